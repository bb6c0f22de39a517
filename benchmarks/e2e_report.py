"""The results of benchmarks/bench_e2e.py: per-configuration summaries over runs (medians, peaks, loss
differences from plain torch), the markdown tables and the JSON written after every run."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from typing import Any, Dict, List, Optional

from benchmarks.harness import machine_info, markdown_table


def summarize_runs(runs: List[Dict[str, Any]], torch_losses: Optional[List[float]]) -> Dict[str, Any]:
    """One configuration over its runs: median step and phase times, disk bytes per step, peaks, losses."""
    rows = [r for run in runs for r in run["rows"]]
    steps = [r["step_s"] for r in rows]

    def med(key: str) -> Optional[float]:
        vals = [r[key] for r in rows if key in r]
        return statistics.median(vals) if vals else None

    out: Dict[str, Any] = {
        "runs": len(runs),
        "timed_steps": len(steps),
        "step_s": statistics.median(steps),
        "step_min_s": min(steps),
        "step_max_s": max(steps),
        "forward_s": med("forward_s"),
        "backward_s": med("backward_s"),
        "optimizer_s": med("optimizer_s"),
        "io_wait_s": med("io_wait_s"),
        "optimizer_compute_s": med("optimizer_compute_s"),
        "disk_read_bytes_per_step": med("disk_read_bytes"),
        "disk_write_bytes_per_step": med("disk_write_bytes"),
        "nvme_read_bytes_per_step": med("nvme_read_bytes"),
        "nvme_write_bytes_per_step": med("nvme_write_bytes"),
        "peak_rss_bytes": max(run["peak_rss_bytes"] for run in runs),
        "init_peak_rss_bytes": max(run["init_peak_rss_bytes"] for run in runs),
        "steady_peak_rss_bytes": max(run["steady_peak_rss_bytes"] for run in runs),
        "init_s": statistics.median(run["init_s"] for run in runs),
        # the model's construction inside init_s (DeepSpeed, stage 3: under deepspeed.zero.Init)
        "build_s": statistics.median(run.get("build_s", math.nan) for run in runs),
        "losses": runs[0]["losses"],
    }
    gpu_peaks = [run["peak_gpu_bytes"] for run in runs if "peak_gpu_bytes" in run]
    if gpu_peaks:
        out["peak_gpu_bytes"] = max(gpu_peaks)
    if torch_losses is not None:
        diffs = [abs(a - b) / abs(b) for run in runs for a, b in zip(run["losses"], torch_losses) if b != 0]
        out["loss_rel_diff_vs_torch"] = max(diffs) if diffs else None
    return out


def comparison_table(results: Dict[str, Dict[str, Any]], gpu: bool = False) -> str:
    """The markdown table; `gpu` (the cuda mode): a peak GPU memory column, and no DeepSpeed ratio."""
    base = results.get("torch", {}).get("torch")
    rows = []
    for name, by_engine in results.items():
        for eng, s in by_engine.items():
            ds = by_engine.get("deepspeed") if eng != "deepspeed" else None
            ds = ds or (
                results.get(s.get("ds_reference", ""), {}).get("deepspeed") if eng == "ours" else None
            )

            def gb(v: Optional[float]) -> str:
                return "" if v is None else f"{v / 1e9:.2f}"

            def sec(v: Optional[float]) -> str:
                return "" if v is None else f"{v:.2f}"

            def gib(v: Optional[float]) -> str:
                return "" if v is None else f"{v / 2**30:.2f}"

            rows.append(
                [
                    name,
                    eng,
                    f"{s['step_s']:.2f} ({s['step_min_s']:.2f}-{s['step_max_s']:.2f})",
                    "" if base is None else f"{s['step_s'] / base['step_s']:.2f}",
                    *([] if gpu else ["" if ds is None else f"{s['step_s'] / ds['step_s']:.2f}"]),
                    sec(s["forward_s"]),
                    sec(s["backward_s"]),
                    sec(s["optimizer_s"]),
                    sec(s["io_wait_s"]),
                    *([gib(s.get("peak_gpu_bytes"))] if gpu else []),
                    f"{s['peak_rss_bytes'] / 2**30:.2f}",
                    "" if base is None else f"{s['peak_rss_bytes'] / base['peak_rss_bytes']:.2f}",
                    f"{gb(s['disk_read_bytes_per_step'])} / {gb(s['disk_write_bytes_per_step'])}",
                    f"{s['init_s']:.1f} ({s['build_s']:.1f} + {s['init_s'] - s['build_s']:.1f})",
                    "" if s.get("loss_rel_diff_vs_torch") is None else f"{s['loss_rel_diff_vs_torch']:.1e}",
                ]
            )
    headers = [
        "configuration",
        "engine",
        "step s median (min-max)",
        "x torch",
        *([] if gpu else ["x DeepSpeed"]),
        "fwd s",
        "bwd s",
        "opt s",
        "io-wait s",
        *(["peak GPU GiB"] if gpu else []),
        "peak RSS GiB",
        "RSS x torch",
        "disk GB r / w per step",
        "init s (model build + engine)",
        "loss rel diff",
    ]
    return markdown_table(headers, rows)


def write_comparison(
    raw: Dict[str, Any], args: argparse.Namespace, size: Dict[str, int], stage3: bool, final: bool
) -> None:
    """Summaries, JSON and table from the runs so far (rewritten after every run: a long run can be read)."""
    torch_runs = raw["torch"]["torch"]
    torch_losses = torch_runs[0]["losses"] if torch_runs else None
    results: Dict[str, Dict[str, Any]] = {}
    for name, by_engine in raw.items():
        for eng, runs in by_engine.items():
            if runs:
                results.setdefault(name, {})[eng] = summarize_runs(
                    runs, None if name == "torch" else torch_losses
                )
    # ZeRO-2 with the optimizer on NVMe has no DeepSpeed counterpart; compare with its closest one.
    for name in ("zero2-opt-nvme", "zero2-opt-nvme-no-overlap"):
        if "ours" in results.get(name, {}):
            results[name]["ours"]["ds_reference"] = "zero3-opt-nvme-param-cpu"
    table = comparison_table(results, gpu=args.device == "cuda")
    if args.device == "cuda":
        note = "GPU run: plain torch and ours compute on the GPU, DeepSpeed is not run"
    else:
        note = "2 CPU cores shared with other jobs: times are noisy; DeepSpeed runs in its own venv"
    payload = {
        "benchmark": args.out_name,
        "device": args.device,
        "machine": machine_info(),
        "model": size,
        "size": args.size,
        "dtype": args.dtype,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "sub_group_size": args.sub_group,
        "pipeline": not args.no_pipeline,
        "stage3_in_tree": stage3,
        "results": results,
        "raw": raw,
        "note": note,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, f"{args.out_name}.json")
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=2, default=float)
    with open(os.path.join(args.out_dir, f"{args.out_name}.md"), "w") as f:
        f.write(table + "\n")
    if final:
        print(table)
        print(f"\nwrote {json_path}")


def summarize_tiers(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One --tiers variant over its runs: refused, failed, or step times, engine NVMe bytes and losses."""
    refused = [r["refused"] for r in runs if "refused" in r]
    if refused:
        return {"status": "refused", "error": refused[0]}
    ok = [r for r in runs if "rows" in r]
    if not ok:
        return {"status": "failed", "error": "every run failed (see the log)"}
    rows = [row for r in ok for row in r["rows"]]
    steps = [row["step_s"] for row in rows]

    def med(*keys: str) -> float:
        return statistics.median(sum(row.get(k, 0.0) for k in keys) for row in rows)

    return {
        "status": "ok",
        "runs": len(ok),
        "step_s": statistics.median(steps),
        "step_min_s": min(steps),
        "step_max_s": max(steps),
        "optimizer_s": med("optimizer_s"),
        # the engine's report: optimizer state (StepReport) + parameter partitions (last_param_io)
        "optimizer_nvme_read_bytes_per_step": med("nvme_read_bytes"),
        "optimizer_nvme_write_bytes_per_step": med("nvme_write_bytes"),
        "nvme_read_bytes_per_step": med("nvme_read_bytes", "param_nvme_read_bytes"),
        "nvme_write_bytes_per_step": med("nvme_write_bytes", "param_nvme_write_bytes"),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
        "final_loss": ok[0]["losses"][-1],
        "losses": ok[0]["losses"],
    }


