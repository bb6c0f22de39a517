"""The estimate for each optimizer-state dtype and NVMe copies choice, against the engine's own accounting.

Bytes per parameter of master + states: fp32 12, bf16 8, int8 6 + the absmax scales (8 bytes per 2048
elements for Adam). The engine's pinned host bytes, swap-file bytes and the NVMe bytes a step moves (its
step report) are the estimate's, up to the 4 KiB padding of each slot and swap region.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import zero
from offload.estimate import SwapBufferSettings, TrainingSetup, count_parameters, estimate
from offload.estimate.errors import EstimateInputError

PADDING_ALLOWANCE = 64 * 1024  # 4 KiB alignment of a few slots and a few dozen regions


def setup(count, sub_group: int, state_dtype: str, copies="auto") -> TrainingSetup:
    return TrainingSetup(
        count.params,
        count.largest_layer_params,
        precision="bf16",
        optimizer="adamw",
        optimizer_state_dtype=state_dtype,
        buffers=SwapBufferSettings(
            optimizer_buffer_count=4, sub_group_size=sub_group, optimizer_nvme_copies=copies
        ),
    )


def test_bytes_per_parameter_for_each_state_dtype():
    per = {
        d: TrainingSetup(10**6, 10**5, optimizer="adam", optimizer_state_dtype=d).optimizer_bytes_per_param
        for d in ("fp32", "bf16", "int8")
    }
    assert per == {"fp32": 12, "bf16": 8, "int8": 6 + 8 / 2048}
    lion = TrainingSetup(10**6, 10**5, optimizer="lion", optimizer_state_dtype="int8")
    assert lion.optimizer_bytes_per_param == 5 + 4 / 2048
    with pytest.raises(EstimateInputError, match="optimizer_nvme_copies"):
        SwapBufferSettings(optimizer_nvme_copies=3)


def test_nvme_bytes_scale_with_dtype_and_copies():
    s = lambda d, c: setup(  # noqa: E731
        type("C", (), {"params": 10**8, "largest_layer_params": 10**6}), 10**7, d, c
    )
    two = {d: estimate(s(d, 2), 1, "nvme") for d in ("fp32", "bf16", "int8")}
    one = estimate(s("bf16", 1), 1, "nvme")
    assert two["bf16"].nvme_read_bytes_per_step == 8 * 10**8
    assert two["fp32"].nvme_read_bytes_per_step == 12 * 10**8
    assert two["int8"].nvme_read_bytes_per_step == 6 * 10**8 + 8 * -(-(10**8) // 2048)
    assert one.nvme_bytes == two["bf16"].nvme_bytes // 2 == one.nvme_min_bytes
    assert two["bf16"].nvme_min_bytes == one.nvme_bytes
    # "auto" on a disk too short for two copies: one, with a note
    auto = estimate(s("bf16", "auto"), 1, "nvme", nvme_free_bytes=one.nvme_bytes + 1)
    assert auto.nvme_bytes == one.nvme_bytes and any("one copy in place" in n for n in auto.notes)


@pytest.mark.parametrize(
    "offload,state_dtype,copies,sub_group",
    [
        ("cpu", "bf16", "auto", 10**9),
        ("nvme", "bf16", 2, 20_000),
        ("nvme", "bf16", 1, 20_000),
        ("cpu", "int8", "auto", 10**9),
        ("nvme", "int8", 2, 20_000),
    ],
)
def test_estimate_matches_the_engine(tmp_path, offload, state_dtype, copies, sub_group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    count = count_parameters(model)
    off = {
        "device": offload,
        "nvme_path": str(tmp_path),
        "buffer_count": 4,
        "nvme_copies": copies,
        "max_in_cpu": 0,
    }
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "state_dtype": state_dtype}},
        "zero_optimization": {"stage": 1, "sub_group_size": sub_group, "offload_optimizer": off},
        "zero_offload": {"report": True},
    }
    engine, *_ = zero.initialize(model=model, config=config)
    try:
        x = torch.randn(2, 256, dtype=torch.bfloat16)
        engine.backward(engine(x).float().square().mean())
        engine.step()
        pinned, nvme, rep = engine.pinned_bytes, engine.nvme_bytes, engine.last_report
        chunk = engine.optimizer_state_info().chunk_numel
    finally:
        engine.close()
    est = estimate(setup(count, sub_group, state_dtype, copies), 1, offload)
    # a CPU-only engine writes updated weights in place: no pinned copy-back slots (see test_estimate_engine)
    expected_pinned = est.per_cpu_pinned_bytes - 2 * chunk * 2
    assert 0 <= pinned - expected_pinned <= PADDING_ALLOWANCE, (pinned, expected_pinned)
    # each swap region is padded to 4 KiB (int8: the scales after whole pages of codes add one page)
    regions = (2 if copies in (2, "auto") else 1) * -(-count.params // chunk)
    assert 0 <= nvme - est.nvme_bytes <= regions * 4096, (nvme, est.nvme_bytes)
    assert 0 <= rep.nvme_read_bytes - est.nvme_read_bytes_per_step <= -(-count.params // chunk) * 4096
    assert 0 <= rep.nvme_write_bytes - est.nvme_write_bytes_per_step <= -(-count.params // chunk) * 4096
    if offload == "nvme":
        scales = 8 * -(-count.params // 2048) if state_dtype == "int8" else 0
        assert est.nvme_read_bytes_per_step == count.params * {"bf16": 8, "int8": 6}[state_dtype] + scales


def _cli(*flags: str) -> dict:
    argv = ["--params", "1e9", "--largest-layer", "1e7", "--stage", "2", "--offload-optimizer", "nvme"]
    argv += ["--max-in-cpu", "0"]  # every sub-group on NVMe (the default, auto, depends on this host's RAM)
    out = subprocess.run(
        [sys.executable, "-m", "offload.cli.estimate_memory", *argv, *flags, "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def test_cli_flags():
    base = _cli()
    int8_one = _cli("--optimizer-state-dtype", "int8", "--nvme-copies", "1")
    assert int8_one["optimizer_state_dtype"] == "int8"
    (row,) = [r for r in base["rows"] if r["offload_param"] == "none"]
    (row8,) = [r for r in int8_one["rows"] if r["offload_param"] == "none"]
    assert row["nvme_read_bytes_per_step"] == 12 * 10**9
    assert row8["nvme_read_bytes_per_step"] == 6 * 10**9 + 8 * -(-(10**9) // 2048)
    assert row8["nvme_bytes"] < row["nvme_bytes"] / 3  # half the bytes, one copy instead of two
