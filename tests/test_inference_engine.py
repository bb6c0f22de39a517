"""An engine without an optimizer (ZeRO-Inference, zero/inference/parts.py): `zero.initialize` with no
optimizer block and no optimizer= returns an inference engine. Greedy generation and logits of Hugging Face
GPT-2 and Llama (tiny configs, random init) through it equal plain transformers bit for bit at stage 0 and at
stage 3 with the weights on cpu and on NVMe (bf16 too, zero.Init too); backward/step/save refuse with
NoOptimizerError; no optimizer state, gradient buffer or optimizer swap space exists; training-only keys;
checkpoints of a training engine load into it; its swap space goes away with it."""

from __future__ import annotations

import copy
import gc
import logging
import os

import pytest
import torch

import zero
from offload.config import ConfigError
from zero.stage3 import Stage3PinnedBudgetError

transformers = pytest.importorskip("transformers")

VOCAB = 128
SEQ = 32
NEW_TOKENS = 8
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}


def gpt2():
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2
        )
    )


def llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=1,
            eos_token_id=2,
        )
    )  # fmt: skip


BUILDERS = {"gpt2": gpt2, "llama": llama}
PLACEMENTS = ["stage0", "stage3-cpu", "stage3-nvme"]


def build(arch, seed=0):
    torch.manual_seed(seed)
    return BUILDERS[arch]().eval()


def zero_section(placement, tmp):
    if placement == "stage0":
        return {"stage": 0}
    if placement == "stage3-cpu":
        return {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    # max_in_cpu 0: every partition in a swap file, read back for each forward
    return {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp), "max_in_cpu": 0}}


def inference_config(placement, tmp, **extra):
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero_section(placement, tmp), **extra}


def prompt(seed=1):
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))


def generate(model, ids):
    mask = torch.ones_like(ids)
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_generation_and_logits_equal_plain_transformers(tmp_path, arch, placement):
    model = build(arch)
    ref = copy.deepcopy(model)
    ids = prompt()
    with torch.no_grad():
        want_tokens, want_logits = generate(ref, ids), ref(ids).logits
    # DeepSpeed's call shape: config_params=, model_parameters=
    engine, optimizer, loader, scheduler = zero.initialize(
        model=model, config_params=inference_config(placement, tmp_path), model_parameters=model.parameters()
    )
    assert optimizer is None and loader is None and scheduler is None and engine.optimizer is None
    assert engine.eval() is engine and not engine.module.training
    if placement != "stage0":
        assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned, gathered per module
        engine.partitioner.take_io_report()
    got_tokens = generate(engine.module, ids)
    assert got_tokens.shape == (2, 6 + NEW_TOKENS)
    assert torch.equal(got_tokens, want_tokens)
    with torch.no_grad():
        assert torch.equal(engine(ids).logits, want_logits)
    assert torch.equal(engine.forward(input_ids=ids).logits, want_logits)  # grad mode: same values
    if placement == "stage3-nvme":
        io = engine.partitioner.take_io_report()
        assert io.param_reads > 0 and io.param_nvme_read_bytes > 0 and io.param_nvme_write_bytes == 0
    assert engine.train() is engine and engine.module.training
    engine.close()


