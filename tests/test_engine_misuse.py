"""Calls that once gave silent wrong answers: a backward that raises (its partial gradients must not reach a
later step), `step()` without a `backward()` (skipped: no weight decay on unchanged weights, no schedule or
counter advanced), and a model on the meta device (refused: it would run with zeros)."""

from __future__ import annotations

import errno
import logging

import pytest
import torch
from engine_helpers import DATA, TINY, base_config, make_model

import zero
from zero.examples.models import GPT, get_batch
from zero.stage3 import Init


class FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises EIO (as an activation checkpoint's read can)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise OSError(errno.EIO, "injected activation read failure", "/nvme/act.swp")


def config(stage: int, gas: int) -> dict:
    cfg = base_config("cpu", stage=stage, gradient_accumulation_steps=gas)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 8}}
    return cfg


def micro(engine, index: int, fail: bool = False) -> float:
    x, y = get_batch(DATA, 4, TINY.seq_len, index)
    handle = None
    if fail:  # half way through backward: the head's gradients are in, the first block's are not
        handle = engine.module.blocks[-1].register_forward_hook(lambda m, a, out: FailingBackward.apply(out))
    try:
        loss = engine(x, y)
        engine.backward(loss)
    finally:
        if handle is not None:
            handle.remove()
    engine.step()
    return loss.item()


def snapshot(engine) -> dict:
    state = engine.optimizer.state_dict()
    return {
        "weights": {k: v.clone() for k, v in zero.consolidated_state_dict(engine).items()},
        "master": state["master"],
        "states": state["states"],
        "counters": (
            state["step"],
            engine.global_steps,
            engine.global_samples,
            engine.micro_steps,
            engine.get_lr(),
        ),
    }


def assert_identical(a: dict, b: dict) -> None:
    assert a["counters"] == b["counters"]
    for k in b["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k
    assert torch.equal(a["master"], b["master"])
    assert all(torch.equal(x, y) for x, y in zip(a["states"], b["states"]))


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_failed_backward_leaves_no_gradient_behind(stage, gas):
    """The window's last backward raises part way; redoing the window from its first micro-batch gives the
    run without the failure, bit for bit."""
    windows = 3
    clean = zero.initialize(model=make_model(), config=config(stage, gas))[0]
    want_losses = [micro(clean, i) for i in range(windows * gas)]
    want = snapshot(clean)
    clean.close()

    engine = zero.initialize(model=make_model(), config=config(stage, gas))[0]
    losses = [micro(engine, i) for i in range(gas)]
    for i in range(gas, 2 * gas - 1):
        micro(engine, i)  # the window's first micro-batches: their gradients are accumulated
    with pytest.raises(OSError, match="injected activation read failure"):
        micro(engine, 2 * gas - 1, fail=True)
    assert engine.micro_steps == gas and engine.global_steps == 1  # back at the window's start
    losses += [micro(engine, i) for i in range(gas, windows * gas)]  # the window again, then on
    got = snapshot(engine)
    engine.close()
    assert losses == want_losses
    assert_identical(got, want)


@pytest.mark.parametrize("stage", [0, 3])
def test_step_without_backward_is_skipped_with_a_warning(stage, caplog):
    """No backward since the last step(): nothing to apply. The weights stay (no weight decay alone), and
    neither the schedule nor any counter moves; the next real step is the first one of a clean run."""
    clean = zero.initialize(model=make_model(), config=config(stage, 1))[0]
    want_losses = [micro(clean, 0), micro(clean, 1)]
    want = snapshot(clean)
    clean.close()

    engine = zero.initialize(model=make_model(), config=config(stage, 1))[0]
    before = snapshot(engine)
    with caplog.at_level(logging.WARNING, logger="zero"):
        engine.step()
    assert "engine.step() without an engine.backward()" in caplog.text
    assert_identical(snapshot(engine), before)
    losses = [micro(engine, 0)]
    engine.step()  # again: a second step() after one backward
    losses.append(micro(engine, 1))
    got = snapshot(engine)
    engine.close()
    assert losses == want_losses
    assert_identical(got, want)


@pytest.mark.parametrize("training", [True, False])
def test_a_model_on_the_meta_device_is_refused(training):
    with torch.device("meta"):
        model = GPT(TINY)
    cfg = (
        config(3, 1) if training else {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    )
    if not training:
        cfg.pop("scheduler", None)
    with pytest.raises(ValueError, match=r"'tok.weight' \(and \d+ more\) is on the meta device") as info:
        zero.initialize(model=model, config=cfg)
    assert "zero.Init()" in str(info.value) and "zero.from_pretrained" in str(info.value)


def test_a_model_built_under_init_is_not_taken_for_a_meta_model():
    """zero.Init builds on the meta device itself: its partitioned parameters are real, and the engine takes
    them as they are."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    ref = GPT(TINY).eval()
    torch.manual_seed(0)
    with Init(config=cfg):
        model = GPT(TINY)
    engine = zero.initialize(model=model, config=cfg)[0]
    x = torch.randint(0, 256, (2, TINY.seq_len))
    with torch.no_grad():
        assert torch.equal(engine.module(x), ref(x))
    engine.close()
