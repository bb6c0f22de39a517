"""ds-nvme-bench: measure the storage tier chain and write an `aio` config the engine loads unchanged.

    ds-nvme-bench --path /mnt/nvme --quick --json profile.json --plot bw.png --write-config aio.json

Exit status: 0 done, 1 data read back differed from what was written, 2 bad input or unusable
environment (path, size, grid, full disk, an output file that exists without --force or cannot be
written), each with one line on stderr saying what was wrong.

Output files are checked before the first measurement and written atomically; the test file, temporary
files and a raised vm.nr_hugepages are undone at exit, on errors and on SIGTERM/SIGHUP (offload.cleanup).
"""

from __future__ import annotations

import argparse
import errno as errno_mod
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from offload.bench.errors import BenchError, VerificationError
from offload.bench.grid import (
    AioParams,
    GiB,
    MiB,
    default_grid,
    expand_grid,
    format_size,
    parse_size,
    quick_grid,
    read_grid_argument,
)
from offload.cli.pipe import quiet_broken_pipe

PROG = "ds-nvme-bench"
DEFAULT_SIZE = 1 * GiB
QUICK_SIZE = 256 * MiB
MAX_BUFFER = 1 * GiB
FREE_SPACE_SHARE = 0.95  # never fill a disk others are using to the last block


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `ds-nvme-bench`."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Measure NVMe read/write bandwidth over a grid of aio settings (O_DIRECT, verified "
        "data), the pinned-host and host<->GPU copy bandwidth, and write the best settings as an `aio` "
        "config section.",
    )
    p.add_argument(
        "--path", required=True, help="directory on the drive to measure (a temporary file is written there)"
    )
    p.add_argument(
        "--size",
        help=f"bytes each measurement moves, e.g. 512M, 2G (default {format_size(DEFAULT_SIZE)}, "
        f"{format_size(QUICK_SIZE)} with --quick, less when free space or RAM is short)",
    )
    p.add_argument(
        "--quick", action="store_true", help="a small grid and size: a first answer in under a minute"
    )
    p.add_argument(
        "--grid",
        help="custom sweep as JSON (inline or a file name): lists for any of block_size, queue_depth, "
        "intra_op_parallelism, backend, single_submit, overlap_events",
    )
    only = p.add_mutually_exclusive_group()
    only.add_argument("--read-only", action="store_true", help="measure reads only")
    only.add_argument("--write-only", action="store_true", help="measure writes only")
    p.add_argument(
        "--repeats", type=int, default=3, help="measurements per configuration; medians are reported"
    )
    p.add_argument("--json", metavar="OUT", help="write the machine profile (all results) as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="plot bandwidth against block size (needs matplotlib)")
    p.add_argument("--write-config", metavar="OUT.json", help='write {"aio": {...}} with the best settings')
    p.add_argument(
        "--fio", action="store_true", help="also run fio with the best settings, interleaved, and compare"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite --json, --write-config and --plot files that already exist (without it an existing "
        "file is an error, reported before anything is measured)",
    )
    return p


# -- argument checks (all before the first byte is written) -----------------------------------------------
def check_directory(path: str) -> str:
    """The directory to bench in (absolute), checked to exist and be writable; BenchError naming the reason
    (and errno) otherwise."""
    if not os.path.exists(path):
        raise BenchError(f"--path {path}: does not exist")
    if not os.path.isdir(path):
        raise BenchError(f"--path {path}: is not a directory")
    probe = os.path.join(path, f".ds_nvme_bench.probe.{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        name = errno_mod.errorcode.get(e.errno or 0, "?")
        raise BenchError(f"--path {path}: is not writable: {e.strerror} (errno {e.errno} {name})") from None
    os.close(fd)
    os.unlink(probe)
    return os.path.abspath(path)


def check_outputs(args: argparse.Namespace) -> None:
    """Every output file must be writable, and new unless --force, before anything is measured."""
    from offload.bench.outputs import check_targets

    check_targets(
        [("--json", args.json), ("--plot", args.plot), ("--write-config", args.write_config)], args.force
    )


def write_output(option: str, path: str, write: Any) -> None:
    """Run `write()` for one output file; an I/O error becomes one line naming the option and file."""
    from offload.bench.nvme import describe_os_error

    try:
        write()
    except OSError as e:
        raise BenchError(describe_os_error(e, f"writing {option} {path}:")) from None


def choose_size(text: Optional[str], quick: bool, free: int, ram: int) -> int:
    """The test file size in bytes: `text` if given, else a default bounded by free disk (`free`) and RAM
    (`ram`)."""
    limit = int(free * FREE_SPACE_SHARE)
    if text is not None:
        size = parse_size(text, "--size")
        if size < MiB:
            raise BenchError(f"--size {text}: must be at least 1M")
        if size > limit:
            raise BenchError(
                f"--size {text} ({size} bytes) exceeds the space free on --path "
                f"({free} bytes free; at most {limit} may be used)"
            )
    else:
        size = min(QUICK_SIZE if quick else DEFAULT_SIZE, free // 10, max(MiB, ram // 8))
        if size < MiB:
            raise BenchError(f"--path has only {free} bytes free: not enough for a measurement (1M at least)")
    return size // MiB * MiB  # whole MiB: aligned for O_DIRECT and for huge-page buffers


def grid_points(args: argparse.Namespace, backends: Sequence[str]) -> List[AioParams]:
    """The aio parameter sets to measure, from the command line or the default/quick grid."""
    if not backends:
        raise BenchError(
            "no I/O backend is usable on this system (offload._aio.available_backends() is empty)"
        )
    base = {
        "block_size": [MiB],
        "queue_depth": [32],
        "intra_op_parallelism": [1],
        "single_submit": [False],
        "overlap_events": [True],
        "backend": [backends[0]],
    }
    if args.grid is not None:
        return expand_grid(read_grid_argument(args.grid), backends, base)
    return expand_grid(quick_grid(backends) if args.quick else default_grid(backends), backends, base)


# -- reporting ------------------------------------------------------------------------------------------
def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_table(rows: Sequence[tuple]) -> str:
    """The results as a plain-text table, one row per parameter set."""
    headers = (
        "best for",
        "backend",
        "block",
        "qd",
        "threads",
        "submit",
        "overlap",
        "read GB/s",
        "CPU s/GB",
        "write GB/s",
        "CPU s/GB",
    )
    table: List[Sequence[str]] = [headers]
    for role, m in rows:
        if m is None:
            continue
        p = m.params
        table.append(
            (
                role,
                p.backend,
                format_size(p.block_size),
                str(p.queue_depth),
                str(p.intra_op_parallelism),
                "single" if p.single_submit else "batch",
                "yes" if p.overlap_events else "no",
                _fmt(m.gbps("read")),
                _fmt(m.cpu_s_per_gb("read"), 3),
                _fmt(m.gbps("write")),
                _fmt(m.cpu_s_per_gb("write"), 3),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)


def fio_lines(comparisons: Sequence[Dict[str, Any]], repeats: int) -> List[str]:
    """Report lines comparing our bandwidths with fio's for the same parameters."""
    lines = [f"fio comparison (same file and parameters, interleaved ours/fio, medians of {repeats}):"]
    for c in comparisons:
        params = AioParams(**c["aio"])
        lines.append(
            f"  {c['op']:5s} {params.label()}: ours {_fmt(c['ours_gbps'])} GB/s, "
            f"fio {_fmt(c['fio_gbps'])} GB/s "
            f"(fio buffers: {c['fio_iomem']})  ours/fio = {_fmt(c['ratio_ours_to_fio'])}  "
            f"CPU s/GB ours {_fmt(c['ours_cpu_s_per_gb'], 3)} fio {_fmt(c['fio_cpu_s_per_gb'], 3)}"
        )
    return lines


def note(text: str) -> None:
    """Print a status line to stderr, prefixed with the program name."""
    print(f"{PROG}: {text}", file=sys.stderr)


def check_libraries(plot: Optional[str]) -> None:
    """Fail before the first measurement when a library the end of the run needs is missing: torch (the
    pinned host and GPU copy measurements) and, for --plot, matplotlib."""
    from offload.bench.plot import plot_available

    try:
        import torch  # noqa: F401

        import offload.pinned  # noqa: F401
    except ImportError as e:
        raise BenchError(
            f"torch cannot be imported ({e}): the host and GPU copy measurements need it "
            "(pip install torch; scripts/setup_env.sh sets up a venv with everything)"
        ) from None
    if plot and not plot_available():
        raise BenchError(
            f"--plot {plot}: matplotlib is not installed (pip install matplotlib); "
            "run without --plot to measure without the plot"
        )


# -- the run --------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """The whole bench for parsed `args`; returns the exit code."""
    from offload.bench import nvme
    from offload.bench.copies import measure_copies
    from offload.bench.plot import plot_results
    from offload.bench.profile import (
        aio_section,
        build_profile,
        filesystem_of,
        free_bytes,
        ram_bytes,
        write_json,
    )
    from offload.bench.progress import Progress

    if args.repeats < 1:
        raise BenchError(f"--repeats {args.repeats}: must be at least 1")
    directory = check_directory(args.path)
    check_outputs(args)
    ops = ["read"] if args.read_only else ["write"] if args.write_only else ["write", "read"]
    try:
        from offload import _aio
    except ImportError as e:
        raise BenchError(f"the I/O library offload._aio is not built ({e}): run setup.py build_ext") from None
    check_libraries(args.plot)
    points = grid_points(args, list(_aio.available_backends()))
    ram = ram_bytes()
    size = choose_size(args.size, args.quick, free_bytes(directory), ram)
    buffer_bytes = min(size, MAX_BUFFER, max(MiB, ram // 8 // MiB * MiB))

    fio_exe = None
    notes: List[str] = []
    fstype = filesystem_of(directory)[1]
    if fstype in ("tmpfs", "ramfs"):
        notes.append(f"--path is on {fstype}: this measures memory, not a drive")
    if args.fio:
        from offload.bench.fio import fio_executable

        fio_exe = fio_executable()
        if fio_exe is None:
            notes.append("fio is not installed (apt-get install fio / dnf install fio): comparison skipped")
    steps = args.repeats * len(points) + (args.repeats * len(ops) if fio_exe else 0)
    progress = Progress(steps, PROG)

    bench = nvme.BenchFile(directory, size, buffer_bytes)
    try:
        try:
            bench.layout()
        except OSError as e:
            raise BenchError(
                nvme.describe_os_error(e, f"preparing the {format_size(size)} test file:")
            ) from None
        notes.extend(bench.notes)
        for line in bench.notes:
            note(line)
        measurements = nvme.run_sweep(bench, points, ops, args.repeats, progress.step)
        best_read = nvme.best(measurements, lambda m: m.gbps("read"))
        best_write = nvme.best(measurements, lambda m: m.gbps("write"))
        best_both = nvme.best(measurements, lambda m: m.combined_gbps())
        chosen = best_both or best_read or best_write
        if chosen is None:  # cannot happen with a non-empty grid; a clear line beats a traceback
            raise BenchError("no configuration produced a measurement")

        comparisons: List[Dict[str, Any]] = []
        if fio_exe:
            comparisons = run_fio_comparisons(
                bench, fio_exe, ops, best_read, best_write, args.repeats, progress, notes
            )
        buffer_info = {
            "bytes": bench.buffer_bytes,
            "locked": bench.buffer_locked,
            "huge_pages": bench.buffer_huge_pages,
        }
        direct_io = bench.direct
    finally:
        bench.close()

    copy_bytes = max(64 * MiB, min(256 * MiB, size))
    copies = measure_copies(copy_bytes, max(3, args.repeats))
    notes.extend(copies.notes)

    results = [m.as_dict() for m in measurements]
    print()
    print(
        f"{PROG}: {directory}  {format_size(size)} per measurement, {len(points)} configurations x "
        f"{args.repeats} repeats, O_DIRECT {'on' if direct_io else 'OFF'}"
    )
    print(summary_table([("read", best_read), ("write", best_write), ("read+write", best_both)]))
    if comparisons:
        print("\n".join(fio_lines(comparisons, args.repeats)))
    print(
        "tier chain: "
        f"NVMe read {_fmt(best_read.gbps('read') if best_read else None)} GB/s, "
        f"write {_fmt(best_write.gbps('write') if best_write else None)} GB/s | "
        f"pinned host copy {_fmt(copies.host_copy_gbps)} GB/s | "
        f"host->GPU {_fmt(copies.h2d_gbps)} (pageable {_fmt(copies.h2d_pageable_gbps)}) GB/s, "
        f"GPU->host {_fmt(copies.d2h_gbps)} (pageable {_fmt(copies.d2h_pageable_gbps)}) GB/s"
    )
    for line in notes:
        print(f"note: {line}")

    overwrite = args.force
    if args.write_config:
        section = aio_section(chosen.params)
        write_output(
            "--write-config", args.write_config, lambda: write_json(section, args.write_config, overwrite)
        )
        print(f"wrote {args.write_config} (aio settings best for {'read+write' if best_both else ops[0]})")
    if args.json:
        profile = build_profile(
            nvme_path=directory,
            size=size,
            repeats=args.repeats,
            direct_io=direct_io,
            read_gbps=best_read.gbps("read") if best_read else None,
            write_gbps=best_write.gbps("write") if best_write else None,
            best_aio=chosen.params,
            best_read=best_read.params if best_read else None,
            best_write=best_write.params if best_write else None,
            copies=copies,
            results=results,
            fio=comparisons,
            notes=notes,
            buffer=buffer_info,
        )
        write_output("--json", args.json, lambda: write_json(profile, args.json, overwrite))
        print(f"wrote {args.json} (machine profile)")
    if args.plot:
        title = f"{PROG}: {directory}, {format_size(size)} per run, medians of {args.repeats}"
        write_output(
            "--plot", args.plot, lambda: plot_results(results, args.plot, title, comparisons, overwrite)
        )
        print(f"wrote {args.plot}")
    return 0


def run_fio_comparisons(
    bench: Any,
    fio_exe: str,
    ops: Sequence[str],
    best_read: Any,
    best_write: Any,
    repeats: int,
    progress: Any,
    notes: List[str],
) -> List[Dict[str, Any]]:
    """Run fio with the best parameter sets and compare its bandwidths with ours."""
    from offload.bench.fio import FioError, HugePages, compare_with_fio, fio_hugepages_needed

    comparisons: List[Dict[str, Any]] = []
    # Reads first: fio's writes replace our pattern, which our verified reads need.
    for op in [o for o in ("read", "write") if o in ops]:
        m = best_read if op == "read" else best_write
        with HugePages(fio_hugepages_needed(m.params)) as pages:
            iomem = "shmhuge" if pages.available else "malloc"
            if not pages.available:
                notes.append(f"fio {op}: {pages.note}; fio used ordinary (malloc) buffers")
            try:
                c = compare_with_fio(bench, m.params, op, repeats, fio_exe, iomem, progress.step)
            except FioError as e:
                if iomem != "shmhuge":
                    notes.append(f"fio {op} failed: {e}")
                    continue
                notes.append(f"fio {op} with huge-page buffers failed ({e}); retried with malloc buffers")
                try:
                    c = compare_with_fio(bench, m.params, op, repeats, fio_exe, "malloc", progress.step)
                except FioError as e2:
                    notes.append(f"fio {op} failed: {e2}")
                    continue
        comparisons.append(c.as_dict())
    return comparisons


@quiet_broken_pipe
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `ds-nvme-bench` with `argv`; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except BenchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except VerificationError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"{PROG}: error: a layer this tool needs is missing: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
