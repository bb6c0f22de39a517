"""End-to-end training step of a GPT decoder: plain torch vs this engine vs DeepSpeed, same model and data.

    .venv/bin/python -m benchmarks.bench_e2e [--size 350m] [--dtype fp32] [--repeats 2] [--no-deepspeed]
    python3 -m benchmarks.bench_e2e --device cuda [--size 350m] [--steps 4 --warmup 1]   # on a GPU host

Every configuration runs in its own process (so peak RSS does not mix), 2 warm-up steps then `--steps`
timed ones, on the same seed and token batches. Each offload configuration runs ours, then DeepSpeed's
(A B A B over `--repeats` rounds); DeepSpeed runs under its own interpreter (`--ds-python`, else
$ZO_DS_PYTHON, else .dsvenv/bin/python, the venv scripts/deepspeed_venv.sh builds) through
benchmarks/deepspeed_runner.py, which also holds the shared timing loop.

Per configuration: median / min / max step time over all timed steps of all rounds, the forward /
backward / optimizer split (wall time around engine(x) / backward / step) and the optimizer phase's I/O
wait (ours: the engine's report), peak RSS (initialisation and steady state), bytes read and written on
disk per step (/proc/self/io), init time (split into the model's construction, which DeepSpeed does under
deepspeed.zero.Init at stage 3, and the engine's own set-up), and the largest relative loss difference from
plain torch over all steps. Output: benchmarks/out/e2e.json and e2e.md (plot with benchmarks.plot_e2e).

`--device cpu` (the default) computes everything on the CPU: every child gets ZO_ACCELERATOR=cpu and
DS_ACCELERATOR=cpu. `--device cuda` computes on the GPU: plain torch moves the model there (fused AdamW
then steps on the GPU; bf16 autocasts on "cuda"), ours gets ZO_ACCELERATOR=cuda and keeps the optimizer
(and in stage 3 the parameters) on the CPU / NVMe as each configuration says. DeepSpeed is not run in
this mode. The GPU is synchronised at every phase boundary so the forward / backward / optimizer split
holds, and the table gains a "peak GPU GiB" column (torch.cuda.max_memory_allocated over the process).
Output names get a `_cuda` suffix (e2e_cuda.json) so GPU results never overwrite CPU ones.

`--tiers {368m,760m,tiny}` runs another grid instead: parameters and optimizer state on NVMe
(zero3-opt-nvme-param-nvme-all), the optimizer state's dtype (`optimizer.params.state_dtype`, --state-dtypes
fp32,bf16,int8; fp32 is sent as no key) x the host memory the NVMe optimizer state may keep
(`zero_optimization.offload_optimizer.max_in_cpu`, --host-budgets: elements, "auto", or a fraction of the
parameters such as 0.5), after a baseline that sends neither key; ours only, rounds A B C ... over
`--repeats`. Per variant: median step time and its ratio to the baseline, bytes read and written on NVMe per
step from the engine's report (optimizer state and parameter partitions), final loss and its difference
from the baseline's. A variant whose keys the engine refuses (ConfigError) is reported as refused with the
engine's message. Output: e2e_tiers_<preset>.json and .md.

    python -m benchmarks.bench_e2e --tiers 368m --dtype bf16 --device cuda --nvme-dir /local_nvme
    python -m benchmarks.bench_e2e --tiers tiny --steps 1 --warmup 1 --state-dtypes fp32,int8   # smoke

The script is long because it carries the whole comparison protocol (both engines, A B A B rounds,
medians, JSON and table) so that one command reproduces the RESULTS.md table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.harness import OUT_DIR, machine_info, markdown_table, write_outputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "benchmarks", "deepspeed_runner.py")
# DeepSpeed's interpreter: --ds-python, else $ZO_DS_PYTHON, else the venv scripts/deepspeed_venv.sh builds.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DS_PYTHON = os.environ.get("ZO_DS_PYTHON", os.path.join(_REPO, ".dsvenv", "bin", "python"))

# GPT-3 paper shapes with a 32000-token vocabulary and an untied head.
SIZES: Dict[str, Dict[str, int]] = {
    "125m": {"n_layer": 12, "d_model": 768, "n_head": 12},
    "350m": {"n_layer": 24, "d_model": 1024, "n_head": 16},
    "760m": {"n_layer": 24, "d_model": 1536, "n_head": 16},
    "tiny": {"n_layer": 2, "d_model": 128, "n_head": 2},  # smoke tests of the benchmark itself
}

LR, WEIGHT_DECAY = 1e-4, 0.01

# name -> (zero_optimization for ours, for DeepSpeed); None: that side has no such configuration.
CONFIGS: Dict[str, Dict[str, Any]] = {
    "zero2-opt-cpu": {"stage": 2, "optimizer": "cpu", "param": None},
    "zero2-opt-nvme": {"stage": 2, "optimizer": "nvme", "param": None},  # DeepSpeed: stage 3 only
    # the same without optimizer steps during backward: what the overlap buys
    "zero2-opt-nvme-no-overlap": {"stage": 2, "optimizer": "nvme", "param": None, "pipeline": False},
    "zero3-opt-nvme-param-cpu": {"stage": 3, "optimizer": "nvme", "param": "cpu"},
    "zero3-opt-nvme-param-nvme": {"stage": 3, "optimizer": "nvme", "param": "nvme"},
    "zero3-opt-nvme-param-nvme-no-overlap": {
        "stage": 3,
        "optimizer": "nvme",
        "param": "nvme",
        "pipeline": False,
    },
    # max_in_cpu 0: every parameter partition lives on disk (the default keeps 1e9 elements in host memory)
    "zero3-opt-nvme-param-nvme-all": {"stage": 3, "optimizer": "nvme", "param": "nvme", "max_in_cpu": 0},
}
DEFAULT_CONFIGS = [c for c in CONFIGS if not c.endswith("-no-overlap")]

# --tiers: parameters and optimizer state on NVMe, optimizer state dtype x host budget for the NVMe optimizer
# state (offload_optimizer.max_in_cpu). "368m" is the 350m shape: 368M parameters with the 32000 vocabulary.
TIERS_PRESETS: Dict[str, str] = {"368m": "350m", "760m": "760m", "tiny": "tiny"}
TIERS_BASE = "zero3-opt-nvme-param-nvme-all"
STATE_DTYPES = ("fp32", "bf16", "int8")


def host_budget(value: str, params: int) -> Any:
    """A --host-budgets entry as offload_optimizer.max_in_cpu: "auto", a count of elements, or a fraction
    ("0.5", "50%") of the model's parameters (one rank's optimizer partition is the whole model)."""
    v = value.strip()
    if v == "auto":
        return "auto"
    if v.endswith("%"):
        return int(float(v[:-1]) / 100 * params)
    if "." in v:
        return int(float(v) * params)
    return int(v)


def tiers_config(conf: Dict[str, Any], state_dtype: Optional[str], max_in_cpu: Any) -> Dict[str, Any]:
    """`conf` with optimizer.params.state_dtype and offload_optimizer.max_in_cpu (None: key not sent)."""
    conf = json.loads(json.dumps(conf))
    if state_dtype is not None:
        conf["optimizer"]["params"]["state_dtype"] = state_dtype
    if max_in_cpu is not None:
        conf["zero_optimization"]["offload_optimizer"]["max_in_cpu"] = max_in_cpu
    return conf


def zero_section(
    cfg: Dict[str, Any], nvme_dir: str, sub_group: int, deepspeed: bool, pipeline: bool = True
) -> Dict[str, Any]:
    zo: Dict[str, Any] = {"stage": cfg["stage"], "sub_group_size": sub_group}
    off: Dict[str, Any] = {"device": cfg["optimizer"]}
    if cfg["optimizer"] == "nvme":
        off.update(nvme_path=nvme_dir, buffer_count=4)
        # pipeline_read/write: ours steps sub-groups during backward. DeepSpeed 0.19.8 keeps its defaults
        # (false): with them on, its pipelined swapper fails an assertion (new_alloc_buffers) on stage 3.
        if not deepspeed:
            on = bool(cfg.get("pipeline", pipeline))
            off.update(pipeline_read=on, pipeline_write=on, max_in_cpu=0)  # every sub-group on NVMe
    if deepspeed and cfg["optimizer"] == "cpu":
        off["pin_memory"] = True
    zo["offload_optimizer"] = off
    if cfg["param"] is not None:
        par: Dict[str, Any] = {"device": cfg["param"]}
        if cfg["param"] == "nvme":
            par.update(nvme_path=nvme_dir, buffer_count=5, buffer_size=int(1e8))
            if "max_in_cpu" in cfg:
                par["max_in_cpu"] = cfg["max_in_cpu"]
        zo["offload_param"] = par
    return zo


def engine_config(
    cfg: Dict[str, Any],
    dtype: str,
    nvme_dir: str,
    sub_group: int,
    micro_batch: int,
    deepspeed: bool,
    pipeline: bool = True,
) -> Dict[str, Any]:
    conf: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": [0.9, 0.999], "eps": 1e-8},
        },
        "zero_optimization": zero_section(cfg, nvme_dir, sub_group, deepspeed, pipeline),
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False, "overlap_events": True},
    }
    if dtype == "bf16":
        conf["bf16"] = {"enabled": True}
    if deepspeed:
        conf["steps_per_print"] = 1 << 30
    return conf


# ------------------------------------------------------------------------------------------- workers
def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Run one configuration of ours or plain torch in this process (spec["engine"])."""
    import torch

    from benchmarks.deepspeed_runner import (
        batch,
        device_sync,
        make_model,
        measure,
        peak_rss_bytes,
        rss_bytes,
    )

    device = spec.get("device", "cpu")
    sync = device_sync(spec)
    if device == "cuda":
        torch.cuda.init()  # CUDA's context is set-up cost of the process, not of the model's initialisation
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    model = make_model(spec)
    build_s = time.perf_counter() - t0
    if spec["engine"] == "torch":
        bf16 = spec["dtype"] == "bf16"
        model.to(device)
        # fused: one kernel over all parameters, on the CPU or the GPU alike
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        sync()
        init_s = time.perf_counter() - t0
        init_peak = peak_rss_bytes()

        def forward(i: int) -> torch.Tensor:
            x, y = batch(spec, i, torch.device(device))
            # bf16 baseline: autocast over fp32 weights (the mixed-precision recipe the engines implement)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                return model(x, y)

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        out = measure(spec, forward, backward, step)
    else:
        import zero
        from offload.config import ConfigError

        try:
            engine, *_ = zero.initialize(model=model, config=spec["config"])
        except ConfigError as exc:  # a key this engine does not take (yet): a result, not a failure
            return {"refused": str(exc)}
        if engine.device.type != device:  # the accelerator comes from the environment _run sets
            raise RuntimeError(f"the engine computes on {engine.device}, this run asked for {device}")
        sync()
        init_s = time.perf_counter() - t0
        init_peak = peak_rss_bytes()

        def forward(i: int) -> torch.Tensor:
            x, y = batch(spec, i, engine.device)  # the caller's job, as with DeepSpeed
            return engine(x, y)

        def extra() -> Dict[str, float]:
            rep = engine.last_report
            return {
                "io_wait_s": rep.io_wait_s,
                "optimizer_compute_s": rep.optimizer_compute_s,
                "engine_optimizer_s": rep.optimizer_s,
                "engine_backward_s": rep.backward_s,
                "nvme_read_bytes": float(rep.nvme_read_bytes),
                "nvme_write_bytes": float(rep.nvme_write_bytes),
                # stage 3: the parameter partitions' swap files (zero for the other stages)
                "param_nvme_read_bytes": float((engine.last_param_io or {}).get("param_nvme_read_bytes", 0)),
                "param_nvme_write_bytes": float(
                    (engine.last_param_io or {}).get("param_nvme_write_bytes", 0)
                ),
            }

        out = measure(spec, forward, engine.backward, engine.step, extra)
        out["pinned_bytes"] = engine.pinned_bytes
        engine.close()
    out.update(init_s=init_s, build_s=build_s, init_peak_rss_bytes=init_peak, rss_before_init_bytes=rss0)
    out["peak_rss_bytes"] = max(init_peak, out["steady_peak_rss_bytes"])
    return out


