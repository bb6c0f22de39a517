"""DeepSpeed's engine accessors and memory calls that scripts, TRL and the RLHF frameworks call by name.

`EngineAPI` is mixed into `ZeroEngine` (zero/engine/engine.py) so that its class stays DeepSpeed's face
without growing further; every method here only reads the engine's config and parts, or delegates to them:

* the configuration accessors (`fp16_enabled()`, `bfloat16_enabled()`, `zero_optimization_stage()`,
  `zero_offload_optimizer()`, `zero_offload_param()`, `get_batch_info()`, ...);
* `offload_states()` / `reload_states()` (DeepSpeed's `OffloadDeviceEnum` / `OffloadStateTypeEnum`);
* `empty_partition_cache()` (stage 3: free every gathered partition nothing holds) and `destroy()`;
* the reports: gradient norm, gradient memory, pinned and NVMe bytes, where the optimizer state lives,
  the inference report of an engine without an optimizer;
* attribute forwarding, as DeepSpeed's engine: a name the engine does not define is looked up on the
  wrapped module (`engine.generate(...)`, `engine.get_input_embeddings()`, `engine.name_or_path` of a
  Hugging Face model). `engine.config` is the engine's config, as in DeepSpeed (the model's is
  `engine.module.config`).
"""

from __future__ import annotations

import enum
import gc
import logging
from typing import Any, Callable, Dict, Iterable, Optional, Set, Tuple

import torch

from offload.config.loader import ZeroOffloadConfig
from offload.config.zero import OffloadOptimizerConfig, OffloadParamConfig
from offload.pinned import PinnedPool
from zero.engine.placement import engine_placement
from zero.layout.base import GradMemory, Layout
from zero.optimizer.state import OptimizerState
from zero.optimizer.tiers.base import StateInfo
from zero.optimizer.update import UpdatePass
from zero.report import InferenceReport

__all__ = ["EngineAPI", "OffloadDeviceEnum", "OffloadStateTypeEnum"]

logger = logging.getLogger("zero")


