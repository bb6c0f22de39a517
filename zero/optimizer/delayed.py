"""DelayedUpdate: the host optimizer step of step t runs while step t+1's forward and backward run.

`zero_offload.delayed_update` (opt-in; docs/engine.md, "Delayed update"): with the optimizer state on the
host (`offload_optimizer.device` cpu or nvme) the host's Adam pass is the longest part of a step and the
device waits for it. Here, at the end of step t's window, the gradients are checked (the norm, clipping,
an fp16 overflow: all decided before anything runs) and copied aside, and the pass over them starts on a
worker thread; `step()` returns at once. Step t+1's forward and backward run on the weights from before that
update (one step of staleness). At step t+1's `step()` the pass is joined, committed and its weights put
into the parameters - before the forward of step t+2 that needs them - and step t+1's pass starts.

What the engine sees is exactly a training loop that applies step t's update after step t+1's forward and
backward (tests/test_delayed_update.py writes that loop in plain torch). The first `warmup_steps` steps are
ordinary ones. Checkpoints, state access and `close()` settle the pending update first (`settle`).

The pass writes no parameters while it runs: its chunk updates get a `NullWriter`, and the committed master
goes into the parameters at the join (so the master may not be the parameter buffer: the engine builds the
state with no alias when this is on).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from offload.config import ZeroOffloadConfig
from zero.layout.base import Layout
from zero.optimizer.state import OptimizerState
from zero.optimizer.update import UpdatePass
from zero.report import StepReport

__all__ = ["DelayedUpdate", "NullWriter", "check_delayed", "make_delayed"]


class NullWriter:
    """A parameter writer that writes nothing: the delayed pass leaves the parameters to the join."""

    h2d_bytes = 0

    def param_copy(self, start: int, n: int) -> Optional[torch.Tensor]:
        """No 16-bit copy for the kernel to write."""
        return None

    def after_update(self, start: int, n: int, master: torch.Tensor) -> None:
        """Nothing to move."""

    def finish(self) -> None:
        """Nothing in flight."""

    def settle(self) -> None:
        """Nothing in flight."""

    def close(self) -> None:
        """No buffers."""


@dataclass
class _Pending:
    """A pass started on the worker thread and not yet joined."""

    thread: threading.Thread
    step: int
    h2d0: int
    sq: Optional[List[float]]  # the gradients' squares, summed by the pass (when the norm was not first)
    grad_scale: float
    start_s: float = 0.0
    end_s: float = 0.0
    ok: bool = False
    error: Optional[BaseException] = None


class DelayedUpdate:
    """Runs the engine's optimizer steps one step late, each on a worker thread (see the module doc)."""

    def __init__(
        self,
        update: UpdatePass,
        opt: OptimizerState,
        layout: Layout,
        *,
        warmup_steps: int,
    ) -> None:
        self.update, self.opt, self.layout = update, opt, layout
        self.warmup_steps = int(warmup_steps)
        self.steps_started = 0  # passes started (skipped steps excluded), warmup ones included
        self._pending: Optional[_Pending] = None
        self._grads: Optional[torch.Tensor] = None  # the gradients the pending pass reads (a copy)
        self._chunks_done = 0
        self._done = threading.Condition()
        self._null = NullWriter()

    @property
    def pending(self) -> bool:
        """Whether an update was started and not yet applied to the parameters."""
        return self._pending is not None

    def run(self, rep: StepReport) -> bool:
        """The end of an accumulation window: apply the pending update, then start this window's (ordinary
        during warmup: finished before this returns). True when this window's step was skipped (overflow:
        nothing started)."""
        self.settle(rep)
        rep.device_to_host_bytes += self.layout.gradients_to_host()
        grad_scale, overflow = self.update.grad_scale_and_overflow(False)  # the norm before anything runs
        if overflow:
            return True
        norm_first = self.update.gradient_clipping > 0 or self.update.check_overflow
        src = self.layout.grad_host
        if self._grads is None or self._grads.shape != src.shape or self._grads.dtype != src.dtype:
            self._grads = torch.empty_like(src, device="cpu")
        self._grads.copy_(src)  # the next window's backward accumulates into grad_host
        step = self.opt.optimizer.step_count + 1
        sq: Optional[List[float]] = None if norm_first else []
        writer, self.opt.writer = self.opt.writer, self._null  # type: ignore[assignment]
        try:
            group = self.opt.optimizer.param_groups[0]
            update = self.opt.chunk_update(self._grads, step, group, grad_scale, False, self._chunk, sq=sq)
        finally:
            self.opt.writer = writer
        pending = _Pending(
            threading.Thread(target=lambda: None), step, self.opt.writer.h2d_bytes, sq, grad_scale
        )
        self._chunks_done = 0

        def work() -> None:
            pending.start_s = time.perf_counter()
            try:
                pending.ok = self.opt.run(update)
            except BaseException as e:  # noqa: BLE001 - raised on the main thread by the join
                pending.error = e
            finally:
                pending.end_s = time.perf_counter()
                with self._done:
                    self._done.notify_all()

        self.steps_started += 1
        if self.steps_started <= self.warmup_steps:  # an ordinary step
            work()
            self._pending = pending
            self._finish(pending, rep, hidden=False)
            return False
        pending.thread = threading.Thread(target=work, name="zero-delayed-update", daemon=True)
        self._pending = pending
        pending.thread.start()
        return False

    def _chunk(self) -> None:
        with self._done:
            self._chunks_done += 1

    def wait_done(self, timeout: float) -> bool:
        """Block until the pending pass finished its chunks (True), or `timeout` seconds passed / none is
        pending (False). For callers that must see the overlap happen, e.g. from a forward hook."""
        pending = self._pending
        if pending is None:
            return False
        with self._done:
            return self._done.wait_for(lambda: pending.end_s > 0, timeout=timeout)

    def settle(self, rep: StepReport) -> None:
        """Apply the pending update, if any: wait for its pass, commit it, put the weights into the
        parameters; its counts go into `rep`, with the time and chunks that ran before this call (hidden
        behind whatever the caller did meanwhile). A failed pass raises here (the previous state kept, or
        poisoned when a memory tier was torn)."""
        pending = self._pending
        if pending is None:
            return
        self._finish(pending, rep, hidden=True)

    def _finish(self, pending: _Pending, rep: StepReport, hidden: bool) -> None:
        join_s = time.perf_counter()
        with self._done:
            chunks_before = self._chunks_done
        if pending.thread.ident is not None:
            pending.thread.join()
        self._pending = None
        if hidden:
            rep.host_step_hidden_s += max(0.0, min(pending.end_s, join_s) - pending.start_s)
            rep.optimizer_chunks_hidden += chunks_before
            rep.delayed_updates += 1
        rep.host_step_s += pending.end_s - pending.start_s
        if pending.error is not None:
            self.opt.fail_pass(pending.error, pending.step)  # raises
        self.opt.end_pass(pending.ok, pending.step, rep, pending.h2d0)
        if pending.sq is not None:
            self.update.set_norm_from_chunks(pending.sq, pending.grad_scale)
        self.layout.put_master(self.opt.writer, self.opt.tier)  # the weights, before the next forward
        self.opt.writer.finish()


