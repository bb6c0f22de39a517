"""Streaming forwards of an engine without an optimizer (docs/inference.md, "Streaming and prefetch" and
"Throughput"): with the weights on NVMe, `engine.inference_report()` counts every forward of a greedy
generation, the tokens it processed and exactly the model's weight bytes read per forward; nothing is ever
written back; the reads are prefetched (the first forward's in a guessed order),
`offload_param.buffer_count` deep, and `stage3_prefetch_bucket_size` 0 turns that off; generation stays
token-identical to plain transformers."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from stream_helpers import BATCH, NEW_TOKENS, PROMPT, VOCAB, llama, transformers

import zero
from zero.stage3.trace import PREFETCH_LOOKAHEAD


def config(tmp, **zero_extra):
    off = {"device": "nvme", "nvme_path": str(tmp), "max_in_cpu": 0, **zero_extra.pop("offload_param", {})}
    return {
        "train_micro_batch_size_per_gpu": 1,
        # threshold 0: no unit stays gathered between forwards, every forward streams every weight
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": off,
            **zero_extra,
        },
    }


def prompt():
    return torch.randint(3, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))


def generate(model, ids):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )


def weight_bytes(model):
    """The model's distinct parameters' bytes: what one forward must stream from the tier."""
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))


def test_report_counts_forwards_tokens_and_exactly_the_weight_bytes(tmp_path):
    model = llama()
    ref = copy.deepcopy(model)
    want_bytes = weight_bytes(model)
    ids = prompt()
    with torch.no_grad():
        want = generate(ref, ids)
    engine, *_ = zero.initialize(model=model, config=config(tmp_path))
    assert engine.inference_report().forwards == 0  # building is not counted
    got = generate(engine.module, ids)
    rep = engine.inference_report(read_ceiling_gbs=2.0)
    assert torch.equal(got, want)
    # generate: one forward over the prompt, then one per further new token, each over one position per row
    assert rep.forwards == NEW_TOKENS
    assert rep.tokens == BATCH * PROMPT + BATCH * (NEW_TOKENS - 1)
    assert rep.nvme_read_bytes == rep.forwards * want_bytes
    assert rep.nvme_read_bytes_per_forward == want_bytes
    assert rep.nvme_write_bytes == 0  # weights are read-only in inference
    units = len(engine.partitioner.units)
    assert rep.param_reads == rep.gathers == rep.forwards * units
    # the first forward records the order, its reads prefetched in the order the modules were built (a
    # guess: a few are on demand); every later read was prefetched
    assert rep.param_reads - units < rep.param_prefetch_hits < rep.param_reads
    assert rep.host_to_device_bytes == 0  # the compute device is the CPU
    assert rep.forward_s > 0 and rep.tokens_per_s == rep.tokens / rep.forward_s
    assert rep.s_per_forward == rep.forward_s / rep.forwards
    assert rep.nvme_read_gbps == rep.nvme_read_bytes / rep.forward_s / 1e9
    assert rep.read_ceiling_fraction == rep.nvme_read_gbps / 2.0 and rep.read_ceiling_source == "argument"
    d = rep.as_dict()
    assert d["tokens"] == rep.tokens and d["nvme_read_bytes_per_forward"] == want_bytes
    assert "tokens/s" in rep.format()
    again = engine.inference_report()  # counts start afresh
    assert again.forwards == again.tokens == again.nvme_read_bytes == again.param_reads == 0
    assert again.read_ceiling_gbs is None and again.read_ceiling_fraction is None
    engine.close()


LAYERS = 10  # 9 units a layer: more units than one window of guesses (PREFETCH_LOOKAHEAD)


def test_first_forward_prefetches_past_units_never_read(tmp_path):
    """The first forward has no recorded order: it prefetches in build order, stepping over units already
    used or not on NVMe, so a model of more units than one window of guesses, with persistent norms used
    out of build order, is streamed with every read but the first prefetched."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )
    ).eval()  # fmt: skip
    cfg = config(tmp_path, stage3_param_persistence_threshold=64)  # the norms (32 elements) persist
    engine, *_ = zero.initialize(model=model, config=cfg)
    units = engine.partitioner.units
    assert len(units) > PREFETCH_LOOKAHEAD and any(u.persistent for u in units)
    with torch.no_grad():
        engine.module(prompt())
    rep = engine.inference_report()
    engine.close()
    assert rep.param_reads == len(units)  # each read once (the persistent ones stay gathered after it)
    # On demand: the first unit (the embedding), and each layer's input norm and the final norm, which run
    # before the units built ahead of them; every other read was prefetched.
    assert rep.param_prefetch_hits >= rep.param_reads - 1 - (LAYERS + 1)


