"""benchmarks/bench_convergence.py --smoke: a tiny GPT on the demo's corpus with fp32, bf16 and int8 optimizer
states. fp32 trains (the loss falls), the final loss is the mean of the last steps, and a state dtype either
trains from the same start (same first loss) or is reported as refused with the engine's message."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import bench_convergence


def test_final_loss_is_the_mean_of_the_last_window():
    losses = [float(i) for i in range(50)]
    assert bench_convergence.final_loss(losses) == sum(range(30, 50)) / 20
    assert bench_convergence.final_loss([3.0, 1.0]) == 2.0


def test_state_dtype_key_only_when_not_the_default():
    args = type("A", (), dict(lr=1e-3, offload="cpu", batch=2, steps=10, dtype="fp32"))()
    assert "state_dtype" not in bench_convergence.engine_config(args, "fp32", "/x")["optimizer"]["params"]
    assert bench_convergence.engine_config(args, "int8", "/x")["optimizer"]["params"]["state_dtype"] == "int8"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv")
    nvme = tmp_path_factory.mktemp("nvme")
    with pytest.MonkeyPatch.context() as mp:  # main() sets ZO_ACCELERATOR; the other tests keep theirs
        mp.setenv("ZO_ACCELERATOR", "cpu")
        assert bench_convergence.main(["--smoke", "--out", str(out), "--nvme-path", str(nvme)]) == 0
    with open(out / "convergence_cpu_smoke.json") as f:
        payload = json.load(f)
    payload["md"] = (out / "convergence_cpu_smoke.md").read_text()
    return payload


def test_fp32_trains_and_reports_its_final_loss(smoke):
    r = smoke["results"]["fp32"]
    steps = smoke["args"]["steps"]
    assert r["status"] == "ok" and len(r["losses"]) == steps
    assert all(math.isfinite(v) for v in r["losses"])
    assert r["losses"][0] == pytest.approx(math.log(256), rel=0.05)  # untrained: uniform over bytes
    assert r["final_loss"] == pytest.approx(sum(r["losses"][-20:]) / len(r["losses"][-20:]))
    assert r["final_loss"] < r["losses"][0]
    assert r["final_loss_rel_diff_vs_fp32"] == 0.0


def test_other_state_dtypes_run_from_the_same_start_or_are_refused(smoke):
    ref = smoke["results"]["fp32"]
    assert set(smoke["results"]) == {"fp32", "bf16", "int8"}
    for sd in ("bf16", "int8"):
        r = smoke["results"][sd]
        if r["status"] == "refused":  # until the engine takes optimizer.params.state_dtype
            assert "state_dtype" in r["error"]
            assert f"| {sd} | refused:" in smoke["md"]
            continue
        assert r["status"] == "ok" and len(r["losses"]) == len(ref["losses"])
        # same seed, same first batch: the state dtype changes only what the updates do
        assert r["losses"][0] == ref["losses"][0]
        want = (r["final_loss"] - ref["final_loss"]) / ref["final_loss"]
        assert r["final_loss_rel_diff_vs_fp32"] == pytest.approx(want)
