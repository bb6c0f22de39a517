"""ZeRO-Inference weight quantization (`weight_quantization`, zero/stage3/quant.py): the int8/int4 group
codes against a float64 reference and their error bound; the stored byte layout (raw parameters bit-exact);
the config keys and their refusals; an inference engine whose Linear/Embedding/Conv1D weights live
quantized in their stage-3 partitions (cpu and NVMe) computes exactly what Hugging Face computes with the
dequantized weights, reads the quantized bytes per forward (the report's counters against the size formula
written out here), and stays within the logit-error bound docs/inference.md states against the
unquantized model; zero.from_pretrained quantizes as it streams and gives the same engine as wrapping."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import zero
from offload.config import ConfigError, load_config
from offload.config.quantization import WeightQuantSpec
from zero.stage3.quant import PartitionCodec, dequantize, is_conv1d, quantize, quantized_nbytes

transformers = pytest.importorskip("transformers")

VOCAB = 128
NEW_TOKENS = 8
# docs/inference.md, "Weight quantization": the bounds on the max relative logit error of these tiny
# random-weight models (benchmarks/bench_quant_error.py measures them)
REL_LOGIT_BOUND = {8: 0.03, 4: 0.4}


def gpt2(seed=0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2
        )
    ).eval()


def llama(seed=0, tied=False):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=tied,
        )
    ).eval()  # fmt: skip


BUILDERS = {"gpt2": gpt2, "llama": llama}


def config(tier, tmp_path, bits=8, **extra):
    off = {"device": "cpu"}
    if tier == "nvme":  # max_in_cpu 0: every partition in a swap file, read back for each forward
        off = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
    return {
        "train_micro_batch_size_per_gpu": 1,
        # persistence 0: every unit is gathered per use, so every forward reads every partition
        "zero_optimization": {"stage": 3, "offload_param": off, "stage3_param_persistence_threshold": 0},
        "weight_quantization": {"quantized_initialization": {"num_bits": bits}},
        **extra,
    }


def prompt(seed=1):
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))


def generate(model, ids):
    mask = torch.ones_like(ids)
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )


def is_quantized_module(m):
    return isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) or type(m).__name__ == "Conv1D"


def assert_fp32_close(got, want):
    """Equal up to fp32 rounding of the sums: a product from the codes adds in an order of its own."""
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def fused_linears(model):
    """Forwards computed from the codes in one forward of `model`: every nn.Linear, nn.Embedding and
    Conv1D (each quantized here; GPT-2's head reads the codes of the embedding's weight it shares)."""
    return sum(1 for m in model.modules() if type(m) in (torch.nn.Linear, torch.nn.Embedding) or is_conv1d(m))


def conv1ds(model):
    return sum(1 for m in model.modules() if is_conv1d(m))


def fake_quantized(model, spec):
    """A copy of `model` whose Linear/Embedding/Conv1D weights are replaced by their quantize-dequantize
    values (what the engine computes with)."""
    out = copy.deepcopy(model)
    done = set()
    with torch.no_grad():
        for m in out.modules():
            if is_quantized_module(m) and id(m.weight) not in done:  # a tied weight once
                w = m.weight
                done.add(id(w))
                codes, scale, offset = quantize(w.reshape(-1), spec)
                w.copy_(dequantize(codes, scale, offset, spec, w.numel(), w.dtype).view_as(w))
    return out


# ------------------------------------------------------------------------------------------- the codes
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_codes_against_a_float64_reference(bits, symmetric):
    """Every element is within half a step (plus the offset's float16 rounding) of its float64 value; the
    codes take bits/8 bytes per element (two int4 codes per byte) and the constants 2 bytes each."""
    spec = WeightQuantSpec(num_bits=bits, group_size=64, symmetric=symmetric)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.05 + 0.01
    codes, scale, offset = quantize(x.float(), spec)
    groups = -(-1000 // 64)
    assert codes.dtype == torch.uint8 and codes.numel() == groups * 64 * bits // 8
    assert scale.dtype == torch.float16 and scale.numel() == groups
    assert (offset is None) == symmetric
    y = dequantize(codes, scale, offset, spec, 1000, torch.float64)
    padded = torch.cat([x, x[-1:].expand(groups * 64 - 1000)]).view(groups, 64)
    step = scale.double()[:, None]
    bound = step / 2
    if not symmetric:
        bound = bound + (padded.amin(1, keepdim=True) - offset.double()[:, None]).abs()
        levels = 2**bits - 1
    else:
        levels = 2 ** (bits - 1) - 1
        assert bool((step * levels >= padded.abs().amax(1, keepdim=True)).all())  # the range is covered
    err = (y - x).view(-1)
    err = torch.cat([err, torch.zeros(groups * 64 - 1000, dtype=torch.float64)]).view(groups, 64).abs()
    assert bool((err <= bound * (1 + 1e-6) + 1e-12).all())
    # the bound is tight: the scale is the group's range over the code levels, rounded up to float16
    span = padded.abs().amax(1) if symmetric else padded.amax(1) - padded.amin(1)
    assert bool((scale.double() <= span / levels * (1 + 2**-9) + 2**-14).all())
    assert quantized_nbytes(1000, spec) == codes.numel() + 2 * scale.numel() * (1 if symmetric else 2)


def test_constant_group_and_out_of_range_weights():
    spec = WeightQuantSpec(num_bits=4, group_size=8)
    x = torch.full((16,), 0.375)
    codes, scale, offset = quantize(x, spec)
    assert torch.equal(dequantize(codes, scale, offset, spec, 16, torch.float32), x)  # no division by 0
    with pytest.raises(ValueError, match="layer.weight: cannot be quantized: it holds inf or nan"):
        quantize(torch.tensor([1.0, float("nan")]), spec, "layer.weight")
    with pytest.raises(ValueError, match="beyond 65504"):
        quantize(torch.tensor([1.0, 1e6]), spec, "layer.weight")


def test_partition_codec_keeps_raw_values_exact_and_encodes_only_what_is_asked():
    """A unit of weight (quantized) + bias (raw) + padding: the bias and padding decode bit-exact, the
    weight within its bound; `only` leaves the other parameters' stored bytes untouched."""
    spec = WeightQuantSpec(num_bits=4, group_size=16)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(100, generator=g), torch.randn(10, generator=g)
    values = torch.cat([w, b, torch.zeros(2)]).to(torch.bfloat16)
    codec = PartitionCodec(112, [(0, 100, 0, True), (100, 110, 1, False)], spec, torch.bfloat16)
    assert codec.nbytes == -(-(12 * 2 + quantized_nbytes(100, spec)) // 8) * 8  # raw bf16, then codes
    stored = torch.zeros(codec.nbytes, dtype=torch.uint8)
    codec.encode(values, stored)
    out = torch.empty(112, dtype=torch.bfloat16)
    codec.decode(stored, out)
    assert torch.equal(out[100:], values[100:])
    codes, scale, offset = quantize(values[:100], spec)
    assert torch.equal(out[:100], dequantize(codes, scale, offset, spec, 100, torch.bfloat16))
    before = stored.clone()
    changed = values.clone()
    changed[:100] += 1
    changed[100:110] = 7
    codec.encode(changed, stored, only={1})  # the bias changes, the quantized weight is kept as stored
    codec.decode(stored, out)
    assert torch.equal(out[100:110], changed[100:110])
    assert torch.equal(stored[24:], before[24:])  # the weight's constants and codes: byte for byte


# ------------------------------------------------------------------------------------------ the config
def test_config_keys_defaults_and_refusals():
    wq = load_config({"weight_quantization": {"quantized_initialization": {}}}).weight_quantization
    assert wq.enabled and wq.quantized_initialization == WeightQuantSpec(8, 64, 1, False)
    assert not load_config({"weight_quantization": {}}).weight_quantization.enabled
    post = {"post_init_quant": {"mlp": {"num_bits": 4, "group_size": 32, "symmetric": True}}}
    cfg = load_config({"weight_quantization": post})
    assert cfg.weight_quantization.post_init_quant == {"mlp": WeightQuantSpec(4, 32, 1, True)}
    assert load_config(cfg.to_dict()) == cfg
    bad = [
        ({"quantized_initialization": {"num_bits": 3}}, "num_bits .*must be 8 or 4"),
        ({"quantized_initialization": {"num_bits": 4, "group_size": 63}}, "group_size .*must be even"),
        ({"quantized_initialization": {"group_dim": 0}}, "group_dim 0 .*not supported"),
        ({"quantized_initialization": {"group": 64}}, "unknown key 'weight_quantization.quantized_init"),
        ({"quantized_initialization": {}, "post_init_quant": {"fc": {}}}, "not both"),
        ({"post_init_quant": {}}, "at least one module-name"),
        ({"post_init_quantization": {"fc": {}}}, "did you mean 'post_init_quant'"),
    ]
    for section, match in bad:
        with pytest.raises(ConfigError, match=match):
            load_config({"weight_quantization": section})


def test_training_engine_and_stages_below_3_refuse(tmp_path):
    cfg = config("cpu", tmp_path, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    with pytest.raises(ConfigError, match="cannot be trained: remove the 'optimizer' block"):
        zero.initialize(model=llama(), config=cfg)
    with pytest.raises(ConfigError, match="cannot be trained"):  # a client optimizer too
        model = llama()
        opt = torch.optim.AdamW(model.parameters())
        zero.initialize(model=model, config=config("cpu", tmp_path), optimizer=opt)
    cfg = config("cpu", tmp_path)
    cfg["zero_optimization"] = {"stage": 2}
    with pytest.raises(ConfigError, match="needs zero_optimization.stage 3, got 2"):
        zero.initialize(model=llama(), config=cfg)


def test_model_built_under_zero_init_is_refused_with_a_way_out(tmp_path):
    cfg = config("nvme", tmp_path)
    plain = dict(cfg, weight_quantization={})
    with zero.Init(config=plain):
        model = llama()
    with pytest.raises(ConfigError, match="partitioned without it .*zero.from_pretrained"):
        zero.initialize(model=model, config=cfg)


def test_post_init_quant_selects_modules_by_name(tmp_path):
    model = llama()
    cfg = config("cpu", tmp_path)
    cfg["weight_quantization"] = {"post_init_quant": {"mlp": {"num_bits": 4}}}
    engine, *_ = zero.initialize(model=copy.deepcopy(model), config=cfg)
    mlp = [m for n, m in model.named_modules() if "mlp" in n and isinstance(m, torch.nn.Linear)]
    q = engine.layout.quantization()
    assert q["units"] == len(mlp) == 6 and q["quantized_numel"] == sum(m.weight.numel() for m in mlp)
    ref = model
    with torch.no_grad():
        for m in [m for n, m in ref.named_modules() if "mlp" in n and isinstance(m, torch.nn.Linear)]:
            codes, scale, offset = quantize(m.weight.reshape(-1), WeightQuantSpec(num_bits=4))
            m.weight.copy_(dequantize(codes, scale, offset, WeightQuantSpec(num_bits=4), m.weight.numel(),
                                      torch.float32).view_as(m.weight))  # fmt: skip
        assert_fp32_close(engine(prompt()).logits, ref(prompt()).logits)
    engine.close()
    cfg["weight_quantization"] = {"post_init_quant": {"mlp": {}, "up_proj": {}}}
    with pytest.raises(ConfigError, match="'model.layers.0.mlp.up_proj' matches the keys 'mlp' and 'up_"):
        zero.initialize(model=llama(), config=cfg)
    assert not os.listdir(tmp_path)


# ------------------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_engine_computes_with_the_dequantized_weights(tmp_path, arch, bits, tier):
    """Logits and greedy generation equal Hugging Face's with the quantize-dequantize weights, bit for bit;
    against the unquantized model the max relative logit error is within the documented bound."""
    model = BUILDERS[arch]()
    exact = copy.deepcopy(model)
    ref = fake_quantized(model, WeightQuantSpec(num_bits=bits))
    ids = prompt()
    engine, *_ = zero.initialize(model=model, config=config(tier, tmp_path, bits))
    q = engine.layout.quantization()
    weights = {id(m.weight) for m in exact.modules() if is_quantized_module(m)}  # GPT-2's head: tied
    assert q["units"] == len(weights)
    engine.partitioner.take_io_report()
    with torch.enable_grad():  # a gather that decodes the weights: bit for bit
        assert torch.equal(engine(ids).logits, ref(ids).logits)
    assert engine.partitioner.take_io_report().quantized_matmuls == 0
    with torch.no_grad():  # an inference forward: the Linears compute from the codes (fused.py)
        got = engine(ids).logits
        assert_fp32_close(got, ref(ids).logits)
        want = exact(ids).logits
    io = engine.partitioner.take_io_report()
    assert io.quantized_matmuls == fused_linears(model)
    assert io.quantized_block_matmuls == conv1ds(model)  # 12 rows: the Linears take the register kernel
    assert torch.equal(generate(engine.module, ids), generate(ref, ids))
    rel = float((got - want).abs().max() / want.abs().max())
    assert 0 < rel <= REL_LOGIT_BOUND[bits]
    engine.close()
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("bits", [8, 4])
def test_int8_activations_stay_within_the_documented_error(tmp_path, bits):
    """zero_offload.int8_activations on the tiny Llama: every Linear computes from the codes with rounded
    activations (its logits differ from the fp32-activation ones by more than fp32 rounding), and the max
    relative logit error against the unquantized model stays within the same documented bound."""
    model = llama()
    exact = copy.deepcopy(model)
    ref = fake_quantized(model, WeightQuantSpec(num_bits=bits))
    ids = prompt()
    engine, *_ = zero.initialize(
        model=model, config=config("cpu", tmp_path, bits, zero_offload={"int8_activations": True})
    )
    engine.partitioner.take_io_report()
    with torch.no_grad():
        got = engine(ids).logits
        dequantized = ref(ids).logits
        want = exact(ids).logits
    assert engine.partitioner.take_io_report().quantized_matmuls == fused_linears(model)
    assert float((got - dequantized).abs().max()) > 1e-4 * float(dequantized.abs().max())
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel <= REL_LOGIT_BOUND[bits]
    engine.close()


def expected_stored_bytes(model, bits, group=64):
    """The size formula of docs/inference.md, per module: each quantized weight ceil(n/g) groups of g * bits
    / 8 bytes of codes and two float16 constants; every other parameter 4 bytes (fp32) per element; each
    module's partition rounded up to 8 bytes."""
    total, quantized = 0, 0
    seen = set()
    for m in model.modules():
        own = [p for p in m._parameters.values() if p is not None and id(p) not in seen]
        seen.update(id(p) for p in own)
        if not own:
            continue
        nbytes = 0
        for name, p in m._parameters.items():
            if p is None or not any(p is o for o in own):
                continue
            if name == "weight" and is_quantized_module(m):
                groups = -(-p.numel() // group)
                nbytes += groups * group * bits // 8 + 2 * 2 * groups
            else:
                nbytes += p.numel() * 4
        nbytes = -(-nbytes // 8) * 8
        total += nbytes
        quantized += nbytes if is_quantized_module(m) else 0
    return total, quantized


@pytest.mark.parametrize("bits", [8, 4])
def test_report_shows_the_quantized_bytes_read_per_forward(tmp_path, bits):
    """Untied Llama, every partition on NVMe, one forward: every module's partition is read once, and the
    report's NVMe bytes are the size formula's - about 4x (int8) or 7x (int4) fewer than fp32. On the cpu
    tier the report's host bytes are the quantized modules' (the others' partitions serve as the weights
    in place)."""
    model = llama()
    total, quantized = expected_stored_bytes(model, bits)
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    engine, *_ = zero.initialize(model=copy.deepcopy(model), config=config("nvme", tmp_path, bits))
    assert engine.nvme_bytes >= total and engine.layout.quantization()["stored_bytes"] == total
    engine.partitioner.take_io_report()
    with torch.no_grad():
        engine(prompt())
    io = engine.partitioner.take_io_report()
    assert io.param_reads == len(engine.partitioner.units)
    assert io.param_nvme_read_bytes == total
    assert fp32 / total > (3.5 if bits == 8 else 6.0)
    engine.close()
    engine, *_ = zero.initialize(model=copy.deepcopy(model), config=config("cpu", tmp_path, bits))
    engine.partitioner.take_io_report()
    with torch.no_grad():
        engine(prompt())
    io = engine.partitioner.take_io_report()
    assert io.param_cpu_read_bytes == quantized and io.param_nvme_read_bytes == 0
    engine.close()


def test_bf16_engine_dequantizes_into_bf16(tmp_path):
    model = llama()
    ref = fake_quantized(model.to(torch.bfloat16), WeightQuantSpec(num_bits=4))
    engine, *_ = zero.initialize(model=model, config=config("nvme", tmp_path, 4, bf16={"enabled": True}))
    assert engine.dtype == torch.bfloat16
    with torch.enable_grad():
        assert torch.equal(engine(prompt()).logits, ref(prompt()).logits)
    with torch.no_grad():  # from the codes, each weight rounded to bf16 as the decode rounds it
        got, want = engine(prompt()).logits.float(), ref(prompt()).logits.float()
    assert engine.partitioner.take_io_report().quantized_matmuls > 0
    assert float((got - want).abs().max()) <= 2**-7 * float(want.abs().max())  # bf16 output rounding
    engine.close()


# ------------------------------------------------------------------------------------- from_pretrained
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """gpt2: 12 kB shards, so some modules' weight and bias lie in two files; llama: sharded, untied."""
    root = tmp_path_factory.mktemp("qckpts")
    out = {}
    for arch, shard in (("gpt2", 12_000), ("llama", 40_000)):
        BUILDERS[arch]().save_pretrained(root / arch, max_shard_size=shard)
        out[arch] = str(root / arch)
    return out


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_from_pretrained_quantizes_as_it_streams(ckpts, tmp_path, arch, tier):
    """The loaded engine stores the same codes as wrapping the transformers-loaded model: logits and
    generation identical (a module split over two shards is encoded once per parameter, never twice)."""
    path = ckpts[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    d1, d2 = tmp_path / "a", tmp_path / "b"
    d1.mkdir(), d2.mkdir()
    wrapped, *_ = zero.initialize(model=hf, config=config(tier, d1, 4))
    loaded = zero.from_pretrained(path, config=config(tier, d2, 4))
    assert loaded.layout.quantization() == wrapped.layout.quantization()
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, wrapped(ids).logits)
    assert torch.equal(generate(loaded.module, ids), generate(wrapped.module, ids))
    loaded.close(), wrapped.close()
    assert not os.listdir(d1) and not os.listdir(d2)


def test_from_pretrained_with_an_optimizer_block_refuses_before_reading(ckpts, tmp_path):
    cfg = config("nvme", tmp_path, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    with pytest.raises(ConfigError, match="cannot be trained"):
        zero.from_pretrained(ckpts["llama"], config=cfg)
    assert not os.listdir(tmp_path)


def _two_rank_quantized(rank, world_size, nvme_dir, out_dir):
    from pathlib import Path

    model = llama()
    exact = copy.deepcopy(model)
    engine, *_ = zero.initialize(model=model, config=config("nvme", Path(nvme_dir), 8))
    engine.partitioner.take_io_report()
    with torch.no_grad():
        got, want = engine(prompt()).logits, exact(prompt()).logits
    io = engine.partitioner.take_io_report()
    q = engine.layout.quantization()
    tokens = generate(engine.module, prompt())
    engine.close()
    return float((got - want).abs().max() / want.abs().max()), tokens, io.param_nvme_read_bytes, q


@pytest.mark.slow  # two spawned processes importing transformers
def test_two_ranks_read_their_quantized_halves(tmp_path):
    """Two gloo ranks: each encodes its half of every partition, reads only that (the stored bytes of its
    half) and all-gathers the decoded values; both ranks compute the same logits and tokens, within the
    int8 bound of the unquantized model."""
    from dist_helpers import run_on_ranks

    results, _ = run_on_ranks(_two_rank_quantized, tmp_path)
    (rel0, tok0, read0, q0), (rel1, tok1, read1, q1) = results
    assert rel0 == rel1 and 0 < rel0 <= REL_LOGIT_BOUND[8] and torch.equal(tok0, tok1)
    assert read0 == q0["stored_bytes"] and read1 == q1["stored_bytes"]
    assert q0["stored_bytes"] + q1["stored_bytes"] < q0["unquantized_bytes"] * 2 / 3.5
