"""Where a checkpointed block's saved inputs wait for the backward: the tiers of the activation stash.

A tier moves one saved input (an `Entry`) away after the block's forward and brings it back before the
recompute that needs it:

* `DeviceTier` (offload_device "none"): the tensor stays where it is. With contiguous_memory_optimization
  it is copied into one of `number_checkpoints` buffers preallocated on its device and reused every pass.
* `HostTier` ("cpu"): a device tensor goes to pinned host memory on a side stream and comes back on that
  stream when prefetched; the compute stream waits only for the copy it needs. A tensor already in host
  memory stays (there is nothing to move), or, with contiguous_memory_optimization, goes into a
  preallocated pinned slot.
* `NvmeTier` ("nvme", zero.activations.nvme): scratch files written and read on an I/O thread.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from offload.pinned import PinnedPool
from offload.swap.space import align_up

__all__ = [
    "CheckpointBufferError",
    "DeviceTier",
    "Entry",
    "HostBuffers",
    "HostTier",
    "Tier",
    "bytes_view",
]


class CheckpointBufferError(RuntimeError):
    """A checkpoint did not fit the preallocated buffers (contiguous_memory_optimization)."""


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s storage as a flat uint8 tensor (no copy; `t` must be contiguous)."""
    return t.reshape(-1).view(torch.uint8)


class Entry:
    """One saved input of a checkpointed block, from the block's forward until autograd releases it."""

    __slots__ = ("tensor", "shape", "dtype", "device", "nbytes", "version", "block", "token", "__weakref__")

    def __init__(self, tensor: torch.Tensor, block: int) -> None:
        self.tensor: Optional[torch.Tensor] = tensor
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.version = tensor._version
        self.block = block
        self.token: Any = None  # the tier's record of where the bytes are while the tensor is away

    @property
    def away(self) -> bool:
        """Whether the tensor is held by the tier rather than in `tensor`."""
        return self.tensor is None

    def from_bytes(self, flat: torch.Tensor) -> torch.Tensor:
        """The entry's tensor viewed from `flat`, a uint8 buffer of at least `nbytes`."""
        return flat[: self.nbytes].view(self.dtype).view(self.shape)


class Tier:
    """The interface the stash uses; `DeviceTier` keeps everything in place."""

    name = "none"

    def moves(self, t: torch.Tensor) -> bool:
        """Whether `offload` would take a tensor like `t` away at all."""
        return False

    def begin_pass(self) -> Any:
        """Per-pass state for the offloads of a new pass (given back to `offload` and `end_pass`)."""
        return None

    def offload(self, entry: Entry, pass_token: Any) -> int:
        """Start moving `entry.tensor` away (it is contiguous); returns the bytes moved."""
        return 0

    def prefetch(self, entry: Entry) -> bool:
        """Start bringing an away entry back; False if that is under way already (or needs no start)."""
        return False

    def restore(self, entry: Entry) -> torch.Tensor:
        """The entry's tensor on its own device, ready for the compute stream; frees the tier's copy."""
        raise AssertionError("restore of an entry that was never offloaded")

    def release(self, entry: Entry) -> None:
        """Autograd dropped an entry that may still be away: free what holds it."""

    def end_pass(self, pass_token: Any) -> None:
        """No entry of that pass is alive any more."""

    def flush(self) -> None:
        """Wait until the moves started so far have finished (synchronize_checkpoint_boundary)."""

    def take_io(self) -> Dict[str, int]:
        """Bytes written to and read from NVMe since the last call."""
        return {"nvme_write_bytes": 0, "nvme_read_bytes": 0}

    def close(self) -> None:
        """Free every buffer and file; the tier is not used again."""


class _Slots:
    """`count` preallocated byte buffers of one size on one device (pinned when in host memory)."""

    def __init__(self, count: int, nbytes: int, device: torch.device, pool: Optional[PinnedPool]) -> None:
        self.nbytes = nbytes
        self.pool = pool if device.type == "cpu" else None
        if self.pool is not None:
            self.buffers = [self.pool.allocate(nbytes, torch.uint8, populate="sync") for _ in range(count)]
        else:
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
        self.free = list(range(count - 1, -1, -1))

    def take(self, nbytes: int) -> int:
        if nbytes > self.nbytes:
            raise CheckpointBufferError(
                f"a checkpoint of {nbytes} bytes does not fit the {self.nbytes}-byte buffers that"
                " activation_checkpointing.contiguous_memory_optimization preallocated for the first"
                " checkpoint; checkpoint blocks whose inputs are the same size, or turn the option off"
            )
        if not self.free:
            raise CheckpointBufferError(
                f"more checkpoints are alive than activation_checkpointing.number_checkpoints"
                f" ({len(self.buffers)}): raise it to the number of checkpointed blocks of one forward"
            )
        return self.free.pop()

    def give(self, index: int) -> None:
        self.free.append(index)

    def close(self) -> None:
        if self.pool is not None:
            for b in self.buffers:
                self.pool.free(b)
        self.buffers = []


