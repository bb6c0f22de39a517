"""DeepSpeed's state accessors (`deepspeed.utils.safe_get_full_fp32_param` & co., zero.utils) at every stage
and tier: read against the engine's own master and against torch.optim.AdamW's state after the same steps;
set, then step, against torch with the same change."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import DATA, TINY, base_config, make_model, s3_config, train

import zero
import zero.utils as ds_utils
from zero.examples.models import get_batch

CASES = [
    (0, "none", "none"),
    (1, "cpu", "none"),
    (2, "nvme", "none"),
    (3, "none", "none"),
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
]
IDS = [f"stage{s}-optim_{o}-param_{p}" for s, o, p in CASES]
ATOL = 2e-5
# parameters spread over the flat buffer and the stage-3 units: first, inside, last; 2-D and 1-D
SAMPLE = ("tok.weight", "blocks.0.ln1.bias", "blocks.1.qkv.weight", "ln_f.weight", "head.weight")


def _config(stage, optim, param, tmp):
    if stage == 3:
        return s3_config(param, optim, tmp)
    return base_config(optim, tmp, stage=stage)


def _engine(stage, optim, param, tmp):
    engine, *_ = zero.initialize(model=make_model(), config=_config(stage, optim, param, tmp))
    return engine


def _torch_run(steps, edit=None):
    """torch AdamW with the engine's hyperparameters; `edit(model, opt)` after the first `steps - 1`."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(steps):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        model(x, y).backward()
        if edit is not None and step == steps - 1:
            edit(model, opt)
        opt.step()
        opt.zero_grad()
    return model, opt


def _close(a, b, what):
    diff = (a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item()
    assert diff <= ATOL, f"{what}: max |diff| {diff:.3g}"


@pytest.mark.parametrize("stage,optim,param", CASES, ids=IDS)
def test_reads_equal_the_master_and_torchs_adamw_state(stage, optim, param, tmp_path):
    engine = _engine(stage, optim, param, tmp_path)
    train(engine, 3)
    ref, opt = _torch_run(3)
    master = engine.fp32_master_state_dict()
    names = dict(engine.module.named_parameters())
    for name in SAMPLE:
        p, want = names[name], dict(ref.named_parameters())[name]
        got = ds_utils.safe_get_full_fp32_param(p)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got.cpu(), master[name]), name  # the engine's own master, bit for bit
        _close(got, want, f"{name} master")
        for key in ("exp_avg", "exp_avg_sq"):
            _close(ds_utils.safe_get_full_optimizer_state(p, key), opt.state[want][key], f"{name} {key}")
        local = ds_utils.safe_get_local_fp32_param(p)
        assert local.dim() == 1
        if stage == 3:  # this rank's share is what ds_tensor holds
            assert local.numel() == p.ds_tensor.ds_numel
        assert torch.equal(local.cpu(), master[name].reshape(-1)[: local.numel()])
    with pytest.raises(KeyError, match="exp_avg_sq"):
        ds_utils.safe_get_full_optimizer_state(names["head.weight"], "momentum_buffer")
    engine.close()
    assert ds_utils.safe_get_full_fp32_param(names["head.weight"]) is None  # no live engine trains it


