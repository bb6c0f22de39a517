"""DeepSpeed's engine accessors and calls as DeepSpeed documents them: configuration accessors,
offload_states / reload_states, empty_partition_cache, destroy, save_checkpoint's tag, save_dir and
save_latest rules, checkpoint.tag_validation over two ranks, load_state_dict_from_zero_checkpoint,
TRL's unwrap_model_for_generation, see_memory_usage, the exception and version names; and the state
accessors (zero.utils) over two ranks."""

from __future__ import annotations

import logging
import os
import pathlib
import warnings

import pytest
import torch
from dist_helpers import run_on_ranks
from engine_helpers import DATA, TINY, base_config, make_model, s3_config, train

import zero
import zero.utils as ds_utils
from zero.examples.models import get_batch
from zero.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint


def _engine(cfg):
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    return engine


# ------------------------------------------------------------------------------ configuration accessors
def test_configuration_accessors(tmp_path):
    cfg = base_config("cpu", tmp_path, stage=2, bf16={"enabled": True}, gradient_accumulation_steps=3)
    e = _engine(cfg)
    assert e.bfloat16_enabled() is True and e.fp16_enabled() is False
    assert e.zero_optimization_stage() == 2 and e.zero_optimization() is True
    assert e.gradient_accumulation_steps() == 3 and e.train_micro_batch_size_per_gpu() == 4
    assert e.train_batch_size() == 12 and e.get_batch_info() == (12, 4, 3)
    assert e.get_lr() == [1e-3]
    assert e.zero_offload_optimizer().device == "cpu" and e.zero_cpu_offload() is True
    assert e.checkpoint_tag_validation_enabled() and not e.checkpoint_tag_validation_fail()
    e.close()
    e = _engine(base_config(stage=0, fp16={"enabled": True}, checkpoint={"tag_validation": "FAIL"}))
    assert e.fp16_enabled() and not e.bfloat16_enabled() and e.zero_optimization_stage() == 0
    assert e.checkpoint_tag_validation_fail() and not e.zero_cpu_offload()
    e.destroy()  # DeepSpeed's name for releasing the engine
    with pytest.raises(RuntimeError, match="closed"):
        e.check_open()


def test_names_deepspeed_users_import():
    assert zero.DeepSpeedConfigError is zero.ConfigError
    with pytest.raises(zero.DeepSpeedConfigError, match="zero_optimization"):
        zero.initialize(model=make_model(), config={"zero_optimization": {"stage": 7}})
    assert zero.DeepSpeedEngine is zero.ZeroEngine
    parts = (zero.__version_major__, zero.__version_minor__, zero.__version_patch__)
    assert ".".join(map(str, parts)) == zero.__version__ and all(isinstance(p, int) for p in parts)
    assert issubclass(zero.CheckpointTagError, AssertionError)
    assert zero.OffloadDeviceEnum.cpu == "cpu" and zero.OffloadStateTypeEnum("optim_states")


# -------------------------------------------------------------------------------- offload / reload
@pytest.mark.parametrize(
    "stage,optim", [(0, "none"), (2, "cpu"), pytest.param(3, "nvme", marks=pytest.mark.slow)]
)
def test_offload_and_reload_states_keep_training_identical(stage, optim, tmp_path):
    """On a CPU-only machine every state is in host memory already: offload and reload move nothing, and
    training goes on exactly as without them."""
    cfg = s3_config("none", optim, tmp_path) if stage == 3 else base_config(optim, tmp_path, stage=stage)
    a, b = _engine(cfg), _engine(cfg)
    la, lb = train(a, 2), train(b, 2)
    before = a.fp32_master_state_dict()
    a.offload_states()
    assert a.offloaded_states() == set(zero.OffloadStateTypeEnum)
    a.reload_states()
    assert a.offloaded_states() == set()
    after = a.fp32_master_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    a.offload_states(include=[zero.OffloadStateTypeEnum.optim_states, "lp_grads"], non_blocking=True)
    assert a.offloaded_states() == {
        zero.OffloadStateTypeEnum.optim_states,
        zero.OffloadStateTypeEnum.lp_grads,
    }
    a.reload_states()
    assert la + train(a, 3, start=2) == lb + train(b, 3, start=2)  # bit for bit
    a.close()
    b.close()