def tiers_table(results: Dict[str, Dict[str, Any]]) -> str:
    """The markdown table of the --tiers variants against the baseline."""
    base = results.get("baseline", {})
    rows = []
    for label, r in results.items():
        sent = [
            r["state_dtype"] or "fp32 (key not sent)",
            "not sent" if r["max_in_cpu"] is None else r["max_in_cpu"],
        ]
        if r["status"] != "ok":
            rows.append([label, *sent, f"{r['status']}: {r['error'][:160]}", "", "", "", "", ""])
            continue
        vs = base.get("status") == "ok"
        rows.append(
            [
                label,
                *sent,
                "ok",
                f"{r['step_s']:.2f} ({r['step_min_s']:.2f}-{r['step_max_s']:.2f})",
                f"{r['step_s'] / base['step_s']:.2f}" if vs else "",
                f"{r['nvme_read_bytes_per_step'] / 1e9:.2f} / {r['nvme_write_bytes_per_step'] / 1e9:.2f}",
                f"{r['final_loss']:.4f}",
                f"{(r['final_loss'] - base['final_loss']) / base['final_loss']:+.1e}" if vs else "",
            ]
        )
    headers = [
        "variant",
        "state_dtype",
        "max_in_cpu (elements)",
        "status",
        "step s median (min-max)",
        "x baseline",
        "engine NVMe GB r / w per step",
        "final loss",
        "loss vs baseline",
    ]
    return markdown_table(headers, rows)
