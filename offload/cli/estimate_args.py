"""The command line of ds-estimate-memory (offload.cli.estimate_memory): its options, their checks and one
line of error for bad input."""

from __future__ import annotations

import argparse
import math
from typing import Callable

from offload.cli.plan_args import add_plan_arguments
from offload.config.zero import OffloadOptimizerConfig, OffloadParamConfig
from offload.estimate.deepspeed_compat import DEFAULT_ADDITIONAL_BUFFER_FACTOR
from offload.estimate.errors import EstimateInputError
from offload.estimate.placement import (
    OFFLOAD_DEVICES,
    OPTIMIZER_STATES_PER_PARAM,
    PRECISIONS,
    STATE_DTYPE_BYTES,
)
from offload.estimate.units import parse_count

__all__ = ["PROG", "build_parser"]

PROG = "ds-estimate-memory"


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; we want the error alone, on one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Raise EstimateInputError with argparse's message (printed as one line by main)."""
        raise EstimateInputError(message)


# argparse turns a type function's ValueError into a vague "invalid value"; ArgumentTypeError keeps our text.
def _count_or_zero(what: str):
    count = _count(what)

    def parse(text: str) -> int:
        return 0 if text.strip() in ("0", "0.0", "0e0") else count(text)

    return parse


def _auto_or(parse):
    def auto_or(text: str):
        return "auto" if text.strip().lower() == "auto" else parse(text)

    return auto_or


def _count(what: str):
    def parse(text: str) -> int:
        try:
            return parse_count(text, what)
        except EstimateInputError as exc:
            # argparse already names the flag: "argument --params: must be positive, got '-5'"
            raise argparse.ArgumentTypeError(
                str(exc).replace(what + ": ", "").replace(what + " ", "")
            ) from None

    return parse


