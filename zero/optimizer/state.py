"""The optimizer's state: passes over the fp32 master and optimizer states of one rank's partition.

The state lives on a tier (zero.optimizer.tiers: `StateTier`, built by `build_tier`): device or pinned host
memory, NVMe swap files, or a split of those (`offload_optimizer.max_in_cpu`, `ratio`). This module uses the
tier protocol's members only and never asks which tier it holds.

`OptimizerState` runs a pass over the tier: the update rule's fused kernel on each chunk, then the
parameter writer (zero.layout.param_writer) copies the new weights out. It commits or drops the pass, puts the
committed master back into the parameters after a failure, and streams the state for checkpoints. On CUDA
without offload the update is torch's fused Adam on the device master (`FusedDeviceStep`); with offload and
a device share (`offload_optimizer.ratio` below 1.0) that share is stepped by torch too (the tier's
`device_part`, zero.optimizer.tiers.device_part), launched before the host walks the offloaded chunks.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, NoReturn, Optional, Tuple

import torch

from offload.swap.optimizer_swapper import STATE_TORCH_DTYPES
from offload.swap.slots import QUANT_BLOCK
from offload.swap.space import SwapSpace
from zero.layout.param_writer import ParamWriter
from zero.optimizer.integrity import StateGuard
from zero.optimizer.param_groups import groups_differ, pieces
from zero.optimizer.rules import UpdateRule, ZeroOptimizer
from zero.optimizer.state_convert import convert_states, format_of, warn_if_lossy
from zero.optimizer.tiers.base import ChunkFn, ReadyFn, StateInfo, StateTier, VisitFn
from zero.optimizer.tiers.device_part import FusedDeviceStep
from zero.report import StepReport

__all__ = ["OptimizerState", "sum_of_squares"]

Fill = Callable[[int, int, torch.Tensor], None]  # fill(start, n, out): fp32 master values
# Elements per piece of a host-memory sum of squares: a 16-bit piece cast to fp32 stays in cache (a whole
# cast would allocate and fault in a tensor the size of the gradients), and each fp32 partial sum is short
# enough to be accurate (one fp32 sum over 10^7 elements is off by ~1e-3).
SQ_PIECE = 1 << 18


def sum_of_squares(t: torch.Tensor) -> float:
    """The sum of the squared elements of `t` (fp32, bf16 or fp16) as a Python float: inf or nan when an
    element is. On the host, fp32 partial sums over SQ_PIECE elements are added in double; on a GPU, one
    reduction."""
    flat = t.reshape(-1)
    if flat.device.type != "cpu":
        return float(torch.linalg.vector_norm(flat, dtype=torch.float32)) ** 2
    total = 0.0
    for i in range(0, flat.numel(), SQ_PIECE):
        total += float(torch.linalg.vector_norm(flat[i : i + SQ_PIECE], dtype=torch.float32)) ** 2
    return total


def _held(err: Optional[BaseException]) -> bool:
    """Whether `err` says the last step is held in memory because its write-back keeps failing
    (offload.swap.optimizer_swapper.DeferredWriteError with `steps_lost` 0): nothing was lost or changed."""
    return isinstance(err, OSError) and getattr(err, "steps_lost", None) == 0


class OptimizerState:
    """Passes over one rank's optimizer state, and the state's way into and out of checkpoints.

    `put_master(writer, tier)` (from the layout) writes the committed master into the parameters;
    `on_step_lost()` is called when a step turns out lost (its deferred NVMe write failed) and the gradients
    computed on its weights must go."""

    def __init__(
        self,
        tier: StateTier,
        space: Optional[SwapSpace],
        writer: ParamWriter,
        rule: UpdateRule,
        optimizer: ZeroOptimizer,
        guard: StateGuard,
        put_master: Callable[[ParamWriter, StateTier], None],
        on_step_lost: Callable[[], None],
        device_step: Optional[FusedDeviceStep] = None,
        spans: Optional[List[Tuple[int, int, int]]] = None,
    ) -> None:
        """With a `tier.device_part` (Twin-Flow's device share stepped by torch) each pass launches that
        share's update first (`run`), and the chunk walk covers the offloaded share. `spans`: the runs of
        one param group over the partition (zero.optimizer.param_groups.group_spans; None: one group);
        chunks are updated run by run with their group's hyperparameters while the groups' values differ."""
        self.tier = tier
        self.space = space
        self.writer = writer
        self.rule = rule
        self.optimizer = optimizer
        self.guard = guard
        self.device_step = device_step
        self._put_master = put_master
        self._on_step_lost = on_step_lost
        self.pass_updates = 0  # chunks the running pass updated
        self.torn = False  # the running pass updated state in place (before `atomic_from`)
        self.device_part = tier.device_part
        self._device_args: Optional[tuple] = None  # what chunk_update gave the device share's launch
        runs = list(spans) if spans is not None else [(0, tier.numel, 0)]
        self.first_group = runs[0][2]  # the group of the partition's first run (of every run: one group)
        self._used = sorted({gi for _, _, gi in runs})
        self.spans = runs if len(self._used) > 1 else None
        self._span_starts = [a for a, _, _ in runs]

    @property
    def atomic(self) -> bool:
        """Whether a failed pass leaves the committed state untouched (two NVMe copies)."""
        return self.tier.atomic_from == 0 and self.tier.copies > 1

    @property
    def atomic_from(self) -> int:
        """The first element from which the state is updated out of place (two NVMe copies) to the end: a
        failed pass that updated no chunk before it leaves the committed state intact."""
        return self.tier.atomic_from

    @property
    def split_pass(self) -> bool:
        """Whether a pass during backward covers only the swapped share, the in-memory rest being stepped
        after backward (`run_resident`): a split state (zero.optimizer.tiers.split)."""
        return self.tier.resident_share[0] > 0

    def prepare_overlap(self) -> Optional[List[Tuple[int, int]]]:
        """The chunks (start, numel) a pass during backward waits on, in the order of the `ready` indices
        it calls (the tier was built to step its swapped chunks last first: `TierSpec.last_first`); None
        when this state cannot be stepped during backward (a failed or dropped pass would have to roll back
        an in-place update)."""
        return self.tier.overlap_chunks

    def info(self, tier_name: str) -> StateInfo:
        """Where the state lives (`engine.optimizer_state_info()`)."""
        t = self.tier
        offloaded = tier_name in ("cpu", "nvme") and t.device_numel > 0  # a device share (ratio below 1.0)
        stepper = "torch" if self.device_part is not None else "kernels" if offloaded else ""
        return StateInfo(
            tier=tier_name,
            numel=t.numel,
            chunk_numel=t.chunk_numel,
            chunks=len(t.chunks),
            copies=t.copies,
            pass_read_bytes=t.pass_bytes,
            disk_bytes=self.space.bytes_allocated if self.space is not None else 0,
            state_dtype=self.rule.state_dtype,
            resident_numel=t.numel - t.swapped_numel,
            swapped_numel=t.swapped_numel,
            device_numel=t.device_numel,
            device_part=stepper,
        )

    # ------------------------------------------------------------------------------------ one pass
    def chunk_update(
        self,
        grad: torch.Tensor,
        step: int,
        group: Dict[str, Any],
        grad_scale: float,
        fused_check: bool,
        on_chunk: Optional[Callable[[], None]] = None,
        sq: Optional[List[float]] = None,
    ) -> Callable[[int, int, torch.Tensor, List[torch.Tensor]], bool]:
        """The tier's per-chunk update: the rule on [start, start + n), then the copy-back. With `sq`, each
        chunk's sum of squared (raw) gradients is appended to it first: the step's gradient norm, taken
        while the pass walks the gradients anyway (on NVMe, under the reads and writes in flight)."""
        rule, writer, atomic_from = self.rule, self.writer, self.atomic_from
        # A snapshot: a pass on a worker thread keeps this step's hyperparameters when a scheduler steps
        groups = [dict(g) for g in self.optimizer.param_groups]
        group = groups[self.first_group]  # the hyperparameters of every chunk while the groups agree
        spans = self.spans if self.spans is not None and groups_differ(groups, self._used) else None
        if spans is not None and rule.format.quantized:
            raise NotImplementedError(
                "optimizer.params.state_dtype='int8' with param groups of different hyperparameters is not "
                "supported (a block's absmax scale would span two groups); use bf16 or fp32 states"
            )
        if self.device_part is not None:
            self._device_args = (grad, step, groups, grad_scale, sq)

        def apply(a: int, n: int, master: Any, g: Any, states: Any, pc: Any, grp: Dict[str, Any]) -> bool:
            return rule.apply(
                master,
                g,
                states,
                step=step,
                group=grp,
                grad_scale=grad_scale,
                param_copy=pc,
                check_finite=fused_check,
                seed=a,
            )

        def update(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> bool:
            g = grad[start : start + n]
            if sq is not None:
                sq.append(sum_of_squares(g))
            pc = writer.param_copy(start, n)
            if spans is None:
                ok = apply(start, n, master, g, states, pc, group)
            else:  # run by run, each with its group's hyperparameters
                ok = True
                for a, z, gi in pieces(spans, self._span_starts, start, n):
                    lo, hi = a - start, z - start
                    part = [t[lo:hi] for t in states]
                    cp = pc[lo:hi] if pc is not None else None
                    ok = apply(a, z - a, master[lo:hi], g[lo:hi], part, cp, groups[gi])
                    if not ok:
                        break
            if ok:
                self.pass_updates += 1
                if start < atomic_from:
                    self.torn = True
                writer.after_update(start, n, master)
                if on_chunk is not None:
                    on_chunk()
            return ok

        return update

    def run(self, update: ChunkFn, ready: Optional[ReadyFn] = None) -> bool:
        """Walk the tier with `update` (waiting on `ready(c)` per chunk when given: a pass during
        backward, over the `prepare_overlap` chunks); False: overflow. A torch-stepped device share is
        launched first, with what `chunk_update` was given. A split state's pass during backward walks
        only its swapped share: `run_resident` finishes it."""
        self.pass_updates = 0
        self.torn = False
        self.writer.settle()  # the last step's parameter writes: one held raises before anything changes
        if self.device_part is not None:
            held = self.tier.take_lost()  # the last step's write-back first: nothing is updated before it
            if held is not None:
                raise held
            self._launch_device_part()
        return self.tier.step(update, ready)

    def resident_share(self) -> Tuple[int, int]:
        """(elements, chunks) of a split state's in-memory front: the first `prepare_overlap` chunks."""
        return self.tier.resident_share

    def run_resident(self, update: ChunkFn) -> bool:
        """The in-memory share of a split pass that `run(update, ready)` began during backward (in place:
        the caller checked its gradients for overflow first); False: overflow."""
        return self.tier.step_resident(update)

    def _launch_device_part(self) -> None:
        """Twin-Flow: queue the device share's update with the pass's gradient scale (asynchronous on CUDA),
        and its new weights into the parameters after it, before the host walks the offloaded chunks."""
        args, self._device_args = self._device_args, None
        if args is None:
            raise RuntimeError("OptimizerState.run: no chunk_update prepared this pass's device-share update")
        grad, step, group, grad_scale, sq = args
        part = self.device_part
        g = grad[: part.numel]
        part.launch(g, step, group, grad_scale)
        self.pass_updates += 1
        self.torn = True  # the share is updated in place: a failure after this tears the state
        self._put_master(self.writer, part)  # device to device on CUDA, queued after the update
        if sq is not None:  # the norm adds both shares' squares (on the host, while the GPU steps)
            sq.append(sum_of_squares(g))

    def end_pass(self, ok: bool, step: int, rep: StepReport, h2d0: int) -> bool:
        """Commit a finished pass (or drop it on overflow) and add its counts to `rep`; True: skipped."""
        if ok:
            self.tier.commit()
            self.optimizer.step_count = step
        else:
            self.tier.abort()
            self.restore_params()
        self.writer.finish()
        stats = self.tier.stats  # counts since the last step, including reads prefetched during backward
        rep.optimizer_compute_s += stats.compute_s
        rep.io_wait_s += stats.io_wait_s
        rep.gradient_wait_s += stats.gate_wait_s  # 0 unless the pass ran during backward
        rep.nvme_read_bytes += stats.bytes_read
        rep.nvme_write_bytes += stats.bytes_written
        rep.optimizer_chunks += self.pass_updates
        stats.reset()
        rep.host_to_device_bytes += self.writer.h2d_bytes - h2d0
        return not ok

    def fail_pass(self, err: BaseException, step: int) -> NoReturn:
        """A pass failed part way. Two NVMe copies: the committed state is intact, so the parameters are
        put back from it and the error raised (a retry redoes the update). In-place state (memory tiers, one
        NVMe copy) that the pass already changed is torn: the guard is poisoned. The last step's write-back
        still failing (`_held`) stopped the pass before it changed anything: raised as it is."""
        self.tier.abort()
        if _held(err):
            raise err
        if self.torn:
            self.writer.finish()
            self.guard.poison(
                err,
                what=f"optimizer step {step} failed after it had updated part of the optimizer state "
                "in place (it cannot be rolled back)",
            )
            self.guard.check()
        self.restore_params()
        if getattr(err, "steps_lost", 0):  # the last step's deferred write-back failed: undo it too
            self.optimizer.step_count -= err.steps_lost  # type: ignore[attr-defined]
            self._on_step_lost()  # gradients computed on the lost step's weights
            raise err
        if isinstance(err, OSError):
            raise OSError(
                err.errno,
                f"optimizer step {step} failed while swapping optimizer state ({err.strerror}); "
                "the previous state is kept and training can continue from it",
                getattr(err, "filename", None),
            ) from err
        raise err

    def drop_pass(self, result_error: Optional[BaseException]) -> None:
        """Undo a pass that will not be committed (stopped during backward): parameters back to the master."""
        self.tier.abort()
        self.tier.stats.reset()
        if _held(result_error):
            return  # it stopped the pass before any chunk: the parameters are the committed state's
        self.restore_params()
        if getattr(result_error, "steps_lost", 0):
            # The pass found the last step's write-back lost: the next step (or save) undoes that step,
            # exactly as without the overlapped pass.
            self.tier.keep_lost(result_error)

    def restore_params(self) -> None:
        """Put the committed master back into the parameters. If that fails the parameters are partly the
        aborted pass's: the guard is poisoned (StateCorruptedError, chained)."""
        try:
            self.writer.finish()  # on a GPU: after the copies the aborted pass still had in flight
            self._put_master(self.writer, self.tier)
        except Exception as e:
            self.guard.poison(e, what="putting the committed fp32 master back into the parameters failed")
            self.guard.check()
        except BaseException as e:  # KeyboardInterrupt and the like: raised as they are, state marked
            self.guard.poison(e, what="putting the committed fp32 master back into the parameters stopped")
            raise

    def settle_write_back(self) -> None:
        """Wait for the writes the last step left in flight. If one failed, the tier is back at the state
        before that step: undo the rest of it too (parameters, step count, gradients computed on its
        weights) and raise the `DeferredWriteError`. Then the parameter writes the step left in flight:
        one held (failing again) raises its `DeferredWriteError` (steps_lost 0)."""
        err = self.tier.take_lost()
        if err is None:
            self.writer.settle()
            return
        if _held(err):
            raise err  # the last step is held and its write is still failing: nothing to undo
        self.restore_params()
        self.optimizer.step_count -= err.steps_lost
        self._on_step_lost()
        raise err

    # ------------------------------------------------------------------------- whole-state access
    def master_and_states(self) -> tuple[torch.Tensor, List[torch.Tensor]]:
        """Copies of the committed master and states on the host."""
        numel, fmt = self.tier.numel, self.rule.format
        whole = [torch.empty(k, dtype=STATE_TORCH_DTYPES[d]) for d, k, _ in fmt.parts(numel)]
        master, states = whole[0], whole[1:]

        def take(start: int, n: int, m: torch.Tensor, st: List[torch.Tensor]) -> None:
            master[start : start + n].copy_(m)
            for dst, src in zip(states, st):
                lo = start if dst.numel() == numel else start // QUANT_BLOCK  # values, or int8 scales
                dst[lo : lo + src.numel()].copy_(src)

        self.tier.read_all(take)
        return master, states

    def load_values(self, master: torch.Tensor, states: List[torch.Tensor]) -> None:
        """Replace master and states (two NVMe copies: atomically; otherwise in place, poisoning on error).
        States in another dtype than this engine's are converted (with a warning when that rounds them)."""
        src, dst = format_of(states, self.rule.n_states), self.rule.format
        if src != dst:
            warn_if_lossy(src.dtype, dst.dtype, "load_optimizer_state_dict")
            states = convert_states(states, src, dst, self.rule.signed)

        numel = self.tier.numel

        def put(start: int, n: int, m: torch.Tensor, st: List[torch.Tensor]) -> None:
            m.copy_(master[start : start + n])
            for dst, src in zip(st, states):
                lo = start if src.numel() == numel else start // QUANT_BLOCK  # values, or int8 scales
                dst.copy_(src[lo : lo + dst.numel()])

        try:
            self.tier.load(put)
        except BaseException as e:
            if not self.atomic:
                self.guard.poison(e, what="loading the optimizer state failed part way")
            raise

    def stream_out(self, fn: VisitFn) -> None:
        """Visit the committed master and states chunk by chunk (checkpoint writes); not a step's I/O."""
        self.tier.read_all(fn)
        self.tier.stats.reset()

    def stream_in(self, fn: VisitFn) -> None:
        """Fill master and states chunk by chunk (checkpoint reads; atomic with two NVMe copies)."""
        self.tier.load(fn)
        self.tier.stats.reset()

    def rebuild_master(self, fill: Fill) -> None:
        """Set the master from `fill` (states kept): after only the module's weights were loaded."""
        err = self.tier.take_lost()
        if err is not None:  # the states are back at the step before: count that, keep the loaded weights
            self.optimizer.step_count -= err.steps_lost
            warnings.warn(
                f"the last optimizer step was lost before the master was rebuilt from the module: {err}",
                RuntimeWarning,
                stacklevel=3,
            )

        def put(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
            fill(start, n, master)

        try:
            self.tier.rewrite(put)
        except BaseException as e:
            self.guard.poison(e, what="rebuilding the fp32 master from the module's weights failed")
            if isinstance(e, Exception):
                self.guard.check()
            raise
        self.tier.stats.reset()  # not part of the next step's report

    def close(self) -> None:
        """Free the copy-back writer, the tier and the swap space (the space goes even if the tier raises:
        its files are scratch, never the only copy of a checkpoint)."""
        try:
            self.writer.close()
            self.tier.close()  # may raise a write-back error nothing reported yet
        finally:
            if self.space is not None:
                self.space.close()