@pytest.mark.parametrize("stage,optim,param", CASES, ids=IDS)
def test_set_then_step_matches_torch_with_the_same_set(stage, optim, param, tmp_path):
    """Master, exp_avg and the gradient changed between the last backward and step, as torch would be."""
    engine = _engine(stage, optim, param, tmp_path)
    train(engine, 2)
    names = dict(engine.module.named_parameters())
    x, y = get_batch(DATA, 4, TINY.seq_len, 2)
    engine.backward(engine(x, y))
    # between backward and step: DeepSpeed's window for gradients
    w, b = names["head.weight"], names["blocks.0.ln1.bias"] if "blocks.0.ln1.bias" in names else None
    g = ds_utils.safe_get_full_grad(w)
    assert g.shape == w.ds_shape if stage == 3 else g.shape == w.shape
    new_w = torch.linspace(-0.1, 0.1, g.numel()).view(g.shape)
    ds_utils.safe_set_full_fp32_param(w, new_w)
    ds_utils.safe_set_full_optimizer_state(w, torch.full(g.shape, 0.01), "exp_avg")
    ds_utils.safe_update_full_grad_vectorized([w], lambda grad, p: grad * 0.5)
    if b is not None:
        ds_utils.safe_set_full_grad(b, torch.ones(b.ds_shape if stage == 3 else b.shape))
    assert torch.equal(ds_utils.safe_get_full_fp32_param(w).cpu(), new_w)
    engine.step()

    def edit(model, opt):
        ref = dict(model.named_parameters())
        with torch.no_grad():
            ref["head.weight"].copy_(new_w)
            opt.state[ref["head.weight"]]["exp_avg"].fill_(0.01)
            ref["head.weight"].grad.mul_(0.5)
            if b is not None:
                ref["blocks.0.ln1.bias"].grad.fill_(1.0)

    ref, _ = _torch_run(3, edit)
    got = zero.consolidated_state_dict(engine)
    for name, want in ref.named_parameters():
        _close(got[name], want, name)
    engine.close()


def test_grad_read_equals_torch_grad_and_is_cleared_by_step(tmp_path):
    engine = _engine(2, "cpu", "none", tmp_path)
    ref = make_model()
    x, y = get_batch(DATA, 4, TINY.seq_len, 0)
    ref(x, y).backward()
    engine.backward(engine(x, y))
    names = dict(engine.module.named_parameters())
    for name, want in ref.named_parameters():
        _close(ds_utils.safe_get_full_grad(names[name]), want.grad, name)
        assert torch.equal(
            ds_utils.safe_get_local_grad(names[name]), ds_utils.safe_get_full_grad(names[name]).reshape(-1)
        )
    engine.step()
    assert not ds_utils.safe_get_full_grad(names["head.weight"]).any()
    with pytest.raises(RuntimeError, match="between backward"):
        ds_utils.safe_set_full_grad(names["head.weight"], torch.zeros(TINY.vocab_size, TINY.d_model))
    engine.close()


def test_local_setters_and_bad_sizes(tmp_path):
    engine = _engine(3, "nvme", "nvme", tmp_path)
    train(engine, 1)
    p = dict(engine.module.named_parameters())["head.weight"]
    n = p.ds_tensor.ds_numel
    ds_utils.safe_set_local_fp32_param(p, torch.arange(n, dtype=torch.float32))
    ds_utils.safe_set_local_optimizer_state(p, torch.full((n,), 2.0), "exp_avg_sq")
    assert torch.equal(ds_utils.safe_get_local_fp32_param(p), torch.arange(n, dtype=torch.float32))
    assert torch.equal(ds_utils.safe_get_local_optimizer_state(p, "exp_avg_sq"), torch.full((n,), 2.0))
    with zero.GatheredParameters(p):  # the weights follow the master
        assert torch.equal(p.detach().reshape(-1), torch.arange(n, dtype=torch.float32))
    with pytest.raises(ValueError, match="elements"):
        ds_utils.safe_set_local_fp32_param(p, torch.zeros(n + 1))
    with pytest.raises(ValueError, match="elements"):
        ds_utils.safe_set_full_fp32_param(p, torch.zeros(3))
    engine.close()


def test_unmanaged_parameters_read_as_none():
    lin = torch.nn.Linear(2, 2)
    assert ds_utils.safe_get_full_fp32_param(lin.weight) is None
    assert ds_utils.safe_get_full_optimizer_state(lin.weight, "exp_avg") is None
    assert ds_utils.safe_get_full_grad(lin.weight) is None
    lin(torch.ones(1, 2)).sum().backward()
    assert ds_utils.safe_get_full_grad(lin.weight) is lin.weight.grad
