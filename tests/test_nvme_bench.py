"""ds-nvme-bench: the sweep runs and verifies data, the profile has its fields, the written aio config loads
into the engine's config unchanged, and bad input ends with exit status 2 and one line naming the problem."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("offload._aio", reason="offload._aio is not built (setup.py build_ext --inplace)")

from offload.bench.errors import BenchError, VerificationError  # noqa: E402
from offload.bench.grid import AioParams, MiB, expand_grid, parse_size  # noqa: E402
from offload.bench.nvme import BenchFile  # noqa: E402
from offload.bench.pattern import PAGE, Pattern  # noqa: E402
from offload.bench.profile import PROFILE_FIELDS, ProfileError, load_machine_profile  # noqa: E402
from offload.cli.nvme_bench import main  # noqa: E402
from offload.config import AioConfig, load_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_POINT = json.dumps({"block_size": ["1M"], "queue_depth": [8]})


def _error_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.strip()]


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One --quick run shared by the tests that inspect its outputs (the sweep is the slow part)."""
    work = tmp_path_factory.mktemp("quick")
    data = work / "data"
    data.mkdir()
    out = {"json": str(work / "profile.json"), "config": str(work / "aio.json"), "dir": str(data)}
    rc = main(
        ["--path", str(data), "--quick", "--size", "4M", "--repeats", "1"]
        + ["--json", out["json"], "--write-config", out["config"]]
    )
    out["rc"] = rc
    return out


def test_quick_run_writes_a_complete_profile(quick_run: dict) -> None:
    assert quick_run["rc"] == 0
    profile = load_machine_profile(quick_run["json"])
    for name in PROFILE_FIELDS:
        assert name in profile
    assert profile["nvme_path"] == os.path.abspath(quick_run["dir"])
    assert profile["ram_bytes"] > 0 and profile["nvme_free_bytes"] > 0
    assert profile["size_bytes"] == 4 * MiB
    assert profile["nvme_read_gbps"] > 0 and profile["nvme_write_gbps"] > 0
    assert profile["host_copy_gbps"] > 0
    if profile["gpu_bytes"] == 0:
        assert profile["h2d_gbps"] is None and profile["d2h_gbps"] is None
    # The quick grid: 3 block sizes x 2 queue depths x every usable backend, each measured both ways.
    from offload import _aio

    assert len(profile["results"]) == 3 * 2 * len(_aio.available_backends())
    for r in profile["results"]:
        assert r["read_gbps"] > 0 and r["write_gbps"] > 0 and len(r["read_samples_gbps"]) == 1
    best_read = max(r["read_gbps"] for r in profile["results"])
    assert profile["nvme_read_gbps"] == pytest.approx(best_read)
    assert set(profile["best_aio"]) == set(AioParams.__dataclass_fields__)
    # The test file is removed afterwards.
    assert os.listdir(quick_run["dir"]) == []


def test_the_memory_estimator_reads_the_profile(quick_run: dict) -> None:
    estimate = pytest.importorskip("offload.estimate")
    machine = estimate.load_machine_profile(quick_run["json"])
    profile = load_machine_profile(quick_run["json"])
    assert machine.nvme_read_gbps == profile["nvme_read_gbps"]
    assert machine.nvme_write_gbps == profile["nvme_write_gbps"]
    assert machine.ram_bytes == profile["ram_bytes"]
    # The bench writes gpu_bytes 0 when no CUDA device was measured; the estimator reads that as "unknown".
    assert machine.gpu_bytes == (profile["gpu_bytes"] or None)


def test_written_config_loads_into_the_engine_config_unchanged(quick_run: dict) -> None:
    with open(quick_run["config"]) as f:
        written = json.load(f)
    assert list(written) == ["aio"]
    assert set(written["aio"]) == set(AioConfig.__dataclass_fields__)
    cfg = load_config(quick_run["config"])
    measured = load_machine_profile(quick_run["json"])["best_aio"]
    assert cfg.aio == AioConfig(**measured)
    for key, value in measured.items():
        assert getattr(cfg.aio, key) == value and type(getattr(cfg.aio, key)) is type(value)


