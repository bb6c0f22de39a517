"""A partition unit: the direct parameters of one module, each split evenly across ranks.

A unit is what one fetch gathers and one release frees: while gathered, one flat buffer of `padded_numel`
elements (the parameters back to back, then unused room). Each parameter is partitioned on its own, as in
DeepSpeed: with `c = ceil(numel / world_size)` (its `chunk`), rank r holds elements [r * c, (r + 1) * c) of
the flattened parameter, the last ranks' chunks zero-padded to `c`. A rank's partition of the unit is its
chunks of the unit's parameters back to back (`part_numel` elements, the same on every rank), so
`param.ds_tensor.numel() == ds_tensor.ds_numel == c` as in DeepSpeed. On one rank a chunk is the whole
parameter and the partition is the flat buffer itself; on several, the ranks' partitions back to back
(`rank_major`, what an all-gather yields and a reduce-scatter takes) are reordered into the flat buffer and
back (`unpack`, `pack`) unless the unit has one parameter, where both orders are the same. Each parameter
keeps DeepSpeed's attribute names, so user code that checks them (`ds_shape`, `ds_numel`, `ds_status`, ...)
works unchanged.
"""

from __future__ import annotations

import enum
import itertools
import re
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from zero.stage3.shard import make_shard, retire_shard

__all__ = [
    "ParamSlice",
    "chunk_range",
    "PartitionStatus",
    "Unit",
    "UnitOwner",
    "ZeroParamStatus",
    "fill_partition",
    "is_partitioned",
    "param_shares",
    "safe_file_name",
    "set_param_attributes",
    "set_partition_tensors",
    "set_status",
]


class PartitionStatus(enum.Enum):
    """DeepSpeed's ZeroParamStatus (same names and values): `param.ds_status`, whether `param.data` holds
    the full tensor right now. AVAILABLE: gathered; NOT_AVAILABLE: partitioned (`param.data` is empty);
    INFLIGHT: not gathered yet, but this rank's partition is being read ahead (an NVMe prefetch in flight)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


ZeroParamStatus = PartitionStatus  # DeepSpeed's name (deepspeed.runtime.zero.partition_parameters)

# DeepSpeed's `param.ds_id`: one process-wide counter, so ids are unique over every partitioner, and equal
# on every rank when the ranks build the same model in the same order.
_DS_IDS = itertools.count()


@dataclass(frozen=True)
class ParamSlice:
    """Where this rank's share of one parameter lies: elements [param_lo, param_hi) of the flattened
    parameter are elements [part_lo, part_hi) of the unit's partition."""

    param: nn.Parameter
    name: str
    param_lo: int
    param_hi: int
    part_lo: int
    part_hi: int


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def safe_file_name(name: str) -> str:
    """A plain file name from a qualified parameter/module name (stable across runs, never an id())."""
    cleaned = _UNSAFE.sub("_", name).strip(".") or "root"
    return cleaned[:200]


