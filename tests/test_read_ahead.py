"""Reads ahead from host memory to the compute device (zero/stage3/store.py, zero/stage3/device_copy.py).

In an inference forward on an accelerator the stage-3 store copies the partitions it holds in host memory
(the `cpu` tier, or those kept by `max_in_cpu`) to the device on a side stream before their use, as it
reads NVMe partitions ahead. The partitioner does that by itself when the compute device is not the CPU;
here `partitioner.read_ahead = True` runs the same path on the CPU (each copy then replaces using the
partition in place, and runs synchronously through the same calls), and tests/test_cuda_inference.py runs
the engine on a GPU. The estimator's row for the copies is checked against the engine's peak.
"""

from __future__ import annotations

import copy

import pytest
import torch
from inference_helpers import engine_for, host_units, llama
from torch import nn

from offload.estimate.inference import InferenceSetup, estimate_inference, unit_numels
from zero.stage3.device_copy import SideStream

CPU = torch.device("cpu")


def test_side_stream_on_the_cpu_copies_synchronously():
    side = SideStream()
    src = torch.arange(10, dtype=torch.float32)
    dst = torch.empty(10)
    assert side.copy(dst, src) is None and torch.equal(dst, src)
    ahead, event = side.copy_ahead(src, CPU)
    assert event is None and torch.equal(ahead, src) and ahead.data_ptr() != src.data_ptr()
    assert side.take(ahead, event) is ahead
    side.wait(None)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_host_partitions_are_copied_ahead_and_handed_over(tmp_path, tier):
    """Each host-memory partition prefetched with reads ahead on is a copy of its own, equal to the
    partition; taking it ends the prefetch and counts a hit and its bytes. NVMe partitions keep their
    staging slots; with reads ahead off a host partition is not prefetched at all."""
    engine = engine_for(tmp_path, tier)
    part = engine.partitioner
    store = part.store
    units = host_units(store, part.units)
    assert units and (tier == "cpu") == (len(units) == len(part.units))
    part.take_io_report()
    assert not any(store.prefetchable(u) for u in units)
    assert not store.prefetch(units[0])
    store.read_ahead_device = CPU
    for u in units:
        assert store.prefetchable(u) and store.prefetch(u) and store.prefetching(u)
        assert not store.prefetch(u)  # already ahead
    for u in units:
        mem = store.memory_partition(u)
        got = store.take_ahead(u)
        assert got is not None and torch.equal(got, mem) and got.data_ptr() != mem.data_ptr()
        assert not store.prefetching(u) and store.take_ahead(u) is None
    io = part.take_io_report()
    assert io.param_prefetches == io.param_prefetch_hits == len(units)
    assert io.param_cpu_read_bytes == sum(u.part_nbytes for u in units)
    assert io.peak_prefetch_depth == len(units)
    assert io.param_nvme_read_bytes == 0
    nvme = [u for u in part.units if store.on_nvme(u)]
    for u in nvme:  # NVMe partitions still go through the slots
        assert store.prefetchable(u)
    engine.close()


def test_a_write_drops_the_copy_ahead(tmp_path):
    """A partition written after its copy ahead was queued is never served from the stale copy."""
    engine = engine_for(tmp_path, "cpu")
    part = engine.partitioner
    store = part.store
    u = part.units[0]
    store.read_ahead_device = CPU
    assert store.prefetch(u)
    new = torch.randn(u.part_numel)
    store.write(u, new)
    assert not store.prefetching(u) and store.take_ahead(u) is None
    out = torch.empty(u.part_numel)
    store.read(u, out)
    assert torch.equal(out, new)
    engine.close()


def test_read_consumes_the_copy_ahead(tmp_path):
    """`read` into another buffer is served from the copy ahead (a hit), with the partition's values."""
    engine = engine_for(tmp_path, "cpu")
    part = engine.partitioner
    store = part.store
    u = part.units[1]
    part.take_io_report()
    store.read_ahead_device = CPU
    assert store.prefetch(u)
    out = torch.empty(u.part_numel)
    store.read(u, out)
    assert torch.equal(out, store.memory_partition(u)) and not store.prefetching(u)
    io = part.take_io_report()
    assert io.param_prefetch_hits == 1 and io.param_cpu_read_bytes == u.part_nbytes
    engine.close()


