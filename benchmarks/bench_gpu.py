"""Training Llama on one GPU with offload: capacity, throughput, overhead and partial optimizer offload.

    python -m benchmarks.bench_gpu                                # on a GPU host, within --budget-s (450)
    python -m benchmarks.bench_gpu --sections overhead,ratio      # a subset
    python -m benchmarks.bench_gpu --smoke                        # seconds on the CPU: tiny sizes

Llama-style models (transformers' LlamaForCausalLM from a LlamaConfig, random weights, no download) of a
ladder of shapes: rung k has hidden 128 k (head dim 128), k layers, k heads and an intermediate size of
8/3 hidden rounded up to a multiple of 256, vocabulary 32000 (rung 32 is LLaMA-7B's shape). bf16 training,
AdamW. The stage-3 models are built under zero.Init (never whole in memory); the others directly on the
device in bf16. Sections:

* ``capacity``: for plain torch (bf16 weights and AdamW state on the GPU, torch's fused AdamW: 8 bytes per
  parameter) and for ZeRO-2 + optimizer on CPU, ZeRO-3 + optimizer and parameters on CPU, ZeRO-3 with both
  on NVMe: the largest rung the estimator (offload.estimate; for plain torch 8 bytes per parameter plus the
  estimator's activations) says fits this machine (GPU memory free after CUDA's start-up,
  torch.cuda.mem_get_info; available host memory; free space at --nvme-path), then two real training
  steps at that rung in a process of their own; out of memory (CUDA, or the process killed) steps one rung
  down and tries again. A try that runs out of its share of the budget is reported as such.
* ``tflops``: model FLOPs per second (6 x params x tokens, plus 2 x params x tokens for the recompute of
  activation checkpointing) at sequence 2048 with activation checkpointing, for the smallest rung whose
  training state (the estimator's stage 0 without offload, activations not counted) does not fit in the
  GPU's memory, trained with --tflops-config (ZeRO-2, optimizer on CPU). Goal: 150 TFLOPS on an H100.
* ``overhead``: plain torch against --overhead-config, and against it with ``zero_offload.delayed_update``
  when CONFIGS has its ``-delayed`` twin, for a model that fits (rung --overhead-rung), the same batches,
  steps alternating A B C A B C in one process; medians and the ratio.
* ``ratio``: ``offload_optimizer.ratio`` 0 / 0.5 / 1 (the part of the optimizer state kept on the CPU; the
  rest stays on the GPU), step times alternating in one process. A value the engine refuses (ConfigError)
  is reported as refused, with the engine's message.

Every section but ``overhead``/``ratio``'s contenders runs in a child process (a fresh GPU, and an out of
memory kill ends only that try); sections share --budget-s in proportion (SHARES), time one leaves unused
goes to the next. Output: benchmarks/out/bench_gpu_<device>.json and .md (--out for another folder).

The four sections share the model ladder, the configurations and the estimator's fit
(benchmarks/gpu_ladder.py) and one contender's training in a child process (benchmarks/gpu_train.py).
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
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.gpu_ladder import (
    CAPACITY,
    CONFIGS,
    DELAYED,
    RATIOS,
    activations,
    estimate_row,
    fmt_params,
    largest_rung,
    rung,
    stage0_bytes,
)
from benchmarks.gpu_train import child_interleaved, child_train, flops_per_step
from benchmarks.harness import markdown_table, write_outputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# run in this order: the cheap, fixed-size sections first; capacity last takes what they leave unused
SECTIONS = ("overhead", "ratio", "tflops", "capacity")
SHARES = {"capacity": 0.45, "tflops": 0.25, "overhead": 0.15, "ratio": 0.15}
TFLOPS_GOAL = 150.0


# ---------------------------------------------------------------------------------------- the parent
def spawn(args: argparse.Namespace, kind: str, job: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Run a child job (in this process with --in-process); a timeout or a kill is a result too.

    The job's swap files go to a folder of its own under job["nvme_dir"], removed when the job ends: a child
    killed for time or memory leaves nothing on the disk for the next try."""
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="job-", dir=job["nvme_dir"]) as swap:
        out = _spawn(args, kind, dict(job, nvme_dir=swap), timeout)
    out["wall_s"] = time.time() - t0
    return out


