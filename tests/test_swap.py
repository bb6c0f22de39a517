"""SwapSpace (private files, cleanup, errors) and OptimizerSwapper (pipelined, split, atomic steps)."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from swap_helpers import ENGINE_CHILD_PRELUDE, fill_from, reference_state, run_child, snapshot

from offload.pinned import PinnedPool
from offload.swap import OptimizerSwapper, SwapSpace, SwapSpaceError, check_nvme_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_space_is_private_and_preallocated(tmp_path):
    with SwapSpace(str(tmp_path)) as space:
        assert os.path.dirname(space.dir) == str(tmp_path)
        assert stat.S_IMODE(os.stat(space.dir).st_mode) == 0o700
        f = space.create("x.swp", 5000)
        assert f.nbytes == 8192  # rounded up to the 4 KiB alignment
        st = os.stat(f.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 8192
        assert st.st_blocks * 512 >= 8192  # blocks really allocated, not a sparse hole
        assert space.bytes_allocated == 8192
        with pytest.raises(ValueError, match="plain file name"):
            space.create("../escape", 10)
    assert not os.path.exists(space.dir)
    space.close()  # idempotent


def test_space_lock_file_is_hidden_private_and_held(tmp_path):
    import fcntl

    with SwapSpace(str(tmp_path)) as space:
        assert os.path.basename(space.lock_path) == f".{os.path.basename(space.dir)}.lock"
        assert os.path.dirname(space.lock_path) == str(tmp_path)
        assert stat.S_IMODE(os.stat(space.lock_path).st_mode) == 0o600
        fd = os.open(space.lock_path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="prefix"):
        SwapSpace(str(tmp_path), prefix="a/b")


def test_space_removed_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(
        f"""
        from offload.swap import SwapSpace
        s = SwapSpace({str(tmp_path)!r})
        s.create("a.swp", 4096)
        print(s.dir)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    made = out.stdout.strip()
    assert made.startswith(str(tmp_path))
    assert not os.path.exists(made)
    assert os.listdir(tmp_path) == []


def test_nvme_path_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SwapSpaceError) as e:
        check_nvme_path(str(missing))
    assert e.value.errno == errno.ENOENT and e.value.filename == str(missing)
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(SwapSpaceError) as e:
        SwapSpace(str(afile))
    assert e.value.errno == errno.ENOTDIR
    with pytest.raises(SwapSpaceError, match="empty"):
        check_nvme_path("")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_nvme_path_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(SwapSpaceError) as e:
            SwapSpace(str(ro))
        assert e.value.errno == errno.EACCES and str(ro) in str(e.value)
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("buffer_count", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [1000, 4096, 50_000])
def test_step_updates_every_element_once(tmp_path, buffer_count, chunk):
    numel, n_states = 10_007, 2  # odd size: a short last chunk, sizes not multiples of the alignment
    master_ref, states_ref = reference_state(numel, n_states, seed=buffer_count)
    pool = PinnedPool(64 << 20)
    with SwapSpace(str(tmp_path)) as space:
        sw = OptimizerSwapper(space, numel, n_states, pool, chunk_numel=chunk, buffer_count=buffer_count)
        assert sw.chunk_numel == min(chunk, numel)
        sw.load(fill_from(master_ref, states_ref))
        seen = torch.zeros(numel, dtype=torch.int32)

        def update(start, n, master, states):
            seen[start : start + n] += 1
            master.add_(1.0)
            states[0].mul_(2.0)
            states[1].copy_(master * states[0])
            return True

        assert sw.step(update)
        sw.commit()
        assert torch.equal(seen, torch.ones(numel, dtype=torch.int32))
        m, st = snapshot(sw)
        assert torch.equal(m, master_ref + 1)
        assert torch.equal(st[0], states_ref[0] * 2)
        assert torch.equal(st[1], (master_ref + 1) * (states_ref[0] * 2))
        assert sw.stats.bytes_written >= numel * 3 * 4
        sw.close()
    assert pool.bytes_in_use == 0


@pytest.mark.parametrize("copies", [1, 2])
def test_load_with_zero_states_writes_only_masters_into_fresh_files(tmp_path, copies):
    numel, n_states = 10_007, 2
    master_ref, states_ref = reference_state(numel, n_states, seed=7)
    pool = PinnedPool(64 << 20)
    with SwapSpace(str(tmp_path)) as space:
        sw = OptimizerSwapper(space, numel, n_states, pool, chunk_numel=3000, buffer_count=2, copies=copies)

        def masters(start, n, master, states):
            master.copy_(master_ref[start : start + n])
            for t in states:
                t.fill_(float("nan"))  # garbage in the slot must not reach the file

        sw.load(masters, states_zero=True)
        assert sw.stats.bytes_written == numel * 4  # the masters alone: the fresh files read as zeros
        m, st = snapshot(sw)
        assert torch.equal(m, master_ref)
        assert all(torch.equal(t, torch.zeros(numel)) for t in st)

        def update(start, n, master, states):
            master.add_(1.0)
            for t, r in zip(states, states_ref):
                t.copy_(r[start : start + n])
            return True

        for _ in range(2):  # both copies written now: a second zero-state load must zero them itself
            assert sw.step(update)
            sw.commit()
        sw.stats.reset()
        sw.load(masters, states_zero=True)
        assert sw.stats.bytes_written >= numel * 3 * 4
        m, st = snapshot(sw)
        assert torch.equal(m, master_ref)
        assert all(torch.equal(t, torch.zeros(numel)) for t in st)
        sw.close()
    assert pool.bytes_in_use == 0


