"""`python -m zero.examples.demo`: train a small GPT on Python's own source with the optimizer on NVMe.

Prints the loss per step and, from the engine's own report, where the bytes live (pinned host memory,
NVMe swap files), how many moved per step and at what rate. Options: --offload {none,cpu,nvme}, --steps,
--dir (the nvme_path; default a temporary directory, removed at the end), --stage {2,3} and, at stage 3,
--offload-param {none,cpu,nvme} (ZeRO-Infinity: `--stage 3 --offload-param nvme` keeps parameters and
optimizer state in swap files; the model is then built under zero.Init, never whole in memory).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from typing import List, Optional

import torch

from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch, num_params
from zero.initialization import initialize
from zero.report import format_bytes
from zero.stage3.init import Init


def build_config(
    offload: str, nvme_dir: str, batch: int, sub_group: int, stage: int = 2, offload_param: str = "none"
) -> dict:
    """The DeepSpeed config the demo trains with, for the chosen stage and offload tiers."""
    zo: dict = {"stage": stage, "sub_group_size": sub_group}
    if offload != "none":
        zo["offload_optimizer"] = {
            "device": offload,
            "nvme_path": nvme_dir,
            "buffer_count": 4,
            "max_in_cpu": 0,
        }
    if stage == 3 and offload_param != "none":
        # max_in_cpu 0: every partition in its swap file (DeepSpeed's default keeps up to 1e9 in memory)
        zo["offload_param"] = {"device": offload_param, "nvme_path": nvme_dir, "max_in_cpu": 0}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"warmup_num_steps": 5, "total_num_steps": 1000, "warmup_min_ratio": 0.1},
        },
        "zero_optimization": zo,
    }


def main(argv: Optional[List[str]] = None) -> int:
    """Run the training demo (`python -m zero.examples.demo`) with `argv`; returns the process exit code."""
    ap = argparse.ArgumentParser(prog="python -m zero.examples.demo", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--offload", choices=("none", "cpu", "nvme"), default="nvme", help="where optimizer state lives"
    )
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    ap.add_argument(
        "--dir", default=None, help="nvme_path for the swap files (default: a temporary directory)"
    )
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument(
        "--d-model", type=int, default=256, help="model width (default 256: about 3.3M parameters)"
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stage", type=int, choices=(2, 3), default=2, help="ZeRO stage (default 2)")
    ap.add_argument(
        "--offload-param",
        choices=("none", "cpu", "nvme"),
        default="none",
        help="stage 3: where parameter partitions live (default none)",
    )
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.offload_param != "none" and args.stage != 3:
        ap.error("--offload-param needs --stage 3")

    torch.manual_seed(0)
    model_cfg = GPTConfig(
        seq_len=128, n_layer=args.layers, n_head=max(1, args.d_model // 64), d_model=args.d_model
    )
    n_params = num_params(model_cfg)
    data = corpus_bytes()
    tmp = tempfile.TemporaryDirectory(prefix="zero-demo-") if args.dir is None else None
    nvme_dir = args.dir if args.dir is not None else tmp.name  # type: ignore[union-attr]
    # Several sub-groups, so the NVMe pipeline (read i+1 / update i / write i-1) has something to overlap.
    sub_group = max(1 << 16, n_params // 6)
    cfg = build_config(args.offload, nvme_dir, args.batch, sub_group, args.stage, args.offload_param)
    with Init(config=cfg, enabled=args.stage == 3):
        model = GPT(model_cfg)
    engine, _, _, _ = initialize(model=model, config=cfg)
    print(
        f"zero-offload demo: GPT {n_params / 1e6:.1f}M parameters ({model_cfg.n_layer} layers, d_model "
        f"{model_cfg.d_model}), byte-level text of {len(data) / 1e3:.0f} kB of Python stdlib source"
    )
    print(
        f"optimizer: AdamW, ZeRO stage {args.stage}, offload={args.offload}"
        + (f", offload_param={args.offload_param}" if args.stage == 3 else "")
        + (f", swap files under {engine.swap_dir}" if engine.swap_dir else "")
        + f", device {engine.device}, {torch.get_num_threads()} threads"
    )
    t_start = time.perf_counter()
    losses = []
    read = written = 0
    opt_time = 0.0
    try:
        for step in range(args.steps):
            x, y = get_batch(data, args.batch, model_cfg.seq_len, step)
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            dt = time.perf_counter() - t0
            rep = engine.last_report
            assert rep is not None
            losses.append(loss.item())
            read += rep.nvme_read_bytes
            written += rep.nvme_write_bytes
            opt_time += rep.optimizer_s
            line = (
                f"step {step + 1:3d}  loss {loss.item():.4f}  lr {engine.get_lr()[0]:.2e}  "
                f"{dt * 1e3:6.0f} ms (fwd {rep.forward_s * 1e3:.0f} bwd {rep.backward_s * 1e3:.0f} "
                f"opt {rep.optimizer_s * 1e3:.0f})"
            )
            param_io = getattr(engine, "last_param_io", None)
            if param_io and param_io["param_nvme_read_bytes"]:
                line += (
                    f"  params r {format_bytes(param_io['param_nvme_read_bytes'])} "
                    f"w {format_bytes(param_io['param_nvme_write_bytes'])}"
                )
            if rep.nvme_read_bytes:
                line += (
                    f"  nvme r {format_bytes(rep.nvme_read_bytes)} w {format_bytes(rep.nvme_write_bytes)} "
                    f"{rep.nvme_gbps:.2f} GB/s"
                )
            print(line, flush=True)
        elapsed = time.perf_counter() - t_start
        print()
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps, {elapsed:.1f} s")
        print(
            f"bytes per tier: pinned host {format_bytes(engine.pinned_bytes)}, "
            f"NVMe files {format_bytes(engine.nvme_bytes)}"
        )
        if read or written:
            print(
                f"NVMe per step: read {format_bytes(read / args.steps)}, "
                f"written {format_bytes(written / args.steps)}; "
                f"{(read + written) / opt_time / 1e9:.2f} GB/s over the optimizer phase"
            )
        ok = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    finally:
        engine.close()
        if tmp is not None:
            tmp.cleanup()
    if not ok:
        print("loss did not decrease", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
