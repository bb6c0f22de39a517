"""Checkpoints edited by someone else: the manifest's checksum is plain xxh3, so anyone who can edit the files
can reseal it. Every such edit is refused quickly, with a bounded read, an error that names the file and
field and quotes none of its content, and nothing of the engine changed: manifest fields out of range, a
FIFO or a symlink (to /dev/zero, or to a file outside) in place of a file, a huge `latest` or manifest,
malformed RNG / step / hyperparameters / scheduler state (checked before anything is applied), and the
checkpoint writer's temporary directory swapped during a save. Every load runs in a thread joined with a
timeout, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import threading

import pytest
import torch
import xxhash
from checkpoint_helpers import new_engine, params_of, run

import zero
from zero.checkpoint._files import manifest_bytes
from zero.checkpoint.to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zero.errors import CheckpointError

EMPTY = {"size": 0, "segment_bytes": 0, "digests": [xxhash.xxh3_64(b"").hexdigest()]}
TIMEOUT = 60


def bounded(fn, timeout=TIMEOUT):
    """fn() in a thread; fails (instead of hanging) if it has not returned after `timeout` seconds."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout} s: hangs"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def edit_manifest(path, edit) -> None:
    """Change manifest.json of checkpoint `path` with `edit(body)` and seal it again (a valid checksum)."""
    body = json.loads((path / "manifest.json").read_text())
    body.pop("manifest_digest")
    edit(body)
    (path / "manifest.json").write_bytes(manifest_bytes(body))


def reseal_file(path, name) -> None:
    """Record file `name`'s new content in the manifest, as anyone who edited it can."""
    from checkpoint_helpers import digest_file

    edit_manifest(path, lambda b: b["files"].update({name: digest_file(str(path / name), 0)}))


def optimizer_state(engine):
    sd = engine.optimizer.state_dict()
    return [sd["master"].clone(), *[s.clone() for s in sd["states"]]]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A checkpoint (stage 1, optimizer on CPU, 2 steps), saved once for the module."""
    tmp = tmp_path_factory.mktemp("orig")
    engine = new_engine("cpu", tmp)
    run(engine, 0, 2)
    engine.save_checkpoint(str(tmp / "ckpt"), tag="good")
    engine.close()
    return tmp / "ckpt"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine (1 step) that every refused load must leave exactly as it was."""
    engine = new_engine("cpu", tmp_path_factory.mktemp("engine"), seed=3)
    run(engine, 0, 1)
    yield engine
    engine.close()


@pytest.fixture
def ckpt(tmp_path, original):
    shutil.copytree(original, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def assert_refused(engine, ckpt, match, error=Exception):
    before, state, rng = params_of(engine), optimizer_state(engine), torch.get_rng_state()
    with pytest.raises(error, match=match) as info:
        bounded(lambda: engine.load_checkpoint(str(ckpt)))
    assert all(torch.equal(a, b) for a, b in zip(params_of(engine), before))
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(engine), state))
    assert torch.equal(torch.get_rng_state(), rng)
    assert engine.global_steps == 1
    engine.check_state_usable()  # not poisoned: nothing was applied
    return str(info.value)


def _set(name, key, value):
    return lambda body: body["files"][name].update({key: value})


# ------------------------------------------------------------------------------------- manifest fields
@pytest.mark.parametrize(
    "edit,match",
    [
        (_set("optim_rank0.bin", "segment_bytes", -1), "optim_rank0.bin: segment_bytes"),
        (_set("model_states.pt", "segment_bytes", 0), "model_states.pt: segment_bytes"),
        (_set("optim_rank0.bin", "size", "12"), "optim_rank0.bin: size"),
        (_set("optim_rank0.bin", "size", -5), "optim_rank0.bin: size"),
        (_set("rank0_states.pt", "digests", []), "rank0_states.pt: 1 checksum"),
        (_set("rank0_states.pt", "digests", ["zz"]), "rank0_states.pt: a checksum"),
        (lambda b: b["files"].update({"../escape": EMPTY}), "not a plain name"),
        (lambda b: b.update(world_size=-1), "'world_size'"),
        (lambda b: b.update(stage3_layout=7), "'stage3_layout'"),
        (lambda b: b.update(files=[]), "'files'"),
    ],
    ids=[
        "segment-negative",
        "segment-zero",
        "size-string",
        "size-negative",
        "no-digests",
        "bad-digest",
        "name-escapes",
        "world-size",
        "stage3-layout",
        "files-list",
    ],
)
def test_resealed_manifest_fields_are_refused(ckpt, engine, edit, match):
    edit_manifest(ckpt / "good", edit)
    assert_refused(engine, ckpt, match)
    with pytest.raises(CheckpointError, match=match):  # zero-to-fp32 reads the same manifest
        bounded(lambda: get_fp32_state_dict_from_zero_checkpoint(str(ckpt)))


