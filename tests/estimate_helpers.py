"""Shared by the estimator tests: a stage-3 engine config and the estimator's setup for the same model."""

from __future__ import annotations

from offload.estimate import (  # noqa: E402
    SwapBufferSettings,
    TrainingSetup,
)

PADDING_ALLOWANCE = 64 * 1024  # 4 KiB alignment of a few slots and a few dozen regions


def stage3_engine_config(tmp_path, param: str, optim: str, sub_group: int) -> dict:
    zo = {
        "stage": 3,
        "sub_group_size": sub_group,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {
            "device": optim,
            "nvme_path": str(tmp_path),
            "buffer_count": 4,
            "pin_memory": True,
            "max_in_cpu": 0,  # every sub-group on NVMe, as the estimate's default
        },
        "offload_param": {
            "device": param,
            "nvme_path": str(tmp_path),
            "pin_memory": True,
            "max_in_cpu": 0,  # every partition really in its swap file
            "buffer_count": 3,
            "buffer_size": 50_000,
        },
    }
    return {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zo,
    }


def stage3_setup(count, sub_group: int) -> TrainingSetup:
    return TrainingSetup(
        count.params,
        count.largest_layer_params,
        precision="bf16",
        optimizer="adamw",
        buffers=SwapBufferSettings(
            optimizer_buffer_count=4,
            sub_group_size=sub_group,
            param_buffer_count=3,
            param_buffer_size=50_000,
            param_max_in_cpu=0,
        ),
    )
