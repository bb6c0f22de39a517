"""Each optimizer type's defaults are DeepSpeed's, and the same wherever the engine or a CPU optimizer takes
them: the config section, a client optimizer of offload.ops built without values, and the engine's step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero
from offload import ops
from offload.config import load_config

# DeepSpeed's defaults: DeepSpeedCPUAdam / FusedAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion / FusedLion
DEEPSPEED = {
    "Adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "AdamW": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "Adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0},
    "Lion": {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0},
}
CPU_OPTIMIZERS = {"Adam": ops.CPUAdam, "AdamW": ops.CPUAdamW, "Adagrad": ops.CPUAdagrad, "Lion": ops.CPULion}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _hyper(group: dict, names) -> dict:
    return {k: tuple(group[k]) if k == "betas" else group[k] for k in names}


@pytest.mark.parametrize("kind", sorted(DEEPSPEED))
def test_defaults_agree_with_deepspeed(kind):
    want = DEEPSPEED[kind]
    params = load_config({"optimizer": {"type": kind}}).optimizer.params
    assert {k: params[k] for k in want} == want
    cpu = CPU_OPTIMIZERS[kind]([nn.Parameter(torch.zeros(4))])
    assert _hyper(cpu.param_groups[0], want) == want
    for client in (None, CPU_OPTIMIZERS[kind]):
        model = _model()
        config = {"train_batch_size": 1}
        if client is None:
            config["optimizer"] = {"type": kind}
            engine, optimizer, _, _ = zero.initialize(model=model, config=config)
        else:
            engine, optimizer, _, _ = zero.initialize(
                model=model, optimizer=client(model.parameters()), config=config
            )
        assert _hyper(optimizer.param_groups[0], want) == want, client
        engine.destroy()


def test_lion_steps_with_deepspeeds_default_lr():
    """From zero momentum the first Lion update is sign(grad): every weight moves by exactly lr = 1e-3."""
    model, reference = _model(), _model()
    x = torch.randn(3, 8)
    reference(x).square().sum().backward()
    engine, *_ = zero.initialize(model=model, config={"train_batch_size": 1, "optimizer": {"type": "Lion"}})
    engine.backward(engine(x).square().sum())
    engine.step()
    before = [p.detach() for p in reference.parameters()]
    grads = [p.grad for p in reference.parameters()]
    for p, p0, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), p0 - 1e-3 * torch.sign(g), rtol=0, atol=1e-7)
    engine.destroy()
