"""ZeRO-Infinity on this machine: a model whose training state is at least twice the RAM, parameters and
optimizer state on NVMe, trained for a few steps with a bounded resident set.

    .venv/bin/python -m benchmarks.bench_infinity                     # ~3.4B parameters, 2 steps
    .venv/bin/python -m benchmarks.bench_infinity --layers 2 --d-model 512 --steps 2   # a quick check

The model (zero.examples.models.GPT, bf16) is built under `zero.Init`, so it is never whole in memory: each
layer is partitioned to NVMe as soon as it is constructed. Training state at 16 bytes per parameter (bf16
weight + bf16 gradient + fp32 master, m, v). Printed per step: time per phase, bytes per tier (parameter NVMe
reads and writes, optimizer NVMe reads and writes, gradients to the host), resident set size now and peak
(getrusage), and the ds-estimate-memory prediction for the same configuration next to the measured numbers.
One run, no repeats: the point is that it fits, not a precise timing (2 shared cores: noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import psutil
import torch
import torch.nn.functional as F
from torch import nn

import zero
from benchmarks.harness import write_outputs
from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch, num_params

GB = 1e9
GIB = float(1 << 30)


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class RssSampler:
    """Samples the resident set every `period` s: the peak inside each phase (getrusage gives only the
    process-wide peak)."""

    def __init__(self, period: float = 0.2) -> None:
        self.proc = psutil.Process()
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def start(self) -> RssSampler:
        """Start sampling; returns the sampler."""
        self._thread.start()
        return self

    def take_peak(self) -> int:
        """The highest RSS seen since the last call (resets it)."""
        peak, self.peak = max(self.peak, self.proc.memory_info().rss), 0
        return peak

    def stop(self) -> None:
        """Stop the sampling thread."""
        self._stop.set()
        self._thread.join()


class _Fp32Matmuls(torch.autograd.Function):
    """y = x W^T + b with fp32 matmuls on bf16 tensors. Saves the bf16 parameter, not an fp32 copy (which
    autograd would keep alive for every layer until backward: 4 bytes per parameter of the whole model)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b computed in fp32, returned in x's dtype; saves x and W for backward."""
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        out = F.linear(x.float(), w.float(), b.float() if b is not None else None)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        """The gradients of x, W and b from fp32 matmuls, in the tensors' dtypes."""
        x, w = ctx.saved_tensors
        g = grad.float().reshape(-1, grad.shape[-1])
        gx = (g @ w.float()).to(x.dtype).reshape(x.shape)
        gw = (g.t() @ x.reshape(-1, x.shape[-1]).float()).to(w.dtype)
        gb = g.sum(0).to(w.dtype) if ctx.has_bias else None
        return gx, gw, gb


class Fp32ComputeLinear(nn.Linear):
    """bf16 storage, fp32 matmuls: torch's CPU bf16 GEMM is ~20x slower than fp32 for the input-gradient
    shape of a small batch (measured here: 2.1 s vs 0.13 s for 16 x 8192 @ 8192 x 2048)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The linear layer through fp32 matmuls."""
        return _Fp32Matmuls.apply(x, self.weight, self.bias)


def make_config(args: argparse.Namespace, nvme: str, largest: int) -> Dict[str, Any]:
    """The ZeRO-Infinity config of the run: bf16, stage 3, parameters and optimizer on NVMe in `nvme`."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": int(args.sub_group),
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 2 * largest,
            "stage3_max_live_parameters": 4 * largest,
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme,
                "buffer_count": 4,
                "buffer_size": largest,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4, "max_in_cpu": 0},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32},
    }


def estimate(args: argparse.Namespace, params: int, largest: int) -> Dict[str, Any]:
    """The estimator CLI's answer for `params` parameters (largest layer `largest`), as a dict."""
    cmd = [
        sys.executable,
        "-m",
        "offload.cli.estimate_memory",
        "--params",
        str(params),
        "--largest-layer",
        str(largest),
        "--stage",
        "3",
        "--offload-optimizer",
        "nvme",
        "--offload-param",
        "nvme",
        "--precision",
        "bf16",
        "--optimizer",
        "adamw",
        "--sub-group-size",
        str(int(args.sub_group)),
        "--buffer-count",
        "4",
        "--param-buffer-count",
        "4",
        "--param-buffer-size",
        str(largest),
        "--param-max-in-cpu",
        "0",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-2000:], "command": " ".join(cmd[1:])}
    try:
        return {"command": " ".join(cmd[1:]), "result": json.loads(out.stdout)}
    except json.JSONDecodeError:
        return {"command": " ".join(cmd[1:]), "raw": out.stdout[-4000:]}