def test_offload_states_arguments(tmp_path, caplog):
    e = _engine(base_config("cpu", tmp_path, stage=1))
    with pytest.raises(ValueError, match="nvme"):
        e.offload_states(device=zero.OffloadDeviceEnum.nvme)
    with pytest.raises(ValueError, match="optim_states"):
        e.offload_states(include=["momentum"])
    with caplog.at_level(logging.WARNING, logger="zero"):
        e.offload_states(device="none")
    assert "nothing is moved" in caplog.text and e.offloaded_states() == set()
    e.close()
    e = _engine(s3_config("cpu", "cpu", tmp_path))
    with pytest.raises(ValueError, match="offload_param.device='cpu'"):
        e.offload_states()
    e.close()
    inference, *_ = zero.initialize(model=make_model(), config={"zero_optimization": {"stage": 0}})
    with pytest.raises(RuntimeError, match="no optimizer"):
        inference.offload_states()


def test_empty_partition_cache_frees_persistent_units(tmp_path):
    cfg = s3_config("cpu", "cpu", tmp_path)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10**9  # every unit stays gathered
    e = _engine(cfg)
    x, y = get_batch(DATA, 4, TINY.seq_len, 0)
    with torch.no_grad():
        want = e(x, y)
    status = zero.ZeroParamStatus
    assert any(p.ds_status is status.AVAILABLE for p in e.module.parameters())
    e.empty_partition_cache()
    assert all(p.ds_status is status.NOT_AVAILABLE for p in e.module.parameters())
    with torch.no_grad():
        assert torch.equal(e(x, y), want)
    e.close()
    flat = _engine(base_config(stage=1))
    flat.empty_partition_cache()  # nothing is cached below stage 3
    flat.close()


# ------------------------------------------------------------------------------------------- checkpoints
def test_save_checkpoint_tag_save_dir_and_save_latest(tmp_path):
    e = _engine(base_config(stage=2))
    train(e, 2)
    for bad in (None, ""):
        with pytest.raises(ValueError, match="save_dir"):
            e.save_checkpoint(bad)
    assert not os.listdir(tmp_path)
    path = e.save_checkpoint(pathlib.Path(tmp_path))  # os.PathLike; tag None: global_step<N>
    assert path == os.path.join(tmp_path, "global_step2")
    assert (tmp_path / "latest").read_text() == "global_step2"
    train(e, 1, start=2)
    e.save_checkpoint(tmp_path, tag="side", save_latest=False)
    assert (tmp_path / "side").is_dir() and (tmp_path / "latest").read_text() == "global_step2"
    e.save_checkpoint(tmp_path, tag=7)  # DeepSpeed turns any tag into str
    assert (tmp_path / "latest").read_text() == "7"

    model = make_model(seed=1)
    out = load_state_dict_from_zero_checkpoint(model, pathlib.Path(tmp_path), tag="side")
    assert out is model
    master = e.fp32_master_state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), master[name]), name
    e.close()


