"""Shared by the stage-3 inference tests: a small Llama, an inference engine over a tier, the units held
in host memory."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import zero


def llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def engine_for(tmp_path, tier: str, model: nn.Module = None, bucket: int = 10**8, **extra):
    off = {"device": tier}
    if tier == "nvme":
        off.update(nvme_path=str(tmp_path), max_in_cpu=3000, buffer_count=2)
    zero_section = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": bucket,
        "offload_param": off,
    }
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero_section, **extra}
    engine, *_ = zero.initialize(model=llama() if model is None else model, config=cfg)
    return engine


def host_units(store, units):
    return [u for u in units if not store.on_nvme(u)]
