"""The largest model per configuration: what our estimator predicts, what DeepSpeed's formulas predict, and
what really fits (one training step in a subprocess, peak RSS against the budget, bytes on disk).

    .venv/bin/python -m benchmarks.bench_capacity --ram-budget 8GiB            # default run, < ~15 min
    .venv/bin/python -m benchmarks.bench_capacity --ram-budget 3GiB --max-params 300M

Models: zero.examples.models.GPT, vocabulary 32000, a ladder of widths d = 256, 384, 512, ... with d / 128
layers (at least 2), bf16, AdamW, micro-batch 1 x 64 tokens. Configurations (CPU-only machine: the "GPU" tier
is host memory too, so the budget must hold the estimate's per-GPU and per-CPU bytes together):

* stage 2, offload_optimizer cpu
* stage 3, offload_optimizer nvme, offload_param cpu
* stage 3, offload_optimizer nvme, offload_param nvme

For each, the largest ladder size whose estimate (+ the measured runtime baseline: the RSS of a process
that imported torch and ran a tiny step) fits the RAM budget and whose NVMe need fits the free space at
--nvme-path is verified by a real step, and so is the next size up (it should not fit). --max-params caps
the verified sizes to bound the run time. DeepSpeed's estimate (its model-states formulas, additional
buffer factor 1.5; it has no NVMe rows, so the NVMe configurations are compared with its "offload params
and optimizer to CPU, zero.Init" row) gives its own largest size. Memory figures are noisy on a loaded
machine; the step time is indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from benchmarks.harness import markdown_table, write_outputs
from offload.estimate import (
    ActivationSettings,
    SwapBufferSettings,
    TrainingSetup,
    deepspeed_rows,
    estimate,
    parse_count,
)

GIB = 2**30
VOCAB = 32000
SEQ = 64
SUB_GROUP = 8_000_000  # sub_group_size: keeps the NVMe staging slots (2 x 96 MB) small next to the budget
CONFIGS: Dict[str, Dict[str, Any]] = {
    "stage2-opt-cpu": {"stage": 2, "optim": "cpu", "param": "none", "ds": (2, "cpu", "none")},
    "stage3-opt-nvme-param-cpu": {"stage": 3, "optim": "nvme", "param": "cpu", "ds": (3, "cpu", "cpu")},
    "stage3-opt-nvme-param-nvme": {"stage": 3, "optim": "nvme", "param": "nvme", "ds": (3, "cpu", "cpu")},
}


def ladder(max_steps: int = 80) -> List[Dict[str, int]]:
    """Model sizes, smallest first: width d = 256 + 128 k with d / 128 layers (at least 2)."""
    out = []
    for k in range(max_steps):
        d = 256 + 128 * k
        layers = max(2, d // 128)
        params = 2 * VOCAB * d + SEQ * d + layers * (12 * d * d + 13 * d) + 2 * d
        out.append({"d_model": d, "n_layer": layers, "params": params, "largest": VOCAB * d})
    return out


def engine_config(cfg: Dict[str, Any], nvme: str, largest: int) -> Dict[str, Any]:
    """The engine config of capacity case `cfg`, its swap files in `nvme`."""
    zo: Dict[str, Any] = {"stage": cfg["stage"], "sub_group_size": SUB_GROUP}
    zo["offload_optimizer"] = {
        "device": cfg["optim"],
        "nvme_path": nvme,
        "buffer_count": 2,
        "pin_memory": True,
        "max_in_cpu": 0,  # the state on NVMe, as the estimator's rows assume
    }
    if cfg["stage"] == 3:
        zo["stage3_param_persistence_threshold"] = 0
        zo["offload_param"] = {
            "device": cfg["param"],
            "nvme_path": nvme,
            "pin_memory": True,
            "max_in_cpu": 0,
            "buffer_count": 2,
            "buffer_size": largest,
        }
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zo,
        "zero_offload": {"pinned_budget_bytes": 64 * GIB},  # the RAM budget is what is measured here
    }


def our_estimate(cfg: Dict[str, Any], size: Dict[str, int], disk_free: int) -> Any:
    """Our estimator's answer for case `cfg` at model `size` with `disk_free` bytes of disk."""
    setup = TrainingSetup(
        size["params"],
        size["largest"],
        precision="bf16",
        optimizer="adamw",
        buffers=SwapBufferSettings(
            optimizer_buffer_count=2,
            sub_group_size=SUB_GROUP,
            param_buffer_count=2,
            param_buffer_size=size["largest"],
            param_max_in_cpu=0,
        ),
        activations=ActivationSettings(
            1, SEQ, size["d_model"], size["n_layer"], num_heads=size["d_model"] // 64, vocab_size=VOCAB
        ),
    )
    return estimate(setup, cfg["stage"], cfg["optim"], cfg["param"], nvme_free_bytes=disk_free)