def test_subgroup_larger_than_slots_is_split(tmp_path):
    # A pool that can hold only small slots: the swapper is told to use 2048-element pieces.
    pool = PinnedPool(4 * 3 * 2048 * 4)
    master_ref, states_ref = reference_state(9000, 2, seed=7)
    with SwapSpace(str(tmp_path)) as space:
        sw = OptimizerSwapper(space, 9000, 2, pool, chunk_numel=2048, buffer_count=4)
        assert len(sw.chunks) == 5 and sw.pinned_bytes <= pool.cap_bytes
        sw.load(fill_from(master_ref, states_ref))
        assert sw.step(lambda s, n, m, st: bool(m.mul_(3.0) is not None))
        sw.commit()
        assert torch.equal(snapshot(sw)[0], master_ref * 3)
        sw.close()


def test_abort_and_false_keep_previous_state(tmp_path):
    pool = PinnedPool(16 << 20)
    master_ref, states_ref = reference_state(5000, 1, seed=3)
    with SwapSpace(str(tmp_path)) as space:
        sw = OptimizerSwapper(space, 5000, 1, pool, chunk_numel=1024, buffer_count=3)
        sw.load(fill_from(master_ref, states_ref))
        calls = []

        def bad_at_third(start, n, master, states):
            calls.append(start)
            master.fill_(float("nan"))
            return len(calls) < 3

        assert not sw.step(bad_at_third)
        assert len(calls) == 3  # stopped at the failing chunk
        with pytest.raises(RuntimeError, match="without a completed step"):
            sw.commit()
        m, st = snapshot(sw)
        assert torch.equal(m, master_ref) and torch.equal(st[0], states_ref[0])
        assert sw.step(lambda s, n, m, st: bool(m.add_(1) is not None))
        sw.abort()
        assert torch.equal(snapshot(sw)[0], master_ref)
        sw.close()


def test_exception_in_update_drains_and_keeps_state(tmp_path):
    pool = PinnedPool(16 << 20)
    master_ref, states_ref = reference_state(6000, 2, seed=4)
    with SwapSpace(str(tmp_path)) as space:
        sw = OptimizerSwapper(space, 6000, 2, pool, chunk_numel=1000, buffer_count=4)
        sw.load(fill_from(master_ref, states_ref))

        def boom(start, n, master, states):
            if start >= 3000:
                raise KeyError("boom")
            return True

        with pytest.raises(KeyError):
            sw.step(boom)
        assert torch.equal(snapshot(sw)[0], master_ref)
        sw.close()


_DISK_FULL_CHILD = ENGINE_CHILD_PRELUDE + textwrap.dedent(
    """

    e = engine()
    got = []
    for s in range(2):
        got.append(fwd_bwd(e, s))
        e.step()
    state = e.optimizer.state_dict()
    params = [p.detach().clone() for p in e.module.parameters()]
    sw = e.optimizer_state
    assert len(sw.chunks) >= 4, sw.chunks
    got.append(fwd_bwd(e, 2))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * sw.region_bytes, hard))  # chunk 2's write fails
    err = None
    try:
        e.step()
    except OSError as exc:
        err = exc
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    after = e.optimizer.state_dict()
    consistent = (
        torch.equal(after["master"], state["master"])
        and all(torch.equal(a, b) for a, b in zip(after["states"], state["states"]))
        and all(torch.equal(a, p.detach()) for a, p in zip(params, e.module.parameters()))
        and after["step"] == state["step"] == 2 and e.global_steps == 2
    )
    fwd_bwd(e, 2)  # once there is room again, the one retry: forward, backward and step on the same batch
    e.step()
    got.append(fwd_bwd(e, 3))
    e.step()
    swap_dir = e.swap_dir
    e.close()
    print(json.dumps({
        "errno": err.errno if err else None, "filename": getattr(err, "filename", None),
        "message": str(err), "swap_dir": swap_dir, "consistent": consistent, "got": got, "want": want,
    }))
    """
)


def test_disk_full_during_step_keeps_previous_state(tmp_path):
    res = run_child(_DISK_FULL_CHILD, str(tmp_path))
    assert res["errno"] in (errno.EFBIG, errno.ENOSPC), res["message"]
    assert res["filename"] and res["filename"].startswith(res["swap_dir"] + os.sep), res
    assert "previous state is kept" in res["message"]
    assert res["consistent"]
    assert res["got"] == res["want"]  # the retried step is exactly the step that failed
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("buffer_count", [1, 3])
def test_prefetch_feeds_the_next_step_and_never_goes_stale(tmp_path, buffer_count):
    pool = PinnedPool(16 << 20)
    master_ref, states_ref = reference_state(7000, 2, seed=5)
    with SwapSpace(str(tmp_path)) as space:
        sw = OptimizerSwapper(space, 7000, 2, pool, chunk_numel=1000, buffer_count=buffer_count)
        sw.load(fill_from(master_ref, states_ref))
        sw.prefetch()
        sw.prefetch()  # idempotent
        read_before = sw.stats.bytes_read
        assert sw.step(lambda s, n, m, st: bool(m.add_(1) is not None))
        sw.commit()
        assert sw.stats.bytes_read - read_before == sum(sw._io_bytes(n) for _, n in sw.chunks[buffer_count:])
        # A prefetch followed by another pass over the slots must not feed stale data to the step.
        sw.prefetch()
        assert torch.equal(snapshot(sw)[0], master_ref + 1)
        sw.load(fill_from(master_ref * 2, states_ref))
        assert sw.step(lambda s, n, m, st: bool(m.add_(1) is not None))
        sw.commit()
        assert torch.equal(snapshot(sw)[0], master_ref * 2 + 1)
        sw.close()
