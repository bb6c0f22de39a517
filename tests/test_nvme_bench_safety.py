"""ds-nvme-bench leaves nothing behind and overwrites nothing by surprise.

- an existing --json / --write-config / --plot file is kept unless --force, and the refusal (exit 2, one
  line naming the file) comes before anything is measured;
- a directory, or a place where no file can be created, is refused as an output before the run;
- reports are written atomically (temporary file in the same directory, fsync, rename);
- the test file is removed at exit and on SIGTERM, a fio still running is killed, and a raised
  vm.nr_hugepages is restored, on SIGTERM too. The huge-page tests use a scratch file as the
  vm.nr_hugepages control (DS_NVME_BENCH_NR_HUGEPAGES) and a simulated /proc/meminfo: the real sysctl is
  never touched.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

pytest.importorskip("offload._aio", reason="offload._aio is not built (setup.py build_ext --inplace)")

from offload.bench import fio as fio_mod  # noqa: E402
from offload.bench import nvme  # noqa: E402
from offload.bench.errors import BenchError  # noqa: E402
from offload.bench.profile import load_machine_profile, write_json  # noqa: E402
from offload.cli.nvme_bench import main  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_POINT = json.dumps({"block_size": ["1M"], "queue_depth": [8]})
TINY_RUN = ["--size", "1M", "--repeats", "1", "--grid", ONE_POINT]
DEADLINE_S = 120.0  # a bound for waits on a child; every wait ends on an event, not on this timer


def _lines(text: str) -> list:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture
def bench_files(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every BenchFile the run creates (the test file is created by BenchFile.layout)."""
    created: list = []
    real = nvme.BenchFile

    def spy(*args: object, **kwargs: object) -> nvme.BenchFile:
        created.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(nvme, "BenchFile", spy)
    return created


@pytest.fixture
def data_dir(tmp_path) -> str:
    path = tmp_path / "data"
    path.mkdir()
    return str(path)


# -- existing outputs and --force -------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--json", "--write-config", "--plot"])
def test_existing_output_without_force_exits_2_before_measuring(
    tmp_path, capsys, bench_files: list, data_dir: str, option: str
) -> None:
    target = tmp_path / "out.file"
    target.write_text("keep me\n")
    rc = main(["--path", data_dir, *TINY_RUN, option, str(target)])
    err = capsys.readouterr().err
    assert rc == 2
    assert _lines(err) == [
        f"ds-nvme-bench: error: {option} {target}: already exists (pass --force to overwrite it)"
    ]
    assert target.read_text() == "keep me\n"
    assert bench_files == []  # no test file was created: nothing was measured
    assert os.listdir(data_dir) == []
    assert sorted(os.listdir(tmp_path)) == ["data", "out.file"]  # no probe or temporary file left


