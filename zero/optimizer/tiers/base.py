"""The tier protocol: what every holder of one rank's fp32 master and optimizer states presents.

Callers (zero.optimizer.state, zero.engine, zero.checkpoint) use these members only and never ask which tier
they hold. The tiers: `DeviceState` (zero.optimizer.tiers.device: device or pinned host memory),
`OptimizerSwapper` (offload.swap.optimizer_swapper: NVMe), `SplitTier` (zero.optimizer.tiers.split: two
tiers over one index space) and `TorchDevicePart` (zero.optimizer.tiers.device_part: a device share stepped
by torch). `StateInfo` is the placement they add up to (`engine.optimizer_state_info()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch

__all__ = ["ChunkFn", "DevicePart", "ReadyFn", "StateInfo", "StateTier", "TierStats", "VisitFn"]

# (start, n, master view, state views): what read_all / load / rewrite hand to the caller
VisitFn = Callable[[int, int, torch.Tensor, List[torch.Tensor]], None]
# (start, n, master view, state views) -> all values finite: one chunk's update in a pass
ChunkFn = Callable[[int, int, torch.Tensor, List[torch.Tensor]], bool]
# chunk index -> go on (blocks until the chunk's inputs are ready; False cancels the pass)
ReadyFn = Callable[[int], bool]
Groups = Union[Dict[str, object], Sequence[Dict[str, object]]]


class TierStats(Protocol):
    """A tier's counters since the last `reset()` (offload.swap.optimizer_swapper.SwapStats)."""

    @property
    def bytes_read(self) -> int:
        """NVMe bytes read."""

    @property
    def bytes_written(self) -> int:
        """NVMe bytes written."""

    @property
    def io_wait_s(self) -> float:
        """Seconds blocked on I/O."""

    @property
    def compute_s(self) -> float:
        """Seconds in the update function."""

    @property
    def gate_wait_s(self) -> float:
        """Seconds waiting for a chunk's gradients."""

    @property
    def write_back_wait_s(self) -> float:
        """Of `io_wait_s`, seconds blocked on the last step's deferred writes."""

    @property
    def chunks(self) -> int:
        """Chunks updated."""

    def reset(self) -> None:
        """Zero every counter."""


class StateTier(Protocol):
    """Master + states of `numel` elements, visited chunk by chunk.

    Placement: `chunks` (start, numel) in pass order of element coordinates, `copies` (NVMe copies; 1 for
    memory), `pass_bytes` (NVMe bytes a pass reads), `pinned_bytes`, `swapped_numel` (elements in swap
    files), `device_numel` (elements in device memory, not pinned: the training device's share),
    `atomic_from` (the first element from which a failed pass leaves the state committed), `device_part` (a
    share stepped by torch, launched before the chunk walk; None: none).

    A pass: `step(fn, ready)` walks every chunk (with `ready`: the share a pass during backward covers,
    waiting on `ready(c)` before chunk c of `overlap_chunks`), `step_resident(fn)` the rest such a pass left
    (`resident_share`: its elements and chunks; (0, 0) when it left none), then `commit` or `abort`.
    Deferred NVMe writes: `settle`, `take_lost`, `keep_lost`, `writes_in_flight`. Whole state: `read_all`,
    `load`, `rewrite`. `close` frees it."""

    numel: int
    chunk_numel: int

    @property
    def stats(self) -> TierStats:
        """The counters since the last reset (a pass adds them to the step report)."""

    @property
    def chunks(self) -> List[Tuple[int, int]]:
        """(start, numel) of every chunk a pass visits, in element coordinates."""

    @property
    def copies(self) -> int:
        """NVMe copies of the swapped share (2: atomic steps); 1 with nothing swapped."""

    @property
    def pass_bytes(self) -> int:
        """NVMe bytes one full pass reads (and, committing, writes)."""

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory the tier holds (host share, staging slots)."""

    @property
    def swapped_numel(self) -> int:
        """Elements whose state is in swap files."""

    @property
    def device_numel(self) -> int:
        """Elements whose state is in device memory (not pinned)."""

    @property
    def atomic_from(self) -> int:
        """The first element from which a failed pass leaves the committed state to the end."""

    @property
    def device_part(self) -> Optional[DevicePart]:
        """The share stepped by torch apart from the chunk walk (launched first), or None."""

    @property
    def overlap_chunks(self) -> Optional[List[Tuple[int, int]]]:
        """The chunks a pass during backward waits on, in `ready` order; None: no such pass."""

    @property
    def resident_share(self) -> Tuple[int, int]:
        """(elements, chunks) a pass during backward leaves to `step_resident`; (0, 0): none."""

    @property
    def writes_in_flight(self) -> bool:
        """Whether the last step's writes may still be running (until `settle`)."""

    def prefetch(self) -> None:
        """Queue the first reads of the next pass (e.g. during backward)."""

    def settle(self) -> None:
        """Wait for writes the last step left in flight (a failure is kept for `take_lost`)."""

    def step(self, fn: ChunkFn, ready: Optional[ReadyFn] = None) -> bool:
        """Run `fn` over the chunks (with `ready`: the share a pass during backward covers); False: stop."""

    def step_resident(self, fn: ChunkFn) -> bool:
        """The share a pass during backward left (`resident_share`); False: overflow."""

    def commit(self) -> None:
        """Make the finished pass the state."""

    def abort(self) -> None:
        """Drop the pass (the committed state stays where the tier keeps two copies)."""

    def read_all(self, fn: VisitFn) -> None:
        """Visit the committed master and states chunk by chunk."""

    def load(self, fn: VisitFn) -> None:
        """Replace master and states chunk by chunk."""

    def rewrite(self, fn: VisitFn) -> None:
        """Let `fn` change every chunk of the committed state."""

    def take_lost(self) -> Optional[OSError]:
        """A deferred write failure not yet reported (the tier is back at the step before), or None."""

    def keep_lost(self, err: OSError) -> None:
        """Keep a failure a discarded pass had taken, for the next `take_lost` or step."""

    def close(self) -> None:
        """Free memory, slots and files."""


class DevicePart(StateTier, Protocol):
    """A device share stepped apart from the chunk walk (zero.optimizer.tiers.device_part.TorchDevicePart)."""

    def launch(self, grad: torch.Tensor, step: int, group: Groups, grad_scale: float) -> None:
        """Queue the share's update `step` with its raw gradient `grad` divided by `grad_scale`."""


@dataclass(frozen=True)
class StateInfo:
    """Where the optimizer state lives and how it is walked (`engine.optimizer_state_info()`)."""

    tier: str  # "device", "cpu" or "nvme"
    numel: int  # elements of the rank's partition
    chunk_numel: int  # elements per chunk (NVMe: per staging slot)
    chunks: int
    copies: int  # NVMe copies kept (2: steps are atomic); 1 for memory tiers
    pass_read_bytes: int  # NVMe bytes one full pass reads (0 for memory tiers)
    disk_bytes: int  # bytes of swap files
    state_dtype: str = "fp32"  # the optimizer states' dtype ("fp32", "bf16", "int8"); the master is fp32
    resident_numel: int = 0  # elements whose state is in memory (device or host; zero.optimizer.tiers.split)
    swapped_numel: int = 0  # elements whose state is in swap files
    device_numel: int = 0  # of the resident ones, elements on the training device (offload_optimizer.ratio)
    # what steps a split's device share: "torch" (zero.optimizer.tiers.device_part) or "kernels"
    device_part: str = ""
