"""Numbers no float or 64-bit integer holds, and JSON nested past Python's recursion limit, are ConfigErrors
naming the key or the file - never an OverflowError, ValueError or RecursionError from deep inside."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, Tuple

import pytest

from offload.config import ConfigError, load_config

HUGE = 10**400  # more than any float holds: float(HUGE) raises OverflowError

BASE: Dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_clipping": 1.0,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "betas": [0.9, 0.99]},
    },
    "fp16": {"enabled": True, "loss_scale": 0, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.0}},
}
SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3},
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "cos_min_ratio": 1e-4, "total_num_steps": 100},
    "OneCycle": {
        "cycle_min_lr": 0.0,
        "cycle_max_lr": 0.1,
        "decay_lr_rate": 0.0,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    },
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_rate": 1.0},
}
# Every number-valued key (the keys that take floats: each once raised OverflowError for HUGE).
FLOAT_KEYS: Tuple[Tuple[str, str], ...] = (
    ("", "gradient_clipping"),
    ("", "optimizer.params.lr"),
    ("", "optimizer.params.eps"),
    ("", "optimizer.params.weight_decay"),
    ("", "optimizer.params.betas"),
    ("", "fp16.loss_scale"),
    ("", "fp16.min_loss_scale"),
    ("", "zero_optimization.offload_optimizer.ratio"),
) + tuple((sched, f"scheduler.params.{k}") for sched, params in SCHEDULERS.items() for k in params)


def config_with(sched: str, dotted: str, value: Any) -> Dict[str, Any]:
    cfg = copy.deepcopy(BASE)
    if sched:
        cfg["scheduler"] = {"type": sched, "params": dict(SCHEDULERS[sched])}
    load_config(cfg)  # the config is valid before the one value is changed
    *parents, last = dotted.split(".")
    d = cfg
    for k in parents:
        d = d[k]
    d[last] = [value, 0.9] if last == "betas" else value
    return cfg


@pytest.mark.parametrize("sched, dotted", FLOAT_KEYS, ids=[k for _, k in FLOAT_KEYS])
@pytest.mark.parametrize("sign", [1, -1])
def test_a_number_too_large_for_a_float_names_the_key(sched: str, dotted: str, sign: int) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(config_with(sched, dotted, sign * HUGE))
    msg = str(info.value)
    assert msg.startswith(f"{dotted} in <dict>:"), msg
    assert len(msg) < 400, msg  # the number is not echoed whole


@pytest.mark.parametrize(
    "key", ["train_micro_batch_size_per_gpu", "steps_per_print", "gradient_accumulation_steps"]
)
def test_an_integer_beyond_64_bits_names_the_key(key: str) -> None:
    cfg = dict(BASE, **{key: 2**63})
    with pytest.raises(
        ConfigError, match=rf"^{key} in <dict>: must be a 64-bit integer, got 9223372036854775808"
    ):
        load_config(cfg)
    sub = copy.deepcopy(BASE)
    sub["zero_optimization"]["sub_group_size"] = 2**64
    with pytest.raises(ConfigError, match="^zero_optimization.sub_group_size in <dict>: must be a 64-bit"):
        load_config(sub)


def test_a_huge_number_in_a_file_names_the_key(tmp_path) -> None:
    path = os.path.join(tmp_path, "ds.json")
    text = json.dumps(BASE).replace('"gradient_clipping": 1.0', '"gradient_clipping": 1' + "0" * 400)
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ConfigError, match=f"^gradient_clipping in {path}: must be a finite number"):
        load_config(path)


def test_an_integer_too_long_to_parse_names_the_file(tmp_path) -> None:
    path = os.path.join(tmp_path, "ds.json")
    with open(path, "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": 1' + "0" * 5000 + "}")
    with pytest.raises(ConfigError, match=f"^config file {path} holds a number that cannot be read"):
        load_config(path)


def test_deep_nesting_names_the_file(tmp_path) -> None:
    path = os.path.join(tmp_path, "ds.json")
    with open(path, "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match=f"^config file {path} nests arrays or objects too deeply"):
        load_config(path)
