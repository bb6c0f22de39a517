"""Swap-space lifetime: removed on SIGTERM/SIGHUP/SIGINT, respecting earlier handlers; what a SIGKILLed
process left is reclaimed by the next SwapSpace under the same nvme_path; nothing live or foreign is touched.

Each child is a fresh interpreter that creates a SwapSpace with a real file, prints the directory and blocks
reading stdin; the parent synchronizes on the child's output lines (never on sleeps), signals it and checks
the exit status and what is left under the nvme_path. The new API (`reclaim_stale`, `offload.cleanup`) is
imported inside the tests that use it, so the others also run against a tree that predates it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from typing import List, Optional

import pytest

from offload.swap import SwapSpace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWAP_BYTES = 1 << 20

_CHILD = """
import os, signal, sys
for _sig in (signal.SIGTERM, signal.SIGHUP):  # whatever the test runner inherited (nohup ignores SIGHUP)
    signal.signal(_sig, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell starts us with SIGINT ignored
{before}
from offload.swap import SwapSpace
space = SwapSpace(sys.argv[1])
space.create("state.swp", {nbytes})
print(space.dir, flush=True)
sys.stdin.readline()
{after}
"""


class Child:
    """A child process holding a SwapSpace under `nvme`; killed after 120 s whatever happens."""

    def __init__(
        self, nvme: str, before: str = "", after: str = "", argv: Optional[List[str]] = None
    ) -> None:
        code = _CHILD.format(before=textwrap.dedent(before), after=textwrap.dedent(after), nbytes=SWAP_BYTES)
        cmd = (argv or []) + [sys.executable, "-c", code, nvme]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._watchdog = threading.Timer(120, self.proc.kill)
        self._watchdog.daemon = True
        self._watchdog.start()
        self.dir = self.readline()
        assert self.dir.startswith(nvme + os.sep), self.dir + self.proc.stderr.read()
        assert os.path.getsize(os.path.join(self.dir, "state.swp")) == SWAP_BYTES

    def readline(self) -> str:
        return self.proc.stdout.readline().strip()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def finish(self, stdin: str = "") -> tuple:
        """Exit status, the rest of stdout, stderr."""
        try:
            out, err = self.proc.communicate(stdin, timeout=120)
        finally:
            self._watchdog.cancel()
        return self.proc.returncode, out, err


def _children_left(nvme) -> List[str]:
    return sorted(os.listdir(nvme))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_termination_signal_removes_the_directory_and_keeps_the_exit_status(tmp_path, sig):
    child = Child(str(tmp_path))
    child.signal(sig)
    rc, _, err = child.finish()
    assert rc == -sig, err  # still "killed by the signal", as without us
    assert not os.path.exists(child.dir)
    assert _children_left(tmp_path) == []  # the lock file too


def test_earlier_handler_that_exits_runs_and_the_directory_goes(tmp_path):
    child = Child(
        str(tmp_path),
        before="""
        def on_term(signum, frame):
            os.write(1, b"handler ran\\n")
            sys.exit(3)
        signal.signal(signal.SIGTERM, on_term)
        """,
    )
    child.signal(signal.SIGTERM)
    rc, out, err = child.finish()
    assert out.split() == ["handler", "ran"] and rc == 3, err
    assert _children_left(tmp_path) == []


def test_earlier_handler_that_returns_keeps_the_space_while_the_process_lives(tmp_path):
    child = Child(
        str(tmp_path),
        before="""
        signal.signal(signal.SIGTERM, lambda signum, frame: os.write(1, b"handled\\n"))
        """,
        after="""
        print(os.path.getsize(os.path.join(space.dir, "state.swp")))  # still usable
        """,
    )
    child.signal(signal.SIGTERM)
    assert child.readline() == "handled"
    assert os.path.getsize(os.path.join(child.dir, "state.swp")) == SWAP_BYTES  # the child lives on
    rc, out, err = child.finish("go on\n")
    assert rc == 0 and out.split() == [str(SWAP_BYTES)], err
    assert _children_left(tmp_path) == []  # and cleans up when it exits normally


def test_ignored_sigterm_stays_ignored(tmp_path):
    child = Child(
        str(tmp_path),
        before="""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        """,
        after="""
        print(os.path.isdir(space.dir), signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)
        """,
    )
    child.signal(signal.SIGTERM)
    rc, out, err = child.finish("go on\n")
    assert rc == 0 and out.split() == ["True", "True"], err
    assert _children_left(tmp_path) == []


def test_sigint_removes_the_directory(tmp_path):
    child = Child(str(tmp_path))
    child.signal(signal.SIGINT)
    rc, _, err = child.finish()
    assert rc == -signal.SIGINT and "KeyboardInterrupt" in err, err
    assert _children_left(tmp_path) == []


def test_forked_child_exiting_leaves_the_parents_space(tmp_path):
    child = Child(
        str(tmp_path),
        after="""
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: atexit and finalizers run in the forked child
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), os.path.isfile(os.path.join(space.dir, "state.swp")))
        """,
    )
    rc, out, err = child.finish("go on\n")
    assert rc == 0 and out.split() == ["0", "True"], err
    assert _children_left(tmp_path) == []


def test_exit_when_the_redelivered_signal_does_not_end_the_process(tmp_path):
    # As for PID 1 of a container, where a signal with the default action is ignored: the cleanup must
    # not leave a process running without its swap space.
    child = Child(
        str(tmp_path),
        before="""
        os.kill = lambda pid, sig: None
        """,
    )
    child.signal(signal.SIGTERM)
    rc, _, err = child.finish()
    assert rc == 128 + signal.SIGTERM, err
    assert _children_left(tmp_path) == []


_UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child"]


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    cmd = [*_UNSHARE, sys.executable, "-c", "pass"]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and PID namespaces (unshare)")
def test_sigterm_to_pid_1_of_a_namespace_removes_and_exits(tmp_path):
    child = Child(str(tmp_path), argv=_UNSHARE)
    # unshare forwards nothing: signal the namespace's PID 1 itself, found as unshare's only child.
    children = f"/proc/{child.proc.pid}/task/{child.proc.pid}/children"
    if not os.path.exists(children):
        child.finish("")
        pytest.skip("the kernel does not list a task's children in /proc")
    with open(children) as f:
        (pid1,) = f.read().split()
    os.kill(int(pid1), signal.SIGTERM)
    rc, _, err = child.finish()
    assert rc == 128 + signal.SIGTERM, err  # unshare passes PID 1's exit status on
    assert _children_left(tmp_path) == []


def _kill9(nvme: str) -> str:
    child = Child(nvme)
    child.signal(signal.SIGKILL)
    rc, _, _ = child.finish()
    assert rc == -signal.SIGKILL
    assert os.path.getsize(os.path.join(child.dir, "state.swp")) == SWAP_BYTES  # nothing could run
    return child.dir


def test_sigkill_leftover_is_reclaimed_by_the_next_space(tmp_path, caplog):
    dead = _kill9(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="offload.swap"):
        with SwapSpace(str(tmp_path)) as space:
            assert not os.path.exists(dead)
            name = os.path.basename(space.dir)
            assert _children_left(tmp_path) == [f".{name}.lock", name]
    assert _children_left(tmp_path) == []
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "offload.swap"]
    assert dead in msg and "1.0 MiB" in msg


def test_reclaim_stale_reports_what_it_removed(tmp_path):
    from offload.swap import ReclaimedSpace, reclaim_stale

    dead = _kill9(str(tmp_path))
    (got,) = reclaim_stale(str(tmp_path))
    assert isinstance(got, ReclaimedSpace) and got.path == dead
    assert got.nbytes >= SWAP_BYTES and got.host == socket.gethostname() and got.pid > 0
    assert _children_left(tmp_path) == []
    assert reclaim_stale(str(tmp_path)) == []


def test_live_process_space_is_never_reclaimed(tmp_path):
    from offload.swap import reclaim_stale

    child = Child(str(tmp_path))
    before = _children_left(tmp_path)
    assert reclaim_stale(str(tmp_path)) == []
    with SwapSpace(str(tmp_path)):  # a second process starting beside it
        assert os.path.getsize(os.path.join(child.dir, "state.swp")) == SWAP_BYTES
    assert _children_left(tmp_path) == before
    rc, _, err = child.finish("done\n")
    assert rc == 0, err
    assert _children_left(tmp_path) == []


def test_space_of_this_process_is_never_reclaimed(tmp_path):
    from offload.swap import reclaim_stale

    with SwapSpace(str(tmp_path)) as first:
        first.create("a.swp", 4096)
        assert reclaim_stale(str(tmp_path)) == []
        with SwapSpace(str(tmp_path)):
            assert os.path.isfile(os.path.join(first.dir, "a.swp"))
    assert _children_left(tmp_path) == []


def test_only_our_own_stale_pairs_are_touched(tmp_path):
    from offload.swap import reclaim_stale
    from offload.swap.space import _stamp

    nvme, outside = tmp_path / "nvme", tmp_path / "outside"
    nvme.mkdir()
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    stamp = _stamp()

    def stale_lock(name: str, content: bytes = stamp) -> None:  # as a SIGKILLed owner leaves it
        fd = os.open(nvme / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, content)
        os.close(fd)

    def private_dir(name: str, mode: int = 0o700) -> None:
        (nvme / name).mkdir()
        (nvme / name / "state.swp").write_bytes(b"\0" * 4096)
        os.chmod(nvme / name, mode)

    # Genuine stale pairs (optimizer and stage-3 parameter swap), so the scan demonstrably ran.
    stale_lock(".zero-offload-stale.lock")
    private_dir("zero-offload-stale")
    stale_lock(".zero-stage3-r0-stale.lock")
    private_dir("zero-stage3-r0-stale")
    # Symlinks named like ours: never followed, never removed.
    os.symlink(outside, nvme / "zero-offload-link")
    stale_lock(".zero-offload-linked.lock")
    os.symlink(outside, nvme / "zero-offload-linked")
    os.symlink(outside / "precious", nvme / ".zero-offload-lockfile.lock")
    private_dir("zero-offload-lockfile")
    # Not our prefix, not our stamp, not private, no lock at all, another machine's.
    stale_lock(".other-thing.lock")
    private_dir("other-thing")
    stale_lock(".zero-offload-notours.lock", b"somebody else's lock\n")
    private_dir("zero-offload-notours")
    stale_lock(".zero-offload-shared.lock")
    private_dir("zero-offload-shared", 0o755)
    private_dir("zero-offload-nolock")
    stale_lock("zero-offload-visible.lock")  # not how our lock files are named
    private_dir("zero-offload-visible")
    foreign = b"zero-offload swap space\npid 1\nhost elsewhere\nboot another-boot\n"
    stale_lock(".zero-offload-foreign.lock", foreign)
    private_dir("zero-offload-foreign")
    (nvme / "zero-offload-notes.txt").write_text("x")
    before = _children_left(nvme)

    got = reclaim_stale(str(nvme))
    stale = ["zero-offload-stale", "zero-stage3-r0-stale"]
    assert sorted(r.path for r in got) == [str(nvme / name) for name in stale]
    assert _children_left(nvme) == sorted(set(before) - set(stale) - {f".{name}.lock" for name in stale})
    assert sorted(os.listdir(outside)) == ["precious"] and (outside / "precious").read_text() == "keep me"
    for name in ("lockfile", "notours", "shared", "nolock", "visible", "foreign"):
        assert (nvme / f"zero-offload-{name}" / "state.swp").is_file()
    assert (nvme / "other-thing" / "state.swp").is_file()


def test_lock_file_without_a_stamp_is_removed_alone(tmp_path):
    # What a creator killed between creating its lock file and stamping it leaves; it never has a directory.
    from offload.swap import reclaim_stale

    fd = os.open(tmp_path / ".zero-offload-early.lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    (tmp_path / "zero-offload-early").mkdir(mode=0o700)  # not its directory: a lock is stamped first
    assert reclaim_stale(str(tmp_path)) == []
    assert _children_left(tmp_path) == ["zero-offload-early"]


def test_creator_racing_a_reclaimer_takes_another_name(tmp_path, monkeypatch):
    # A reclaimer that runs between the creation of a lock file and its locking finds it unlocked and
    # unstamped and removes it; the creator must notice and start over instead of using an unlinked lock.
    from offload.swap import reclaim_stale, space

    real_open, first = space._open_lock_file, []

    def open_then_reclaim(name, root_fd):
        fd, path = real_open(name, root_fd), str(tmp_path / name)
        if not first:
            first.append(path)
            assert reclaim_stale(str(tmp_path)) == [] and not os.path.exists(path)
        return fd

    monkeypatch.setattr(space, "_open_lock_file", open_then_reclaim)
    with SwapSpace(str(tmp_path)) as space:
        assert space.lock_path != first[0]
        assert _children_left(tmp_path) == sorted(
            [os.path.basename(space.lock_path), os.path.basename(space.dir)]
        )
        monkeypatch.undo()
        assert reclaim_stale(str(tmp_path)) == []  # and its lock is really held
    assert _children_left(tmp_path) == []


def test_creator_finding_its_lock_file_held_takes_another_name(tmp_path, monkeypatch):
    # The reclaimer still holds the lock it took (it unlinks the file itself): the creator leaves it alone.
    import fcntl

    from offload.swap import space

    real_open, held = space._open_lock_file, []

    def open_held_by_reclaimer(name, root_fd):
        fd, path = real_open(name, root_fd), str(tmp_path / name)
        if not held:
            other = os.open(path, os.O_RDONLY)
            fcntl.flock(other, fcntl.LOCK_EX)
            held.append((other, path))
        return fd

    monkeypatch.setattr(space, "_open_lock_file", open_held_by_reclaimer)
    with SwapSpace(str(tmp_path)) as space:
        other, path = held[0]
        assert space.lock_path != path and os.path.exists(path)
        os.unlink(path)
        os.close(other)
    assert _children_left(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_other_users_pairs_are_never_touched(tmp_path):
    from offload.swap import reclaim_stale
    from offload.swap.space import _stamp

    (tmp_path / ".zero-offload-theirs.lock").write_bytes(_stamp())
    os.chmod(tmp_path / ".zero-offload-theirs.lock", 0o600)
    (tmp_path / "zero-offload-theirs").mkdir(mode=0o700)
    (tmp_path / ".zero-offload-mine.lock").write_bytes(_stamp())
    os.chmod(tmp_path / ".zero-offload-mine.lock", 0o600)
    (tmp_path / "zero-offload-mine").mkdir(mode=0o700)
    os.chown(tmp_path / ".zero-offload-theirs.lock", 12345, 12345)
    os.chown(tmp_path / "zero-offload-mine", 12345, 12345)  # a lock of ours beside a directory of theirs
    assert reclaim_stale(str(tmp_path)) == []
    assert len(_children_left(tmp_path)) == 4


def test_registration_runs_once_and_cancel_drops_it():
    from offload import cleanup

    ran = []
    reg = cleanup.register(lambda: ran.append(1))
    assert reg.pending
    reg()
    reg()
    assert ran == [1] and not reg.pending
    other = cleanup.register(lambda: ran.append(2))
    other.cancel()
    other()
    assert ran == [1] and not other.pending


def test_a_failing_cleanup_is_reported_and_the_others_still_run(tmp_path):
    """At exit every registered cleanup runs, newest first; one that raises is reported on stderr and does not
    stop the others (nor change the exit status)."""
    marker = tmp_path / "older-ran"
    code = textwrap.dedent(
        f"""
        from offload import cleanup
        cleanup.register(lambda: open({str(marker)!r}, "w").close())
        def boom():
            raise RuntimeError("cleanup boom")
        cleanup.register(boom)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "cleanup failed" in run.stderr and "cleanup boom" in run.stderr
    assert marker.exists()


