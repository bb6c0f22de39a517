"""zero.initialize / ZeroEngine on one process: numerics against plain torch for every offload device."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from engine_helpers import (
    DATA,
    LOSS_ATOL,
    PARAM_ATOL,
    STEPS,
    TINY,
    assert_close_trajectory,
    base_config,
    make_model,
    torch_reference,
    train,
)

import zero
from offload.swap import SwapSpaceError
from offload.swap.slots import swap_chunk
from zero.examples.models import GPT, get_batch


def assert_params_close(model_a, model_b, atol=PARAM_ATOL):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        diff = (a.detach().float() - b.detach().float()).abs().max().item()
        assert diff <= atol, f"{name}: max |diff| {diff:.3g}"


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("stage", [0, 2])
def test_matches_torch_adamw(tmp_path, reference, offload, stage):
    ref_losses, ref_model = reference
    engine, opt, loader, sched = zero.initialize(
        model=make_model(), config=base_config(offload, tmp_path, stage=stage)
    )
    assert loader is None and sched is None and opt is engine.optimizer
    losses = train(engine, STEPS)
    assert_close_trajectory(losses, ref_losses)
    assert_params_close(engine.module, ref_model)
    assert engine.global_steps == STEPS and engine.optimizer.step_count == STEPS
    if offload == "cpu":  # weights (= fp32 master here), gradients, m and v all in pinned pool memory
        assert engine.pinned_bytes >= 4 * engine.part_numel * 4
    if offload == "nvme":
        rep = engine.last_report
        assert rep.nvme_read_bytes > 0 and rep.nvme_write_bytes == rep.nvme_read_bytes
        assert rep.nvme_read_bytes == engine.optimizer_state_info().pass_read_bytes
        assert engine.nvme_bytes > 0
        swap_dir = engine.swap_dir
        assert os.path.isdir(swap_dir)
        engine.close()
        assert not os.path.exists(swap_dir)
    else:
        engine.close()


def test_one_wrong_step_is_caught(reference):
    """The tolerance is meaningful: a run that skips one step in the middle fails it."""
    ref_losses, _ = reference
    engine, *_ = zero.initialize(model=make_model(), config=base_config())
    losses = train(engine, 10) + train(engine, STEPS - 11, start=11)  # batch 10 never trained on
    shifted = ref_losses[:10] + ref_losses[11:]
    worst = max(abs(a - b) for a, b in zip(losses, shifted))
    assert worst > LOSS_ATOL
    engine.close()


def test_gradient_accumulation_equals_larger_batch(tmp_path):
    big, *_ = zero.initialize(model=make_model(), config=base_config("cpu", tmp_path))
    acc_cfg = base_config("cpu", tmp_path)
    acc_cfg["train_micro_batch_size_per_gpu"] = 2
    acc_cfg["gradient_accumulation_steps"] = 2
    acc, *_ = zero.initialize(model=make_model(), config=acc_cfg)
    assert acc.train_batch_size() == 4 and acc.gradient_accumulation_steps() == 2
    for step in range(8):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        big.backward(big(x, y))
        big.step()
        for half in range(2):
            assert acc.is_gradient_accumulation_boundary() == (half == 1)
            loss = acc(x[2 * half : 2 * half + 2], y[2 * half : 2 * half + 2])
            acc.backward(loss)
            acc.step()
        assert acc.global_steps == big.global_steps == step + 1
    assert acc.micro_steps == 16
    assert_params_close(acc.module, big.module, atol=1e-5)
    big.close()
    acc.close()


def test_client_optimizer_and_torch_scheduler():
    def lam(s):
        return 1.0 / (1 + s)

    ref_losses, ref_model = torch_reference(12, lr_lambda=lam)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    cfg = base_config("cpu")
    del cfg["optimizer"]
    engine, zopt, _, sched = zero.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lam),
        config_params=cfg,
    )
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    losses = train(engine, 12)
    assert_close_trajectory(losses, ref_losses)
    assert engine.get_lr() == [pytest.approx(1e-3 / 13)]
    engine.close()


def test_config_scheduler_drives_lr():
    cfg = base_config()
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4},
    }
    engine, _, _, sched = zero.initialize(model=make_model(), config=cfg)
    assert sched is not None
    lrs = []
    for step in range(6):
        lrs.append(engine.get_lr()[0])
        train(engine, 1, start=step)
    # DeepSpeed's log warmup: iterations -1 and 0 both give warmup_min_lr.
    assert lrs[0] == 0.0 and lrs[1] < lrs[2] < lrs[3] <= 1e-3 and lrs[5] == pytest.approx(1e-3)
    engine.close()


def test_gradient_clipping_matches_torch():
    ref_losses, ref_model = torch_reference(10, clip=0.05)
    cfg = base_config("cpu", gradient_clipping=0.05)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    losses = train(engine, 10)
    assert_close_trajectory(losses, ref_losses)
    assert_params_close(engine.module, ref_model)
    assert engine.last_grad_norm > 0.05  # clipping really happened
    engine.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_fp16_overflow_skips_exactly_one_step(tmp_path, offload):
    cfg = base_config(offload, tmp_path, fp16={"enabled": True, "initial_scale_power": 8})
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    assert next(engine.module.parameters()).dtype == torch.float16
    train(engine, 3)
    assert engine.skipped_steps == 0 and engine.loss_scale == 256.0
    before = [p.detach().clone() for p in engine.module.parameters()]
    state_before = engine.optimizer.state_dict()
    x, y = get_batch(DATA, 4, TINY.seq_len, 3)
    loss = engine(x, y)
    engine.backward(loss * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.global_steps == 4
    assert engine.optimizer.step_count == 3
    assert engine.last_report.skipped
    for a, b in zip(before, engine.module.parameters()):
        assert torch.equal(a, b.detach())
    state_after = engine.optimizer.state_dict()
    assert torch.equal(state_before["master"], state_after["master"])
    assert all(torch.equal(a, b) for a, b in zip(state_before["states"], state_after["states"]))
    losses = train(engine, 5, start=4)
    assert engine.optimizer.step_count == 8 and all(math.isfinite(v) for v in losses)
    engine.close()


def test_fp16_tracks_fp32_training():
    ref_losses, _ = torch_reference(15)
    cfg = base_config("cpu", fp16={"enabled": True, "initial_scale_power": 12})
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    losses = train(engine, 15)
    assert engine.skipped_steps == 0
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 2e-2
    engine.close()


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_bf16_trains_with_fp32_master(tmp_path, offload):
    ref_losses, ref_model = torch_reference(15)
    cfg = base_config(offload, tmp_path, bf16={"enabled": True})
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    losses = train(engine, 15)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 5e-2
    master = engine.optimizer.state_dict()["master"][: engine.trainable_numel]
    want = torch.cat([p.detach().reshape(-1) for p in ref_model.parameters()])
    init = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])
    # The fp32 master follows the fp32 run: its error is small next to how far training moved the weights,
    # and it holds updates far below bf16's resolution (a bf16 master would lose them).
    moved = (want - init).abs().mean().item()
    assert (master - want).abs().mean().item() < 0.25 * moved
    assert not torch.equal(master, master.bfloat16().float())
    engine.close()


def test_report_counts_phases_and_bytes(tmp_path, capsys):
    cfg = base_config("nvme", tmp_path, zero_offload={"report": True})
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    train(engine, 1)
    first = engine.last_report
    train(engine, 1, start=1)
    rep = engine.last_report
    # Every step moves the same bytes: the initial write of the state is in no step's report.
    assert (first.nvme_read_bytes, first.nvme_write_bytes) == (rep.nvme_read_bytes, rep.nvme_write_bytes)
    assert rep.step == 2 and rep.micro_batches == 1
    assert rep.forward_s > 0 and rep.backward_s > 0 and rep.optimizer_s > 0
    assert rep.optimizer_compute_s > 0
    state_bytes = engine.part_numel * 3 * 4
    assert rep.nvme_read_bytes >= state_bytes and rep.nvme_write_bytes >= state_bytes
    assert rep.pinned_bytes_in_use >= engine.pinned_bytes > 0
    assert rep.nvme_bytes_in_use == engine.nvme_bytes >= 2 * state_bytes
    out = capsys.readouterr().out
    assert "[zero] step 1" in out and "nvme r" in out
    engine.close()


def test_nvme_path_missing_is_a_clear_error(tmp_path):
    with pytest.raises(SwapSpaceError) as e:
        zero.initialize(model=make_model(), config=base_config("nvme", tmp_path / "missing"))
    assert str(tmp_path / "missing") in str(e.value)


@pytest.mark.parametrize("source", ["env", "config"])
def test_pinned_budget_too_small_is_a_clear_error(tmp_path, monkeypatch, source):
    cfg = base_config("nvme", tmp_path)
    if source == "env":
        monkeypatch.setenv("ZERO_OFFLOAD_PINNED_BUDGET", str(64 << 10))
    else:
        monkeypatch.setenv("ZERO_OFFLOAD_PINNED_BUDGET", str(1 << 40))  # the config key wins over the env
        cfg["zero_offload"] = {"pinned_budget_bytes": 64 << 10}
    with pytest.raises((ValueError, MemoryError), match="pinned memory budget"):
        zero.initialize(model=make_model(), config=cfg)
    assert os.listdir(tmp_path) == []


def test_small_budget_splits_subgroups(tmp_path, monkeypatch, reference):
    """A sub-group bigger than the staging slots the budget allows is split, and the result is the same."""
    ref_losses, _ = reference
    monkeypatch.setenv("ZERO_OFFLOAD_PINNED_BUDGET", str(400_000))
    cfg = base_config("nvme", tmp_path)
    cfg["zero_optimization"]["sub_group_size"] = 10**9
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    assert engine.optimizer_state_info().chunk_numel < engine.part_numel
    # smaller than the slots the same config gets without a budget: the split really happened
    assert engine.optimizer_state_info().chunk_numel < swap_chunk(10**9, engine.part_numel, 8)
    losses = train(engine, 5)
    assert_close_trajectory(losses, ref_losses[:5])
    engine.close()


def test_budget_too_small_for_any_staging_is_a_clear_error(tmp_path, monkeypatch):
    # 4 slots of the smallest piece (4096 elements x 3 fp32 tensors) need 196608 bytes
    monkeypatch.setenv("ZERO_OFFLOAD_PINNED_BUDGET", str(150_000))
    with pytest.raises(ValueError, match=r"budget too small for NVMe staging: 150000 bytes") as e:
        zero.initialize(model=make_model(), config=base_config("nvme", tmp_path))
    assert "offload_optimizer.buffer_count=4 slots" in str(e.value)
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_zero_grad_none_by_user_is_tolerated():
    engine, *_ = zero.initialize(model=make_model(), config=base_config())
    ref, _ = torch_reference(4)
    losses = []
    for step in range(4):
        engine.module.zero_grad(set_to_none=True)
        losses += train(engine, 1, start=step)
    assert_close_trajectory(losses, ref)
    engine.close()


def test_training_data_gives_a_loader_of_micro_batches():
    xs = torch.stack([get_batch(DATA, 1, TINY.seq_len, i)[0][0] for i in range(12)])
    ys = torch.stack([get_batch(DATA, 1, TINY.seq_len, i)[1][0] for i in range(12)])
    dataset = torch.utils.data.TensorDataset(xs, ys)
    engine, _, loader, _ = zero.initialize(model=make_model(), config=base_config(), training_data=dataset)
    assert engine.device == torch.device("cpu") and isinstance(engine.module, GPT)
    batches = list(loader)
    assert len(batches) == 3 and batches[0][0].shape == (4, TINY.seq_len)
    for x, y in batches:
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 3 and engine.global_samples == 12
    assert engine.get_lr() == [1e-3]
    engine.close()


def test_config_errors():
    # without an optimizer the engine is an inference engine (tests/test_inference_engine.py); a scheduler
    # then has nothing to drive
    with pytest.raises(ValueError, match="scheduler .* needs an optimizer"):
        cfg = base_config()
        del cfg["optimizer"]
        cfg["scheduler"] = {"type": "WarmupLR", "params": {}}
        zero.initialize(model=make_model(), config=cfg)
    # a client optimizer together with an optimizer block is DeepSpeed's rule, not an error: the client
    # optimizer wins (tests/test_deepspeed_contract.py)
    with pytest.raises(ValueError, match="offload_param.device='cpu' needs stage 3"):
        cfg = base_config(stage=2)
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        zero.initialize(model=make_model(), config=cfg)
    with pytest.raises(ValueError, match="config"):
        zero.initialize(model=make_model())


def test_close_keeps_model_usable(tmp_path):
    engine, *_ = zero.initialize(model=make_model(), config=base_config("cpu"))
    train(engine, 2)
    model = engine.module
    snapshot = copy.deepcopy(model.state_dict())
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, snapshot[k])
    x, y = get_batch(DATA, 2, TINY.seq_len, 0)
    assert math.isfinite(model(x, y).item())


@pytest.mark.parametrize("stage", [2, 3])
def test_start_up_does_not_import_torch_dynamo(tmp_path, stage):
    # The first torch.optim.Optimizer of a process imports torch._dynamo (over a second of start-up) unless
    # the engine's optimizer facade avoids it; a fresh interpreter shows whether anything imported it.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        import zero
        from zero.examples.models import GPT, GPTConfig
        model = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=16))
        cfg = {{
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
            "zero_optimization": {{
                "stage": {stage},
                "offload_optimizer": {{"device": "nvme", "nvme_path": {str(tmp_path)!r}}},
            }},
        }}
        engine, opt, *_ = zero.initialize(model=model, config=cfg)
        assert opt.param_groups[0]["lr"] == 1e-3 and len(opt.param_groups) == 1
        print("torch._dynamo" in sys.modules)
        engine.close()
        """
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