def _spawn(args: argparse.Namespace, kind: str, job: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    if args.in_process:
        return (child_train if kind == "train" else child_interleaved)(args, job)
    with tempfile.TemporaryDirectory(prefix="zo-gpu-job-") as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_gpu",
            *args.child_argv,
            "--child",
            kind,
            job_path,
            out_path,
        ]
        env = dict(os.environ, ZO_ACCELERATOR=args.device, PYTHONWARNINGS="ignore")
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"not finished within its {timeout:.0f} s of the budget"}
        if not os.path.exists(out_path):
            killed = proc.returncode in (-9, 137)  # the kernel's OOM killer: host memory ran out
            return {"status": "oom" if killed else "error", "error": f"child exited with {proc.returncode}"}
        with open(out_path) as f:
            return json.load(f)


def machine_limits(args: argparse.Namespace, nvme_dir: str) -> Any:
    """GPU memory free in a fresh process (a probe child), available RAM, free disk at nvme_dir."""
    import psutil

    from offload.estimate import MachineProfile

    gpu = args.device_mem
    if gpu is None:
        probe = "import torch; torch.cuda.init(); print(torch.cuda.mem_get_info()[0])"
        gpu = int(
            subprocess.run(
                [sys.executable, "-c", probe], capture_output=True, text=True, check=True
            ).stdout.split()[-1]
        )
    return MachineProfile(
        gpu_bytes=int(gpu),
        ram_bytes=int(psutil.virtual_memory().available),
        nvme_free_bytes=shutil.disk_usage(nvme_dir).free,
    )


def job_for(args: argparse.Namespace, name: str, k: int, nvme_dir: str, **kw: Any) -> Dict[str, Any]:
    """A child job: configuration `name` at rung `k` with the capacity section's settings (`kw` overrides)."""
    job = dict(
        name=name,
        shape=asdict(rung(k, args)),
        seq=args.seq,
        micro=args.micro,
        accum=1,
        ckpt=False,
        warmup=0,
        steps=2,
        nvme_dir=nvme_dir,
    )
    job.update(kw)
    return job


def section_capacity(
    args: argparse.Namespace, machine: Any, nvme_dir: str, deadline: float
) -> Dict[str, Any]:
    """The largest rung each configuration fits by the estimate, verified by two training steps (one rung
    down after an out of memory)."""
    out: Dict[str, Any] = {"configs": {}}
    names = [c for c in args.capacity_configs.split(",") if c]
    for idx, name in enumerate(names):
        k, est = largest_rung(name, args, machine)
        entry: Dict[str, Any] = {"estimator_rung": k, "estimate": est, "attempts": []}
        entry["estimator_params"] = rung(k, args).params if k else 0
        entry["capped"] = k == args.max_rung  # the ladder ends here: larger ones may fit too
        print(
            f"[capacity] {name}: estimator's largest: rung {k} ({fmt_params(entry['estimator_params'])})",
            flush=True,
        )
        verified = 0
        while k >= 1:
            left = (deadline - time.time()) / (len(names) - idx)
            if left < 5:
                entry["attempts"].append({"rung": k, "status": "skipped", "error": "no budget left"})
                break
            r = spawn(args, "train", job_for(args, name, k, nvme_dir), left)
            entry["attempts"].append(
                {
                    "rung": k,
                    "params": rung(k, args).params,
                    **{key: r.get(key) for key in ("status", "error", "peak_gpu_bytes", "init_s", "wall_s")},
                }
            )
            if r.get("rows"):
                entry["attempts"][-1]["step_s"] = [row["step_s"] for row in r["rows"]]
                entry["attempts"][-1]["losses"] = [row["loss"] for row in r["rows"]]
            if r["status"] == "ok":
                verified = k
                break
            if r["status"] != "oom":
                break
            k -= 1
            print(f"[capacity] {name}: out of memory, one rung down to {k}", flush=True)
        entry["verified_rung"] = verified
        entry["verified_params"] = rung(verified, args).params if verified else 0
        out["configs"][name] = entry
    out["status"] = "ok"
    base = out["configs"].get("torch", {}).get("verified_params")
    for entry in out["configs"].values():
        entry["x_torch"] = entry["verified_params"] / base if base else None
    return out


