"""Child process of the chaos test: a ZeRO-Infinity training loop that resumes from its last checkpoint.

    python tests/chaos_train.py WORK_DIR TOTAL_STEPS SAVE_EVERY

Stage 3 with parameters and optimizer state on NVMe under `WORK_DIR/nvme`, checkpoints in `WORK_DIR/ckpt`.
On start it loads `latest` if there is one, then trains up to TOTAL_STEPS, saving every SAVE_EVERY steps.
Each finished step appends `step loss.hex()` to `WORK_DIR/losses.<pid>` (flushed and fsynced: a line
there is a step that ran, whatever happens after). It prints one line per event on stdout (`event N
name`), flushing each, so the parent can pick a kill point by event count. At the end it writes the fp32
master and the module's weights to `WORK_DIR/final.pt` and exits normally.

`CHAOS_SELF_KILL=<checkpoint crash point>@<save number>` makes the process SIGKILL itself at that point
inside its save number N (counted from 1 in this process), through the checkpoint module's crash hook.
"""

from __future__ import annotations

import os
import sys

import torch

import zero
from zero.checkpoint import CRASH_ENV
from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch

CFG = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.1)
BATCH = 4


def config(nvme: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 4096,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
        },
    }


class Events:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, name: str) -> None:
        self.n += 1
        sys.stdout.write(f"event {self.n} {name}\n")
        sys.stdout.flush()


def main() -> None:
    work, total, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    nvme, ckpt = os.path.join(work, "nvme"), os.path.join(work, "ckpt")
    self_kill = os.environ.pop("CHAOS_SELF_KILL", "")
    kill_point, _, kill_save = self_kill.partition("@")
    event = Events()
    data = corpus_bytes()
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=config(nvme)):
        model = GPT(CFG)
    engine, *_ = zero.initialize(model=model, config=config(nvme))
    event("initialized")
    start = 0
    if os.path.isfile(os.path.join(ckpt, "latest")):
        engine.load_checkpoint(ckpt)
        start = engine.global_steps
    event(f"resumed {start}")
    log = open(os.path.join(work, f"losses.{os.getpid()}"), "a")
    saves = 0
    for step in range(start, total):
        x, y = get_batch(data, BATCH, CFG.seq_len, step)
        loss = engine(x, y)
        event("forward")
        engine.backward(loss)
        event("backward")
        engine.step()
        log.write(f"{step} {loss.item().hex()}\n")
        log.flush()
        os.fsync(log.fileno())
        event("step")
        if (step + 1) % every == 0:
            saves += 1
            if kill_point and int(kill_save) == saves:
                os.environ[CRASH_ENV] = kill_point
            event("save")
            engine.save_checkpoint(ckpt)
            event("saved")
    log.close()
    torch.save(zero.consolidated_state_dict(engine, fp32=True), os.path.join(work, "final.pt"))
    engine.close()
    event("done")


if __name__ == "__main__":
    main()
