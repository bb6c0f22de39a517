"""Served partitions read at the alignment of their checkpoint files (zero/stage3/served.py, `lead`): a
checkpoint's tensors lie at unaligned file offsets; the store lands each read where memory and file agree
modulo 4 KiB, so that only each extent's head and tail (under 4 KiB) go through the I/O core's bounce
buffers, and what lands is the file's bytes, bit for bit, whatever the buffer's position."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import zero
from offload.aio import AioHandle
from zero.stage3.served import ALIGN, Extent, ServedPartition

transformers = pytest.importorskip("transformers")


class RecordingHandle:
    """sync_pread/async_pread by os.pread, each request recorded as (address, file offset, bytes)."""

    def __init__(self) -> None:
        self.requests = []

    def sync_pread(self, buf, fd, offset):
        data = os.pread(fd, buf.numel(), offset)
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.requests.append((buf.data_ptr(), offset, buf.numel()))

    async_pread = sync_pread


def _file(tmp_path, head, sizes):
    """A file of `head` bytes of junk, then tensors of `sizes` bytes of random values: (fd, offsets,
    bytes)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (head + sum(sizes),), dtype=torch.uint8, generator=g)
    path = tmp_path / "w.bin"
    path.write_bytes(data.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    offs, at = [], head
    for n in sizes:
        offs.append(at)
        at += n
    return fd, offs, data


def _aligned(nbytes):
    raw = torch.empty(nbytes + 2 * ALIGN, dtype=torch.uint8)
    return raw[(-raw.data_ptr()) % ALIGN :][: nbytes + ALIGN]


def test_reads_at_the_lead_go_straight_to_the_device_but_for_head_and_tail(tmp_path):
    sizes = [5 * ALIGN, 3 * ALIGN + 200, 2 * ALIGN]  # the second moves the third off the first's alignment
    fd, offs, data = _file(tmp_path, 2200, sizes)
    try:
        # the partition: the third tensor, a gap, the first (same alignment), the second
        ext = [
            Extent(0, fd, offs[2], sizes[2], "w.bin", "c"),
            Extent(sizes[2] + 64, fd, offs[0], sizes[0], "w.bin", "a"),
            Extent(sizes[2] + 64 + sizes[0], fd, offs[1], sizes[1], "w.bin", "b"),
        ]
        nbytes = sum(sizes) + 64 + 100
        part = ServedPartition("u", ext, nbytes)
        want = torch.zeros(nbytes, dtype=torch.uint8)
        for e in ext:
            want[e.part_offset : e.part_offset + e.nbytes] = data[e.file_offset : e.file_offset + e.nbytes]
        # the lead follows the extents holding most bytes (a and b: file offset - partition offset agree)
        assert part.lead(0) == (offs[0] - (sizes[2] + 64)) % ALIGN and part.lead(0) % 8 == 0
        for offset in (0, 8 * 100, sizes[2] + 64 + 40):
            buf = _aligned(nbytes - offset)
            h = RecordingHandle()
            view = buf[part.lead(offset) :][: nbytes - offset]
            part.read_into(h, view, offset)
            assert torch.equal(view, want[offset:])
            # a and b agree with the lead: their middles are aligned in memory and file, their heads and
            # tails are under 4 KiB; c, off the lead, is read as one request
            aligned = [n for a, f, n in h.requests if a % ALIGN == 0 and f % ALIGN == 0]
            assert sum(aligned) >= sizes[0] + sizes[1] - 4 * ALIGN - offset
            for a, f, n in h.requests:
                in_c = offs[2] <= f < offs[2] + sizes[2]
                assert n < ALIGN or in_c or (a % ALIGN == 0 and f % ALIGN == 0)
        # anywhere else in memory the bytes are the same (the I/O core bounces what is unaligned)
        with AioHandle(block_size=ALIGN) as real:
            for shift in (0, 8, part.lead(0), 1000):
                buf = _aligned(nbytes)[shift:][:nbytes]
                part.read_into(real, buf, 0)
                assert torch.equal(buf, want)
                buf.fill_(7)
                part.read_into(real, buf, 0, asynchronous=True)
                real.wait()
                assert torch.equal(buf, want)
    finally:
        os.close(fd)


def _tensor_offsets(path):
    """{tensor name: file offset of its data} over the checkpoint's safetensors files."""
    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for key, v in header.items():
                if key != "__metadata__":
                    out[key] = 8 + n + v["data_offsets"][0]
    return out


def test_served_weights_land_at_their_files_alignment_and_equal_the_copied_ones(tmp_path):
    """Every tensor of this Llama is a multiple of 4 KiB: a served forward's weights lie in the staging
    slots at their file offsets' alignment, and its logits equal the copy path's bit for bit."""
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=1024, intermediate_size=1024, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    ckpt = tmp_path / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(ckpt)
    offsets = _tensor_offsets(ckpt)
    assert {o % ALIGN for o in offsets.values()} != {0}  # the header leaves them unaligned
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    z = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}}
    z["stage3_param_persistence_threshold"] = 0
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": z}
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    seen = {}
    out = {}
    for serve in (False, "auto"):
        engine = zero.from_pretrained(str(ckpt), config=config, serve_checkpoint=serve)
        assert (engine.load_report.checkpoint_bytes_served > 0) == (serve == "auto")
        hooks = []
        if serve == "auto":
            proj = dict(engine.module.named_modules())["model.layers.0.mlp.down_proj"]

            def grab(m, args, seen=seen):
                seen["down"] = m.weight.data_ptr()

            hooks.append(proj.register_forward_pre_hook(grab))
        with torch.no_grad():
            out[serve] = engine(ids).logits
        for h in hooks:
            h.remove()
        engine.close()
    assert torch.equal(out["auto"], out[False])
    assert seen["down"] % ALIGN == offsets["model.layers.0.mlp.down_proj.weight"] % ALIGN


class _Handle:
    def __init__(self, opened: list) -> None:
        self.closed = False
        opened.append(self)

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("room, want", [(3 * (8192 + ALIGN), 8192 + ALIGN), (3 * 8192, 8192)])
def test_staging_slots_take_the_alignment_pad_only_when_the_budget_has_room(room, want):
    """allocate_slots: slots with room for the file's alignment when they fit, else without it; the
    try that did not fit is given back whole (its memory and its handles)."""
    from offload.pinned import PinnedPool
    from zero.stage3.staging_slot import allocate_slots

    pool, opened = PinnedPool(room), []
    slots, nbytes = allocate_slots(pool, 3, 8192, (ALIGN, 0), lambda: _Handle(opened))
    assert nbytes == want and [s.buf.numel() for s in slots] == [want] * 3
    assert pool.bytes_in_use == 3 * want
    live = [s.handle for s in slots]
    assert all(h.closed for h in opened if h not in live) and not any(h.closed for h in live)
    for s in slots:
        pool.free(s.buf)


def test_staging_slots_that_never_fit_hold_nothing():
    from offload.pinned import PinnedMemoryBudgetError, PinnedPool
    from zero.stage3.staging_slot import allocate_slots

    pool, opened = PinnedPool(2 * 8192), []
    with pytest.raises(PinnedMemoryBudgetError):
        allocate_slots(pool, 3, 8192, (ALIGN, 0), lambda: _Handle(opened))
    assert pool.bytes_in_use == 0 and opened and all(h.closed for h in opened)