class DeviceTier(Tier):
    """offload_device "none"; with `slots` (contiguous_memory_optimization) copies into reused buffers."""

    def __init__(self, slots: Optional[int] = None, pool: Optional[PinnedPool] = None) -> None:
        self._count = slots
        self._pool = pool
        self._slots: Optional[_Slots] = None

    def moves(self, t: torch.Tensor) -> bool:
        """Whether preallocated device slots are configured (contiguous_memory_optimization)."""
        return self._count is not None

    def offload(self, entry: Entry, pass_token: Any) -> int:
        """Copy `entry` into a device slot (the slots are made on first use); 0 bytes moved off the device."""
        if self._slots is None:
            self._slots = _Slots(self._count, entry.nbytes, entry.device, self._pool)
        index = self._slots.take(entry.nbytes)
        self._slots.buffers[index][: entry.nbytes].copy_(bytes_view(entry.tensor))
        entry.token = index
        entry.tensor = None
        return 0  # the bytes stay on their device

    def restore(self, entry: Entry) -> torch.Tensor:
        # a view of the slot: it is handed back when autograd releases the entry
        """A view of `entry`'s slot, handed back when autograd releases the entry."""
        return entry.from_bytes(self._slots.buffers[entry.token])

    def release(self, entry: Entry) -> None:
        """Give `entry`'s slot back."""
        if entry.token is not None and self._slots is not None:
            self._slots.give(entry.token)
            entry.token = None

    def close(self) -> None:
        """Free the slots."""
        if self._slots is not None:
            self._slots.close()


class HostBuffers:
    """Pinned byte buffers under the pool's cap, recycled by size (or fixed slots when preallocated).
    Sizes are rounded up to 4 KiB, so a buffer can be written to and read from files with O_DIRECT."""

    def __init__(self, pool: PinnedPool, slots: Optional[int]) -> None:
        self.pool = pool
        self._count = slots
        self._slots: Optional[_Slots] = None
        self._free: Dict[int, List[torch.Tensor]] = {}
        self._lock = threading.Lock()

    @property
    def preallocated(self) -> bool:
        """Whether these are `number_checkpoints` fixed slots (contiguous_memory_optimization)."""
        return self._count is not None

    def take(self, nbytes: int) -> Tuple[torch.Tensor, Any]:
        """A buffer of at least `nbytes` and the key that gives it back."""
        nbytes = align_up(nbytes, _HOST_ALIGN)
        with self._lock:
            if self._count is not None:
                if self._slots is None:
                    self._slots = _Slots(self._count, nbytes, torch.device("cpu"), self.pool)
                index = self._slots.take(nbytes)
                return self._slots.buffers[index], index
            spare = self._free.get(nbytes)
            if spare:
                buf = spare.pop()
                return buf, buf
        buf = self.pool.allocate(nbytes, torch.uint8)
        return buf, buf

    def give(self, key: Any) -> None:
        """Return a buffer taken by `take` (a slot index or a pinned tensor) for reuse."""
        with self._lock:
            if isinstance(key, int):
                self._slots.give(key)
            else:
                self._free.setdefault(key.numel(), []).append(key)

    def close(self) -> None:
        """Free every pinned buffer and slot back to the pool."""
        with self._lock:
            for bufs in self._free.values():
                for b in bufs:
                    self.pool.free(b)
            self._free = {}
            if self._slots is not None:
                self._slots.close()


_HOST_ALIGN = 4096


class HostTier(Tier):
    """offload_device "cpu": device tensors to pinned host memory on a side stream and back on it."""

    name = "cpu"

    def __init__(self, buffers: HostBuffers) -> None:
        self.buffers = buffers
        self._streams: Dict[torch.device, Any] = {}

    def moves(self, t: torch.Tensor) -> bool:
        """Whether `t` leaves its device: device tensors always, CPU tensors only into preallocated slots."""
        return t.device.type != "cpu" or self.buffers.preallocated

    def side_stream(self, device: torch.device) -> Any:
        """The copy stream of `device` (one per device, made on first use)."""
        if device not in self._streams:
            self._streams[device] = torch.Stream(device=device)
        return self._streams[device]

    def offload(self, entry: Entry, pass_token: Any) -> int:
        """Copy `entry` into pinned host memory (from a device on a side stream); the bytes moved."""
        t = entry.tensor
        buf, key = self.buffers.take(entry.nbytes)
        if t.device.type == "cpu":
            buf[: entry.nbytes].copy_(bytes_view(t))
            entry.token = [buf, key, None, None]
        else:
            side = self.side_stream(t.device)
            side.wait_stream(torch.accelerator.current_stream(t.device))
            with side:
                buf[: entry.nbytes].copy_(bytes_view(t), non_blocking=True)
                done = side.record_event()
            t.record_stream(side)  # the allocator keeps t's memory until the copy has read it
            entry.token = [buf, key, done, None]
        entry.tensor = None
        return entry.nbytes

    def prefetch(self, entry: Entry) -> bool:
        """Start copying a device entry back on a side stream; False if under way already or on the CPU."""
        token = entry.token
        if token[3] is not None or entry.device.type == "cpu":
            return False
        current = torch.accelerator.current_stream(entry.device)
        out = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
        side = self.side_stream(entry.device)
        side.wait_stream(current)  # `out` was allocated on the compute stream
        with side:
            out.copy_(token[0][: entry.nbytes], non_blocking=True)
            ready = side.record_event()
        out.record_stream(side)
        token[3] = (out, ready)
        return True

    def restore(self, entry: Entry) -> torch.Tensor:
        """`entry`'s tensor on its device, the compute stream ordered after its copy back; frees the host
        buffer."""
        if entry.device.type == "cpu":
            # contiguous slots: a view of the pinned slot, handed back when autograd releases the entry
            return entry.from_bytes(entry.token[0])
        self.prefetch(entry)
        buf, key, _, (out, ready) = entry.token
        torch.accelerator.current_stream(entry.device).wait_event(ready)
        entry.token = None
        self.buffers.give(key)  # its next use is a copy on the same side stream, ordered after this one
        return entry.from_bytes(out)

    def release(self, entry: Entry) -> None:
        """Give `entry`'s host buffer back."""
        if entry.token is not None:
            self.buffers.give(entry.token[1])
            entry.token = None

    def close(self) -> None:
        """Free the host buffers."""
        self.buffers.close()
