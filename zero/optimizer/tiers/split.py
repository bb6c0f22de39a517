"""SplitTier: one rank's optimizer state split between two tiers over one index space.

Two features share this composition:

* **RAM-first placement** (`offload_optimizer.device: nvme` with `max_in_cpu`): the first sub-groups of the
  partition stay in pinned host memory (a `DeviceState`), only the rest is swapped (`OptimizerSwapper`), so
  the NVMe bytes per step shrink by the resident share. `max_in_cpu: "auto"` keeps as many sub-groups as the
  pinned budget holds after what the engine already pinned and the swap slots.
* **Twin-Flow** (`offload_optimizer.ratio` below 1.0): that fraction of the sub-groups (rounded up) lives on
  the offload tier (cpu or nvme) and is stepped there; the sub-groups before them stay on the device. On
  CUDA the device part is a `TorchDevicePart` (zero.optimizer.tiers.device_part): device memory stepped by
  torch's fused Adam/AdamW, launched before the host walks the offloaded chunks so both run at once. On a
  CPU-only machine it is plain (not pinned) host memory stepped by the same fused kernels, so every ratio
  gives bit-identical results.

Both nest: `[device | pinned host | NVMe]` is `SplitTier(device, SplitTier(pinned, swapper))`. A split always
falls on a sub-group boundary, so chunks never straddle two tiers.

The split state presents `StateTier` (zero.optimizer.tiers.base): `step` walks the back tier first (its first
reads were prefetched during backward), then the front; `read_all` / `load` / `rewrite` visit the front
then the back, with the back's element offsets shifted by the front's size; `stats` adds the two tiers'
counters (the front's only compute time).

Failure safety. A split state is not atomic: the front tier is updated in place. The back swapper runs with
its write-back drained inside the step (no deferred writes), so an NVMe error surfaces from `step` and never
after a commit. `atomic_from` is the first element whose state is on a two-copy swapper: the engine poisons
the state (`StateCorruptedError` until a checkpoint is loaded, zero.optimizer.integrity) only when a failed
pass had updated a chunk before it, in place; a failure in the swapped share alone keeps the committed state.

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

from offload.config.zero import OffloadOptimizerConfig
from offload.swap.optimizer_swapper import SwapStats
from offload.swap.space import SwapSpace
from offload.swap.split import auto_max_in_cpu, split_numel
from zero.optimizer.tiers.base import ChunkFn, DevicePart, ReadyFn, StateTier, TierStats, VisitFn

__all__ = ["SplitPlan", "SplitStats", "SplitTier", "build_split", "plan_split"]

# build(numel, init, tier, alias) -> (tier object, swap space or None): one plain tier of a part
PartBuilder = Callable[[int, Any, str, Optional[torch.Tensor]], Tuple[StateTier, Optional[SwapSpace]]]


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
    offload: Optional[OffloadOptimizerConfig],
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
    ratio = float(offload.ratio) if offload is not None else 1.0
    want = offload.max_in_cpu if offload is not None else 0
    if want == "auto" and tier == "nvme" and offload is not None:
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
) -> Tuple[StateTier, Optional[SwapSpace]]:
    """The tiers of `plan` (each from `build`, over its slice of `init` and `alias`), nested into
    SplitTiers; returns (tier, swap space or None)."""
    parts = [(n, t) for n, t in ((plan.device, "none"), (plan.host, "cpu"), (plan.offload, plan.tier)) if n]
    built: List[StateTier] = []
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

    def __init__(self, own: SwapStats, back: TierStats) -> None:
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
        """Zero both tiers' counters."""
        self._own.reset()
        self._back.reset()


