"""The activation stash: saved-tensor hooks that move checkpointed blocks' inputs to a tier and back.

`torch.utils.checkpoint` (non-reentrant) saves only each checkpointed block's inputs through the saved-tensor
hooks active around it; everything the block computes is dropped and recomputed in backward. The stash is
those hooks. Its order of work, for a chain of blocks:

* a block's inputs are packed as it starts (`pack`); they go to the tier when the *next* block starts
  (`begin_block`), so the inputs of the last block, the first the backward needs, never leave;
* in backward, unpacking block k's inputs (the start of its recompute) first starts bringing back block k-1's,
  then waits for its own: the read of one block overlaps the recompute and backward of the next;
* autograd drops an input after its block's backward; when a pass's last input is dropped, the tier frees the
  pass (the NVMe scratch file is removed).

A tensor saved twice in one pass (an attention mask every block receives) is stashed once. Tensors smaller
than `MIN_OFFLOAD_BYTES`, parameters and non-contiguous tensors stay where they are. A stashed input modified
in place after its block's forward raises, as autograd does for any saved tensor.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from zero.activations.tiers import Entry, Tier

__all__ = ["MIN_OFFLOAD_BYTES", "ActivationStash", "CheckpointingReport"]

MIN_OFFLOAD_BYTES = 1 << 16


@dataclass
class CheckpointingReport:
    """Activation checkpointing over one interval (`zero.checkpointing.take_report`)."""

    checkpoints: int = 0  # checkpointed block forwards (with grad enabled)
    saved_inputs: int = 0  # distinct tensors saved as block inputs
    saved_bytes: int = 0
    offloaded_bytes: int = 0  # moved off their device (to host memory or NVMe)
    restored_bytes: int = 0  # brought back for a recompute
    prefetches: int = 0  # restores started one block ahead of their recompute
    nvme_write_bytes: int = 0
    nvme_read_bytes: int = 0
    peak_resident_bytes: int = 0  # most bytes of saved inputs on their own device at once
    offload_s: float = 0.0  # compute-thread time spent starting offloads (profile: true)
    restore_wait_s: float = 0.0  # compute-thread time spent waiting for restores (profile: true)

    def as_dict(self) -> Dict[str, Any]:
        """The counts by field name."""
        return asdict(self)


class _Pass:
    """The blocks of one forward pass and its backward: entries in forward order, per block."""

    def __init__(self) -> None:
        self.blocks: List[List[Entry]] = []
        self.live = 0  # entries autograd still holds
        self.backward = False  # an input of this pass was unpacked: a new forward starts a new pass
        self.pending: Optional[int] = None  # the block whose inputs go away when the next block starts
        self.token: Any = None  # the tier's per-pass state (the NVMe scratch file), made at the first offload
        self.begun = False


class _Handle:
    """What autograd holds for a stashed input; dropping the last reference releases the entry."""

    __slots__ = ("stash", "entry", "pass_", "__weakref__")

    def __init__(self, stash: ActivationStash, entry: Entry, pass_: _Pass) -> None:
        self.stash = stash
        self.entry = entry
        self.pass_ = pass_

    def __del__(self) -> None:
        try:
            self.stash._drop(self)
        except Exception:  # interpreter shutdown, or the stash closed under us: nothing left to free
            pass


class ActivationStash:
    """Pack/unpack hooks for checkpointed blocks' inputs over one `Tier`; thread-safe (CUDA backward runs
    on autograd's device threads)."""

    def __init__(self, tier: Tier, profile: bool = False) -> None:
        self.tier = tier
        self.profile = profile
        self._lock = threading.RLock()
        self._pass: Optional[_Pass] = None
        self._seen: Dict[int, Any] = {}  # id(tensor) -> (weakref to it, handle) within the current pass
        self._report = CheckpointingReport()
        self._resident = 0
        self._closed = False

    # -- forward ---------------------------------------------------------------------------------------------

    def begin_block(self) -> None:
        """A checkpointed block is about to run its forward: the previous block's inputs may go."""
        with self._lock:
            p = self._pass
            if p is None or p.backward:
                p = self._new_pass()
            if p.pending is not None:
                self._offload_block(p, p.pending)
            p.blocks.append([])
            p.pending = len(p.blocks) - 1
            self._report.checkpoints += 1

    def new_pass(self) -> None:
        """The next checkpoint starts a new pass (inputs saved so far stay until autograd drops them)."""
        with self._lock:
            self._pass = None
            self._seen = {}

    def _new_pass(self) -> _Pass:
        self._pass = _Pass()
        self._seen = {}
        return self._pass

    def _offload_block(self, p: _Pass, index: int) -> None:
        start = time.perf_counter()
        for entry in p.blocks[index]:
            if entry.away:
                continue
            self._check_version(entry, entry.tensor)
            if not p.begun:
                p.token, p.begun = self.tier.begin_pass(), True
            moved = self.tier.offload(entry, p.token)
            if entry.away:
                self._resident -= entry.nbytes
            self._report.offloaded_bytes += moved
        if self.profile:
            self._report.offload_s += time.perf_counter() - start

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a handle for a stashed input, the tensor itself for one that stays."""
        if (
            isinstance(t, nn.Parameter)
            or not t.is_contiguous()
            or t.numel() * t.element_size() < MIN_OFFLOAD_BYTES
            or not self.tier.moves(t)
        ):
            return t
        with self._lock:
            p = self._pass
            if p is None or not p.blocks or self._closed:
                return t  # a checkpoint entered without begin_block (nested in a recompute): keep it
            seen = self._seen.get(id(t))
            if seen is not None and seen[0]() is t and seen[1]() is not None:
                return seen[1]()
            entry = Entry(t, len(p.blocks) - 1)
            handle = _Handle(self, entry, p)
            self._seen[id(t)] = (weakref.ref(t), weakref.ref(handle))
            p.blocks[-1].append(entry)
            p.live += 1
            self._report.saved_inputs += 1
            self._report.saved_bytes += entry.nbytes
            self._add_resident(entry.nbytes)
            return handle

    # -- backward --------------------------------------------------------------------------------------------

    def unpack(self, obj: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the input, brought back (and the previous block's restore started)."""
        if not isinstance(obj, _Handle):
            return obj
        entry, p = obj.entry, obj.pass_
        with self._lock:
            p.backward = True
            p.pending = None
            self._prefetch_before(p, entry.block)
            if entry.tensor is not None:
                self._check_version(entry, entry.tensor)
                return entry.tensor
            start = time.perf_counter()
            tensor = self.tier.restore(entry)
            if self.profile:
                self._report.restore_wait_s += time.perf_counter() - start
            entry.tensor = tensor
            self._report.restored_bytes += entry.nbytes
            self._add_resident(entry.nbytes)
            return tensor

    def _prefetch_before(self, p: _Pass, block: int) -> None:
        """Start restoring the nearest earlier block that saved inputs (one block ahead)."""
        for index in range(block - 1, -1, -1):
            if not p.blocks[index]:
                continue
            for e in p.blocks[index]:
                if e.away and self.tier.prefetch(e):
                    self._report.prefetches += 1
            return

    # -- release ---------------------------------------------------------------------------------------------

    def _drop(self, handle: _Handle) -> None:
        entry, p = handle.entry, handle.pass_
        with self._lock:
            if entry.tensor is not None:
                self._resident -= entry.nbytes
                entry.tensor = None
            if entry.token is not None and not self._closed:
                self.tier.release(entry)
            p.live -= 1
            if p.live == 0:  # the pass's last input: its backward is over (or it never had one)
                if p.begun and not self._closed:
                    self.tier.end_pass(p.token)
                    p.begun = False
                if p is self._pass:
                    self._pass = None
                    self._seen = {}

    # -- helpers ---------------------------------------------------------------------------------------------

    def _add_resident(self, n: int) -> None:
        self._resident += n
        self._report.peak_resident_bytes = max(self._report.peak_resident_bytes, self._resident)

    @staticmethod
    def _check_version(entry: Entry, t: torch.Tensor) -> None:
        if t._version != entry.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace"
                f" operation: the input of checkpointed block {entry.block} ({tuple(entry.shape)},"
                f" {entry.dtype}) is at version {t._version}; expected version {entry.version} instead"
            )

    def flush(self) -> None:
        """Wait until every offload and restore started so far has finished."""
        self.tier.flush()

    def take_report(self) -> CheckpointingReport:
        """The counts since the last call (NVMe bytes included), then start counting afresh."""
        with self._lock:
            rep, self._report = self._report, CheckpointingReport()
            self._report.peak_resident_bytes = self._resident
        io = self.tier.take_io()
        rep.nvme_write_bytes, rep.nvme_read_bytes = io["nvme_write_bytes"], io["nvme_read_bytes"]
        return rep

    def close(self) -> None:
        """Free the tier's buffers and files; handles still alive release nothing afterwards."""
        with self._lock:
            self._closed = True
            self._pass = None
            self._seen = {}
        self.tier.close()
