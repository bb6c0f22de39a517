"""ZeRO-Inference on a CUDA device: generation with the weights in host memory or on NVMe, the host
partitions copied to the GPU ahead of their use on a side stream. Skipped on machines without CUDA
(tests/test_read_ahead.py drives the same store calls on the CPU)."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import engine_for, host_units, llama

pytestmark = pytest.mark.parametrize("device", ["cuda"], indirect=True)

NEW_TOKENS = 6


def generate(model, ids, **kwargs):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_generation_reads_host_partitions_ahead(tmp_path, tier, device):
    """Greedy tokens equal transformers' on the same GPU; from the second forward on every host partition
    was copied ahead (a prefetch hit), and every weight byte crossed to the device once per forward."""
    ref = llama().to(device)
    engine = engine_for(tmp_path, tier)
    part = engine.partitioner
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        want = generate(ref, ids)
        engine.inference_report()
        got = generate(engine.module, ids)
        report = engine.inference_report()
    assert torch.equal(got, want)
    host = host_units(part.store, part.units)
    assert report.forwards == NEW_TOKENS
    assert report.param_prefetch_hits >= (NEW_TOKENS - 1) * len(host)
    assert report.host_to_device_bytes == NEW_TOKENS * sum(u.part_nbytes for u in part.units)
    assert part.store.read_ahead_device == engine.device
    engine.close()


def test_training_forward_copies_when_gathered(tmp_path, device):
    """With grad mode on (a training forward) nothing is copied ahead: the host partitions are copied
    when gathered, and the logits equal transformers'."""
    ref = llama().to(device)
    engine = engine_for(tmp_path, "cpu")
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(2):
        got = engine.module(ids).logits
    torch.testing.assert_close(got, ref(ids).logits, rtol=0, atol=1e-5)
    assert engine.partitioner.store.read_ahead_device is None
    assert engine.inference_report().param_prefetches == 0
    engine.close()


def test_kv_cache_in_host_memory(tmp_path, device):
    """transformers' offloaded KV cache (`cache_implementation="offloaded"`) through the engine: the
    tokens of the default cache and of transformers with the same option."""
    ref = llama().to(device)
    engine = engine_for(tmp_path, "cpu")
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        want = generate(ref, ids)
        assert torch.equal(generate(ref, ids, cache_implementation="offloaded"), want)
        assert torch.equal(generate(engine.module, ids, cache_implementation="offloaded"), want)
    engine.close()
