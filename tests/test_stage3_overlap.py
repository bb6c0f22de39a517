"""Stage 3: optimizer sub-groups stepped during backward (offload_optimizer.pipeline_read / pipeline_write).

A unit's gradient partition is final once the partitioner has reduced it; the optimizer thread then steps
every sub-group whose units are all final and writes their new weights into the parameter tier (memory or
the unit's swap file) while backward goes on with the layers below. The update of an element does not
depend on the order in which sub-groups run, so every trajectory here must be bit-identical to the engine
stepping after backward.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import DATA, TINY, make_model, s3_config
from swap_helpers import train_steps

import zero
from zero.examples.models import get_batch


def config(param: str, tmp, pipeline: bool, **extra):
    cfg = s3_config(param, "nvme", tmp, **extra)
    off = cfg["zero_optimization"]["offload_optimizer"]
    off.update(pipeline_read=pipeline, pipeline_write=pipeline, buffer_count=3)
    return cfg


def run(cfg, steps: int, freeze: bool = False, gas: int = 1):
    model = make_model()
    if freeze:  # a mixed unit: the optimizer rewrites the weight, the frozen bias keeps its stored value
        model.blocks[0].qkv.bias.requires_grad_(False)
    cfg = dict(cfg, gradient_accumulation_steps=gas)
    engine = zero.initialize(model=model, config=cfg)[0]
    losses = train_steps(engine, DATA, 4, TINY.seq_len, steps * gas)
    out = {
        "losses": losses,
        "params": zero.consolidated_state_dict(engine),
        "state": engine.optimizer.state_dict(),
        "early": engine.overlap.enabled,
        "skipped": engine.skipped_steps,
        "param_io": dict(engine.last_param_io),
        "info": engine.optimizer_state_info(),
    }
    engine.close()
    return out


def assert_same(a, b):
    assert a["losses"] == b["losses"]
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert torch.equal(a["state"]["master"], b["state"]["master"])
    for x, y in zip(a["state"]["states"], b["state"]["states"]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_overlapped_steps_match_steps_after_backward(tmp_path, param, device):
    plain = run(config(param, tmp_path, False), steps=3)
    overlapped = run(config(param, tmp_path, True), steps=3)
    assert not plain["early"] and overlapped["early"]
    assert overlapped["state"]["step"] == 3
    assert_same(plain, overlapped)
    if param == "nvme":  # every partition written back once per step, from the optimizer thread
        assert overlapped["param_io"]["param_nvme_write_bytes"] == plain["param_io"]["param_nvme_write_bytes"]


@pytest.mark.parametrize("clip", [0.05, 1e6], ids=["clipping-triggers", "clipping-idle"])
def test_speculative_steps_with_clipping_match_steps_after_backward(tmp_path, clip):
    """Clipping: sub-groups stepped during backward with coefficient 1, kept or undone and redone once the
    norm is known (zero/optimizer/speculative.py); the NVMe parameter partitions follow either way."""
    plain = run(config("nvme", tmp_path, False, gradient_clipping=clip), steps=3)
    spec = run(config("nvme", tmp_path, True, gradient_clipping=clip), steps=3)
    assert spec["early"] and spec["state"]["step"] == 3
    assert_same(plain, spec)


@pytest.mark.parametrize("param", ["none", "nvme"])
def test_a_share_of_the_state_in_ram(tmp_path, param):
    """max_in_cpu: the swapped sub-groups are stepped during backward, the resident ones after it; their
    new weights reach the parameter tier all the same."""

    def cfg(pipeline):
        c = config(param, tmp_path, pipeline)
        c["zero_optimization"]["offload_optimizer"]["max_in_cpu"] = (
            2 * c["zero_optimization"]["sub_group_size"]
        )
        return c

    plain = run(cfg(False), steps=3)
    overlapped = run(cfg(True), steps=3)
    assert overlapped["early"] and overlapped["state"]["step"] == 3
    info = overlapped["info"]
    assert 0 < info.resident_numel < info.numel and info.swapped_numel == info.numel - info.resident_numel
    assert_same(plain, overlapped)


def test_bf16_and_a_partly_frozen_unit_on_nvme(tmp_path, device):
    cfg_plain = config("nvme", tmp_path, False, bf16={"enabled": True})
    cfg_over = config("nvme", tmp_path, True, bf16={"enabled": True})
    plain = run(cfg_plain, steps=3, freeze=True)
    overlapped = run(cfg_over, steps=3, freeze=True)
    assert overlapped["early"]
    assert_same(plain, overlapped)
    first = make_model().blocks[0].qkv.bias.detach().to(torch.bfloat16)
    assert torch.equal(overlapped["params"]["blocks.0.qkv.bias"], first)  # frozen: never rewritten


def test_with_gradient_accumulation(tmp_path, device):
    kw = {"train_micro_batch_size_per_gpu": 2}
    plain = run(config("nvme", tmp_path, False, **kw), steps=2, gas=2)
    overlapped = run(config("nvme", tmp_path, True, **kw), steps=2, gas=2)
    assert_same(plain, overlapped)


def test_fp16_overflow_in_the_overlapped_pass_is_undone(tmp_path, device):
    fp16 = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2}
    plain = run(config("nvme", tmp_path, False, fp16=fp16), steps=8)
    overlapped = run(config("nvme", tmp_path, True, fp16=fp16), steps=8)
    assert 0 < overlapped["skipped"] < 8
    assert_same(plain, overlapped)


def test_sub_groups_are_stepped_while_backward_runs(tmp_path, device):
    """The gate opens chunks as units finish, not only when backward returns: a hook on the position
    embedding (its gradient comes last) holds backward until the pass reports an updated chunk."""
    engine = zero.initialize(model=make_model(), config=config("nvme", tmp_path, True))[0]
    n_chunks = engine.optimizer_state_info().chunks
    assert engine.overlap.enabled and n_chunks >= 4
    seen = []
    hook = engine.module.pos.weight.register_hook(
        lambda g: seen.append(engine.overlap.wait_updated(1, timeout=60))
    )
    x, y = (t.to(engine.device) for t in get_batch(DATA, 4, TINY.seq_len, 0))
    engine.backward(engine(x, y))
    engine.step()
    hook.remove()
    rep = engine.last_report
    assert seen == [True]
    assert rep.optimizer_chunks == n_chunks
    assert 1 <= rep.optimizer_chunks_in_backward <= n_chunks
    assert engine.optimizer.step_count == 1
    engine.close()


def test_forward_between_backward_and_step_sees_the_committed_weights(tmp_path, device):
    engine = zero.initialize(model=make_model(), config=config("nvme", tmp_path, True))[0]
    before = zero.consolidated_state_dict(engine)
    x, y = (t.to(engine.device) for t in get_batch(DATA, 4, TINY.seq_len, 0))
    engine.backward(engine(x, y))
    with torch.no_grad():
        engine(x, y)  # drops the pass begun in backward and restores the weights
    assert not engine.overlap.running
    now = zero.consolidated_state_dict(engine)
    assert all(torch.equal(before[k], now[k]) for k in before)
    engine.step()  # then steps after backward, from the same gradients
    assert engine.optimizer.step_count == 1
    reference = run(config("nvme", tmp_path, False), steps=1)
    after = zero.consolidated_state_dict(engine)
    assert all(torch.equal(after[k], reference["params"][k]) for k in after)
    engine.close()


def test_failed_backward_cancels_the_pass(tmp_path, device):
    engine = zero.initialize(model=make_model(), config=config("nvme", tmp_path, True))[0]
    before = zero.consolidated_state_dict(engine)
    x, y = (t.to(engine.device) for t in get_batch(DATA, 4, TINY.seq_len, 0))

    def fail(grad):
        # the head's units are in and their sub-groups stepped already: the pass has work to undo
        assert engine.overlap.wait_updated(1, timeout=60)
        raise RuntimeError("backward failed")

    def arm(module, inputs, out) -> None:  # raises when backward reaches the first block's output
        out.register_hook(fail)

    hook = engine.module.blocks[0].register_forward_hook(arm)
    loss = engine(x, y)
    hook.remove()
    with pytest.raises(RuntimeError, match="backward failed"):
        engine.backward(loss)
    assert not engine.overlap.running
    now = zero.consolidated_state_dict(engine)
    assert all(torch.equal(before[k], now[k]) for k in before)
    assert engine.optimizer.step_count == 0
    engine.zero_grad()
    losses = [engine(x, y)]  # and training goes on from the committed state
    engine.backward(losses[0])
    engine.step()
    assert engine.optimizer.step_count == 1
    engine.close()
