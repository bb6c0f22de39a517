"""Chaos: a ZeRO-Infinity loop killed with SIGKILL at random points resumes bit for bit and leaks nothing.

The child (`tests/chaos_train.py`: stage 3, parameters and optimizer state on NVMe, a checkpoint every
SAVE_EVERY steps) is killed KILLS times: by the parent right after a randomly chosen event line (the child
keeps running until the signal lands, so the point is anywhere in the following forward, backward, step,
save or load), or by itself at a named point inside `save_checkpoint`. After each kill it is restarted and
resumes from `latest`. Every step any run finished must have the uninterrupted run's loss (bit for bit),
every restart must resume from the newest complete checkpoint, the final weights must equal the
uninterrupted run's, and after the last run no swap directory, temporary checkpoint file or `.old` copy
may be left. `CHAOS_SEED` picks the kill schedule (default 0); the counts are printed.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest
import torch

from zero.checkpoint import CRASH_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(REPO, "tests", "chaos_train.py")
TOTAL, SAVE_EVERY, KILLS = 12, 2, 20
SAVE_POINTS = ["after_optimizer", "after_model", "after_move_aside", "before_latest"]


def _start(work: str, env_extra: Dict[str, str]) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    env.update(env_extra)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, CHILD, work, str(TOTAL), str(SAVE_EVERY)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )


def _latest_step(ckpt: str) -> int:
    path = os.path.join(ckpt, "latest")
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        return int(f.read().strip().removeprefix("global_step"))


def _losses(work: str) -> List[Tuple[int, str, str]]:
    out = []
    for name in sorted(os.listdir(work)):
        if name.startswith("losses."):
            with open(os.path.join(work, name)) as f:
                out += [(int(s), v, name) for s, v in (line.split() for line in f if line.strip())]
    return out


def _leftovers(root: str, allowed) -> Dict[str, int]:
    """Every path under `root` that `allowed(relative_path)` rejects, with its size in bytes."""
    found: Dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if not allowed(rel):
                found[rel] = os.lstat(full).st_size
    return found


def _finish(proc: subprocess.Popen, timeout: float = 300) -> Tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


@pytest.mark.slow
def test_sigkill_anywhere_resumes_bit_exactly_and_leaks_nothing(tmp_path):
    ref, work = str(tmp_path / "ref"), str(tmp_path / "chaos")
    for d in (ref, work):
        os.makedirs(os.path.join(d, "nvme"))
    proc = _start(ref, {})
    rc, err = _finish(proc)
    assert rc == 0, err
    want = {s: v for s, v, _ in _losses(ref)}
    assert sorted(want) == list(range(TOTAL))

    rng = random.Random(int(os.environ.get("CHAOS_SEED", "0")))
    ckpt = os.path.join(work, "ckpt")
    kills = self_kills = resumes = 0
    while kills < KILLS:
        before = _latest_step(ckpt)
        saves_left = (TOTAL - before) // SAVE_EVERY
        env = {}
        if saves_left and rng.random() < 0.3:
            env["CHAOS_SELF_KILL"] = f"{rng.choice(SAVE_POINTS)}@{rng.randint(1, saves_left)}"
        proc = _start(work, env)
        assert proc.stdout is not None
        target = None
        for line in proc.stdout:
            _, n, name = line.split(" ", 2)
            if name.startswith("resumed"):
                resumes += int(name.split()[1]) > 0
                assert int(name.split()[1]) == before  # the newest complete checkpoint
                steps_left = TOTAL - before
                # Up to the last step's event: the kill lands anywhere up to and inside the last save.
                target = None if env else rng.randint(0, 3 * steps_left + 2 * saves_left - 2)
                if target == 0:
                    proc.kill()
                    break
                target = None if target is None else int(n) + target
            elif target is not None and int(n) >= target:
                proc.kill()
                break
        rc, err = _finish(proc)
        if rc == -signal.SIGKILL:
            kills += 1
            self_kills += bool(env)
        else:  # a self-kill at a point this run's saves never reach (after_move_aside of a new tag)
            assert rc == 0, err
            shutil.rmtree(ckpt)  # start over: the same steps again, the same losses expected
            os.remove(os.path.join(work, "final.pt"))
    # The last run trains to the end undisturbed.
    rc, err = _finish(_start(work, {}))
    assert rc == 0, err

    got = _losses(work)
    wrong = [(s, v, want[s], f) for s, v, f in got if v != want[s]]
    assert not wrong, f"steps whose loss differs from the uninterrupted run: {wrong[:5]}"
    assert {s for s, _, _ in got} == set(range(TOTAL))
    final, want_final = torch.load(os.path.join(work, "final.pt")), torch.load(os.path.join(ref, "final.pt"))
    assert final.keys() == want_final.keys()
    assert all(torch.equal(final[k], want_final[k]) for k in want_final)

    tags = {f"global_step{s}" for s in range(SAVE_EVERY, TOTAL + 1, SAVE_EVERY)}
    leaked = _leftovers(os.path.join(work, "nvme"), lambda rel: False)
    leaked.update(
        _leftovers(ckpt, lambda rel: rel == "latest" or rel.split(os.sep)[0] in tags and "tmp" not in rel)
    )
    print(
        f"\nchaos: {kills} kills ({self_kills} inside save_checkpoint by its crash hook, "
        f"{kills - self_kills} by the parent), {resumes} resumes from a checkpoint, "
        f"{len(got)} steps run for {TOTAL}, leaked {sum(leaked.values())} bytes in {len(leaked)} paths"
    )
    tops = sorted({rel.split(os.sep)[0] for rel in leaked})
    assert not leaked, f"left behind: {sum(leaked.values())} bytes under {tops[:6]} ({len(tops)} entries)"
