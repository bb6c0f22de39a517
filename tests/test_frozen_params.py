"""Parameters frozen after zero.Init (PEFT's LoRA on ZeRO-3): partitioned, gathered for forward, never given
gradients or optimizer state, at every stage and tier; `exclude_frozen_parameters` on save and export."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from engine_helpers import DATA, TINY, base_config, make_model, s3_config
from safetensors.torch import load_file

import zero
from zero.examples.models import get_batch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def lora(base):
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    torch.manual_seed(1)  # the adapters' initial values
    return peft.get_peft_model(base, cfg)


def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def lora_config(tmp, tier):
    off = {"device": tier, "nvme_path": str(tmp), "max_in_cpu": 0} if tier != "none" else None
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,  # nothing kept whole for a reuse: the peak shows what is held
            "offload_param": off,
            "offload_optimizer": off,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    }


def batches(n):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, LLAMA["vocab_size"], (2, 8), generator=g) for _ in range(n)]


@pytest.mark.parametrize("tier", [pytest.param("nvme", marks=pytest.mark.slow), "cpu"])
def test_lora_trains_on_zero3(tmp_path, tier):
    """LoRA over a tiny Llama built under zero.Init, parameters and optimizer on `tier`: the adapters train
    as with torch AdamW on the plain model, the frozen base stays bit-identical, the optimizer holds only the
    adapters, and the adapters peft saves (gathered) equal the engine's export with
    `exclude_frozen_parameters`."""
    ref = lora(tiny_llama())
    frozen_before = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    want = []
    for ids in batches(4):
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss))
    adapters = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}

    cfg = lora_config(tmp_path, tier)
    with zero.Init(config_dict_or_path=cfg):
        base = tiny_llama()
    model = lora(base)
    engine, *_ = zero.initialize(model=model, config=cfg)
    assert engine.trainable_numel == sum(p.numel() for p in adapters.values())
    info = engine.optimizer_state_info()
    assert info.tier == tier and info.numel < sum(p.numel() for p in frozen_before.values())
    got = []
    for ids in batches(4):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        got.append(float(loss))
    assert max(abs(a - b) for a, b in zip(got, want)) <= 2e-5, (got, want)
    # the frozen modules' weights are freed once their backward ran, not held to the end of backward
    whole = sum(u.nbytes for u in engine.partitioner.units)
    assert engine.last_param_io["peak_full_bytes"] < whole / 3

    full = zero.consolidated_state_dict(engine)
    for name, before in frozen_before.items():
        assert torch.equal(full[name], before), name  # never updated, bit for bit
    for name, p in adapters.items():
        assert (full[name] - p).abs().max().item() <= 2e-5, name

    exported = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    assert set(exported) == set(adapters)
    assert engine.save_16bit_model(str(tmp_path / "out"), "adapters.bin", exclude_frozen_parameters=True)
    saved16 = torch.load(tmp_path / "out" / "adapters.bin", weights_only=True)
    assert set(saved16) == set(adapters) and all(torch.equal(saved16[k], exported[k]) for k in adapters)

    # PEFT's own save of the unwrapped model, its parameters gathered
    with zero.GatheredParameters(list(engine.module.parameters())):
        engine.module.save_pretrained(str(tmp_path / "peft"))
    saved = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert len(saved) == len(adapters)
    for name, value in exported.items():
        assert torch.equal(saved[name.replace(".default", "")], value), name
    engine.close()


def _freeze(m):
    m.tok.weight.requires_grad_(False)
    m.blocks[0].fc.bias.requires_grad_(False)
    return m


STAGE_TIERS = [(0, "none"), (1, "cpu"), (2, "nvme"), (2, "cpu"), (3, "none"), (3, "cpu"), (3, "nvme")]


@pytest.mark.parametrize("stage,optim", STAGE_TIERS)
def test_frozen_after_construction_stays_unchanged_at_every_stage(tmp_path, stage, optim):
    """Parameters frozen after the model was built (after zero.Init at stage 3) get no optimizer state and
    keep their values bit for bit; the trained ones follow torch AdamW over the trainable parameters."""
    ref = _freeze(make_model())
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1
    )
    for step in range(3):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    if stage == 3:
        cfg = s3_config(optim if optim != "nvme" else "nvme", optim, tmp_path)
        with zero.Init(config_dict_or_path=cfg):
            model = make_model()
    else:
        cfg = base_config(optim, tmp_path, stage=stage)
        model = make_model()
    engine, *_ = zero.initialize(model=_freeze(model), config=cfg)
    assert engine.trainable_numel == sum(p.numel() for p in ref.parameters() if p.requires_grad)
    for step in range(3):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        engine.backward(engine(x, y))
        engine.step()
    got = zero.consolidated_state_dict(engine)
    for name, want in frozen.items():
        assert torch.equal(got[name], want), name
    for name, want in ref.named_parameters():
        assert (got[name] - want.detach()).abs().max().item() <= 2e-5, name
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_init_built_model_with_a_stage_0_2_config_is_refused(stage):
    with zero.Init():
        model = make_model()
    with pytest.raises(
        ValueError, match=rf"zero_optimization.stage={stage}: the model was built under zero.Init"
    ):
        zero.initialize(model=model, config=base_config("none", stage=stage))


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_without_frozen_parameters_resumes_bit_identically(tmp_path, stage):
    """save_checkpoint(exclude_frozen_parameters=True) leaves the frozen weights out; a fresh engine over the
    same base model loads it and continues exactly as the engine that saved it."""

    def build():
        if stage == 3:
            cfg = s3_config("cpu", "cpu", tmp_path)
            with zero.Init(config_dict_or_path=cfg):
                model = make_model()
        else:
            cfg, model = base_config("cpu", tmp_path, stage=stage), make_model()
        engine, *_ = zero.initialize(model=_freeze(model), config=cfg)
        return engine

    def steps(engine, first, n):
        for step in range(first, first + n):
            x, y = get_batch(DATA, 4, TINY.seq_len, step)
            engine.backward(engine(x, y))
            engine.step()

    a = build()
    steps(a, 0, 2)
    full_path = a.save_checkpoint(str(tmp_path / "full"), tag="t")
    path = a.save_checkpoint(str(tmp_path / "ck"), tag="t", exclude_frozen_parameters=True)
    module = torch.load(os.path.join(path, "model_states.pt"), weights_only=True)["module"]
    assert "tok.weight" not in module and "blocks.0.fc.bias" not in module
    if stage == 3:  # the frozen embedding's unit is not in the parameter file
        small = os.path.getsize(os.path.join(path, "param_rank0.bin"))
        assert small < os.path.getsize(os.path.join(full_path, "param_rank0.bin"))
    else:
        assert "blocks.0.fc.weight" in module
    steps(a, 2, 2)
    want = copy.deepcopy(zero.consolidated_state_dict(a))
    a.close()

    b = build()
    b.load_checkpoint(str(tmp_path / "ck"), tag="t")
    steps(b, 2, 2)
    got = zero.consolidated_state_dict(b)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    b.close()
