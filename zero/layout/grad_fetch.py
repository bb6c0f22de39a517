"""Gradients of one chunk brought from the GPU to the host partition once backward has produced them.

Stages 0-2 on CUDA with the optimizer stepped during backward (offload_optimizer.pipeline_read /
pipeline_write): the optimizer thread must not read a chunk's gradients before the kernels that produce
them ran. The hook that completes a chunk runs on autograd's device thread, where the current stream is the
one backward computes on; `chunk_ready` records an event there. The optimizer thread then copies the chunk
on a stream of its own, ordered after that event, and waits for the copy only (not for all of backward).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["D2H_PIECE_NUMEL", "DeviceGradFetch", "copy_to_host"]

# A non-blocking device-to-host copy that changes dtype (16-bit gradients into the fp32 host partition)
# converts on the GPU first, into a temporary of the destination's size: copies go in pieces of at most this
# many elements, so that temporary stays at 64 MiB whatever the model's size.
D2H_PIECE_NUMEL = 1 << 24


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, start: int, n: int) -> None:
    """Queue `dst[start:start+n] = src[start:start+n]` (non-blocking) on the current stream; from a GPU with
    a dtype change, in pieces of D2H_PIECE_NUMEL elements. The caller waits for the stream."""
    piece = D2H_PIECE_NUMEL if src.is_cuda and src.dtype != dst.dtype else max(1, n)
    for a in range(start, start + n, piece):
        z = min(a + piece, start + n)
        dst[a:z].copy_(src[a:z], non_blocking=True)


class DeviceGradFetch:
    """Copies chunk c of `src` (device gradients) into `dst` (pinned host) after backward produced it.

    `chunks`: (start, numel) in the coordinates both `src` and `dst` share. `begin()` before each backward;
    `chunk_ready(c)` from the gradient hooks (GradReadiness.on_ready); `backward_done()` when backward
    returned, before the gate opens the chunks no hook completed (parameters without a gradient);
    `fetch(c)` on the optimizer thread once the gate let chunk c through.
    """

    def __init__(
        self, src: torch.Tensor, dst: torch.Tensor, chunks: Sequence[Tuple[int, int]], device: torch.device
    ) -> None:
        self.src, self.dst, self.chunks, self.device = src, dst, list(chunks), device
        self._stream = torch.cuda.Stream(device=device)
        self._events = [torch.cuda.Event() for _ in self.chunks]
        self._end = torch.cuda.Event()
        self._recorded: List[bool] = [False] * len(self.chunks)
        self._ended = False
        self.bytes = 0  # copied by this pass

    def begin(self) -> None:
        """Start a pass: no chunk recorded, backward not ended, no bytes counted."""
        self._recorded = [False] * len(self.chunks)
        self._ended = False
        self.bytes = 0  # a pass that was dropped moved nothing the step keeps

    def chunk_ready(self, c: int) -> None:
        """Record that chunk `c`'s gradients are final on the stream backward computes on."""
        self._events[c].record(torch.cuda.current_stream(self.device))
        self._recorded[c] = True

    def backward_done(self) -> None:
        """Record backward's end: chunks no hook recorded are final after it."""
        self._end.record(torch.cuda.current_stream(self.device))
        self._ended = True

    def fetch(self, c: int) -> None:
        """Copy chunk `c`'s gradients to the host partition once they are final, on the fetch's own stream."""
        event: Optional[torch.cuda.Event] = self._events[c] if self._recorded[c] else None
        if event is None:
            if not self._ended:
                raise RuntimeError(f"gradient chunk {c} fetched before backward produced it")
            event = self._end
        start, n = self.chunks[c]
        self._stream.wait_event(event)
        with torch.cuda.stream(self._stream):
            copy_to_host(self.dst, self.src, start, n)
        self._stream.synchronize()
        self.bytes += n * self.src.element_size()

    def take_bytes(self) -> int:
        """Bytes fetched since the last call (resets the count)."""
        out, self.bytes = self.bytes, 0
        return out
