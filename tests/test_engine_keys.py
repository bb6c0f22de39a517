"""Config keys the engine honours beyond the optimizer and offload sections, each against its meaning in
DeepSpeed: fp16.auto_cast, bf16.check_grad_overflow, steps_per_print, ignore_unused_parameters,
load_from_fp32_weights (stage3_gather_16bit_weights_on_model_save: tests/test_stage3_engine.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero
from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)
DATA = corpus_bytes()


def _config(stage: int = 0, tmp=None, **extra) -> dict:
    zo: dict = {"stage": stage}
    if stage == 3:
        zo["offload_param"] = {"device": "cpu"}
        zo["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": zo,
    }
    for key, value in extra.items():
        if key in ("ignore_unused_parameters", "load_from_fp32_weights"):
            zo[key] = value
        else:
            cfg[key] = value
    return cfg


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY)


def _step(engine, i: int = 0) -> float:
    x, y = get_batch(DATA, 2, TINY.seq_len, i)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss.item()


class _Mlp(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.spare = nn.Linear(8, 8) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).pow(2).mean()


def test_fp16_auto_cast_casts_float_inputs():
    x = torch.randn(4, 8)  # fp32, as a data loader gives it
    plain = zero.initialize(model=_Mlp(), config=_config(fp16={"enabled": True}))[0]
    with pytest.raises(RuntimeError):  # fp32 input into fp16 weights
        plain(x)
    plain.close()
    engine = zero.initialize(model=_Mlp(), config=_config(fp16={"enabled": True, "auto_cast": True}))[0]
    loss = engine(x)
    assert loss.dtype == torch.float16
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1
    engine.close()


@pytest.mark.parametrize("check", [True, False])
def test_bf16_check_grad_overflow_skips_non_finite_steps(check):
    cfg = _config(bf16={"enabled": True, "check_grad_overflow": check})
    engine = zero.initialize(model=_gpt(), config=cfg)[0]
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    hook = engine.module.head.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    _step(engine)
    hook.remove()
    after = engine.module.state_dict()
    if check:
        assert engine.skipped_steps == 1
        assert all(torch.equal(before[k], after[k]) for k in before)
        _step(engine, 1)  # training goes on
        assert engine.optimizer.step_count == 1 and torch.isfinite(engine.module.head.weight).all()
    else:  # nothing checks the gradients: the update runs and writes non-finite weights
        assert not torch.isfinite(after["head.weight"].float()).all()
    engine.close()


def test_steps_per_print_logs_on_rank0(caplog):
    engine = zero.initialize(model=_gpt(), config=_config(steps_per_print=2))[0]
    with caplog.at_level(logging.INFO, logger="zero"):
        for i in range(5):
            _step(engine, i)
    steps = [r.getMessage().split(",")[0] for r in caplog.records if r.name == "zero"]
    assert steps == ["step=2", "step=4"]
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_ignore_unused_parameters_false_names_the_parameter(stage):
    x = torch.randn(4, 8)
    strict = zero.initialize(model=_Mlp(unused=True), config=_config(stage, ignore_unused_parameters=False))[
        0
    ]
    with pytest.raises(RuntimeError, match=r"spare\.weight.*ignore_unused_parameters"):
        strict.backward(strict(x))
    strict.close()
    lenient = zero.initialize(model=_Mlp(unused=True), config=_config(stage))[0]  # DeepSpeed's default: true
    lenient.backward(lenient(x))
    lenient.step()
    assert lenient.global_steps == 1
    lenient.close()


def test_ignore_unused_parameters_counts_the_whole_accumulation_window():
    """A parameter used in one micro-batch of the window is not unused."""

    class Alternating(_Mlp):
        def forward(self, x: torch.Tensor, use_spare: bool) -> torch.Tensor:
            h = torch.relu(self.a(x))
            if use_spare:
                h = self.spare(h)
            return self.b(h).pow(2).mean()

    cfg = _config(2, ignore_unused_parameters=False, gradient_accumulation_steps=2)
    engine = zero.initialize(model=Alternating(unused=True), config=cfg)[0]
    x = torch.randn(2, 8)
    for use in (True, False):
        engine.backward(engine(x, use))
        engine.step()
    assert engine.global_steps == 1
    engine.close()


@pytest.mark.parametrize("from_fp32", [True, False])
def test_load_from_fp32_weights(tmp_path, from_fp32):
    """true (default): the master comes from the checkpoint's fp32 copy; false: from the 16-bit weights."""
    cfg = _config(bf16={"enabled": True})
    engine = zero.initialize(model=_gpt(), config=cfg)[0]
    for i in range(3):
        _step(engine, i)
    saved_master = engine.fp32_master_state_dict()
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.close()
    other = zero.initialize(
        model=_gpt(), config=dict(cfg, zero_optimization={"stage": 0, "load_from_fp32_weights": from_fp32})
    )[0]
    other.load_checkpoint(str(tmp_path), tag="t")
    master = other.fp32_master_state_dict()
    weights = other.module.state_dict()
    name = "blocks.0.qkv.weight"
    if from_fp32:
        assert torch.equal(master[name], saved_master[name])
        assert not torch.equal(master[name], weights[name].float())  # the low bits bf16 drops are kept
    else:
        assert torch.equal(master[name], weights[name].float())
    other.close()
