"""Building a rank's optimizer-state tier from the offload settings (`build_tier`), and describing it.

`offload_optimizer.device` picks the tier: "none" (`DeviceState` on the training device), "cpu" (`DeviceState`
over pinned host memory) or "nvme" (`OptimizerSwapper` in swap files, in `swap_copies` copies, with
`last_first` order when a pass steps during backward). `offload_optimizer.ratio` and `max_in_cpu` split the
state over several of them (`SplitTier`, zero.optimizer.tiers.split); the training device's share is a
`TorchDevicePart` when torch steps it (zero.optimizer.tiers.device_part). Every knob is given at
construction: nothing is set on a tier after it was built. `describe_placement` is the log line of the
result.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from offload.config.aio import AioConfig
from offload.config.zero import OffloadOptimizerConfig
from offload.pinned import PINNED_BUDGET_ENV, PinnedPool
from offload.progress import progress
from offload.swap.optimizer_swapper import STATE_TORCH_DTYPES, OptimizerSwapper
from offload.swap.slots import QUANT_BLOCK, StateFormat, plan_slot_numel
from offload.swap.space import SwapSpace, check_nvme_path
from offload.swap.split import split_numel
from zero.optimizer.rules import UpdateRule, ZeroOptimizer
from zero.optimizer.tiers.base import StateInfo, StateTier
from zero.optimizer.tiers.device import DeviceState
from zero.optimizer.tiers.device_part import FusedDeviceStep, TorchDevicePart
from zero.optimizer.tiers.split import build_split, plan_split
from zero.report import format_bytes

__all__ = [
    "Fill",
    "TierSpec",
    "TorchPart",
    "build_tier",
    "describe_placement",
    "device_share_numel",
    "fused_device_step",
    "swap_copies",
]

Fill = Callable[[int, int, torch.Tensor], None]  # fill(start, n, out): initial fp32 master values
SWAP_ALIGNMENT = 4096
FP32_BYTES = 4
# Two copies of the NVMe optimizer state are kept when the disk has this much more room than they need.
DISK_HEADROOM = 1.05
OPTIMIZER_PATH_KEY = "zero_optimization.offload_optimizer.nvme_path"
Copies = Union[int, Callable[[int], int]]  # NVMe copies, or copies(numel) for the `numel` elements swapped


@dataclass(frozen=True)
class TorchPart:
    """What torch needs to step the training device's share (`TorchDevicePart`): the rule, the optimizer's
    param groups and their runs over the partition (zero.optimizer.param_groups.group_spans)."""

    rule: UpdateRule
    groups: Sequence[Dict[str, object]]
    spans: Optional[List[Tuple[int, int, int]]] = None


@dataclass(frozen=True)
class TierSpec:
    """Where and how the state of one rank is kept: `tier` is `offload_optimizer.device` ("none", "cpu" or
    "nvme") with its settings `offload` (None: no offload block); `sub_group` elements per chunk
    (`zero_optimization.sub_group_size`); `state_dtype` of the states (the master is fp32);
    `device_staging_bytes` pinned bytes the GPU copy-back reserves besides the NVMe slots; `swap_copies`:
    NVMe copies (`swap_copies`), or a function of the swapped elements; `last_first`: a pass steps the
    swapped chunks during backward, last first; `torch_part`: the training device's share (ratio below 1.0)
    is stepped by torch."""

    tier: str
    device: torch.device
    sub_group: int
    offload: Optional[OffloadOptimizerConfig]
    aio: AioConfig
    rank: int = 0
    state_dtype: str = "fp32"
    device_staging_bytes: int = 0
    swap_copies: Copies = 2
    last_first: bool = False
    torch_part: Optional[TorchPart] = None


def describe_placement(
    info: StateInfo, n_states: int, offload: Optional[OffloadOptimizerConfig], budget_bytes: int
) -> str:
    """One line for the log: where the optimizer state went, bytes per tier, and why (the offload settings
    and, for `max_in_cpu: "auto"`, the pinned budget it was sized against)."""
    fmt = StateFormat(n_states, info.state_dtype)
    device = fmt.whole_bytes(info.device_numel)
    host = fmt.whole_bytes(info.resident_numel - info.device_numel)
    if info.tier == "device":
        return (
            f"optimizer state: {format_bytes(device)} on the training device (offload_optimizer.device=none)"
        )
    off = offload if offload is not None else OffloadOptimizerConfig()  # the defaults when no block
    parts = [f"{format_bytes(device)} on the training device (ratio={off.ratio})"] if device else []
    if info.tier == "cpu":
        parts.append(f"{format_bytes(host)} in pinned RAM (offload_optimizer.device=cpu)")
        return "optimizer state: " + ", ".join(parts)
    swapped = fmt.whole_bytes(info.swapped_numel)
    copies = f" ({info.copies} cop{'ies' if info.copies > 1 else 'y'} on disk)" if swapped else ""
    parts += [f"{format_bytes(host)} in pinned RAM", f"{format_bytes(swapped)} on NVMe{copies}"]
    want = off.max_in_cpu
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
    spec: TierSpec,
    *,
    pool: PinnedPool,
    pinned: Callable[[int, str], torch.Tensor],
    alias: Optional[torch.Tensor] = None,
) -> Tuple[StateTier, Optional[SwapSpace]]:
    """The tier `spec` describes, filled with the initial master (`init`: the values, or `fill(start, n,
    out)` so NVMe never needs them whole) and zero states in `spec.state_dtype` (the master is fp32).
    `alias`: a tensor the master may be (fp32 weights on the host). `pinned(numel, what)` allocates fp32
    elements within the pinned budget. `offload.ratio` and `offload.max_in_cpu` may split the state over
    several tiers (zero.optimizer.tiers.split); with int8 states the split falls on whole QUANT_BLOCKs, and
    "auto" sizes the resident share at the state dtype's bytes per element."""
    fmt = StateFormat(n_states, spec.state_dtype)
    sub_group = _state_sub_group(spec.sub_group, fmt)
    plan = plan_split(
        numel,
        n_states,
        tier=spec.tier,
        offload=spec.offload,
        sub_group=sub_group,
        device=spec.device,
        cap_bytes=pool.cap_bytes,
        in_use_bytes=pool.bytes_in_use,
        reserved_bytes=spec.device_staging_bytes,
        alignment=SWAP_ALIGNMENT,
        state_dtype=fmt.dtype,
    )
    whole = plan.offload and not (plan.device or plan.host)
    # a pass steps the swapped chunks during backward (last first) only when they are the whole state or sit
    # behind one in-memory front that the kernels step
    behind_one = not (plan.device and (plan.host or spec.torch_part is not None))
    last_first = spec.last_first and bool(whole or behind_one)
    parts = _Parts(spec, fmt, sub_group, pool, pinned, last_first=last_first)
    if whole:
        return parts.one(numel, init, spec.tier, alias, split=False)
    if plan.device and spec.tier != "none" and not (plan.host or plan.offload):  # ratio 0: the device alone
        return parts.one(numel, init, "none", alias, split=False, torch_part=spec.torch_part)

    def part(
        n: int, part_init: Union[torch.Tensor, Fill], t: str, part_alias: Optional[torch.Tensor]
    ) -> Tuple[StateTier, Optional[SwapSpace]]:
        torch_part = spec.torch_part if t == "none" and spec.tier != "none" else None
        return parts.one(n, part_init, t, part_alias, split=True, torch_part=torch_part)

    return build_split(plan, init, alias, part)


