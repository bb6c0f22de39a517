"""The transformers code paths PEFT and TRL take with ZeRO-3, through our engine (no `deepspeed` installed).

transformers' own ZeRO-3 branches are gated on `is_deepspeed_zero3_enabled()`, which reads the
`HfDeepSpeedConfig` that only `TrainingArguments(deepspeed=...)` with an installed `deepspeed` creates:
with zero-offload it stays False (docs/integrations.md, "transformers' own DeepSpeed path"). What those
branches do is done through ours: shapes and values of partitioned weights read and written inside
`zero.GatheredParameters` (what transformers does around embedding resizes, PEFT around its weight
copies), embeddings resized before the engine partitions the model, and TRL's
`unwrap_model_for_generation` with `generate` on a stage-3 model whose parameters live on NVMe.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.integrations import is_deepspeed_zero3_enabled  # noqa: E402

import zero  # noqa: E402


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg)


def stage3(tmp_path, optimizer=True):
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {**nvme, "max_in_cpu": 0},
            "offload_optimizer": nvme,
        },
    }
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    return cfg


def test_transformers_zero3_branches_stay_off_and_deepspeed_is_not_faked(tmp_path):
    engine, *_ = zero.initialize(model=tiny_gpt2(), config=stage3(tmp_path))
    assert not is_deepspeed_zero3_enabled()  # no HfDeepSpeedConfig: transformers runs its plain paths
    assert importlib.util.find_spec("deepspeed") is None  # zero-offload never poses as `deepspeed`
    emb = engine.module.get_input_embeddings()
    assert emb.weight.numel() == 0  # partitioned: shapes need a gather, as under DeepSpeed
    engine.close()


def test_embedding_shape_and_values_inside_gathered_parameters(tmp_path):
    """transformers reads `weight.shape[0]` inside GatheredParameters(modifier_rank=None); PEFT writes
    weights inside GatheredParameters(modifier_rank=0). Both through ours, on NVMe partitions."""
    plain = tiny_gpt2()
    engine, *_ = zero.initialize(model=tiny_gpt2(), config=stage3(tmp_path))
    emb = engine.module.get_input_embeddings()
    with zero.GatheredParameters(emb.weight, modifier_rank=None):
        assert tuple(emb.weight.shape) == (64, 32)
        assert torch.equal(emb.weight, plain.transformer.wte.weight)
    with zero.GatheredParameters(emb.weight, modifier_rank=0), torch.no_grad():
        emb.weight[:4] = 0.5  # as PEFT initialises a copied module's weights
    sd = engine.consolidated_state_dict()
    assert torch.equal(sd["transformer.wte.weight"][:4], torch.full((4, 32), 0.5))
    assert torch.equal(sd["transformer.wte.weight"][4:], plain.transformer.wte.weight[4:])
    engine.close()


def test_resized_embeddings_train_at_stage3(tmp_path):
    """resize_token_embeddings (new tokens for a chat template) on the model before the engine partitions
    it; the engine then trains every row, and the 16-bit export has the new vocabulary."""
    model = tiny_gpt2()
    model.resize_token_embeddings(72, mean_resizing=False)
    cfg = stage3(tmp_path)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = zero.initialize(model=model, config=cfg)
    ids = torch.tensor([[1, 70, 71, 5, 69, 2]])
    before = engine.consolidated_state_dict()["transformer.wte.weight"]
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    after = engine._zero3_consolidated_16bit_state_dict()["transformer.wte.weight"]
    assert after.shape == (72, 32)
    assert not torch.equal(after[70], before[70])  # a new token's row was trained
    engine.close()


def test_trl_generation_on_a_stage3_engine_with_nvme_parameters(tmp_path):
    plain = tiny_gpt2().eval()
    engine, *_ = zero.initialize(model=tiny_gpt2(), config=stage3(tmp_path))
    engine.eval()
    prompt = torch.tensor([[3, 17, 5]])
    want = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    status = zero.ZeroParamStatus
    with zero.unwrap_model_for_generation(engine) as unwrapped:
        assert isinstance(unwrapped, GPT2LMHeadModel)
        got = unwrapped.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert all(p.ds_status is status.AVAILABLE for p in unwrapped.parameters())  # gathered once
    assert torch.equal(got, want)
    assert all(p.ds_status is status.NOT_AVAILABLE for p in engine.module.parameters())
    with zero.unwrap_model_for_generation(engine, gather_deepspeed3_params=False) as unwrapped:
        got = unwrapped.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)  # each module gathers its own parameters as it runs
    engine.close()