def test_quantized_partitions_are_decoded_from_their_codes_read_ahead(tmp_path):
    """A unit stored quantized is copied ahead as its codes (its stored bytes) and decoded by `read`:
    the same values as a read without the copy ahead."""
    engine = engine_for(tmp_path, "cpu", weight_quantization={"quantized_initialization": {"num_bits": 4}})
    part = engine.partitioner
    store = part.store
    quantized = [u for u in part.units if store.codec(u) is not None]
    assert quantized
    part.take_io_report()
    store.read_ahead_device = CPU
    for u in quantized:
        want = torch.empty(u.part_numel)
        store.read(u, want)  # no copy ahead queued: decoded from the host partition
        assert store.prefetch(u)
        assert store.take_ahead(u) is None  # the codes are not the values
        got = torch.empty(u.part_numel)
        store.read(u, got)
        assert torch.equal(got, want) and not store.prefetching(u)
    io = part.take_io_report()
    assert io.param_prefetch_hits == len(quantized)
    assert io.param_cpu_read_bytes == 2 * sum(store.stored_nbytes(u) for u in quantized)
    engine.close()


def test_close_drops_copies_ahead(tmp_path):
    engine = engine_for(tmp_path, "cpu")
    part = engine.partitioner
    store = part.store
    store.read_ahead_device = CPU
    units = list(part.units)
    assert all(store.prefetch(u) for u in units)
    engine.close()
    assert not any(store.prefetching(u) for u in units)


def test_cpu_inference_forward_does_not_read_ahead(tmp_path):
    """On the CPU the host partitions are used where they lie: an inference forward turns reads ahead off
    and copies nothing (the cpu tier's weights are the partitions themselves)."""
    engine = engine_for(tmp_path, "cpu")
    ref = copy.deepcopy(llama())
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(engine.module(ids).logits, ref(ids).logits)
    io = engine.partitioner.take_io_report()
    assert engine.partitioner.store.read_ahead_device is None
    assert io.param_prefetches == 0 and io.host_to_device_bytes == 0
    engine.close()


def generate(model, ids):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_generation_with_copies_ahead_gives_transformers_tokens(tmp_path, tier):
    """`read_ahead = True` on the CPU: every host partition is copied ahead of its use in each forward
    after the first (the guessed order covers most of the first), used as the gathered weights, and the
    tokens are transformers'."""
    ref = llama()
    engine = engine_for(tmp_path, tier)
    part = engine.partitioner
    part.read_ahead = True
    host = host_units(part.store, part.units)
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = generate(ref, ids)
        engine.module(ids)  # records the order of uses
        engine.inference_report()
        got = generate(engine.module, ids)
        report = engine.inference_report()
    assert torch.equal(got, want)
    io = report.as_dict()
    assert report.forwards == 5
    assert report.param_prefetch_hits >= 5 * len(host)
    assert report.host_to_device_bytes == 0  # the CPU computes: nothing crosses to a device
    assert report.peak_read_ahead_bytes > 0
    assert "copied ahead: at most" in report.format()
    assert io["nvme_read_bytes"] == 5 * sum(u.part_nbytes for u in part.units if part.store.on_nvme(u))
    engine.close()


def test_grad_mode_copies_nothing_ahead(tmp_path):
    """A forward with grad mode on (training) never copies ahead, whatever `read_ahead` says."""
    engine = engine_for(tmp_path, "cpu")
    engine.partitioner.read_ahead = True
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.module(ids)
    io = engine.partitioner.take_io_report()
    assert io.param_prefetches == 0 and io.peak_read_ahead_bytes == 0
    engine.close()


