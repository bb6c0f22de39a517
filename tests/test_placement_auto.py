"""`max_in_cpu: "auto"` (the default) and `engine.placement()`: a model that fits in the pinned budget reads
nothing from disk per forward; one that does not keeps its share in RAM and streams the rest."""

from __future__ import annotations

import logging

import pytest
import torch

import zero
from offload.config import ConfigError, load_config
from offload.pinned import PINNED_BUDGET_ENV
from offload.swap.resident import auto_resident_numel

WIDTH, LAYERS = 256, 4
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _config(nvme, **param) -> dict:
    off = {"device": "nvme", "nvme_path": str(nvme), **param}
    # persistence 0: every layer is gathered and released around each forward (none stays gathered)
    zo = {"stage": 3, "offload_param": off, "stage3_param_persistence_threshold": 0}
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zo}


def _run(cfg):
    model = _model()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        want = model(x)
    eng, *_ = zero.initialize(model=model, config=cfg)
    try:
        eng(x)  # the first forward: the trace is recorded
        eng.inference_report()
        with torch.no_grad():
            got = eng(x)
        return eng.placement(), eng.inference_report(), want, got
    finally:
        eng.close()


def test_config_max_in_cpu_defaults_to_auto_and_accepts_counts(tmp_path) -> None:
    z = load_config(_config(tmp_path)).zero_optimization
    assert z.offload_param.max_in_cpu == "auto"
    assert load_config(_config(tmp_path, max_in_cpu=5)).zero_optimization.offload_param.max_in_cpu == 5
    with pytest.raises(ConfigError, match="max_in_cpu"):
        load_config(_config(tmp_path, max_in_cpu="most"))


def test_auto_keeps_a_model_that_fits_resident_and_reads_nothing_per_forward(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="zero"):
        placement, report, want, got = _run(_config(tmp_path))
    params = placement["parameters"]
    assert params["nvme_bytes"] == 0 and params["host_bytes"] == LAYERS * LAYER_BYTES
    assert params["max_in_cpu"] == "auto" and "fits" in params["why"]
    # pageable, yet charged to the pinned budget (no staging slot: nothing is on NVMe)
    assert not params["host_pinned"] and placement["pinned_bytes_in_use"] == LAYERS * LAYER_BYTES
    assert report.forwards == 1 and report.gathers == LAYERS and report.nvme_read_bytes == 0
    assert torch.equal(want, got)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("placement:")]
    assert len(lines) == 1 and "parameters: 1.00 MiB RAM" in lines[0]


def test_auto_keeps_its_share_of_a_model_that_does_not_fit(tmp_path, monkeypatch) -> None:
    # one staging slot of a layer + 1.5 layers of room: one layer stays in RAM, three are streamed
    budget = LAYER_BYTES + LAYER_BYTES * 3 // 2
    monkeypatch.setenv(PINNED_BUDGET_ENV, str(budget))
    placement, report, want, got = _run(_config(tmp_path, buffer_count=1))
    params = placement["parameters"]
    assert params["host_bytes"] == LAYER_BYTES
    assert params["nvme_bytes"] >= 3 * LAYER_BYTES
    assert "stays in RAM" in params["why"]
    assert report.nvme_read_bytes == 3 * LAYER_BYTES  # per forward: exactly the streamed layers
    assert torch.equal(want, got)


def test_pageable_partitions_kept_by_auto_are_charged_to_the_pinned_budget(tmp_path, monkeypatch) -> None:
    """The optimizer's own "auto", placed after the parameters, sees only what they left of the budget."""
    monkeypatch.setenv(PINNED_BUDGET_ENV, str(40 * LAYER_BYTES))
    cfg = _config(tmp_path)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    eng, *_ = zero.initialize(model=_model(), config=cfg)
    try:
        p = eng.placement()
    finally:
        eng.close()
    assert p["parameters"]["host_bytes"] == LAYERS * LAYER_BYTES and not p["parameters"]["host_pinned"]
    assert p["pinned_bytes_in_use"] >= LAYERS * LAYER_BYTES + p["optimizer_state"]["host_bytes"]
    assert p["pinned_bytes_in_use"] <= p["pinned_budget_bytes"]
    assert p["optimizer_state"]["tier"] == "nvme" and p["optimizer_state"]["max_in_cpu"] == "auto"


def test_placement_of_a_stage_2_engine_names_each_tier() -> None:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    eng, *_ = zero.initialize(model=_model(), config=cfg)
    try:
        p = eng.placement()
    finally:
        eng.close()
    numel = LAYERS * LAYER_BYTES // 4
    assert p["parameters"]["tier"] == "none" and p["parameters"]["device_bytes"] == numel * 4
    opt = p["optimizer_state"]
    assert (opt["tier"], opt["host_bytes"], opt["nvme_bytes"]) == ("cpu", numel * 12, 0)


def test_auto_resident_numel_arithmetic() -> None:
    assert auto_resident_numel([10, 10], 4, 80, 2, 100) == 20  # all fit: no staging slots needed
    assert auto_resident_numel([10, 10], 4, 79, 2, 100) == 0  # two slots of a partition take it all
    assert auto_resident_numel([10, 10], 4, 70, 1, 100) == (70 - 40) // 4
    assert auto_resident_numel([10, 10], 4, 70, 1, 5) == (70 - 20) // 4  # slots of buffer_size elements


def test_auto_under_init_keeps_room_for_the_staging_slots(tmp_path, monkeypatch) -> None:
    """zero.Init places each layer as it is built: "auto" keeps one while the budget still has room for the
    staging slots of the layers to come, so the slots fit when the streamed layers need them."""
    monkeypatch.setenv(PINNED_BUDGET_ENV, str(LAYER_BYTES * 5 // 2))
    cfg = _config(tmp_path, buffer_count=1)
    with zero.Init(config=cfg):
        model = _model()
    x = torch.randn(2, WIDTH)
    eng, *_ = zero.initialize(model=model, config=cfg)
    try:
        eng(x)
        eng.inference_report()
        with torch.no_grad():
            eng(x)
        params, report = eng.placement()["parameters"], eng.inference_report()
    finally:
        eng.close()
    assert params["host_bytes"] == LAYER_BYTES  # a second layer would leave no room for the slot
    assert report.nvme_read_bytes == 3 * LAYER_BYTES
