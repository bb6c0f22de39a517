"""UpdatePass: one optimizer pass over the rank's partition, after backward or during it.

The engine (zero.engine.engine) decides when a step happens; this object runs it: the gradient scale (loss
scale, world size, clipping coefficient folded into one divisor), the overflow check (fp16; bf16 with
`check_grad_overflow`), then the optimizer state's pass - the torch fused step on a GPU without offload, else
the fused CPU kernels chunk by chunk, committed only when every chunk succeeded. With the overlap enabled the
pass starts on a worker thread when backward starts (`start_overlapped`) and is finished, or dropped,
afterwards.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from zero.comm import settle
from zero.layout.base import Layout
from zero.optimizer.overlap import OverlapPass
from zero.optimizer.rules import ZeroOptimizer
from zero.optimizer.speculative import validate
from zero.optimizer.state import OptimizerState, sum_of_squares
from zero.report import StepReport

__all__ = ["UpdatePass"]


class UpdatePass:
    """Runs optimizer passes for the engine (see the module doc)."""

    def __init__(
        self,
        layout: Layout,
        opt: OptimizerState,
        overlap: OverlapPass,
        zopt: ZeroOptimizer,
        *,
        device: torch.device,
        world_size: int,
        stage: int,
        clipping: float,
        check_overflow: bool,
        loss_scale: Callable[[], float],
    ) -> None:
        self.layout, self.opt, self.overlap, self.zopt = layout, opt, overlap, zopt
        self.device, self.world_size, self.stage = device, world_size, stage
        self.gradient_clipping = clipping
        self.check_overflow = check_overflow
        self.loss_scale = loss_scale
        # The global gradient norm of the last step (DeepSpeed's get_global_grad_norm): a float, or a device
        # tensor not read yet (no synchronisation until someone asks); None before the first step.
        self._norm: Optional[Union[float, torch.Tensor]] = None
        self._overlap_sq: List[float] = []  # the pass during backward sums its chunks' squares here
        self._h2d0 = 0  # the writer's byte count when the overlapped pass started
        self._overlap_args: tuple = ()  # (gradients, step, group, scale) of the pass during backward

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The 2-norm of the last step's gradients over all ranks, unscaled (loss scale, accumulation and
        the mean over ranks applied) and before clipping: what torch's clip_grad_norm_ returns. inf or nan
        when that step overflowed; None before the first step."""
        if isinstance(self._norm, torch.Tensor):
            self._norm = float(self._norm)
        return self._norm

    def _norm_first(self, fused_check: bool) -> bool:
        """Whether the pass needs the norm before it starts (clipping, an overflow check outside the
        kernels); otherwise the pass sums each chunk's squares as it goes."""
        return self.gradient_clipping > 0 or (self.check_overflow and not fused_check)

    def _sum_over_ranks(self, sq: torch.Tensor) -> torch.Tensor:
        """This rank's sum of squares (a 1-element float64 tensor) -> the global one (stages 1-3 hold a
        partition of the gradients; float64, so a large sum of 16-bit squares never overflows to inf)."""
        if self.world_size > 1 and self.stage >= 1:
            sq = sq.to(self.device) if self.device.type == "cuda" else sq
            settle(dist.all_reduce(sq, async_op=True))
        return sq

    def set_norm_from_chunks(self, sq: List[float], grad_scale: float) -> None:
        """Set the step's gradient norm from the squares a pass summed chunk by chunk (`sq`)."""
        total = float(self._sum_over_ranks(torch.tensor([sum(sq)], dtype=torch.float64)).item())
        self._norm = math.sqrt(total) / grad_scale if math.isfinite(total) else math.inf

    def grad_scale_and_overflow(self, fused_check: bool) -> Tuple[float, bool]:
        """The divisor for raw gradient sums, and whether an overflow was already found."""
        grad_scale = self.loss_scale() * self.world_size  # sum over ranks -> mean, and unscale
        if not self._norm_first(fused_check):
            return grad_scale, False
        sq = torch.tensor([sum_of_squares(self.layout.grad_host)], dtype=torch.float64)
        total = float(self._sum_over_ranks(sq).item())
        norm = math.sqrt(total) / grad_scale if math.isfinite(total) else math.inf
        self._norm = norm
        if not math.isfinite(norm):
            return grad_scale, self.check_overflow
        if self.gradient_clipping > 0:
            coef = self.gradient_clipping / (norm + 1e-6)
            if coef < 1.0:
                grad_scale /= coef
        return grad_scale, False

    def run(self, rep: StepReport) -> bool:
        """Run the optimizer over this rank's partition; True when the step was skipped (overflow)."""
        opt = self.opt
        if self.overlap.running:
            return self._finish_overlapped(rep)
        rep.device_to_host_bytes += self.layout.gradients_to_host()
        # The fused check needs an atomic step (two NVMe copies) to discard a half-done pass.
        fused_check = self.check_overflow and opt.atomic and self.gradient_clipping <= 0
        norm_first = self._norm_first(fused_check)
        grad_scale, overflow = self.grad_scale_and_overflow(fused_check)
        if overflow:
            return True
        step = self.zopt.step_count + 1
        group = self.zopt.param_groups[0]
        if opt.device_step is not None:
            grad = self.layout.device_grad(grad_scale)
            if not norm_first:  # on the device, read only when asked for
                sq = torch.linalg.vector_norm(grad, dtype=torch.float32).pow(2).reshape(1)
                self._norm = self._sum_over_ranks(sq).sqrt()[0]
            opt.device_step.step(grad, step, group)
            self.layout.put_master(opt.writer, opt.tier)
            self.zopt.step_count = step
            return False
        h2d0 = opt.writer.h2d_bytes
        sq_chunks: Optional[List[float]] = None if norm_first else []
        update = opt.chunk_update(self.layout.grad_host, step, group, grad_scale, fused_check, sq=sq_chunks)
        try:
            ok = opt.run(update)
        except BaseException as e:
            opt.fail_pass(e, step)
        if fused_check and self.world_size > 1:
            flag = torch.tensor(
                [1.0 if ok else 0.0], device=self.device if self.device.type == "cuda" else "cpu"
            )
            settle(dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True))
            ok = bool(flag.item() > 0)
        if sq_chunks is not None:
            self.set_norm_from_chunks(sq_chunks, grad_scale)
        return opt.end_pass(ok, step, rep, h2d0)

    # --------------------------------------------------------------- optimizer steps during backward
    @property
    def speculative_scale(self) -> float:
        """The gradient divisor the pass during backward uses: loss scale and world size, clipping
        coefficient 1 (zero.optimizer.speculative validates it once backward ended)."""
        return float(self._overlap_args[3])

    @property
    def speculative_grads(self) -> torch.Tensor:
        """The gradients the pass during backward reads (zero.optimizer.speculative)."""
        return self._overlap_args[0]

    def start_overlapped(self) -> None:
        """Start the pass on the overlap's worker thread; it steps each chunk once its gradients are final
        (with clipping, speculatively: zero.optimizer.speculative)."""
        opt = self.opt
        fused_check = self.check_overflow  # an overflow stops the pass, nothing committed
        grad_scale = self.loss_scale() * self.world_size
        step = self.zopt.step_count + 1
        grad = self.layout.early_grads(self.overlap.fetch is not None)
        self._h2d0 = opt.writer.h2d_bytes
        group = self.zopt.param_groups[0]
        self._overlap_sq = []
        self._overlap_args = (grad, step, group, grad_scale)
        update = opt.chunk_update(
            grad, step, group, grad_scale, fused_check, self.overlap.chunk_updated, sq=self._overlap_sq
        )
        self.overlap.start(lambda ready: opt.run(update, ready=ready))

    def _step_resident(self) -> bool:
        """A split state's in-memory share, after its swapped share was stepped during backward: its
        gradients made final (fetched from a GPU), checked for overflow (when the step checks) before
        anything is updated in place, then stepped; False: overflow (the swapped share is then dropped
        uncommitted)."""
        grad, step, group, grad_scale = self._overlap_args
        ready = self.overlap.ready_fn()
        resident, chunks = self.opt.resident_share()
        for c in range(chunks):
            ready(c)
        if self.check_overflow:  # before anything is updated in place
            sq = sum_of_squares(grad[:resident])
            self._overlap_sq.append(sq)
            if not math.isfinite(sq):
                return False
        # without the check, the norm's squares are summed chunk by chunk as the update walks the gradients
        norm_sq = None if self.check_overflow else self._overlap_sq
        return self.opt.run_resident(self.opt.chunk_update(grad, step, group, grad_scale, False, sq=norm_sq))

    def _finish_overlapped(self, rep: StepReport) -> bool:
        """Wait for the pass started in backward, then commit it or keep the previous state."""
        result = self.overlap.join()
        assert result is not None
        if self.gradient_clipping > 0:
            decided = validate(self, result, rep)
            if decided is not None:
                return decided
        step = self.zopt.step_count + 1
        rep.optimizer_overlapped = True
        rep.optimizer_chunks_in_backward += self.overlap.chunks_in_backward
        try:
            if result.error is not None:
                self.opt.fail_pass(result.error, step)
            ok = result.ok
            if ok and self.opt.split_pass:
                try:
                    ok = self._step_resident()
                except BaseException as e:
                    self.opt.fail_pass(e, step)
        finally:  # after the resident share fetched its gradients too
            rep.device_to_host_bytes += self.overlap.take_fetched_bytes()
            moved = getattr(self.layout, "moved_grad_bytes", None)  # stage 2: what its buckets moved
            if moved is not None:
                rep.device_to_host_bytes += moved()
        if self.gradient_clipping <= 0:  # with clipping `validate` took the norm as after backward
            self.set_norm_from_chunks(self._overlap_sq, self.loss_scale() * self.world_size)
        return self.opt.end_pass(ok, step, rep, self._h2d0)

    def drop_overlapped(self) -> None:
        """Stop a pass started during backward and undo its effect on the parameters (state uncommitted)."""
        if not self.overlap.running:
            return
        result = self.overlap.cancel()
        self.opt.drop_pass(result.error if result is not None else None)
