"""The optimizer's state: the fp32 master and optimizer states of one rank's partition, on their tier.

A tier (`StateTier`) holds master + states and walks them chunk by chunk:
* `DeviceState` (zero.optimizer.rules): tensors in device memory (offload none) or page-locked host
  memory (offload cpu), updated in place;
* `OptimizerSwapper` (offload.swap): swap files on NVMe streamed through pinned slots, two copies so a
  pass is committed only when every chunk succeeded (one copy, in place, with `nvme_copies` 1 or when the
  disk cannot hold two);
* `SplitTier` (zero.optimizer.tiers.split): two of those over one index space, when
`offload_optimizer.max_in_cpu`
  keeps part of the NVMe state in pinned host memory or `ratio` keeps sub-groups on the device.

The master is fp32; the states are in the rule's `state_dtype` (fp32, bf16, or int8 codes with their
absmax scales) on every tier, laid out by `offload.swap.slots.StateFormat`.

`OptimizerState` runs a pass over the tier: the update rule's fused kernel on each chunk, then the
parameter writer (zero.layout.param_writer) copies the new weights out. It commits or drops the pass, puts the
committed master back into the parameters after a failure, and streams the state for checkpoints. On CUDA
without offload the update is torch's fused Adam on the device master (`FusedDeviceStep`); with offload and
a device share (`offload_optimizer.ratio` below 1.0) that share is stepped by torch too
(zero.optimizer.tiers.device_part),
launched before the host walks the offloaded chunks.

Over the usual 500 lines because the tier factory (`build_tier`: copies, dtype, split) and the pass
(`OptimizerState`: commit, failure, checkpoint streaming) change together whenever a tier gains a property;
splitting them would put one decision in two files.

Over 700 lines on purpose for now: the tiers and their passes go into an optimizer package, behind one
widened tier protocol, in the restructuring of zero/ into folders by concern; splitting it before would
split it twice.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NoReturn, Optional, Protocol, Tuple, Union

import torch

from offload.config import AioConfig
from offload.pinned import PINNED_BUDGET_ENV, PinnedPool
from offload.progress import progress
from offload.swap.optimizer_swapper import STATE_TORCH_DTYPES, OptimizerSwapper, SwapStats
from offload.swap.slots import QUANT_BLOCK, StateFormat, plan_slot_numel
from offload.swap.space import SwapSpace, check_nvme_path
from zero.layout.param_writer import ParamWriter
from zero.optimizer.integrity import StateGuard
from zero.optimizer.param_groups import groups_differ, pieces
from zero.optimizer.rules import DeviceState, UpdateRule, ZeroOptimizer
from zero.optimizer.state_convert import convert_states, format_of, warn_if_lossy
from zero.optimizer.tiers.device_part import TorchAdamSpans, TorchDevicePart
from zero.optimizer.tiers.split import SplitTier, build_split, plan_split
from zero.report import StepReport, format_bytes

__all__ = [
    "FusedDeviceStep",
    "OptimizerState",
    "StateInfo",
    "StateTier",
    "build_tier",
    "describe_placement",
    "sum_of_squares",
]

# (start, n, master view, state views): what read_all / load / rewrite hand to the caller
VisitFn = Callable[[int, int, torch.Tensor, List[torch.Tensor]], None]
Fill = Callable[[int, int, torch.Tensor], None]  # fill(start, n, out): initial fp32 master values
SWAP_ALIGNMENT = 4096
# Elements per piece of a host-memory sum of squares: a 16-bit piece cast to fp32 stays in cache (a whole
# cast would allocate and fault in a tensor the size of the gradients), and each fp32 partial sum is short
# enough to be accurate (one fp32 sum over 10^7 elements is off by ~1e-3).
SQ_PIECE = 1 << 18
FP32_BYTES = 4
# Two copies of the NVMe optimizer state are kept when the disk has this much more room than they need.
DISK_HEADROOM = 1.05
OPTIMIZER_PATH_KEY = "zero_optimization.offload_optimizer.nvme_path"
Copies = Union[int, Callable[[int], int]]  # NVMe copies, or copies(numel) for the `numel` elements swapped


class StateTier(Protocol):
    """Master + states of `numel` elements, visited chunk by chunk (DeviceState, OptimizerSwapper)."""

    numel: int
    chunk_numel: int
    stats: SwapStats

    def prefetch(self) -> None: ...

    def step(self, fn: Callable[..., bool]) -> bool: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...

    def read_all(self, fn: VisitFn) -> None: ...

    def load(self, fn: VisitFn) -> None: ...

    def rewrite(self, fn: VisitFn) -> None: ...

    def take_lost(self) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class StateInfo:
    """Where the optimizer state lives and how it is walked (`engine.optimizer_state_info()`)."""

    tier: str  # "device", "cpu" or "nvme"
    numel: int  # elements of the rank's partition
    chunk_numel: int  # elements per chunk (NVMe: per staging slot)
    chunks: int
    copies: int  # NVMe copies kept (2: steps are atomic); 1 for memory tiers
    pass_read_bytes: int  # NVMe bytes one full pass reads (0 for memory tiers)
    disk_bytes: int  # bytes of swap files
    state_dtype: str = "fp32"  # the optimizer states' dtype ("fp32", "bf16", "int8"); the master is fp32
    resident_numel: int = 0  # elements whose state is in memory (device or host; zero.optimizer.tiers.split)
    swapped_numel: int = 0  # elements whose state is in swap files
    device_numel: int = 0  # of the resident ones, elements on the training device (offload_optimizer.ratio)
    device_part: str = ""  # what steps a split's device share: "torch" (zero.optimizer.tiers.device_part) or
    "kernels"


def describe_placement(info: StateInfo, n_states: int, offload: Any, budget_bytes: int) -> str:
    """One line for the log: where the optimizer state went, bytes per tier, and why (the offload settings
    and, for `max_in_cpu: "auto"`, the pinned budget it was sized against)."""
    fmt = StateFormat(n_states, info.state_dtype)
    device = fmt.whole_bytes(info.device_numel)
    host = fmt.whole_bytes(info.resident_numel - info.device_numel)
    if info.tier == "device":
        return (
            f"optimizer state: {format_bytes(device)} on the training device (offload_optimizer.device=none)"
        )
    parts = [f"{format_bytes(device)} on the training device (ratio={offload.ratio})"] if device else []
    if info.tier == "cpu":
        parts.append(f"{format_bytes(host)} in pinned RAM (offload_optimizer.device=cpu)")
        return "optimizer state: " + ", ".join(parts)
    swapped = fmt.whole_bytes(info.swapped_numel)
    copies = f" ({info.copies} cop{'ies' if info.copies > 1 else 'y'} on disk)" if swapped else ""
    parts += [f"{format_bytes(host)} in pinned RAM", f"{format_bytes(swapped)} on NVMe{copies}"]
    want = offload.max_in_cpu
    if want != "auto":
        why = f"max_in_cpu={want}"
    elif info.swapped_numel == 0:
        why = f"max_in_cpu=auto: fits in the pinned budget of {format_bytes(budget_bytes)}"
    else:
        why = f"max_in_cpu=auto: what fits in the pinned budget of {format_bytes(budget_bytes)} stays in RAM"
    return "optimizer state: " + ", ".join(parts) + f" ({why})"


def _disk_free(path: str) -> int:
    return shutil.disk_usage(path).free


def swap_copies(
    nvme_path: str, numel: int, n_states: int, state_dtype: str = "fp32", choice: Union[str, int] = "auto"
) -> int:
    """NVMe copies of the optimizer state (`offload_optimizer.nvme_copies`). "auto": 2 (atomic steps) when
    the disk at `nvme_path` has room for two copies of the state, else 1 (in place, with a warning: a step
    that fails half way cannot be rolled back then). 1: in place, as chosen. 2: ValueError with the sizes
    when the disk cannot hold them."""
    nvme_path = check_nvme_path(nvme_path or "", OPTIMIZER_PATH_KEY)  # a clear error for a bad path first
    if choice == 1:
        return 1
    one = StateFormat(n_states, state_dtype).whole_bytes(numel)
    free = _disk_free(nvme_path)
    if 2 * one * DISK_HEADROOM <= free:
        return 2
    if choice == 2:
        raise ValueError(
            f"zero_optimization.offload_optimizer.nvme_copies=2: nvme_path={nvme_path!r} has {free} bytes "
            f"free, two copies of the optimizer state need {2 * one} bytes (+{DISK_HEADROOM - 1:.0%} "
            f"headroom: {int(2 * one * DISK_HEADROOM)}); free space, or use nvme_copies 1 (in place) or "
            '"auto"'
        )
    warnings.warn(
        f"offload_optimizer.nvme_path={nvme_path!r} has {free} bytes free, not enough for two copies "
        f"of the optimizer state ({2 * one} bytes): the state is updated in place, so a step that fails "
        "half way (I/O error) cannot be rolled back",
        stacklevel=4,
    )
    return 1


def build_tier(
    numel: int,
    n_states: int,
    init: Union[torch.Tensor, Fill],
    *,
    tier: str,
    device: torch.device,
    pool: PinnedPool,
    pinned: Callable[[int, str], torch.Tensor],
    sub_group: int,
    offload: Any,
    aio: AioConfig,
    rank: int,
    alias: Optional[torch.Tensor] = None,
    device_staging_bytes: int = 0,
    swap_copies: Copies = 2,
    state_dtype: str = "fp32",
) -> tuple[StateTier, Optional[SwapSpace]]:
    """The tier for `offload_optimizer.device` = `tier`, filled with the initial master (`init`: the values,
    or `fill(start, n, out)` so NVMe never needs them whole) and zero states in `state_dtype` (the master
    is fp32). `alias`: a tensor the master may be (fp32 weights on the host). `pinned(numel, what)`
    allocates fp32 elements within the pinned budget. `offload.ratio` and `offload.max_in_cpu` may split
    the state over several tiers (zero.optimizer.tiers.split); with int8 states the split falls on whole
    QUANT_BLOCKs, and "auto" sizes the resident share at the state dtype's bytes per element."""
    fmt = StateFormat(n_states, state_dtype)
    if fmt.quantized:
        sub_group = -(-sub_group // QUANT_BLOCK) * QUANT_BLOCK
    plan = plan_split(
        numel,
        n_states,
        tier=tier,
        offload=offload,
        sub_group=sub_group,
        device=device,
        cap_bytes=pool.cap_bytes,
        in_use_bytes=pool.bytes_in_use,
        reserved_bytes=device_staging_bytes,
        alignment=SWAP_ALIGNMENT,
        state_dtype=fmt.dtype,
    )
    common = (device, pool, pinned, sub_group, offload, aio, rank)
    if plan.offload and not (plan.device or plan.host):
        return _one_tier(numel, fmt, init, tier, *common, alias, device_staging_bytes, swap_copies)

    def part(n: int, part_init: Any, t: str, part_alias: Optional[torch.Tensor]) -> tuple[Any, Any]:
        return _one_tier(n, fmt, part_init, t, *common, part_alias, device_staging_bytes, swap_copies)

    return build_split(plan, init, alias, part)


def _one_tier(
    numel: int,
    fmt: StateFormat,
    init: Union[torch.Tensor, Fill],
    tier: str,
    device: torch.device,
    pool: PinnedPool,
    pinned: Callable[[int, str], torch.Tensor],
    sub_group: int,
    offload: Any,
    aio: AioConfig,
    rank: int,
    alias: Optional[torch.Tensor],
    device_staging_bytes: int,
    swap_copies: Copies,
) -> tuple[StateTier, Optional[SwapSpace]]:
    if callable(init) and tier != "nvme" and alias is None:
        values = torch.empty(numel, dtype=torch.float32)
        init(0, numel, values)
        init = values
    if tier == "nvme":
        return _nvme_tier(
            numel, fmt, init, pool, sub_group, offload, aio, rank, device_staging_bytes, swap_copies
        )
    on_host = tier == "cpu"
    if alias is not None:
        master = alias
        if not callable(init):
            master.copy_(init)  # the fp32 weights, bit for bit (already there: same values)
    elif on_host:
        master = pinned(numel, "the fp32 master partition").copy_(init)
    else:
        master = init.to(device)
    states = []
    for dtype, k, _ in fmt.parts(numel)[1:]:
        tdt = STATE_TORCH_DTYPES[dtype]
        if on_host:  # fresh pages read as 0
            nbytes = k * tdt.itemsize
            raw = pinned(-(-nbytes // FP32_BYTES), "the optimizer states").view(torch.uint8)
            states.append(raw[:nbytes].view(tdt))
        else:
            states.append(torch.zeros(k, dtype=tdt, device=device))
    return DeviceState(master, states, min(sub_group, numel), pinned=on_host, fmt=fmt), None


def _nvme_tier(
    numel: int,
    fmt: StateFormat,
    init: Union[torch.Tensor, Fill],
    pool: PinnedPool,
    sub_group: int,
    off: Any,
    aio: AioConfig,
    rank: int,
    device_staging_bytes: int,
    copies: Copies,
) -> tuple[StateTier, Optional[SwapSpace]]:
    nvme_path = check_nvme_path(off.nvme_path or "", OPTIMIZER_PATH_KEY)
    copies = copies(numel) if callable(copies) else copies  # decided for the swapped share only
    buffer_count = max(1, int(off.buffer_count))
    chunk = plan_slot_numel(
        sub_group,
        numel,
        fmt.n_states,
        buffer_count,
        cap_bytes=pool.cap_bytes,
        in_use_bytes=pool.bytes_in_use,
        reserved_bytes=device_staging_bytes,
        alignment=SWAP_ALIGNMENT,
        budget_source=f"zero_offload.pinned_budget_bytes / {PINNED_BUDGET_ENV}",
        state_dtype=fmt.dtype,
    )
    space = SwapSpace(nvme_path, alignment=SWAP_ALIGNMENT, prefix=f"zero-offload-r{rank}-")
    try:
        swapper = OptimizerSwapper(
            space,
            numel,
            fmt.n_states,
            pool,
            chunk_numel=chunk,
            state_dtype=fmt.dtype,
            buffer_count=buffer_count,
            aio=aio,
            name=f"optim-rank{rank}",
            **({"copies": copies} if copies != 2 else {}),
        )
    except BaseException:
        space.close()  # no half-built swap directory left behind
        raise

    bar = progress("zero: writing the optimizer state to NVMe", fmt.whole_bytes(numel), rank=rank)

    def fill(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
        if callable(init):
            init(start, n, master)
        else:
            master.copy_(init[start : start + n])
        bar.update(fmt.whole_bytes(n))

    try:
        swapper.load(fill, states_zero=True)
    except BaseException:
        swapper.close()
        space.close()
        raise
    finally:
        bar.close()
    swapper.stats.reset()  # the initial write is not part of any step's report
    return swapper, space


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


class FusedDeviceStep:
    """offload none on CUDA: torch's fused Adam/AdamW on the flat fp32 partition in device memory, one torch
    param group per param group (`spans`: zero.optimizer.param_groups.group_spans; None: one group)."""

    def __init__(
        self,
        rule: UpdateRule,
        optimizer: ZeroOptimizer,
        state: DeviceState,
        spans: Optional[List[Tuple[int, int, int]]] = None,
    ) -> None:
        if rule.kind not in ("adam", "adamw"):
            raise NotImplementedError(
                f"optimizer {rule.kind!r} without offload on CUDA is not supported; "
                "use offload_optimizer.device cpu or nvme"
            )
        if rule.state_dtype != "fp32":
            raise NotImplementedError(
                f"optimizer.params.state_dtype={rule.state_dtype!r} (fp32_optimizer_states false) without "
                "offload on CUDA is not supported: the device step is torch's fused Adam, which keeps fp32 "
                "states; use offload_optimizer.device cpu or nvme for 16-bit or 8-bit states"
            )
        self.optimizer = optimizer
        spans = spans or [(0, state.numel, 0)]
        self.torch = TorchAdamSpans(optimizer.param_groups, spans, state.master, state.states, fused=True)

    def step(self, grad: torch.Tensor, step: int, group: Dict[str, Any]) -> None:
        """One update of the master with the fp32 gradient `grad` (already unscaled); each param group's
        current hyperparameters (`group` is the first one's)."""
        self.torch.step(grad, step, self.optimizer.param_groups)


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
        """`tier` may be a SplitTier whose device share is a TorchDevicePart (Twin-Flow on CUDA), or that
        part alone (`ratio` 0): each pass then launches that share's update first (`run`), and the chunk
        walk covers the offloaded share. `spans`: the runs of one param group over the partition
        (zero.optimizer.param_groups.group_spans; None: one group); chunks are updated run by run with their
        group's
        hyperparameters while the groups' values differ."""
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
        part = tier.device_part if isinstance(tier, SplitTier) else tier
        self.device_part = part if isinstance(part, TorchDevicePart) else None
        self._device_args: Optional[tuple] = None  # what chunk_update gave the device share's launch
        runs = list(spans) if spans is not None else [(0, tier.numel, 0)]
        self.first_group = runs[0][2]  # the group of the partition's first run (of every run: one group)
        self._used = sorted({gi for _, _, gi in runs})
        self.spans = runs if len(self._used) > 1 else None
        self._span_starts = [a for a, _, _ in runs]

    @property
    def swapped(self) -> bool:
        return isinstance(self.tier, OptimizerSwapper)

    @property
    def atomic(self) -> bool:
        """Whether a failed pass leaves the committed state untouched (two NVMe copies)."""
        return isinstance(self.tier, OptimizerSwapper) and self.tier.copies > 1

    @property
    def atomic_from(self) -> int:
        """The first element from which the state is updated out of place (two NVMe copies) to the end: a
        failed pass that updated no chunk before it leaves the committed state intact."""
        t = self.tier
        if isinstance(t, SplitTier):
            return t.atomic_from
        return 0 if self.atomic else t.numel

    @property
    def split_pass(self) -> bool:
        """Whether a pass during backward covers only the swapped share, the in-memory rest being stepped
        after backward (`run_resident`): a split state (zero.optimizer.tiers.split)."""
        return isinstance(self.tier, SplitTier)

    def prepare_overlap(self) -> Optional[List[Tuple[int, int]]]:
        """Set the swapped chunks to be stepped last-first (the order backward finishes them) and return the
        chunks (start, numel) the pass during backward waits on, in the order of the `ready` indices it
        calls; None when this state cannot be stepped during backward (a failed or dropped pass would have
        to roll back an in-place update)."""
        t = self.tier
        if isinstance(t, SplitTier) and t.overlappable:
            swapper, chunks = t.back, t.chunks
        elif self.atomic:
            swapper, chunks = t, list(t.chunks)  # type: ignore[union-attr]
        else:
            return None
        swapper.step_order = list(reversed(range(len(swapper.chunks))))
        return chunks

    def info(self, tier_name: str) -> StateInfo:
        t = self.tier
        split = isinstance(t, SplitTier)
        swap = isinstance(t, OptimizerSwapper) or split
        chunks = t.chunk_count if split else len(t.chunks) if swap else -(-t.numel // t.chunk_numel)
        swapped = t.swapped_numel if split else t.numel if swap else 0
        device_numel = t.device_numel if split else 0 if swap or t.pinned_bytes else t.numel
        offloaded = tier_name in ("cpu", "nvme") and device_numel > 0  # a device share (ratio below 1.0)
        stepper = "torch" if self.device_part is not None else "kernels" if offloaded else ""
        return StateInfo(
            tier=tier_name,
            numel=t.numel,
            chunk_numel=t.chunk_numel,
            chunks=chunks,
            copies=t.copies if swap else 1,
            pass_read_bytes=t.pass_bytes if swap else 0,
            disk_bytes=self.space.bytes_allocated if self.space is not None else 0,
            state_dtype=self.rule.state_dtype,
            resident_numel=t.numel - swapped,
            swapped_numel=swapped,
            device_numel=device_numel,
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

    def run(self, update: Callable[..., bool], ready: Optional[Callable[[int], bool]] = None) -> bool:
        """Walk the tier with `update` (waiting on `ready(c)` per chunk when given: a pass during
        backward, over the `prepare_overlap` chunks); False: overflow. A torch-stepped device share is
        launched first, with what `chunk_update` was given. A split state's pass during backward walks
        only its swapped share: `run_resident` finishes it."""
        self.pass_updates = 0
        self.torn = False
        if self.device_part is not None:
            held = self.tier.take_lost()  # the last step's write-back first: nothing is updated before it
            if held is not None:
                raise held
            self._launch_device_part()
        if ready is None:
            return self.tier.step(update)
        if isinstance(self.tier, SplitTier):
            return self.tier.step_swapped(update, ready)
        return self.tier.step(update, ready=ready)  # type: ignore[call-arg]

    def resident_share(self) -> Tuple[int, int]:
        """(elements, chunks) of a split state's in-memory front: the first `prepare_overlap` chunks."""
        assert isinstance(self.tier, SplitTier)
        return self.tier.split, self.tier.front_chunks

    def run_resident(self, update: Callable[..., bool]) -> bool:
        """The in-memory share of a split pass that `run(update, ready)` began during backward (in place:
        the caller checked its gradients for overflow first); False: overflow."""
        assert isinstance(self.tier, SplitTier)
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
            self.tier.keep_lost(result_error)  # type: ignore[attr-defined]

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
        weights) and raise the `DeferredWriteError`."""
        err = self.tier.take_lost()
        if err is None:
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
