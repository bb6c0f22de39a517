"""Activation memory at long context: no checkpointing vs torch.utils.checkpoint vs zero.checkpointing.

A GPT-2-style model (Hugging Face GPT2LMHeadModel from a config, random weights) trains through
zero.initialize (stage 0, fp32, AdamW); only where activations live differs between the contenders:

* ``none``: no checkpointing (every layer keeps its saved tensors);
* ``torch``: Hugging Face's gradient checkpointing with ``torch.utils.checkpoint`` (checkpoints in place);
* ``ours-ram``: ``zero.checkpointing.apply(model)`` with checkpoints kept in memory (offload_device "none";
  on a GPU also ``ours-cpu``: checkpoints in pinned host memory, ``cpu_checkpointing``);
* ``ours-nvme``: checkpoints in an NVMe scratch file (offload_device "nvme").

Each run of a contender is its own process (peak RSS is the process's own), rounds alternate the contenders
(A B C D A B C D), and every process runs a warm-up step before the timed one. Reported: median step time,
its ratio to ``torch``, peak RSS (and peak GPU memory on CUDA), the checkpoint bytes moved, the loss (the same
for every contender: checkpointing does not change the math), and the estimator's prediction.

    python -m benchmarks.bench_activations --preset small          # ~20 min on 2 cores
    python -m benchmarks.bench_activations --preset 350m           # the 350M / seq 2048 / batch 4 case
    python -m benchmarks.bench_activations --preset 1.3b --device cuda --contenders torch,ours-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from benchmarks.harness import markdown_table, write_outputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS: Dict[str, Dict[str, int]] = {
    "tiny": dict(hidden=256, heads=4, layers=4, vocab=4096, seq=512, batch=2),
    "small": dict(hidden=1024, heads=16, layers=6, vocab=8192, seq=2048, batch=2),
    "350m": dict(hidden=1024, heads=16, layers=24, vocab=50257, seq=2048, batch=4),
    "1.3b": dict(hidden=2048, heads=16, layers=24, vocab=50257, seq=4096, batch=1),
}
CONTENDERS = ("none", "torch", "ours-ram", "ours-cpu", "ours-nvme")


def _config(contender: str, nvme_path: str) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 0},
    }
    section = {"ours-ram": {"offload_device": "none"}, "ours-cpu": {"cpu_checkpointing": True}}.get(contender)
    if contender == "ours-nvme":
        section = {"offload_device": "nvme", "nvme_path": nvme_path}
    if section is not None:
        cfg["activation_checkpointing"] = dict(section, profile=True)
    return cfg


def run_child(args: argparse.Namespace) -> Dict[str, Any]:
    """One contender in this process: a warm-up step, then `--steps` timed steps."""
    import torch
    import transformers

    import zero

    shape = json.loads(args.shape)
    baseline = _rss_now()  # the interpreter, torch and transformers: what the estimator does not count
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_embd=shape["hidden"],
        n_head=shape["heads"],
        n_layer=shape["layers"],
        vocab_size=shape["vocab"],
        n_positions=shape["seq"],
        attn_implementation="sdpa",
        # no attention dropout, as in current LLM training: torch's SDPA then keeps no s x s matrix on the
        # CPU either (flash kernel); the residual and embedding dropout stay, so the RNG replay is exercised
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    if args.child == "torch":
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable({"use_reentrant": False})
    elif args.child.startswith("ours"):
        zero.checkpointing.apply(model)
    engine, *_ = zero.initialize(model=model, config=_config(args.child, args.nvme_path))
    device = engine.device
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device)
    times, losses, moved = [], [], {}
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        moved = engine.last_report.activations if engine.last_report else {}
    out = {
        "step_s": statistics.median(times),
        "losses": losses,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "baseline_rss_bytes": baseline,
        "params": sum(p.numel() for p in model.parameters()),
        "activations": moved,
    }
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    engine.close()
    return out


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def estimate_bytes(shape: Dict[str, int], contender: str, params: int) -> int:
    """The estimator's compute-device + host total for this contender (fp32, stage 0, one rank)."""
    from offload.estimate import ActivationSettings, TrainingSetup, estimate

    device = {"none": "none", "torch": "none", "ours-ram": "none", "ours-cpu": "cpu", "ours-nvme": "nvme"}
    act = ActivationSettings(
        batch_size=shape["batch"],
        seq_len=shape["seq"],
        hidden_size=shape["hidden"],
        num_layers=shape["layers"],
        checkpointing=contender != "none",
        checkpoint_device=device[contender],
        attention="flash",  # no attention dropout: SDPA's flash kernel (see run_child)
        num_heads=shape["heads"],
        vocab_size=shape["vocab"],
    )
    setup = TrainingSetup(params, 4 * shape["hidden"] ** 2 * 3, precision="fp32", activations=act)
    est = estimate(setup, 0)
    return sum(est.gpu.values()) + sum(est.cpu.values())


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: compare activation checkpointing contenders on a preset model; the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    for key in ("hidden", "heads", "layers", "vocab", "seq", "batch"):
        ap.add_argument(f"--{key}", type=int, help=f"override the preset's {key}")
    ap.add_argument("--contenders", default="none,torch,ours-ram,ours-nvme")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1, help="timed steps per process")
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed steps first (0: the timed step includes first-step allocations, alike for all)",
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--nvme-path", default=os.environ.get("ZO_TEST_IO_DIR", "/var/tmp"))
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/out)")
    ap.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_child(args)), flush=True)
        return 0

    shape = dict(PRESETS[args.preset])
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        ap.error(f"unknown contenders {unknown}; choose from {CONTENDERS}")
    env = dict(os.environ, ZO_ACCELERATOR=args.device)
    runs: Dict[str, List[Dict[str, Any]]] = {c: [] for c in contenders}
    with tempfile.TemporaryDirectory(prefix="zo-bench-act-", dir=args.nvme_path) as scratch:
        for rnd in range(args.rounds):
            for c in contenders:
                cmd = [sys.executable, "-m", "benchmarks.bench_activations", "--child", c]
                cmd += [
                    "--shape",
                    json.dumps(shape),
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                ]
                cmd += ["--nvme-path", scratch]
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    tail = (proc.stdout + proc.stderr)[-2000:]
                    runs[c].append({"error": f"rc={proc.returncode}: {tail}"})
                    print(f"round {rnd} {c}: FAILED rc={proc.returncode}", flush=True)
                    continue
                runs[c].append(json.loads(line[len("RESULT ") :]))
                r = runs[c][-1]
                print(
                    f"round {rnd} {c}: {r['step_s']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB",
                    flush=True,
                )

    summary: Dict[str, Dict[str, Any]] = {}
    for c, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            summary[c] = {"error": rs[-1]["error"] if rs else "not run"}
            continue
        summary[c] = {
            "step_s": statistics.median(r["step_s"] for r in ok),
            "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in ok),
            "baseline_rss_bytes": statistics.median(r["baseline_rss_bytes"] for r in ok),
            "losses": ok[0]["losses"],
            "activations": ok[-1]["activations"],
            "estimated_bytes": estimate_bytes(shape, c, ok[0]["params"]),
            "params": ok[0]["params"],
        }
        if "peak_gpu_bytes" in ok[0]:
            summary[c]["peak_gpu_bytes"] = statistics.median(r["peak_gpu_bytes"] for r in ok)
    base = summary.get("torch", {}).get("step_s")
    rows = []
    for c, s in summary.items():
        if "error" in s:
            rows.append([c, "failed"] + [""] * 6)
            continue
        a = s["activations"] or {}
        moved = (a.get("nvme_write_bytes", 0) + a.get("nvme_read_bytes", 0)) or (
            a.get("offloaded_bytes", 0) + a.get("restored_bytes", 0)
        )
        rows.append(
            [
                c,
                f"{s['step_s']:.2f}",
                f"{s['step_s'] / base:.3f}" if base else "",
                f"{s['peak_rss_bytes'] / 2**30:.2f}",
                f"{(s['peak_rss_bytes'] - s['baseline_rss_bytes']) / 2**30:.2f}",
                f"{s['estimated_bytes'] / 2**30:.2f}",
                f"{moved / 2**20:.0f}",
                f"{s['losses'][-1]:.6f}",
            ]
            + ([f"{s['peak_gpu_bytes'] / 2**30:.2f}"] if "peak_gpu_bytes" in s else [])
        )
    headers = [
        "contender",
        "step s",
        "vs torch",
        "peak RSS GiB",
        "peak - baseline GiB",
        "estimate GiB",
        "ckpt MiB moved",
        "loss",
    ]
    if any("peak_gpu_bytes" in s for s in summary.values()):
        headers.append("peak GPU GiB")
    title = (
        f"GPT-2 {summary[next(iter(summary))].get('params', 0) / 1e6:.0f}M params, hidden {shape['hidden']}, "
        f"{shape['layers']} layers, seq {shape['seq']}, batch {shape['batch']}, {args.device}, "
        f"{args.rounds} rounds"
    )
    table = title + "\n\n" + markdown_table(headers, rows)
    write_outputs(
        f"bench_activations_{args.preset}_{args.device}",
        {"shape": shape, "args": vars(args), "summary": summary, "runs": runs},
        table,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
