"""Convergence on real text with fp32, bf16 and int8 optimizer states: same model, seed and batches.

    python -m benchmarks.bench_convergence                              # 300 steps, CPU (hours on 2 cores)
    python -m benchmarks.bench_convergence --device cuda --dtype bf16   # on a GPU host
    python -m benchmarks.bench_convergence --smoke                      # seconds: tiny model, a few steps

The model is zero/examples/models.py's GPT in the GPT-3 paper's "125M" shape (12 layers, width 768, 12 heads)
with a byte-level vocabulary (256), which makes it 85M parameters (the paper's count includes a 50257-token
embedding); the text is the demo's corpus (zero.examples.models.corpus_bytes: Python's own stdlib source),
read in the order zero.examples.models.get_batch gives for (step, seed). Every variant starts from the same
weights (same seed) and sees the same batches; only `optimizer.params.state_dtype` differs ("fp32" sends no
key: it is the engine's default). The engine: ZeRO-2, optimizer on --offload (cpu), AdamW with a warm-up and
cosine schedule, gradient clipping 1.0.

Reported per variant: the loss curve (JSON), the final loss (the mean of the last 20 steps' losses) and its
relative difference from fp32's, median step time. A variant the engine refuses (ConfigError, e.g. before
it takes `state_dtype`) is reported as refused with the engine's message. A PNG of the curves is written
when matplotlib imports (it is not a dependency). Output: benchmarks/out/convergence_<device>.json, .md
(and .png).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from benchmarks.harness import OUT_DIR, markdown_table, write_outputs

STATE_DTYPES = ("fp32", "bf16", "int8")
FINAL_WINDOW = 20  # the final loss is the mean over this many last steps


def engine_config(args: argparse.Namespace, state_dtype: str, nvme_dir: str) -> Dict[str, Any]:
    """The DeepSpeed-style config of one variant; fp32 states: no state_dtype key (the default)."""
    params: Dict[str, Any] = {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    if state_dtype != "fp32":
        params["state_dtype"] = state_dtype
    off: Dict[str, Any] = {"device": args.offload}
    if args.offload == "nvme":
        off["nvme_path"] = nvme_dir
    conf: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": params},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "warmup_num_steps": max(1, args.steps // 10),
                "total_num_steps": args.steps,
                "warmup_min_ratio": 0.1,
            },
        },
        "zero_optimization": {"stage": 2, "offload_optimizer": off},
    }
    if args.dtype == "bf16":
        conf["bf16"] = {"enabled": True}
    return conf


def final_loss(losses: List[float]) -> float:
    """The mean of the last FINAL_WINDOW losses (all of them when there are fewer)."""
    tail = losses[-FINAL_WINDOW:]
    return sum(tail) / len(tail)


def run_variant(args: argparse.Namespace, state_dtype: str, data: Any, nvme_dir: str) -> Dict[str, Any]:
    """Train one variant from the seed's weights; its losses, or the engine's refusal."""
    import torch

    import zero
    from offload.config import ConfigError
    from zero.examples.models import GPT, GPTConfig, get_batch

    cfg = GPTConfig(seq_len=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.width)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    try:
        engine, *_ = zero.initialize(model=model, config=engine_config(args, state_dtype, nvme_dir))
    except ConfigError as exc:
        print(f"[convergence] {state_dtype}: refused by the engine: {exc}", flush=True)
        return {"status": "refused", "error": str(exc), "params": params}
    losses: List[float] = []
    times: List[float] = []
    try:
        for step in range(args.steps):
            x, y = (t.to(engine.device) for t in get_batch(data, args.batch, args.seq, step, args.seed))
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.item()))  # .item() waits for the device: the step is finished
            times.append(time.perf_counter() - t0)
            if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
                print(
                    f"[convergence] {state_dtype}: step {step + 1}/{args.steps} loss {losses[-1]:.4f}",
                    flush=True,
                )
    finally:
        engine.close()
    ok = all(math.isfinite(v) for v in losses)
    return {
        "status": "ok" if ok else "diverged",
        "params": params,
        "losses": losses,
        "final_loss": final_loss(losses),
        "step_s": statistics.median(times),
    }


def plot(results: Dict[str, Dict[str, Any]], path: str, title: str = "") -> Optional[str]:
    """The loss curves as a PNG at `path` (`title` above them); None (nothing written) when matplotlib does
    not import."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        if r.get("losses"):
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{name} states", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.legend()
    if title:
        ax.set_title(title, fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: train with each optimizer-state dtype and compare the loss curves; the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="training (compute) precision")
    ap.add_argument("--state-dtypes", default=",".join(STATE_DTYPES))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--offload", choices=("cpu", "nvme"), default="cpu", help="where the optimizer state lives"
    )
    ap.add_argument("--nvme-path", default=os.environ.get("ZO_TEST_IO_DIR", "/var/tmp"))
    ap.add_argument("--smoke", action="store_true", help="a tiny model for a few steps (a test's check)")
    ap.add_argument("--out", default=None, help=f"output folder (default {OUT_DIR})")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.seq, args.layers, args.width, args.heads = 8, 4, 32, 2, 64, 2
        args.lr = 3e-3
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    dtypes = [x for x in args.state_dtypes.split(",") if x]
    unknown = sorted(set(dtypes) - set(STATE_DTYPES))
    if unknown:
        ap.error(f"--state-dtypes: unknown {unknown}; choose from {STATE_DTYPES}")
    os.environ["ZO_ACCELERATOR"] = args.device  # before the engine picks its device
    from zero.examples.models import corpus_bytes

    data = corpus_bytes()
    results: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="zo-conv-", dir=args.nvme_path) as nvme_dir:
        for sd in dtypes:
            results[sd] = run_variant(args, sd, data, nvme_dir)
    ref = results.get("fp32", {})
    for r in results.values():
        if r.get("final_loss") is not None and ref.get("status") == "ok":
            r["final_loss_rel_diff_vs_fp32"] = (r["final_loss"] - ref["final_loss"]) / ref["final_loss"]
    rows = []
    for sd, r in results.items():
        if r["status"] == "refused":
            rows.append([sd, f"refused: {r['error'][:160]}", "", "", "", ""])
            continue
        rel = r.get("final_loss_rel_diff_vs_fp32")
        rows.append(
            [
                sd,
                r["status"],
                f"{r['losses'][0]:.4f}",
                f"{r['final_loss']:.4f}",
                "" if rel is None else f"{rel:+.2%}",
                f"{r['step_s']:.3f}",
            ]
        )
    params = next(iter(results.values()))["params"]
    title = (
        f"GPT {params / 1e6:.1f}M ({args.layers} x {args.width}, byte-level), {args.steps} steps, "
        f"batch {args.batch} x {args.seq}, {args.dtype} training, optimizer on {args.offload}, {args.device};"
        f" final loss = mean of the last {min(FINAL_WINDOW, args.steps)} steps"
    )
    headers = ["state dtype", "status", "first loss", "final loss", "vs fp32", "step s (median)"]
    name = f"convergence_{args.device}" + ("_smoke" if args.smoke else "")
    out_dir = args.out or OUT_DIR
    os.makedirs(out_dir, exist_ok=True)
    png = plot(results, os.path.join(out_dir, name + ".png"), title)
    note = f"plot: {png}" if png else "plot: matplotlib does not import here, no PNG written"
    payload = {
        "args": vars(args),
        "params": params,
        "final_window": FINAL_WINDOW,
        "results": results,
        "plot": png,
    }
    write_outputs(name, payload, title + "\n\n" + markdown_table(headers, rows) + "\n\n" + note, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
