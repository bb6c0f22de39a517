"""scripts/gpu_check.sh without a GPU: it parses (bash -n), and its dry run plans the CUDA tests and every
bench_gpu section (capacity, tflops, overhead with the delayed update, ratio) within an 8-minute budget, with
arguments bench_gpu accepts."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def test_dry_run_plans_every_check_within_eight_minutes(tmp_path):
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", PYTHON="python3")
    proc = subprocess.run(
        ["bash", SCRIPT, str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    plan = dict(re.findall(r"^(\w+): cap (\d+) s: ", proc.stdout, re.M))
    assert set(plan) == {"cuda_tests", "bench_gpu"}, proc.stdout
    # the steps share one wall-clock budget (each capped by what is left of it): 450 s by default
    assert max(int(v) for v in plan.values()) <= 450
    bench = next(line for line in proc.stdout.splitlines() if line.startswith("bench_gpu:"))
    argv = shlex.split(bench.split(": ", 2)[2])[3:]  # after `python3 -m benchmarks.bench_gpu`
    from benchmarks import bench_gpu

    args = bench_gpu.parse_args(argv + ["--device", "cpu", "--device-mem", "1000000"])
    assert set(args.sections.split(",")) == set(bench_gpu.SECTIONS)
    assert args.budget_s <= 450  # what the CUDA tests leave of the budget, less 30 s for packing
    assert args.overhead_config + bench_gpu.DELAYED in bench_gpu.CONFIGS  # overhead runs the delayed update
    assert args.tflops_seq == 2048
    assert bench_gpu.RATIOS == (0.0, 0.5, 1.0)
