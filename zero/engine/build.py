"""How an engine is put together: the parts `ZeroEngine.__init__` composes, each decided from the config.

* `refuse_partitioned` / `refuse_meta_tensors`: models no engine can run, refused before anything is built;
* `choose_rule`: the update rule and its hyperparameters, from the config's `optimizer` block or the client
  optimizer (DeepSpeed's rule when both are given: the client's; one the kernels do not implement steps
  with its own class on the host, zero.optimizer.torch_step), or none (an inference engine);
* `build_optimizer_state`: the fp32 master and optimizer states on their tier (zero.optimizer.state), with
  Twin-Flow's device share stepped by torch where it can be;
* `enable_overlap`: whether the optimizer steps NVMe sub-groups during backward;
* `build_scheduler`: the learning-rate schedule, from the client or the config's `scheduler` block.

The loss scaler is `zero.optimizer.loss_scaler.build_loss_scaler`, the one place that decides it.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from offload.config import ZeroOffloadConfig
from offload.config.zero import OffloadOptimizerConfig
from offload.pinned import PinnedPool
from zero.layout.base import Layout, allocate_pinned
from zero.optimizer.integrity import StateGuard
from zero.optimizer.overlap import OverlapPass
from zero.optimizer.param_groups import check_quantized_groups, group_spans
from zero.optimizer.rules import UpdateRule, ZeroOptimizer, rule_from_client_optimizer, rule_from_config
from zero.optimizer.state import OptimizerState
from zero.optimizer.tiers.build import TierSpec, TorchPart, build_tier, fused_device_step, swap_copies
from zero.optimizer.tiers.device_part import wants_torch_part
from zero.optimizer.torch_step import kernel_implements, torch_step_rule

__all__ = [
    "build_optimizer_state",
    "build_scheduler",
    "choose_rule",
    "enable_overlap",
    "refuse_meta_tensors",
    "refuse_partitioned",
]

logger = logging.getLogger("zero")


def refuse_partitioned(model: nn.Module, stage: int) -> None:
    """ValueError, before anything is built, for a model zero.Init partitioned given a stage 0-2 config."""
    from zero.stage3.unit import is_partitioned

    for name, p in model.named_parameters():
        if is_partitioned(p):
            raise ValueError(
                f"zero_optimization.stage={stage}: the model was built under zero.Init, which partitions "
                f"its parameters for stage 3 (parameter {name!r} is partitioned); use stage 3 with it, or "
                "build the model without zero.Init for stages 0-2"
            )


def refuse_meta_tensors(model: nn.Module) -> None:
    """A parameter or buffer on the meta device has no values: an engine built on it would compute with
    zeros (stage 3 gives such parameters zero partitions). zero.Init and zero.from_pretrained partition
    their meta-built parameters before the engine sees them, so none is left here."""
    named = list(model.named_parameters(remove_duplicate=True)) + list(model.named_buffers())
    meta = [name for name, t in named if t is not None and t.is_meta]
    if not meta:
        return
    more = f" (and {len(meta) - 1} more)" if len(meta) > 1 else ""
    raise ValueError(
        f"zero.initialize: {meta[0]!r}{more} is on the meta device, so it holds no values (the engine would "
        "run with zeros). Build the model inside `zero.Init()` (its parameters are partitioned as they are "
        "created), load a Hugging Face checkpoint with `zero.from_pretrained`, or give the model real "
        "tensors first (`model.to_empty(device=...)`, then load its weights)"
    )


def choose_rule(
    cfg: ZeroOffloadConfig, client_opt: Any, params: List[nn.Parameter]
) -> Tuple[Optional[UpdateRule], Dict[str, Any], Optional[torch.optim.Optimizer]]:
    """The update rule, its default hyperparameters, and the client optimizer (built when given as a
    callable) whose param groups the engine's optimizer takes. No rule: an inference engine."""
    if client_opt is not None and cfg.optimizer is not None:
        logger.warning(  # DeepSpeed's rule (_configure_optimizer): the client optimizer is used
            "zero.initialize: the client optimizer (optimizer=%s) is used; the config's 'optimizer' "
            "block (type %r) is ignored",
            type(client_opt).__name__,
            cfg.optimizer.type,
        )
    if client_opt is None and cfg.optimizer is not None:
        return (*rule_from_config(cfg.optimizer.type, dict(cfg.optimizer.params)), None)
    if client_opt is not None:
        if callable(client_opt) and not isinstance(client_opt, torch.optim.Optimizer):
            client_opt = client_opt(params)
        if not kernel_implements(client_opt):  # SGD, RMSprop, ...: its own class steps on the host
            off = cfg.zero_optimization.offload_optimizer
            tier = off.device if off is not None else "none"
            return torch_step_rule(client_opt, cfg, tier), dict(client_opt.defaults), client_opt  # type: ignore[return-value]
        return (*rule_from_client_optimizer(client_opt), client_opt)
    return None, {}, None  # no optimizer: inference


