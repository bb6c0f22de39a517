"""Host-to-device copies on a side stream, ordered against the compute stream.

Stage 3 copies partitions from host memory (the `cpu` tier, or an NVMe staging slot) to the compute device
while the compute stream runs the layers before. Two rules of torch's caching allocator keep that safe:

- A copy into a buffer allocated on the compute stream first waits for the work the compute stream has
  queued so far: the allocator may have handed out memory that a kernel still pending reads.
- A buffer allocated on the side stream (`empty`, a gathered buffer; `copy_ahead`) and used on the
  compute stream is marked with `record_stream`, so that once freed its memory is not handed out again
  before that work has run; a copy into it need not wait for the compute stream, so it overlaps the layers
  queued before it.

In both cases the compute stream waits on the copy's event before it uses the buffer. The copy's event
also says when the host source may be overwritten (`wait`). On the CPU every call is a plain synchronous
copy and the events are None: the same calls serve both, so the store's logic runs on a machine without
an accelerator.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["SideStream"]


class SideStream:
    """One side stream per accelerator device, created on first use, for copies from host memory."""

    def __init__(self) -> None:
        self._streams: Dict[torch.device, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised buffer on `device` allocated on the side stream and marked as used by the
        compute stream: copies into it (`copy(..., fresh=True)`) start without waiting for the compute
        stream."""
        if device.type != "cuda":
            return torch.empty(numel, dtype=dtype, device=device)
        with torch.cuda.stream(self._stream(device)):
            t = torch.empty(numel, dtype=dtype, device=device)
        t.record_stream(torch.cuda.current_stream(device))
        return t

    def copy(self, dst: torch.Tensor, src: torch.Tensor, fresh: bool = False) -> Optional[Any]:
        """Copy `src` into `dst`; work queued on the compute stream from now on runs after the copy.
        `fresh`: `dst` comes from `empty` (else it was allocated on the compute stream, and the copy first
        waits for the work queued there). Returns the copy's event (None on the CPU: already done)."""
        if dst.device.type != "cuda":
            dst.copy_(src)
            return None
        compute = torch.cuda.current_stream(dst.device)
        if not fresh:
            self._stream(dst.device).wait_stream(compute)  # dst may be a block pending kernels still read
        event = self._side_copy(dst, src)
        compute.wait_event(event)
        return event

    def copy_ahead(self, src: torch.Tensor, device: torch.device) -> Tuple[torch.Tensor, Optional[Any]]:
        """A new tensor on `device` (from `empty`) with `src`'s values, copied on the side stream without
        waiting for the compute stream; `take` it before use. Returns it and the copy's event (None on the
        CPU)."""
        if device.type != "cuda":
            return src.to(device, copy=True), None
        dst = self.empty(src.numel(), src.dtype, device).view(src.shape)
        return dst, self._side_copy(dst, src)

    def _side_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        side = self._stream(dst.device)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event

    @staticmethod
    def take(t: torch.Tensor, event: Optional[Any]) -> torch.Tensor:
        """`t` from `copy_ahead`, ready for the compute stream: work queued from now on runs after its copy
        (its memory already outlives that work: `empty`)."""
        if event is not None:
            torch.cuda.current_stream(t.device).wait_event(event)
        return t

    @staticmethod
    def wait(event: Optional[Any]) -> None:
        """Block until the copy of `event` has finished (its host source may then be reused or freed)."""
        if event is not None:
            event.synchronize()