def _run(spec: Dict[str, Any], ds_python: str, log: Any) -> Optional[Dict[str, Any]]:
    """One configuration in a fresh process; None (and the error in the log) when it failed."""
    with tempfile.TemporaryDirectory(prefix="e2e-run-", dir=spec.get("nvme_dir")) as tmp:
        spec = dict(spec)
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        if spec["config"] is not None:  # each run's swap files in a directory of its own
            conf = json.loads(json.dumps(spec["config"]).replace(spec["nvme_dir"], tmp))
            spec["config"] = conf
            spec["ds_config"] = conf
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        if spec["engine"] == "deepspeed":
            cmd = [ds_python, RUNNER, spec_path, out_path]
        else:
            cmd = [sys.executable, "-m", "benchmarks.bench_e2e", "--worker", spec_path, out_path]
        # ZO_ACCELERATOR picks our engine's device (and wins over DS_ACCELERATOR, which is DeepSpeed's)
        device = spec.get("device", "cpu")
        env = dict(os.environ, ZO_ACCELERATOR=device, DS_ACCELERATOR=device, PYTHONWARNINGS="ignore")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        label = f"{spec['name']} / {spec['engine']}"
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = (proc.stdout + proc.stderr)[-3000:]
            print(f"[e2e] {label}: FAILED rc={proc.returncode}\n{tail}", file=log, flush=True)
            return None
        with open(out_path) as f:
            out = json.load(f)
        if "refused" in out:
            print(f"[e2e] {label}: refused by the engine: {out['refused']}", file=log, flush=True)
            return out
        out["process_wall_s"] = wall
        med = statistics.median(r["step_s"] for r in out["rows"])
        gpu = f", peak GPU {out['peak_gpu_bytes'] / 2**30:.2f} GiB" if "peak_gpu_bytes" in out else ""
        print(
            f"[e2e] {label}: median step {med:.2f} s, init {out['init_s']:.1f} s, "
            f"peak RSS {out['peak_rss_bytes'] / 2**30:.2f} GiB{gpu}",
            file=log,
            flush=True,
        )
        return out


