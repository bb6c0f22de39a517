"""zero_offload.delayed_update: step t's host optimizer pass runs during step t+1's forward and backward.

The reference is a plain torch loop that applies step t's AdamW update after step t+1's forward and
backward (`delayed_reference`); the engine must follow it step for step (losses) and end on its weights once
the pending update is settled. A forward hook that waits for the pending pass proves the overlap ran
(StepReport.optimizer_chunks_hidden counts the chunks done before the engine waited for the pass).
"""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

import zero
from offload.config import ConfigError, load_config
from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)
DATA = corpus_bytes()
ATOL = 2e-5  # the C++ kernel against torch's AdamW: rounding only (tests/test_engine.py, LOSS_ATOL)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY)


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _config(device: str = "cpu", tmp=None, warmup: int = 0, enabled: bool = True, **extra) -> dict:
    off: dict = {"device": device}
    if device == "nvme":
        off.update(nvme_path=str(tmp), max_in_cpu=0)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "zero_optimization": {"stage": 2, "sub_group_size": 8000, "offload_optimizer": off},
        "zero_offload": {"delayed_update": {"enabled": enabled, "warmup_steps": warmup}},
    }
    cfg.update(extra)
    return cfg


def delayed_reference(steps: int, warmup: int, clip: float = 0.0, gas: int = 1):
    """Plain torch: the first `warmup` steps update at once; from then on step t's update (its gradients)
    is applied after step t+1's forward and backward; the last one at the end."""
    model = _model()
    opt = _opt(model)
    params = list(model.parameters())
    pending: Optional[List[torch.Tensor]] = None

    def apply(grads: List[torch.Tensor]) -> None:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()

    losses = []
    for t in range(steps):
        for m in range(gas):
            x, y = get_batch(DATA, 4, TINY.seq_len, t * gas + m)
            loss = model(x, y)
            (loss / gas).backward()
            losses.append(loss.item())
        grads = [p.grad.clone() for p in params]
        opt.zero_grad()
        if pending is not None:
            apply(pending)
            pending = None
        if t < warmup:
            apply(grads)
        else:
            pending = grads
    if pending is not None:
        apply(pending)
    return losses, torch.cat([p.detach().reshape(-1) for p in params])


def _train(engine, steps: int, gas: int = 1, hook: bool = False):
    reports, losses = [], []
    if hook:  # each forward waits until the pending pass finished: the overlap happens, whatever the timing

        def wait(module, args):
            if engine.delayed_update is not None and engine.delayed_update.pending:
                assert engine.delayed_update.wait_done(60.0)

        engine.module.register_forward_pre_hook(wait)
    for t in range(steps * gas):
        x, y = get_batch(DATA, 4, TINY.seq_len, t)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (t + 1) % gas == 0:
            reports.append(engine.last_report)
    return losses, reports


def _params(engine) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


@pytest.mark.parametrize(
    "device,warmup",
    [
        ("cpu", 0),
        pytest.param("cpu", 2, marks=pytest.mark.slow),
        pytest.param("nvme", 1, marks=pytest.mark.slow),
    ],
)
def test_delayed_update_equals_the_torch_loop_that_applies_step_t_after_step_t_plus_1(
    tmp_path, device, warmup
) -> None:
    steps = 6
    want_losses, want_params = delayed_reference(steps, warmup)
    engine = zero.initialize(model=_model(), config=_config(device, tmp_path, warmup))[0]
    losses, reports = _train(engine, steps, hook=True)
    assert losses == pytest.approx(want_losses, abs=ATOL)
    assert engine.delayed_update.pending  # the last step's update is still on its way
    engine.settle_update()
    assert not engine.delayed_update.pending
    assert torch.allclose(_params(engine), want_params, atol=ATOL, rtol=0)
    assert engine.optimizer.step_count == steps
    # the overlap ran: every step after the first delayed one applied a pass that had finished all its
    # chunks during this step's forward and backward
    delayed = reports[warmup + 1 :]
    assert [r.delayed_updates for r in delayed] == [1] * len(delayed)
    chunks = engine.optimizer_state_info().chunks
    assert [r.optimizer_chunks_hidden for r in delayed] == [chunks] * len(delayed)
    assert all(0 < r.host_step_hidden_s <= r.host_step_s for r in delayed)
    assert all(r.delayed_updates == 0 for r in reports[: warmup + 1])
    engine.close()


def test_the_delayed_trajectory_is_not_the_ordinary_one() -> None:
    """The reference above is not ordinary training in disguise (the test could not tell them apart)."""
    delayed, _ = delayed_reference(3, 0)
    ordinary, _ = delayed_reference(3, 3)
    assert abs(delayed[2] - ordinary[2]) > 100 * ATOL


def test_delayed_update_with_clipping_and_accumulation() -> None:
    steps, gas = 4, 2
    want_losses, want_params = delayed_reference(steps, 1, clip=0.05, gas=gas)
    cfg = _config(warmup=1, gradient_clipping=0.05, gradient_accumulation_steps=gas)
    engine = zero.initialize(model=_model(), config=cfg)[0]
    losses, _ = _train(engine, steps, gas=gas)
    assert losses == pytest.approx(want_losses, abs=ATOL)
    engine.close()  # settles the pending update first: the module keeps the final weights
    assert torch.allclose(_params(engine), want_params, atol=ATOL, rtol=0)


def test_checkpoint_settles_the_pending_update(tmp_path) -> None:
    steps = 3
    _, want_params = delayed_reference(steps, 0)
    engine = zero.initialize(model=_model(), config=_config())[0]
    _train(engine, steps)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    assert not engine.delayed_update.pending
    assert torch.allclose(_params(engine), want_params, atol=ATOL, rtol=0)
    engine.close()
    other = zero.initialize(model=_model(), config=_config())[0]
    other.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    assert torch.equal(_params(other), _params(engine))
    assert other.optimizer.step_count == steps
    other.close()


def test_delayed_update_config_is_validated() -> None:
    cfg = load_config({"zero_offload": {"delayed_update": {"enabled": True, "warmup_steps": 3}}})
    assert cfg.zero_offload.delayed_update.enabled and cfg.zero_offload.delayed_update.warmup_steps == 3
    with pytest.raises(ConfigError, match="zero_offload.delayed_update.warmup_step"):
        load_config({"zero_offload": {"delayed_update": {"warmup_step": 3}}})
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_config({"zero_offload": {"delayed_update": {"warmup_steps": -1}}})


@pytest.mark.parametrize(
    "change,message",
    [
        ({"device": "none"}, "no host step to hide"),
        ({"ratio": 0.5}, "ratio=0.5"),
    ],
)
def test_placements_without_a_host_step_to_hide_are_refused(change, message) -> None:
    cfg = _config()
    cfg["zero_optimization"]["offload_optimizer"].update(change)
    with pytest.raises(ValueError, match=message):
        zero.initialize(model=_model(), config=cfg)


def test_stage_3_and_several_ranks_are_refused_before_anything_is_built() -> None:
    from zero.optimizer.delayed import check_delayed

    cfg = load_config(_config())
    with pytest.raises(ValueError, match="stage 0-2"):
        check_delayed(cfg, offload_device="cpu", stage=3)
    with pytest.raises(ValueError, match="one rank"):
        check_delayed(cfg, offload_device="cpu", stage=2, world=2)
    check_delayed(cfg, offload_device="nvme", stage=2)  # served
    check_delayed(load_config(_config(enabled=False)), offload_device="none", stage=3, world=8)  # off