# -------------------------------------------------------------------------------- only regular files
def _fifo(path):
    os.unlink(path)
    os.mkfifo(path)


def _dev_zero(path):
    os.unlink(path)
    os.symlink("/dev/zero", path)


@pytest.mark.parametrize("name", ["model_states.pt", "optim_rank0.bin"])
@pytest.mark.parametrize(
    "make,match", [(_fifo, "a FIFO, not a regular file"), (_dev_zero, "a symbolic link")]
)
def test_fifo_or_dev_zero_in_a_checkpoint_is_refused(ckpt, engine, name, make, match):
    make(ckpt / "good" / name)
    edit_manifest(ckpt / "good", lambda b: b["files"].update({name: dict(EMPTY)}))  # os.stat says 0 bytes
    assert_refused(engine, ckpt, f"{name}: {match}")
    with pytest.raises(CheckpointError, match=name):  # the optimizer file: already too small for a master
        bounded(lambda: get_fp32_state_dict_from_zero_checkpoint(str(ckpt)))


def test_symlink_to_a_file_outside_is_refused(ckpt, engine, tmp_path):
    """Same bytes, same checksums: still refused, a checkpoint's files are the regular files inside it."""
    outside = tmp_path / "elsewhere.bin"
    os.rename(ckpt / "good" / "optim_rank0.bin", outside)
    os.symlink(outside, ckpt / "good" / "optim_rank0.bin")
    assert_refused(engine, ckpt, "optim_rank0.bin: a symbolic link")


# ------------------------------------------------------------------------------------ bounded reads
@pytest.mark.parametrize("name", ["latest", "good/manifest.json"])
def test_huge_latest_or_manifest_is_refused_unread_and_unquoted(ckpt, engine, name):
    """64 MiB (sparse, costs no disk): refused from its size, its content never read into the error."""
    path = ckpt / name
    with open(path, "wb") as f:
        f.write(b"SECRET-" * 10)
        f.truncate(64 << 20)
    message = assert_refused(engine, ckpt, f"{os.path.basename(name)}: {64 << 20} bytes, more than")
    assert "SECRET" not in message and len(message) < 500


def test_latest_naming_no_tag_is_not_quoted(ckpt, engine):
    (ckpt / "latest").write_text("../SECRET/..")
    message = assert_refused(engine, ckpt, "latest: does not hold a checkpoint tag")
    assert "SECRET" not in message


# ---------------------------------------------------------------------------- validate, then apply
def _edit_rank_state(ckpt, edit):
    path = ckpt / "good" / "rank0_states.pt"
    obj = torch.load(path, weights_only=True)
    edit(obj)
    torch.save(obj, path)
    reseal_file(ckpt / "good", "rank0_states.pt")


def _edit_model_state(ckpt, edit):
    path = ckpt / "good" / "model_states.pt"
    obj = torch.load(path, weights_only=True)
    edit(obj)
    torch.save(obj, path)
    reseal_file(ckpt / "good", "model_states.pt")


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda c: _edit_rank_state(c, lambda o: o["rng"].update(torch=torch.zeros(3, dtype=torch.uint8))),
            "RNG state does not load",
        ),
        (
            lambda c: _edit_rank_state(c, lambda o: o["rng"]["python"].update(state=torch.zeros(3).long())),
            "RNG state does not load",
        ),
        (lambda c: _edit_rank_state(c, lambda o: o["optimizer"].update(step="7")), "'step'"),
        (lambda c: _edit_rank_state(c, lambda o: o["optimizer"].update(step=-1)), "'step'"),
        (
            lambda c: _edit_rank_state(c, lambda o: o["optimizer"]["param_groups"][0].update(lr="fast")),
            r"param_groups\[0\]\['lr'\]",
        ),
        (lambda c: _edit_rank_state(c, lambda o: o["optimizer"].update(param_groups=[])), "'param_groups'"),
        (
            lambda c: _edit_model_state(c, lambda o: o.update(lr_scheduler={"last_batch_iteration": "x"})),
            "LR scheduler's state",
        ),
        (lambda c: _edit_model_state(c, lambda o: o.update(global_steps="2")), "'global_steps'"),
    ],
    ids=[
        "rng-torch",
        "rng-python",
        "step-string",
        "step-negative",
        "lr-string",
        "no-param-groups",
        "scheduler",
        "global-steps",
    ],
)
def test_malformed_field_is_refused_before_anything_is_applied(ckpt, engine, edit, match):
    edit(ckpt)
    assert_refused(engine, ckpt, match, ValueError)


