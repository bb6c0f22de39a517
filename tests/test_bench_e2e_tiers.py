"""benchmarks/bench_e2e.py --tiers: optimizer state dtype x host budget for the NVMe optimizer state. The keys
go where the engine reads them; a variant the engine refuses is reported as refused with its message; the
bytes per step come from the engine's report and match the optimizer state the model needs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import e2e_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_host_budget_values():
    assert e2e_configs.host_budget("0", 1000) == 0
    assert e2e_configs.host_budget("auto", 1000) == "auto"
    assert e2e_configs.host_budget("0.5", 1000) == 500
    assert e2e_configs.host_budget("25%", 1000) == 250
    assert e2e_configs.host_budget("123", 1000) == 123
    with pytest.raises(ValueError):
        e2e_configs.host_budget("half", 1000)


def test_tiers_config_places_the_keys():
    cfg = e2e_configs.CONFIGS[e2e_configs.TIERS_BASE]
    conf = e2e_configs.engine_config(cfg, "bf16", "/nvme", 1000, 2, False)
    got = e2e_configs.tiers_config(conf, "int8", 500)
    assert got["optimizer"]["params"]["state_dtype"] == "int8"
    assert got["zero_optimization"]["offload_optimizer"]["max_in_cpu"] == 500
    assert got["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert got["zero_optimization"]["offload_param"]["device"] == "nvme"
    assert "state_dtype" not in conf["optimizer"]["params"]  # the input is left as it was
    plain = e2e_configs.tiers_config(conf, None, None)
    assert plain == conf


@pytest.mark.slow
def test_tiers_smoke_runs_today(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.bench_e2e", "--tiers", "tiny", "--steps", "1", "--warmup", "1"]
    cmd += ["--state-dtypes", "fp32,int8", "--host-budgets", "0", "--out-dir", str(tmp_path)]
    cmd += ["--nvme-dir", str(tmp_path / "nvme"), "--no-deepspeed"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "e2e_tiers_tiny.json") as f:
        payload = json.load(f)
    res = payload["results"]
    assert set(res) == {"baseline", "fp32 / host 0", "int8 / host 0"}
    base = res["baseline"]
    assert base["status"] == "ok" and math.isfinite(base["final_loss"])
    # fp32 master + Adam's two fp32 states, read and written once per step (up to the swap files' padding)
    state = 12 * payload["params"]
    for key in ("optimizer_nvme_read_bytes_per_step", "optimizer_nvme_write_bytes_per_step"):
        assert state <= base[key] <= 1.01 * state, key
    # parameters on NVMe too: the step moves more than the optimizer state alone
    assert base["nvme_read_bytes_per_step"] > base["optimizer_nvme_read_bytes_per_step"]
    md = (tmp_path / "e2e_tiers_tiny.md").read_text()
    for label in ("fp32 / host 0", "int8 / host 0"):
        r = res[label]
        assert r["max_in_cpu"] == 0
        if r["status"] == "refused":  # until the engine takes the keys
            assert "max_in_cpu" in r["error"] or "state_dtype" in r["error"], r["error"]
            assert f"| {label} |" in md and "refused:" in md
        else:
            assert r["status"] == "ok" and math.isfinite(r["final_loss"])
            if label.startswith("int8"):  # 1-byte states: fewer bytes than the fp32 baseline's
                assert r["optimizer_nvme_read_bytes_per_step"] < base["optimizer_nvme_read_bytes_per_step"]
