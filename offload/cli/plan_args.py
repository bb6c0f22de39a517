"""`ds-estimate-memory --plan`: the arguments and the run of the planner (offload.estimate.plan).

    ds-estimate-memory --plan --model config.json --seq-len 2048 --batch-size 8 \\
        --machine-profile profile.json [--compute-profile rates.json] [--inference] [--json]

The model's shape comes from `--model` (a Hugging Face config.json or a module factory) or from `--params`,
`--largest-layer`, `--hidden-size`, `--num-layers`, `--vocab-size`; `--batch-size` is the largest micro-batch
weighed (inference: the batch). The machine is detected and overlaid with `--machine-profile` (what
`ds-nvme-bench --json` writes: the disk's bandwidths); the rates are probed here in a few seconds unless
`--compute-profile` gives them (a JSON of `ComputeProfile.to_dict()`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Dict, Optional

from offload.estimate.counting import hf_activation_shape, read_json_file
from offload.estimate.ds_config import ConfigChoices
from offload.estimate.errors import EstimateInputError
from offload.estimate.machine import MachineProfile
from offload.estimate.plan import ModelShape, Plan, plan_training
from offload.estimate.plan_inference import plan_inference
from offload.estimate.probe import ComputeProfile, load_compute_profile, probe_machine

__all__ = ["add_plan_arguments", "run_plan"]


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` argument group of ds-estimate-memory."""
    g = parser.add_argument_group("plan")
    g.add_argument(
        "--plan",
        action="store_true",
        help="pick the fastest configuration that fits and print it as a loadable config, with the predicted "
        "step (or forward) time and what bounds it",
    )
    g.add_argument(
        "--compute-profile",
        metavar="FILE",
        help="measured rates (ComputeProfile JSON) instead of probing this machine",
    )
    g.add_argument("--save-compute-profile", metavar="FILE", help="write the probed rates as JSON")


def _shape(args: argparse.Namespace, params: int, largest: int) -> ModelShape:
    shape: Dict[str, int] = hf_activation_shape(args.model) if args.model else {}
    for key in ("hidden_size", "num_layers", "num_heads", "vocab_size"):
        value = getattr(args, key)
        if value is not None:
            shape[key] = value
    missing = [f"--{k.replace('_', '-')}" for k in ("hidden_size", "num_layers") if k not in shape]
    if args.seq_len is None:
        missing.insert(0, "--seq-len")
    if missing:
        raise EstimateInputError(f"--plan needs {', '.join(missing)} (or --model with a config.json)")
    return ModelShape(
        params=params,
        largest_layer_params=largest,
        hidden_size=shape["hidden_size"],
        num_layers=shape["num_layers"],
        seq_len=args.seq_len,
        vocab_size=shape.get("vocab_size", 0),
        num_heads=shape.get("num_heads"),
    )


def _compute(args: argparse.Namespace, shape: ModelShape, precision: str, batch: int) -> ComputeProfile:
    if args.compute_profile:
        data = read_json_file(args.compute_profile, "--compute-profile")
        if not isinstance(data, dict):
            raise EstimateInputError(f"--compute-profile {args.compute_profile}: expected a JSON object")
        try:
            return load_compute_profile(data)
        except ValueError as exc:
            raise EstimateInputError(f"--compute-profile {args.compute_profile}: {exc}") from None
    profile = probe_machine(
        tokens=batch * shape.seq_len,
        hidden=shape.hidden_size,
        dtype=precision,
        seq_len=None if args.inference else shape.seq_len,
        heads=shape.num_heads,
    )
    if args.save_compute_profile:
        with open(args.save_compute_profile, "w", encoding="utf-8") as f:
            json.dump(profile.to_dict(), f, indent=2)
    return profile


def run_plan(
    args: argparse.Namespace,
    config: Optional[ConfigChoices],
    sizes: Callable[[argparse.Namespace], Any],
    machine: Callable[[argparse.Namespace], MachineProfile],
    pinned_budget: Callable[[argparse.Namespace, Optional[ConfigChoices], Optional[MachineProfile]], int],
) -> str:
    """The plan's text (or JSON with --json). `sizes`, `machine`, `pinned_budget`: ds-estimate-memory's
    readings of the model's size, the machine and the pinned budget."""
    params, largest, _ = sizes(args)
    shape = _shape(args, params, largest)
    precision = args.precision or (config.precision if config else None) or "bf16"
    batch = args.batch_size or (config.micro_batch_size if config else None) or 1
    mach = machine(args)
    budget = pinned_budget(args, config, mach)
    compute = _compute(args, shape, precision, batch)
    nvme_path = args.nvme_path if args.nvme_path != "." else "/local_nvme"
    plan: Plan
    if args.inference:
        plan = plan_inference(
            shape,
            mach,
            compute,
            precision=precision,
            batch_size=batch,
            nvme_path=nvme_path,
            pinned_budget=budget,
        )
    else:
        plan = plan_training(
            shape,
            mach,
            compute,
            precision=precision,
            optimizer=args.optimizer or (config.optimizer if config else None) or "adam",
            max_micro_batch=batch,
            gpus_per_node=args.gpus_per_node,
            nvme_path=nvme_path,
            pinned_budget=budget,
            stages=(args.stage,) if args.stage is not None else (0, 1, 2, 3),
            offload_optimizer=args.offload_optimizer,
            offload_param=args.offload_param,
            checkpointing=True if args.activation_checkpointing else None,
        )
    if args.json:
        return json.dumps(plan.to_dict(), indent=2)
    return (
        plan.format()
        + "\n\nConfig (offload.config.load_config / zero.initialize take it as it is):\n"
        + json.dumps(plan.config, indent=2)
    )