def test_read_only_and_write_only_measure_one_direction(tmp_path: pytest.TempPathFactory, capsys) -> None:
    for flag, measured, skipped in (("--read-only", "read", "write"), ("--write-only", "write", "read")):
        out = tmp_path / f"{measured}.json"
        rc, stdout, _ = _run(
            capsys,
            "--path",
            str(tmp_path),
            "--size",
            "2M",
            "--repeats",
            "2",
            "--grid",
            ONE_POINT,
            flag,
            "--json",
            str(out),
        )
        assert rc == 0
        profile = load_machine_profile(str(out))
        (result,) = profile["results"]
        assert len(result[f"{measured}_samples_gbps"]) == 2 and result[f"{skipped}_samples_gbps"] == []
        assert profile[f"nvme_{skipped}_gbps"] is None and profile[f"nvme_{measured}_gbps"] > 0
        assert "best for" in stdout


def _tmpfs_refusing_o_direct() -> str:
    """/dev/shm when our library refuses O_DIRECT there (EINVAL with direct="on"), else ''."""
    from offload import _aio

    path = "/dev/shm"
    if not os.path.isdir(path) or os.statvfs(path).f_bavail * os.statvfs(path).f_frsize < 64 * MiB:
        return ""
    probe = os.path.join(path, f".ds_nvme_bench_test.{os.getpid()}")
    page = np.zeros(PAGE, dtype=np.uint8)
    handle = _aio.Handle(direct="on")
    try:
        handle.pwrite(page.ctypes.data, PAGE, probe, 0, False)
        return ""
    except OSError as e:
        return path if e.errno == errno.EINVAL else ""
    finally:
        handle.close()
        if os.path.exists(probe):
            os.unlink(probe)


def test_without_o_direct_the_run_says_so(tmp_path, capsys) -> None:
    shm = _tmpfs_refusing_o_direct()
    if not shm:
        pytest.skip("no tmpfs that refuses O_DIRECT here")
    out = tmp_path / "p.json"
    rc, stdout, err = _run(
        capsys, "--path", shm, "--size", "2M", "--repeats", "1", "--grid", ONE_POINT, "--json", str(out)
    )
    assert rc == 0
    profile = load_machine_profile(str(out))
    assert profile["direct_io"] is False and profile["nvme_filesystem"] == "tmpfs"
    assert any("O_DIRECT refused" in n for n in profile["notes"])
    assert "O_DIRECT OFF" in stdout and "O_DIRECT refused" in err
    assert not [f for f in os.listdir(shm) if f.startswith(f".ds_nvme_bench.{os.getpid()}")]


def test_bad_path_exits_2_with_one_line(tmp_path, capsys) -> None:
    missing = tmp_path / "nope"
    rc, _, err = _run(capsys, "--path", str(missing), "--quick")
    assert rc == 2
    assert _error_lines(err) == [f"ds-nvme-bench: error: --path {missing}: does not exist"]

    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    rc, _, err = _run(capsys, "--path", str(a_file), "--quick")
    assert rc == 2 and len(_error_lines(err)) == 1 and "is not a directory" in err


def test_size_beyond_free_space_is_refused(tmp_path, capsys) -> None:
    rc, _, err = _run(capsys, "--path", str(tmp_path), "--size", "1000T")
    assert rc == 2 and len(_error_lines(err)) == 1
    assert "exceeds the space free" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "grid, complaint",
    [
        ('{"block_size": [0]}', "block_size"),
        ('{"block_size": ["huge"]}', "block_size"),
        ('{"queue_depth": [8, "deep"]}', "queue_depth"),
        ('{"intra_op_parallelism": [0]}', "intra_op_parallelism"),
        ('{"single_submit": ["yes"]}', "single_submit"),
        ('{"backend": ["spdk"]}', "backend"),
        ('{"queue_depht": [8]}', "queue_depht"),
        ('{"block_size": []}', "empty"),
        ('{"block_size": [1M]}', "invalid JSON"),
    ],
)
def test_invalid_grid_exits_2_with_one_line(tmp_path, capsys, grid: str, complaint: str) -> None:
    rc, _, err = _run(capsys, "--path", str(tmp_path), "--grid", grid)
    lines = _error_lines(err)
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("ds-nvme-bench: error: --grid") and complaint in lines[0]
    assert os.listdir(tmp_path) == []


