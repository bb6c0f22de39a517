"""Checkpoint safety: loading runs no code from the files, checksums catch damage before anything changes,
failed saves leave nothing behind, and files are private. (A module-only load rebuilding the fp32 master is
tested with the engine's other state guarantees, in test_state_integrity.py.)"""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from checkpoint_helpers import CFG, DATA, new_engine, params_of, run

import zero
from zero.examples.models import GPT, get_batch


class Touch:
    """Unpickling it creates `path`: stands for any code a crafted checkpoint could run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class Custom:
    """A client-state object that only pickle can restore."""

    def __init__(self, value: int) -> None:
        self.value = value


def reseal(path) -> None:
    """Make manifest.json describe the files as they are now, as anyone who can edit the files can."""
    manifest = os.path.join(path, "manifest.json")
    if not os.path.exists(manifest):
        return
    from checkpoint_helpers import digest_file

    from zero.checkpoint._files import manifest_bytes

    with open(manifest) as f:
        body = json.load(f)
    body.pop("manifest_digest")
    for name, entry in body["files"].items():
        entry.update(digest_file(os.path.join(path, name), entry["segment_bytes"]))
    with open(manifest, "wb") as f:
        f.write(manifest_bytes(body))


def optimizer_state(engine):
    sd = engine.optimizer.state_dict()
    return [sd["master"], *sd["states"]]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.fixture
def saved(tmp_path):
    """A checkpoint `good` after 2 steps (optimizer on CPU), and the weights it holds."""
    ckpt = tmp_path / "ckpt"
    engine = new_engine("cpu", tmp_path)
    run(engine, 0, 2)
    engine.save_checkpoint(str(ckpt), tag="good", client_state={"epoch": 1})
    want = params_of(engine), optimizer_state(engine)
    engine.close()
    return ckpt, want


# ------------------------------------------------------------------------------------ no code on load
@pytest.mark.parametrize("name", ["model_states.pt", "rank0_states.pt"])
def test_crafted_file_runs_no_code(tmp_path, saved, name):
    ckpt, _ = saved
    marker = tmp_path / "marker"
    path = ckpt / "good" / name
    obj = torch.load(path, weights_only=False)  # the test's own file
    if name == "model_states.pt":
        obj["client_state"] = {"x": Touch(str(marker))}
    else:
        obj["rng"]["python"] = Touch(str(marker))
    torch.save(obj, path)
    reseal(ckpt / "good")
    engine = new_engine("cpu", tmp_path, seed=3)
    before = params_of(engine)
    with pytest.raises(Exception, match=name):
        engine.load_checkpoint(str(ckpt))
    assert not marker.exists(), "loading the checkpoint ran code from it"
    assert_same(params_of(engine), before)
    engine.close()


def test_loads_weights_only_and_restores_every_rng(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    engine = new_engine("cpu", tmp_path)
    run(engine, 0, 1)
    random.seed(11)
    np.random.seed(12)
    np.random.standard_normal()  # numpy keeps a cached gaussian: it must come back too
    engine.save_checkpoint(str(ckpt), client_state={"epoch": 3, "t": torch.arange(3), "nested": [1.5, None]})
    want = random.random(), np.random.standard_normal(), np.random.rand(), torch.rand(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    _, client = engine.load_checkpoint(str(ckpt))
    monkeypatch.undo()
    assert calls and all(c is True for c in calls), calls
    assert (
        client["epoch"] == 3 and torch.equal(client["t"], torch.arange(3)) and client["nested"] == [1.5, None]
    )
    got = random.random(), np.random.standard_normal(), np.random.rand(), torch.rand(1)
    assert got[:3] == want[:3] and torch.equal(got[3], want[3])
    engine.close()


def test_client_state_needing_pickle_requires_opt_in(tmp_path):
    from zero.checkpoint import CheckpointPickleError

    ckpt = tmp_path / "ckpt"
    engine = new_engine("cpu", tmp_path)
    run(engine, 0, 2)
    with pytest.warns(UserWarning, match="allow_pickle=True"):
        engine.save_checkpoint(str(ckpt), client_state={"obj": Custom(3), "epoch": 2})
    want = params_of(engine)
    engine.close()
    other = new_engine("cpu", tmp_path, seed=5)
    before = params_of(other)
    with pytest.raises(CheckpointPickleError, match="allow_pickle=True"):
        other.load_checkpoint(str(ckpt))
    assert_same(params_of(other), before)
    # DeepSpeed's positional arguments still work next to the opt-in
    path, client = other.load_checkpoint(str(ckpt), None, True, True, True, allow_pickle=True)
    assert os.path.basename(path) == "global_step2"
    assert client["epoch"] == 2 and isinstance(client["obj"], Custom) and client["obj"].value == 3
    assert_same(params_of(other), want)
    other.close()


def _to_format1(path) -> None:
    """Rewrite a checkpoint as format 1 wrote it: pickled RNG tuples, no manifest."""
    ms_path, rs_path = path / "model_states.pt", path / "rank0_states.pt"
    ms = torch.load(ms_path, weights_only=False)
    if ms["format_version"] == 1:
        return  # already written in format 1
    ms["format_version"] = 1
    ms.pop("pickled")
    torch.save(ms, ms_path)
    rs = torch.load(rs_path, weights_only=False)
    py, npy = rs["rng"]["python"], rs["rng"]["numpy"]
    rs["rng"]["python"] = (py["version"], tuple(py["state"].tolist()), py["gauss"])
    key = npy["key"].numpy().astype(np.uint32)
    rs["rng"]["numpy"] = (npy["kind"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    torch.save(rs, rs_path)
    os.remove(path / "manifest.json")


def test_format1_checkpoint_needs_opt_in(tmp_path, saved):
    ckpt, (want_params, want_state) = saved
    _to_format1(ckpt / "good")
    engine = new_engine("cpu", tmp_path, seed=4)
    before = params_of(engine)
    with pytest.raises(Exception, match="allow_pickle=True"):
        engine.load_checkpoint(str(ckpt))
    assert_same(params_of(engine), before)
    path, client = engine.load_checkpoint(str(ckpt), allow_pickle=True)
    assert client == {"epoch": 1} and engine.global_steps == 2
    assert_same(params_of(engine), want_params)
    assert_same(optimizer_state(engine), want_state)
    engine.close()


# ------------------------------------------------------------------------------------------ checksums
@pytest.mark.parametrize(
    "name,damage",
    [
        ("model_states.pt", "flip"),
        ("rank0_states.pt", "flip"),
        ("optim_rank0.bin", "flip"),
        ("optim_rank0.bin", "truncate"),
        ("manifest.json", "flip"),
    ],
)
def test_damaged_file_is_named_and_nothing_changes(tmp_path, saved, name, damage):
    ckpt, _ = saved
    path = ckpt / "good" / name
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(size - 4096)
        else:  # one bit in the middle: in the data, where a format check sees nothing
            f.seek(size // 2)
            byte = f.read(1)[0]
            f.seek(size // 2)
            f.write(bytes([byte ^ 0x10]))
    engine = new_engine("cpu", tmp_path, seed=3)
    run(engine, 0, 1)
    before, state = params_of(engine), optimizer_state(engine)
    with pytest.raises(Exception, match=name):
        engine.load_checkpoint(str(ckpt))
    assert_same(params_of(engine), before)
    assert_same(optimizer_state(engine), state)
    assert engine.global_steps == 1
    engine.close()


def test_manifest_lists_every_file(saved):
    ckpt, _ = saved
    with open(ckpt / "good" / "manifest.json") as f:
        manifest = json.load(f)
    assert manifest["format_version"] == zero.checkpoint.FORMAT_VERSION and manifest["hash"] == "xxh3_64"
    files = sorted(os.listdir(ckpt / "good"))
    assert sorted(manifest["files"]) == [n for n in files if n != "manifest.json"]
    for name, entry in manifest["files"].items():
        assert entry["size"] == (ckpt / "good" / name).stat().st_size
    optim = manifest["files"]["optim_rank0.bin"]
    assert len(optim["digests"]) == 3  # AdamW: master, exp_avg, exp_avg_sq, each hashed while written


# --------------------------------------------------------------------------------------- failed saves
def _fail_handle(monkeypatch):
    import offload.aio

    def refuse(self, *args, **kwargs):
        raise OSError(errno.EAGAIN, "io_setup failed: queue_depth above the kernel's aio-max-nr")

    monkeypatch.setattr(offload.aio.AioHandle, "__init__", refuse)


def _fail_write(monkeypatch):
    import offload.aio

    real, calls = offload.aio.AioHandle.async_pwrite, []

    def write(self, buffer, path, offset=0):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(self, buffer, path, offset)

    monkeypatch.setattr(offload.aio.AioHandle, "async_pwrite", write)


def _fail_latest(monkeypatch):
    def replace(src, dst, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize(
    "fault,tag",
    [(_fail_handle, "next"), (_fail_write, "next"), (_fail_latest, "next"), (_fail_latest, "good")],
)
def test_failed_save_leaves_previous_checkpoint(tmp_path, fault, tag):
    ckpt = tmp_path / "ckpt"
    engine = new_engine("nvme", tmp_path)
    run(engine, 0, 2)
    engine.save_checkpoint(str(ckpt), tag="good")
    want = params_of(engine), optimizer_state(engine)
    run(engine, 2, 1)
    with pytest.MonkeyPatch.context() as mp:
        fault(mp)
        with pytest.raises(OSError):
            engine.save_checkpoint(str(ckpt), tag=tag)
    assert sorted(os.listdir(ckpt)) == ["good", "latest"]
    assert (ckpt / "latest").read_text() == "good"
    engine.close()
    other = new_engine("cpu", tmp_path, seed=5)
    path, _ = other.load_checkpoint(str(ckpt))
    assert os.path.basename(path) == "good" and other.global_steps == 2
    assert_same(params_of(other), want[0])
    assert_same(optimizer_state(other), want[1])
    other.close()


def test_resave_keeps_the_only_copy_until_latest_names_the_new_one(tmp_path, saved, monkeypatch):
    ckpt, (want_params, _) = saved
    # as a save of `good` leaves it when killed right after moving the previous copy aside
    os.rename(ckpt / "good", ckpt / ".good.old")
    engine = new_engine("cpu", tmp_path, seed=3)
    run(engine, 0, 3)
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if str(src).endswith(".good.tmp"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError):
        engine.save_checkpoint(str(ckpt), tag="good")
    monkeypatch.undo()
    assert sorted(os.listdir(ckpt)) == [".good.old", "latest"]
    other = new_engine("cpu", tmp_path, seed=4)
    path, _ = other.load_checkpoint(str(ckpt))
    assert os.path.basename(path) == ".good.old"
    assert_same(params_of(other), want_params)
    # a save that succeeds replaces it, and only then removes the copy moved aside
    engine.save_checkpoint(str(ckpt), tag="good")
    assert sorted(os.listdir(ckpt)) == ["good", "latest"]
    other.load_checkpoint(str(ckpt))
    assert_same(params_of(other), params_of(engine))
    engine.close()
    other.close()


def test_files_are_private(tmp_path):
    old_umask = os.umask(0o022)
    try:
        engine = new_engine("cpu", tmp_path)
        path = engine.save_checkpoint(str(tmp_path / "runs" / "ckpt"), tag="t")
        engine.close()
    finally:
        os.umask(old_umask)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "runs" / "ckpt") == 0o700  # created by the save
    assert mode(path) == 0o700
    assert mode(tmp_path / "runs" / "ckpt" / "latest") == 0o600
    for name in os.listdir(path):
        assert mode(os.path.join(path, name)) == 0o600, name


# ---------------------------------------------------------------------------------- module-only loads
def _plain_config(stage: int, nvme_dir):
    zo = {
        "stage": stage,
        "sub_group_size": 5000,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_dir), "max_in_cpu": 0},
    }
    if stage == 3:
        zo["stage3_param_persistence_threshold"] = 0
        zo["offload_param"] = {"device": "nvme", "nvme_path": str(nvme_dir), "max_in_cpu": 0}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1}},
        "zero_optimization": zo,
    }


def _weights(engine):
    return {k: v.clone() for k, v in zero.consolidated_state_dict(engine).items()}


def test_damaged_stage3_partitions_are_named_and_nothing_changes(tmp_path):
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=GPT(CFG), config=_plain_config(3, tmp_path))
    x, y = get_batch(DATA, 4, CFG.seq_len, 0)
    engine.backward(engine(x, y))
    engine.step()
    path = engine.save_checkpoint(str(tmp_path / "ckpt"))
    before = _weights(engine)
    params = os.path.join(path, "param_rank0.bin")
    with open(params, "r+b") as f:
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 1]))
    with pytest.raises(Exception, match="param_rank0.bin"):
        engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(v, before[k]) for k, v in _weights(engine).items())
    engine.close()


def test_io_error_while_applying_poisons_until_a_full_load(tmp_path, saved, monkeypatch):
    import offload.aio

    ckpt, (want_params, want_state) = saved
    engine = new_engine("cpu", tmp_path, seed=3)
    run(engine, 0, 1)
    real_read, calls = offload.aio.AioHandle.async_pread, []

    def read(self, buffer, path, offset=0):
        calls.append(path)
        if len(calls) == 2:  # the first chunk is already in: the state is half old, half loaded
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_read(self, buffer, path, offset)

    monkeypatch.setattr(offload.aio.AioHandle, "async_pread", read)
    with pytest.raises(OSError, match="optim_rank0.bin"):
        engine.load_checkpoint(str(ckpt))
    monkeypatch.undo()
    with pytest.raises(zero.StateCorruptedError):
        run(engine, 1, 1)
    with pytest.raises(zero.StateCorruptedError):
        engine.save_checkpoint(str(ckpt), tag="torn")
    assert sorted(os.listdir(ckpt)) == ["good", "latest"]
    engine.load_checkpoint(str(ckpt))  # complete this time: usable again
    assert_same(params_of(engine), want_params)
    assert_same(optimizer_state(engine), want_state)
    run(engine, 2, 1)
    engine.close()


def test_latest_temp_file_of_a_killed_save_is_removed_by_the_next(tmp_path):
    """A save killed between writing `.latest.tmp-<pid>` and renaming it leaves that file; the next save in
    the directory removes it once its process is gone, and never a live process's."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs (reaped)
    stale, live = ckpt / f".latest.tmp-{dead.pid}", ckpt / f".latest.tmp-{os.getppid()}"
    stale.write_text("global_step1")
    live.write_text("global_step1")
    engine = new_engine("cpu", tmp_path)
    engine.save_checkpoint(str(ckpt), tag="t")
    engine.close()
    assert not stale.exists() and live.exists()