def _state_sub_group(sub_group: int, fmt: StateFormat) -> int:
    """The split's sub-group: int8 states split on whole QUANT_BLOCKs."""
    return -(-sub_group // QUANT_BLOCK) * QUANT_BLOCK if fmt.quantized else sub_group


def device_share_numel(
    numel: int,
    *,
    tier: str,
    offload: Optional[OffloadOptimizerConfig],
    sub_group: int,
    state_dtype: str = "fp32",
) -> int:
    """The first elements of a `numel`-element partition whose state `build_tier` keeps on the training
    device (`offload_optimizer.ratio` below 1.0 with tier "cpu" or "nvme"; 0 otherwise): the layouts pin
    no gradient or master memory for them."""
    if numel <= 0 or offload is None or tier == "none":
        return 0
    sub = _state_sub_group(max(1, int(sub_group)), StateFormat(1, state_dtype))
    return split_numel(numel, sub, tier=tier, ratio=float(offload.ratio)).device


class _Parts:
    """Builds the plain tiers of one `build_tier` call (each part of a split, or the whole state)."""

    def __init__(
        self,
        spec: TierSpec,
        fmt: StateFormat,
        sub_group: int,
        pool: PinnedPool,
        pinned: Callable[[int, str], torch.Tensor],
        *,
        last_first: bool,
    ) -> None:
        self.spec, self.fmt, self.sub_group, self.pool, self.pinned = spec, fmt, sub_group, pool, pinned
        self.last_first = last_first  # the swapped chunks are stepped last first (during backward)

    def one(
        self,
        numel: int,
        init: Union[torch.Tensor, Fill],
        tier: str,
        alias: Optional[torch.Tensor],
        *,
        split: bool,
        torch_part: Optional[TorchPart] = None,
    ) -> Tuple[StateTier, Optional[SwapSpace]]:
        """One plain tier of `numel` elements: NVMe (`split`: its writes drained inside each step, so an
        error surfaces from `step`, never after a commit), or memory (stepped by torch with `torch_part`)."""
        if tier == "nvme":
            return self.nvme(numel, init, defer_writes=not split)
        if callable(init) and alias is None:
            values = torch.empty(numel, dtype=torch.float32)
            init(0, numel, values)
            init = values
        state = self.memory(numel, init, tier == "cpu", alias)
        if torch_part is None:
            return state, None
        return TorchDevicePart(torch_part.rule, torch_part.groups, state, spans=torch_part.spans), None

    def memory(
        self, numel: int, init: Union[torch.Tensor, Fill], on_host: bool, alias: Optional[torch.Tensor]
    ) -> DeviceState:
        """Master + zero states in device memory, or pinned host memory (`on_host`)."""
        pinned, fmt = self.pinned, self.fmt
        if alias is not None:
            master = alias
            if not callable(init):
                master.copy_(init)  # the fp32 weights, bit for bit (already there: same values)
        elif on_host:
            assert not callable(init)
            master = pinned(numel, "the fp32 master partition").copy_(init)
        else:
            assert not callable(init)
            master = init.to(self.spec.device)
        states = []
        for dtype, k, _ in fmt.parts(numel)[1:]:
            tdt = STATE_TORCH_DTYPES[dtype]
            if on_host:  # fresh pages read as 0
                nbytes = k * tdt.itemsize
                raw = pinned(-(-nbytes // FP32_BYTES), "the optimizer states").view(torch.uint8)
                states.append(raw[:nbytes].view(tdt))
            else:
                states.append(torch.zeros(k, dtype=tdt, device=self.spec.device))
        return DeviceState(master, states, min(self.sub_group, numel), pinned=on_host, fmt=fmt)

    def nvme(
        self, numel: int, init: Union[torch.Tensor, Fill], *, defer_writes: bool
    ) -> Tuple[StateTier, Optional[SwapSpace]]:
        """The swapped share: swap files in their copies, written with the initial master and zero states."""
        spec, fmt, pool, rank = self.spec, self.fmt, self.pool, self.spec.rank
        off = spec.offload
        if off is None:
            raise ValueError(
                "offload_optimizer.device=nvme needs the zero_optimization.offload_optimizer block"
            )
        nvme_path = check_nvme_path(off.nvme_path or "", OPTIMIZER_PATH_KEY)
        copies = spec.swap_copies
        copies = copies(numel) if callable(copies) else copies  # decided for the swapped share only
        buffer_count = max(1, int(off.buffer_count))
        chunk = plan_slot_numel(
            self.sub_group,
            numel,
            fmt.n_states,
            buffer_count,
            cap_bytes=pool.cap_bytes,
            in_use_bytes=pool.bytes_in_use,
            reserved_bytes=spec.device_staging_bytes,
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
                aio=spec.aio,
                name=f"optim-rank{rank}",
                copies=copies,
                defer_writes=defer_writes,
                last_first=self.last_first and copies > 1,  # in place: never stepped during backward
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


def fused_device_step(
    tier: StateTier, rule: UpdateRule, optimizer: ZeroOptimizer, spans: Optional[List[Tuple[int, int, int]]]
) -> FusedDeviceStep:
    """torch's fused Adam/AdamW over a state `build_tier` kept whole in device memory (offload none, CUDA)."""
    if not isinstance(tier, DeviceState):
        raise TypeError(
            f"torch's fused device step needs the state in device memory, not a {type(tier).__name__}"
        )
    return FusedDeviceStep(rule, optimizer, tier, spans)
