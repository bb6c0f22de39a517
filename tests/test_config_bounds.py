"""Bounds the config loader enforces so that a value the engine cannot use fails at load time, naming the key,
the value and the allowed range, instead of part way through training."""

from __future__ import annotations

import logging
from typing import Any, Dict

import pytest

from offload import _aio
from offload.config import (
    AIO_LIMITS,
    MIN_SUB_GROUP_SIZE,
    AioConfig,
    ConfigError,
    load_config,
    validate_aio_section,
)
from offload.swap.optimizer_swapper import slot_bytes
from offload.swap.slots import swap_chunk
from offload.swap.space import DEFAULT_ALIGNMENT


def errmsg(config: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    return str(info.value)


def nvme_config(tmp_path, **aio: Any) -> Dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "aio": aio,
    }


# --- aio: the I/O core's limits ------------------------------------------------------------

AIO_CASES = [
    ("block_size", "block_size"),
    ("queue_depth", "queue_depth"),
    ("intra_op_parallelism", "intra_op_parallelism"),
    ("thread_count", "intra_op_parallelism"),  # DeepSpeed's old name: the same limit
]


def test_queue_depth_the_core_refuses_fails_at_load_not_at_the_first_swap(tmp_path) -> None:
    msg = errmsg(nvme_config(tmp_path, queue_depth=10000))
    assert "aio.queue_depth in <dict>: must be in [1, 4096], got 10000" in msg
    assert "I/O core" in msg


@pytest.mark.parametrize("key, limit", AIO_CASES)
def test_aio_values_outside_the_core_range_name_key_value_and_range(key: str, limit: str) -> None:
    lo, hi = AIO_LIMITS[limit]
    for bad in (lo - 1, hi + 1, 10 * hi):
        msg = errmsg({"aio": {key: bad}})
        assert f"aio.{key} in <dict>: must be in [{lo}, {hi}], got {bad}" in msg
    # The bench tools' checker applies the same rules.
    with pytest.raises(ConfigError, match=rf"aio\.{key} in <dict>: must be in \[{lo}, {hi}\]"):
        validate_aio_section({"aio": {key: hi + 1}})


@pytest.mark.parametrize("key, limit", AIO_CASES)
def test_aio_values_at_both_ends_of_the_range_load(key: str, limit: str) -> None:
    for good in AIO_LIMITS[limit]:
        aio = load_config({"aio": {key: good}}).aio
        assert getattr(aio, limit) == good
        assert AioConfig.from_dict(aio.to_dict()) == aio


@pytest.mark.parametrize("key", sorted(AIO_LIMITS))
def test_aio_limits_are_the_io_core_limits(key: str) -> None:
    """The Python table and the C++ checks must agree: a real Handle takes both ends of each range and
    refuses one past either end."""
    lo, hi = AIO_LIMITS[key]
    for good in (lo, hi):
        h = _aio.Handle(backend="psync", **{key: good})
        assert getattr(h, key) == good
        h.close()
    for bad in (lo - 1, hi + 1):
        with pytest.raises(ValueError, match=key):
            _aio.Handle(backend="psync", **{key: bad})


def test_every_limited_aio_key_is_a_config_key() -> None:
    defaults = AioConfig()
    for key, (lo, hi) in AIO_LIMITS.items():
        assert lo <= getattr(defaults, key) <= hi


# --- zero_optimization.sub_group_size ------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 100, MIN_SUB_GROUP_SIZE - 1])
def test_sub_group_size_below_the_minimum_is_rounded_up_with_a_warning(value: int, caplog) -> None:
    """DeepSpeed accepts any size >= 0; the engine uses its minimum and says so, with the reason."""
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        cfg = load_config({"zero_optimization": {"stage": 2, "sub_group_size": value}})
    assert cfg.zero_optimization.sub_group_size == MIN_SUB_GROUP_SIZE
    msg = caplog.text
    assert f"'zero_optimization.sub_group_size' = {value} is below {MIN_SUB_GROUP_SIZE}" in msg
    assert f"{MIN_SUB_GROUP_SIZE} is used" in msg and "4 KiB" in msg and "1e9" in msg
    assert "must be >= 0" in errmsg({"zero_optimization": {"sub_group_size": -1}})