def test_full_disk_exits_2_with_one_line(tmp_path) -> None:
    """RLIMIT_FSIZE stands in for a full disk: the first write past 1 MiB fails with EFBIG."""

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
        resource.setrlimit(resource.RLIMIT_FSIZE, (MiB, MiB))

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "offload.cli.nvme_bench",
            "--path",
            str(tmp_path),
            "--size",
            "8M",
            "--grid",
            ONE_POINT,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        timeout=120,
    )
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ds-nvme-bench: error:") and "EFBIG" in lines[0]
    assert os.listdir(tmp_path) == []  # the partial test file is removed


def test_plot_is_a_png(tmp_path, capsys) -> None:
    # matplotlib is part of the development environment (scripts/requirements-dev.txt): no skip.
    png = tmp_path / "bw.png"
    data = tmp_path / "data"
    data.mkdir()
    grid = json.dumps({"block_size": ["256K", "1M"], "queue_depth": [4, 16]})
    rc, stdout, _ = _run(
        capsys, "--path", str(data), "--size", "2M", "--repeats", "1", "--grid", grid, "--plot", str(png)
    )
    assert rc == 0
    assert f"wrote {png}" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert width > 2 * height * 0.9  # read and write panels side by side


def test_without_matplotlib_plot_fails_before_measuring(tmp_path, capsys, monkeypatch) -> None:
    import offload.bench.plot

    monkeypatch.setattr(offload.bench.plot, "plot_available", lambda: False)
    png = tmp_path / "bw.png"
    data = tmp_path / "data"
    data.mkdir()
    rc, stdout, err = _run(
        capsys,
        "--path",
        str(data),
        "--size",
        "1M",
        "--repeats",
        "1",
        "--grid",
        ONE_POINT,
        "--plot",
        str(png),
        "--write-config",
        str(tmp_path / "aio.json"),
    )
    assert rc == 2 and stdout == ""
    (line,) = _error_lines(err)
    assert line.startswith("ds-nvme-bench: error: --plot") and "pip install matplotlib" in line
    assert sorted(os.listdir(tmp_path)) == ["data"] and os.listdir(data) == []  # nothing measured or written


def test_without_torch_the_tool_fails_before_measuring(tmp_path) -> None:
    # tools/ds_nvme_bench.py (the source-checkout entry point) in a Python where `import torch` fails.
    data = tmp_path / "data"
    data.mkdir()
    argv = ["--path", str(data), "--size", "1M", "--repeats", "1", "--grid", ONE_POINT]
    argv += ["--json", str(tmp_path / "p.json")]
    shim = (
        "import runpy, sys\n"
        "sys.modules['torch'] = None  # any import of torch raises ImportError\n"
        f"sys.argv = [{os.path.join(REPO, 'tools', 'ds_nvme_bench.py')!r}, *{argv!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", shim], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert line.startswith("ds-nvme-bench: error: torch cannot be imported"), line
    assert proc.stdout == "" and "GB/s" not in proc.stderr  # no measurement ran
    assert sorted(os.listdir(tmp_path)) == ["data"] and os.listdir(data) == []


def test_fio_comparison_when_fio_is_installed(tmp_path, capsys) -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    out = tmp_path / "p.json"
    data = tmp_path / "data"
    data.mkdir()
    rc, stdout, _ = _run(
        capsys,
        "--path",
        str(data),
        "--size",
        "4M",
        "--repeats",
        "1",
        "--grid",
        ONE_POINT,
        "--fio",
        "--json",
        str(out),
    )
    assert rc == 0
    fio = load_machine_profile(str(out))["fio"]
    assert [c["op"] for c in fio] == ["read", "write"]
    for c in fio:
        assert c["fio_gbps"] > 0 and c["ours_gbps"] > 0
        assert c["ratio_ours_to_fio"] == pytest.approx(c["ours_gbps"] / c["fio_gbps"])
    assert "ours/fio" in stdout