@pytest.mark.parametrize("buffer_count", [2, 4])
def test_prefetch_depth_is_buffer_count(tmp_path, buffer_count):
    """The units read ahead of the one computing: as many as there are staging slots when the prefetch
    bucket holds them; bucket 0: no prefetch, the same bytes read on demand."""
    ids = prompt()
    reports = {}
    for bucket in (10**9, 0):
        engine, *_ = zero.initialize(
            model=llama(),
            config=config(
                tmp_path,
                offload_param={"buffer_count": buffer_count},
                stage3_prefetch_bucket_size=bucket,
            ),
        )
        tokens = generate(engine.module, ids)
        reports[bucket] = (tokens, engine.inference_report())
        engine.close()
    (tokens_on, on), (tokens_off, off) = reports[10**9], reports[0]
    assert torch.equal(tokens_on, tokens_off)
    assert on.peak_prefetch_depth == buffer_count and on.param_prefetches > 0
    assert off.peak_prefetch_depth == 0 and off.param_prefetches == off.param_prefetch_hits == 0
    assert on.nvme_read_bytes == off.nvme_read_bytes and on.param_reads == off.param_reads
    # every read on demand is waited for; the waits are part of the forwards' time
    assert 0 < off.read_wait_s <= off.forward_s and 0 <= on.read_wait_s <= on.forward_s


def test_bucket_bounds_the_depth(tmp_path):
    """A bucket of one MLP projection's elements: never two of them in flight at once."""
    model = llama()
    proj = model.model.layers[0].mlp.gate_proj.weight.numel()
    engine, *_ = zero.initialize(
        model=model,
        config=config(tmp_path, offload_param={"buffer_count": 8}, stage3_prefetch_bucket_size=proj),
    )
    generate(engine.module, prompt())
    rep = engine.inference_report()
    big = [u for u in engine.partitioner.units if u.numel >= proj]
    assert len(big) > 2 and 1 <= rep.peak_prefetch_depth < 8
    engine.close()


def test_read_ceiling_from_a_machine_profile(tmp_path):
    profile = tmp_path / "machine.json"
    profile.write_text(json.dumps({"nvme_read_gbps": 3.5}))
    engine, *_ = zero.initialize(model=llama(), config=config(tmp_path))
    generate(engine.module, prompt())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nvme_read_gbps": None}))
    with pytest.raises(ValueError, match="bad.json"):
        engine.inference_report(machine_profile=str(bad))
    with pytest.raises(ValueError, match="positive"):
        engine.inference_report(read_ceiling_gbs=-1.0)
    rep = engine.inference_report(machine_profile=str(profile))  # the failed calls took nothing
    assert rep.forwards == NEW_TOKENS and rep.read_ceiling_gbs == 3.5
    assert "ds-nvme-bench" in rep.read_ceiling_source
    assert rep.read_ceiling_fraction == rep.nvme_read_gbps / 3.5
    engine.close()


def test_stage0_counts_forwards_without_bytes_and_training_engines_refuse(tmp_path):
    engine, *_ = zero.initialize(model=llama(), config={"train_micro_batch_size_per_gpu": 1})
    with torch.no_grad():
        engine(prompt())
        engine.module(input_ids=prompt()[:1])
    rep = engine.inference_report()
    assert rep.forwards == 2 and rep.tokens == BATCH * PROMPT + PROMPT and rep.nvme_read_bytes == 0
    engine.close()
    opt = {"type": "AdamW", "params": {"lr": 1e-3}}
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": opt}
    trainer, *_ = zero.initialize(model=llama(), config=cfg)
    with pytest.raises(RuntimeError, match="last_report"):
        trainer.inference_report()
    trainer.close()