def section_tflops(args: argparse.Namespace, machine: Any, nvme_dir: str, deadline: float) -> Dict[str, Any]:
    """Model TFLOPS of the smallest rung that needs offload, at --tflops-seq with activation checkpointing."""
    k = next((k for k in range(1, args.max_rung + 1) if stage0_bytes(rung(k, args)) > machine.gpu_bytes), 0)
    if k == 0:
        return {"status": "skipped", "error": f"no rung up to {args.max_rung} needs offload on this device"}
    shape = rung(k, args)
    act = activations(shape, args.tflops_micro, args.tflops_seq, True)
    est = estimate_row(args.tflops_config, shape, args, act, machine)
    print(
        f"[tflops] rung {k} ({fmt_params(shape.params)}; stage 0 without offload needs "
        f"{stage0_bytes(shape) / 2**30:.1f} GiB), {args.tflops_config}",
        flush=True,
    )
    job = job_for(
        args,
        args.tflops_config,
        k,
        nvme_dir,
        seq=args.tflops_seq,
        micro=args.tflops_micro,
        accum=args.tflops_accum,
        ckpt=True,
        warmup=1,
        steps=args.tflops_steps,
    )
    r = spawn(args, "train", job, deadline - time.time())
    out = {
        "rung": k,
        "params": shape.params,
        "config": args.tflops_config,
        "estimate": est,
        "stage0_state_bytes": stage0_bytes(shape),
        "gpu_bytes": machine.gpu_bytes,
        "seq": args.tflops_seq,
        "tokens_per_step": args.tflops_seq * args.tflops_micro * args.tflops_accum,
        **r,
    }
    if r.get("rows"):
        med = statistics.median(row["step_s"] for row in r["rows"])
        out["step_s"] = med
        out["tflops"] = flops_per_step(shape.params, out["tokens_per_step"], True) / med / 1e12
        out["goal_tflops"] = TFLOPS_GOAL
    return out


def section_interleaved(
    args: argparse.Namespace, contenders: Dict[str, Tuple[str, float]], nvme_dir: str, deadline: float
) -> Dict[str, Any]:
    """The contenders' steps alternating in one child process (the overhead and ratio sections)."""
    job = job_for(
        args,
        "",
        args.overhead_rung,
        nvme_dir,
        seq=args.tflops_seq,
        micro=args.overhead_micro,
        ckpt=True,
        warmup=1,
        repeats=args.repeats,
        contenders=contenders,
    )
    return spawn(args, "interleaved", job, deadline - time.time())


def _gib(v: Optional[float]) -> str:
    return "" if v is None else f"{v / 2**30:.1f}"