def _read_id(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def test_reclaim_trusts_the_boot_and_machine_ids_never_the_host_name(tmp_path):
    """A stale pair is this machine's when its stamp has this kernel's boot id (the flock is the truth) or
    this machine's id with an earlier boot (every process of that boot is gone). The same host name on
    another machine (another boot and machine id) proves nothing: its directory is left alone."""
    from offload.swap import reclaim_stale

    boot = _read_id("/proc/sys/kernel/random/boot_id")
    machine = _read_id("/etc/machine-id")
    if not boot or not machine:
        pytest.skip("needs /proc/sys/kernel/random/boot_id and /etc/machine-id")
    host = socket.gethostname()
    stamps = {
        "samehost": f"host {host}\nboot another-boot\nmachine another-machine\n",  # a twin elsewhere
        "rebooted": f"host renamed-since\nboot an-earlier-boot\nmachine {machine}\n",
        "thisboot": f"host renamed-since\nboot {boot}\nmachine another-machine\n",
        "oldstamp": f"host {host}\nboot another-boot\n",  # a stamp without a machine id
    }
    for name, tail in stamps.items():
        fd = os.open(tmp_path / f".zero-offload-{name}.lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, f"zero-offload swap space\npid 1\n{tail}".encode())
        os.close(fd)
        (tmp_path / f"zero-offload-{name}").mkdir(mode=0o700)
        (tmp_path / f"zero-offload-{name}" / "state.swp").write_bytes(b"\0" * 4096)
    got = reclaim_stale(str(tmp_path))
    assert sorted(os.path.basename(r.path) for r in got) == ["zero-offload-rebooted", "zero-offload-thisboot"]
    assert _children_left(tmp_path) == sorted(
        [f"zero-offload-{n}" for n in ("samehost", "oldstamp")]
        + [f".zero-offload-{n}.lock" for n in ("samehost", "oldstamp")]
    )


def test_new_stamps_carry_the_machine_id(tmp_path):
    machine = _read_id("/etc/machine-id")
    if not machine:
        pytest.skip("needs /etc/machine-id")
    with SwapSpace(str(tmp_path)) as space:
        with open(space.lock_path) as f:
            assert f"machine {machine}" in f.read().splitlines()
