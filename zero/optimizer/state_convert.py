"""Optimizer states from one dtype into another: a checkpoint or state dict saved with fp32 states loaded into
an engine that keeps them in bf16 or int8, and back.

States come as the tier hands them to the update (`offload.swap.slots.StateFormat`): the `n_states` value
tensors, then for int8 one fp32 absmax tensor per state (one scale per QUANT_BLOCK elements, the first
block starting at element 0 of the tensors given). The master is fp32 in every format and never converted.
"""

from __future__ import annotations

import warnings
from typing import List, Sequence

import torch

from offload.swap.slots import StateFormat

__all__ = ["convert_states", "format_of", "is_lossless", "warn_if_lossy"]


def is_lossless(src: str, dst: str) -> bool:
    """Whether states in `src` survive the move into `dst` exactly (same dtype, or into fp32)."""
    return src == dst or dst == "fp32"


def warn_if_lossy(src: str, dst: str, where: str) -> None:
    """A UserWarning when loading `src` states into `dst` rounds them."""
    if not is_lossless(src, dst):
        warnings.warn(
            f"{where}: the optimizer states were saved as {src} and this engine keeps them as {dst}: they "
            f"are rounded to {dst} on loading (precision is lost; the fp32 master is loaded exactly)",
            UserWarning,
            stacklevel=3,
        )


def format_of(states: List[torch.Tensor], n_states: int) -> StateFormat:
    """The format `states` are in (a state dict's list: values, then int8 scales)."""
    dtypes = {t.dtype for t in states[:n_states]}
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "int8"}.get(next(iter(dtypes)))
    fmt = StateFormat(n_states, name or "?") if len(dtypes) == 1 and name else None
    if fmt is None or len(states) != fmt.n_tensors - 1:
        got = [str(t.dtype) for t in states]
        raise ValueError(f"optimizer states of dtypes {got} are not {n_states} fp32, bf16 or int8 states")
    return fmt


def _values(states: List[torch.Tensor], fmt: StateFormat, signed: Sequence[bool]) -> List[torch.Tensor]:
    """The states as fp32 values (int8: dequantized with their absmax)."""
    if not fmt.quantized:
        return [t.float() for t in states]
    from offload import ops

    codes, scales = states[: fmt.n_states], states[fmt.n_states :]
    return [ops.dequantize_blockwise(q, a, sg).float() for q, a, sg in zip(codes, scales, signed)]


def convert_states(
    states: List[torch.Tensor], src: StateFormat, dst: StateFormat, signed: Sequence[bool]
) -> List[torch.Tensor]:
    """`states` in `src`'s format (host tensors of one chunk, or of a whole partition) as new tensors in
    `dst`'s: cast between fp32 and bf16 (round to nearest), block-quantized to or from int8 (`signed`: per
    state, whether its codes are signed, `UpdateRule.signed`)."""
    if src.n_states != dst.n_states:
        raise ValueError(f"optimizer states: {src.n_states} saved, this optimizer keeps {dst.n_states}")
    if src.dtype == dst.dtype:
        return [t.clone() for t in states]
    values = _values(states, src, signed)
    if dst.dtype == "fp32":
        return values
    if dst.dtype == "bf16":
        return [v.to(torch.bfloat16) for v in values]
    from offload import ops

    pairs = [ops.quantize_blockwise(v.contiguous(), sg) for v, sg in zip(values, signed)]
    return [q for q, _ in pairs] + [a for _, a in pairs]
