"""A plan for a model on a machine: the configuration with the highest predicted throughput that fits.

`plan_training` / `plan_inference` (offload.estimate.plan_inference) take a model's shape (`ModelShape`:
parameters, largest layer, hidden size, layers, vocabulary, sequence length), a machine profile
(`MachineProfile`: RAM, GPU memory, disk bandwidths, from `ds-nvme-bench --json` or detected) and measured
rates (`ComputeProfile`, offload.estimate.probe). Each candidate - stage, offload devices, micro-batch,
activation checkpointing - is sized by the memory estimator (offload.estimate.formulas, with `max_in_cpu:
"auto"` resolved as the engine resolves it against the pinned budget) and timed by the time model; the
fastest one that fits every memory limit is the plan, printed as a config `load_config` takes, with its
predicted time, what bounds it, and the rejected alternatives.

The time model is offload.estimate.plan_time; this module searches the candidates with it. `plan_training`
weighs the chosen configuration's `offload_optimizer.ratio` and NVMe buffer counts (`_refine`), each
count's staging slots charged to the pinned budget.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from offload.config.zero import OffloadOptimizerConfig

from .errors import EstimateInputError
from .formulas import (
    SwapBufferSettings,
    TrainingSetup,
    valid_combinations,
)
from .machine import MachineProfile
from .plan_time import (
    DTYPE_BYTES,
    Candidate,
    ModelShape,
    Plan,
    disk_seconds,
    pinned_budget_of,
    predict_training,
    training_candidate,
    training_setup,
)
from .probe import ComputeProfile
from .setup import layers
from .units import format_bytes

# The records and the time model live in offload.estimate.plan_time; they are re-exported here, where the
# planner's callers have always found them.
__all__ = [
    "DTYPE_BYTES",
    "Candidate",
    "ModelShape",
    "Plan",
    "choose",
    "disk_seconds",
    "layers",
    "pinned_budget_of",
    "plan_training",
    "predict_training",
]


def _micro_batches(max_micro_batch: int) -> List[int]:
    out, mb = [], 1
    while mb <= max_micro_batch:
        out.append(mb)
        mb *= 2
    return out if out[-1] == max_micro_batch else out + [max_micro_batch]


def _config(
    mode: str, c: Candidate, precision: str, nvme_path: str, sub_group_size: int, optimizer: str = "adam"
) -> Dict[str, Any]:
    """The plan as a config `offload.config.load_config` takes (DeepSpeed's keys)."""
    zo: Dict[str, Any] = {"stage": c.stage}
    if c.stage >= 1:
        zo["sub_group_size"] = sub_group_size
    if c.offload_optimizer != "none":
        oo: Dict[str, Any] = {"device": c.offload_optimizer}
        if c.offload_optimizer == "nvme":
            oo.update(nvme_path=nvme_path, max_in_cpu="auto", buffer_count=c.optimizer_buffer_count)
        if c.ratio != OffloadOptimizerConfig.ratio:
            oo["ratio"] = c.ratio
        zo["offload_optimizer"] = oo
    if c.offload_param != "none":
        op: Dict[str, Any] = {"device": c.offload_param}
        if c.offload_param == "nvme":
            op.update(nvme_path=nvme_path, max_in_cpu="auto", buffer_count=c.param_buffer_count)
        zo["offload_param"] = op
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": c.micro_batch, "zero_optimization": zo}
    # the engine's reports show the prediction beside what it measures
    cfg["zero_offload"] = {"predicted_seconds": round(c.seconds, 6)}
    if mode == "train":
        cfg["gradient_accumulation_steps"] = 1
        name = {"adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "lion": "Lion", "sgd": "SGD"}[
            optimizer
        ]
        cfg["optimizer"] = {"type": name, "params": {"lr": 1e-4}}
    if precision in ("bf16", "fp16"):
        cfg[precision] = {"enabled": True}
    return cfg


def _rank(cands: Sequence[Candidate], best: Candidate) -> List[Tuple[Candidate, str]]:
    """The alternatives and why each lost: the best variant (micro-batch, checkpointing) of every other
    stage and offload choice, then the chosen choice's other variants; fastest first."""

    def why(c: Candidate) -> str:
        if not c.fits:
            return f"does not fit: {c.fit_label}"
        share = c.tokens_per_s / best.tokens_per_s if best.tokens_per_s > 0 else 0.0
        text = f"{c.tokens_per_s:.1f} tokens/s ({share:.2f}x the plan's), bound by {c.bound}"
        if round(share, 3) >= 1.0 and c.staging_bytes > best.staging_bytes:
            text += (
                f"; no faster, and {format_bytes(c.staging_bytes - best.staging_bytes)} more pinned staging"
            )
        elif round(share, 3) >= 1.0 and c.ratio < best.ratio:
            text += "; no faster, and more optimizer state on the device"
        return text

    def key(c: Candidate) -> Tuple[int, str, str]:
        return (c.stage, c.offload_optimizer, c.offload_param)

    per_choice: Dict[Tuple[int, str, str], Candidate] = {}
    for c in cands:
        if key(c) == key(best):
            continue
        old = per_choice.get(key(c))
        if old is None or (c.fits, c.tokens_per_s) > (old.fits, old.tokens_per_s):
            per_choice[key(c)] = c
    variants = [c for c in cands if key(c) == key(best) and c is not best]
    order = sorted(per_choice.values(), key=lambda c: (not c.fits, -c.tokens_per_s))
    order += sorted(variants, key=lambda c: (not c.fits, -c.tokens_per_s))
    return [(c, why(c)) for c in order]


def plan_training(
    shape: ModelShape,
    machine: MachineProfile,
    compute: ComputeProfile,
    *,
    precision: str = "bf16",
    optimizer: str = "adam",
    max_micro_batch: int = 1,
    gpus_per_node: int = 1,
    nvme_path: str = "/local_nvme",
    sub_group_size: int = 100_000_000,
    pinned_budget: Optional[int] = None,
    stages: Sequence[int] = (0, 1, 2, 3),
    offload_optimizer: Optional[str] = None,
    offload_param: Optional[str] = None,
    checkpointing: Optional[bool] = None,
    allow_nvme: bool = True,
) -> Plan:
    """The fastest training configuration that fits (module doc). `max_micro_batch`: micro-batches of 1, 2,
    4, ... up to it are weighed; `stages`, `offload_optimizer`, `offload_param`, `checkpointing` narrow the
    search (None: every choice); `allow_nvme` False leaves NVMe out. Raises EstimateInputError when nothing
    fits."""
    budget = pinned_budget_of(machine, gpus_per_node, pinned_budget)
    bufs = SwapBufferSettings(sub_group_size=sub_group_size)
    combos = valid_combinations(
        None,
        None if offload_optimizer is None else (offload_optimizer,),
        None if offload_param is None else (offload_param,),
    )
    cands: List[Candidate] = []
    for mb in _micro_batches(max(1, int(max_micro_batch))):
        for ckpt in (False, True) if checkpointing is None else (checkpointing,):
            setup = training_setup(shape, mb, ckpt, precision, optimizer, bufs, gpus_per_node)
            for stage, opt, par in combos:
                if stage not in stages or (not allow_nvme and "nvme" in (opt, par)):
                    continue
                cands.append(training_candidate(shape, setup, stage, opt, par, machine, compute, budget))
    args = ("train", cands, machine, compute, budget, precision, nvme_path, sub_group_size, optimizer)
    best = choose(*args).chosen
    setup = training_setup(
        shape, best.micro_batch, best.checkpointing, precision, optimizer, bufs, gpus_per_node
    )
    notes = _refine(cands, best, shape, setup, machine, compute, budget)
    plan = choose(*args)
    return dataclasses.replace(plan, notes=notes + plan.notes)


OPTIMIZER_BUFFER_COUNTS = (1, 2, 4, 8)  # offload_optimizer.buffer_count choices (NVMe)
PARAM_BUFFER_COUNTS = (1, 2, 5, 8)  # offload_param.buffer_count choices (NVMe)
RATIOS = (0.75, 0.5, 0.25)  # offload_optimizer.ratio choices below 1 (a GPU with a device optimizer rate)


def _refine(
    cands: List[Candidate],
    best: Candidate,
    shape: ModelShape,
    setup: TrainingSetup,
    machine: MachineProfile,
    compute: ComputeProfile,
    budget: int,
) -> List[str]:
    """Weigh `best`'s `offload_optimizer.ratio`, then its optimizer and parameter NVMe buffer counts, one
    after the other (each keeps the fastest so far); every variant is appended to `cands`. Returns notes
    on what was not weighed and why."""
    notes: List[str] = []
    stage, opt, par = best.stage, best.offload_optimizer, best.offload_param

    def run(s: TrainingSetup, ratio: float) -> Candidate:
        c = training_candidate(shape, s, stage, opt, par, machine, compute, budget, ratio=ratio)
        cands.append(c)
        return c

    def faster(c: Candidate, than: Candidate) -> bool:
        return c.fits and round(c.tokens_per_s, 9) > round(than.tokens_per_s, 9)

    ratio = best.ratio
    if opt != "none" and machine.cpu_only:
        notes.append(
            "offload_optimizer.ratio stays 1: no GPU, so the device is the host and a device share "
            "would step on the same CPU (no gain)"
        )
    elif opt != "none" and not compute.device_optimizer_elems_per_s:
        notes.append("offload_optimizer.ratio stays 1: the compute profile has no device optimizer rate")
    elif opt != "none":
        for r in RATIOS:
            c = run(setup, r)
            if faster(c, best):
                best, ratio = c, r
    if opt == "nvme":
        chosen = setup
        for k in OPTIMIZER_BUFFER_COUNTS:
            if k == setup.buffers.optimizer_buffer_count:
                continue
            s = dataclasses.replace(
                setup, buffers=dataclasses.replace(setup.buffers, optimizer_buffer_count=k)
            )
            c = run(s, ratio)
            if faster(c, best) or (
                c.fits and c.tokens_per_s >= best.tokens_per_s and c.staging_bytes < best.staging_bytes
            ):
                best, chosen = c, s
        setup = chosen
    if par == "nvme":
        for k in PARAM_BUFFER_COUNTS:
            if k == setup.buffers.param_buffer_count:
                continue
            s = dataclasses.replace(setup, buffers=dataclasses.replace(setup.buffers, param_buffer_count=k))
            run(s, ratio)
    return notes


def choose(
    mode: str,
    cands: List[Candidate],
    machine: MachineProfile,
    compute: ComputeProfile,
    budget: int,
    precision: str,
    nvme_path: str,
    sub_group_size: int,
    optimizer: str = "adam",
) -> Plan:
    """The fastest fitting candidate as a Plan (its config, the rejected ones and why); EstimateInputError
    naming the limits when none fits."""
    fitting = [c for c in cands if c.fits]
    if not fitting:
        worst = "; ".join(sorted({c.fit_label for c in cands}))
        raise EstimateInputError(f"no configuration fits this machine ({worst})")
    # the most tokens per second; on a tie the least offload and the smaller stage
    tier = {"none": 0, "cpu": 1, "nvme": 2}
    best = max(
        fitting,
        key=lambda c: (
            round(c.tokens_per_s, 9),
            -tier[c.offload_param],
            -tier[c.offload_optimizer],
            -c.stage,
            -int(c.checkpointing),
            c.ratio,  # the least optimizer state on the device
            -c.staging_bytes,  # the fewest pinned staging slots
        ),
    )
    notes = []
    if best.checkpointing:
        notes.append(
            "activation checkpointing: turn it on in the model (Hugging Face: "
            "model.gradient_checkpointing_enable(); else zero.checkpointing.checkpoint around each layer)"
        )
    return Plan(
        mode=mode,
        chosen=best,
        config=_config(mode, best, precision, nvme_path, sub_group_size, optimizer),
        rejected=_rank(cands, best),
        machine=machine,
        compute=compute,
        pinned_budget_bytes=budget,
        notes=notes,
    )
