"""Several engines in one process: models built under one zero.Init (RLHF's actor and reference, a teacher and
a student) or under two, each wrapped by an engine of its own with its own partitioner and swap space,
trained alternately, each exactly as when it trains alone."""

from __future__ import annotations

import engine_helpers
import pytest
import torch
from engine_helpers import TINY
from stage3_helpers import MLP, s3_config
from torch import nn

import zero
from zero.examples.models import GPT


def _build(seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def _cfg(tier: str, tmp) -> dict:
    cfg = engine_helpers.s3_config(tier, tier, tmp)
    cfg["train_micro_batch_size_per_gpu"] = 8
    return cfg


def train(engine, steps: int, start: int = 0) -> list:
    """`steps` optimizer steps on the regression batches `start`, `start + 1`, ...: their losses."""
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _alone(cfg, seed: int, steps: int, start: int):
    """The single-engine run of the model `seed` builds: its losses and final weights."""
    with zero.Init(config=cfg):
        model = _build(seed)
    engine, *_ = zero.initialize(model=model, config=cfg)
    losses = train(engine, steps, start=start)
    weights = zero.consolidated_state_dict(engine)
    engine.close()
    return losses, weights


def _alternate(a, b, steps: int):
    la, lb = [], []
    for step in range(steps):
        la += train(a, 1, start=step)
        lb += train(b, 1, start=100 + step)
    return la, lb


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_two_models_under_one_init_train_alternately_each_as_alone(tmp_path, tier):
    cfg = _cfg(tier, tmp_path)
    steps = 4
    with zero.Init(config=cfg) as zi:
        actor = _build(0)
        ref = _build(1)
    assert len(zi.partitioners) == 2 and zi.partitioner is zi.partitioners[1]
    ea, *_ = zero.initialize(model=actor, config=cfg)
    eb, *_ = zero.initialize(model=ref, config=cfg)
    assert ea.partitioner is zi.partitioners[0] and eb.partitioner is zi.partitioners[1]
    if tier == "nvme":  # each engine its own swap directories, parameters and optimizer state
        dirs = {ea.partitioner.store.swap_dir, eb.partitioner.store.swap_dir, ea.swap_dir, eb.swap_dir}
        assert len(dirs) == 4 and None not in dirs
    la, lb = _alternate(ea, eb, steps)
    wa = zero.consolidated_state_dict(ea)
    ea.close()
    lb += train(eb, 1, start=100 + steps)  # the first engine closed: the second goes on, unaffected
    wb = zero.consolidated_state_dict(eb)
    eb.close()
    want_la, want_wa = _alone(cfg, 0, steps, 0)
    assert la == want_la and _same(wa, want_wa)
    want_lb, want_wb = _alone(cfg, 1, steps + 1, 100)
    assert lb == want_lb and _same(wb, want_wb)


def test_two_init_blocks_two_engines(tmp_path):
    cfg_a, cfg_b = _cfg("cpu", tmp_path), _cfg("nvme", tmp_path)
    with zero.Init(config=cfg_a):
        student = _build(2)
    with zero.Init(config=cfg_b):
        teacher = _build(3)
    ea, *_ = zero.initialize(model=student, config=cfg_a)
    eb, *_ = zero.initialize(model=teacher, config=cfg_b)
    la, lb = _alternate(ea, eb, 3)
    wa, wb = zero.consolidated_state_dict(ea), zero.consolidated_state_dict(eb)
    ea.close()
    eb.close()
    want_la, want_wa = _alone(cfg_a, 2, 3, 0)
    want_lb, want_wb = _alone(cfg_b, 3, 3, 100)
    assert (la, lb) == (want_la, want_lb) and _same(wa, want_wa) and _same(wb, want_wb)


@pytest.mark.slow
def test_two_gpts_under_one_init_on_nvme(tmp_path):
    """The same with the GPT of the engine tests, parameters and optimizer state on NVMe."""
    cfg = engine_helpers.s3_config("nvme", "nvme", tmp_path)
    with zero.Init(config=cfg):
        torch.manual_seed(0)
        actor = GPT(TINY)
        torch.manual_seed(1)
        ref = GPT(TINY)
    ea, *_ = zero.initialize(model=actor, config=cfg)
    eb, *_ = zero.initialize(model=ref, config=cfg)
    la, lb = [], []
    for step in range(3):
        la += engine_helpers.train(ea, 1, start=step)
        lb += engine_helpers.train(eb, 1, start=50 + step)
    ea.close()
    eb.close()
    for seed, start, got in ((0, 0, la), (1, 50, lb)):
        with zero.Init(config=cfg):
            torch.manual_seed(seed)
            alone = GPT(TINY)
        eng, *_ = zero.initialize(model=alone, config=cfg)
        assert engine_helpers.train(eng, 3, start=start) == got
        eng.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_model_composed_of_separately_built_models_is_moved_into_one_partitioner(tmp_path, tier):
    """`nn.Sequential(a, b)` of two models built under one Init: their units end in one partitioner (the
    other is closed), with the values they were built with."""
    torch.manual_seed(5)
    want = nn.Sequential(MLP(), MLP(d=4)).state_dict()
    cfg = _cfg(tier, tmp_path)
    torch.manual_seed(5)
    with zero.Init(config=cfg) as zi:
        a, b = MLP(), MLP(d=4)
        model = nn.Sequential(a, b)
    assert len(zi.partitioners) == 2
    engine, *_ = zero.initialize(model=model, config=cfg)
    assert {p.ds_unit.owner for p in model.parameters()} == {engine.partitioner}
    other = next(p for p in zi.partitioners if p is not engine.partitioner)
    assert other.store.swap_dir is None and not other.store.arena.segments  # closed: nothing kept
    got = zero.consolidated_state_dict(engine)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    train(engine, 1)
    engine.close()


def test_module_built_from_a_built_module_joins_its_partitioner(tmp_path):
    class Head(nn.Module):
        def __init__(self, body: nn.Module) -> None:
            super().__init__()
            self.body, self.head = body, nn.Linear(4, 2)

    with zero.Init(config=s3_config("cpu")) as zi:
        body = MLP()
        model = Head(body)
    assert len(zi.partitioners) == 1
    assert {p.ds_unit.owner for p in model.parameters()} == {zi.partitioner}
    zi.partitioner.close()


def test_two_engines_over_one_model_are_refused_clearly(tmp_path):
    cfg = _cfg("cpu", tmp_path)
    with zero.Init(config=cfg):
        model = _build(0)
    engine, *_ = zero.initialize(model=model, config=cfg)
    with pytest.raises(RuntimeError, match="already attached to a model: one partitioner"):
        zero.initialize(model=model, config=cfg)
    assert train(engine, 2) == _alone(cfg, 0, 2, 0)[0]  # the first engine is untouched
    engine.close()


def test_lone_layers_share_one_partitioner_and_a_layer_added_later_is_moved_in(tmp_path):
    """Layers built one by one stay together (no copies); a layer built after a model and put into it (a
    resized embedding) has a partitioner of its own until an engine takes the model, then joins it."""
    cfg = _cfg("cpu", tmp_path)
    with zero.Init(config=cfg) as zi:
        model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    assert len(zi.partitioners) == 1
    torch.manual_seed(7)
    want = MLP()
    want.out = nn.Linear(40, 4)
    torch.manual_seed(7)
    with zero.Init(config=cfg) as zi:
        model = MLP()
        new_out = nn.Linear(40, 4)
    assert len(zi.partitioners) == 2 and new_out.weight.ds_unit.owner is zi.partitioners[1]
    model.out = new_out
    engine, *_ = zero.initialize(model=model, config=cfg)
    assert {p.ds_unit.owner for p in model.parameters()} == {zi.partitioners[0]}
    got = zero.consolidated_state_dict(engine)
    assert all(torch.equal(got[k], v) for k, v in want.state_dict().items())
    engine.close()