class _Stack(nn.Module):
    """Linears used in build order: the window of units ahead is the same in use and placement order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 40)
        self.hidden = nn.ModuleList(nn.Linear(40, 40) for _ in range(3))
        self.out = nn.Linear(40, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for h in self.hidden:
            x = torch.tanh(h(x))
        return self.out(x)


@pytest.mark.parametrize("bucket", [2000, 3300, 10**6])
def test_estimator_row_is_the_engine_peak(tmp_path, bucket):
    """`ds-estimate-memory --inference`'s "copies ahead (GPU)" row equals the most bytes the engine held
    copied ahead at once, for buckets that end the window inside the model and one that holds it all."""
    model = _Stack()
    setup = InferenceSetup(
        units=tuple(unit_numels(model)),
        precision="fp32",
        offload_param="cpu",
        persistence_threshold=0,
        prefetch_bucket=bucket,
    )
    want = estimate_inference(setup).rows["copies ahead (GPU)"]["device"]
    engine = engine_for(tmp_path, "cpu", model=model, bucket=bucket)
    engine.partitioner.read_ahead = True
    with torch.no_grad():
        for _ in range(3):
            engine.module(torch.randn(2, 16))
    assert engine.partitioner.take_io_report().peak_read_ahead_bytes == want > 0
    engine.close()


def test_a_training_pass_drops_copies_left_ahead(tmp_path):
    """A copy ahead left over from an inference pass is not used by a training pass: the optimizer
    updates the partitions in place (not through `write`), so the training pass gathers from the
    partitions themselves."""
    ref = llama()
    engine = engine_for(tmp_path, "cpu")
    part = engine.partitioner
    store = part.store
    u = next(x for x in part.units if x.name.endswith("q_proj"))
    store.read_ahead_device = CPU
    assert store.prefetch(u)
    with torch.no_grad():
        store.memory_partition(u).add_(0.5)  # as an optimizer step does, in place
        dict(ref.named_modules())[u.name].weight.add_(0.5)
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    got = engine.module(ids).logits  # grad mode on
    assert not store.prefetching(u)
    torch.testing.assert_close(got, ref(ids).logits, rtol=0, atol=0)
    engine.close()


def test_quantized_generation_with_copies_ahead(tmp_path):
    """int4 weights on the cpu tier with `read_ahead = True`: the products read the codes copied ahead
    (every unit a prefetch hit after the first forward) and give the tokens of the same engine without
    copies ahead."""
    wq = {"weight_quantization": {"quantized_initialization": {"num_bits": 4}}}
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    tokens = []
    for ahead in (False, True):
        engine = engine_for(tmp_path, "cpu", **wq)
        engine.partitioner.read_ahead = ahead
        part = engine.partitioner
        with torch.no_grad():
            engine.module(ids)
            part.take_io_report()
            tokens.append(generate(engine.module, ids))
        io = part.take_io_report()
        assert io.param_prefetch_hits == (5 * len(part.units) if ahead else 0)
        assert io.quantized_matmuls > 0  # the products read the codes (the copies, with `read_ahead`)
        engine.close()
    assert torch.equal(tokens[0], tokens[1])


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_reads_into_a_device_buffer(tmp_path, tier):
    """`read(unit, device_buffer(...), fresh=True)` - how a one-rank gather on a GPU reads, into a buffer
    of the copies' side stream - gives the values of a plain read, for raw and quantized units in host
    memory and on NVMe (on the CPU the buffer is a plain one: the same calls)."""
    wq = {"weight_quantization": {"quantized_initialization": {"num_bits": 8}}}
    engine = engine_for(tmp_path, tier, **wq)
    store = engine.partitioner.store
    units = engine.partitioner.units
    assert any(store.codec(u) for u in units) and any(not store.codec(u) for u in units)
    for u in units:
        want = torch.empty(u.part_numel, dtype=u.dtype)
        store.read(u, want)
        got = store.device_buffer(u.part_numel, u.dtype)
        store.read(u, got, fresh=True)
        assert torch.equal(got, want), u.name
    engine.close()


def test_no_room_on_the_device_for_a_copy_ahead_falls_back_to_copying_when_gathered(tmp_path, monkeypatch):
    """A copy ahead that finds the device full (OutOfMemoryError) is not queued: the unit is copied when
    it is gathered, and the tokens stay transformers'."""

    def full_device(self, src, device):
        raise torch.OutOfMemoryError("device full")

    monkeypatch.setattr(SideStream, "copy_ahead", full_device)
    ref = llama()
    engine = engine_for(tmp_path, "cpu")
    part = engine.partitioner
    part.read_ahead = True
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = generate(ref, ids)
        part.take_io_report()
        got = generate(engine.module, ids)
    assert torch.equal(got, want)
    io = part.take_io_report()
    assert io.param_prefetches == io.param_prefetch_hits == io.peak_read_ahead_bytes == 0
    assert not any(part.store.prefetching(u) for u in part.units)
    engine.close()
