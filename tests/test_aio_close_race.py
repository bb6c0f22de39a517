"""close() racing submissions and wait(), from Python and on the C++ core under ThreadSanitizer and ASan.

A handle shared by threads may be closed by one of them while another is submitting: the submitter gets the
ValueError of a closed handle, never a crash. A failed write is reported by exactly one of a wait() and a
close() that run at once. The stress runs in a child process, so that a crash (SIGFPE, SIGSEGV, an abort)
fails the test with its signal instead of killing pytest.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

from offload import _aio
from offload.aio import AioError, AioHandle
from tests.aio_helpers import build_core_program

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "aio_csrc")
BACKENDS = _aio.available_backends()
CLOSED = "the aio Handle is closed"


@pytest.fixture
def io_dir():
    with tempfile.TemporaryDirectory(
        prefix="zo-close-race-", dir=os.environ.get("ZO_TEST_IO_DIR", "/var/tmp")
    ) as d:
        yield d


# ---------------------------------------------------------------------------------------------------------
# The stress, in a child process.

STRESS = textwrap.dedent(
    """
    import errno, json, os, sys, threading, time
    import numpy as np
    from offload import _aio
    from offload.aio import AioError, AioHandle

    rounds, io_dir = int(sys.argv[1]), sys.argv[2]
    CLOSED = "the aio Handle is closed"
    REC, SLOTS = 8192, 16
    backends = _aio.available_backends()
    # Closing a Linux AIO context waits for an RCU grace period (tens of ms): few rounds use it.
    fast = [b for b in backends if b != "aio"]

    def backend_of(r):
        return "aio" if "aio" in backends and r % 32 in (5, 11) else fast[r % len(fast)]
    rpath, wpath, fpath = (os.path.join(io_dir, n) for n in ("r.bin", "w.bin", "f.bin"))
    with open(rpath, "wb") as f:
        f.write(os.urandom(REC * SLOTS))
    wbuf = np.full(REC * SLOTS, 7, np.uint8)
    rbuf = np.zeros(REC * SLOTS, np.uint8)
    problems = []
    stats = {"rounds": 0, "submitted": 0, "fault_rounds": 0, "refused_after_close": 0}

    def submitter(h, started, seed):
        rng = np.random.default_rng(seed)
        raw = isinstance(h, _aio.Handle)
        while True:
            slot = int(rng.integers(SLOTS))
            chunk = slice(slot * REC, (slot + 1) * REC)
            try:
                if raw:  # the binding alone: little time in Python between submissions
                    write, asynchronous = bool(rng.integers(2)), bool(rng.integers(8))
                    base = wbuf.ctypes.data if write else rbuf.ctypes.data
                    fn = h.pwrite if write else h.pread
                    fn(base + slot * REC, REC, wpath if write else rpath, slot * REC, asynchronous)
                elif rng.integers(2):
                    h.async_pwrite(wbuf[chunk], wpath, slot * REC)
                elif rng.integers(8):
                    h.async_pread(rbuf[chunk], rpath, slot * REC)
                else:
                    h.sync_pread(rbuf[chunk], rpath, slot * REC)
                started.append(1)
                if rng.integers(16) == 0:
                    h.wait()
            except ValueError as e:
                if str(e) != CLOSED:
                    problems.append("submitter: ValueError %r" % str(e))
                return
            except BaseException as e:
                problems.append("submitter: %r" % (e,))
                return

    def race_round(r):
        kind = _aio.Handle if r % 2 == 0 else AioHandle
        workers = 1 if backend_of(r) == "aio" else 1 + r % 3
        h = kind(backend=backend_of(r), block_size=4096, queue_depth=4, intra_op_parallelism=workers)
        started = []
        close_after = r % 6
        t = threading.Thread(target=submitter, args=(h, started, r))
        t.start()
        while len(started) < close_after and t.is_alive():
            time.sleep(0)
        try:
            h.close()
        except BaseException as e:
            problems.append("close: %r" % (e,))
        t.join()
        stats["submitted"] += len(started)
        if kind is AioHandle:
            calls = [lambda: h.async_pwrite(wbuf[:REC], rpath, 0), lambda: h.sync_pread(rbuf[:REC], rpath, 0)]
        else:
            calls = [lambda: h.pwrite(wbuf.ctypes.data, REC, wpath, 0, True),
                     lambda: h.pread(rbuf.ctypes.data, REC, rpath, 0, False)]
        for i, call in enumerate(calls):
            try:
                call()
                problems.append("round %d: submission %d after close did not raise" % (r, i))
            except ValueError as e:
                if str(e) != CLOSED:
                    problems.append("round %d: submission %d after close: %r" % (r, i, str(e)))
                else:
                    stats["refused_after_close"] += 1

    def fault_round(r):
        # One write fails (injected allocation failure in the worker); wait() and close() then run at once.
        raw = r % 8 == 7  # the binding itself, or the Python face
        h = (_aio.Handle if raw else AioHandle)(backend=backend_of(r), block_size=4096)
        _aio._inject_alloc_failure(1, "submit")
        if raw:
            h.pwrite(wbuf.ctypes.data, REC, fpath, 0, True)
        else:
            h.async_pwrite(wbuf[:REC], fpath, 0)
        reported, barrier = [], threading.Barrier(2)

        def call(name, fn):
            barrier.wait()
            try:
                fn()
            except AioError as e:
                reported.append(name)
                if e.errno != errno.ENOMEM or e.op != "write" or e.filename != fpath:
                    problems.append("round %d: %s raised %r" % (r, name, e))
            except BaseException as e:
                problems.append("round %d: %s raised %r" % (r, name, e))

        calls = (("wait", h.wait), ("close", h.close))
        threads = [threading.Thread(target=call, args=call_args) for call_args in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if _aio._alloc_failure_countdown() != 0:
            problems.append("round %d: the injected failure did not fire" % r)
        _aio._inject_alloc_failure(0)
        if len(reported) != 1:
            problems.append("round %d: the failed write was reported by %s" % (r, reported or "nobody"))
        stats["fault_rounds"] += 1

    t0 = time.monotonic()
    for r in range(rounds):
        (fault_round if r % 4 == 3 else race_round)(r)
        stats["rounds"] += 1
        if len(problems) > 20:
            break
    stats["seconds"] = round(time.monotonic() - t0, 2)
    print("RESULT " + json.dumps({"problems": problems, **stats}))
    """
)


def run_stress(rounds: int, io_dir: str, timeout: float) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", STRESS, str(rounds), io_dir],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        raise AssertionError(f"the stress child was killed by {name}:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["problems"] == [], result
    assert result["rounds"] == rounds
    assert result["refused_after_close"] == 2 * (rounds - result["fault_rounds"])
    return result


def test_close_racing_submitters_and_wait(io_dir):
    result = run_stress(300, io_dir, timeout=120)
    assert result["fault_rounds"] == 75


@pytest.mark.slow
def test_close_racing_submitters_and_wait_3000_rounds(io_dir):
    result = run_stress(3000, io_dir, timeout=900)
    assert result["fault_rounds"] == 750


# A submission held inside open() (a FIFO without a reader) while another thread closes the handle: close()
# must wait for it rather than take the workers away under it. Deterministic; in a child, since the old
# failure was a SIGFPE.

HELD_IN_OPEN = textwrap.dedent(
    """
    import json, os, platform, sys, threading, time
    import numpy as np
    from offload import _aio

    fifo, backend = sys.argv[1], sys.argv[2]
    OPENAT = {"x86_64": 257, "aarch64": 56}.get(platform.machine())
    os.mkfifo(fifo, 0o600)
    h = _aio.Handle(backend=backend)
    buf = np.ones(8192, np.uint8)
    tid, outcome, closed = [], [], []

    def submit():
        tid.append(threading.get_native_id())
        try:
            h.pwrite(buf.ctypes.data, buf.nbytes, fifo, 0, False)
            outcome.append("completed")
        except _aio.AioError:
            outcome.append("AioError")  # a FIFO cannot be written at an offset on every backend: fine
        except BaseException as e:
            outcome.append(repr(e))

    def in_openat():
        try:
            with open("/proc/self/task/%d/syscall" % tid[0]) as f:
                return f.read().split()[0] == str(OPENAT)
        except (IndexError, OSError):
            return False

    if OPENAT is None:
        pytest.skip("openat's syscall number on this architecture is not known to the test")
    submitter = threading.Thread(target=submit)
    submitter.start()
    deadline = time.monotonic() + 20
    while not in_openat() and time.monotonic() < deadline:  # until the submission blocks in open()
        time.sleep(0.001)
    blocked = in_openat()
    closer = threading.Thread(target=lambda: (h.close(), closed.append(True)))
    closer.start()
    closer.join(timeout=0.1)  # the submission cannot finish while the FIFO has no reader
    close_waited = not closed
    rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the submission's open() return
    submitter.join(30)
    closer.join(30)
    os.close(rfd)
    try:
        h.pwrite(buf.ctypes.data, 10, fifo, 0, True)
        after = "accepted"
    except ValueError as e:
        after = str(e)
    print("RESULT " + json.dumps({"blocked": blocked, "close_waited": close_waited, "outcome": outcome,
                                  "closed": closed, "after": after}))
    """
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_waits_for_a_submission_still_opening_its_file(io_dir, backend):
    fifo = os.path.join(io_dir, "fifo")
    proc = subprocess.run(
        [sys.executable, "-c", HELD_IN_OPEN, fifo, backend],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        raise AssertionError(f"the child was killed by {name}:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["blocked"], "the submission never blocked in open()"
    assert result["close_waited"], "close() returned while a submission was still opening its file"
    assert result["outcome"] in (["completed"], ["AioError"]), result
    assert result["closed"] == [True] and result["after"] == CLOSED, result


# ---------------------------------------------------------------------------------------------------------
# In process: the contract, deterministically.


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_submission_after_close_is_refused(io_dir, backend):
    path = os.path.join(io_dir, "f.bin")
    buf = np.arange(8192, dtype=np.uint8)
    h = AioHandle(backend=backend)
    h.sync_pwrite(buf, path)
    h.close()
    for call in (h.sync_pwrite, h.async_pwrite, h.sync_pread, h.async_pread):
        with pytest.raises(ValueError, match=CLOSED):
            call(buf, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match=CLOSED):
            h.async_pread(buf, fd)
    finally:
        os.close(fd)
    assert h.wait() == 0 and h.pending() == 0
    h.close()  # idempotent


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_waits_for_a_sync_request_in_another_thread(io_dir, backend):
    # A request the workers have not started (paused) when close() begins still completes, and its caller
    # gets the byte count; nothing submitted after close() began is accepted.
    path = os.path.join(io_dir, "f.bin")
    data = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8)
    h = _aio.Handle(block_size=64 << 10, backend=backend)
    h._set_paused(True)
    got = []
    t = threading.Thread(target=lambda: got.append(h.pwrite(data.ctypes.data, data.nbytes, path, 0, False)))
    t.start()
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.001)
    h.close()
    t.join()
    assert got == [data.nbytes]
    with open(path, "rb") as f:
        assert f.read() == data.tobytes()
    with pytest.raises(ValueError, match=CLOSED):
        h.pwrite(data.ctypes.data, 10, path, 0, True)


@pytest.mark.parametrize("closer_first", [True, False])
def test_failed_write_reported_by_exactly_one_of_wait_and_close(io_dir, closer_first):
    path = os.path.join(io_dir, "f.bin")
    buf = np.ones(8192, np.uint8)
    h = AioHandle(block_size=4096)
    _aio._inject_alloc_failure(1, "submit")
    try:
        h.async_pwrite(buf, path)
        calls = [h.close, h.wait] if closer_first else [h.wait, h.close]
        errors = []
        for call in calls:
            try:
                call()
            except AioError as e:
                errors.append(e)
        assert _aio._alloc_failure_countdown() == 0
    finally:
        _aio._inject_alloc_failure(0)
    assert len(errors) == 1 and errors[0].errno == errno.ENOMEM and errors[0].filename == path


# ---------------------------------------------------------------------------------------------------------
# The core under sanitizers: aio_csrc/tests/close_race_test.cpp, 3000 rounds.

SANITIZERS = {
    "thread": (["-fsanitize=thread"], ("ThreadSanitizer",)),
    "address,undefined": (
        ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
        ("AddressSanitizer", "LeakSanitizer", "runtime error:", "UndefinedBehaviorSanitizer"),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("sanitizer", list(SANITIZERS))
def test_core_close_race_under_sanitizer(tmp_path, sanitizer):
    flags, markers = SANITIZERS[sanitizer]
    exe = build_core_program(tmp_path, os.path.join(CSRC, "tests", "close_race_test.cpp"), flags)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = dict(os.environ)
    env["TSAN_OPTIONS"] = "halt_on_error=1:exitcode=66:second_deadlock_stack=1"
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0:exitcode=66"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    run = subprocess.run([exe, str(scratch), "3000"], capture_output=True, text=True, timeout=1500, env=env)
    if run.returncode != 0 and "FATAL: ThreadSanitizer: unexpected memory mapping" in run.stderr:
        pytest.skip("ThreadSanitizer cannot run with this kernel's address space layout")
    report = f"rc={run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr[-8000:]}"
    for marker in markers:
        assert marker not in run.stderr, report
    assert run.returncode == 0, report
    assert "3000 rounds" in run.stdout and "ALL OK" in run.stdout, report
