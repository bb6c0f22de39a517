"""Shared by the engine tests: a tiny GPT, its data, a DeepSpeed config, a plain torch AdamW reference run
and the training loop, with the tolerances against torch (see LOSS_ATOL)."""

from __future__ import annotations

import torch

from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)


DATA = corpus_bytes()


STEPS = 30


# Per-step loss tolerance against torch.optim.AdamW. The C++ kernel and torch's AdamW differ only in
# floating-point rounding (~1e-7 relative per step); one skipped, repeated or mis-scaled step moves the loss
# by ~1e-3 at lr 1e-3, so 2e-5 catches any wrong step while allowing the rounding drift over 30 steps.
LOSS_ATOL = 2e-5


PARAM_ATOL = 2e-5


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def base_config(offload: str = "none", tmp=None, stage: int = 0, **extra):
    zo = {"stage": stage, "sub_group_size": 8000}
    if offload != "none":
        zo["offload_optimizer"] = {"device": offload}
        if offload == "nvme":
            # max_in_cpu 0: every sub-group on NVMe (the default "auto" keeps this tiny model's state in RAM)
            zo["offload_optimizer"].update(nvme_path=str(tmp), max_in_cpu=0)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "zero_optimization": zo,
    }
    cfg.update(extra)
    return cfg


def torch_reference(steps: int, clip: float = 0.0, batch: int = 4, lr_lambda=None):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    losses = []
    for step in range(steps):
        x, y = get_batch(DATA, batch, TINY.seq_len, step)
        loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses, model


def train(engine, steps: int, batch: int = 4, start: int = 0):
    losses = []
    for step in range(start, start + steps):
        x, y = get_batch(DATA, batch, TINY.seq_len, step)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def assert_close_trajectory(got, want, atol=LOSS_ATOL):
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= atol, f"loss trajectories differ by {worst:.3g} (first {got[:3]} vs {want[:3]})"


def s3_config(param: str, optim: str, tmp, **extra):
    cfg = base_config(optim, tmp, stage=3, **extra)
    zo = cfg["zero_optimization"]
    # persistence 0: every unit is gathered and freed per module, the path large models take
    zo["stage3_param_persistence_threshold"] = zo.get("stage3_param_persistence_threshold", 0)
    if param != "none":
        # max_in_cpu 0: every partition really lives in its swap file (the default keeps 1e9 in memory)
        zo["offload_param"] = {"device": param, "nvme_path": str(tmp), "max_in_cpu": 0}
    return cfg
