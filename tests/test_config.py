"""The DeepSpeed-compatible config schema: DeepSpeed configs load unchanged, mistakes are clear errors."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config import (
    AioConfig,
    ConfigError,
    OffloadOptimizerConfig,
    ZeroConfig,
    ZeroOffloadConfig,
    load_config,
    validate_aio_section,
)

# The ZeRO-Offload tutorial's configuration, written from the keys DeepSpeed documents for it: stage 2,
# optimizer states offloaded to pinned CPU memory, fp16 with dynamic loss scaling, Adam and WarmupLR.
ZERO_OFFLOAD_TUTORIAL = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "steps_per_print": 100,
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "contiguous_gradients": True,
        "overlap_comm": True,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
    },
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 0.00015, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.00015, "warmup_num_steps": 1000},
    },
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "wall_clock_breakdown": False,
}

# A ZeRO-Infinity style config: stage 3 with parameters and optimizer states on NVMe, the old aio key
# "thread_count", and the deprecated stage3_gather_fp16 spelling.
ZERO_INFINITY = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 8,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
            "pipeline_read": True,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
        "sub_group_size": 1e9,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_gather_fp16_weights_on_model_save": True,
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2, "single_submit": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10000, "warmup_num_steps": 100}},
}


def errmsg(config, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world_size)
    return str(info.value)


# --- DeepSpeed configs load unchanged -----------------------------------------------------------------


def test_zero_offload_tutorial_config_loads_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO_OFFLOAD_TUTORIAL, indent=2))
    before = copy.deepcopy(ZERO_OFFLOAD_TUTORIAL)
    for cfg in (load_config(ZERO_OFFLOAD_TUTORIAL), load_config(str(path)), load_config(path)):
        assert (
            cfg.train_batch_size,
            cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps,
        ) == (
            16,
            4,
            4,
        )
        assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 100
        z = cfg.zero_optimization
        assert z.stage == 2 and z.contiguous_gradients and z.overlap_comm
        assert z.offload_optimizer == OffloadOptimizerConfig(device="cpu", pin_memory=True)
        assert z.offload_param is None or z.offload_param.device == "none"
        assert z.reduce_bucket_size == 500_000_000 and type(z.reduce_bucket_size) is int
        assert cfg.optimizer.type == "adam"
        assert cfg.optimizer.params["lr"] == 0.00015
        assert cfg.optimizer.params["betas"] == (0.9, 0.999)
        assert cfg.optimizer.params["adam_w_mode"] is True  # DeepSpeed's default for type Adam
        assert cfg.scheduler.type == "WarmupLR"
        assert cfg.scheduler.params["warmup_num_steps"] == 1000
        assert cfg.fp16.enabled and cfg.fp16.dynamic_loss_scale and cfg.fp16.initial_dynamic_scale == 65536.0
    assert ZERO_OFFLOAD_TUTORIAL == before  # the caller's dict is not modified


def test_zero_infinity_config_loads_with_legacy_spellings() -> None:
    cfg = load_config(ZERO_INFINITY, world_size=4)
    assert cfg.train_batch_size == 2 * 8 * 4
    z = cfg.zero_optimization
    assert z.stage == 3 and z.overlap_comm is True  # DeepSpeed turns overlap_comm on for stage 3
    assert z.offload_optimizer.device == "nvme" and z.offload_optimizer.nvme_path == "/local_nvme"
    assert z.offload_optimizer.pipeline_read and z.offload_optimizer.pipeline
    assert z.offload_param.device == "nvme" and z.offload_param.buffer_size == 100_000_000
    assert z.offload_param.max_in_cpu == 1_000_000_000
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert cfg.aio == AioConfig(block_size=262144, queue_depth=32, intra_op_parallelism=2)
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.optimizer.type == "adamw" and cfg.optimizer.params["adam_w_mode"] is True
    assert cfg.scheduler.params["cos_min_ratio"] == 0.0001 and cfg.scheduler.params["warmup_min_ratio"] == 0.0


def test_huggingface_zero3_config_after_auto_resolution_loads() -> None:
    # The shape of the HuggingFace Trainer's stage-3 example once its "auto" values are filled in.
    config = {
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": 2e-5,
                "warmup_num_steps": 500,
                "total_num_steps": 5000,
            },
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": 16777216,
            "stage3_prefetch_bucket_size": 15099494.4,
            "stage3_param_persistence_threshold": 40960,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 2000,
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 8,
        "wall_clock_breakdown": False,
    }
    # A size computed as 0.9 * hidden_size**2 is not a whole number: an element count must be an integer
    # (DeepSpeed's pydantic-2 schema refuses fractional ints as well).
    msg = errmsg(config, world_size=8)
    assert "zero_optimization.stage3_prefetch_bucket_size in <dict>: expected an integer" in msg
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 15099494
    cfg = load_config(config, world_size=8)
    z = cfg.zero_optimization
    assert z.offload_param.device != "none" and z.offload_optimizer.device != "none"
    assert cfg.scheduler.params["total_num_steps"] == 5000


def test_defaults_are_deepspeeds() -> None:
    cfg = load_config(None)
    assert cfg == ZeroOffloadConfig() == load_config({})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        1,
        1,
        1,
    )
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.gradient_clipping == 0.0 and cfg.steps_per_print == 10 and cfg.wall_clock_breakdown is False
    f = cfg.fp16
    assert (f.enabled, f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis) == (
        False,
        0,
        16,
        1000,
        2,
    )
    assert (f.consecutive_hysteresis, f.min_loss_scale, f.auto_cast) == (False, 1, False)
    assert cfg.bf16.enabled is False
    z = cfg.zero_optimization
    assert z == ZeroConfig()
    assert (z.stage, z.contiguous_gradients, z.overlap_comm, z.reduce_scatter) == (0, True, False, True)
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.sub_group_size) == (5 * 10**8, 5 * 10**8, 10**9)
    assert z.allgather_partitions and z.offload_optimizer is None and z.offload_param is None
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (5 * 10**7, 10**5)
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance) == (10**9, 10**9)
    assert z.stage3_model_persistence_threshold == sys.maxsize
    assert z.stage3_gather_16bit_weights_on_model_save is False and z.round_robin_gradients is False
    a = cfg.aio
    assert (a.block_size, a.queue_depth, a.intra_op_parallelism) == (1048576, 8, 1)
    assert (a.single_submit, a.overlap_events, a.use_gds, a.backend) == (False, True, False, "auto")
    assert cfg.zero_offload.report is False and cfg.zero_offload.report_every == 1


def test_offload_section_defaults() -> None:
    cfg = load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {}, "offload_param": {}}})
    o, p = cfg.zero_optimization.offload_optimizer, cfg.zero_optimization.offload_param
    assert (o.device, o.nvme_path, o.pin_memory, o.buffer_count) == ("none", None, True, 4)  # always pinned
    assert (o.pipeline_read, o.pipeline_write, o.fast_init, o.ratio) == (False, False, False, 1.0)
    assert (p.device, p.nvme_path, p.pin_memory, p.buffer_count) == ("none", None, False, 5)
    assert (p.buffer_size, p.max_in_cpu) == (10**8, "auto")
    assert cfg.zero_optimization.offload_optimizer.device == "none"


def test_config_is_frozen() -> None:
    cfg = load_config(ZERO_OFFLOAD_TUTORIAL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train_batch_size = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.zero_optimization.stage = 3  # type: ignore[misc]


# --- round trip ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        None,
        ZERO_OFFLOAD_TUTORIAL,
        ZERO_INFINITY,
        {
            "optimizer": {"type": "Lion"},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.0, "cycle_max_lr": 1e-3}},
        },
        {"optimizer": {"type": "adagrad"}, "scheduler": {"type": "LRRangeTest"}},
        {
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 2.0]},
            }
        },
        {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_type": "linear"}}},
        {"zero_optimization": {"cpu_offload": True, "cpu_offload_use_pin_memory": True}},
        {"aio": {"io_backend": "posix"}, "zero_offload": {"report": True, "report_every": 5}},
    ],
)
def test_to_dict_round_trips(config) -> None:
    world_size = 4 if config is ZERO_INFINITY else 1
    cfg = load_config(config, world_size=world_size)
    d = cfg.to_dict()
    text = json.dumps(d)  # JSON-serialisable
    assert load_config(json.loads(text), world_size=world_size) == cfg
    assert load_config(d, world_size=world_size).to_dict() == d


def test_to_dict_has_every_field() -> None:
    d = load_config(ZERO_INFINITY, world_size=2).to_dict()

    def fields_of(obj) -> set:
        return {f.name for f in dataclasses.fields(obj)}

    cfg = load_config(ZERO_INFINITY, world_size=2)
    assert set(d) == fields_of(cfg)
    assert set(d["zero_optimization"]) == fields_of(cfg.zero_optimization)
    assert set(d["zero_optimization"]["offload_param"]) == fields_of(cfg.zero_optimization.offload_param)
    assert set(d["aio"]) == fields_of(cfg.aio)
    assert set(d["fp16"]) == fields_of(cfg.fp16)
    assert d["optimizer"]["params"]["betas"] == [0.9, 0.999]
    assert set(d["optimizer"]["params"]) >= {"lr", "betas", "eps", "weight_decay", "bias_correction"}


# --- unknown keys ---------------------------------------------------------------------------------------


def test_unknown_nested_key_names_path_source_and_suggestion() -> None:
    msg = errmsg({"zero_optimization": {"stgae": 2}})
    assert msg.startswith(
        "unknown key 'zero_optimization.stgae' in <dict>; did you mean 'stage'? valid keys: "
    )
    assert "reduce_bucket_size" in msg


def test_unknown_key_in_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(
        json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": True}}})
    )
    msg = errmsg(str(path))
    assert f"unknown key 'zero_optimization.offload_optimizer.pin_memroy' in {path}" in msg
    assert "did you mean 'pin_memory'?" in msg


@pytest.mark.parametrize(
    "config, key, guess",
    [
        ({"trian_batch_size": 8}, "trian_batch_size", "train_batch_size"),
        ({"fp16": {"enable": True}}, "fp16.enable", "enabled"),
        ({"optimizer": {"type": "Adam", "params": {"lrr": 1e-3}}}, "optimizer.params.lrr", "lr"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_step": 10}}},
            "scheduler.params.warmup_step",
            None,
        ),
        ({"aio": {"queue_dept": 8}}, "aio.queue_dept", "queue_depth"),
        ({"zero_offload": {"reprot": True}}, "zero_offload.reprot", "report"),
        ({"Zero_Optimization": {}}, "Zero_Optimization", "zero_optimization"),
    ],
)
def test_unknown_keys(config, key, guess) -> None:
    msg = errmsg(config)
    assert msg.startswith(f"unknown key '{key}' in <dict>")
    assert "valid keys: " in msg
    if guess:
        assert f"did you mean '{guess}'?" in msg


def test_optimizer_params_are_checked_per_type() -> None:
    # eps is an Adam parameter but not a Lion one.
    msg = errmsg({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})
    assert msg.startswith("unknown key 'optimizer.params.eps'")
    msg = errmsg({"optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}})
    assert msg.startswith("unknown key 'optimizer.params.betas'")


# --- types and ranges ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, fragment",
    [
        (
            {"zero_optimization": {"stage": "2"}},
            "zero_optimization.stage in <dict>: expected an integer, got string '2'",
        ),
        (
            {"zero_optimization": {"stage": True}},
            "zero_optimization.stage in <dict>: expected an integer, got boolean",
        ),
        ({"zero_optimization": {"reduce_bucket_size": 1.5}}, "expected an integer, got number 1.5"),
        ({"fp16": {"enabled": "true"}}, "fp16.enabled in <dict>: expected true or false, got string 'true'"),
        ({"fp16": {"enabled": "auto"}}, "HuggingFace"),
        ({"fp16": {"enabled": None}}, "fp16.enabled in <dict>: expected true or false, got null"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping in <dict>: expected a number"),
        ({"zero_optimization": []}, "zero_optimization in <dict>: expected an object"),
        ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas"),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}},
            "each value must be in [0.0, 1.0)",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            "must be one of 'none', 'cpu', 'nvme'",
        ),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvem"}}}, "did you mean 'nvme'?"),
        (
            {"aio": {"backend": "uring"}},
            "aio.backend in <dict>: must be one of 'auto', 'io_uring', 'aio', 'psync'",
        ),
    ],
)
def test_wrong_types(config, fragment) -> None:
    assert fragment in errmsg(config)


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage in <dict>: must be <= 3, got 4"),
        ({"zero_optimization": {"reduce_bucket_size": -1}}, "must be >= 0, got -1"),
        ({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}}, "must be <= 1.0, got 1.5"),
        ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis in <dict>: must be >= 1, got 0"),
        ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale in <dict>: must be > 0.0"),
        ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale in <dict>: must be >= 0.0"),
        ({"train_batch_size": 0}, "train_batch_size in <dict>: must be >= 1, got 0"),
        ({"gradient_clipping": -0.5}, "gradient_clipping in <dict>: must be >= 0.0"),
        ({"aio": {"queue_depth": 0}}, "aio.queue_depth in <dict>: must be in [1, 4096], got 0"),
        (
            {"optimizer": {"type": "Adam", "params": {"lr": -1e-3}}},
            "optimizer.params.lr in <dict>: must be >= 0.0",
        ),
        ({"zero_offload": {"report_every": 0}}, "zero_offload.report_every in <dict>: must be >= 1"),
        ({"gradient_clipping": float("nan")}, "must be a finite number"),
    ],
)
def test_out_of_range(config, fragment) -> None:
    assert fragment in errmsg(config)


def test_float_sizes_become_ints() -> None:
    z = load_config(
        {"zero_optimization": {"reduce_bucket_size": 2e8, "sub_group_size": 1e12}}
    ).zero_optimization
    assert z.reduce_bucket_size == 200_000_000 and type(z.reduce_bucket_size) is int
    assert z.sub_group_size == 10**12 and type(z.sub_group_size) is int


def test_nvme_device_requires_nvme_path() -> None:
    msg = errmsg({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert "zero_optimization.offload_param.nvme_path in <dict>: is required when device is 'nvme'" in msg
    msg = errmsg({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ""}}})
    assert "zero_optimization.offload_optimizer.nvme_path" in msg


def test_partial_offload_ratio_and_max_in_cpu_are_parsed() -> None:
    for stage in (0, 1, 2, 3):
        cfg = load_config(
            {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
        )
        assert cfg.zero_optimization.offload_optimizer.ratio == 0.5
    cfg = load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1}}})
    o = cfg.zero_optimization.offload_optimizer
    assert o.ratio == 1.0 and o.max_in_cpu == "auto"
    nvme = {"device": "nvme", "nvme_path": "/tmp"}
    o = load_config({"zero_optimization": {"offload_optimizer": {**nvme, "max_in_cpu": 1e6}}})
    assert o.zero_optimization.offload_optimizer.max_in_cpu == 1_000_000
    assert "must be >= 0, got -1" in errmsg({"zero_optimization": {"offload_optimizer": {"max_in_cpu": -1}}})
    assert "expected an integer" in errmsg(
        {"zero_optimization": {"offload_optimizer": {"max_in_cpu": "all"}}}
    )


def test_fp16_and_bf16_both_enabled() -> None:
    msg = errmsg({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled and bf16.enabled" in msg
    assert load_config({"fp16": {"enabled": True}, "bf16": {"enabled": False}}).fp16.enabled


def test_bfloat16_old_spelling() -> None:
    assert load_config({"bfloat16": {"enabled": True}}).bf16.enabled
    assert "give only one" in errmsg({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}})


def test_world_size_validated() -> None:
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ConfigError, match="world_size"):
            load_config(None, world_size=bad)  # type: ignore[arg-type]


def test_bad_config_argument_type() -> None:
    with pytest.raises(ConfigError, match="config must be a dict"):
        load_config(42)  # type: ignore[arg-type]


# --- not supported (yet) ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, key",
    [
        ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
        ({"aio": {"use_gds": True}}, "aio.use_gds"),
        ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp"),
        ({"prescale_gradients": True}, "prescale_gradients"),
        ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
        ({"communication_data_type": "fp32"}, "communication_data_type"),
        ({"sparse_gradients": True}, "sparse_gradients"),
        ({"elasticity": {"enabled": True}}, "elasticity"),
        ({"compression_training": {"weight_quantization": {}}}, "compression_training"),
        ({"data_efficiency": {"enabled": True}}, "data_efficiency"),
        ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
        ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
        ({"zero_optimization": {"zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "super_offload": True}}},
            "zero_optimization.offload_optimizer.super_offload",
        ),
        ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal"),
        ({"data_types": {"buffer_dtype": "fp32"}}, "data_types.buffer_dtype"),
        ({"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype"),
        ({"optimizer": {"type": "Adagrad", "params": {"lr_decay": 0.1}}}, "optimizer.params.lr_decay"),
    ],
)
def test_behaviour_changing_keys_are_not_supported(config, key) -> None:
    msg = errmsg(config)
    assert msg.startswith(f"{key} in <dict>: ")
    assert msg.endswith("is not supported yet by zero-offload")


@pytest.mark.parametrize("name", ["Lamb", "OneBitAdam", "SGD", "muon"])
def test_other_deepspeed_optimizers_not_supported(name: str) -> None:
    msg = errmsg({"optimizer": {"type": name}})
    assert f"'{name}' is not supported yet by zero-offload (supported: Adam, AdamW, Adagrad, Lion)" in msg


def test_misspelled_optimizer_type_gets_suggestion() -> None:
    assert "did you mean 'AdamW'?" in errmsg({"optimizer": {"type": "AdamWW"}})
    assert "'type' is required" in errmsg({"optimizer": {"params": {}}})


def test_max_grad_norm_points_at_gradient_clipping() -> None:
    msg = errmsg({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})
    assert "optimizer.params.max_grad_norm" in msg and "gradient_clipping" in msg


def test_switched_off_features_are_accepted_silently(caplog: pytest.LogCaptureFixture) -> None:
    config = {
        "amp": {"enabled": False, "opt_level": "O1"},
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "sparse_gradients": False,
        "communication_data_type": None,
        "elasticity": {"enabled": False},
        "tensorboard": {"enabled": False, "output_path": "runs/"},
        "flops_profiler": {"enabled": False},
        "zero_allow_untested_optimizer": False,
        "zero_optimization": {"stage": 1, "zero_quantized_weights": False, "mics_shard_size": -1},
        "fp16": {"enabled": True, "fp16_master_weights_and_grads": False, "fused_mode": True},
    }
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        cfg = load_config(config)
    assert caplog.records == []
    assert cfg.zero_optimization.stage == 1 and cfg.fp16.enabled


def test_ignored_tooling_keys_warn_once_each(caplog: pytest.LogCaptureFixture) -> None:
    config = {
        "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "x"},
        "wandb": {"enabled": True, "project": "p"},
        "flops_profiler": {"enabled": True, "profile_step": 1},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
        "checkpoint": {"tag_validation": "Fail"},
        "zero_optimization": {"stage": 2, "log_trace_cache_warnings": True},
    }
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        load_config(config)
    messages = [r.getMessage() for r in caplog.records]
    for key in (
        "tensorboard",
        "wandb",
        "flops_profiler",
        "zero_optimization.log_trace_cache_warnings",
    ):
        assert sum(f"'{key}' is accepted but ignored" in m for m in messages) == 1, key
    # the section is read; of its keys only partition_activations does nothing (one model-parallel rank)
    assert sum("'activation_checkpointing.partition_activations' = True" in m for m in messages) == 1
    assert len(messages) == 5  # checkpoint.tag_validation is read (save_checkpoint compares the tags)


def test_torch_adam_is_accepted_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        cfg = load_config({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}})
    assert cfg.optimizer.params["torch_adam"] is True
    assert any("optimizer.params.torch_adam" in r.getMessage() for r in caplog.records)


# --- optimizer and scheduler normalisation ---------------------------------------------------------------


def test_optimizer_types_are_case_insensitive_and_filled_in() -> None:
    adam = load_config({"optimizer": {"type": "ADAMW"}}).optimizer
    assert adam.type == "adamw"
    assert adam.params == {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "adam_w_mode": True,
        "bias_correction": True,
        "amsgrad": False,
        "torch_adam": False,
        "fp32_optimizer_states": True,
        "state_dtype": "fp32",
        "stochastic_rounding": False,
    }
    plain = load_config({"optimizer": {"type": "adam", "params": {"adam_w_mode": False}}}).optimizer
    assert plain.type == "adam" and plain.params["adam_w_mode"] is False
    adagrad = load_config({"optimizer": {"type": "Adagrad"}}).optimizer
    assert adagrad.params == {
        "lr": 1e-2,
        "eps": 1e-10,
        "weight_decay": 0.0,
        "amsgrad": False,
        "fp32_optimizer_states": True,
        "state_dtype": "fp32",
        "stochastic_rounding": False,
    }
    lion = load_config({"optimizer": {"type": "Lion", "params": {"betas": [0.95, 0.98]}}}).optimizer
    assert lion.params == {
        "lr": 1e-3,
        "betas": (0.95, 0.98),
        "weight_decay": 0.0,
        "fp32_optimizer_states": True,
        "state_dtype": "fp32",
        "stochastic_rounding": False,
    }


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "Adagrad", "Lion"])
def test_resolved_params_are_accepted_by_the_engine(kind: str) -> None:
    # The engine builds its update rule from cfg.optimizer; every resolved key must be one it knows.
    optimizer_offload = pytest.importorskip("zero.optimizer.rules")
    opt = load_config({"optimizer": {"type": kind, "params": {"lr": 0.25}}}).optimizer
    _, hyper = optimizer_offload.rule_from_config(opt.type, dict(opt.params))
    assert hyper["lr"] == 0.25


def test_adamw_ignores_adam_w_mode_false_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        opt = load_config({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}).optimizer
    assert opt.params["adam_w_mode"] is True
    assert any("adam_w_mode" in r.getMessage() for r in caplog.records)


def test_scheduler_validation() -> None:
    sched = load_config({"scheduler": {"type": "warmuplr"}}).scheduler
    assert sched.type == "WarmupLR"
    assert sched.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    }
    assert "scheduler.params.total_num_steps in <dict>: is required" in errmsg(
        {"scheduler": {"type": "WarmupDecayLR"}}
    )
    assert "scheduler.params.cycle_min_lr" in errmsg({"scheduler": {"type": "OneCycle"}})
    assert "must be one of 'log', 'linear'" in errmsg(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}
    )
    assert "did you mean 'OneCycle'?" in errmsg({"scheduler": {"type": "OneCylce"}})
    assert "warmup_num_steps in <dict>: must be >= 1" in errmsg(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}
    )


# --- zero_optimization legacy forms ---------------------------------------------------------------------


def test_cpu_offload_legacy_flags() -> None:
    z = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}}).zero_optimization
    assert z.offload_optimizer == OffloadOptimizerConfig(device="cpu")
    z = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": True,
            }
        }
    ).zero_optimization
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert z.offload_param.device == "cpu" and z.offload_param.pin_memory
    assert (
        load_config({"zero_optimization": {"cpu_offload": False}}).zero_optimization.offload_optimizer is None
    )
    msg = errmsg({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    assert "zero_optimization.cpu_offload in <dict>: is the deprecated spelling" in msg


def test_gather_fp16_legacy_spelling() -> None:
    both = {
        "stage3_gather_fp16_weights_on_model_save": True,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    assert "give only one" in errmsg({"zero_optimization": both})


def test_zero_optimization_boolean_format() -> None:
    z = load_config({"zero_optimization": True, "allgather_size": 1e8}).zero_optimization
    assert z.stage == 1 and z.allgather_bucket_size == 100_000_000
    assert load_config({"zero_optimization": False}).zero_optimization.stage == 0
    assert "allgather_size" in errmsg({"allgather_size": 1e8, "zero_optimization": {"stage": 1}})


def test_overlap_comm_default_depends_on_stage() -> None:
    assert load_config({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False
    assert load_config({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert (
        load_config({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization.overlap_comm
        is False
    )


def test_offload_param_below_stage_3_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        cfg = load_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert any("only applies to stage 3" in r.getMessage() for r in caplog.records)


# --- batch sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, world_size, expected",
    [
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
            4,
            (32, 4, 2),
        ),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 32}, 4, (32, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
        ({"gradient_accumulation_steps": 5}, 2, (10, 1, 5)),
        ({}, 3, (3, 1, 1)),
    ],
)
def test_batch_resolution(given, world_size, expected) -> None:
    cfg = load_config(given, world_size=world_size)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected


@pytest.mark.parametrize(
    "given, world_size",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, 1),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 16}, 1),
        ({"train_batch_size": 2}, 4),
        ({"train_batch_size": 6, "gradient_accumulation_steps": 4}, 1),
    ],
)
def test_inconsistent_batch_sizes(given, world_size) -> None:
    msg = errmsg(given, world_size=world_size)
    assert msg.startswith("inconsistent batch sizes in <dict>: train_batch_size")
    assert f"world_size ({world_size})" in msg


@settings(max_examples=60, deadline=None)
@given(
    micro=st.integers(1, 64),
    acc=st.integers(1, 16),
    world_size=st.integers(1, 8),
    drop=st.sampled_from(
        ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
    ),
)
def test_any_two_batch_keys_determine_the_third(micro: int, acc: int, world_size: int, drop: str) -> None:
    full = {
        "train_batch_size": micro * acc * world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": acc,
    }
    partial = {k: v for k, v in full.items() if k != drop}
    cfg = load_config(partial, world_size=world_size)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        full["train_batch_size"],
        micro,
        acc,
    )


# --- aio -----------------------------------------------------------------------------------------------


def test_aio_thread_count_is_old_name_of_intra_op_parallelism() -> None:
    assert AioConfig.from_dict({"thread_count": 4}).intra_op_parallelism == 4
    assert AioConfig.from_dict({"intra_op_parallelism": 3, "thread_count": 3}).intra_op_parallelism == 3
    with pytest.raises(
        ConfigError, match="aio.intra_op_parallelism in <dict>: 2 disagrees with aio.thread_count"
    ):
        AioConfig.from_dict({"intra_op_parallelism": 2, "thread_count": 4})


def test_aio_backends() -> None:
    for backend in ("auto", "io_uring", "aio", "psync"):
        assert AioConfig.from_dict({"backend": backend}).backend == backend
    assert AioConfig.from_dict({"io_backend": "posix"}).backend == "psync"
    assert AioConfig.from_dict({"io_backend": "async_io"}).backend == "auto"
    with pytest.raises(ConfigError, match="not both"):
        AioConfig.from_dict({"io_backend": "posix", "backend": "aio"})


def test_aio_from_dict_to_dict_round_trip() -> None:
    a = AioConfig.from_dict(
        {"block_size": 4096, "queue_depth": 64, "single_submit": True, "backend": "psync"}
    )
    assert a.to_dict() == {
        "block_size": 4096,
        "queue_depth": 64,
        "intra_op_parallelism": 1,
        "single_submit": True,
        "overlap_events": True,
        "use_gds": False,
        "backend": "psync",
    }
    assert AioConfig.from_dict(a.to_dict()) == a
    assert AioConfig.from_dict(None) == AioConfig() == AioConfig.from_dict({})


def test_validate_aio_section(tmp_path: Path) -> None:
    assert validate_aio_section({"aio": {"queue_depth": 16}}).queue_depth == 16
    path = tmp_path / "aio.json"
    path.write_text(json.dumps({"aio": {"block_size": 65536, "intra_op_parallelism": 2}}))
    assert validate_aio_section(path) == AioConfig(block_size=65536, intra_op_parallelism=2)
    path.write_text(json.dumps({"aio": {"block_sise": 65536}}))
    with pytest.raises(
        ConfigError, match=f"unknown key 'aio.block_sise' in {re.escape(str(path))}; did you mean"
    ):
        validate_aio_section(str(path))
    with pytest.raises(ConfigError, match="unknown key 'zero_optimization'"):
        validate_aio_section({"aio": {}, "zero_optimization": {}})
    with pytest.raises(ConfigError, match="expected an object with an 'aio' key"):
        validate_aio_section({})


# --- files -----------------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    assert errmsg(str(path)) == f"config file {path} not found"


def test_invalid_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    msg = errmsg(path)
    assert msg.startswith(f"config file {path} is not valid JSON: ")
    assert "line 3 column" in msg


def test_duplicate_keys_rejected(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert "duplicate key 'train_batch_size'" in errmsg(path)


def test_top_level_must_be_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert "expected an object" in errmsg(path)


# --- the reference documents every key ---------------------------------------------------------------------


def test_every_key_is_documented() -> None:
    from offload.config import aio, loader, optimizer, precision, zero

    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"`([A-Za-z0-9_]+)`", doc))
    keys = set(loader.TOP_LEVEL_KEYS) | set(zero.ZERO_KEYS) | set(aio._AIO_KEYS)
    keys |= set(zero._OFFLOAD_OPTIMIZER_KEYS) | set(zero._OFFLOAD_PARAM_KEYS)
    keys |= set(precision._FP16_KEYS) | set(precision._BF16_KEYS)
    for params in list(optimizer._PARAM_KEYS.values()) + list(optimizer._SCHEDULER_KEYS.values()):
        keys |= set(params)
    keys |= {"report", "report_every", "tag_validation", "load_universal", "use_node_local_storage"}
    keys |= set(optimizer.SCHEDULER_TYPES) | set(optimizer.OPTIMIZER_TYPES.values())
    missing = sorted(keys - documented)
    assert missing == [], f"docs/configuration.md does not document: {missing}"
