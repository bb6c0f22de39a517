"""Weights streamed from NVMe are used where their read landed when the CPU computes (docs/inference.md,
"Streaming and prefetch"; zero/stage3/store.py, `lend`): the parameters view the staging slot, which is
refilled only after the unit is released and nothing else references it. Generation stays token-identical
to plain transformers for every buffer_count, the partitioner's io report says which bytes were used in
place, copied out of a slot or read straight into a gathered buffer, and a slot still viewed from outside
is never refilled."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import zero
from offload.aio import AioError

transformers = pytest.importorskip("transformers")

from stream_helpers import BATCH, NEW_TOKENS, PROMPT, VOCAB, llama  # noqa: E402


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=3, n_head=4, bos_token_id=1, eos_token_id=2
        )
    ).eval()


BUILDERS = {"gpt2": gpt2, "llama": llama}


def config(tmp, buffer_count, **off_extra):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            # persistence 0: every unit is read from NVMe for every forward; a bucket that holds every unit
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 10**9,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(tmp),
                "max_in_cpu": 0,
                "buffer_count": buffer_count,
                **off_extra,
            },
        },
    }


def prompt(seed=1):
    return torch.randint(3, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(seed))


def generate(model, ids):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize(
    "arch,buffer_count", [("gpt2", 2), ("gpt2", 5), ("llama", 2), ("llama", 3), ("llama", 4), ("llama", 5)]
)
def test_generation_in_place_is_token_identical(tmp_path, arch, buffer_count):
    """Three generations (24 forwards) and a full forward: tokens and logits equal plain transformers'; every
    byte read from NVMe was used in its staging slot, none copied out of one."""
    model = BUILDERS[arch]()
    ref = copy.deepcopy(model)
    engine, *_ = zero.initialize(model=model, config=config(tmp_path, buffer_count))
    part = engine.partitioner
    with torch.no_grad():
        engine.module(prompt(0))  # records the order of uses
    part.take_io_report()
    for seed in (1, 2, 3):
        ids = prompt(seed)
        with torch.no_grad():
            want = generate(ref, ids)
        assert torch.equal(generate(engine.module, ids), want)
    with torch.no_grad():
        ids = prompt(4)
        assert torch.equal(engine.module(ids).logits, ref(ids).logits)
    io = part.take_io_report()
    assert io.param_nvme_read_bytes > 0
    assert io.param_in_place_bytes == io.param_nvme_read_bytes
    assert io.param_staged_bytes == io.param_direct_bytes == 0
    assert part.store.stats.slots_replaced == 0
    # once the order is known, every read was prefetched (the first units of a forward too), as deep as
    # the slots go
    assert io.param_prefetch_hits == io.param_reads
    assert io.peak_prefetch_depth == buffer_count
    engine.close()


def test_grad_mode_copies_out_of_the_slot(tmp_path):
    """With grad enabled the autograd graph may keep views of the weights past their module: the partition
    is copied out of its slot instead (the results are the same)."""
    model = llama()
    ref = copy.deepcopy(model)
    engine, *_ = zero.initialize(model=model, config=config(tmp_path, 2))
    part = engine.partitioner
    ids = prompt()
    engine.module(ids)  # records the order
    part.take_io_report()
    out = engine.module(ids).logits
    io = part.take_io_report()
    assert torch.equal(out, ref(ids).logits)
    assert io.param_staged_bytes == io.param_nvme_read_bytes > 0
    assert io.param_in_place_bytes == 0
    engine.close()


def test_partition_larger_than_a_slot_is_prefetched_in_pieces(tmp_path):
    """buffer_size below the embedding's and the head's partitions (two slots each): once the order is
    known, both are prefetched in pieces into two slots and copied out of them, every read a prefetch
    hit; the other units are used in place; tokens unchanged."""
    model = llama()
    ref = copy.deepcopy(model)
    big = {id(m.weight): m.weight.numel() * 4 for m in (model.model.embed_tokens, model.lm_head)}
    engine, *_ = zero.initialize(model=model, config=config(tmp_path, 3, buffer_size=64 * 32))
    part = engine.partitioner
    ids = prompt()
    with torch.no_grad():
        want = generate(ref, ids)
        engine.module(ids)  # records the order of uses
    part.take_io_report()
    assert torch.equal(generate(engine.module, ids), want)
    io = part.take_io_report()
    assert io.param_staged_bytes == NEW_TOKENS * sum(big.values()) and io.param_direct_bytes == 0
    assert io.param_in_place_bytes == io.param_nvme_read_bytes - io.param_staged_bytes > 0
    assert io.param_prefetch_hits == io.param_reads
    engine.close()


def test_partition_larger_than_every_slot_together_is_read_straight_into_its_buffer(tmp_path):
    """One slot, smaller than the embedding's and the head's partitions: those are read on demand straight
    into their gathered buffers (no staging copy), the others in place; tokens unchanged."""
    model = llama()
    ref = copy.deepcopy(model)
    big = {id(m.weight): m.weight.numel() * 4 for m in (model.model.embed_tokens, model.lm_head)}
    engine, *_ = zero.initialize(model=model, config=config(tmp_path, 1, buffer_size=64 * 32))
    part = engine.partitioner
    part.take_io_report()
    ids = prompt()
    with torch.no_grad():
        want = generate(ref, ids)
    assert torch.equal(generate(engine.module, ids), want)
    io = part.take_io_report()
    assert io.param_direct_bytes == NEW_TOKENS * sum(big.values())
    assert io.param_in_place_bytes == io.param_nvme_read_bytes - io.param_direct_bytes > 0
    assert io.param_staged_bytes == 0
    engine.close()


@pytest.mark.parametrize("which,keep", [("lm_head", 8192), ("lm_head", 0), ("q_proj", 0)])
def test_a_refused_read_raises_and_no_slot_keeps_stale_bytes(tmp_path, which, keep):
    """A swap file cut short after the order is known (the head: in pieces, its second piece or both past
    the end; a projection: one slot): the forward raises AioError naming the file; with the file whole
    again, the next forward's logits are exact - no slot passed for holding the unit."""
    model = llama()
    ref = copy.deepcopy(model)
    engine, *_ = zero.initialize(model=model, config=config(tmp_path, 3, buffer_size=64 * 32))
    module = model.lm_head if which == "lm_head" else model.model.layers[1].self_attn.q_proj
    path = engine.partitioner.store.swap_file(module.weight.ds_unit)
    ids = prompt()
    with torch.no_grad():
        want = ref(ids).logits
        assert torch.equal(engine.module(ids).logits, want)  # records the order of uses
        with open(path, "rb") as f:
            data = f.read()
        os.truncate(path, keep)
        with pytest.raises(AioError, match=os.path.basename(path)):
            engine.module(ids)
        with open(path, "r+b") as f:
            f.write(data)
        for _ in range(2):
            assert torch.equal(engine.module(ids).logits, want)
    engine.close()