def ds_bytes(cfg: Dict[str, Any], size: Dict[str, int]) -> int:
    """DeepSpeed's estimated CPU plus GPU bytes for case `cfg` at model `size`."""
    stage, opt, par = cfg["ds"]
    rows = deepspeed_rows(
        size["params"], size["largest"], stages=[stage], offload_optimizers=[opt], offload_params=[par]
    )
    row = next(r for r in rows if r.zero_init in (None, True))
    return row.per_cpu_bytes + row.per_gpu_bytes


def largest_fitting(sizes: List[Dict[str, int]], need: Any) -> Optional[int]:
    """Index of the last size of the increasing run that `need` accepts; None if the first fails."""
    best = None
    for i, size in enumerate(sizes):
        if need(size):
            best = i
        else:
            break
    return best


# ------------------------------------------------------------------------------------------ the child
def child(name: str, d_model: int, n_layer: int, nvme: str) -> None:
    """One training step of the given size; prints a JSON line with peak RSS, pinned and disk bytes."""
    import psutil
    import torch

    import zero
    from zero.examples.models import GPT, GPTConfig

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    cfg = CONFIGS[name]
    gcfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=n_layer, n_head=d_model // 64, d_model=d_model)
    config = engine_config(cfg, nvme, VOCAB * d_model)
    t0 = time.perf_counter()
    if cfg["stage"] == 3:
        with zero.Init(config=config):
            model = GPT(gcfg)
    else:
        torch.set_default_dtype(torch.bfloat16)  # never an fp32 copy of the model: only bf16 weights
        model = GPT(gcfg)
        torch.set_default_dtype(torch.float32)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    del model
    build_s = time.perf_counter() - t0
    x = torch.randint(0, VOCAB, (1, SEQ))
    t0 = time.perf_counter()
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    step_s = time.perf_counter() - t0
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    result = {
        "peak_rss_bytes": hwm,
        "rss_after_step_bytes": psutil.Process().memory_info().rss,
        "pinned_bytes": engine.pinned_bytes,
        "nvme_bytes": engine.nvme_bytes,
        "loss": float(loss),
        "build_s": build_s,
        "step_s": step_s,
    }
    engine.close()
    print("RESULT " + json.dumps(result), flush=True)


def run_child(name: str, size: Dict[str, int], nvme_root: str, timeout: int) -> Dict[str, Any]:
    """Run case `name` at `size` in a child process (its swap files under `nvme_root`); its result dict."""
    nvme = tempfile.mkdtemp(prefix="capacity-", dir=nvme_root)
    cmd = [sys.executable, "-m", "benchmarks.bench_capacity", "--child", name, str(size["d_model"])]
    cmd += [str(size["n_layer"]), nvme]
    # a fixed mmap threshold returns freed large blocks to the OS, so RSS shows what is live
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": f"exit {out.returncode}: {out.stderr.strip()[-1500:]}"}


