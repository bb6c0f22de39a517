"""Sizing the pinned staging slots through which the optimizer state streams to and from NVMe, and the
byte layout of one chunk of optimizer state in whatever dtype its states live in (`StateFormat`).

Torch-free, so the memory estimator (offload/estimate) sizes slots with the same functions the engine
uses. A slot holds master + optimizer states of one chunk of the partition, padded to the swap alignment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from offload.swap.space import align_up

__all__ = [
    "FP32_BYTES",
    "MIN_SLOT_NUMEL",
    "QUANT_BLOCK",
    "STATE_DTYPES",
    "StateFormat",
    "plan_slot_numel",
    "slot_bytes",
    "state_chunk",
    "swap_chunk",
]

FP32_BYTES = 4
# Below this many elements a staging slot is mostly per-request overhead: the smallest piece a sub-group is
# cut into when the pinned budget is tight.
MIN_SLOT_NUMEL = 4096
# Optimizer-state dtypes: bytes per element of each state tensor (the fp32 master is always 4).
STATE_DTYPES = {"fp32": 4, "bf16": 2, "int8": 1}
# Elements per absmax scale of int8 (block-quantized) states; chunks of int8 state start at multiples of it.
QUANT_BLOCK = 2048
# Byte alignment of each tensor inside a chunk's region (any dtype's view of it is aligned).
PART_ALIGN = 64


@dataclass(frozen=True)
class StateFormat:
    """How one chunk of optimizer state is laid out: the fp32 master, `n_states` state tensors in `dtype`
    ("fp32", "bf16" or "int8"), and for int8 one fp32 absmax per QUANT_BLOCK elements of each state."""

    n_states: int
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.dtype not in STATE_DTYPES:
            raise ValueError(f"state dtype must be one of {sorted(STATE_DTYPES)}, got {self.dtype!r}")

    @property
    def quantized(self) -> bool:
        """Whether the states carry per-block absmax scales (int8)."""
        return self.dtype == "int8"

    @property
    def state_element_bytes(self) -> int:
        """Bytes per optimizer-state element in this format's dtype."""
        return STATE_DTYPES[self.dtype]

    @property
    def n_tensors(self) -> int:
        """Tensors a chunk hands to the update: master, states, and (int8) one absmax per state."""
        return 1 + self.n_states * (2 if self.quantized else 1)

    def bytes_per_element(self) -> float:
        """Bytes of master + states per parameter (int8: with its absmax scales)."""
        scales = self.n_states * FP32_BYTES / QUANT_BLOCK if self.quantized else 0.0
        return FP32_BYTES + self.n_states * self.state_element_bytes + scales

    def parts(self, n: int) -> List[Tuple[str, int, int]]:
        """(dtype, numel, byte offset) of each tensor of an n-element chunk: master, states, scales."""
        spec = [("fp32", n)] + [(self.dtype, n)] * self.n_states
        if self.quantized:
            spec += [("fp32", -(-n // QUANT_BLOCK))] * self.n_states
        out, off = [], 0
        for dtype, numel in spec:
            out.append((dtype, numel, off))
            off = align_up(off + numel * STATE_DTYPES[dtype], PART_ALIGN)
        return out

    def chunk_bytes(self, n: int) -> int:
        """Bytes of an n-element chunk's region before the swap alignment (the last tensor unpadded)."""
        dtype, numel, off = self.parts(n)[-1]
        return off + numel * STATE_DTYPES[dtype]

    def whole_bytes(self, n: int) -> int:
        """Bytes of master + states of n elements stored tensor after tensor (checkpoints, host tiers)."""
        return sum(numel * STATE_DTYPES[d] for d, numel, _ in self.parts(n))


def slot_bytes(chunk_numel: int, n_states: int, alignment: int, state_dtype: str = "fp32") -> int:
    """Pinned bytes one staging slot needs for a chunk of `chunk_numel` elements (master + n_states)."""
    return align_up(StateFormat(n_states, state_dtype).chunk_bytes(chunk_numel), alignment)


def swap_chunk(sub_group: int, part: int, state_bytes: int) -> int:
    """Elements per staging slot for DeepSpeed's staging memory: buffer_count x sub_group x 4 bytes, split
    into buffer_count slots that each hold master + states (`state_bytes` per element) of one chunk of
    sub_group / (1 + states) elements, so that buffer_count chunks can be in flight at once."""
    sub = min(sub_group, part)
    arrays = 1 + state_bytes // FP32_BYTES
    return min(sub, max(MIN_SLOT_NUMEL, sub // arrays // 1024 * 1024))


def state_chunk(sub_group: int, part_numel: int, n_states: int, state_dtype: str = "fp32") -> int:
    """Elements per chunk of NVMe optimizer state when the pinned budget allows: `swap_chunk`'s for the fp32
    count of arrays (the same for every state dtype: smaller states make smaller slots), int8 chunks
    whole QUANT_BLOCKs."""
    want = swap_chunk(sub_group, part_numel, n_states * FP32_BYTES)
    if state_dtype == "int8" and want < part_numel:
        want = max(QUANT_BLOCK, want // QUANT_BLOCK * QUANT_BLOCK)
    return want


def plan_slot_numel(
    sub_group: int,
    part_numel: int,
    n_states: int,
    buffer_count: int,
    *,
    cap_bytes: int,
    in_use_bytes: int,
    reserved_bytes: int = 0,
    alignment: int = 4096,
    budget_source: str = "zero_offload.pinned_budget_bytes",
    state_dtype: str = "fp32",
) -> int:
    """Elements per slot: `swap_chunk`'s if `buffer_count` slots fit in the pinned budget (`cap_bytes` minus
    `in_use_bytes` already allocated and `reserved_bytes` still to come), else the largest multiple of
    1024 that fits (a smaller piece of a sub-group, down to MIN_SLOT_NUMEL); ValueError naming the budget,
    buffer_count and sub_group_size when not even that fits. The element count does not depend on
    `state_dtype` (16-bit or 8-bit states make each slot smaller), except that int8 chunks are whole
    QUANT_BLOCKs (a chunk's absmax scales then start at its first element)."""
    fmt = StateFormat(n_states, state_dtype)
    step = QUANT_BLOCK if fmt.quantized else 1024
    free = cap_bytes - in_use_bytes - reserved_bytes
    want = state_chunk(sub_group, part_numel, n_states, state_dtype)
    if buffer_count * slot_bytes(want, n_states, alignment, state_dtype) <= free:
        return want
    per_slot = max(0, free) // buffer_count
    numel = int(per_slot // fmt.bytes_per_element()) // step * step
    while numel > 0 and slot_bytes(numel, n_states, alignment, state_dtype) > per_slot:
        numel -= step  # the scales' padding
    floor = min(max(MIN_SLOT_NUMEL, step), want)
    if numel < floor:
        need = (
            buffer_count * slot_bytes(floor, n_states, alignment, state_dtype) + in_use_bytes + reserved_bytes
        )
        slots = buffer_count * slot_bytes(want, n_states, alignment, state_dtype)
        raise ValueError(
            f"pinned memory budget too small for NVMe staging: {cap_bytes} bytes ({budget_source}) with "
            f"{in_use_bytes} bytes already used for gradients; offload_optimizer.buffer_count={buffer_count} "
            f"slots of {want} elements (sub_group_size={sub_group}, an fp32 master and {n_states} "
            f"{state_dtype} states each) need {slots} bytes"
            f", and at least {need} bytes in total are needed to split sub-groups into smaller pieces"
        )
    return numel