class _WeightView(nn.Module):
    """Returns a view of its own weight: the caller uses it after this module's weights were released."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight[:8]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _WeightView()
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.a(x)  # a view of a's weight, alive while b, c and d are read into the slots
        y = self.d(self.c(self.b(x)))
        return y @ w.t() + w.sum()


@pytest.mark.parametrize("buffer_count", [2, 3])
def test_slot_still_viewed_is_never_refilled(tmp_path, buffer_count):
    """A module hands out a view of its weight that outlives its release: the slot it views is replaced,
    not refilled, so the view keeps its values through the reads that follow."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    engine, *_ = zero.initialize(model=model, config=config(tmp_path, buffer_count))
    part = engine.partitioner
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = ref(x)
        for _ in range(5):
            assert torch.equal(engine.module(x), want)
    io = part.take_io_report()
    assert io.param_in_place_bytes == io.param_nvme_read_bytes > 0
    assert part.store.stats.slots_replaced == 5  # once per forward: a's slot
    engine.close()


def test_quantized_partition_is_decoded_from_its_slot(tmp_path):
    """int8 weights on NVMe are decoded straight from the staging slot: the same tokens as the same codes
    decoded from host memory (cpu tier), every NVMe byte used in place."""
    quant = {"weight_quantization": {"quantized_initialization": {"num_bits": 8}}}
    ids = prompt()
    engine_cpu, *_ = zero.initialize(
        model=llama(),
        config={
            **config(tmp_path, 2),
            **quant,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
        },
    )
    want = generate(engine_cpu.module, ids)
    engine_cpu.close()
    engine, *_ = zero.initialize(model=llama(), config={**config(tmp_path, 2), **quant})
    engine.partitioner.take_io_report()
    assert torch.equal(generate(engine.module, ids), want)
    io = engine.partitioner.take_io_report()
    assert io.param_in_place_bytes == io.param_nvme_read_bytes > 0
    assert io.param_staged_bytes == 0
    engine.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_first_forward_prefetches_in_build_order(tmp_path, arch):
    """No order is recorded before the first forward: its reads are prefetched in the order the modules
    were built, so most of them are hits already (llama runs its norms before the layers built ahead of
    them: those few are on demand); the outputs are unchanged."""
    model = BUILDERS[arch]()
    ref = copy.deepcopy(model)
    engine, *_ = zero.initialize(model=model, config=config(tmp_path, 3))
    part = engine.partitioner
    part.take_io_report()
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(engine.module(ids).logits, ref(ids).logits)
    io = part.take_io_report()
    misses = io.param_reads - io.param_prefetch_hits
    assert io.param_reads >= len(part.units) and misses <= io.param_reads // 4
    engine.close()


def test_every_slot_lent_refuses_a_device_read(tmp_path):
    """With every staging slot lent out, a read into device memory (which has no direct path) is refused
    naming the unit, before anything is read; reads into host memory go around the slots."""
    engine, *_ = zero.initialize(model=llama(), config=config(tmp_path, 2))
    store, units = engine.partitioner.store, engine.partitioner.units
    lent = [u for u in units if store.lend(u) is not None][:2]
    other = units[-1]
    assert len(lent) == 2 and other not in lent
    with pytest.raises(RuntimeError, match=f"no free staging slot to read {other.name!r}"):
        store.read(other, torch.empty(other.part_numel, dtype=other.dtype, device="meta"))
    host = torch.empty(other.part_numel, dtype=other.dtype)
    store.read(other, host)  # straight into host memory
    for u in lent:
        assert store.give_back(u)
    engine.close()
