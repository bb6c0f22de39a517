"""Speculative sub-group steps under gradient clipping: step during backward, validate after it.

With gradient clipping the coefficient `clip / (norm + 1e-6)` needs the global gradient norm, known only
when backward ended. The pass during backward (zero.optimizer.overlap, NVMe sub-groups in two copies) does
not wait for it: it steps each sub-group as its gradients become final with coefficient 1 - what the step
after backward uses whenever clipping does not trigger. Once backward ended, `validate` computes the norm
exactly as the step after backward does (the same sum over the same gradients, so the same float) and
decides:

* the true divisor equals the one the pass used (clipping did not trigger): the speculative steps stand;
* an overflow (fp16, or bf16 with `check_grad_overflow`): the pass is dropped and the step skipped, as
  after backward;
* clipping triggered: the pass is dropped - the two-copy swapper's live copy still holds every sub-group's
  pre-step master and states, and the parameters are put back from it - and the ordinary pass redoes the
  step with the true coefficient. `StepReport.optimizer_chunks_redone` counts the sub-groups redone.

Every outcome is bit-identical to stepping after backward (tests/test_overlap.py).
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch

from zero.layout.base import Layout
from zero.optimizer.overlap import OverlapPass, PassResult
from zero.optimizer.state import OptimizerState
from zero.report import StepReport

__all__ = ["SpeculativeUpdate", "validate"]


class SpeculativeUpdate(Protocol):
    """What `validate` needs from the update pass (zero.optimizer.update.UpdatePass)."""

    opt: OptimizerState
    overlap: OverlapPass
    layout: Layout

    @property
    def speculative_scale(self) -> float:
        """The gradient divisor the speculative pass stepped with (clipping coefficient 1)."""
        ...

    @property
    def speculative_grads(self) -> torch.Tensor:
        """The gradients the speculative pass read, for the norm computed after backward."""
        ...

    def grad_scale_and_overflow(self, fused_check: bool) -> Tuple[float, bool]:
        """The true gradient divisor (loss scale, world size, clipping) and whether a value overflowed."""
        ...

    def run(self, rep: StepReport) -> bool:
        """The ordinary pass after backward; True when the step was skipped (overflow)."""
        ...


def validate(update: SpeculativeUpdate, result: PassResult, rep: StepReport) -> Optional[bool]:
    """After the speculative pass was joined: None when its steps stand (the caller finishes the pass as
    usual), else whether the step was skipped - the pass already dropped, and redone with the true
    clipping coefficient unless it overflowed. A pass that raised is left to the caller (None)."""
    if result.error is not None:
        return None
    opt, overlap = update.opt, update.overlap
    if opt.split_pass:  # the resident share final (fetched from a GPU) before the norm reads it
        ready = overlap.ready_fn()
        for c in range(opt.resident_share()[1]):
            ready(c)
    layout = update.layout
    if update.speculative_grads.data_ptr() != layout.grad_host.data_ptr():
        # the pass read 16-bit gradients in place: the norm after backward reads the host partition
        rep.device_to_host_bytes += layout.gradients_to_host()
    scale, overflow = update.grad_scale_and_overflow(False)  # the step after backward's norm, to the bit
    if result.ok and not overflow and scale == update.speculative_scale:
        return None
    rep.device_to_host_bytes += overlap.take_fetched_bytes()
    opt.drop_pass(None)  # the live copy is the pre-step state: the parameters are put back from it
    if overflow:
        return True
    rep.optimizer_chunks_redone += overlap.chunks_updated
    return update.run(rep)  # the ordinary pass, with the true coefficient
