"""The one retry rule after an `OSError` from `step()`: redo forward, backward and step on the same batch (the
accumulation window's micro-batches) - and the run is bit-identical to one without the failure: weights,
fp32 master, optimizer states, step counters, learning rate and loss scale.

The errors are real: the NVMe optimizer state lives on an ext4 file system on a loop device, and the loop
device's size limit is cut below a region of the swap file the next step writes, so the kernel's block layer
fails those O_DIRECT writes with EIO ("attempt to access beyond end of device"); lifting the limit heals the
disk. Two cases: a write that fails inside the step (synchronous), and the step's last write, still in flight
when `step()` returned, failing afterwards (and again when written anew from its slot: the step is held and
the next `step()` raises). Needs root, losetup and mkfs.ext4 (skipped otherwise).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import shutil
import struct
import subprocess

import pytest
import torch
from engine_helpers import DATA, TINY, make_model

import zero
from zero.examples.models import get_batch

pytestmark = pytest.mark.slow

LOOP_SET_STATUS64, LOOP_GET_STATUS64 = 0x4C04, 0x4C05
LOOP_INFO64 = "=QQQQQIIII64s64s32sQQ"  # struct loop_info64; lo_sizelimit is the fifth field
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_HEAD, FIEMAP_EXTENT = "=QQIIII", "=QQQQQIIII"
STEPS, FAIL_AT = 4, 1  # the second step writes the `.b` copy (the engine's load made `.b` live)


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


class LoopDisk:
    """An ext4 file system on a loop device whose capacity can be cut (EIO beyond it) and restored."""

    def __init__(self, root: str) -> None:
        self.image, self.mnt = os.path.join(root, "disk.img"), os.path.join(root, "mnt")
        os.mkdir(self.mnt)
        with open(self.image, "wb") as f:
            f.truncate(64 << 20)
        self.dev = _run("losetup", "--find", "--show", self.image)
        self.mounted = False
        _run("mkfs.ext4", "-q", "-b", "4096", "-O", "^has_journal", self.dev)
        _run("mount", self.dev, self.mnt)
        self.mounted = True

    def _set_limit(self, nbytes: int) -> None:
        fd = os.open(self.dev, os.O_RDWR)
        try:
            buf = bytearray(struct.calcsize(LOOP_INFO64))
            fcntl.ioctl(fd, LOOP_GET_STATUS64, buf)
            info = list(struct.unpack(LOOP_INFO64, buf))
            info[4] = nbytes
            fcntl.ioctl(fd, LOOP_SET_STATUS64, struct.pack(LOOP_INFO64, *info))
        finally:
            os.close(fd)

    def fail_from(self, offset: int) -> None:
        """Every block at or past byte `offset` of the device fails with EIO."""
        self._set_limit(offset)

    def heal(self) -> None:
        self._set_limit(0)

    def close(self) -> None:
        try:
            self.heal()
            if self.mounted:
                subprocess.run(["umount", self.mnt], check=False, capture_output=True)
                if os.path.ismount(self.mnt):  # still busy (a failed test's engine not collected yet)
                    _run("umount", "--lazy", self.mnt)
        finally:
            _run("losetup", "--detach", self.dev)


def physical(path: str, logical: int) -> int:
    """The device offset of byte `logical` of `path` (FIEMAP)."""
    n = 64
    buf = bytearray(struct.calcsize(FIEMAP_HEAD) + n * struct.calcsize(FIEMAP_EXTENT))
    struct.pack_into(FIEMAP_HEAD, buf, 0, 0, 2**64 - 1, 1, 0, n, 0)  # FIEMAP_FLAG_SYNC
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
    finally:
        os.close(fd)
    mapped = struct.unpack_from(FIEMAP_HEAD, buf, 0)[3]
    for k in range(mapped):
        lo, ph, ln = struct.unpack_from(FIEMAP_EXTENT, buf, struct.calcsize(FIEMAP_HEAD) + k * 56)[:3]
        if lo <= logical < lo + ln:
            return ph + logical - lo
    raise AssertionError(f"{path}: byte {logical} is not mapped")


@pytest.fixture
def disk(tmp_path):
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("losetup", "mkfs.ext4", "mount")):
        pytest.skip("needs root, losetup, mkfs.ext4 and mount")
    try:
        d = LoopDisk(str(tmp_path))
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"no loop device here: {e}")
    yield d
    d.close()


def config(nvme: str, gas: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 8}},
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2},
        "zero_optimization": {
            "stage": 2,
            "sub_group_size": 8000,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0, "buffer_count": 2},
        },
    }


def window(engine, step: int, gas: int) -> list:
    losses = []
    for k in range(gas):
        x, y = get_batch(DATA, 4, TINY.seq_len, step * gas + k)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def counters(engine) -> tuple:
    return (
        engine.optimizer.step_count,
        engine.global_steps,
        engine.global_samples,
        engine.micro_steps,
        engine.skipped_steps,
        engine.get_lr(),
        engine.loss_scale,
    )


def outcome(engine, losses: list) -> dict:
    state = engine.optimizer.state_dict()
    return {
        "losses": losses,
        "weights": {k: v.clone() for k, v in zero.consolidated_state_dict(engine).items()},
        "master": state["master"],
        "states": state["states"],
        "counters": counters(engine),
    }


def assert_identical(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"]
    assert got["counters"] == want["counters"]
    assert got["weights"].keys() == want["weights"].keys()
    for k in want["weights"]:
        assert torch.equal(got["weights"][k], want["weights"][k]), k
    assert torch.equal(got["master"], want["master"])
    assert all(torch.equal(a, b) for a, b in zip(got["states"], want["states"]))


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("case", ["sync", "held"])
def test_redoing_the_batch_after_a_real_eio_is_the_run_without_it(disk, case, gas):
    cfg = config(disk.mnt, gas)
    engine = zero.initialize(model=make_model(), config=cfg)[0]
    try:
        got = _failing_run(engine, disk, case, gas)
    finally:
        engine.close()
    clean = zero.initialize(model=make_model(), config=cfg)[0]
    ref = []
    for s in range(STEPS):
        ref += window(clean, s, gas)
    want = outcome(clean, ref)
    clean.close()
    assert_identical(got, want)


def _failing_run(engine, disk: LoopDisk, case: str, gas: int) -> dict:
    losses = []
    for s in range(FAIL_AT):
        losses += window(engine, s, gas)
    sw = engine.optimizer_state
    (spare,) = glob.glob(os.path.join(engine.swap_dir, "*.b.swp"))
    (live,) = glob.glob(os.path.join(engine.swap_dir, "*.a.swp"))
    n = len(sw.chunks)
    assert n > sw.buffer_count  # a write in the pass is waited for before the step ends
    first = 0 if case == "sync" else (n - 1) * sw.region_bytes  # chunk 0's write, or the last one's
    cut = physical(spare, first)
    others = [(live, c) for c in range(n)] + [(spare, c) for c in range(n) if c * sw.region_bytes < first]
    if any(physical(f, c * sw.region_bytes) + sw.region_bytes > cut for f, c in others):
        pytest.skip("the file system placed the swap files out of order")
    disk.fail_from(cut)
    if case == "sync":
        with pytest.raises(OSError, match="previous state is kept") as info:
            window(engine, FAIL_AT, gas)  # the window's last step() raises
    else:
        losses += window(engine, FAIL_AT, gas)  # returns: its last write is in flight (and fails)
        before = (counters(engine), [p.detach().clone() for p in engine.module.parameters()])
        with pytest.raises(OSError, match="held in memory") as info:
            window(engine, FAIL_AT + 1, gas)  # the write fails again: the step is held, this one raises
        assert type(info.value).__name__ == "DeferredWriteError" and info.value.steps_lost == 0
        assert counters(engine) == before[0]  # nothing lost, nothing changed
        assert all(torch.equal(a, p) for a, p in zip(before[1], engine.module.parameters()))
        ckpt = os.path.join(os.path.dirname(disk.mnt), "ckpt")
        with pytest.raises(OSError, match="held in memory"):  # a save would pair new weights with old state
            engine.save_checkpoint(ckpt, tag="held")
        assert not os.path.exists(os.path.join(ckpt, "held"))
    assert info.value.errno == errno.EIO and info.value.filename == spare
    assert engine.state_error is None
    disk.heal()
    start = FAIL_AT if case == "sync" else FAIL_AT + 1
    for s in range(start, STEPS):  # the one retry: the failed window again, then on
        losses += window(engine, s, gas)
    return outcome(engine, losses)
