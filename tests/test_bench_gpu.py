"""benchmarks/bench_gpu.py in its --smoke mode (CPU, tiny Llama shapes): every section runs and its JSON
holds what the section is about, consistent with the estimator and with the steps it ran."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # about a minute on two shared cores: the smoke trains 9 tiny models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu")
    nvme = tmp_path_factory.mktemp("nvme")
    cmd = [sys.executable, "-m", "benchmarks.bench_gpu", "--smoke", "--out", str(out)]
    cmd += ["--nvme-path", str(nvme)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "bench_gpu_cpu.json") as f:
        payload = json.load(f)
    assert (out / "bench_gpu_cpu.md").read_text().count("###") == 4
    return payload


def _args(payload):
    from benchmarks import bench_gpu

    return bench_gpu.parse_args(["--smoke", f"--device-mem={payload['settings']['device_mem']}"])


def test_every_section_ran(smoke):
    assert set(smoke["results"]) == {"capacity", "tflops", "overhead", "ratio"}
    for name, section in smoke["results"].items():
        assert section.get("status", "ok") == "ok", (name, section)
        assert section["section_s"] > 0


def test_capacity_is_the_estimators_largest_and_was_trained(smoke):
    from benchmarks import gpu_ladder
    from offload.estimate import MachineProfile

    args = _args(smoke)
    limits = smoke["machine_limits"]
    machine = MachineProfile(limits["gpu_bytes"], limits["ram_bytes"], limits["nvme_free_bytes"])
    configs = smoke["results"]["capacity"]["configs"]
    assert set(configs) == set(gpu_ladder.CAPACITY)
    for name, entry in configs.items():
        k = entry["estimator_rung"]
        assert k >= 1, name
        assert entry["estimate"]["per_gpu_bytes"] <= limits["gpu_bytes"], name
        if not entry["capped"]:  # one rung more does not fit: the search found the largest
            bigger = gpu_ladder.rung(k + 1, args)
            act = gpu_ladder.activations(bigger, args.micro, args.seq, False)
            assert not gpu_ladder.estimate_row(name, bigger, args, act, machine)["fits"], name
        # on the CPU nothing runs out of memory: the estimator's largest is the one verified, by 2 steps
        assert entry["verified_rung"] == k, entry["attempts"]
        last = entry["attempts"][-1]
        assert last["status"] == "ok" and len(last["losses"]) == 2
        assert all(math.isfinite(x) and 0 < x < 10 for x in last["losses"])
    # offload lets a larger model fit than plain torch's 8 bytes per parameter, stage 3 more than stage 2
    assert configs["torch"]["x_torch"] == 1.0
    assert configs["zero2-opt-cpu"]["verified_params"] > configs["torch"]["verified_params"]
    assert configs["zero3-opt-cpu-param-cpu"]["verified_params"] > configs["zero2-opt-cpu"]["verified_params"]


def test_tflops_model_needs_offload_and_flops_follow_from_the_steps(smoke):
    from benchmarks import gpu_ladder

    args = _args(smoke)
    tf = smoke["results"]["tflops"]
    gpu = smoke["machine_limits"]["gpu_bytes"]
    assert tf["status"] == "ok" and tf["stage0_state_bytes"] > gpu
    if tf["rung"] > 1:  # the smallest such rung
        assert gpu_ladder.stage0_bytes(gpu_ladder.rung(tf["rung"] - 1, args)) <= gpu
    assert tf["tokens_per_step"] == args.tflops_seq * args.tflops_micro * args.tflops_accum
    step_s = sorted(r["step_s"] for r in tf["rows"])[len(tf["rows"]) // 2]
    assert tf["step_s"] == pytest.approx(step_s)
    assert tf["tflops"] == pytest.approx(8 * tf["params"] * tf["tokens_per_step"] / step_s / 1e12)
    assert tf["tflops"] > 0


def test_overhead_runs_both_on_the_same_batches(smoke):
    sec = smoke["results"]["overhead"]
    torch_run, ours = sec["contenders"]["torch"], sec["contenders"]["zero2-opt-cpu"]
    args = smoke["settings"]
    for c in (torch_run, ours):
        assert c["status"] == "ok" and len(c["samples"]) == args["repeats"]
        assert c["step_min_s"] <= c["step_s"] <= c["step_max_s"]
        assert len(c["losses"]) == args["repeats"] + 1  # the warm-up step, then the timed ones
    # the same initial weights (same seed, same device) and the same first batch: the same first loss
    assert ours["losses"][0] == pytest.approx(torch_run["losses"][0], rel=1e-3)


def test_overhead_runs_the_delayed_update_too(smoke):
    sec = smoke["results"]["overhead"]["contenders"]
    ours, delayed = sec["zero2-opt-cpu"], sec["zero2-opt-cpu-delayed"]
    assert delayed["status"] == "ok" and len(delayed["samples"]) == smoke["settings"]["repeats"]
    # warm-up step 1 is an ordinary one: the same weights for the first two losses, then one step stale
    assert delayed["losses"][:2] == pytest.approx(ours["losses"][:2], rel=1e-3)


def test_ratio_values_run_or_are_refused_by_name(smoke):
    sec = smoke["results"]["ratio"]["contenders"]
    assert set(sec) == {"ratio=0.0", "ratio=0.5", "ratio=1.0"}
    assert sec["ratio=1.0"]["status"] == "ok"
    for label, c in sec.items():
        if c["status"] == "refused":
            assert "offload_optimizer.ratio" in c["error"], label
        else:
            assert c["status"] == "ok" and c["step_s"] > 0, label