@pytest.mark.parametrize("value", [MIN_SUB_GROUP_SIZE, 4000, 1e6, 1e9, 1e12])
def test_sub_group_sizes_from_the_minimum_up_load(value: float) -> None:
    assert (
        load_config({"zero_optimization": {"sub_group_size": value}}).zero_optimization.sub_group_size
        == value
    )


@pytest.mark.parametrize("n_states", [1, 2])
def test_minimum_sub_group_fills_whole_swap_blocks(n_states: int) -> None:
    """At the minimum, a chunk of master + states is a whole number of aligned blocks (nothing padded);
    below it, the padding is what multiplied the swap files."""
    chunk = swap_chunk(MIN_SUB_GROUP_SIZE, 10**9, n_states * 4)
    assert chunk == MIN_SUB_GROUP_SIZE
    useful = (1 + n_states) * chunk * 4
    assert slot_bytes(chunk, n_states, DEFAULT_ALIGNMENT) == useful
    assert slot_bytes(1, n_states, DEFAULT_ALIGNMENT) == DEFAULT_ALIGNMENT  # a whole block for one element


# --- offload staging buffers ---------------------------------------------------------------


@pytest.mark.parametrize(
    "section, key",
    [
        ("offload_optimizer", "buffer_count"),
        ("offload_param", "buffer_count"),
        ("offload_param", "buffer_size"),
    ],
)
def test_zero_staging_buffers_are_refused_for_nvme(tmp_path, section: str, key: str) -> None:
    cfg = {"zero_optimization": {"stage": 3, section: {"device": "nvme", "nvme_path": str(tmp_path), key: 0}}}
    msg = errmsg(cfg)
    assert f"zero_optimization.{section}.{key} in <dict>: must be >= 1, got 0" in msg
    assert "nvme" in msg


@pytest.mark.parametrize(
    "section, key",
    [
        ("offload_optimizer", "buffer_count"),
        ("offload_param", "buffer_count"),
        ("offload_param", "buffer_size"),
    ],
)
def test_staging_buffer_keys_unused_off_nvme_keep_accepting_zero(section: str, key: str) -> None:
    """DeepSpeed accepts 0 there and never reads it without NVMe; neither do we."""
    z = load_config({"zero_optimization": {"stage": 3, section: {"device": "cpu", key: 0}}}).zero_optimization
    assert getattr(getattr(z, section), key) == 0


@pytest.mark.parametrize(
    "key",
    [
        "reduce_bucket_size",
        "allgather_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_module_granularity_threshold",
    ],
)
def test_zero_keeps_its_deepspeed_meaning_for_other_sizes(key: str) -> None:
    """0 means something here (one bucket per gradient, no prefetch, nothing kept...): still accepted."""
    assert getattr(load_config({"zero_optimization": {"stage": 3, key: 0}}).zero_optimization, key) == 0
    assert ">= 0, got -1" in errmsg({"zero_optimization": {"stage": 3, key: -1}})


def test_max_in_cpu_zero_still_puts_every_partition_on_nvme(tmp_path) -> None:
    off = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
    assert load_config(
        {"zero_optimization": {"stage": 3, "offload_param": off}}
    ).zero_optimization.offload_param


def test_slot_plan_fits_shrinks_or_refuses() -> None:
    """The engine's and the estimator's slot sizing: DeepSpeed's staging memory when the budget allows,
    a smaller multiple of 1024 when not, a clear error when not even MIN_SLOT_NUMEL fits."""
    from offload.swap.slots import MIN_SLOT_NUMEL, plan_slot_numel, slot_bytes

    want = swap_chunk(1_000_000, 10**8, 8)
    roomy = plan_slot_numel(1_000_000, 10**8, 2, 4, cap_bytes=1 << 40, in_use_bytes=0)
    assert roomy == want
    budget = 4 * slot_bytes(want, 2, 4096) // 2
    tight = plan_slot_numel(1_000_000, 10**8, 2, 4, cap_bytes=budget, in_use_bytes=0)
    assert MIN_SLOT_NUMEL <= tight < want and tight % 1024 == 0
    assert 4 * slot_bytes(tight, 2, 4096) <= budget
    with pytest.raises(ValueError, match=r"buffer_count=4 .*sub_group_size=1000000"):
        plan_slot_numel(1_000_000, 10**8, 2, 4, cap_bytes=100_000, in_use_bytes=50_000)
