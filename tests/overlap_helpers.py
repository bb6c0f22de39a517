"""Shared by the overlap tests: a small stage-2 NVMe config with the overlap on or off, and a run of it that
returns the losses, weights, optimizer state, skipped steps and the reports."""

from __future__ import annotations

import torch
from swap_helpers import train_steps

import zero
from zero.examples.models import GPT, GPTConfig, corpus_bytes

MODEL = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)


SUB = 8192


def overlap_config(nvme: str, pipeline: bool, dtype: str = "fp32", in_ram: int = 0, **extra: object) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 2,
            "sub_group_size": SUB,  # about 8 sub-groups: several become ready at different times
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme,
                "buffer_count": 3,
                "max_in_cpu": in_ram,
                "pipeline_read": pipeline,
                "pipeline_write": pipeline,
            },
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        # 2**20 overflows the first steps of this model by a wide margin (here the first 5: 2**16 is the
        # last that overflows, and where fp16 matmuls round otherwise that edge moves): the scaler halves
        # it, later steps go through.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2}
    cfg.update(extra)
    return cfg


def overlap_run(cfg: dict, steps: int, gas: int = 1):
    torch.manual_seed(0)
    engine = zero.initialize(model=GPT(MODEL), config=dict(cfg, gradient_accumulation_steps=gas))[0]
    losses, overlapped = [], []
    for window in range(steps):
        losses += train_steps(engine, corpus_bytes(), 2, MODEL.seq_len, gas, start=window * gas)
        overlapped.append(engine.last_report.optimizer_overlapped)  # this window's pass ran during backward
    params = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    state = engine.optimizer.state_dict()
    out = {
        "losses": losses,
        "params": params,
        "state": state,
        "skipped": engine.skipped_steps,
        "early": engine.overlap.enabled,
        "overlapped": overlapped,
        "report": engine.last_report,
    }
    engine.close()
    return out
