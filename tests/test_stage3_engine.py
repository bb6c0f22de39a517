"""zero.initialize at stage 3: parameters and optimizer on none/cpu/nvme, numerics against plain torch AdamW,
16-bit training, checkpoints with NVMe-resident state, consolidated exports, zero.Init, budget errors."""

from __future__ import annotations

import math
import os

import pytest
import torch
from engine_helpers import (
    DATA,
    STEPS,
    TINY,
    assert_close_trajectory,
    base_config,
    make_model,
    s3_config,
    torch_reference,
    train,
)

import zero
from zero.examples.models import GPT, get_batch
from zero.layout.units import UnitLayout
from zero.stage3 import Stage3PinnedBudgetError

TIERS = ["none", "cpu", "nvme"]


def full_params(engine) -> dict:
    return zero.consolidated_state_dict(engine)


def assert_params_match(engine, ref_model, atol=2e-5):
    got = full_params(engine)
    for name, want in ref_model.named_parameters():
        diff = (got[name].float() - want.detach().float()).abs().max().item()
        assert diff <= atol, f"{name}: max |diff| {diff:.3g}"


@pytest.mark.parametrize("optim", TIERS)
@pytest.mark.parametrize("param", TIERS)
def test_matches_torch_adamw(tmp_path, reference, param, optim):
    ref_losses, ref_model = reference
    engine, opt, loader, sched = zero.initialize(model=make_model(), config=s3_config(param, optim, tmp_path))
    assert isinstance(engine.layout, UnitLayout) and opt is engine.optimizer
    # nothing is whole between steps: every parameter is an empty placeholder
    assert all(p.numel() == 0 for p in engine.module.parameters())
    losses = train(engine, STEPS)
    assert_close_trajectory(losses, ref_losses)
    assert_params_match(engine, ref_model)
    assert engine.optimizer.step_count == STEPS
    part = engine.partitioner
    if param == "nvme":
        names = sorted(os.listdir(part.store.swap_dir))
        assert "blocks.0.qkv.param.swp" in names and "tok.param.swp" in names  # named, never id()
        assert engine.last_param_io["param_nvme_read_bytes"] > 0
        # each step writes every trainable partition back exactly once
        assert engine.last_param_io["param_nvme_write_bytes"] == sum(
            u.part_nbytes for u in engine.layout.units
        )
    if optim == "nvme":
        rep = engine.last_report
        assert rep.nvme_read_bytes > 0 and rep.nvme_write_bytes == rep.nvme_read_bytes
        assert engine.optimizer_state_info().copies == 2
    dirs = [d for d in (engine.swap_dir, part.store.swap_dir) if d]
    engine.close()
    assert not any(os.path.exists(d) for d in dirs)


@pytest.mark.slow  # tests/test_engine.py shows the same for stages 0-2 in the default run
def test_one_wrong_step_is_caught(tmp_path, reference):
    """The tolerance is meaningful at stage 3 too: one skipped batch fails it."""
    ref_losses, _ = reference
    engine, *_ = zero.initialize(model=make_model(), config=s3_config("nvme", "nvme", tmp_path))
    losses = train(engine, 10) + train(engine, STEPS - 11, start=11)
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses[:10] + ref_losses[11:]))
    assert worst > 2e-5
    engine.close()


def test_gradient_accumulation_equals_larger_batch(tmp_path):
    big, *_ = zero.initialize(model=make_model(), config=s3_config("nvme", "cpu", tmp_path))
    acc_cfg = s3_config(
        "nvme", "cpu", tmp_path, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2
    )
    acc, *_ = zero.initialize(model=make_model(), config=acc_cfg)
    for step in range(5):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        big.backward(big(x, y))
        big.step()
        for k in range(2):
            acc.backward(acc(x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2]))
            acc.step()
    assert acc.global_steps == 5 and acc.micro_steps == 10
    a, b = full_params(big), full_params(acc)
    for name in a:
        assert (a[name] - b[name]).abs().max().item() <= 2e-5, name
    big.close()
    acc.close()