def runtime_baseline() -> int:
    """RSS of a process that imported torch and zero and ran a tiny step: what every run has anyway."""
    code = (
        "import psutil, torch, zero, offload._cpu_optim\n"
        "from zero.examples.models import GPT, GPTConfig\n"
        "m = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=1, d_model=64))\n"
        "x = torch.randint(0, 64, (1, 8)); m(x, x).backward()\n"
        "print(psutil.Process().memory_info().rss)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> None:
    """Command line: the largest model each case trains within a RAM budget, measured and estimated."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ram-budget", default="8GiB", help="host memory budget, e.g. 8GiB, 3GiB, 3.5e9")
    ap.add_argument("--nvme-path", default=tempfile.gettempdir(), help="where swap files go")
    ap.add_argument("--max-params", default="600M", help="largest size actually run (run-time bound)")
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS)
    )
    ap.add_argument("--timeout", type=int, default=600, help="seconds per verification run")
    ap.add_argument(
        "--child", nargs=4, metavar=("CONFIG", "D_MODEL", "N_LAYER", "NVME"), help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)
    if args.child:
        name, d, n, nvme = args.child
        child(name, int(d), int(n), nvme)
        return
    budget = parse_budget(args.ram_budget)
    max_params = parse_count(args.max_params, "--max-params")
    names = [c for c in args.configs.split(",") if c]
    for name in names:
        if name not in CONFIGS:
            raise SystemExit(
                f"bench_capacity: error: unknown configuration {name!r} (known: {', '.join(CONFIGS)})"
            )
    disk_free = shutil.disk_usage(args.nvme_path).free
    baseline = runtime_baseline()
    sizes = ladder()
    print(
        f"RAM budget {budget / GIB:.2f} GiB, runtime baseline {baseline / GIB:.2f} GiB, "
        f"disk free {disk_free / 1e9:.1f} GB at {args.nvme_path}",
        flush=True,
    )
    rows, payload_rows = [], []
    for name in names:
        cfg = CONFIGS[name]

        def ours_fit(size: Dict[str, int], cfg: Dict[str, Any] = cfg) -> bool:
            est = our_estimate(cfg, size, disk_free)
            host = est.per_cpu_bytes + est.per_gpu_bytes + baseline
            return host <= budget and est.nvme_min_bytes <= disk_free

        def ds_fit(size: Dict[str, int], cfg: Dict[str, Any] = cfg) -> bool:
            return ds_bytes(cfg, size) + baseline <= budget

        ours = largest_fitting(sizes, ours_fit)
        theirs = largest_fitting(sizes, ds_fit)
        if ours is None:
            print(f"{name}: nothing fits the budget", flush=True)
            continue
        capped = sizes[ours]["params"] > max_params
        pick = largest_fitting(sizes[: ours + 1], lambda s: s["params"] <= max_params) if capped else ours
        runs = []
        for idx in [i for i in (pick, None if capped else ours + 1) if i is not None]:
            size = sizes[idx]
            est = our_estimate(cfg, size, disk_free)
            print(
                f"{name}: running {size['params'] / 1e6:.0f}M "
                f"(d {size['d_model']}, {size['n_layer']} layers)",
                flush=True,
            )
            measured = run_child(name, size, args.nvme_path, args.timeout)
            print(f"  -> {measured}", flush=True)
            predicted_host = est.per_cpu_bytes + est.per_gpu_bytes + baseline
            run = {
                "size": size,
                "estimate_host_bytes": predicted_host,
                "estimate_nvme_bytes": est.nvme_bytes,
                "deepspeed_host_bytes": ds_bytes(cfg, size) + baseline,
                "measured": measured,
                "fits_budget": measured.get("peak_rss_bytes", 1 << 62) <= budget,
            }
            runs.append(run)
            rows.append(
                [
                    name,
                    f"{size['params'] / 1e6:.0f}M",
                    "estimator's largest" + (" (capped)" if capped and idx == pick else "")
                    if idx in (ours, pick)
                    else "one size bigger",
                    f"{predicted_host / GIB:.2f}",
                    f"{run['deepspeed_host_bytes'] / GIB:.2f}",
                    f"{measured['peak_rss_bytes'] / GIB:.2f}" if "peak_rss_bytes" in measured else "error",
                    "yes" if run["fits_budget"] else "no",
                    f"{est.nvme_bytes / 1e9:.2f}",
                    f"{measured['nvme_bytes'] / 1e9:.2f}" if "nvme_bytes" in measured else "-",
                    f"{measured['step_s']:.0f}" if "step_s" in measured else "-",
                ]
            )
        payload_rows.append(
            {
                "config": name,
                "ours_largest": sizes[ours],
                "deepspeed_largest": sizes[theirs] if theirs is not None else None,
                "capped_at_max_params": capped,
                "runs": runs,
            }
        )
        ds_text = f"{sizes[theirs]['params'] / 1e6:.0f}M" if theirs is not None else "none"
        print(
            f"{name}: our estimator's largest {sizes[ours]['params'] / 1e6:.0f}M, DeepSpeed's {ds_text}",
            flush=True,
        )
    headers = [
        "config",
        "params",
        "size",
        "est. host GiB",
        "DeepSpeed host GiB",
        "peak RSS GiB",
        "fits budget",
        "est. NVMe GB",
        "NVMe GB",
        "step s",
    ]
    table = markdown_table(headers, rows)
    summary = markdown_table(
        ["config", "our largest", "DeepSpeed's largest"],
        [
            [
                p["config"],
                f"{p['ours_largest']['params'] / 1e6:.0f}M",
                f"{p['deepspeed_largest']['params'] / 1e6:.0f}M" if p["deepspeed_largest"] else "none",
            ]
            for p in payload_rows
        ],
    )
    payload = {
        "ram_budget_bytes": budget,
        "runtime_baseline_bytes": baseline,
        "disk_free_bytes": disk_free,
        "max_params": max_params,
        "configs": payload_rows,
    }
    write_outputs("bench_capacity", payload, f"RAM budget {budget / GIB:.2f} GiB\n\n{table}\n\n{summary}")


def parse_budget(text: str) -> int:
    """A byte count from text like 8GiB, 3.5e9 or 500MB."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    t = text.strip().upper()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    try:
        return int(float(t))
    except ValueError:
        raise SystemExit(f"bench_capacity: error: --ram-budget {text!r} is not a size (e.g. 8GiB)") from None


if __name__ == "__main__":
    main()
