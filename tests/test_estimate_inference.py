"""`ds-estimate-memory --inference` (offload/estimate/inference.py) against what the inference engine
allocates for a tiny Llama: the NVMe swap bytes, the pinned staging buffers (the engine's pinned pool), the
partitions in pinned host memory on the cpu tier and under max_in_cpu, the gathered weights on the device
(the stage-3 report's peak) and the KV cache (the cache tensors' actual sizes after a forward)."""

from __future__ import annotations

import json

import pytest
import torch

import zero
from offload.cli import estimate_memory
from offload.estimate.errors import EstimateInputError
from offload.estimate.inference import (
    InferenceSetup,
    estimate_inference,
    kv_cache_shape,
    unit_numels,
)
from offload.estimate.setup import SwapBufferSettings

transformers = pytest.importorskip("transformers")

CFG = dict(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
BATCH, SEQ = 3, 11


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()


def engine_for(tmp, tier, **off):
    section = {"device": tier, "pin_memory": True, **off}
    if tier == "nvme":
        section["nvme_path"] = str(tmp)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": section}}
    model = llama()
    engine, *_ = zero.initialize(model=model, config=cfg)
    return model, engine


def setup_for(model, tier, **buffers):
    return InferenceSetup(
        units=tuple(unit_numels(model)),
        precision="fp32",
        offload_param=tier,
        buffers=SwapBufferSettings(**buffers),
        batch_size=BATCH,
        seq_len=SEQ,
        kv=kv_cache_shape(CFG),
    )


def run_forward(engine):
    ids = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    engine.partitioner.take_io_report()
    with torch.no_grad():
        out = engine.module(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    kv_bytes = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    return kv_bytes, engine.partitioner.take_io_report().peak_full_bytes


@pytest.mark.parametrize("buffer_count", [2, 3])
def test_nvme_rows_equal_the_engine(tmp_path, buffer_count):
    model = llama()
    est = estimate_inference(
        setup_for(model, "nvme", param_max_in_cpu=0, param_buffer_count=buffer_count, param_buffer_size=1000)
    )
    _, engine = engine_for(tmp_path, "nvme", max_in_cpu=0, buffer_count=buffer_count, buffer_size=1000)
    assert est.rows["weights"]["nvme"] == engine.nvme_bytes > 0
    assert est.rows["weights"]["cpu"] == 0
    # the staging buffers are all the engine pins: buffer_count x min(buffer_size, largest partition)
    assert est.rows["prefetch buffers"]["cpu_pinned"] == engine.pinned_bytes == buffer_count * 1000 * 4
    kv_bytes, peak = run_forward(engine)
    assert est.rows["KV cache"]["device"] == kv_bytes
    assert est.rows["gathered weights"]["device"] == peak
    engine.close()


def test_cpu_tier_and_max_in_cpu_rows_equal_the_engine(tmp_path):
    model = llama()
    est = estimate_inference(setup_for(model, "cpu"))
    _, engine = engine_for(tmp_path, "cpu")
    assert est.rows["weights"]["cpu_pinned"] == engine.pinned_bytes
    assert est.rows["weights"]["cpu_pinned"] == sum(p.numel() * 4 for p in model.parameters())
    assert "prefetch buffers" not in est.rows and est.total("nvme") == 0
    kv_bytes, peak = run_forward(engine)
    assert est.rows["KV cache"]["device"] == kv_bytes and est.rows["gathered weights"]["device"] == peak
    engine.close()

    units = unit_numels(model)
    max_in_cpu = units[0] + units[1] + 5  # splits the model: the first partition and a spread of others
    est = estimate_inference(setup_for(model, "nvme", param_max_in_cpu=max_in_cpu))
    _, engine = engine_for(tmp_path, "nvme", max_in_cpu=max_in_cpu)
    assert 0 < est.rows["weights"]["cpu"] <= max_in_cpu * 4
    assert est.rows["weights"]["nvme"] == engine.nvme_bytes
    assert est.total("cpu_pinned") == engine.pinned_bytes  # in-cpu partitions + staging buffers
    engine.close()


def test_quantized_and_kv_formulas():
    setup = InferenceSetup(
        units=(4096, 64), precision="bf16", offload_param="cpu", weight_bits=4, group_size=64
    )
    est = estimate_inference(setup)
    assert est.rows["weights"]["cpu"] == (4096 // 2 + 64 * 4) + (32 + 4)
    shape = kv_cache_shape({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096})
    assert (shape.num_kv_heads, shape.head_dim) == (32, 128)
    assert shape.numel(4, 2048) * 2 == 4 * 2**30  # Llama-2-7B: 4 sequences of 2048 positions, fp16
    with pytest.raises(EstimateInputError, match="num_attention_heads"):
        kv_cache_shape({"num_hidden_layers": 2})
    with pytest.raises(EstimateInputError, match="weight bits"):
        InferenceSetup(units=(10,), weight_bits=3)


def test_cli_inference_flag(tmp_path, capsys):
    transformers.LlamaConfig(**CFG).save_pretrained(tmp_path)
    cfg = tmp_path / "ds.json"
    cfg.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "max_in_cpu": 0}},
                "weight_quantization": {"quantized_initialization": {"num_bits": 8, "group_size": 32}},
            }
        )
    )
    argv = ["--inference", "--model", str(tmp_path), "--config", str(cfg), "--precision", "fp32"]
    out = json.loads(
        estimate_memory.run(argv + ["--batch-size", str(BATCH), "--seq-len", str(SEQ), "--json"])
    )
    (row,) = out["rows"]
    want = estimate_inference(
        InferenceSetup(
            units=tuple(unit_numels(llama())),
            precision="fp32",
            offload_param="nvme",
            buffers=SwapBufferSettings(param_max_in_cpu=0),
            weight_bits=8,
            group_size=32,
            batch_size=BATCH,
            seq_len=SEQ,
            kv=kv_cache_shape(CFG),
        )
    )
    assert row["rows"] == want.rows and row["options"].startswith("offload_param=nvme")
    text = estimate_memory.run(argv)
    assert "prefetch buffers" in text and "KV cache: not counted" in text
    assert estimate_memory.main(argv + ["--offload-optimizer", "cpu"]) == 2
    assert "no optimizer" in capsys.readouterr().err