def test_gradient_clipping_matches_torch(tmp_path):
    ref_losses, ref_model = torch_reference(10, clip=0.05)
    engine, *_ = zero.initialize(
        model=make_model(), config=s3_config("cpu", "nvme", tmp_path, gradient_clipping=0.05)
    )
    assert_close_trajectory(train(engine, 10), ref_losses)
    assert_params_match(engine, ref_model)
    assert engine.last_grad_norm > 0.05
    engine.close()


def test_fp16_overflow_skips_exactly_one_step(tmp_path):
    cfg = s3_config("nvme", "nvme", tmp_path, fp16={"enabled": True, "initial_scale_power": 8})
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    train(engine, 3)
    assert engine.skipped_steps == 0 and engine.loss_scale == 256.0
    before = full_params(engine)
    assert before["blocks.0.qkv.weight"].dtype == torch.float16
    state_before = engine.optimizer.state_dict()
    x, y = get_batch(DATA, 4, TINY.seq_len, 3)
    engine.backward(engine(x, y) * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.optimizer.step_count == 3 and engine.last_report.skipped
    after = full_params(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    state_after = engine.optimizer.state_dict()
    assert torch.equal(state_before["master"], state_after["master"])
    assert all(torch.equal(a, b) for a, b in zip(state_before["states"], state_after["states"]))
    losses = train(engine, 5, start=4)
    assert engine.optimizer.step_count == 8 and all(math.isfinite(v) for v in losses)
    engine.close()


@pytest.mark.parametrize("param", ["nvme", pytest.param("none", marks=pytest.mark.slow)])
def test_bf16_trains_with_fp32_master(tmp_path, param):
    """As at stages 0-2: bf16 weights, an fp32 master that follows the fp32 run, same as stage 0 bf16."""
    ref_losses, ref_model = torch_reference(15)
    engine, *_ = zero.initialize(
        model=make_model(), config=s3_config(param, "nvme", tmp_path, bf16={"enabled": True})
    )
    losses = train(engine, 15)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 5e-2
    master = engine.fp32_master_state_dict()
    names = [n for n, _ in ref_model.named_parameters()]
    got = torch.cat([master[n].reshape(-1) for n in names])
    want = torch.cat([p.detach().reshape(-1) for p in ref_model.parameters()])
    init = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])
    # the same criterion as tests/test_engine.py at stages 0-2
    moved = (want - init).abs().mean().item()
    assert (got - want).abs().mean().item() < 0.25 * moved
    assert not torch.equal(got, got.bfloat16().float())
    # the bf16 weights are the rounded master
    weights = full_params(engine)
    assert weights["blocks.0.fc.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["blocks.0.fc.weight"], master["blocks.0.fc.weight"].bfloat16())
    engine.close()
    # and the same run at stage 0 gives the same losses bit for bit (same kernel, same bf16 rounding)
    stage0, *_ = zero.initialize(
        model=make_model(), config=base_config("nvme", tmp_path, stage=0, bf16={"enabled": True})
    )
    assert train(stage0, 15) == losses
    stage0.close()


@pytest.mark.parametrize("optim", ["nvme", "cpu"])
def test_checkpoint_with_nvme_params_resumes_bit_identically(tmp_path, optim):
    cfg = s3_config("nvme", "nvme", tmp_path, bf16={"enabled": True})
    full, *_ = zero.initialize(model=make_model(), config=cfg)
    want = train(full, 6)
    want_params = full_params(full)
    full.close()

    first, *_ = zero.initialize(model=make_model(), config=cfg)
    train(first, 3)
    path = first.save_checkpoint(str(tmp_path / "ckpt"))
    first.close()
    assert sorted(os.listdir(path)) == [
        "manifest.json",
        "model_states.pt",
        "optim_rank0.bin",
        "param_rank0.bin",
        "rank0_states.pt",
    ]
    # a new engine, another seed, possibly another optimizer tier: loading restores everything
    resumed, *_ = zero.initialize(
        model=make_model(seed=5), config=s3_config("nvme", optim, tmp_path, **{"bf16": {"enabled": True}})
    )
    got_path, _ = resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert got_path == path and resumed.global_steps == 3
    assert train(resumed, 3, start=3) == want[3:]
    got_params = full_params(resumed)
    assert all(torch.equal(want_params[k], got_params[k]) for k in want_params)
    resumed.close()


def test_checkpoint_rejects_other_model(tmp_path):
    engine, *_ = zero.initialize(model=make_model(), config=s3_config("cpu", "cpu", tmp_path))
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    other_cfg = TINY.__class__(**{**TINY.__dict__, "n_layer": 3})
    other, *_ = zero.initialize(model=GPT(other_cfg), config=s3_config("cpu", "cpu", tmp_path))
    with pytest.raises(ValueError, match="trainable elements"):
        other.load_checkpoint(str(tmp_path / "ckpt"))
    other.close()


def test_save_16bit_model_and_consolidated_exports(tmp_path):
    cfg = s3_config("nvme", "nvme", tmp_path, bf16={"enabled": True})
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    train(engine, 3)
    assert engine.save_16bit_model(str(tmp_path / "export"), "model.bin")
    saved = torch.load(tmp_path / "export" / "model.bin", weights_only=True)
    sd16 = zero.consolidated_state_dict(engine)
    sd32 = zero.consolidated_state_dict(engine, fp32=True)
    master = engine.fp32_master_state_dict()
    engine.close()
    plain = make_model()
    assert set(saved) == set(plain.state_dict())
    assert all(torch.equal(saved[k], sd16[k]) for k in saved)
    assert saved["blocks.1.out.weight"].dtype == torch.bfloat16
    assert sd32["blocks.1.out.weight"].dtype == torch.float32
    assert torch.equal(sd32["blocks.1.out.weight"], master["blocks.1.out.weight"])
    plain.load_state_dict({k: v.float() for k, v in saved.items()})  # a plain torch model takes it as is


def test_save_16bit_model_needs_the_gather_key_at_stage3(tmp_path, caplog):
    """DeepSpeed's rule: stage 3 saves a 16-bit model only with stage3_gather_16bit_weights_on_model_save."""
    engine, *_ = zero.initialize(model=make_model(), config=s3_config("cpu", "cpu", tmp_path))
    with caplog.at_level("WARNING", logger="zero"):
        assert engine.save_16bit_model(str(tmp_path / "export"), "model.bin") is False
    assert "stage3_gather_16bit_weights_on_model_save" in caplog.text
    assert not (tmp_path / "export").exists()
    engine.close()


def test_init_built_model_trains_like_torch(tmp_path, reference):
    """zero.Init: the model is partitioned to NVMe while it is built and draws the same random numbers."""
    ref_losses, _ = reference
    cfg = s3_config("nvme", "nvme", tmp_path)
    torch.manual_seed(0)
    with zero.Init(config=cfg):
        model = GPT(TINY)
    assert all(p.numel() == 0 for p in model.parameters())
    engine, *_ = zero.initialize(model=model, config=cfg)
    initial = zero.consolidated_state_dict(engine)
    assert all(torch.equal(initial[k], v) for k, v in make_model().state_dict().items())
    assert_close_trajectory(train(engine, 10), ref_losses[:10])  # a prefix of the 30-step torch run
    engine.close()


def test_init_takes_the_dtype_from_the_config(tmp_path):
    cfg = s3_config("cpu", "cpu", tmp_path, bf16={"enabled": True})
    with zero.Init(config=cfg):
        model = GPT(TINY)
    assert {p.ds_unit.dtype for p in model.parameters()} == {torch.bfloat16}
    engine, *_ = zero.initialize(model=model, config=cfg)
    assert all(math.isfinite(v) for v in train(engine, 2))
    engine.close()
    with zero.Init(config=s3_config("cpu", "cpu", tmp_path)):
        fp32_model = GPT(TINY)
    with pytest.raises(ValueError, match="partitioned .* as torch.float32 but the config trains in"):
        zero.initialize(model=fp32_model, config=cfg)


def test_pinned_budget_too_small_for_largest_layer_fails_at_initialize(tmp_path):
    cfg = s3_config("nvme", "nvme", tmp_path, zero_offload={"pinned_budget_bytes": 4096})
    with pytest.raises(Stage3PinnedBudgetError, match="largest") as err:
        zero.initialize(model=make_model(), config=cfg)
    assert "tok" in str(err.value) or "blocks" in str(err.value)  # names the layer


def test_in_place_optimizer_state_when_the_disk_is_short(tmp_path, monkeypatch, reference):
    """One NVMe copy of the optimizer state (ZeRO-Infinity scale): same numbers, half the disk."""
    from zero.optimizer.tiers import build as optimizer_state

    ref_losses, _ = reference
    monkeypatch.setattr(optimizer_state, "_disk_free", lambda path: 1)
    with pytest.warns(UserWarning, match="updated in place"):
        engine, *_ = zero.initialize(model=make_model(), config=s3_config("nvme", "nvme", tmp_path))
    assert engine.optimizer_state_info().copies == 1
    assert engine.optimizer_nvme_bytes == engine.optimizer_state_info().disk_bytes > 0
    param_bytes = sum(u.part_nbytes for u in engine.partitioner.units)
    assert engine.nvme_bytes >= engine.optimizer_nvme_bytes + param_bytes
    assert_close_trajectory(train(engine, 10), ref_losses[:10])  # a prefix of the 30-step torch run
    engine.close()


def test_frozen_parameters_stay_unchanged(tmp_path):
    """requires_grad=False parameters (a whole module and one bias inside a trained module) are not
    touched by the optimizer, exactly as torch AdamW over the trainable ones."""

    def frozen_model():
        m = make_model()
        m.tok.weight.requires_grad_(False)
        m.blocks[0].fc.bias.requires_grad_(False)
        return m

    ref = frozen_model()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(5):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    engine, *_ = zero.initialize(model=frozen_model(), config=s3_config("nvme", "nvme", tmp_path))
    train(engine, 5)
    got = full_params(engine)
    init = dict(make_model().named_parameters())
    assert torch.equal(got["tok.weight"], init["tok.weight"].detach())
    assert torch.equal(got["blocks.0.fc.bias"], init["blocks.0.fc.bias"].detach())
    for name, want in ref.named_parameters():
        assert (got[name] - want.detach()).abs().max().item() <= 2e-5, name
    engine.close()


def test_consolidated_state_dict_at_stage_2(tmp_path):
    """The export helper works at stages 0-2 too: module weights, or the fp32 master with fp32=True."""
    engine, *_ = zero.initialize(
        model=make_model(), config=base_config("cpu", tmp_path, stage=2, bf16={"enabled": True})
    )
    train(engine, 2)
    sd16 = zero.consolidated_state_dict(engine)
    sd32 = zero.consolidated_state_dict(engine, fp32=True)
    for name, p in engine.module.named_parameters():
        assert torch.equal(sd16[name], p.detach())
        assert sd32[name].dtype == torch.float32 and torch.equal(sd32[name].bfloat16(), p.detach())
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_failed_initialize_leaves_no_swap_space(tmp_path, stage):
    """A construction that fails after the parts were built (here: the client scheduler raises) frees
    them: no swap directory or lock file of the optimizer or the parameters is left in nvme_path."""

    def broken_scheduler(optimizer):
        raise RuntimeError("scheduler construction failed")

    cfg = s3_config("nvme", "nvme", tmp_path) if stage == 3 else base_config("nvme", tmp_path, stage=stage)
    with pytest.raises(RuntimeError, match="scheduler construction failed"):
        zero.initialize(model=make_model(), config=cfg, lr_scheduler=broken_scheduler)
    assert os.listdir(tmp_path) == []
