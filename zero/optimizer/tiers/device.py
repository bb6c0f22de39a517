"""DeviceState: master + states as ordinary tensors, the memory tier of `offload_optimizer.device`.

"none": tensors on the training device (plain host memory on a CPU-only machine); "cpu": pinned host memory
from the PinnedPool. Chunks are views of the tensors, updated in place, so there is nothing to roll back: the
engine checks gradients for overflow before it steps this tier. It presents `StateTier`
(zero.optimizer.tiers.base).
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch

from offload.swap.optimizer_swapper import SwapStats
from offload.swap.slots import QUANT_BLOCK, StateFormat
from zero.optimizer.tiers.base import ChunkFn, DevicePart, ReadyFn, VisitFn

__all__ = ["DeviceState"]


class DeviceState:
    """Master + states as ordinary tensors (device memory, or pinned host memory for the "cpu" tier).

    Updates happen in place, so there is nothing to roll back: the engine checks gradients for overflow
    before it calls `step` on this tier.
    """

    def __init__(
        self,
        master: torch.Tensor,
        states: List[torch.Tensor],
        chunk_numel: int,
        pinned: bool,
        fmt: Optional[StateFormat] = None,
    ) -> None:
        self.master = master
        self.states = states  # the states in their dtype, then (int8) one absmax tensor per state
        self.numel = master.numel()
        self.fmt = fmt or StateFormat(len(states))
        self.n_states = self.fmt.n_states
        chunk = max(1, min(int(chunk_numel), self.numel))
        if self.fmt.quantized and chunk < self.numel:  # a chunk's scales start at its first element
            chunk = max(QUANT_BLOCK, chunk // QUANT_BLOCK * QUANT_BLOCK)
        self.chunk_numel = chunk
        self.stats = SwapStats()
        self._pinned = pinned
        self._lost: Optional[OSError] = None

    @property
    def pinned_bytes(self) -> int:
        """Bytes of master + states in pinned host memory (0 on the device)."""
        if not self._pinned:
            return 0
        return sum(t.numel() * t.element_size() for t in [self.master, *self.states])

    disk_bytes = 0

    @property
    def state_bytes(self) -> int:
        """Bytes of master + states (int8: with the absmax scales)."""
        return self.fmt.whole_bytes(self.numel)

    # ------------------------------------------------------------------------------------ placement
    @property
    def chunks(self) -> List[Tuple[int, int]]:
        """(start, numel) of every chunk a pass visits."""
        return list(self._chunks())

    copies = 1  # no NVMe copies
    pass_bytes = 0  # a pass reads nothing from NVMe
    swapped_numel = 0
    device_part: Optional[DevicePart] = None  # every chunk is stepped by the chunk walk
    overlap_chunks: Optional[List[Tuple[int, int]]] = None  # in place: a pass cannot run during backward
    resident_share = (0, 0)  # `step` walks every chunk

    @property
    def device_numel(self) -> int:
        """Elements in device memory: all of them unless pinned (the "cpu" tier)."""
        return 0 if self._pinned else self.numel

    @property
    def atomic_from(self) -> int:
        """Updated in place: a failed pass leaves no element committed."""
        return self.numel

    def _chunks(self) -> Iterable[Tuple[int, int]]:
        for s in range(0, self.numel, self.chunk_numel):
            yield s, min(self.chunk_numel, self.numel - s)

    def _views(self, s: int, n: int) -> List[torch.Tensor]:
        values = [t[s : s + n] for t in self.states[: self.n_states]]
        lo, hi = s // QUANT_BLOCK, -(-(s + n) // QUANT_BLOCK)
        return values + [t[lo:hi] for t in self.states[self.n_states :]]

    # ------------------------------------------------------------------------------------ a pass
    def step(self, fn: ChunkFn, ready: Optional[ReadyFn] = None) -> bool:
        """Run `fn` on every chunk in place (after `ready(c)` when given); False: `fn` or `ready` said
        stop."""
        for c, (s, n) in enumerate(self._chunks()):
            if ready is not None and not ready(c):
                return False
            if not fn(s, n, self.master[s : s + n], self._views(s, n)):
                return False
        return True

    def step_resident(self, fn: ChunkFn) -> bool:
        """Nothing is left after `step`."""
        return True

    writes_in_flight = False  # updates are in place in memory: nothing is ever left to write

    def prefetch(self) -> None:
        """Nothing to read: already in memory."""

    def settle(self) -> None:
        """Nothing is written back later on this tier."""

    def commit(self) -> None:
        """Updated in place: nothing to commit."""

    def abort(self) -> None:
        """Updated in place: nothing to drop (the engine checked for overflow first)."""

    def read_all(self, fn: VisitFn) -> None:
        """Call `fn(start, n, master, states)` on views of every chunk."""
        for s, n in self._chunks():
            fn(s, n, self.master[s : s + n], self._views(s, n))

    def load(self, fn: VisitFn) -> None:
        """`fn` fills each chunk's views in place."""
        self.read_all(fn)

    def rewrite(self, fn: VisitFn) -> None:
        """`fn` changes each chunk's views in place (the swapper's `rewrite`, for this tier)."""
        self.read_all(fn)

    def take_lost(self) -> Optional[OSError]:
        """None (nothing is written back later on this tier), or what `keep_lost` kept."""
        err, self._lost = self._lost, None
        return err

    def keep_lost(self, err: OSError) -> None:
        """Keep a failure a discarded pass had taken, for the next `take_lost`."""
        self._lost = err

    def close(self) -> None:
        """Nothing to free (the tensors go with their last reference)."""