class OffloadDeviceEnum(str, enum.Enum):
    """DeepSpeed's offload devices (`deepspeed.runtime.zero.offload_config.OffloadDeviceEnum`)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """DeepSpeed's kinds of engine state `offload_states(include=...)` moves."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class EngineAPI:
    """DeepSpeed's accessors and memory calls over a ZeroEngine's config and parts (see the module doc)."""

    config: ZeroOffloadConfig
    device: torch.device
    stage: int
    fp16: bool
    bf16: bool
    optimizer: Any
    offload_device: str
    rule: Any
    layout: Layout
    pool: PinnedPool
    _opt: OptimizerState
    _update: UpdatePass

    check_open: Callable[[], None]  # the engine's

    # ---------------------------------------------------------------------------- configuration accessors
    def fp16_enabled(self) -> bool:
        """Whether the model trains in fp16 (the config's `fp16.enabled`)."""
        return self.fp16

    def bfloat16_enabled(self) -> bool:
        """Whether the model trains in bf16 (the config's `bf16.enabled`)."""
        return self.bf16

    def zero_optimization(self) -> bool:
        """DeepSpeed's: whether ZeRO partitions anything (stage above 0)."""
        return self.stage > 0

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0 to 3."""
        return self.stage

    def zero_offload_optimizer(self) -> Optional[OffloadOptimizerConfig]:
        """The config's `zero_optimization.offload_optimizer` section (None when not given)."""
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Optional[OffloadParamConfig]:
        """The config's `zero_optimization.offload_param` section (None when not given)."""
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state lives off the device (offload_optimizer cpu or nvme)."""
        return self.offload_device in ("cpu", "nvme")

    def zero_sub_group_size(self) -> int:
        """The config's `zero_optimization.sub_group_size` (elements per optimizer chunk)."""
        return int(self.config.zero_optimization.sub_group_size)

    def get_batch_info(self) -> Tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        cfg = self.config
        return (
            int(cfg.train_batch_size),
            int(cfg.train_micro_batch_size_per_gpu),
            int(cfg.gradient_accumulation_steps),
        )

    def checkpoint_tag_validation_enabled(self) -> bool:
        """Whether ranks' differing checkpoint tags are reported (`checkpoint.tag_validation` not Ignore)."""
        return self.config.checkpoint.tag_validation != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        """Whether tags that differ across ranks fail the save (`checkpoint.tag_validation: Fail`)."""
        return self.config.checkpoint.tag_validation == "Fail"

    # ------------------------------------------------------------------------------------ device memory
    def empty_partition_cache(self) -> None:
        """Stage 3: free every gathered parameter partition nothing holds (persistent ones and ones kept for
        a reuse included) and the read-ahead copies; the next forward gathers them again. Elsewhere nothing
        is cached: a no-op."""
        part = getattr(self.layout, "partitioner", None)  # type: ignore[attr-defined]
        if part is None:
            return
        for unit in part.units:
            part.repartition(unit)
        part.drop_read_ahead()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def offload_states(
        self,
        include: Optional[Iterable[Any]] = None,
        device: Any = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """DeepSpeed's: move the engine's states out of accelerator memory (between an RLHF generation and
        training, say) until `reload_states()`. `include`: OffloadStateTypeEnum members (or their names),
        all of them when None; `device`: "cpu" (None/"none": a warning, nothing moved; "nvme": ValueError,
        as DeepSpeed). States that already live in host memory (every state on a CPU-only machine; the
        fp32 master and optimizer states with offload_optimizer cpu/nvme) stay where they are. A state
        resident in accelerator memory is refused with NotImplementedError naming the config that keeps
        it on the host."""
        if self.optimizer is None:
            raise RuntimeError("offload_states() needs a training engine: this engine has no optimizer")
        offload_param = self.zero_offload_param()
        param_tier = offload_param.device if offload_param is not None else "none"
        if param_tier != "none":
            raise ValueError(
                f"offload_states(): parameters are offloaded already (offload_param.device={param_tier!r});"
                " moving states across devices is not supported with offloaded parameters (as in DeepSpeed)"
            )
        dev = OffloadDeviceEnum(getattr(device, "value", device) if device is not None else "none")
        if dev is OffloadDeviceEnum.none:
            logger.warning("offload_states(): no device given (device=none); nothing is moved")
            return
        if dev is OffloadDeviceEnum.nvme:
            raise ValueError("offload_states(device='nvme') is not supported: states move to 'cpu' only")
        kinds = _kinds(include)
        on_device = sorted(k.value for k in kinds if self._state_on_accelerator(k))
        if on_device:
            raise NotImplementedError(
                f"offload_states(): {', '.join(on_device)} live in {self.device.type} memory and moving"
                " them is not implemented; keep them in host memory with"
                " zero_optimization.offload_optimizer.device 'cpu' (optimizer states, fp32 master)"
            )
        self._offloaded_states().update(kinds)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's: bring back what `offload_states()` moved (nothing offloaded: a no-op)."""
        if self.optimizer is None:
            raise RuntimeError("reload_states() needs a training engine: this engine has no optimizer")
        self._offloaded_states().clear()

    def offloaded_states(self) -> Set[OffloadStateTypeEnum]:
        """The states `offload_states()` took off the accelerator and `reload_states()` has not restored."""
        return set(self._offloaded_states())

    def _offloaded_states(self) -> Set[OffloadStateTypeEnum]:
        states = self.__dict__.setdefault("_offloaded", set())
        return states

    def _state_on_accelerator(self, kind: OffloadStateTypeEnum) -> bool:
        """Whether state `kind` is held in accelerator memory now."""
        if self.device.type == "cpu":
            return False
        layout = self.layout  # type: ignore[attr-defined]
        if kind in (OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params):
            return self.offload_device == "none"
        if kind in (OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer):
            g = layout.early_grads(False)
            return g is not None and g.device.type != "cpu"
        return True  # lp_params: the model-dtype weights are on the device

    # ------------------------------------------------------------------------------------ the module
    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup failed. Dunder names are never forwarded (copy, pickle and
        # friends probe them), nor anything before the module is set (a construction that failed).
        module = self.__dict__.get("module")
        if module is None or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}' (nor has its module, a "
                f"{type(module).__name__})"
            ) from None

    # ------------------------------------------------------------------------------------- reports
    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global gradient norm of the last step (`get_global_grad_norm()`); None before one."""
        return self._update.last_grad_norm

    def get_global_grad_norm(self) -> Optional[float]:
        """DeepSpeed's: the 2-norm of the last step's gradients over all ranks and parameters, unscaled
        and before clipping (what torch's clip_grad_norm_ returns); None before the first step, inf/nan
        when that step overflowed."""
        return self._update.last_grad_norm

    def gradient_memory(self) -> GradMemory:
        """The gradient bytes this rank allocated, counted from the tensors (zero.layout.base.GradMemory):
        at stage 2 the buckets and, without optimizer offload, the rank's partition on the device."""
        layout = self.layout
        if hasattr(layout, "grad_memory"):
            return layout.grad_memory()
        g = layout.grad_host  # stage 3 / inference: the gradient partition only
        n = 0 if g is None else g.numel() * g.element_size()
        on_device = self.offload_device == "none"
        return GradMemory(
            partition_device_bytes=n if on_device else 0, partition_host_bytes=0 if on_device else n
        )

    @property
    def partitioner(self) -> Any:
        """Stage 3: the parameter partitioner (zero.stage3); None at stages 0-2."""
        return self.layout.partitioner

    @property
    def part_numel(self) -> int:
        """Elements of this rank's optimizer partition."""
        return self.layout.part_numel

    @property
    def trainable_numel(self) -> int:
        """Elements of the trainable parameters (the whole model, not this rank's share)."""
        return self.layout.trainable_numel

    @property
    def lo(self) -> int:
        """First element of this rank's optimizer partition in the flat trainable order."""
        return self.layout.lo

    @property
    def hi(self) -> int:
        """End (exclusive) of this rank's optimizer partition in the flat trainable order."""
        return self.layout.hi

    def inference_report(
        self, read_ceiling_gbs: Optional[float] = None, machine_profile: Optional[str] = None
    ) -> InferenceReport:
        """An engine without an optimizer: forwards, tokens, tokens/s, bytes read per forward and the achieved
        read bandwidth since the last call, against the disk's read ceiling (`read_ceiling_gbs`, else the
        `nvme_read_gbps` of a `ds-nvme-bench --json` profile). Resets the counts that
        `partitioner.take_io_report()` also resets (docs/inference.md, "Throughput")."""
        if self.rule is not None:
            raise RuntimeError(
                "inference_report() is the report of an engine without an optimizer; a training engine "
                "reports each step in engine.last_report"
            )
        rep = self.layout.inference_report(read_ceiling_gbs, machine_profile)  # type: ignore[attr-defined]
        rep.predicted_s_per_forward = self.config.zero_offload.predicted_seconds
        return rep

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes this engine's pinned pool holds."""
        return self.pool.bytes_in_use

    @property
    def optimizer_nvme_bytes(self) -> int:
        """Bytes of the optimizer state's swap files."""
        space = self._opt.space if self._opt is not None else None
        return space.bytes_allocated if space is not None else 0

    @property
    def nvme_bytes(self) -> int:
        """Bytes of swap files: optimizer state plus (stage 3) parameter partitions."""
        return self.optimizer_nvme_bytes + self.layout.param_nvme_bytes

    @property
    def swap_dir(self) -> Optional[str]:
        """The optimizer state's private swap directory; None without NVMe offload."""
        space = self._opt.space if self._opt is not None else None
        return space.dir if space is not None else None

    def placement(self) -> Dict[str, Any]:
        """Where each state went and why: parameters and optimizer state, bytes per tier (device, RAM,
        NVMe) on this rank, and the pinned budget (zero.engine.placement)."""
        self.check_open()
        return engine_placement(self)

    def optimizer_state_info(self) -> StateInfo:
        """Where the optimizer state lives: tier, chunking, NVMe copies, bytes per pass."""
        self.check_open()
        return self._opt.info(self.offload_device if self.offload_device != "none" else "device")

    @property
    def optimizer_state(self) -> Any:
        """The optimizer state's tier object (zero.optimizer.tiers.base.StateTier), for I/O fault
        injection and inspection; stepping it directly bypasses the engine's commit and restore logic."""
        return self._opt.tier

    # ---------------------------------------------------------------------------------------- lifetime
    def destroy(self) -> None:
        """DeepSpeed's: release what the engine holds (hooks, pinned buffers, swap files): `close()`."""
        self.close()  # type: ignore[attr-defined]


def _kinds(include: Optional[Iterable[Any]]) -> Set[OffloadStateTypeEnum]:
    if include is None:
        return set(OffloadStateTypeEnum)
    if isinstance(include, (str, OffloadStateTypeEnum)):
        include = [include]
    out = set()
    for k in include:
        try:
            out.add(OffloadStateTypeEnum(getattr(k, "value", k)))
        except ValueError:
            names = ", ".join(m.value for m in OffloadStateTypeEnum)
            raise ValueError(f"offload_states(include=...): {k!r} is not one of {names}") from None
    return out
