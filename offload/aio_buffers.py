"""The buffers of offload.aio's requests: what memory a tensor, numpy array, buffer-protocol object or
device buffer resolves to (one contiguous host region, or device memory staged through pinned host memory),
and what must stay alive until the request completes (`IORegion`).

`DeviceBuffer` / `TorchDeviceBuffer` are public through offload.aio as well.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from offload.pinned import HostBuffer

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceBuffer", "IORegion", "TorchDeviceBuffer", "describe_type", "pinned_view", "resolve_buffer"]


class DeviceBuffer:
    """Memory the kernel cannot read or write directly; AioHandle stages it through pinned host memory.

    Subclass it to plug in another accelerator. `TorchDeviceBuffer` covers torch device tensors and objects
    with `__cuda_array_interface__` (CuPy). `host` below is a 1-D uint8 CPU tensor of exactly `nbytes`.
    """

    nbytes: int

    def copy_to_host(self, host: torch.Tensor) -> None:
        """Copy the device bytes into `host`; must be complete when it returns."""
        raise NotImplementedError

    def copy_from_host(self, host: torch.Tensor) -> None:
        """Copy `host` into the device bytes; must be complete (or ordered before any later use) on return."""
        raise NotImplementedError


class TorchDeviceBuffer(DeviceBuffer):
    """A contiguous torch tensor on a non-CPU device, seen as bytes."""

    def __init__(self, tensor: torch.Tensor) -> None:
        import torch

        if not tensor.is_contiguous():
            raise ValueError(
                f"{tensor.device} tensor of shape {tuple(tensor.shape)} with strides {tensor.stride()} "
                "is not contiguous; call .contiguous() first (a hidden copy would not see data read into it)"
            )
        self.tensor = tensor
        self._bytes = tensor.reshape(-1).view(torch.uint8)
        self.nbytes = self._bytes.numel()

    def copy_to_host(self, host: torch.Tensor) -> None:
        """Copy the tensor's bytes into host (blocking)."""
        host.copy_(self._bytes)  # blocking device -> host copy

    def copy_from_host(self, host: torch.Tensor) -> None:
        """Copy host into the tensor's bytes, finished on the device when it returns."""
        # Blocking: the pinned staging buffer is released right after this returns.
        self._bytes.copy_(host)
        if self._bytes.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self._bytes.device).synchronize()


class IORegion:
    """One request's host memory: (ptr, nbytes) plus whatever must stay alive until it completes."""

    __slots__ = ("ptr", "nbytes", "keepalive", "device", "staging", "unhold")

    def __init__(
        self,
        ptr: int,
        nbytes: int,
        keepalive: Any,
        device: Optional[DeviceBuffer] = None,
        staging: Optional[Tuple[HostBuffer, torch.Tensor]] = None,
    ) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.keepalive = keepalive
        self.device = device
        self.staging = staging
        # Ends the hold on memory that can be freed explicitly (PinnedBuffer.release()): it stays mapped
        # until the request is done, so a release() meanwhile cannot pull it from under the kernel.
        self.unhold: Optional[Callable[[], None]] = _hold_io(keepalive)

    def finish_read(self) -> None:
        """After the kernel filled the host memory: move staged bytes on to the device."""
        if self.device is not None and self.staging is not None:
            self.device.copy_from_host(self.staging[1])

    def release(self) -> None:
        """Drop the request's references and end its hold on explicitly freeable memory."""
        # Dropping the references frees a staging buffer at once (refcounting) unless a DeviceBuffer kept
        # the host tensor; freeing it explicitly could pull memory from under such a reference.
        self.staging = None
        self.keepalive = None
        self.device = None
        unhold, self.unhold = self.unhold, None
        if unhold is not None:
            unhold()