# --------------------------------------------------------------------------------- the save's writer
def test_save_writes_into_the_directory_it_created_even_if_swapped(tmp_path, monkeypatch):
    """Once the optimizer file is written, `.<tag>.tmp` is renamed away and a symlink to another directory
    put in its place: no file lands there, and the save fails instead of publishing the swapped directory."""
    import zero.checkpoint._state as st

    engine = new_engine("cpu", tmp_path)
    run(engine, 0, 1)
    ckpt, trap = tmp_path / "ckpt", tmp_path / "trap"
    trap.mkdir()
    real = st.rng_state

    def swap_then_rng_state():  # called after the optimizer file, before the other files are written
        tmp = ckpt / ".t.tmp"
        os.rename(tmp, tmp_path / "moved")
        os.symlink(trap, tmp)
        return real()

    monkeypatch.setattr(st, "rng_state", swap_then_rng_state)
    with pytest.raises(OSError):
        engine.save_checkpoint(str(ckpt), tag="t")
    assert os.listdir(trap) == []
    assert not (ckpt / "t").exists() and not (ckpt / "latest").exists()
    engine.close()


def test_tag_with_surrounding_whitespace_is_refused_at_save(tmp_path):
    engine = new_engine("cpu", tmp_path)
    for tag in (" global_step10", "global_step10\n", "a\tb"):
        with pytest.raises(ValueError, match="tag"):
            engine.save_checkpoint(str(tmp_path / "ckpt"), tag=tag)
    assert not (tmp_path / "ckpt").exists() or os.listdir(tmp_path / "ckpt") == []
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="global_step10")
    assert engine.load_checkpoint(str(tmp_path / "ckpt"))[0] == str(tmp_path / "ckpt" / "global_step10")
    engine.close()


def test_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path, original):
    from checkpoint_helpers import CFG, config

    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, d_model=48)
    other, *_ = zero.initialize(model=zero.examples.models.GPT(cfg), config=config("cpu", tmp_path))
    with pytest.raises(ValueError, match=r"parameter \S+: shape \(\d+(, \d+)*\) in the checkpoint, \(\d+"):
        other.load_checkpoint(str(original))
    other.close()


# ------------------------------------------------------------------------------------------- exports
def test_save_16bit_model_never_writes_through_a_planted_temporary(tmp_path):
    """A symlink at the fixed name `<file>.tmp` would have its target overwritten; another user's 0666
    file there would become the output. Neither is touched; the output is this user's, mode 0644 under
    umask 022, and holds the model's state dict."""
    engine = new_engine("cpu", tmp_path)
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.write_bytes(b"keep")
    os.symlink(victim, out / "pytorch_model.bin.tmp")
    planted = out / "m.bin.tmp"
    planted.write_bytes(b"theirs")
    os.chmod(planted, 0o666)
    if os.geteuid() == 0:
        os.chown(planted, 65534, 65534)
    old = os.umask(0o022)
    try:
        assert engine.save_16bit_model(str(out)) is True
        assert engine.save_16bit_model(str(out), "m.bin") is True
    finally:
        os.umask(old)
    assert victim.read_bytes() == b"keep" and planted.read_bytes() == b"theirs"
    want = engine.module.state_dict()
    for name in ("pytorch_model.bin", "m.bin"):
        st = os.lstat(out / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644 and st.st_uid == os.geteuid()
        got = torch.load(out / name, weights_only=True)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    engine.close()