def param_shares(numels: Sequence[int], world_size: int, rank: int) -> Tuple[List[int], List[int], int]:
    """(chunks, part_offsets, part_numel) of parameters of `numels` split over `world_size` ranks as a unit
    splits them (module doc): each parameter's chunk `ceil(numel / world_size)` (its whole numel on one
    rank), where its chunk starts in a rank's partition, and the partition's size (at least 1). The same on
    every rank; `rank` only checks the caller's rank is one of them."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    chunks = [-(-n // world_size) for n in numels]
    part_offsets: List[int] = []
    total = 0
    for c in chunks:
        part_offsets.append(total)
        total += c
    return chunks, part_offsets, max(1, total)


def chunk_range(numel: int, chunk: int, rank: int) -> Tuple[int, int]:
    """[lo, hi) of the elements of a parameter of `numel` that rank `rank` holds with chunks of `chunk`
    (empty, lo == hi, for a rank past its end)."""
    lo = min(numel, rank * chunk)
    return lo, min(numel, lo + chunk)


class Unit:
    """The parameters one module owns (recurse=False), each split over the ranks (module doc)."""

    def __init__(
        self,
        index: int,
        name: str,
        params: Sequence[nn.Parameter],
        param_names: Sequence[str],
        world_size: int,
        rank: int,
        device: torch.device,
        shapes: Optional[Sequence[torch.Size]] = None,
    ) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"module {name!r}: parameters of one module must share one dtype to be flattened, got "
                f"{sorted(str(d) for d in dtypes)} for {list(param_names)}"
            )
        self.index = index
        self.name = name
        self.params: List[nn.Parameter] = list(params)
        self.param_names: List[str] = list(param_names)
        self.dtype: torch.dtype = next(iter(dtypes))
        self.device = device
        self.shapes = list(shapes) if shapes is not None else [p.shape for p in self.params]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets: List[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        self.world_size = world_size
        self.rank = rank
        self.set_shares()
        self.element_size = torch.empty((), dtype=self.dtype).element_size()
        # state owned by the partitioner
        self.owner: Optional[UnitOwner] = None  # the Stage3Partitioner that holds it
        self.full: Optional[torch.Tensor] = None  # the gathered flat buffer while fetched
        # gathered encoded (zero.stage3.fused): its quantized weight's codes, the weight not decoded
        self.encoded: Optional[Any] = None
        self.refs = 0  # forward fetches (module invocations) and GatheredParameters holding it
        self.bwd_hold = False  # fetched by a pre-backward; freed when its gradients are in
        self.persistent = False
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.grad_flat: Optional[torch.Tensor] = None
        self.grads_seen = 0

    def set_shares(self) -> None:
        """Compute the ranks' shares (`chunks`, `part_offsets`, `part_numel`) from `numels`."""
        self.chunks, self.part_offsets, self.part_numel = param_shares(
            self.numels, self.world_size, self.rank
        )
        self.padded_numel = self.part_numel * self.world_size
        # the ranks' partitions back to back are the flat buffer itself (one rank, or one parameter)
        self.rank_major = self.world_size == 1 or len(self.numels) <= 1

    @property
    def nbytes(self) -> int:
        """Bytes of the whole unit (all ranks' shares, no padding)."""
        return self.numel * self.element_size

    @property
    def part_nbytes(self) -> int:
        """Bytes of this rank's partition."""
        return self.part_numel * self.element_size

    @property
    def present(self) -> bool:
        """Whether the unit is gathered (whole on the compute device) right now."""
        return self.full is not None

    def slices(self) -> Iterator[ParamSlice]:
        """This rank's share of every parameter of the unit (parameters with no share, a rank past a small
        parameter's end, are skipped)."""
        for i, (p, name) in enumerate(zip(self.params, self.param_names)):
            lo, hi = self.share(i)
            if lo < hi:
                at = self.part_offsets[i]
                yield ParamSlice(p, name, lo, hi, at, at + hi - lo)

    def share(self, i: int, rank: Optional[int] = None) -> Tuple[int, int]:
        """[lo, hi) of the elements of parameter i (flattened) that `rank` (default: this rank) holds, at
        `part_offsets[i]` of its partition; the chunk's `chunks[i] - (hi - lo)` elements after them are
        zero padding."""
        return chunk_range(self.numels[i], self.chunks[i], self.rank if rank is None else rank)

    def param_range(self, i: int) -> Tuple[int, int]:
        """[lo, hi) of parameter i inside the flat buffer."""
        return self.offsets[i], self.offsets[i] + self.numels[i]

    def partition_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's partition (`part_numel` elements) taken from a flat buffer of the unit: a view of it
        when `rank_major`, else a new tensor (its padding zeros)."""
        if self.rank_major:
            lo = self.rank * self.part_numel
            return full[lo : lo + self.part_numel]
        out = torch.zeros(self.part_numel, dtype=full.dtype, device=full.device)
        for i, off in enumerate(self.offsets):
            lo, hi = self.share(i)
            at = self.part_offsets[i]
            out[at : at + hi - lo].copy_(full[off + lo : off + hi])
        return out

    def unpack(self, gathered: torch.Tensor, full: torch.Tensor) -> None:
        """Reorder every rank's partition back to back (`gathered`, `padded_numel` elements, rank-major as an
        all-gather yields them) into the flat buffer `full` (the parameters back to back). One copy per
        parameter; not for a `rank_major` unit, whose two orders are the same."""
        rows = gathered.view(self.world_size, self.part_numel)
        for off, n, c, at in zip(self.offsets, self.numels, self.chunks, self.part_offsets):
            if n == 0:
                continue
            q, rem = divmod(n, c)  # ranks whose chunk is whole, then the one holding the rest
            if q:
                full[off : off + q * c].view(q, c).copy_(rows[:q, at : at + c])
            if rem:
                full[off + q * c : off + n].copy_(rows[q, at : at + rem])
        full[self.numel :].zero_()  # the room after the parameters, as a one-parameter unit's padding

    def pack(self, full: torch.Tensor, gathered: torch.Tensor) -> None:
        """The inverse of `unpack`: the flat buffer `full` as every rank's partition back to back in
        `gathered` (`padded_numel` elements), the padding zero (what a reduce-scatter of a gradient takes)."""
        rows = gathered.view(self.world_size, self.part_numel)
        covered = 0
        for off, n, c, at in zip(self.offsets, self.numels, self.chunks, self.part_offsets):
            if at > covered:
                rows[:, covered:at].zero_()
            covered = at + c
            if c == 0:
                continue
            q, rem = divmod(n, c)
            if q:
                rows[:q, at : at + c].copy_(full[off : off + q * c].view(q, c))
            if rem:
                rows[q, at : at + rem].copy_(full[off + q * c : off + n])
                rows[q, at + rem : at + c].zero_()
                q += 1
            if q < self.world_size:
                rows[q:, at : at + c].zero_()
        if covered < self.part_numel:
            rows[:, covered:].zero_()

    def __repr__(self) -> str:
        return (
            f"Unit({self.index}, {self.name!r}, {len(self.params)} params, {self.numel} x {self.dtype}, "
            f"partition {self.part_numel})"
        )


class UnitOwner(Protocol):
    """What a unit's partitioner (zero.stage3.partitioner.Stage3Partitioner) offers the modules that
    only hold units: GatheredParameters, the state-dict functions, the unit builder."""

    world_size: int
    rank: int
    group: Optional[dist.ProcessGroup]
    units: List[Unit]

    def fetch(self, unit: Unit) -> None:
        """Hold `unit` whole on the compute device until the matching `release`."""
        ...

    def release(self, unit: Unit) -> None:
        """Undo one `fetch`."""
        ...

    def read_partition(self, unit: Unit, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's partition of `unit`."""
        ...

    def write_partition(self, unit: Unit, values: torch.Tensor) -> None:
        """Replace this rank's partition of `unit`."""
        ...

    def partition_as_full(self, unit: Unit) -> Optional[torch.Tensor]:
        """The partition itself when it serves as the unit's full buffer, else None."""
        ...

    def write_share(self, unit: Unit, index: int, values: Optional[torch.Tensor]) -> None:
        """A write to parameter `index`'s `ds_tensor` (zero.stage3.shard): `values` into the partition, or
        (None) its memory-resident share was changed in place; copies of the partition follow."""
        ...