def build_optimizer_state(
    layout: Layout,
    rule: UpdateRule,
    optimizer: ZeroOptimizer,
    cfg: ZeroOffloadConfig,
    *,
    offload_device: str,
    device: torch.device,
    dtype: torch.dtype,
    pool: PinnedPool,
    rank: int,
    device_part: str,
    guard: StateGuard,
    on_step_lost: Callable[[], None],
    world_size: int = 1,
) -> OptimizerState:
    """fp32 master and states on the offload tier, with the writer that copies weights back (the NVMe
    chunks in the order a pass during backward steps them, when `overlap_wanted`)."""
    off = cfg.zero_optimization.offload_optimizer
    delayed = cfg.zero_offload.delayed_update.enabled
    n_states, part = rule.n_states, layout.part_numel
    spans = group_spans(layout.param_spans(), optimizer.param_groups, part)
    check_quantized_groups(rule, optimizer.param_groups, spans)
    rule.bind(optimizer.param_groups, spans)  # a torch-stepped client optimizer builds its steppers
    sub_group = max(1, int(cfg.zero_optimization.sub_group_size))
    staging = 0  # pinned bytes the GPU copy-back needs besides the NVMe slots
    if device.type == "cuda":
        staging = 2 * min(sub_group, part) * torch.empty((), dtype=dtype).element_size()
    state_dtype = rule.state_dtype

    def copies(swapped: int) -> int:  # decided for the swapped share (max_in_cpu keeps the rest in RAM)
        assert off is not None  # only an NVMe tier asks, and it has its offload_optimizer block
        return swap_copies(off.nvme_path, swapped, n_states, state_dtype, off.nvme_copies)

    if offload_device == "nvme" and off is not None:
        swap_copies(off.nvme_path, 0, n_states, state_dtype, off.nvme_copies)  # a bad nvme_path: now
    torch_part = wants_torch_part(device_part, device) and offload_device != "none"
    spec = TierSpec(
        tier=offload_device,
        device=device,
        sub_group=sub_group,
        offload=off,
        aio=cfg.aio,
        rank=rank,
        state_dtype=state_dtype,
        device_staging_bytes=staging,
        swap_copies=copies,
        last_first=overlap_wanted(off, offload_device=offload_device, world_size=world_size, delayed=delayed),
        torch_part=TorchPart(rule, optimizer.param_groups, spans) if torch_part else None,
    )
    pinned = partial(allocate_pinned, pool)
    # a delayed update puts the weights in at its join: the master cannot be the parameters
    alias = None if delayed else layout.master_alias()
    tier, space = build_tier(
        part, n_states, layout.master_init(), spec, pool=pool, pinned=pinned, alias=alias
    )
    device_step = None
    if device.type == "cuda" and offload_device == "none":
        device_step = fused_device_step(tier, rule, optimizer, spans)
    return OptimizerState(
        tier,
        space,
        layout.make_writer(tier.chunk_numel),
        rule,
        optimizer,
        guard,
        put_master=layout.put_master,
        on_step_lost=on_step_lost,
        device_step=device_step,
        spans=spans,
    )


def overlap_wanted(
    off: Optional[OffloadOptimizerConfig], *, offload_device: str, world_size: int, delayed: bool = False
) -> bool:
    """Whether the config asks to step NVMe sub-groups during backward and nothing rules it out before the
    tier is built: one rank (the reduction ends with backward), no delayed update (which steps during the
    next step's forward and backward instead). With gradient clipping the steps are speculative."""
    if delayed or off is None or not bool(off.pipeline) or offload_device != "nvme":
        return False
    return world_size <= 1


def enable_overlap(
    overlap: OverlapPass,
    opt: OptimizerState,
    layout: Layout,
    off: Optional[OffloadOptimizerConfig],
    *,
    offload_device: str,
    world_size: int,
    delayed: bool = False,
) -> None:
    """Step NVMe sub-groups during backward (offload_optimizer.pipeline_read / pipeline_write) when a
    pass can be dropped (two copies; with a share of the state in memory, that share steps after
    backward) and needs no gradient still to come: one rank (the reduction ends with backward). With
    gradient clipping the steps are speculative, validated once the norm is known
    (zero.optimizer.speculative). Elsewhere the optimizer runs after backward; with the delayed update
    (zero.optimizer.delayed) it runs during the next step's forward and backward instead."""
    if not overlap_wanted(off, offload_device=offload_device, world_size=world_size, delayed=delayed):
        return
    chunks = opt.prepare_overlap()
    if chunks is None:
        info = opt.info(offload_device)
        logger.warning(
            "offload_optimizer.pipeline_read/pipeline_write: the optimizer does not step during backward "
            "with this placement (of %d optimizer-state elements %d swapped to NVMe in %d copies, %d on "
            "the training device); it steps after backward. The overlap needs a share on NVMe in two "
            "copies and, with ratio below 1.0, no host share between it and the device share",
            info.numel,
            info.swapped_numel,
            info.copies,
            info.device_numel,
        )
        return
    overlap.enable(*layout.grad_gate(chunks))


def build_scheduler(
    lr_scheduler: Optional[Any], cfg: ZeroOffloadConfig, optimizer: ZeroOptimizer
) -> Optional[Any]:
    """The client's scheduler (built when given as a callable of the optimizer), else the config's
    `scheduler` block (zero.optimizer.schedulers), else none."""
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        return lr_scheduler
    if cfg.scheduler is not None:
        from zero.optimizer.schedulers import build_scheduler as from_config

        return from_config(cfg.scheduler, optimizer)
    return None
