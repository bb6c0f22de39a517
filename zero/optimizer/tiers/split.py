"""SplitTier: one rank's optimizer state split between two tiers over one index space.

Two features share this composition:

* **RAM-first placement** (`offload_optimizer.device: nvme` with `max_in_cpu`): the first sub-groups of the
  partition stay in pinned host memory (a `DeviceState`), only the rest is swapped (`OptimizerSwapper`), so
  the NVMe bytes per step shrink by the resident share. `max_in_cpu: "auto"` keeps as many sub-groups as the
  pinned budget holds after what the engine already pinned and the swap slots.
* **Twin-Flow** (`offload_optimizer.ratio` below 1.0): that fraction of the sub-groups (rounded up) lives on
  the offload tier (cpu or nvme) and is stepped there; the sub-groups before them stay on the device. On
  CUDA the device part is a `TorchDevicePart` (zero.optimizer.tiers.device_part): device memory stepped by
  torch's fused
  Adam/AdamW, launched before the host walks the offloaded chunks so both run at once. On a CPU-only
  machine it is plain (not pinned) host memory stepped by the same fused kernels, so every ratio gives
  bit-identical results.

Both nest: `[device | pinned host | NVMe]` is `SplitTier(device, SplitTier(pinned, swapper))`. A split always
falls on a sub-group boundary, so chunks never straddle two tiers.

The split state presents `StateTier` (zero.optimizer.state): `step` walks the back tier first (its first
reads were prefetched during backward), then the front; `read_all` / `load` / `rewrite` visit the front
then the back, with the back's element offsets shifted by the front's size; `stats` adds the two tiers'
counters (the front's only compute time).

Failure safety. A split state is not atomic: the front tier is updated in place. The back swapper runs with
its write-back drained inside the step (no deferred writes), so an NVMe error surfaces from `step` and never
after a commit. `atomic_from` is the first element whose state is on a two-copy swapper: the engine poisons
the state (`StateCorruptedError` until a checkpoint is loaded, zero.optimizer.integrity) only when a failed
pass had
updated a chunk before it, in place; a failure in the swapped share alone keeps the committed state.

Stepping during backward (`offload_optimizer.pipeline_read` / `pipeline_write`). When the back is one
two-copy swapper behind an in-memory front (`overlappable`), the pass is cut in two: `step_swapped` walks
the swapped chunks on the overlap's worker while backward runs (each as soon as its gradients are final;
the back holds the last sub-groups, whose gradients come first), and `step_resident` walks the in-memory
front once backward has ended, from `engine.step()`. A pass dropped before `step()` has then only touched
the swapped share, which is never committed, so nothing has to be rolled back. `chunks` lists the gate's
chunks in element coordinates: the front's, then the back's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from offload.swap.optimizer_swapper import ChunkFn, OptimizerSwapper, SwapStats
from offload.swap.split import auto_max_in_cpu, split_numel
from zero.optimizer.tiers.device_part import TorchDevicePart

__all__ = ["SplitPlan", "SplitStats", "SplitTier", "build_split", "plan_split"]

VisitFn = Callable[[int, int, torch.Tensor, List[torch.Tensor]], None]
# build(numel, init, tier, alias) -> (tier object, swap space or None): one plain tier of a part
PartBuilder = Callable[[int, Any, str, Optional[torch.Tensor]], Tuple[Any, Any]]


@dataclass(frozen=True)
class SplitPlan:
    """Elements per tier, in index order: `device` on the training device, `host` in pinned host memory
    (RAM-first), `offload` on the offload tier `tier` ("cpu" or "nvme")."""

    device: int
    host: int
    offload: int
    tier: str


def plan_split(
    numel: int,
    n_states: int,
    *,
    tier: str,
    offload: Any,
    sub_group: int,
    device: torch.device,
    cap_bytes: int,
    in_use_bytes: int,
    reserved_bytes: int,
    alignment: int,
    state_dtype: str = "fp32",
) -> SplitPlan:
    """How `offload_optimizer.ratio` and `max_in_cpu` split a partition of `numel` elements (the arithmetic
    is offload.swap.split's; "auto" takes what the pinned budget has left after `in_use_bytes` and
    `reserved_bytes`, at the bytes per element of `state_dtype`)."""
    ratio = float(getattr(offload, "ratio", 1.0)) if offload is not None else 1.0
    want = getattr(offload, "max_in_cpu", 0) if offload is not None else 0
    if want == "auto" and tier == "nvme":
        rest = split_numel(numel, sub_group, tier=tier, ratio=ratio, max_in_cpu=0).offload
        want = auto_max_in_cpu(
            rest,
            n_states,
            sub_group,
            max(1, int(offload.buffer_count)),
            free_bytes=cap_bytes - in_use_bytes - reserved_bytes,
            alignment=alignment,
            state_dtype=state_dtype,
        )
    s = split_numel(numel, sub_group, tier=tier, ratio=ratio, max_in_cpu=0 if want == "auto" else int(want))
    return SplitPlan(device=s.device, host=s.host, offload=s.offload, tier=tier)


def build_split(
    plan: SplitPlan,
    init: Union[torch.Tensor, Callable[..., None]],
    alias: Optional[torch.Tensor],
    build: PartBuilder,
) -> Tuple[Any, Any]:
    """The tiers of `plan` (each from `build`, over its slice of `init` and `alias`), nested into
    SplitTiers; returns (tier, swap space or None)."""
    parts = [(n, t) for n, t in ((plan.device, "none"), (plan.host, "cpu"), (plan.offload, plan.tier)) if n]
    built: List[Any] = []
    space = None
    start = 0
    try:
        for n, t in parts:
            part_alias = None if alias is None else alias[start : start + n]
            part, sp = build(n, _slice_init(init, start, n), t, part_alias)
            built.append(part)
            space = sp if sp is not None else space
            start += n
    except BaseException:
        for part in built:
            part.close()
        raise
    tier = built[-1]
    for front, (_, t) in reversed(list(zip(built[:-1], parts))):
        tier = SplitTier(front, tier, on_device=t == "none")
    return tier, space


def _slice_init(init: Any, start: int, n: int) -> Any:
    if not callable(init):
        return init[start : start + n]

    def fill(s: int, k: int, out: torch.Tensor) -> None:
        init(start + s, k, out)

    return fill


class SplitStats:
    """The counters of a split state: the back tier's plus the front's own (compute time, chunks), read and
    reset like `SwapStats`."""

    def __init__(self, own: SwapStats, back: Any) -> None:
        self._own, self._back = own, back

    def _sum(self, name: str) -> Any:
        return getattr(self._own, name) + getattr(self._back, name)

    bytes_read = property(lambda self: self._sum("bytes_read"))
    bytes_written = property(lambda self: self._sum("bytes_written"))
    io_wait_s = property(lambda self: self._sum("io_wait_s"))
    compute_s = property(lambda self: self._sum("compute_s"))
    gate_wait_s = property(lambda self: self._sum("gate_wait_s"))
    write_back_wait_s = property(lambda self: self._sum("write_back_wait_s"))
    chunks = property(lambda self: self._sum("chunks"))

    def reset(self) -> None:
        self._own.reset()
        self._back.reset()


class SplitTier:
    """`front` holds elements [0, front.numel), `back` the rest, both as one `StateTier` (module doc).
    `on_device`: the front is the training device's share (Twin-Flow), not pinned host memory."""

    def __init__(self, front: Any, back: Any, *, on_device: bool = False) -> None:
        self.front, self.back = front, back
        self.on_device = bool(on_device)
        self.split = int(front.numel)
        self.numel = self.split + int(back.numel)
        self.chunk_numel = max(int(front.chunk_numel), int(back.chunk_numel))
        self._own = SwapStats()
        self.stats = SplitStats(self._own, back.stats)
        for t in (front, back):
            if isinstance(t, OptimizerSwapper):
                t.defer_writes = False  # an NVMe error must surface from step(), never after a commit

    # ------------------------------------------------------------------------------------ chunks
    @property
    def chunks(self) -> List[Tuple[int, int]]:
        """(start, numel) of every chunk a pass visits, in element coordinates: the front's, then the
        back's."""
        return _chunks_of(self.front) + [(self.split + s, n) for s, n in _chunks_of(self.back)]

    @property
    def atomic_from(self) -> int:
        """The first element whose state lives on a two-copy swapper up to the end (updated out of place,
        so a failed pass leaves it committed); `numel` when the tail is updated in place."""
        if isinstance(self.back, OptimizerSwapper):
            return self.split if self.back.copies > 1 else self.numel
        if isinstance(self.back, SplitTier):
            return self.split + self.back.atomic_from
        return self.numel

    @property
    def overlappable(self) -> bool:
        """Whether the pass may step the swapped share during backward (module doc): one two-copy swapper
        behind an in-memory front that this tier's chunk walk steps."""
        return (
            isinstance(self.back, OptimizerSwapper)
            and self.back.copies > 1
            and not isinstance(self.front, (OptimizerSwapper, SplitTier, TorchDevicePart))
        )

    def use_device_part(self, part: TorchDevicePart) -> None:
        """Step the device share with `part` (a `TorchDevicePart` over the current front): the pass launches
        it before this tier's `step`, whose visit of the front then only checks that it was."""
        if not self.on_device or int(part.numel) != self.split:
            raise ValueError(
                f"a device part of {part.numel} elements cannot replace this split's front "
                f"({self.split} elements, on the device: {self.on_device})"
            )
        self.front = part

    @property
    def device_part(self) -> Any:
        """The front when it is stepped apart from the chunk walk (`use_device_part`), else None."""
        return self.front if isinstance(self.front, TorchDevicePart) else None

    # ------------------------------------------------------------------------------------ placement
    def _swappers(self) -> List[OptimizerSwapper]:
        out: List[OptimizerSwapper] = []
        for t in (self.front, self.back):
            if isinstance(t, OptimizerSwapper):
                out.append(t)
            elif isinstance(t, SplitTier):
                out.extend(t._swappers())
        return out

    @property
    def swapped_numel(self) -> int:
        """Elements whose state lives in swap files."""
        return sum(s.numel for s in self._swappers())

    @property
    def resident_numel(self) -> int:
        """Elements whose state lives in memory (device or host)."""
        return self.numel - self.swapped_numel

    @property
    def device_numel(self) -> int:
        """Elements whose state lives on the training device (`ratio` below 1.0)."""
        inner = self.back.device_numel if isinstance(self.back, SplitTier) else 0
        return (self.split if self.on_device else 0) + inner

    @property
    def pass_bytes(self) -> int:
        """NVMe bytes one full pass reads (and, committing, writes): the swapped share only."""
        return sum(s.pass_bytes for s in self._swappers())

    @property
    def copies(self) -> int:
        """NVMe copies of the swapped share (1 with nothing swapped)."""
        return max([s.copies for s in self._swappers()] or [1])

    @property
    def chunk_count(self) -> int:
        """Chunks one pass visits over both tiers."""
        return sum(_chunk_count(t) for t in (self.front, self.back))

    @property
    def pinned_bytes(self) -> int:
        return int(getattr(self.front, "pinned_bytes", 0)) + int(getattr(self.back, "pinned_bytes", 0))

    @property
    def writes_in_flight(self) -> bool:
        return bool(getattr(self.back, "writes_in_flight", False))

    # ------------------------------------------------------------------------------------ a pass
    def _shifted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        off = self.split

        def shifted(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> Any:
            return fn(off + start, n, master, states)

        return shifted

    def prefetch(self) -> None:
        """Queue the swapped share's first reads (e.g. during backward)."""
        self.back.prefetch()

    def settle(self) -> None:
        """Wait for writes in flight (none are left by a split state's steps)."""
        getattr(self.back, "settle", lambda: None)()

    def step(self, fn: ChunkFn) -> bool:
        """Run `fn` over every chunk: the back tier first (its reads were prefetched), then the front."""
        if not self.back.step(self._shifted(fn)):
            return False
        t0 = time.perf_counter()
        try:
            return self.front.step(fn)
        finally:
            if not isinstance(self.front, (OptimizerSwapper, SplitTier)):
                self._own.compute_s += time.perf_counter() - t0
                self._own.chunks += _chunk_count(self.front)

    @property
    def front_chunks(self) -> int:
        """Chunks of the front: the first indices of `chunks`."""
        return len(_chunks_of(self.front))

    def step_swapped(self, fn: ChunkFn, ready: Callable[[int], bool]) -> bool:
        """The swapped share's part of a pass (`overlappable` only): `ready(c)` with c the chunk's index in
        `chunks` is called before each update; the front is left for `step_resident`."""
        if not self.overlappable:
            raise RuntimeError("SplitTier.step_swapped: this split is not overlappable (see `overlappable`)")
        nf = self.front_chunks
        return bool(self.back.step(self._shifted(fn), ready=lambda i: ready(nf + i)))

    def step_resident(self, fn: ChunkFn) -> bool:
        """The in-memory front's part of a pass cut by `step_swapped` (in place)."""
        t0 = time.perf_counter()
        try:
            return bool(self.front.step(fn))
        finally:
            self._own.compute_s += time.perf_counter() - t0
            self._own.chunks += _chunk_count(self.front)

    def commit(self) -> None:
        self.back.commit()
        self.front.commit()

    def abort(self) -> None:
        self.back.abort()
        self.front.abort()

    # ------------------------------------------------------------------------------------ whole state
    def read_all(self, fn: VisitFn) -> None:
        """Visit the committed master and states chunk by chunk, front then back."""
        self.front.read_all(fn)
        self.back.read_all(self._shifted(fn))

    def load(self, fn: VisitFn) -> None:
        """Replace the state chunk by chunk (front first, in place; not atomic as a whole)."""
        self.front.load(fn)
        self.back.load(self._shifted(fn))

    def rewrite(self, fn: VisitFn) -> None:
        """Let `fn` change every chunk in place, front then back."""
        self.front.rewrite(fn)
        self.back.rewrite(self._shifted(fn))

    def take_lost(self) -> Any:
        """A failure of deferred writes not yet reported (never, as the back tier drains its steps)."""
        return self.back.take_lost() or self.front.take_lost()

    def keep_lost(self, err: Any) -> None:
        """Keep a deferred failure a discarded step had taken, for the next step."""
        self.back.keep_lost(err)

    def close(self) -> None:
        """Close both tiers; the first error is raised after both are closed."""
        first: Optional[BaseException] = None
        for t in (self.back, self.front):
            try:
                t.close()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                first = first or e
        if first is not None:
            raise first


def _chunks_of(t: Any) -> List[Tuple[int, int]]:
    if isinstance(t, (SplitTier, OptimizerSwapper)):
        return list(t.chunks)
    n, c = int(t.numel), int(t.chunk_numel)
    return [(s, min(c, n - s)) for s in range(0, n, c)]


def _chunk_count(t: Any) -> int:
    if isinstance(t, SplitTier):
        return t.chunk_count
    if isinstance(t, OptimizerSwapper):
        return len(t.chunks)
    return -(-int(t.numel) // int(t.chunk_numel))
