"""ds-estimate-memory: will it fit, and where? Bytes per GPU, per node's host memory and NVMe for every
ZeRO stage and offload choice, with a breakdown; --fit checks this machine and recommends one.

Bad input prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple, Union

from offload.cli.estimate_args import PROG, build_parser
from offload.cli.pipe import quiet_broken_pipe
from offload.cli.plan_args import run_plan
from offload.config.zero import OffloadOptimizerConfig
from offload.estimate.activations import ActivationSettings
from offload.estimate.counting import (
    count_parameters,
    hf_activation_shape,
    hf_config_path,
    load_model_on_meta,
    read_json_file,
)
from offload.estimate.deepspeed_compat import deepspeed_rows
from offload.estimate.ds_config import ConfigChoices, read_ds_config
from offload.estimate.errors import EstimateInputError
from offload.estimate.formulas import estimate_all, largest_layer_heuristic
from offload.estimate.inference import (
    InferenceSetup,
    estimate_inference,
    inference_choices,
    kv_cache_shape,
    render_inference,
    unit_numels,
)
from offload.estimate.machine import (
    MachineProfile,
    check_fit,
    detect_machine,
    load_machine_profile,
    recommend,
)
from offload.estimate.placement import (
    OFFLOAD_DEVICES,
    OPTIMIZER_STATES_PER_PARAM,
    STAGES,
    check_combination,
)
from offload.estimate.report import deepspeed_json, estimates_json, render_deepspeed, render_estimates
from offload.estimate.result import MemoryEstimate
from offload.estimate.setup import SwapBufferSettings, TrainingSetup, layers
from offload.estimate.split import apply_split, resolve_max_in_cpu
from offload.estimate.units import format_bytes, format_count
from offload.pinned import PINNED_BUDGET_ENV, automatic_pinned_budget, default_pinned_budget

HEURISTIC_SOURCE = "heuristic; pass --largest-layer for the exact value"
EXIT_BAD_INPUT = 2


def _model_sizes(args: argparse.Namespace) -> Tuple[int, int, str]:
    """(params, largest layer, where the largest layer came from)."""
    if args.model is not None and args.params is not None:
        raise EstimateInputError("give either --params or --model, not both")
    if args.model is None and args.params is None:
        raise EstimateInputError("give the model size: --params 7B (with --largest-layer) or --model PATH")
    if args.model is not None:
        counted = count_parameters(load_model_on_meta(args.model))
        if counted.params == 0:
            raise EstimateInputError(f"--model {args.model}: the model has no parameters")
        if args.largest_layer is not None:
            return counted.params, args.largest_layer, "given"
        name = f"module {counted.largest_layer_name!r}" if counted.largest_layer_name else "the root module"
        return counted.params, counted.largest_layer_params, f"counted: {name}"
    if args.largest_layer is not None:
        if args.largest_layer > args.params:
            raise EstimateInputError(f"--largest-layer {args.largest_layer} exceeds --params {args.params}")
        return args.params, args.largest_layer, "given"
    return (
        args.params,
        largest_layer_heuristic(args.params),
        HEURISTIC_SOURCE,
    )


def _activation_settings(
    args: argparse.Namespace, config: Optional[ConfigChoices]
) -> Optional[ActivationSettings]:
    batch = args.batch_size if args.batch_size is not None else (config.micro_batch_size if config else None)
    shape_flags = (args.hidden_size, args.num_layers, args.num_heads, args.vocab_size)
    if args.seq_len is None:
        if (
            args.batch_size is not None
            or any(v is not None for v in shape_flags)
            or args.activation_checkpointing
            or args.checkpoint_device is not None
        ):
            raise EstimateInputError("activation flags need --seq-len (and --batch-size)")
        return None
    if batch is None:
        raise EstimateInputError(
            "--seq-len needs --batch-size (or train_micro_batch_size_per_gpu in --config)"
        )
    shape = hf_activation_shape(args.model) if args.model else {}
    for key in ("hidden_size", "num_layers", "num_heads", "vocab_size"):
        value = getattr(args, key)
        if value is not None:
            shape[key] = value
    device = args.checkpoint_device or (config.checkpoint_device if config else None) or "none"
    missing = [f"--{k.replace('_', '-')}" for k in ("hidden_size", "num_layers") if k not in shape]
    if missing:
        raise EstimateInputError(f"activations need {' and '.join(missing)} (or --model with a config.json)")
    return ActivationSettings(
        batch_size=batch,
        seq_len=args.seq_len,
        hidden_size=shape["hidden_size"],
        num_layers=shape["num_layers"],
        checkpointing=args.activation_checkpointing or device != "none",
        checkpoint_device=device,
        attention=args.attention,
        num_heads=shape.get("num_heads"),
        vocab_size=shape.get("vocab_size"),
    )


def _buffers(args: argparse.Namespace, config: Optional[ConfigChoices]) -> SwapBufferSettings:
    values = dict(config.buffers) if config else {}
    for flag, name in (
        ("buffer_count", "optimizer_buffer_count"),
        ("sub_group_size", "sub_group_size"),
        ("param_buffer_count", "param_buffer_count"),
        ("param_buffer_size", "param_buffer_size"),
        ("param_max_in_cpu", "param_max_in_cpu"),
    ):
        if getattr(args, flag) is not None:
            values[name] = getattr(args, flag)
    if args.no_pin_memory:
        values["optimizer_pin_memory"] = False
        values["param_pin_memory"] = False
    if args.nvme_copies is not None:
        values["optimizer_nvme_copies"] = "auto" if args.nvme_copies == "auto" else int(args.nvme_copies)
    return SwapBufferSettings(**values)  # type: ignore[arg-type]


def _choices(
    args: argparse.Namespace, config: Optional[ConfigChoices]
) -> Tuple[List[int], List[str], List[str]]:
    """The stages and offload devices to print: the flag, else the config, else all."""

    def pick(flag, from_config, everything):
        if flag is not None:
            return [flag]
        if from_config is not None:
            return [from_config]
        return list(everything)

    stages = pick(args.stage, config.stage if config else None, STAGES)
    opts = pick(args.offload_optimizer, config.offload_optimizer if config else None, OFFLOAD_DEVICES)
    pars = pick(args.offload_param, config.offload_param if config else None, OFFLOAD_DEVICES)
    return stages, opts, pars


def _first_reason(stages: Sequence[int], opts: Sequence[str], pars: Sequence[str]) -> str:
    for stage in stages:
        for opt in opts:
            for par in pars:
                try:
                    check_combination(stage, opt, par)
                except EstimateInputError as exc:
                    return str(exc)
    return "no valid combination"  # pragma: no cover - only reached when a valid one exists


def _machine(args: argparse.Namespace) -> MachineProfile:
    detected = detect_machine(args.nvme_path)
    if args.machine_profile:
        return load_machine_profile(args.machine_profile).merged_over(detected)
    return detected


def _max_in_cpu(args: argparse.Namespace, config: Optional[ConfigChoices]) -> Union[int, str]:
    """--max-in-cpu, else the --config's offload_optimizer.max_in_cpu, else the engine's default."""
    if args.max_in_cpu is not None:
        return args.max_in_cpu
    if config is not None and config.optimizer_max_in_cpu is not None:
        return config.optimizer_max_in_cpu
    return OffloadOptimizerConfig.max_in_cpu


def _pinned_budget(
    args: argparse.Namespace, config: Optional[ConfigChoices], machine: Optional[MachineProfile]
) -> int:
    """One rank's pinned budget, as the engine sets it (offload.pinned.default_pinned_budget): the config's
    zero_offload.pinned_budget_bytes, else $ZERO_OFFLOAD_PINNED_BUDGET, else half of this machine's memory
    (or the --machine-profile's ram_bytes) over --gpus-per-node ranks."""
    if (config is not None and config.pinned_budget_bytes is not None) or os.environ.get(PINNED_BUDGET_ENV):
        return default_pinned_budget(config.pinned_budget_bytes if config is not None else None)
    given = machine is not None and "ram_bytes" in machine.sources and args.machine_profile
    return automatic_pinned_budget(
        physical=machine.ram_bytes if given and machine is not None else None,
        environ={"LOCAL_WORLD_SIZE": str(args.gpus_per_node)},
    )


def _with_note(est: MemoryEstimate, max_in_cpu: Union[int, str], kept: int, budget: int) -> MemoryEstimate:
    if max_in_cpu != "auto" or est.offload_optimizer != "nvme":
        return est
    note = (
        f"max_in_cpu=auto: {format_count(kept)} optimizer-state elements per rank in pinned host memory, "
        f"the rest on NVMe: what fits in a pinned budget of {format_bytes(budget)} per rank after the other "
        "pinned buffers, as the engine places it (--max-in-cpu 0: all on NVMe)"
    )
    return dataclasses.replace(est, notes=(*est.notes, note))


def _resolve_param_max_in_cpu(setup: TrainingSetup, budget: int) -> TrainingSetup:
    """`setup` with offload_param.max_in_cpu "auto" resolved as the engine resolves it: the elements of one
    rank's partitions (the largest layer's size each) that fit in its pinned `budget`."""
    n = setup.world_size
    parts = layers(math.ceil(setup.params / n), math.ceil(setup.largest_layer_params / n))
    kept = setup.buffers.param_in_cpu(parts, setup.compute_bytes, budget)
    return dataclasses.replace(setup, buffers=dataclasses.replace(setup.buffers, param_max_in_cpu=kept))


def _with_param_note(est: MemoryEstimate, kept: Union[int, str]) -> MemoryEstimate:
    if est.offload_param != "nvme":
        return est
    note = (
        f"offload_param max_in_cpu=auto: {format_count(int(kept))} parameter elements per rank in host "
        "memory, the rest on NVMe: what fits in the pinned budget, as the engine places it "
        "(--param-max-in-cpu 0: all on NVMe)"
    )
    return dataclasses.replace(est, notes=(*est.notes, note))


def run(argv: Optional[Sequence[str]] = None) -> str:
    """Parse argv and return the text to print; raises EstimateInputError on bad input."""
    args = build_parser().parse_args(argv)
    config = read_ds_config(args.config) if args.config else None
    if args.plan:
        return run_plan(args, config, _model_sizes, _machine, _pinned_budget)
    if args.inference:
        return _run_inference(args, config)
    stages, opts, pars = _choices(args, config)

    if args.deepspeed_compat:
        params, largest, _ = _model_sizes(args)
        rows = deepspeed_rows(
            params,
            largest,
            args.gpus_per_node,
            args.nodes,
            args.additional_buffer_factor,
            stages=None if len(stages) == len(STAGES) else stages,
            offload_optimizers=opts,
            offload_params=pars,
        )
        if not rows:
            raise EstimateInputError(
                "DeepSpeed's estimator has no row for these choices (it covers stages 1-3 with "
                "offload none or cpu; stage 0 and NVMe are ours only)"
            )
        if args.json:
            return json.dumps(deepspeed_json(rows, params, largest, args.additional_buffer_factor), indent=2)
        return render_deepspeed(
            rows, params, largest, args.gpus_per_node, args.nodes, args.additional_buffer_factor
        )

    params, largest, source = _model_sizes(args)
    precision = args.precision or (config.precision if config else None) or "bf16"
    optimizer = args.optimizer or (config.optimizer if config else None) or "adam"
    if optimizer not in OPTIMIZER_STATES_PER_PARAM:
        raise EstimateInputError(
            f"--config {config.path if config else ''}: optimizer.type {optimizer!r} is not one the "
            f"estimator knows ({', '.join(sorted(OPTIMIZER_STATES_PER_PARAM))}); pass --optimizer"
        )
    setup = TrainingSetup(
        params=params,
        largest_layer_params=largest,
        gpus_per_node=args.gpus_per_node,
        nodes=args.nodes,
        precision=precision,
        optimizer=optimizer,
        optimizer_state_dtype=args.optimizer_state_dtype
        or (config.optimizer_state_dtype if config else None)
        or "fp32",
        buffers=_buffers(args, config),
        activations=_activation_settings(args, config),
    )
    checks = machine = recommended = None
    if args.fit or args.machine_profile:
        machine = _machine(args)
    param_auto = setup.buffers.param_max_in_cpu == "auto" and "nvme" in pars and 3 in stages
    if param_auto:
        setup = _resolve_param_max_in_cpu(setup, _pinned_budget(args, config, machine))
    estimates: List[MemoryEstimate] = estimate_all(setup, stages, opts, pars)
    if not estimates:
        raise EstimateInputError(_first_reason(stages, opts, pars))
    max_in_cpu = _max_in_cpu(args, config)
    budget = _pinned_budget(args, config, machine) if max_in_cpu == "auto" else 0
    split = []
    for e in estimates:
        kept = resolve_max_in_cpu(e, setup, args.ratio, max_in_cpu, budget)
        cpu_only = machine is not None and machine.cpu_only
        split.append(
            _with_note(apply_split(e, setup, args.ratio, kept, cpu_only=cpu_only), max_in_cpu, kept, budget)
        )
    estimates = split
    if param_auto:
        estimates = [_with_param_note(e, setup.buffers.param_max_in_cpu) for e in estimates]
    if machine is not None:
        checks = [check_fit(est, machine, args.gpus_per_node) for est in estimates]
        recommended = recommend(estimates, checks)
    if args.json:
        return json.dumps(estimates_json(setup, estimates, source, checks, machine, recommended), indent=2)
    return render_estimates(setup, estimates, source, checks, machine, recommended)


def _inference_units(args: argparse.Namespace) -> Tuple[List[int], Dict[str, object]]:
    """(the stage-3 units, the model's config.json or {}): counted on the meta device with --model; with
    --params, units of --largest-layer elements (the heuristic's without it) and one with the rest."""
    if args.model is not None and args.params is not None:
        raise EstimateInputError("give either --params or --model, not both")
    if args.model is not None:
        units = unit_numels(load_model_on_meta(args.model))
        path = hf_config_path(args.model)
        hf = read_json_file(path, "--model") if path else {}
        return units, hf if isinstance(hf, dict) else {}
    params, largest, _ = _model_sizes(args)
    whole, rest = divmod(params, largest)
    return [largest] * whole + ([rest] if rest else []), {}


def _run_inference(args: argparse.Namespace, config: Optional[ConfigChoices]) -> str:
    """--inference: one estimate per offload_param choice (the flag, else the config's, else all three)."""
    if args.offload_optimizer is not None or args.optimizer is not None:
        raise EstimateInputError(
            "--inference has no optimizer: leave out --offload-optimizer and --optimizer"
        )
    if args.stage not in (None, 3) or (config is not None and config.stage not in (None, 3)):
        raise EstimateInputError("--inference estimates stage 3 (weights streamed from offload_param)")
    units, hf = _inference_units(args)
    extra = inference_choices(args.config)
    if args.weight_bits is not None:
        extra["weight_bits"] = args.weight_bits
    if args.weight_group_size is not None:
        extra["group_size"] = args.weight_group_size
    kv = None
    if args.seq_len is not None:
        shape = dict(hf)
        for key, flag in (
            ("num_hidden_layers", args.num_layers),
            ("num_attention_heads", args.num_heads),
            ("hidden_size", args.hidden_size),
            ("num_key_value_heads", args.kv_heads),
            ("head_dim", args.head_dim),
        ):
            if flag is not None:
                shape[key] = flag
        kv = kv_cache_shape(shape, "--model" if hf else "--num-layers/--num-heads/--hidden-size")
    batch = args.batch_size if args.batch_size is not None else (config.micro_batch_size if config else None)
    if args.seq_len is not None and batch is None:
        raise EstimateInputError(
            "--seq-len needs --batch-size (or train_micro_batch_size_per_gpu in --config)"
        )
    precision = args.precision or (config.precision if config else None) or "bf16"
    tiers = [args.offload_param] if args.offload_param else None
    if tiers is None:
        tiers = [config.offload_param] if config and config.offload_param else ["none", "cpu", "nvme"]
    buffers = _buffers(args, config)
    budget = None
    if buffers.param_max_in_cpu == "auto" and "nvme" in tiers:
        budget = _pinned_budget(args, config, _machine(args) if args.machine_profile else None)
    estimates = [
        estimate_inference(
            InferenceSetup(
                units=tuple(units),
                precision=precision,
                offload_param=tier,
                buffers=buffers,
                pinned_budget=budget,
                world_size=args.gpus_per_node * args.nodes,
                batch_size=batch if kv is not None else None,
                seq_len=args.seq_len,
                kv=kv,
                **extra,  # type: ignore[arg-type]
            )
        )
        for tier in tiers
    ]
    params = sum(units)
    header = [
        f"Inference (no optimizer), stage 3: {format_count(params)} params in {len(units)} units, largest "
        f"{format_count(max(units))}, {precision}, {args.gpus_per_node * args.nodes} rank(s); bytes per rank",
        "KV cache: "
        + (
            f"batch {batch} x {args.seq_len} positions, {kv.num_layers} layers x {kv.num_kv_heads} kv "
            f"heads x head dim {kv.head_dim}"
            if kv is not None
            else "not counted (give --batch-size and --seq-len)"
        ),
    ]
    if args.json:
        return json.dumps(
            {"params": params, "units": len(units), "rows": [e.to_dict() for e in estimates]}, indent=2
        )
    return render_inference(estimates, header)


@quiet_broken_pipe
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `ds-estimate-memory` with `argv`; returns the process exit code."""
    try:
        text = run(argv)
    except EstimateInputError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