def test_force_overwrites_existing_outputs(tmp_path, capsys, data_dir: str) -> None:
    profile, config = tmp_path / "profile.json", tmp_path / "aio.json"
    profile.write_text("old profile")
    config.write_text("old config")
    rc = main(
        ["--path", data_dir, *TINY_RUN, "--json", str(profile), "--write-config", str(config), "--force"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert load_machine_profile(str(profile))["nvme_read_gbps"] > 0
    assert list(json.loads(config.read_text())) == ["aio"]
    assert f"wrote {profile}" in out and f"wrote {config}" in out
    assert sorted(os.listdir(tmp_path)) == ["aio.json", "data", "profile.json"]
    assert os.listdir(data_dir) == []


def test_two_options_naming_one_file_exit_2(tmp_path, capsys, bench_files: list, data_dir: str) -> None:
    target = tmp_path / "same.json"
    rc = main(["--path", data_dir, *TINY_RUN, "--json", str(target), "--write-config", str(target)])
    err = capsys.readouterr().err
    assert rc == 2 and len(_lines(err)) == 1
    assert "--json and --write-config both name" in err and str(target) in err
    assert bench_files == [] and not target.exists()


# -- outputs that cannot be written ---------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--json", "--write-config", "--plot"])
@pytest.mark.parametrize("force", [False, True])
def test_directory_as_output_is_refused_before_the_run(
    tmp_path, capsys, bench_files: list, data_dir: str, option: str, force: bool
) -> None:
    target = tmp_path / "reports"
    target.mkdir()
    rc = main(["--path", data_dir, *TINY_RUN, option, str(target)] + (["--force"] if force else []))
    err = capsys.readouterr().err
    assert rc == 2
    assert _lines(err) == [f"ds-nvme-bench: error: {option} {target}: is a directory (name a file to write)"]
    assert bench_files == [] and os.listdir(target) == [] and os.listdir(data_dir) == []


def test_output_where_no_file_can_be_created_is_refused_before_the_run(
    capsys, bench_files: list, data_dir: str
) -> None:
    """/proc takes no new files, whatever the permission bits say (root passes access(2) checks there)."""
    target = "/proc/ds_nvme_bench_report.json"
    rc = main(["--path", data_dir, *TINY_RUN, "--json", target])
    err = capsys.readouterr().err
    assert rc == 2 and len(_lines(err)) == 1
    assert f"--json {target}: directory /proc is not writable" in err
    assert bench_files == []


def test_output_whose_parent_is_missing_or_a_file_is_refused(
    tmp_path, capsys, bench_files: list, data_dir: str
) -> None:
    missing = tmp_path / "nope" / "p.json"
    rc = main(["--path", data_dir, *TINY_RUN, "--json", str(missing)])
    err = capsys.readouterr().err
    assert rc == 2 and _lines(err) == [
        f"ds-nvme-bench: error: --json {missing}: directory {missing.parent} does not exist"
    ]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    rc = main(["--path", data_dir, *TINY_RUN, "--write-config", str(a_file / "aio.json")])
    err = capsys.readouterr().err
    assert rc == 2 and _lines(err) == [
        f"ds-nvme-bench: error: --write-config {a_file / 'aio.json'}: {a_file} is not a directory"
    ]
    assert bench_files == []


def test_symlinks_are_written_through_and_special_files_refused(
    tmp_path, capsys, bench_files: list, data_dir: str
) -> None:
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    rc = main(["--path", data_dir, *TINY_RUN, "--write-config", str(link), "--force"])
    capsys.readouterr()
    assert rc == 0 and link.is_symlink() and os.readlink(link) == str(real)
    assert list(json.loads(real.read_text())) == ["aio"]

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "missing")
    created = len(bench_files)
    for target, complaint in ((fifo, "is not a regular file"), (dangling, "is a symlink to a missing file")):
        rc = main(["--path", data_dir, *TINY_RUN, "--json", str(target), "--force"])
        err = capsys.readouterr().err
        assert rc == 2 and _lines(err) == [
            f"ds-nvme-bench: error: --json {target}: {complaint}; it is never overwritten"
        ]
    assert len(bench_files) == created and fifo.is_fifo() and dangling.is_symlink()


# -- atomic writes ----------------------------------------------------------------------------------------
def test_report_is_fsynced_in_its_own_directory_then_renamed(tmp_path, monkeypatch) -> None:
    target = tmp_path / "profile.json"
    target.write_text("old")
    events: list = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", src, dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_json({"a": 1}, str(target))
    (replaced,) = [e for e in events if e[0] == "replace"]
    _, tmp, dst = replaced
    assert os.path.dirname(tmp) == str(tmp_path) and dst == str(target)
    assert events.index(("fsync", tmp)) < events.index(replaced)  # the data is on disk before the rename
    assert json.loads(target.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["profile.json"]


def test_failed_write_keeps_the_old_report_and_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    target = tmp_path / "profile.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_json({"ok": 1, "bad": object()}, str(target))  # not serialisable half-way through
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["profile.json"]

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError):
        write_json({"a": 1}, str(target))
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["profile.json"]


def test_without_overwrite_a_file_that_appeared_meanwhile_is_kept(tmp_path) -> None:
    target = tmp_path / "aio.json"
    write_json({"a": 1}, str(target), overwrite=False)
    assert json.loads(target.read_text()) == {"a": 1}
    with pytest.raises(BenchError, match="not overwritten"):
        write_json({"a": 2}, str(target), overwrite=False)
    assert json.loads(target.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["aio.json"]


# -- the test file ----------------------------------------------------------------------------------------
def test_test_file_is_removed_at_normal_exit_without_close(data_dir: str) -> None:
    """A caller that never closes its BenchFile still leaves no file: the removal runs at exit."""
    code = textwrap.dedent(
        f"""
        from offload.bench.nvme import BenchFile
        bench = BenchFile({data_dir!r}, 1 << 20, 1 << 20)
        bench.layout()
        print(bench.path, flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(os.path.join(data_dir, ".ds_nvme_bench."))
    assert os.listdir(data_dir) == []


def _watchdog(proc: subprocess.Popen) -> threading.Timer:
    """Kills `proc` if the test hangs; it never decides the outcome of a passing test."""
    timer = threading.Timer(DEADLINE_S, proc.kill)
    timer.daemon = True
    timer.start()
    return timer


def test_sigterm_removes_the_test_file_and_writes_no_report(tmp_path, data_dir: str) -> None:
    report = tmp_path / "out" / "profile.json"
    report.parent.mkdir()
    cmd = [sys.executable, "-m", "offload.cli.nvme_bench", "--path", data_dir, "--size", "1M"]
    cmd += ["--repeats", "1000000", "--grid", ONE_POINT, "--json", str(report)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    timer = _watchdog(proc)
    try:
        # The first progress line comes after the first measurement: the test file exists from then on.
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("ds-nvme-bench ["):
                break
        else:
            pytest.fail(f"the bench ended before measuring: {''.join(seen)}")
        assert [f for f in os.listdir(data_dir) if f.startswith(".ds_nvme_bench.")], "no test file"
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=DEADLINE_S) == -signal.SIGTERM, rest
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert os.listdir(data_dir) == []
    assert os.listdir(report.parent) == []  # neither a report nor a temporary file


# -- vm.nr_hugepages --------------------------------------------------------------------------------------
BASE_PAGES = 7  # huge pages in use by "others" in the simulated kernel: all of the initial value


def _simulate_kernel(monkeypatch: pytest.MonkeyPatch, sysctl: str) -> None:
    """HugePages_Free follows the scratch control file as the kernel's would follow vm.nr_hugepages."""
    real = fio_mod._meminfo

    def meminfo(key: str) -> int:
        if key == "HugePages_Free":
            with open(sysctl) as f:
                return int(f.read()) - BASE_PAGES
        return real(key)

    monkeypatch.setattr(fio_mod, "_meminfo", meminfo)


@pytest.fixture
def sysctl(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    path = tmp_path / "nr_hugepages"
    path.write_text(f"{BASE_PAGES}\n")
    monkeypatch.setenv("DS_NVME_BENCH_NR_HUGEPAGES", str(path))
    _simulate_kernel(monkeypatch, str(path))
    return str(path)


def _pages(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def test_hugepages_are_restored_after_the_block_and_after_an_error(sysctl: str) -> None:
    pages = fio_mod.HugePages(4)
    assert pages.sysctl == sysctl  # the environment variable is honoured: the real sysctl stays untouched
    with pages:
        assert pages.available and _pages(sysctl) == BASE_PAGES + 4
    assert _pages(sysctl) == BASE_PAGES

    with pytest.raises(KeyboardInterrupt):
        with fio_mod.HugePages(4, sysctl=sysctl) as pages:
            assert _pages(sysctl) == BASE_PAGES + 4
            raise KeyboardInterrupt
    assert _pages(sysctl) == BASE_PAGES


def test_hugepages_are_restored_when_entering_fails_after_the_raise(sysctl: str, monkeypatch) -> None:
    calls = []

    def meminfo(key: str) -> int:
        calls.append(key)
        if len(calls) > 1:  # the check after raising the value
            raise KeyboardInterrupt
        return 0

    monkeypatch.setattr(fio_mod, "_meminfo", meminfo)
    with pytest.raises(KeyboardInterrupt):
        with fio_mod.HugePages(4, sysctl=sysctl):
            pytest.fail("the block must not run")
    assert len(calls) == 2 and _pages(sysctl) == BASE_PAGES


_WRAPPER = """
import os, sys
import offload.bench.fio as fio

sysctl = os.environ["DS_NVME_BENCH_NR_HUGEPAGES"]
if getattr(fio, "nr_hugepages_path", lambda: None)() != sysctl:  # the real sysctl is never touched
    sys.exit("this offload.bench.fio does not honour DS_NVME_BENCH_NR_HUGEPAGES: not run")
real = fio._meminfo

def meminfo(key):
    if key == "HugePages_Free":
        with open(sysctl) as f:
            return int(f.read()) - {base}
    return real(key)

fio._meminfo = meminfo
from offload.cli.nvme_bench import main
sys.exit(main())
"""

_FAKE_FIO = """#!{python}
import os, signal
with open(os.environ["FAKE_FIO_SYNC"], "w") as f:
    f.write(f"{{os.getpid()}}\\n")
signal.pause()
"""


def _read_line(fd: int, proc: subprocess.Popen) -> str:
    """One line from the FIFO `fd` (opened O_NONBLOCK); fails as soon as `proc` closes its stderr (ends)."""
    data, errors = b"", b""
    err = proc.stderr.fileno()
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd, err], [], [], DEADLINE_S)
        if not ready:
            pytest.fail("no line from the fake fio")
        if fd in ready:
            data += os.read(fd, 64)
        elif err in ready:
            chunk = os.read(err, 4096)
            if not chunk:
                proc.wait()
                pytest.fail(f"the bench exited with {proc.returncode}: {errors.decode(errors='replace')}")
            errors += chunk
    return data.decode().strip()


def test_sigterm_during_fio_restores_hugepages_kills_fio_and_removes_the_test_file(
    tmp_path, data_dir: str
) -> None:
    sysctl = tmp_path / "nr_hugepages"
    sysctl.write_text(f"{BASE_PAGES}\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake_fio = bindir / "fio"
    fake_fio.write_text(_FAKE_FIO.format(python=sys.executable))
    fake_fio.chmod(0o755)
    wrapper = tmp_path / "bench.py"
    wrapper.write_text(_WRAPPER.format(base=BASE_PAGES))
    sync = str(tmp_path / "sync")
    os.mkfifo(sync)
    env = dict(os.environ, DS_NVME_BENCH_NR_HUGEPAGES=str(sysctl), FAKE_FIO_SYNC=sync)
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    fd = os.open(sync, os.O_RDONLY | os.O_NONBLOCK)  # before the writer: its open must not block
    proc = subprocess.Popen(
        [sys.executable, str(wrapper), "--path", data_dir, *TINY_RUN, "--fio"],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    timer = _watchdog(proc)
    fio_pidfd = None
    try:
        fio_pid = int(_read_line(fd, proc))
        fio_pidfd = os.pidfd_open(fio_pid)
        # fio runs with huge-page buffers: the control was raised, and the test file is there.
        assert _pages(str(sysctl)) > BASE_PAGES
        assert [f for f in os.listdir(data_dir) if f.startswith(".ds_nvme_bench.")], "no test file"
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read().decode(errors="replace")
        assert proc.wait(timeout=DEADLINE_S) == -signal.SIGTERM, rest
        assert _pages(str(sysctl)) == BASE_PAGES
        assert os.listdir(data_dir) == []
        ended, _, _ = select.select([fio_pidfd], [], [], DEADLINE_S)  # readable once fio has exited
        assert ended, "fio was left running"
    finally:
        timer.cancel()
        os.close(fd)
        if fio_pidfd is not None:
            try:
                signal.pidfd_send_signal(fio_pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(fio_pidfd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