def fill_partition(unit: Unit, dst: torch.Tensor) -> None:
    """Write this rank's share of the unit's parameters into `dst` (part_numel elements), zeros elsewhere.

    Straight into the partition's final place: a temporary would cost one more pass over every weight."""
    covered = 0
    for s in sorted(unit.slices(), key=lambda s: s.part_lo):
        if s.part_lo > covered:
            dst[covered : s.part_lo].zero_()
        dst[s.part_lo : s.part_hi].copy_(s.param.detach().reshape(-1)[s.param_lo : s.param_hi])
        covered = max(covered, s.part_hi)
    if covered < dst.numel():
        dst[covered:].zero_()


def set_param_attributes(unit: Unit, released: torch.Tensor) -> None:
    """Attach the DeepSpeed-style metadata to every parameter and point its data at `released`."""
    for i, (p, name) in enumerate(zip(unit.params, unit.param_names)):
        p.ds_id = next(_DS_IDS)
        p.ds_shape = unit.shapes[i]
        p.ds_numel = unit.numels[i]
        p.ds_unit = unit
        p.ds_index = i
        p.ds_name = name
        p.ds_status = PartitionStatus.NOT_AVAILABLE
        lo, hi = unit.share(i)
        p.ds_partition_range = (lo, hi) if lo < hi else (0, 0)
        p.ds_persist = False
        p.data = released


def set_status(unit: Unit, status: PartitionStatus) -> None:
    """Set `ds_status` of every parameter of `unit`."""
    for p in unit.params:
        p.ds_status = status


def set_partition_tensors(
    unit: Unit, partition: Optional[torch.Tensor], location: Optional[str], owned: bool = True
) -> None:
    """DeepSpeed's `param.ds_tensor`: this rank's chunk of each parameter (elements `ds_partition_range` of
    the flattened parameter, then zero padding up to `unit.chunks[i]` elements), a 1-D
    zero.stage3.shard.ParamShard, with `ds_tensor.ds_numel` its element count (padding included) and
    `ds_tensor.final_location` where the partition lives (`location`: "nvme", else None, as in DeepSpeed).

    `partition`: the unit's partition when it lives in memory - each ds_tensor is then a view of it, so it
    always holds the current values and in-place changes go into the partition. None (on NVMe, stored
    quantized, or freed): each ds_tensor is an empty placeholder of the unit's dtype; `ds_numel` still says
    how many elements this rank's share holds. Writes (`.data = t`, `copy_`) reach the partition through
    the unit's owner; `owned=False` (the partitioner is closed): they are refused."""
    for i, p in enumerate(unit.params):
        if not owned:  # the same shard emptied in place: no new tensor while a finalizer closes the engine
            retire_shard(getattr(p, "ds_tensor", None), unit.dtype)
            continue
        at, c = unit.part_offsets[i], unit.chunks[i]
        view = partition[at : at + c] if partition is not None else None
        p.ds_tensor = make_shard(unit, i, view, c, location)


def is_partitioned(p: object) -> bool:
    """Whether `p` is a parameter partitioned by stage 3 (it carries its unit)."""
    return getattr(p, "ds_unit", None) is not None