def _hold_io(keepalive: Any) -> Optional[Callable[[], None]]:
    """Hold the memory behind a buffer that can be unmapped explicitly (an object with `hold_io`: a
    PinnedBuffer, or the HostBuffer behind an `as_ctypes()` array) until the returned callable runs."""
    if not isinstance(keepalive, tuple) or len(keepalive) != 3:
        return None
    _, view, obj = keepalive
    exporters = (getattr(view, "obj", None), obj, getattr(obj, "obj", None))
    for owner in [o for e in exporters for o in (e, getattr(e, "_zo_owner", None))]:
        hold = getattr(owner, "hold_io", None)
        if hold is not None:
            hold()
            return owner.unhold_io
    return None


def describe_type(obj: Any) -> str:
    """The qualified type name of obj, for error messages."""
    return type(obj).__module__ + "." + type(obj).__qualname__


def _torch_region(
    torch: Any, t: torch.Tensor, for_read: bool
) -> Tuple[int, int, Any, Optional[DeviceBuffer]]:
    if t.layout != torch.strided:
        raise TypeError(
            f"tensor with layout {t.layout} cannot be used for file I/O; only strided tensors can"
        )
    if t.device.type == "meta":
        raise ValueError(
            f"meta tensor of shape {tuple(t.shape)} has no memory to read into or write from; materialize "
            "it first (to_empty(device=...))"
        )
    if t.device.type != "cpu":
        return 0, 0, t, TorchDeviceBuffer(t)
    if not t.is_contiguous():
        raise ValueError(
            f"CPU tensor of shape {tuple(t.shape)} with strides {t.stride()} is not contiguous; call "
            ".contiguous() first (a hidden copy would not see the data read into it)"
        )
    if t.is_conj() or t.is_neg():
        raise ValueError(
            "tensor has a lazy conjugate/negative bit set; call .resolve_conj()/.resolve_neg() first"
        )
    return t.data_ptr(), t.numel() * t.element_size(), t, None


def _buffer_region(obj: Any, for_read: bool) -> Tuple[int, int, Any]:
    import numpy as np

    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{describe_type(obj)} is not a usable I/O buffer: pass a contiguous CPU torch.Tensor, a numpy "
            "array, a writable buffer-protocol object (bytearray, memoryview, mmap, PinnedBuffer), a CUDA "
            "tensor, a CuPy array or an offload.aio.DeviceBuffer"
        ) from None
    if not view.c_contiguous:
        shape, strides = view.shape, view.strides
        view.release()
        raise ValueError(
            f"{describe_type(obj)} buffer of shape {shape} with strides {strides} is not C-contiguous; "
            "make a contiguous copy first (a hidden copy would not see the data read into it)"
        )
    if for_read and view.readonly:
        view.release()
        raise ValueError(f"{describe_type(obj)} buffer is read-only and cannot be read into")
    # numpy gives the address of any contiguous buffer, read-only ones included, without copying; the array
    # holds the memoryview, which holds the export (so e.g. a bytearray cannot be resized while in flight).
    arr = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    return arr.__array_interface__["data"][0], view.nbytes, (arr, view, obj)


def resolve_buffer(buffer: Any, for_read: bool) -> Tuple[int, int, Any, Optional[DeviceBuffer]]:
    """(ptr, nbytes, keepalive, device) for any supported buffer; device set means staging is needed."""
    if isinstance(buffer, DeviceBuffer):
        return 0, 0, buffer, buffer
    torch = sys.modules.get("torch")  # a tensor can only exist if torch was imported; never import it here
    if torch is not None and isinstance(buffer, torch.Tensor):
        return _torch_region(torch, buffer, for_read)
    if hasattr(buffer, "__cuda_array_interface__"):
        if torch is None or not torch.cuda.is_available():
            raise TypeError(
                f"{describe_type(buffer)} lives in CUDA memory, but torch with CUDA is needed to stage it; "
                "pass a host buffer instead"
            )
        t = torch.as_tensor(buffer, device="cuda")
        return 0, 0, (buffer, t), TorchDeviceBuffer(t)
    ptr, nbytes, keep = _buffer_region(buffer, for_read)
    return ptr, nbytes, keep, None


def pinned_view(host: HostBuffer) -> torch.Tensor:
    """A 1-D uint8 tensor over a HostBuffer (keeps it alive)."""
    import torch

    return torch.frombuffer(host.as_ctypes(), dtype=torch.uint8)