# -- the pieces the honesty of the numbers rests on ---------------------------------------------------------
def test_pattern_check_catches_reads_that_did_not_land_or_landed_wrong() -> None:
    pattern = Pattern(seed=5)
    buf = np.zeros(64 * PAGE, dtype=np.uint8)
    pattern.fill(buf)
    pages = pattern.sample(64)
    assert 0 in pages and 63 in pages
    pattern.verify(buf, pages, "intact")
    # Poisoned pages that no read overwrote.
    pattern.poison(buf, pages)
    with pytest.raises(VerificationError, match="data mismatch in page 0"):
        pattern.verify(buf, pages, "not read")
    # A page from 1 MiB further on shares the random bytes and differs in its header alone.
    big = np.zeros(512 * PAGE, dtype=np.uint8)
    pattern.fill(big)
    big[:PAGE] = big[256 * PAGE : 257 * PAGE]
    # The page index 256 is 0x100 in the little-endian header's second word: byte 9 tells them apart.
    with pytest.raises(VerificationError, match="first wrong byte at \\+9: 0x01 != 0x00"):
        pattern.verify(big, [0], "from the wrong offset")


def test_a_read_that_moves_nothing_fails_verification(tmp_path) -> None:
    class NoopHandle:
        def pread(self, *args: object) -> int:
            return 0

        def wait(self) -> int:
            return 0

    with BenchFile(str(tmp_path), 2 * MiB, 2 * MiB) as bench:
        bench.layout()
        with pytest.raises(VerificationError, match="data mismatch"):
            bench.read(NoopHandle(), "a handle that moves no data")
        # A real handle reads the pattern back, with O_DIRECT on this filesystem.
        with bench.handle(AioParams(MiB, 8, 1, False, True, "auto")) as h:
            sample = bench.read(h, "real")
        assert sample.nbytes == 2 * MiB and sample.gbps > 0


def test_file_larger_than_buffer_is_moved_in_chunks_and_verified(tmp_path) -> None:
    with BenchFile(str(tmp_path), 6 * MiB, 2 * MiB) as bench:
        bench.layout()
        assert os.path.getsize(bench.path) == 6 * MiB
        with bench.handle(AioParams(MiB, 8, 2, False, True, "auto")) as h:
            bench.write(h)
            bench.verify_file("chunks")
            assert bench.read(h, "chunks").nbytes == 6 * MiB
        # The last chunk of the file holds the buffer's image, page headers included.
        with open(bench.path, "rb") as f:
            f.seek(4 * MiB)
            assert f.read(2 * MiB) == bytes(bench.view)
    assert os.listdir(tmp_path) == []


def test_sizes_and_grids_are_parsed_strictly() -> None:
    assert parse_size("4M") == 4 * MiB and parse_size("256KiB") == 256 * 1024 and parse_size(4096) == 4096
    assert parse_size("1.5G") == 3 * (1 << 29)
    for bad in ("", "4Q", "-1", True, "0"):
        with pytest.raises(BenchError):
            parse_size(bad)
    base = {
        "block_size": [MiB],
        "queue_depth": [32],
        "intra_op_parallelism": [1],
        "single_submit": [False],
        "overlap_events": [True],
        "backend": ["psync"],
    }
    points = expand_grid(
        {"block_size": ["1M", 1048576, "2M"], "single_submit": [True, False]}, ["psync"], base
    )
    assert [(p.block_size, p.single_submit) for p in points] == [
        (MiB, True),
        (MiB, False),
        (2 * MiB, True),
        (2 * MiB, False),
    ]


def test_profile_loader_names_the_missing_field(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"ram_bytes": 1}))
    with pytest.raises(ProfileError, match="missing field 'gpu_bytes'"):
        load_machine_profile(str(path))
