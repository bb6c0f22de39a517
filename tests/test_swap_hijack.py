"""Nothing under nvme_path can turn the engine's writes against its user.

The attack: between two steps, the engine's private swap directory is renamed away and replaced by one of
symlinks named like the swap files, pointing at a file the engine's user can write (the victim). An engine
that reopens its files by path then writes weights into the victim. The engine holds its directories open
and opens every file relative to them with O_NOFOLLOW, so it keeps writing into its own files; and it
refuses an nvme_path in which another user could do the renaming at all (`check_nvme_path`).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from engine_helpers import make_model, s3_config, train

import zero
from offload.swap import SwapSpace, SwapSpaceError, check_nvme_path

VICTIM_BYTES = b"the victim's own bytes\n" * 100
NOBODY = 65534


def _victim(tmp_path) -> str:
    path = str(tmp_path / "victim.txt")
    with open(path, "wb") as f:
        f.write(VICTIM_BYTES)
    return path


def _hijack(directory: str, victim: str) -> str:
    """Rename `directory` away and put a directory of symlinks to `victim`, named like its files, in its
    place. Returns where the real directory went."""
    moved = directory + ".moved"
    os.rename(directory, moved)
    os.mkdir(directory, 0o700)
    for name in os.listdir(moved):
        os.symlink(victim, os.path.join(directory, name))
    return moved


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_swap_directories_replaced_by_symlinks_between_steps(tmp_path):
    """Stage 3 with parameters and optimizer state on NVMe: both swap directories are swapped for symlink
    farms after the first step. The next steps write only into the engine's own files (the victim is
    untouched) and train exactly as an engine nobody touched."""
    torch.manual_seed(0)
    clean_dir, attacked_dir = tmp_path / "clean", tmp_path / "attacked"
    clean_dir.mkdir()
    attacked_dir.mkdir()
    victim = _victim(tmp_path)
    clean, *_ = zero.initialize(model=make_model(), config=s3_config("nvme", "nvme", clean_dir))
    attacked, *_ = zero.initialize(model=make_model(), config=s3_config("nvme", "nvme", attacked_dir))
    want = train(clean, 3)
    got = train(attacked, 1)
    dirs = [attacked.swap_dir, attacked.partitioner.store.swap_dir]
    assert all(dirs) and all(os.listdir(d) for d in dirs)
    moved = [_hijack(d, victim) for d in dirs]
    got += train(attacked, 2, start=1)
    assert _read(victim) == VICTIM_BYTES
    assert got == want  # bit-identical: every read came from the engine's own files
    clean.close()
    attacked.close()
    assert _read(victim) == VICTIM_BYTES
    for d, m in zip(dirs, moved):
        assert os.listdir(m) == []  # its files were removed through the held descriptor
        assert all(os.path.islink(os.path.join(d, n)) for n in os.listdir(d))  # not ours: left alone


def test_world_writable_without_sticky_bit_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(SwapSpaceError, match="writable by every user .* without the sticky bit") as e:
        check_nvme_path(str(shared))
    assert e.value.errno == errno.EPERM and e.value.filename == str(shared)
    with pytest.raises(SwapSpaceError, match="sticky"):
        zero.initialize(model=make_model(), config=s3_config("nvme", "nvme", shared))
    assert os.listdir(shared) == []  # refused before anything was created
    os.chmod(shared, 0o1777)  # /tmp-style: only an entry's owner may rename it
    assert check_nvme_path(str(shared)) == str(shared)
    with SwapSpace(str(shared)) as space:
        space.create("a.swp", 4096)
        assert os.stat(space.dir).st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_directory_owned_by_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(SwapSpaceError, match="owned by .*another user") as e:
        check_nvme_path(str(theirs))
    assert e.value.errno == errno.EPERM


def _as_nobody(script: str) -> subprocess.CompletedProcess:
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to act as another user")
    cmd = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def reachable(tmp_path):
    """A directory user nobody can reach (pytest's tmp_path sits under a 0700 directory): removed after."""
    base = tempfile.mkdtemp(prefix="zo-hijack-", dir=tempfile.gettempdir())
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _attack_as_nobody(directory: str, victim: str, names: list) -> str:
    """Try the hijack as user nobody, who knows the swap files' `names` (they are predictable) but cannot
    list the 0700 directory; returns what happened (the attacker's own report)."""
    script = f"""
import os
d, v = {directory!r}, {victim!r}
try:
    os.rename(d, d + ".moved")
except OSError as e:
    print("rename", e.errno)
else:
    os.mkdir(d)
    for name in {names!r}:
        os.symlink(v, os.path.join(d, name))
    print("hijacked")
"""
    proc = _as_nobody(script)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_hijack_by_another_user_in_a_sticky_shared_directory(reachable, tmp_path):
    """A /tmp-style directory (1777) shared with user nobody: nobody cannot rename the engine's directory,
    and the engine's steps leave nobody's chosen victim (a file of the engine's user) untouched."""
    shared = os.path.join(reachable, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    victim = _victim(tmp_path)
    engine, *_ = zero.initialize(model=make_model(), config=s3_config("nvme", "nvme", shared))
    train(engine, 1)
    dirs = (engine.swap_dir, engine.partitioner.store.swap_dir)
    outcomes = [_attack_as_nobody(d, victim, os.listdir(d)) for d in dirs]
    assert outcomes == [f"rename {errno.EPERM}"] * 2
    train(engine, 2, start=1)
    engine.close()
    assert _read(victim) == VICTIM_BYTES
    assert os.listdir(shared) == []


def test_hijack_by_another_user_in_a_world_writable_directory_is_refused(reachable, tmp_path):
    """A non-sticky world-writable directory: nobody could rename anything in it (shown), so the engine
    refuses it before creating anything."""
    shared = os.path.join(reachable, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    bait = os.path.join(shared, "zero-offload-bait")
    os.mkdir(bait, 0o700)
    with open(os.path.join(bait, "x.swp"), "wb") as f:
        f.write(b"\0")
    assert _attack_as_nobody(bait, _victim(tmp_path), ["x.swp"]) == "hijacked"  # the attack works here
    with pytest.raises(SwapSpaceError, match="without the sticky bit") as e:
        zero.initialize(model=make_model(), config=s3_config("nvme", "nvme", shared))
    assert e.value.errno == errno.EPERM
    assert sorted(os.listdir(shared)) == ["zero-offload-bait", "zero-offload-bait.moved"]


def test_swap_cache_directories_are_per_user_and_held(tmp_path):
    """The swap cache lives in `zero-offload-cache-<uid>`; its files are created, written and sealed through
    the held fingerprint directory, whatever is put at its path meanwhile."""
    import numpy as np

    from offload.aio import AioHandle
    from zero.stage3.swap_cache import CACHE_DIR, open_swap_cache

    assert CACHE_DIR == f"zero-offload-cache-{os.geteuid()}"
    victim = _victim(tmp_path)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cache = open_swap_cache(str(nvme), {"checkpoint": "x"})
    f = cache.create("a.param.swp", 8192)
    moved = _hijack(cache.dir, victim)
    data = np.arange(8192, dtype=np.uint8)
    with AioHandle() as h:
        h.sync_pwrite(data, f, 0)
    cache.seal()
    cache.close()
    assert _read(victim) == VICTIM_BYTES
    assert sorted(os.listdir(moved)) == ["a.param.swp", "manifest.json"]
    assert _read(os.path.join(moved, "a.param.swp")) == data.tobytes()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_swap_cache_directory_made_by_another_user_is_refused(tmp_path):
    from zero.stage3.swap_cache import CACHE_DIR, SwapCacheError, open_swap_cache

    squatted = tmp_path / CACHE_DIR
    squatted.mkdir(mode=0o700)
    os.chown(squatted, NOBODY, NOBODY)
    with pytest.raises(SwapCacheError, match="not a directory of this user") as e:
        open_swap_cache(str(tmp_path), {"checkpoint": "x"})
    assert e.value.errno == errno.EPERM and e.value.filename == str(squatted)
    assert os.listdir(squatted) == []