class SplitTier:
    """`front` holds elements [0, front.numel), `back` the rest, both as one `StateTier` (module doc).
    `on_device`: the front is the training device's share (Twin-Flow), not pinned host memory. The back must
    not defer its writes (an NVMe error must surface from `step`, never after a commit): the builder makes
    its swapper with `defer_writes=False`."""

    def __init__(self, front: StateTier, back: StateTier, *, on_device: bool = False) -> None:
        self.front, self.back = front, back
        self.on_device = bool(on_device)
        self.split = int(front.numel)
        self.numel = self.split + int(back.numel)
        self.chunk_numel = max(int(front.chunk_numel), int(back.chunk_numel))
        self._own = SwapStats()
        self.stats = SplitStats(self._own, back.stats)

    # ------------------------------------------------------------------------------------ chunks
    @property
    def chunks(self) -> List[Tuple[int, int]]:
        """(start, numel) of every chunk a pass visits, in element coordinates: the front's, then the
        back's."""
        return list(self.front.chunks) + [(self.split + s, n) for s, n in self.back.chunks]

    @property
    def atomic_from(self) -> int:
        """The first element whose state lives on a two-copy swapper up to the end (updated out of place,
        so a failed pass leaves it committed); `numel` when the tail is updated in place."""
        return self.split + self.back.atomic_from

    @property
    def overlappable(self) -> bool:
        """Whether the pass may step the swapped share during backward (module doc): one two-copy swapper
        behind an in-memory front that this tier's chunk walk steps."""
        back, front = self.back, self.front
        return (
            back.overlap_chunks is not None
            and back.resident_share == (0, 0)
            and front.swapped_numel == 0
            and front.device_part is None
        )

    @property
    def overlap_chunks(self) -> Optional[List[Tuple[int, int]]]:
        """The gate's chunks of a pass during backward (`chunks`), or None when not `overlappable`."""
        return self.chunks if self.overlappable else None

    @property
    def resident_share(self) -> Tuple[int, int]:
        """(elements, chunks) of the in-memory front a pass during backward leaves to `step_resident`."""
        return self.split, self.front_chunks

    @property
    def device_part(self) -> Optional[DevicePart]:
        """The front when it is stepped apart from the chunk walk (a `TorchDevicePart`), else None."""
        return self.front.device_part

    # ------------------------------------------------------------------------------------ placement
    @property
    def swapped_numel(self) -> int:
        """Elements whose state lives in swap files."""
        return self.front.swapped_numel + self.back.swapped_numel

    @property
    def resident_numel(self) -> int:
        """Elements whose state lives in memory (device or host)."""
        return self.numel - self.swapped_numel

    @property
    def device_numel(self) -> int:
        """Elements whose state lives on the training device (`ratio` below 1.0)."""
        return self.front.device_numel + self.back.device_numel

    @property
    def pass_bytes(self) -> int:
        """NVMe bytes one full pass reads (and, committing, writes): the swapped share only."""
        return self.front.pass_bytes + self.back.pass_bytes

    @property
    def copies(self) -> int:
        """NVMe copies of the swapped share (1 with nothing swapped)."""
        return max(self.front.copies, self.back.copies)

    @property
    def chunk_count(self) -> int:
        """Chunks one pass visits over both tiers."""
        return len(self.front.chunks) + len(self.back.chunks)

    @property
    def pinned_bytes(self) -> int:
        """Pinned bytes of both tiers (host share, staging slots)."""
        return self.front.pinned_bytes + self.back.pinned_bytes

    @property
    def writes_in_flight(self) -> bool:
        """Whether either tier has writes in flight (never after a split's step: the back drains)."""
        return self.back.writes_in_flight or self.front.writes_in_flight

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
        self.back.settle()
        self.front.settle()

    def step(self, fn: ChunkFn, ready: Optional[ReadyFn] = None) -> bool:
        """Run `fn` over every chunk: the back tier first (its reads were prefetched), then the front. With
        `ready`: only the swapped share, as `step_swapped`."""
        if ready is not None:
            return self.step_swapped(fn, ready)
        if not self.back.step(self._shifted(fn)):
            return False
        t0 = time.perf_counter()
        try:
            return self.front.step(fn)
        finally:
            if self.front.swapped_numel == 0:  # an in-memory front: its compute is this tier's own
                self._own.compute_s += time.perf_counter() - t0
                self._own.chunks += len(self.front.chunks)

    @property
    def front_chunks(self) -> int:
        """Chunks of the front: the first indices of `chunks`."""
        return len(self.front.chunks)

    def step_swapped(self, fn: ChunkFn, ready: ReadyFn) -> bool:
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
            self._own.chunks += len(self.front.chunks)

    def commit(self) -> None:
        """Commit both tiers' pass (the back first)."""
        self.back.commit()
        self.front.commit()

    def abort(self) -> None:
        """Drop both tiers' pass."""
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

    def take_lost(self) -> Optional[OSError]:
        """A failure of deferred writes not yet reported (never, as the back tier drains its steps)."""
        return self.back.take_lost() or self.front.take_lost()

    def keep_lost(self, err: OSError) -> None:
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