def check_delayed(cfg: ZeroOffloadConfig, *, offload_device: str, stage: int, world: int = 1) -> None:
    """ValueError, before anything is built, for placements `zero_offload.delayed_update` does not serve:
    an optimizer on the training device (no host step to hide), stage 3 (its parameters are written per
    unit), Twin-Flow's device share (`offload_optimizer.ratio` below 1.0: updated in place on the device
    while the next forward would read it), several ranks (a settle outside `step()` would have to gather
    every rank's partition). Nothing when the delayed update is off."""
    if not cfg.zero_offload.delayed_update.enabled:
        return
    where = "zero_offload.delayed_update.enabled=true"
    if offload_device not in ("cpu", "nvme"):
        raise ValueError(
            f"{where}: the optimizer steps on the training device (offload_optimizer.device="
            f"{offload_device!r}), so there is no host step to hide; offload the optimizer to 'cpu' or "
            "'nvme', or turn the delayed update off"
        )
    if world > 1:
        raise ValueError(
            f"{where} runs on one rank for now ({world} ranks here: applying a pending update outside "
            "step() would need every rank's partition gathered); use one rank, or turn it off"
        )
    if stage >= 3:
        raise ValueError(
            f"{where} is supported at zero_optimization.stage 0-2 (stage {stage} writes the parameters per "
            "unit); use stage 1 or 2 with offload_optimizer, or turn the delayed update off"
        )
    off = cfg.zero_optimization.offload_optimizer
    ratio = float(off.ratio) if off is not None else 1.0
    if ratio < 1.0:
        raise ValueError(
            f"{where}: offload_optimizer.ratio={ratio} keeps a share of the optimizer state on the device, "
            "updated in place while the next forward would read it; use ratio 1.0 with the delayed update, "
            "or turn it off"
        )


def make_delayed(
    cfg: ZeroOffloadConfig, update: UpdatePass, opt: OptimizerState, layout: Layout
) -> Optional[DelayedUpdate]:
    """The engine's DelayedUpdate when `zero_offload.delayed_update.enabled`, else None."""
    d = cfg.zero_offload.delayed_update
    return DelayedUpdate(update, opt, layout, warmup_steps=d.warmup_steps) if d.enabled else None
