"""The optimizer `zero.initialize` returns for a client optimizer is an instance of the client's class too,
with the engine's behaviour: param groups, state_dict, zero_grad and step as the ZeroOptimizer's."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import zero
from zero.optimizer.rules import ZeroOptimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["adamw", "adam", "sgd"],
)
def test_returned_optimizer_is_an_instance_of_the_client_class(make):
    model = _model()
    client = make(model.parameters())
    engine, opt, _, _ = zero.initialize(model=model, optimizer=client, config=CONFIG)
    assert opt is engine.optimizer and opt is not client
    assert isinstance(opt, type(client)) and isinstance(opt, ZeroOptimizer)
    assert isinstance(opt, torch.optim.Optimizer)
    # the engine's behaviour, not the client's
    assert opt.param_groups[0]["lr"] == client.param_groups[0]["lr"]
    with pytest.raises(RuntimeError, match="engine.step"):
        opt.step()
    x = torch.randn(4, 8)
    engine.backward(engine(x).pow(2).mean())
    opt.zero_grad()
    engine.step()
    if not isinstance(opt, torch.optim.SGD):  # an SGD engine keeps its state out of checkpoints
        sd = opt.state_dict()
        assert sd["step"] == 1 and sd["rule"] in ("adam", "adamw")
    # one class per client class
    model2 = _model()
    engine2, opt2, _, _ = zero.initialize(model=model2, optimizer=make(model2.parameters()), config=CONFIG)
    assert type(opt2) is type(opt)
    engine.close()
    engine2.close()


def test_without_a_client_optimizer_it_is_the_plain_zero_optimizer():
    cfg = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, opt, _, _ = zero.initialize(model=_model(), config=cfg)
    assert type(opt) is ZeroOptimizer and not isinstance(opt, torch.optim.AdamW)
    engine.close()


def test_the_client_del_never_runs_on_the_engine_optimizer():
    calls = []

    class Tracked(torch.optim.SGD):
        def __init__(self, params, **kw):
            super().__init__(params, **kw)
            self.handle = object()

        def __del__(self):
            calls.append(getattr(self, "handle", None))  # None: its __init__ never ran on this object

    model = _model()
    client = Tracked(model.parameters(), lr=0.1)
    engine, opt, _, _ = zero.initialize(model=model, optimizer=client, config=CONFIG)
    assert isinstance(opt, Tracked)
    del client
    gc.collect()
    assert len(calls) == 1  # the client's own
    engine.close()
    del engine, opt
    gc.collect()
    assert len(calls) == 1
