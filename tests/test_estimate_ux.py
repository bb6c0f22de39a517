"""The estimator and the CLIs do not mislead: on a machine without a GPU the device is host memory (no
104 GiB "GPU" layout on a 21 GiB host); by default the estimate places the optimizer state as the engine
does (`max_in_cpu: "auto"`, one default); every hardware flag has help; output piped into a reader that
stops early ends without a traceback, for every CLI."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import zero
from offload.cli.estimate_args import build_parser
from offload.cli.estimate_memory import run
from offload.estimate import SwapBufferSettings, TrainingSetup, check_fit, estimate_all, recommend
from offload.estimate.machine import MachineProfile, host_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


def test_without_a_gpu_the_device_is_host_memory():
    # parameters kept in RAM by a count, not by "auto" (which would size them against this machine's budget)
    buffers = SwapBufferSettings(sub_group_size=10**8, param_max_in_cpu=10**9)
    setup = TrainingSetup(params=7 * 10**9, largest_layer_params=135 * 10**6, buffers=buffers)
    estimates = estimate_all(setup, [0, 1, 2, 3], ["none", "cpu", "nvme"], ["none", "cpu", "nvme"])
    host = MachineProfile(ram_bytes=21 * GiB, nvme_free_bytes=2000 * GiB, cpu_only=True)
    checks = [check_fit(e, host) for e in estimates]
    best = recommend(estimates, checks)
    assert best is not None and best.offload_optimizer == "nvme"  # nothing else fits in 21 GiB
    assert best.per_gpu_bytes + best.per_cpu_bytes <= 21 * GiB
    for e, c in zip(estimates, checks):
        assert c.device == "cpu" and c.gpu is None
        assert c.cpu == (host_bytes(e, host) <= 21 * GiB)
        if e.per_gpu_bytes > 21 * GiB:  # e.g. stage 0 without offload: ~104 GiB of "GPU" memory
            assert not c.fits
    # two ranks per node: both ranks' device bytes are in the one host's memory
    two = check_fit(best, host, ranks_per_node=2)
    assert host_bytes(best, host, 2) == best.per_cpu_bytes + 2 * best.per_gpu_bytes
    assert two.cpu == (host_bytes(best, host, 2) <= 21 * GiB)
    # with a GPU the device bytes are checked against the GPU, not the host
    gpu = MachineProfile(gpu_bytes=80 * GiB, ram_bytes=21 * GiB, nvme_free_bytes=2000 * GiB)
    assert check_fit(best, gpu).gpu is True and check_fit(best, gpu).device == "gpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a detected GPU wins over the profile's gpu_bytes 0")
def test_fit_report_on_a_cpu_only_machine(tmp_path):
    profile = tmp_path / "machine.json"
    profile.write_text(json.dumps({"gpu_bytes": 0, "ram_bytes": 21 * GiB, "nvme_free_bytes": 2000 * GiB}))
    args = [
        "--params",
        "7B",
        "--largest-layer",
        "135M",
        "--sub-group-size",
        "1e8",
        "--machine-profile",
        str(profile),
        # every parameter on NVMe: "auto" would keep half the host (the pinned budget) of them in RAM
        "--param-max-in-cpu",
        "0",
    ]
    text = run(args)
    assert "No GPU: the device is this host's memory" in text
    out = json.loads(run([*args, "--json"]))
    assert out["machine"]["cpu_only"] is True
    best = out["recommended"]
    assert best is not None and best["offload_optimizer"] == "nvme"
    rows = [r for r in out["rows"] if r["fit"]["fits"]]
    assert rows and all(r["per_gpu_bytes"] + r["per_cpu_bytes"] <= 21 * GiB for r in rows)


def _tiny_engine(tmp_path, **off):
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 2,
            "sub_group_size": 4096,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), **off},
        },
    }
    engine, *_ = zero.initialize(model=model, config=cfg)
    return engine, sum(p.numel() for p in model.parameters())


def test_default_max_in_cpu_predicts_the_engines_nvme_traffic(tmp_path):
    engine, params = _tiny_engine(tmp_path)  # the engine's default: "auto"
    info = engine.optimizer_state_info()
    engine.close()
    assert info.swapped_numel == 0  # a small state: all of it in pinned RAM
    args = ["--params", str(params), "--largest-layer", "8256", "--stage", "2", "--offload-optimizer", "nvme"]
    args += ["--sub-group-size", "4096", "--json"]
    row = json.loads(run(args))["rows"][0]
    assert row["nvme_bytes"] == 0 and row["nvme_read_bytes_per_step"] == 0  # as the engine: nothing on disk
    assert any("max_in_cpu=auto" in n for n in row["notes"])

    engine, _ = _tiny_engine(tmp_path, max_in_cpu=0)
    assert engine.optimizer_state_info().swapped_numel == info.numel
    engine.close()
    row = json.loads(run([*args, "--max-in-cpu", "0"]))["rows"][0]
    assert row["nvme_bytes"] > 0 and row["nvme_read_bytes_per_step"] > 0
    # the config's value is used when the flag is not given
    cfg = tmp_path / "ds.json"
    cfg.write_text(
        json.dumps({"zero_optimization": {"offload_optimizer": {"device": "nvme", "max_in_cpu": 0}}})
    )
    assert json.loads(run([*args, "--config", str(cfg)]))["rows"][0]["nvme_bytes"] > 0


def test_every_hardware_flag_has_help():
    for action in build_parser()._actions:
        if action.option_strings and action.option_strings[0] in ("--gpus-per-node", "--nodes"):
            assert action.help and len(action.help) > 20


def _into_a_closed_pipe(module, args):
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first byte, as `| head -c 0` would
    try:
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
            timeout=300,
        )
    finally:
        os.close(write)


def _quiet(proc):
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 1


def test_estimate_memory_into_a_closed_pipe_has_no_traceback():
    _quiet(_into_a_closed_pipe("offload.cli.estimate_memory", ["--params", "7B"]))


def test_zero_to_fp32_into_a_closed_pipe_has_no_traceback(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zero.initialize(model=model, config=cfg)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    _quiet(_into_a_closed_pipe("zero.cli_to_fp32", [str(tmp_path / "ckpt"), str(tmp_path / "out")]))


@pytest.mark.slow
def test_nvme_bench_into_a_closed_pipe_has_no_traceback(tmp_path):
    _quiet(
        _into_a_closed_pipe("offload.cli.nvme_bench", ["--path", str(tmp_path), "--size", "1M", "--quick"])
    )


def test_engine_logs_where_the_optimizer_state_went(tmp_path, caplog):
    from offload.swap.slots import StateFormat
    from zero.report import format_bytes

    with caplog.at_level(logging.INFO, logger="zero"):
        engine, _ = _tiny_engine(tmp_path)  # offload_optimizer nvme, max_in_cpu "auto": a state that fits
    info, budget = engine.optimizer_state_info(), engine.pool.cap_bytes
    engine.close()
    whole = format_bytes(StateFormat(2, "fp32").whole_bytes(info.numel))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("optimizer state:")]
    assert lines == [
        f"optimizer state: {whole} in pinned RAM, 0 B on NVMe "
        f"(max_in_cpu=auto: fits in the pinned budget of {format_bytes(budget)})"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zero"):
        engine, _ = _tiny_engine(tmp_path, max_in_cpu=0)
    engine.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("optimizer state:")]
    assert lines == [f"optimizer state: 0 B in pinned RAM, {whole} on NVMe (2 copies on disk) (max_in_cpu=0)"]