def _summary(runs: List[Dict[str, Any]], torch_losses: Optional[List[float]]) -> Dict[str, Any]:
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


def _stage3_available() -> bool:
    """Whether this tree's engine dispatches stage 3 (another part of the project adds it)."""
    with open(os.path.join(ROOT, "zero", "engine.py")) as f:
        return "stage3" in f.read()


def _table(results: Dict[str, Dict[str, Any]], gpu: bool = False) -> str:
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


def _write(
    raw: Dict[str, Any], args: argparse.Namespace, size: Dict[str, int], stage3: bool, final: bool
) -> None:
    """Summaries, JSON and table from the runs so far (rewritten after every run: a long run can be read)."""
    torch_runs = raw["torch"]["torch"]
    torch_losses = torch_runs[0]["losses"] if torch_runs else None
    results: Dict[str, Dict[str, Any]] = {}
    for name, by_engine in raw.items():
        for eng, runs in by_engine.items():
            if runs:
                results.setdefault(name, {})[eng] = _summary(runs, None if name == "torch" else torch_losses)
    # ZeRO-2 with the optimizer on NVMe has no DeepSpeed counterpart; compare with its closest one.
    for name in ("zero2-opt-nvme", "zero2-opt-nvme-no-overlap"):
        if "ours" in results.get(name, {}):
            results[name]["ours"]["ds_reference"] = "zero3-opt-nvme-param-cpu"
    table = _table(results, gpu=args.device == "cuda")
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