def _positive(convert: Callable[[str], float], kind: str) -> Callable[[str], float]:
    """An argparse type: `text` converted, finite and above zero, else "must be a positive {kind}"."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a positive {kind}, got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a positive {kind}, got {text!r}")
        return value

    return parse


_positive_int = _positive(int, "integer")
_positive_float = _positive(float, "number")


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"--ratio must be a number in [0, 1], got {text!r}")
    return value


def _stage(text: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"must be 0, 1, 2 or 3, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `ds-estimate-memory`."""
    parser = _OneLineParser(
        prog=PROG,
        description="Estimate training memory per GPU, per node's CPU memory and per node's NVMe for "
        "ZeRO stages 0-3 with CPU/NVMe offload. Omitted choices: every valid combination is printed.",
        epilog="Sizes accept 7.5e9, 7.5B, 350M, 1.3b, 125k. See docs/estimator.md.",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--params", type=_count("--params"), help="total parameters, e.g. 7.5B")
    model.add_argument(
        "--largest-layer",
        type=_count("--largest-layer"),
        help="parameters of the largest single module (default with --params: a conservative heuristic)",
    )
    model.add_argument(
        "--model",
        help="a Hugging Face config.json (or its folder; needs transformers) or module:callable returning "
        "an nn.Module; built on the meta device, nothing allocated",
    )

    hw = parser.add_argument_group("hardware")
    hw.add_argument(
        "--gpus-per-node",
        type=_positive_int,
        default=1,
        help="ranks (GPUs) per node, sharing its host memory and NVMe (default 1; on a machine without a "
        "GPU: training processes per node)",
    )
    hw.add_argument(
        "--nodes",
        type=_positive_int,
        default=1,
        help="nodes; ZeRO partitions over all gpus-per-node x nodes ranks (default 1)",
    )

    zero = parser.add_argument_group("ZeRO (omitted: every valid choice)")
    zero.add_argument("--stage", type=_stage, help="0, 1, 2 or 3")
    zero.add_argument("--offload-optimizer", choices=OFFLOAD_DEVICES)
    zero.add_argument("--offload-param", choices=OFFLOAD_DEVICES, help="stage 3 only")
    zero.add_argument("--config", help="DeepSpeed-style ds_config.json: stage, offload and buffer settings")
    zero.add_argument(
        "--sub-group-size", type=_count("--sub-group-size"), help="elements per optimizer sub-group"
    )
    zero.add_argument("--buffer-count", type=_positive_int, help="offload_optimizer.buffer_count (NVMe)")
    zero.add_argument("--param-buffer-count", type=_positive_int, help="offload_param.buffer_count")
    zero.add_argument(
        "--param-buffer-size", type=_count("--param-buffer-size"), help="offload_param.buffer_size"
    )
    zero.add_argument(
        "--param-max-in-cpu",
        type=_auto_or(_count_or_zero("--param-max-in-cpu")),
        help="offload_param.max_in_cpu: parameter elements per rank kept in host memory with offload_param "
        f"nvme; 0: every partition on NVMe (default: the --config's, else the engine's "
        f"{OffloadParamConfig.max_in_cpu!r}: what fits in this machine's pinned budget, as the engine "
        "resolves it)",
    )
    zero.add_argument(
        "--max-in-cpu",
        type=_auto_or(_count_or_zero("--max-in-cpu")),
        help="offload_optimizer.max_in_cpu: optimizer-state elements per rank kept in pinned host "
        f"memory with offload_optimizer nvme; 0: every sub-group on NVMe (default: the --config's, else "
        f"the engine's {OffloadOptimizerConfig.max_in_cpu!r}: what fits in this machine's pinned budget, "
        "as the engine resolves it)",
    )
    zero.add_argument(
        "--ratio",
        type=_ratio,
        default=1.0,
        help="offload_optimizer.ratio: share of the optimizer state on the offload tier, the rest on the GPU",
    )
    zero.add_argument(
        "--no-pin-memory", action="store_true", help="offloaded states in pageable host memory (not pinned)"
    )
    zero.add_argument(
        "--nvme-copies",
        choices=("auto", "1", "2"),
        help="offload_optimizer.nvme_copies: copies of the NVMe optimizer state (default auto: two when "
        "--nvme-path has room with --fit, else counted as two)",
    )

    train = parser.add_argument_group("training")
    train.add_argument(
        "--precision", choices=PRECISIONS, help="bf16/fp16 mixed precision or fp32 (default bf16)"
    )
    train.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES_PER_PARAM), help="default adam")
    train.add_argument(
        "--optimizer-state-dtype",
        choices=sorted(STATE_DTYPE_BYTES),
        help="optimizer.params.state_dtype (default: the --config's, else fp32): master + states are 12 "
        "(fp32), 8 (bf16) or 6 + scales (int8) bytes per parameter for Adam",
    )

    act = parser.add_argument_group("activations (counted when --batch-size and --seq-len are given)")
    act.add_argument("--batch-size", type=_positive_int, help="micro-batch per GPU")
    act.add_argument("--seq-len", type=_positive_int)
    act.add_argument("--hidden-size", type=_positive_int)
    act.add_argument("--num-layers", type=_positive_int)
    act.add_argument("--num-heads", type=_positive_int)
    act.add_argument("--vocab-size", type=_positive_int, help="adds the logits")
    act.add_argument("--attention", choices=("flash", "eager"), default="flash")
    act.add_argument("--activation-checkpointing", action="store_true")
    act.add_argument(
        "--checkpoint-device",
        choices=("none", "cpu", "nvme"),
        help="where checkpoints wait for the backward (activation_checkpointing.offload_device; implies"
        " --activation-checkpointing; default: the --config's section, else none)",
    )

    inf = parser.add_argument_group(
        "inference (--inference: an engine without an optimizer; --seq-len: prompt plus new tokens)"
    )
    inf.add_argument(
        "--inference",
        action="store_true",
        help="estimate ZeRO-Inference: weights per tier, gathered layer, prefetch buffers and KV cache",
    )
    inf.add_argument("--kv-heads", type=_positive_int, help="key/value heads (default: heads)")
    inf.add_argument("--head-dim", type=_positive_int, help="default hidden size / heads")
    inf.add_argument(
        "--weight-bits",
        type=int,
        choices=(4, 8),
        help="quantized weights (weight_quantization.quantized_initialization.num_bits)",
    )
    inf.add_argument("--weight-group-size", type=_positive_int, help="quantization group (64)")

    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument(
        "--deepspeed-compat",
        action="store_true",
        help="print DeepSpeed's own estimate (estimate_zero2/zero3_model_states_mem_needs_all_cold)",
    )
    out.add_argument(
        "--additional-buffer-factor",
        type=_positive_float,
        default=DEFAULT_ADDITIONAL_BUFFER_FACTOR,
        help="DeepSpeed's host-memory factor, for --deepspeed-compat (default 1.5)",
    )
    out.add_argument("--fit", action="store_true", help="check which configurations fit this machine")
    out.add_argument("--nvme-path", default=".", help="where swap files would go, for --fit (default .)")
    out.add_argument(
        "--machine-profile",
        help="machine profile JSON (ram_bytes, gpu_bytes, nvme_free_bytes, nvme_read_gbps, nvme_write_gbps); "
        "implies --fit and predicts each step's NVMe I/O time",
    )
    add_plan_arguments(parser)
    return parser
