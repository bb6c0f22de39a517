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

One command reproduces the RESULTS.md table: this module runs the protocol (both engines, A B A B
rounds); what is compared is in benchmarks/e2e_configs.py, one run of ours or plain torch in
benchmarks/e2e_worker.py, the summaries, JSON and tables in benchmarks/e2e_report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.e2e_configs import (
    CONFIGS,
    DEFAULT_CONFIGS,
    SIZES,
    STATE_DTYPES,
    TIERS_BASE,
    TIERS_PRESETS,
    engine_config,
    host_budget,
    tiers_config,
)
from benchmarks.e2e_report import summarize_tiers, tiers_table, write_comparison
from benchmarks.e2e_worker import run_worker
from benchmarks.harness import OUT_DIR, write_outputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "benchmarks", "deepspeed_runner.py")
# DeepSpeed's interpreter: --ds-python, else $ZO_DS_PYTHON, else the venv scripts/deepspeed_venv.sh builds.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DS_PYTHON = os.environ.get("ZO_DS_PYTHON", os.path.join(_REPO, ".dsvenv", "bin", "python"))


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


def _stage3_available() -> bool:
    """Whether this tree has the stage-3 engine (zero.stage3's partitioner)."""
    return os.path.isfile(os.path.join(ROOT, "zero", "stage3", "partitioner.py"))


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
        results[label] = dict(summarize_tiers(raw[label]), state_dtype=sd, max_in_cpu=budget)
    table = tiers_table(results)
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
    """Run the comparison (or the --tiers grid, or one --worker run) and write its JSON and table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":
        with open(argv[1]) as f:
            spec = json.load(f)
        out = run_worker(spec)
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
                    write_comparison(raw, args, size, stage3, final=False)

    write_comparison(raw, args, size, stage3, final=True)
    if args.nvme_dir is None:
        shutil.rmtree(nvme_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