def _tiers_summary(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
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


def _tiers_table(results: Dict[str, Dict[str, Any]]) -> str:
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


def run_tiers(args: argparse.Namespace, base_spec: Dict[str, Any], nvme_root: str) -> int:
    """--tiers: the baseline (neither key sent), then every state dtype x host budget, rounds A B C ..."""
    from zero.examples.models import GPTConfig, num_params

    params = num_params(GPTConfig(**base_spec["size"]))
    variants: Dict[str, Tuple[Optional[str], Any]] = {"baseline": (None, None)}
    for sd in [x for x in args.state_dtypes.split(",") if x]:
        if sd not in STATE_DTYPES:
            raise SystemExit(f"--state-dtypes: unknown {sd!r}; choose from {STATE_DTYPES}")
        for hb in [x for x in args.host_budgets.split(",") if x]:
            variants[f"{sd} / host {hb}"] = (None if sd == "fp32" else sd, host_budget(hb, params))
    conf0 = engine_config(
        CONFIGS[TIERS_BASE],
        args.dtype,
        nvme_root,
        args.sub_group,
        args.micro_batch,
        False,
        not args.no_pipeline,
    )
    print(f"[e2e] --tiers {args.tiers}: {params / 1e6:.0f}M parameters, {len(variants)} variants", flush=True)
    raw: Dict[str, List[Dict[str, Any]]] = {label: [] for label in variants}
    for _ in range(args.repeats):
        for label, (sd, budget) in variants.items():
            if any("refused" in r for r in raw[label]):
                continue  # the engine's answer does not change between rounds
            conf = tiers_config(conf0, sd, budget)
            spec = dict(base_spec, name=label, engine="ours", config=conf, ds_config=conf)
            raw[label].append(_run(spec, args.ds_python, sys.stdout) or {"error": "failed"})
    results = {}
    for label, (sd, budget) in variants.items():
        results[label] = dict(_tiers_summary(raw[label]), state_dtype=sd, max_in_cpu=budget)
    table = _tiers_table(results)
    payload = {
        "device": args.device,
        "preset": args.tiers,
        "params": params,
        "model": base_spec["size"],
        "dtype": args.dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "base_config": TIERS_BASE,
        "results": results,
        "raw": raw,
    }
    write_outputs(args.out_name, payload, table, args.out_dir)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":
        with open(argv[1]) as f:
            spec = json.load(f)
        out = _worker(spec)
        with open(argv[2], "w") as f:
            json.dump(out, f)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where torch and ours compute; cuda: no DeepSpeed, output names get a _cuda suffix",
    )
    ap.add_argument("--size", choices=sorted(SIZES), default="125m")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of ours/DeepSpeed runs per configuration")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--sub-group", type=int, default=20_000_000, help="sub_group_size (both engines)")
    ap.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS)
    )
    ap.add_argument("--no-deepspeed", action="store_true", help="only plain torch and ours")
    ap.add_argument("--no-ours", action="store_true", help="only plain torch and DeepSpeed")
    ap.add_argument(
        "--no-pipeline", action="store_true", help="offload_optimizer.pipeline_read/write off (both engines)"
    )
    ap.add_argument(
        "--ds-python",
        default=DS_PYTHON,
        help="DeepSpeed's interpreter (default: $ZO_DS_PYTHON, else .dsvenv/bin/python from "
        "scripts/deepspeed_venv.sh); missing: DeepSpeed is not run, and the run says so",
    )
    ap.add_argument("--nvme-dir", default=None, help="where swap files go (default: a directory under /tmp)")
    ap.add_argument("--out-name", default="e2e", help="output file stem (with --device cuda: + _cuda)")
    ap.add_argument(
        "--reuse",
        default=None,
        help="a previous output JSON: its runs are kept and added to",
    )
    ap.add_argument("--skip-torch", action="store_true", help="do not run plain torch (with --reuse)")
    ap.add_argument(
        "--tiers",
        choices=sorted(TIERS_PRESETS),
        default=None,
        help="instead of the comparison: parameters and optimizer on NVMe (" + TIERS_BASE + "), optimizer "
        "state dtype x host budget for it; sets --size; output e2e_tiers_<preset>",
    )
    ap.add_argument(
        "--state-dtypes", default=",".join(STATE_DTYPES), help="--tiers: optimizer.params.state_dtype"
    )
    ap.add_argument(
        "--host-budgets",
        default="0,0.5",
        help="--tiers: offload_optimizer.max_in_cpu values: elements, 'auto', or a fraction ('0.5', '50%%') "
        "of the parameters",
    )
    ap.add_argument("--out-dir", default=OUT_DIR, help="where the JSON and table go")
    args = ap.parse_args(argv)
    if args.tiers:
        args.size = TIERS_PRESETS[args.tiers]
        if args.out_name == "e2e":
            args.out_name = f"e2e_tiers_{args.tiers}"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error(f"--device cuda: torch {torch.__version__} sees no usable CUDA device")
        if not args.out_name.endswith("_cuda"):
            args.out_name += "_cuda"

    nvme_root = args.nvme_dir or tempfile.mkdtemp(prefix="zo-e2e-", dir="/tmp")
    os.makedirs(nvme_root, exist_ok=True)
    size = dict(SIZES[args.size], vocab_size=args.vocab, seq_len=args.seq)
    base_spec = {
        "size": size,
        "dtype": args.dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": 0,
        "micro_batch": args.micro_batch,
        "nvme_dir": nvme_root,
        "device": args.device,
    }
    use_ds = not args.no_deepspeed and os.path.exists(args.ds_python)
    if not args.no_deepspeed and not use_ds:
        print(
            f"[e2e] no DeepSpeed interpreter at {args.ds_python}: DeepSpeed is not run "
            "(scripts/deepspeed_venv.sh builds one; or pass --ds-python)",
            flush=True,
        )
    if args.device == "cuda" and not args.no_deepspeed:
        print("[e2e] --device cuda: DeepSpeed is not run (plain torch and ours only)", flush=True)
        use_ds = False
    if args.tiers:
        code = run_tiers(args, base_spec, nvme_root)
        if args.nvme_dir is None:
            shutil.rmtree(nvme_root, ignore_errors=True)
        return code
    stage3 = _stage3_available()
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    log = sys.stdout
    print(
        f"[e2e] size {args.size} {size}, {args.dtype}, device {args.device}, nvme dir {nvme_root}, "
        f"stage 3 in tree: {stage3}",
        flush=True,
    )

    raw: Dict[str, Dict[str, List[Dict[str, Any]]]] = {"torch": {"torch": []}}
    if args.reuse:
        with open(args.reuse) as f:
            previous = json.load(f)
        if previous.get("device", "cpu") != args.device:
            ap.error(
                f"--reuse {args.reuse}: its runs are on {previous.get('device', 'cpu')}, not {args.device}"
            )
        raw.update(previous["raw"])
    for name in names:
        raw.setdefault(name, {})
    for _ in range(args.repeats):
        if not (args.skip_torch and raw["torch"]["torch"]):
            out = _run(dict(base_spec, name="torch", engine="torch", config=None), args.ds_python, log)
            if out is not None:
                raw["torch"]["torch"].append(out)
        for name in names:
            cfg = CONFIGS[name]
            engines = []
            if not args.no_ours and (cfg["stage"] < 3 or stage3):
                engines.append("ours")
            # DeepSpeed has no ZeRO-2 with the optimizer on NVMe; its no-overlap run is its default run
            if use_ds and not (cfg["stage"] < 3 and cfg["optimizer"] == "nvme") and "pipeline" not in cfg:
                engines.append("deepspeed")
            for eng in engines:
                conf = engine_config(
                    cfg,
                    args.dtype,
                    nvme_root,
                    args.sub_group,
                    args.micro_batch,
                    eng == "deepspeed",
                    not args.no_pipeline,
                )
                spec = dict(base_spec, name=name, engine=eng, config=conf, ds_config=conf)
                out = _run(spec, args.ds_python, log)
                if out is not None and "refused" not in out:
                    raw[name].setdefault(eng, []).append(out)
                    _write(raw, args, size, stage3, final=False)

    _write(raw, args, size, stage3, final=True)
    if args.nvme_dir is None:
        shutil.rmtree(nvme_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
