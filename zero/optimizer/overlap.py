"""OverlapPass: the optimizer pass that steps NVMe sub-groups during backward.

With `offload_optimizer.pipeline_read` / `pipeline_write` each sub-group (chunk of the optimizer partition)
is stepped as soon as its gradients are final, so its NVMe read, update and write overlap the rest of
backward. The pass runs on a worker thread; `GradReadiness` (zero.layout.partition) blocks it on each chunk
until the gradient sources that chunk covers (flat parameters at stages 0-2, units at stage 3) were reported
by `source_ready`. On a GPU a `DeviceGradFetch` copies each ready chunk's gradients to the host first.

The engine decides when the pass may run (two NVMe copies so it can be dropped, one rank; with gradient
clipping its steps are speculative, zero.optimizer.speculative) and what it does (`start(run)`); this object
owns the thread, the gate and the counts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

from zero.layout.grad_fetch import DeviceGradFetch
from zero.layout.partition import GradReadiness

__all__ = ["OverlapPass", "PassResult"]

ReadyFn = Callable[[int], bool]


@dataclass
class PassResult:
    """How a pass run on the worker thread ended: `ok` False on overflow, `error` if it raised."""

    ok: bool
    error: Optional[BaseException] = None


class OverlapPass:
    """Created disabled; `enable(gate, fetch)` once the optimizer's chunks are known."""

    def __init__(self) -> None:
        self._gate: Optional[GradReadiness] = None
        self._fetch: Optional[DeviceGradFetch] = None
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[PassResult] = None
        self._in_backward = False
        self._progress = threading.Condition()
        self.chunks_updated = 0  # chunks the running (or last) pass updated
        self.chunks_in_backward = 0  # of those, updated before backward ended

    # ---------------------------------------------------------------------------------------- state
    def enable(self, gate: GradReadiness, fetch: Optional[DeviceGradFetch] = None) -> None:
        """Let boundary backwards step the optimizer, gated on `gate` (and `fetch` from a GPU)."""
        self._gate = gate
        self._fetch = fetch

    @property
    def enabled(self) -> bool:
        """Whether boundary backwards step the optimizer while they run."""
        return self._gate is not None

    @property
    def running(self) -> bool:
        """A pass was started and not yet joined (between a boundary backward and step())."""
        return self._thread is not None

    @property
    def fetch(self) -> Optional[DeviceGradFetch]:
        """The copy of ready gradients from a GPU to the host, or None."""
        return self._fetch

    def ready_fn(self) -> ReadyFn:
        """The worker's wait for chunk c: its gradients final (and, from a GPU, copied to the host)."""
        gate, fetch = self._gate, self._fetch
        assert gate is not None
        if fetch is None:
            return gate.wait

        def ready(c: int) -> bool:
            if not gate.wait(c):
                return False
            fetch.fetch(c)
            return True

        return ready

    def chunk_updated(self) -> None:
        """Called by the pass after each chunk it updated (counts the ones that beat backward's end)."""
        with self._progress:
            self.chunks_updated += 1
            if self._in_backward:
                self.chunks_in_backward += 1
            self._progress.notify_all()

    def wait_updated(self, n: int, timeout: float) -> bool:
        """Block until the running pass updated `n` chunks (False: not within `timeout` seconds, or no
        pass runs). For callers that must see the overlap happen, e.g. from a gradient hook."""
        with self._progress:
            return (
                self._progress.wait_for(
                    lambda: self.chunks_updated >= n or self._thread is None, timeout=timeout
                )
                and self.chunks_updated >= n
            )

    # ------------------------------------------------------------------------------------- lifetime
    def source_ready(self, index: int) -> None:
        """A gradient source is final (a hook fired): open the chunks waiting only for it."""
        if self._thread is not None:
            self._gate.param_ready(index)  # type: ignore[union-attr]

    def start(self, run: Callable[[ReadyFn], bool]) -> None:
        """Start `run(ready)` on the worker thread; it returns whether the pass finished without overflow."""
        gate = self._gate
        assert gate is not None and self._thread is None
        ready = self.ready_fn()

        def work() -> None:
            try:
                self._result = PassResult(run(ready))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread by join()
                self._result = PassResult(False, e)

        if self._fetch is not None:
            self._fetch.begin()
        gate.begin()
        self._result = None
        self.chunks_updated = self.chunks_in_backward = 0
        self._in_backward = True
        self._thread = threading.Thread(target=work, name="zero-optimizer-overlap", daemon=True)
        self._thread.start()

    def backward_done(self) -> None:
        """Backward ended: every chunk's gradients are final (also those no hook reported)."""
        self._in_backward = False
        if self._fetch is not None:
            self._fetch.backward_done()  # before the gate opens chunks no hook completed
        self._gate.all_ready()  # type: ignore[union-attr]

    def join(self) -> Optional[PassResult]:
        """Wait for the running pass; None if none runs."""
        thread = self._thread
        if thread is None:
            return None
        thread.join()
        self._thread = None
        self._in_backward = False
        result, self._result = self._result, None
        return result

    def cancel(self) -> Optional[PassResult]:
        """Stop the running pass at its next chunk and wait for it; None if none runs."""
        if self._thread is None:
            return None
        self._gate.cancel()  # type: ignore[union-attr]
        return self.join()

    def take_fetched_bytes(self) -> int:
        """Bytes the GPU gradient fetch moved to the host since the last call."""
        return self._fetch.take_bytes() if self._fetch is not None else 0
