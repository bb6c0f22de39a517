"""Client optimizers the fused kernels do not implement (SGD with momentum, RMSprop, Adamax, any torch
optimizer): stepped on the host by their own class over the fp32 master, equal to torch's optimizer on the
same model, with DeepSpeed's `zero_allow_untested_optimizer` / `zero_force_ds_cpu_optimizer` semantics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero

ALLOW = {"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _groups(model: nn.Module, first: dict) -> list:
    """Two param groups: the first layer with its own hyperparameters, the rest with the defaults."""
    params = list(model.parameters())
    return [{"params": params[:2], **first}, {"params": params[2:]}]


OPTIMIZERS = {
    "sgd_momentum": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        {"lr": 0.02, "momentum": 0.5},
    ),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, momentum=0.1), {"alpha": 0.8}),
    "adamax": (lambda ps: torch.optim.Adamax(ps, lr=0.01), {"lr": 0.005}),
}


def _config(stage: int, offload: str = "cpu", **extra) -> dict:
    zo = {"stage": stage, "offload_optimizer": {"device": offload}}
    if stage == 3:
        zo["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zo, **ALLOW, **extra}


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [2, 3])
def test_equals_torch_optimizer(name, stage):
    make, first = OPTIMIZERS[name]
    ref = _model()
    ref_opt = make(_groups(ref, first))
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    model = _model()
    client = make(_groups(model, first))
    engine, opt, _, _ = zero.initialize(
        model=model,
        optimizer=client,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        config=_config(stage),
    )
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    for step in range(6):
        x, y = _batch(step)
        loss = (ref(x) - y).pow(2).mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        got = (engine(x) - y).pow(2).mean()
        engine.backward(got)
        engine.step()  # steps the scheduler too, as DeepSpeed's
        assert got.item() == loss.item(), f"step {step}"
    weights = zero.consolidated_state_dict(engine)
    for k, v in ref.state_dict().items():
        assert torch.equal(weights[k], v), k
    engine.close()


def test_without_offload_no_force_key_is_needed():
    ref, model = _model(), _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    engine, *_ = zero.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        config={**cfg, "zero_allow_untested_optimizer": True},
    )
    for step in range(3):
        x, y = _batch(step)
        (ref(x) - y).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()
    weights = zero.consolidated_state_dict(engine)
    assert all(torch.equal(weights[k], v) for k, v in ref.state_dict().items())
    engine.close()


def test_deepspeed_config_checks_name_their_keys(tmp_path):
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match='"zero_allow_untested_optimizer": true'):
        zero.initialize(model=model, optimizer=sgd, config=_config(2, zero_allow_untested_optimizer=False))
    with pytest.raises(ValueError, match='"zero_force_ds_cpu_optimizer": false'):
        zero.initialize(model=model, optimizer=sgd, config=_config(2, zero_force_ds_cpu_optimizer=True))
    cfg = _config(2, "nvme")
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
    with pytest.raises(ValueError, match="device='nvme'"):
        zero.initialize(model=model, optimizer=sgd, config=cfg)
    # the kernels' own optimizers need neither key
    engine, *_ = zero.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        config=_config(2, **{"zero_allow_untested_optimizer": False, "zero_force_ds_cpu_optimizer": True}),
    )
    engine.close()


def test_checkpoints_are_refused_not_saved_without_the_optimizer_state(tmp_path):
    model = _model()
    engine, opt, *_ = zero.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), config=_config(2)
    )
    x, y = _batch(0)
    engine.backward((engine(x) - y).pow(2).mean())
    engine.step()
    with pytest.raises(NotImplementedError, match="momentum buffers"):
        engine.save_checkpoint(str(tmp_path))
    with pytest.raises(NotImplementedError, match="torch.SGD"):
        opt.state_dict()
    assert list(tmp_path.iterdir()) == []
    engine.close()