def tables(res: Dict[str, Any]) -> str:
    """The markdown tables of the sections that ran."""
    parts = []
    cap = res.get("capacity", {})
    if cap.get("configs"):
        rows = []
        for name, e in cap["configs"].items():
            tries = ", ".join(f"{a['rung']}: {a['status']}" for a in e["attempts"])
            est = e["estimate"]
            rows.append(
                [
                    name,
                    fmt_params(e["estimator_params"]) + (" (ladder's top)" if e["capped"] else ""),
                    _gib(est.get("per_gpu_bytes")),
                    _gib(est.get("per_cpu_bytes")),
                    _gib(est.get("nvme_bytes")),
                    fmt_params(e["verified_params"]) if e["verified_rung"] else "none verified",
                    "" if e["x_torch"] is None else f"{e['x_torch']:.2f}",
                    tries,
                ]
            )
        hdr = [
            "config",
            "estimator's largest (params)",
            "est. GPU GiB",
            "est. host GiB",
            "est. NVMe GiB",
            "verified (2 steps)",
            "x torch",
            "tries (rung: outcome)",
        ]
        parts.append("### Largest model\n\n" + markdown_table(hdr, rows))
    tf = res.get("tflops", {})
    if tf.get("params"):
        row = [
            tf["config"],
            fmt_params(tf["params"]),
            tf["tokens_per_step"],
            tf.get("status", ""),
            f"{tf['step_s']:.2f}" if "step_s" in tf else "",
            f"{tf['tflops']:.1f}" if "tflops" in tf else "",
            TFLOPS_GOAL,
        ]
        hdr = ["config", "params", "tokens/step", "status", "step s (median)", "TFLOPS", "goal"]
        parts.append(
            f"### Throughput, seq {tf['seq']}, activation checkpointing\n\n" + markdown_table(hdr, [row])
        )
    for key, title in (("overhead", "Offload overhead vs plain torch"), ("ratio", "offload_optimizer.ratio")):
        sec = res.get(key, {})
        if not sec.get("contenders"):
            continue
        ok = [c for c in sec["contenders"].values() if c["status"] == "ok"]
        base = sec["contenders"].get("torch") or sec["contenders"].get("ratio=1.0") or (ok or [{}])[0]
        rows = []
        for label, c in sec["contenders"].items():
            if c["status"] != "ok":
                rows.append([label, f"{c['status']}: {c.get('error', '')[:120]}", "", ""])
                continue
            ratio = c["step_s"] / base["step_s"] if base.get("status") == "ok" else None
            rows.append(
                [
                    label,
                    f"{c['step_s']:.3f} ({c['step_min_s']:.3f}-{c['step_max_s']:.3f})",
                    "" if ratio is None else f"{ratio:.2f}",
                    f"{c['losses'][-1]:.4f}",
                ]
            )
        hdr = ["contender", "step s median (min-max)", "x baseline", "last loss"]
        parts.append(f"### {title} ({fmt_params(sec['params'])} params)\n\n" + markdown_table(hdr, rows))
    return "\n\n".join(parts)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    """The command line; --smoke sets tiny CPU sizes, and the settings a child needs go to args.child_argv."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, in one process: seconds")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--budget-s", type=float, default=450.0, help="total wall time the sections share")
    ap.add_argument("--nvme-path", default=os.environ.get("ZO_TEST_IO_DIR", "/var/tmp"))
    ap.add_argument(
        "--device-mem", type=int, default=None, help="device bytes to plan with (default: probed)"
    )
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/out)")
    ap.add_argument("--unit", type=int, default=128, help="hidden size per rung (= head dim x heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--inter-multiple", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-rung", type=int, default=96)
    ap.add_argument("--seq", type=int, default=512, help="capacity: sequence length")
    ap.add_argument("--micro", type=int, default=1, help="capacity: micro-batch")
    ap.add_argument("--sub-group", type=int, default=100_000_000)
    ap.add_argument(
        "--capacity-configs", default=",".join(CAPACITY), help="capacity: of " + ",".join(CONFIGS)
    )
    ap.add_argument("--tflops-config", choices=[c for c in CONFIGS if c != "torch"], default="zero2-opt-cpu")
    ap.add_argument("--tflops-seq", type=int, default=2048)
    ap.add_argument("--tflops-micro", type=int, default=8)
    ap.add_argument("--tflops-accum", type=int, default=4)
    ap.add_argument("--tflops-steps", type=int, default=2, help="timed steps after one warm-up")
    ap.add_argument(
        "--overhead-config", choices=[c for c in CONFIGS if c != "torch"], default="zero2-opt-cpu"
    )
    ap.add_argument("--overhead-rung", type=int, default=16, help="overhead and ratio: the model's rung")
    ap.add_argument("--overhead-micro", type=int, default=4)
    ap.add_argument("--ratio-config", choices=[c for c in CONFIGS if c != "torch"], default="zero3-opt-cpu")
    ap.add_argument("--repeats", type=int, default=4, help="overhead/ratio: timed rounds")
    ap.add_argument("--in-process", action="store_true", help="no child processes (no OOM isolation)")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "JOB", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.in_process = "cpu", True
        for key, value in dict(
            unit=32,
            head_dim=16,
            inter_multiple=32,
            vocab=256,
            seq=32,
            micro=1,
            max_rung=4,
            device_mem=args.device_mem or 2 << 20,
            tflops_seq=64,
            tflops_micro=2,
            tflops_accum=2,
            tflops_steps=1,
            overhead_rung=2,
            overhead_micro=2,
            repeats=2,
            sub_group=1 << 16,
            budget_s=min(args.budget_s, 150.0),  # four sections, the overhead one with three contenders
        ).items():
            setattr(args, key, value)
    if args.device == "cpu" and args.device_mem is None and not args.child:
        ap.error("--device cpu needs --device-mem (the bytes the 'device' may use)")
    # what a child needs to rebuild these settings
    args.child_argv = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("device", "unit", "head_dim", "inter_multiple", "vocab", "sub_group")
    ]
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Run the chosen sections within --budget-s (or one child job with --child) and write the outputs."""
    args = parse_args(argv)
    if args.child:
        kind, job_path, out_path = args.child
        with open(job_path) as f:
            job = json.load(f)
        out = (child_train if kind == "train" else child_interleaved)(args, job)
        with open(out_path, "w") as f:
            json.dump(out, f)
        return 0
    if args.device == "cuda":
        os.environ.setdefault("ZO_ACCELERATOR", "cuda")
    else:
        os.environ["ZO_ACCELERATOR"] = "cpu"
    sections = [x for x in args.sections.split(",") if x]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {SECTIONS}")
    bad = sorted(set(args.capacity_configs.split(",")) - set(CONFIGS) - {""})
    if bad:
        raise SystemExit(f"unknown --capacity-configs {bad}; choose from {list(CONFIGS)}")
    start = time.time()
    res: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="zo-bench-gpu-", dir=args.nvme_path) as nvme_dir:
        machine = machine_limits(args, nvme_dir)
        print(
            f"[bench_gpu] {args.device}: plan with {machine.gpu_bytes / 2**30:.1f} GiB device memory, "
            f"{machine.ram_bytes / 2**30:.1f} GiB RAM, {machine.nvme_free_bytes / 2**30:.1f} GiB disk free "
            f"at {args.nvme_path}; budget {args.budget_s:.0f} s",
            flush=True,
        )
        for idx, name in enumerate(sections):
            left = args.budget_s - (time.time() - start)
            share = SHARES[name] / sum(SHARES[x] for x in sections[idx:])
            deadline = time.time() + left * share
            print(f"[bench_gpu] section {name}: {left * share:.0f} s of {left:.0f} s left", flush=True)
            t0 = time.time()
            if left < 5:
                res[name] = {"status": "skipped", "error": "no budget left"}
                continue
            if name == "capacity":
                res[name] = section_capacity(args, machine, nvme_dir, deadline)
            elif name == "tflops":
                res[name] = section_tflops(args, machine, nvme_dir, deadline)
            elif name == "overhead":
                contenders = {"torch": ("torch", 1.0), args.overhead_config: (args.overhead_config, 1.0)}
                if args.overhead_config + DELAYED in CONFIGS:
                    delayed = args.overhead_config + DELAYED
                    contenders[delayed] = (delayed, 1.0)
                res[name] = section_interleaved(args, contenders, nvme_dir, deadline)
            else:
                contenders = {f"ratio={r}": (args.ratio_config, r) for r in RATIOS}
                res[name] = section_interleaved(args, contenders, nvme_dir, deadline)
            res[name]["section_s"] = time.time() - t0
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k != "child"},
        "results": res,
        "machine_limits": {
            "gpu_bytes": machine.gpu_bytes,
            "ram_bytes": machine.ram_bytes,
            "nvme_free_bytes": machine.nvme_free_bytes,
        },
        "total_s": time.time() - start,
    }
    write_outputs(f"bench_gpu_{args.device}", payload, tables(res), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
