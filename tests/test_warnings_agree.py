"""Warnings and errors that agree with what the engine does: a config's own `to_dict()` loads back without a
warning; the "not enough disk for two copies" warning is about the optimizer state that goes to disk, not
the share `max_in_cpu` keeps in RAM; a missing `nvme_path` names the config key it came from."""

from __future__ import annotations

import logging
import warnings

import pytest
from engine_helpers import base_config, make_model

import zero
from offload.config import load_config
from zero.optimizer.tiers import build as optimizer_state


@pytest.mark.parametrize(
    "offload",
    [
        {},
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        {"zero_optimization": {"stage": 2, "cpu_offload": True}},
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
            },
            "bf16": {"enabled": True},
        },
    ],
)
def test_to_dict_loads_back_without_a_warning(offload, caplog):
    cfg = load_config(offload)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload.config"), warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_config(cfg.to_dict())
    assert again == cfg
    assert [r.getMessage() for r in caplog.records] == []


def test_pin_memory_false_given_explicitly_still_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        load_config(
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
        )
    assert any(
        "offload_optimizer.pin_memory' = False is accepted but ignored" in r.getMessage()
        for r in caplog.records
    )


def _nvme_engine(tmp_path, max_in_cpu):
    cfg = base_config("nvme", tmp_path, stage=2)
    cfg["zero_optimization"]["offload_optimizer"]["max_in_cpu"] = max_in_cpu
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    return engine


def test_small_disk_warns_only_about_the_state_on_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(optimizer_state, "_disk_free", lambda path: 32 << 20)  # 32 MiB free
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole state is in RAM: nothing about copies on disk
        engine = _nvme_engine(tmp_path, "auto")
    info = engine.optimizer_state_info()
    assert info.swapped_numel == 0 and info.disk_bytes == 0
    engine.close()

    whole = optimizer_state.StateFormat(2, "fp32").whole_bytes(info.numel)
    monkeypatch.setattr(optimizer_state, "_disk_free", lambda path: whole)  # one copy of the whole state
    with pytest.warns(UserWarning, match="not enough for two copies"):
        engine = _nvme_engine(tmp_path, 0)  # every sub-group on disk: two copies do not fit
    assert engine.optimizer_state_info().copies == 1
    engine.close()
    # two thirds of the state in RAM: two copies of the swapped third fit in the same space
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = _nvme_engine(tmp_path, info.numel * 2 // 3)
    assert engine.optimizer_state_info().copies == 2
    engine.close()


def test_missing_nvme_path_names_the_config_key(tmp_path):
    cfg = base_config("nvme", tmp_path / "gone", stage=2)
    with pytest.raises(OSError, match=r"zero_optimization\.offload_optimizer\.nvme_path does not exist"):
        zero.initialize(model=make_model(), config=cfg)
    cfg = base_config("none", None, stage=3)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "gone")}
    with pytest.raises(OSError, match=r"zero_optimization\.offload_param\.nvme_path does not exist"):
        zero.initialize(model=make_model(), config=cfg)