@pytest.mark.parametrize("placement", ["stage0", "stage3-nvme"])
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_bf16_generates_what_a_transformers_bf16_load_does(tmp_path, arch, placement):
    """bf16 from an fp32 model: the parameters are cast (at stage 3 as they are partitioned: the partitions
    are bf16) and the buffers keep their dtype, so generation and logits equal transformers' own bf16 load
    of the same weights, a Llama's float32 rotary frequencies included; wrapping that bf16 model gives the
    same again."""
    model = build(arch)
    model.save_pretrained(tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    cfg = inference_config(placement, tmp_path, bf16={"enabled": True})
    for source in (model, copy.deepcopy(ref)):
        engine, *_ = zero.initialize(model=source, config=cfg)
        assert engine.dtype == torch.bfloat16
        if placement != "stage0":
            assert all(u.dtype == torch.bfloat16 for u in engine.partitioner.units)
        buffers = dict(engine.module.named_buffers())
        assert {n: b.dtype for n, b in ref.named_buffers()} == {
            n: buffers[n].dtype for n, _ in ref.named_buffers()
        }
        with torch.no_grad():
            assert torch.equal(generate(engine.module, prompt()), generate(ref, prompt()))
            assert torch.equal(engine(prompt()).logits, ref(prompt()).logits)
        engine.close()
    if arch == "llama":  # the case that differs from a cast model is there
        assert any(b.dtype == torch.float32 for b in ref.buffers())


def test_model_built_under_zero_init(tmp_path):
    """zero.Init builds the model partitioned on NVMe (never whole); the inference engine takes its
    partitioner over and generates what transformers does with the same weights."""
    cfg = inference_config("stage3-nvme", tmp_path)
    torch.manual_seed(0)
    with zero.Init(config=cfg):
        model = llama().eval()
    assert all(p.numel() == 0 for p in model.parameters())
    engine, *_ = zero.initialize(model=model, config=cfg)
    ref = llama().eval()
    ref.load_state_dict(zero.consolidated_state_dict(engine))
    with torch.no_grad():
        assert torch.equal(generate(engine.module, prompt()), generate(ref, prompt()))
        assert torch.equal(engine(prompt()).logits, ref(prompt()).logits)
    engine.close()


def test_backward_step_and_training_state_refuse(tmp_path):
    engine, *_ = zero.initialize(model=build("gpt2"), config=inference_config("stage3-cpu", tmp_path))
    loss = engine(prompt(), labels=prompt()).loss
    for call in (lambda: engine.backward(loss), engine.step):
        with pytest.raises(zero.NoOptimizerError, match=r"needs an optimizer.*'optimizer' block.*optimizer="):
            call()
    assert issubclass(zero.NoOptimizerError, RuntimeError)
    with pytest.raises(zero.NoOptimizerError, match="save_16bit_model"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt")
    with pytest.raises(zero.NoOptimizerError):
        engine.fp32_master_state_dict()
    with pytest.raises(zero.NoOptimizerError):
        engine.optimizer_state_dict()
    assert engine.get_lr() == [] and engine.global_steps == 0 and engine.last_grad_norm is None
    engine.close()


@pytest.mark.parametrize("placement", ["stage3-cpu", "stage3-nvme"])
def test_no_optimizer_state_or_gradient_buffers(tmp_path, placement):
    """The public memory numbers: nothing for the optimizer; the pinned memory is the training engine's
    (same weights, optimizer on cpu) less exactly its fp32 master, two Adam states and gradient partition."""
    engine, *_ = zero.initialize(model=build("gpt2"), config=inference_config(placement, tmp_path))
    info = engine.optimizer_state_info()
    assert info.tier == "none" and info.numel == 0 and info.disk_bytes == 0 and info.pass_read_bytes == 0
    assert engine.optimizer_nvme_bytes == 0 and engine.swap_dir is None and engine.optimizer_state is None
    assert engine.layout.grad_host is None and engine.part_numel == 0
    assert engine.nvme_bytes == engine.partitioner.store.bytes_on_disk
    assert (engine.nvme_bytes > 0) == (placement == "stage3-nvme")
    generate(engine.module, prompt())
    assert all(p.grad is None for p in engine.module.parameters())
    cfg = inference_config(placement, tmp_path, optimizer=OPTIMIZER)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    trainer, *_ = zero.initialize(model=build("gpt2"), config=cfg)
    n = trainer.part_numel
    assert engine.trainable_numel == trainer.trainable_numel
    assert trainer.pinned_bytes - engine.pinned_bytes == n * 4 * (1 + 2 + 1)
    trainer.close()
    engine.close()


def test_manual_backward_at_stage3_drops_parameter_gradients(tmp_path):
    """A backward the user runs through the module (not engine.backward) works and accumulates nothing."""
    engine, *_ = zero.initialize(model=build("llama"), config=inference_config("stage3-nvme", tmp_path))
    ref = build("llama")
    engine(prompt(), labels=prompt()).loss.backward()
    assert all(p.grad is None for p in engine.module.parameters())
    with torch.no_grad():
        assert torch.equal(generate(engine.module, prompt(2)), generate(ref, prompt(2)))
    engine.close()


def test_training_keys_without_optimizer(tmp_path, caplog):
    cfg = inference_config("stage0", tmp_path, scheduler={"type": "WarmupLR", "params": {}})
    with pytest.raises(ConfigError, match="scheduler.*needs an optimizer"):
        zero.initialize(model=build("gpt2"), config=cfg)
    with pytest.raises(ValueError, match="lr_scheduler= needs an optimizer"):
        cfg = inference_config("stage0", tmp_path)
        zero.initialize(model=build("gpt2"), config=cfg, lr_scheduler=lambda opt: None)

    with caplog.at_level(logging.WARNING, logger="zero"):
        zero.initialize(model=build("gpt2"), config=inference_config("stage3-cpu", tmp_path))[0].close()
    assert not [r for r in caplog.records if "ignores the training keys" in r.getMessage()]

    cfg = inference_config("stage3-cpu", tmp_path, gradient_clipping=1.0)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    with caplog.at_level(logging.WARNING, logger="zero"):
        engine, *_ = zero.initialize(model=build("gpt2"), config=cfg)
    [warning] = [r.getMessage() for r in caplog.records if "ignores the training keys" in r.getMessage()]
    assert "gradient_clipping=1.0" in warning and "offload_optimizer.device='nvme'" in warning
    assert engine.swap_dir is None and engine.optimizer_nvme_bytes == 0 and engine.offload_device == "none"
    assert os.listdir(tmp_path) == []  # no optimizer swap space was made under the ignored nvme_path
    engine.close()


def _train_and_save(arch, placement, tmp_path):
    """A training engine (optimizer on cpu) takes two steps and saves; returns (checkpoint dir, weights)."""
    cfg = inference_config(placement, tmp_path / "train-swap", optimizer=OPTIMIZER)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    os.makedirs(tmp_path / "train-swap")
    trainer, *_ = zero.initialize(model=build(arch), config=cfg)
    for step in range(2):
        ids = prompt(10 + step)
        trainer.backward(trainer(ids, labels=ids).loss)
        trainer.step()
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    trained = zero.consolidated_state_dict(trainer)
    trainer.close()
    return str(tmp_path / "ckpt"), trained


@pytest.mark.parametrize("placement", ["stage0", "stage3-nvme"])
def test_load_checkpoint_of_a_training_engine(tmp_path, placement):
    ckpt, trained = _train_and_save("gpt2", placement, tmp_path)
    ref = build("gpt2")
    ref.load_state_dict(trained)
    with torch.no_grad():
        want_tokens, want_logits = generate(ref, prompt()), ref(prompt()).logits
    model = build("gpt2", seed=1).requires_grad_(False)  # frozen, as often for inference: loads all the same
    engine, *_ = zero.initialize(model=model, config=inference_config(placement, tmp_path))
    assert not torch.equal(generate(engine.module, prompt()), want_tokens)  # other weights before loading
    for kwargs in ({"load_optimizer_states": False}, {"load_module_only": True}, {}):  # {}: weights only too
        path, client = engine.load_checkpoint(ckpt, **kwargs)
        assert path.endswith("global_step2") and client == {}
        assert engine.global_steps == 2
        assert torch.equal(generate(engine.module, prompt()), want_tokens)
        with torch.no_grad():
            assert torch.equal(engine(prompt()).logits, want_logits)
    sd = zero.consolidated_state_dict(engine)
    assert all(torch.equal(sd[k], v) for k, v in trained.items())
    engine.close()


def resident_config(tmp, max_in_cpu, **off):
    cfg = inference_config("stage3-nvme", tmp)
    cfg["zero_optimization"]["offload_param"].update(max_in_cpu=max_in_cpu, **off)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every unit read at each use
    return cfg


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_max_in_cpu_keeps_layers_in_ram_and_streams_the_rest(tmp_path, arch):
    """offload_param.max_in_cpu with nvme for inference: partitions of up to that many elements in all
    stay in host memory (no swap file), the rest are streamed; generation and logits equal transformers
    exactly, and the report's NVMe bytes per forward shrink by the resident partitions' bytes (untied
    Llama: each unit used once per forward, so exactly)."""
    model = build(arch)
    ref = copy.deepcopy(model)
    ids = prompt()
    with torch.no_grad():
        want_tokens, want_logits = generate(ref, ids), ref(ids).logits
    budget = sum(p.numel() for p in model.parameters()) // 2
    streamed, *_ = zero.initialize(model=copy.deepcopy(model), config=resident_config(tmp_path, 0))
    engine, *_ = zero.initialize(model=model, config=resident_config(tmp_path, budget))
    store, units = engine.partitioner.store, engine.partitioner.units
    resident = [u for u in units if not store.on_nvme(u)]
    assert 0 < sum(u.part_numel for u in resident) <= budget and len(resident) < len(units)
    assert [store.swap_file(u) for u in resident] == [None] * len(resident)
    assert sum(u.part_nbytes for u in units if store.on_nvme(u)) <= engine.nvme_bytes < streamed.nvme_bytes
    assert torch.equal(generate(engine.module, ids), want_tokens)
    reads = {}
    for name, e in (("streamed", streamed), ("resident", engine)):
        e.partitioner.take_io_report()
        with torch.no_grad():
            assert torch.equal(e(ids).logits, want_logits)
        reads[name] = e.partitioner.take_io_report().param_nvme_read_bytes
    resident_bytes = sum(u.part_nbytes for u in resident)
    if arch == "llama":
        assert reads["resident"] == reads["streamed"] - resident_bytes
        assert reads["resident"] == sum(u.part_nbytes for u in units if store.on_nvme(u))
    else:  # GPT-2's tied embedding (resident: it comes first) is used twice per forward
        assert reads["resident"] <= reads["streamed"] - resident_bytes
    engine.close(), streamed.close()
    assert os.listdir(tmp_path) == []


def test_pinned_budget_too_small_for_the_resident_layers_fails_at_initialize(tmp_path):
    """max_in_cpu itself is a cap, not a budget (0 is valid: every partition streamed), so no value of it
    is too small for a layer; the pinned budget is: with pin_memory the resident partitions are
    page-locked, and a budget below them fails at initialize naming the layer and sizes, before any
    forward, with no swap file left."""
    cfg = resident_config(tmp_path, 10**9, pin_memory=True)
    cfg["zero_offload"] = {"pinned_budget_bytes": 4096}
    with pytest.raises(
        Stage3PinnedBudgetError,
        match=r"pinned memory budget of 4096 bytes .* "
        r"the largest 'model.embed_tokens' with a partition of 4096 elements \(16384 bytes\)",
    ):
        zero.initialize(model=build("llama"), config=cfg)  # fmt: skip
    assert os.listdir(tmp_path) == []


def test_swap_space_removed_on_close_and_when_collected(tmp_path):
    engine, *_ = zero.initialize(model=build("llama"), config=inference_config("stage3-nvme", tmp_path))
    swap = engine.partitioner.store.swap_dir
    assert swap is not None and os.listdir(swap)
    engine.close()
    assert not os.path.exists(swap)

    engine, *_ = zero.initialize(model=build("llama"), config=inference_config("stage3-nvme", tmp_path))
    swap = engine.partitioner.store.swap_dir
    generate(engine.module, prompt())
    del engine
    gc.collect()
    assert not os.path.exists(swap) and os.listdir(tmp_path) == []


def _two_rank_generation(rank, world_size, nvme_dir, out_dir):
    model = build("llama")
    ref = copy.deepcopy(model)
    engine, *_ = zero.initialize(model=model, config=inference_config("stage3-nvme", nvme_dir))
    got, want = generate(engine.module, prompt()), generate(ref, prompt())
    parts = [u.part_numel for u in engine.partitioner.units]
    engine.close()
    return torch.equal(got, want), parts


@pytest.mark.slow  # two spawned processes importing transformers: about 20 s
def test_two_ranks_at_stage3_generate_like_one(tmp_path):
    """Two gloo ranks, each holding half of every partition on NVMe, generate what plain transformers does."""
    from dist_helpers import run_on_ranks

    results, _ = run_on_ranks(_two_rank_generation, tmp_path)
    assert [same for same, _ in results] == [True, True]
    assert results[0][1] == results[1][1]


def test_forward_meter_waits_for_the_device(monkeypatch):
    """On a GPU a forward's time covers the work it queued: the meter synchronizes the device as the root
    forward starts and as it returns; on the CPU it has nothing to wait for."""
    from zero.report import ForwardMeter

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    model = torch.nn.Linear(4, 4)
    gpu = torch.device("cuda", 0)
    meter = ForwardMeter(model, gpu)
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert calls == [gpu, gpu] and meter.take()[0] == 1
    meter.close()
    meter = ForwardMeter(model)
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert calls == [gpu, gpu] and meter.take()[0] == 1
    meter.close()