def _tags_on_two_ranks(rank, world_size, nvme_dir, out_dir):
    results = {}
    for mode in ("Fail", "Warn", "Ignore"):
        cfg = base_config(stage=2, checkpoint={"tag_validation": mode})
        engine, *_ = zero.initialize(model=make_model(), config=cfg)
        save_dir = os.path.join(out_dir, mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                results[mode] = engine.save_checkpoint(save_dir, tag=f"tag-{rank}")
            except zero.CheckpointTagError as err:
                results[mode] = f"raised: {err}"
        results[mode + "_warned"] = any("tags differ" in str(w.message) for w in caught)
        results[mode + "_dirs"] = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
        engine.close()
    return results


@pytest.mark.slow
def test_tag_validation_across_ranks(tmp_path):
    (r0, r1), _ = run_on_ranks(_tags_on_two_ranks, tmp_path)
    for r in (r0, r1):
        assert r["Fail"].startswith("raised: checkpoint tags differ") and "'tag-1'" in r["Fail"]
        assert r["Fail_dirs"] == []  # nothing written
        assert r["Warn"] == os.path.join(tmp_path, "Warn", "tag-0") and r["Warn_warned"]
        assert r["Ignore"] == os.path.join(tmp_path, "Ignore", "tag-0") and not r["Ignore_warned"]
    assert r0["Warn_dirs"] == ["latest", "tag-0"]


# ------------------------------------------------------------------------ accessors over two ranks
def _accessors_on_two_ranks(rank, world_size, nvme_dir, out_dir):
    out = {}
    for stage in (1, 2, 3):
        cfg = s3_config("cpu", "cpu", nvme_dir) if stage == 3 else base_config("cpu", nvme_dir, stage=stage)
        engine, *_ = zero.initialize(model=make_model(), config=cfg)
        x, y = get_batch(DATA, 4, TINY.seq_len, 0)  # the same batch on both ranks: the mean is its gradient
        engine.backward(engine(x, y))
        names = dict(engine.module.named_parameters())
        out[stage] = {
            "grad": {n: ds_utils.safe_get_full_grad(p) for n, p in names.items()},
            "local": {n: ds_utils.safe_get_local_fp32_param(p).numel() for n, p in names.items()},
        }
        engine.step()
        master = engine.fp32_master_state_dict()
        got = {n: ds_utils.safe_get_full_fp32_param(p) for n, p in names.items()}
        out[stage]["master_equal"] = all(torch.equal(got[n], master[n]) for n in names)
        out[stage]["exp_avg"] = {
            n: ds_utils.safe_get_full_optimizer_state(p, "exp_avg") for n, p in names.items()
        }
        engine.close()
    return out


@pytest.mark.slow
def test_accessors_over_two_ranks(tmp_path):
    (r0, r1), _ = run_on_ranks(_accessors_on_two_ranks, tmp_path)
    ref = make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x, y = get_batch(DATA, 4, TINY.seq_len, 0)
    ref(x, y).backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    opt.step()
    for stage in (1, 2, 3):
        a, b = r0[stage], r1[stage]
        assert a["master_equal"] and b["master_equal"]
        for n, p in ref.named_parameters():
            assert torch.allclose(a["grad"][n], grads[n], atol=1e-6) and torch.equal(
                a["grad"][n], b["grad"][n]
            )
            assert torch.allclose(a["exp_avg"][n], opt.state[p]["exp_avg"], atol=1e-7), (stage, n)
            assert a["local"][n] + b["local"][n] == p.numel()  # the two shares make the parameter


# -------------------------------------------------------------------------------- TRL and diagnostics
def test_unwrap_model_for_generation_gathers_stage3_once(tmp_path):
    e = _engine(s3_config("nvme", "cpu", tmp_path))
    ref = make_model()
    x, y = get_batch(DATA, 2, TINY.seq_len, 0)
    status = zero.ZeroParamStatus
    with zero.unwrap_model_for_generation(e) as model:
        assert model is e.module
        assert all(p.ds_status is status.AVAILABLE for p in model.parameters())
        with torch.no_grad():
            assert torch.equal(model(x, y), ref(x, y))
        assert all(p.ds_status is status.AVAILABLE for p in model.parameters())  # a forward kept them
    assert all(p.ds_status is status.NOT_AVAILABLE for p in e.module.parameters())
    e.close()
    flat = _engine(base_config(stage=2))
    with zero.unwrap_model_for_generation(flat, gather_deepspeed3_params=False) as model:
        assert model is flat.module
    flat.close()


def test_see_memory_usage_logs_only_when_forced(caplog):
    with caplog.at_level(logging.INFO, logger="zero"):
        ds_utils.see_memory_usage("quiet")
        ds_utils.see_memory_usage("after init", force=True)
    assert "quiet" not in caplog.text
    assert "after init" in caplog.text and "host RSS" in caplog.text


# ---------------------------------------------------------------------------- attribute forwarding
def test_unknown_attributes_come_from_the_module(tmp_path):
    """DeepSpeed's engine forwards names it does not define to the wrapped module."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    plain = transformers.GPT2LMHeadModel(cfg).eval()
    torch.manual_seed(0)
    engine, *_ = zero.initialize(
        model=transformers.GPT2LMHeadModel(cfg), config=s3_config("nvme", "cpu", tmp_path)
    )
    engine.eval()
    prompt = torch.tensor([[3, 17, 5]])
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(engine.generate(prompt, **kw), plain.generate(prompt, **kw))
    assert engine.get_input_embeddings() is engine.module.transformer.wte
    assert engine.generation_config is engine.module.generation_config
    assert engine.config is not engine.module.config  # the engine's config, as DeepSpeed's engine.config
    assert engine.zero_optimization_stage() == 3  # the engine's own names win
    with pytest.raises(AttributeError, match="nor has its module, a GPT2LMHeadModel"):
        getattr(engine, "no_such_attribute")  # noqa: B009
    with pytest.raises(AttributeError):
        getattr(engine, "__no_such_dunder__")  # noqa: B009
    engine.close()
