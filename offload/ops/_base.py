"""What CPUAdam, CPUAdagrad and CPULion share: state dtype policy, error context, torch-compatible
state_dict loading."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import torch

from .quant import check_seed


class CPUOptimizerBase(torch.optim.Optimizer):
    """torch.optim.Optimizer with per-parameter state kept in fp32 (or bf16) on the CPU.

    Subclasses set `_state_keys` (the per-element state tensors, e.g. exp_avg) and implement step().
    state_dict() is torch's; load_state_dict() also accepts one saved by the torch optimizer of the same
    algorithm, and restores state tensors bit-exactly in this optimizer's state dtype (torch's own loader
    would first cast them to the param's dtype, which for 16-bit params loses bits).
    """

    _state_keys: Tuple[str, ...] = ()

    @staticmethod
    def _state_dtype(group: Dict[str, Any]) -> torch.dtype:
        return torch.float32 if group.get("fp32_optimizer_states", True) else torch.bfloat16

    @staticmethod
    def _check_rounding(fp32_optimizer_states: bool, stochastic_rounding: bool, seed: int) -> None:
        if not isinstance(stochastic_rounding, bool):
            raise ValueError(f"stochastic_rounding must be a bool, got {stochastic_rounding!r}")
        check_seed(seed)
        if stochastic_rounding and fp32_optimizer_states:
            raise ValueError(
                "stochastic_rounding=True applies to bf16 optimizer states: pass fp32_optimizer_states=False"
            )

    @staticmethod
    def _rounding(group: Dict[str, Any], gi: int, pi: int) -> Dict[str, Any]:
        """make_segment's stochastic-rounding arguments for param pi of group gi: its own seed,
        seed + gi * 2^32 + pi (mod 2^64), so that tensors of one step draw different bits."""
        if not group.get("stochastic_rounding", False):
            return {}
        seed = (int(group.get("seed", 0)) + (gi << 32) + pi) & 0xFFFFFFFFFFFFFFFF
        return {"stochastic_rounding": True, "seed": seed}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        # A state_dict from a torch optimizer lacks our keys: fill them from this instance's defaults.
        for group in self.param_groups:
            self._fill_group_defaults(group)

    def _fill_group_defaults(self, group: Dict[str, Any]) -> None:
        for key, value in self.defaults.items():
            group.setdefault(key, value)

    def _params_with_grad(self, gi: int, group: Dict[str, Any]) -> Iterator[Tuple[torch.Tensor, str, int]]:
        """Yields (param, where, pi) for each param of group `gi` with a grad; `where` names it for errors,
        pi is its index in the group."""
        for pi, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            where = f"param {pi} of param group {gi} (shape {tuple(p.shape)}, dtype {p.dtype})"
            if p.grad.is_sparse:
                raise ValueError(f"{where}: sparse gradients are not supported")
            if p.grad.shape != p.shape:
                raise ValueError(f"{where}: grad has shape {tuple(p.grad.shape)}")
            yield p, where, pi

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        saved_state = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        for group in saved_groups:
            if group.get("amsgrad", False):
                raise ValueError("cannot load a state_dict with amsgrad=True: amsgrad is not supported")
        super().load_state_dict(state_dict)  # checks group/param counts, restores hyperparameters
        by_id = {
            pid: (group, p)
            for saved, group in zip(saved_groups, self.param_groups)
            for pid, p in zip(saved["params"], group["params"])
        }
        for pid, saved in saved_state.items():
            if pid not in by_id:
                continue
            group, p = by_id[pid]
            self.state[p] = self._restore_state(saved, p, self._state_dtype(group))

    def _restore_state(
        self, saved: Dict[str, Any], p: torch.Tensor, state_dtype: torch.dtype
    ) -> Dict[str, Any]:
        state: Dict[str, Any] = {}
        for key, value in saved.items():
            if key == "step":
                # torch keeps step as a float32 scalar tensor on the CPU; older checkpoints hold a number.
                step = float(value.item()) if torch.is_tensor(value) else float(value)
                state[key] = torch.tensor(step, dtype=torch.float32)
            elif key in self._state_keys:
                if not torch.is_tensor(value) or value.shape != p.shape:
                    shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                    raise ValueError(f"state '{key}' has shape {shape}, param has {tuple(p.shape)}")
                state[key] = value.detach().to(device="cpu", dtype=state_dtype, copy=True).contiguous()
            else:
                state[key] = value
        return state