def main(argv: List[str] | None = None) -> None:
    """Command line: train a large GPT with ZeRO-Infinity and report its memory and step time."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=17)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sub-group", type=float, default=2e7)
    ap.add_argument("--nvme", default=None, help="directory for the swap files (default: a new one in /tmp)")
    ap.add_argument("--rss-limit-gib", type=float, default=12.0)
    args = ap.parse_args(argv)

    gcfg = GPTConfig(
        vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model
    )
    n_params = num_params(gcfg)
    largest = 4 * args.d_model * args.d_model + args.d_model  # the MLP's fc / out Linear
    state_bytes = 16 * n_params
    ram = psutil.virtual_memory().total
    nvme = args.nvme or tempfile.mkdtemp(prefix="zo-infinity-", dir="/tmp")
    os.makedirs(nvme, exist_ok=True)
    free_before = shutil.disk_usage(nvme).free
    print(
        f"model: {n_params / 1e9:.3f}B parameters ({args.layers} layers, d_model {args.d_model}), "
        "training state "
        f"{state_bytes / GB:.1f} GB = {state_bytes / ram:.2f} x RAM ({ram / GIB:.1f} GiB); disk free "
        f"{free_before / GB:.1f} GB at {nvme}",
        flush=True,
    )
    est = estimate(args, n_params, largest)
    print(f"ds-estimate-memory: {json.dumps(est)[:3000]}", flush=True)
    cfg = make_config(args, nvme, largest)
    sampler = RssSampler().start()
    rows: List[Dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with zero.Init(config=cfg):
            model = GPT(gcfg)
        for m in model.modules():
            if type(m) is nn.Linear:
                m.__class__ = Fp32ComputeLinear
        build_s = time.perf_counter() - t0
        build_peak = sampler.take_peak()
        print(f"built under zero.Init in {build_s:.1f} s, peak RSS {build_peak / GIB:.2f} GiB", flush=True)
        t0 = time.perf_counter()
        engine, *_ = zero.initialize(model=model, config=cfg)
        init_s = time.perf_counter() - t0
        init_peak = sampler.take_peak()
        print(
            f"zero.initialize in {init_s:.1f} s, peak RSS {init_peak / GIB:.2f} GiB, optimizer swap copies "
            f"{engine.optimizer_state_info().copies}, pinned {engine.pinned_bytes / GIB:.2f} GiB, "
            "optimizer state on disk "
            f"{engine.nvme_bytes / GB:.1f} GB",
            flush=True,
        )
        data = corpus_bytes()
        for step in range(args.steps):
            x, y = get_batch(data, args.batch, args.seq, step)
            t0 = time.perf_counter()
            loss = engine(x, y)
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            rep, pio = engine.last_report, engine.last_param_io
            row = {
                "step": step,
                "loss": float(loss.item()),
                "forward_s": t1 - t0,
                "backward_s": t2 - t1,
                "optimizer_s": t3 - t2,
                "step_s": t3 - t0,
                "optimizer_kernel_s": rep.optimizer_compute_s,
                "optimizer_io_wait_s": rep.io_wait_s,
                "optimizer_nvme_read_bytes": rep.nvme_read_bytes,
                "optimizer_nvme_write_bytes": rep.nvme_write_bytes,
                "grad_to_host_bytes": rep.device_to_host_bytes,
                "param_to_tier_bytes": rep.host_to_device_bytes,
                **pio,
                "rss_peak_in_step_bytes": sampler.take_peak(),
                "rss_now_bytes": psutil.Process().memory_info().rss,
                "pinned_bytes": engine.pinned_bytes,
            }
            rows.append(row)
            print(
                f"step {step}: loss {row['loss']:.4f} | fwd {row['forward_s']:.1f} s, "
                f"bwd {row['backward_s']:.1f} s, optimizer {row['optimizer_s']:.1f} s "
                f"(kernel {row['optimizer_kernel_s']:.1f} s, io wait {row['optimizer_io_wait_s']:.1f} s) | "
                f"params NVMe read {pio['param_nvme_read_bytes'] / GB:.2f} GB "
                f"(prefetch hits {pio['param_prefetch_hits']}/{pio['param_reads']}), written "
                f"{pio['param_nvme_write_bytes'] / GB:.2f} GB | optimizer NVMe read "
                f"{rep.nvme_read_bytes / GB:.2f} GB, written {rep.nvme_write_bytes / GB:.2f} GB | "
                f"grads to host {rep.device_to_host_bytes / GB:.2f} GB | "
                f"RSS peak {row['rss_peak_in_step_bytes'] / GIB:.2f} GiB",
                flush=True,
            )
        swap_bytes = engine.nvme_bytes  # optimizer state + parameter partitions
        engine.close()
    finally:
        sampler.stop()
    peak = peak_rss_bytes()
    ok = peak <= args.rss_limit_gib * GIB
    payload = {
        "params": n_params,
        "largest_layer": largest,
        "training_state_bytes": state_bytes,
        "ram_bytes": ram,
        "state_over_ram": state_bytes / ram,
        "disk_free_before_bytes": free_before,
        "swap_bytes_on_disk": swap_bytes,
        "build_s": build_s,
        "initialize_s": init_s,
        "build_peak_rss_bytes": build_peak,
        "initialize_peak_rss_bytes": init_peak,
        "peak_rss_bytes": peak,
        "rss_limit_bytes": args.rss_limit_gib * GIB,
        "within_limit": ok,
        "steps": rows,
        "estimate": est,
        "config": cfg,
    }
    lines = [
        "| step | loss | fwd s | bwd s | optim s | param NVMe read GB | param NVMe write GB "
        "| optim NVMe read GB | optim NVMe write GB | RSS peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['loss']:.4f} | {r['forward_s']:.1f} | {r['backward_s']:.1f} "
            f"| {r['optimizer_s']:.1f} "
            f"| {r['param_nvme_read_bytes'] / GB:.2f} | {r['param_nvme_write_bytes'] / GB:.2f} "
            f"| {r['optimizer_nvme_read_bytes'] / GB:.2f} | {r['optimizer_nvme_write_bytes'] / GB:.2f} "
            f"| {r['rss_peak_in_step_bytes'] / GIB:.2f} |"
        )
    lines.append(
        f"\n{n_params / 1e9:.3f}B params, state {state_bytes / GB:.1f} GB ({state_bytes / ram:.2f} x RAM), "
        "swap on "
        f"disk {swap_bytes / GB:.1f} GB, peak RSS {peak / GIB:.2f} GiB (limit {args.rss_limit_gib} GiB: "
        f"{'ok' if ok else 'EXCEEDED'})"
    )
    write_outputs("bench_infinity", payload, "\n".join(lines))
    if args.nvme is None:
        shutil.rmtree(nvme, ignore_errors=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
