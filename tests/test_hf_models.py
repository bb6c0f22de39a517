"""Hugging Face transformers models (built from tiny configs, no hub access) through the stage-3 engine with
parameters and optimizer on NVMe: forward/backward/step equal plain torch AdamW; zero.Init construction."""

from __future__ import annotations

import copy

import pytest
import torch

import zero

transformers = pytest.importorskip("transformers")

VOCAB = 128
SEQ = 16
STEPS = 5
LOSS_ATOL = 2e-5  # as tests/test_engine.py: rounding drift only; one wrong step moves the loss ~1e-3
PARAM_ATOL = 2e-5


def gpt2_config():
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip


BUILDERS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(gpt2_config()),
    "llama": lambda: transformers.LlamaForCausalLM(llama_config()),
}


def config(tmp):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 5000,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp), "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp)},
        },
    }


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def torch_run(model, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for step in range(steps):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def engine_run(engine, steps):
    losses = []
    for step in range(steps):
        ids = batch(step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def compare(engine, ref_model, ref_losses, losses):
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst <= LOSS_ATOL, f"losses differ by {worst:.3g}: {losses} vs {ref_losses}"
    got = zero.consolidated_state_dict(engine)
    for name, want in ref_model.named_parameters():
        diff = (got[name] - want.detach()).abs().max().item()
        assert diff <= PARAM_ATOL, f"{name}: {diff:.3g}"


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_hf_model_stage3_nvme_matches_torch(tmp_path, arch):
    torch.manual_seed(0)
    model = BUILDERS[arch]()
    ref = copy.deepcopy(model)
    ref_losses = torch_run(ref, STEPS)
    engine, *_ = zero.initialize(model=model, config=config(tmp_path))
    assert all(p.numel() == 0 for p in engine.module.parameters())
    compare(engine, ref, ref_losses, engine_run(engine, STEPS))
    if arch == "gpt2":  # the tied output head is one parameter: stored once, still tied after training
        sd = zero.consolidated_state_dict(engine)
        assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    engine.close()


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_hf_model_built_under_zero_init(tmp_path, arch):
    """zero.Init while the HF model is constructed from its config: never whole in memory, trains like
    torch started from the same weights."""
    cfg = config(tmp_path)
    torch.manual_seed(0)
    with zero.Init(config=cfg):
        model = BUILDERS[arch]()
    assert all(p.numel() == 0 for p in model.parameters())
    engine, *_ = zero.initialize(model=model, config=cfg)
    ref = BUILDERS[arch]()
    initial = zero.consolidated_state_dict(engine)
    ref.load_state_dict(initial)
    assert any(v.abs().sum() > 0 for k, v in initial.items() if k.endswith("weight"))  # really initialised
    ref_losses = torch_run(ref, STEPS)
    compare(engine, ref, ref_losses, engine_run(engine, STEPS))
    engine.close()
