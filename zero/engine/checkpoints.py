"""The engine's training state as checkpoints see it: whether it can be trusted, the optimizer state in and
out, the whole model's weights, and DeepSpeed's `save_checkpoint` / `load_checkpoint` / `save_16bit_model`.

`CheckpointAPI` is mixed into `ZeroEngine` (zero/engine/engine.py) beside `EngineAPI`: each method settles
the engine (a pass started during backward dropped, a delayed update applied, deferred NVMe writes waited
for) and delegates to the optimizer state (zero.optimizer.state), the layout or zero.checkpoint.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.config.loader import ZeroOffloadConfig
from zero.layout.base import Layout
from zero.optimizer.integrity import StateGuard
from zero.optimizer.state import OptimizerState
from zero.optimizer.update import UpdatePass

__all__ = ["CheckpointAPI"]


class CheckpointAPI:
    """State integrity, optimizer-state I/O and checkpoints over a ZeroEngine's parts (see the module doc)."""

    config: ZeroOffloadConfig
    layout: Layout
    optimizer: Any
    rule: Any
    lo: int
    hi: int
    _guard: StateGuard
    _opt: OptimizerState
    _update: UpdatePass

    # the engine's own methods these call
    check_open: Callable[[], None]
    settle_update: Callable[[], None]
    _require_optimizer: Callable[[str], None]
    _require_checkpointable: Callable[[str], None]

    # ------------------------------------------------------------------------------------- state integrity
    @property
    def state_error(self) -> Optional[BaseException]:
        """The failure that made the training state unusable (see `check_state_usable`); None when usable."""
        return self._guard.error

    def check_state_usable(self) -> None:
        """Raise `StateCorruptedError` if a failure may have left master, optimizer states or parameters
        inconsistent (an I/O error while state was updated in place, a failed restore, a checkpoint load
        that stopped part way). Steps, backward and checkpoint saves call this; loading a checkpoint
        completely (with its optimizer states) makes the engine usable again."""
        self._guard.check()

    def poison_state(self, err: BaseException, what: Optional[str] = None) -> None:
        """Mark the training state unusable because of `err`: `step`, `backward` and saves raise
        `StateCorruptedError` until `mark_state_restored()`."""
        self._guard.poison(err, what)

    def mark_state_restored(self) -> None:
        """A checkpoint's module weights and optimizer states were loaded completely: usable again."""
        self._guard.clear()

    def prepare_checkpoint_save(self) -> None:
        """Settle the engine before a checkpoint reads its state: a pass started during backward is dropped
        (the committed state is saved, as without overlap); the last step's deferred NVMe writes are waited
        for - if one failed, that step is undone and its `DeferredWriteError` raised, so no save pairs its
        weights with the older optimizer state; an unusable state raises `StateCorruptedError`."""
        self.check_open()
        self.check_state_usable()
        self._update.drop_overlapped()
        self.settle_update()
        self._opt.settle_write_back()
        self.check_state_usable()

    def sync_master_from_module(self) -> None:
        """Rebuild the fp32 master from the module's current weights (optimizer states are kept): after
        loading only the module's weights, the next step starts from them. With 16-bit weights the master
        takes their (16-bit) values. An error part way poisons the engine."""
        self.check_open()
        if self.optimizer is None:
            return  # no master to rebuild
        self._update.drop_overlapped()
        self.settle_update()
        self._opt.rebuild_master(self.layout.master_from_module())

    # --------------------------------------------------------------------------- optimizer state I/O
    def optimizer_state_dict(self) -> Dict[str, Any]:
        """This rank's optimizer state: rule, hyperparameters, step, partition, master and states."""
        self._require_checkpointable("optimizer.state_dict()")
        self._update.drop_overlapped()  # between backward and step: the committed state, as without overlap
        self.settle_update()
        self._opt.settle_write_back()
        master, states = self._opt.master_and_states()
        return {
            "rule": self.rule.kind,
            "param_groups": self.optimizer.group_hyperparameters(),
            "step": self.optimizer.step_count,
            "partition": (self.lo, self.hi),
            "master": master,
            "states": states,
        }

    def load_optimizer_state_dict(self, sd: Dict[str, Any]) -> None:
        """Load what `optimizer_state_dict` returned (same rule and partition; ValueError otherwise)."""
        if sd["rule"] != self.rule.kind or tuple(sd["partition"]) != (self.lo, self.hi):
            raise ValueError(
                f"optimizer state is for {sd['rule']} over partition {tuple(sd['partition'])}, "
                f"this engine runs {self.rule.kind} over {(self.lo, self.hi)}"
            )
        self.optimizer.check_hyperparameters(sd["param_groups"], "load_optimizer_state_dict")
        self._update.drop_overlapped()
        self.settle_update()
        self._opt.load_values(sd["master"], sd["states"])
        self.optimizer.load_hyperparameters(sd["param_groups"], "load_optimizer_state_dict")
        self.optimizer.step_count = int(sd["step"])
        self._opt.restore_params()

    def stream_optimizer_state(
        self, fn: Callable[[int, int, torch.Tensor, List[torch.Tensor]], None]
    ) -> None:
        """`fn(start, n, master, states)` over the committed state, chunk by chunk (checkpoint writes)."""
        self.settle_update()
        self._opt.stream_out(fn)

    def load_optimizer_state(self, fn: Callable[[int, int, torch.Tensor, List[torch.Tensor]], None]) -> None:
        """`fn(start, n, master, states)` fills the state chunk by chunk (checkpoint reads)."""
        self.settle_update()
        self._opt.stream_in(fn)

    def consolidated_state_dict(self, fp32: bool = False) -> Dict[str, torch.Tensor]:
        """The whole model's state dict on the CPU (collective at stages 1-3: every rank calls it).
        `fp32=True`: trainable parameters from the fp32 master instead of the model-dtype weights."""
        sd = self.layout.module_state_dict()
        if fp32:
            sd.update(self.fp32_master_state_dict())
        return sd

    def fp32_master_state_dict(self) -> Dict[str, torch.Tensor]:
        """The trainable parameters' fp32 master values, whole (collective)."""
        self._update.drop_overlapped()
        self.settle_update()
        self._opt.settle_write_back()
        master, _ = self._opt.master_and_states()
        return self.layout.master_state_dict(master)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's: the config's zero_optimization.stage3_gather_16bit_weights_on_model_save."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> Optional[Dict[str, torch.Tensor]]:
        """DeepSpeed's: the whole model's state dict in the model dtype on rank 0, None on the others
        (stage 3 only; collective; zero.checkpoint.export16)."""
        from zero.checkpoint.export16 import zero3_consolidated_16bit_state_dict

        return zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's: the whole model (model dtype) saved as `save_dir/save_filename` by rank 0, atomically;
        every rank must call it. False (nothing saved) at stage 3 without
        `stage3_gather_16bit_weights_on_model_save: true` (zero.checkpoint.export16)."""
        from zero.checkpoint.export16 import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Optional[str] = None,
        client_state: Optional[Dict[str, Any]] = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """DeepSpeed's: every rank calls it; tag None: `global_step<N>`; `save_latest=False` leaves the
        `latest` file as it was; `exclude_frozen_parameters` leaves out the parameters with requires_grad
        False (an adapter's base model). Returns the checkpoint's directory
        (zero.checkpoint.save_checkpoint)."""
        from zero.checkpoint.save import save_checkpoint

        self._require_optimizer("save_checkpoint() (training state; save_16bit_model exports the weights)")
        self._require_checkpointable("save_checkpoint()")
        return save_checkpoint(
            self,
            save_dir,
            tag=tag,
            client_state=client_state,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Optional[str] = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        *,
        allow_pickle: bool = False,
    ) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
        """DeepSpeed's load_checkpoint; `allow_pickle=True` also loads what only pickle can restore (see
        zero.checkpoint.load_checkpoint: only for checkpoints from a trusted source). Without an optimizer
        only the module's weights (and counters) are loaded, whatever `load_optimizer_states` says."""
        from zero.checkpoint.load import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            allow_pickle=allow_pickle,
        )
