"""Predicted against measured: the planner's time for a configuration beside the engine's, on this machine.

    python -m benchmarks.bench_plan --profile profile.json [--configs train-125m-s2-cpu,...] [--repeats 2]

`--profile` is the machine profile `ds-nvme-bench --json` writes (the disk's bandwidths). Each round, for each
configuration in turn (A B A B), the rates are probed (offload.estimate.probe: CPU AdamW, host copy, a
matmul of the model's shape, for training a transformer block's forward + backward), the planner predicts
the step (or forward) time of exactly that configuration (offload.estimate.plan.predict_training,
plan_inference.predict_inference), and the engine runs it:
`--warmup` steps, then `--steps` timed ones (inference: forwards). The table gives the medians over rounds
of both and their ratio, with what the plan says bounds it. Output: benchmarks/out/plan.json (with each timed
training step's engine report: forward, backward, optimizer, I/O wait, NVMe bytes) and plan.md.

Configurations (GPT shapes of benchmarks/bench_e2e.py, vocabulary 32000, sequence 128, fp32):

* `train-125m-s2-cpu`: 125M, ZeRO-2, optimizer on the CPU, micro-batch 2;
* `train-125m-s3-nvme`: 125M, ZeRO-3, parameters and optimizer state on NVMe (max_in_cpu 0 for both: every
  byte streamed), micro-batch 2;
* `infer-1b-fits`: a 1.0B GPT (16 x 2048), stage 3 with parameters on NVMe and no placement key: `"auto"`
  keeps the whole model in RAM, so the forward reads nothing from disk; batch 1, 64 tokens;
* `infer-7b-4gib`: a 6.7B GPT (32 x 4096) in fp32, larger than this machine's RAM, with a pinned budget
  of 4 GiB (needs the disk space and about 30 GiB of swap-file writes: not run by default).

`--checkpoint DIR` runs the inference configurations the way a user does instead: the Hugging Face
checkpoint in DIR (config.json and safetensors shards, e.g. one `benchmarks.bench_inference` wrote) loaded
with `zero.from_pretrained` under the configuration's placement (`--serve-checkpoint`: "auto" serves the
NVMe partitions straight from the checkpoint's files, "false" copies them into swap files), the shape the
planner gets read from its config.json (the model built on the meta device); each run's load seconds,
time to first token (load plus the first forward) and LoadReport are recorded. `--drop-caches` drops the
page cache before each run (root).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List

import torch

from benchmarks.deepspeed_runner import batch, make_model
from benchmarks.harness import markdown_table, write_outputs
from offload.estimate import count_parameters
from offload.estimate.machine import load_machine_profile
from offload.estimate.plan import ModelShape, predict_training
from offload.estimate.plan_inference import predict_inference
from offload.estimate.probe import probe_machine

GiB = 1 << 30
SIZES = {
    "125m": {"n_layer": 12, "d_model": 768, "n_head": 12},
    "1b": {"n_layer": 16, "d_model": 2048, "n_head": 16},
    "7b": {"n_layer": 32, "d_model": 4096, "n_head": 32},
}
CONFIGS: Dict[str, Dict[str, Any]] = {
    "train-125m-s2-cpu": {"size": "125m", "stage": 2, "opt": "cpu", "par": "none", "mb": 2, "seq": 128},
    "train-125m-s3-nvme": {
        "size": "125m",
        "stage": 3,
        "opt": "nvme",
        "par": "nvme",
        "mb": 2,
        "seq": 128,
        "max_in_cpu": 0,
    },
    "infer-1b-fits": {"size": "1b", "par": "nvme", "mb": 1, "seq": 64},
    "infer-7b-4gib": {"size": "7b", "par": "nvme", "mb": 1, "seq": 16, "budget": 4 * GiB},
}
DEFAULT_CONFIGS = ["train-125m-s2-cpu", "train-125m-s3-nvme", "infer-1b-fits"]
SUB_GROUP = 20_000_000


def _shape(c: Dict[str, Any]) -> ModelShape:
    s = SIZES[c["size"]]
    count = count_parameters(make_model({"size": {**s, "vocab_size": 32000, "seq_len": c["seq"]}}))
    return ModelShape(
        params=count.params,
        largest_layer_params=count.largest_layer_params,
        hidden_size=s["d_model"],
        num_layers=s["n_layer"],
        seq_len=c["seq"],
        vocab_size=32000,
        num_heads=s["n_head"],
    )


def _checkpoint_shape(ckpt: str, c: Dict[str, Any]) -> ModelShape:
    """The ModelShape of the causal LM in the checkpoint folder `ckpt`, built on the meta device."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        count = count_parameters(transformers.AutoModelForCausalLM.from_config(cfg))
    return ModelShape(
        params=count.params,
        largest_layer_params=count.largest_layer_params,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        seq_len=c["seq"],
        vocab_size=cfg.vocab_size,
        num_heads=cfg.num_attention_heads,
    )


def _drop_page_cache() -> str:
    """Drop the page cache (root); a note saying why not, else ""."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return ""
    except OSError as e:
        return f"page cache not dropped ({e.strerror})"


def _measure_pretrained(
    c: Dict[str, Any], ckpt: str, serve: Any, nvme: str, vocab: int, warmup: int, steps: int
) -> Dict[str, Any]:
    """Load `ckpt` with zero.from_pretrained under the configuration's placement, then time the forwards:
    load seconds, time to first token (load + the first forward), the forwards' median and bytes read."""
    import zero

    t0 = time.perf_counter()
    engine = zero.from_pretrained(ckpt, config=_config(c, nvme), serve_checkpoint=serve)
    load_s = time.perf_counter() - t0
    times: List[float] = []
    try:
        placement = engine.placement()
        load = engine.load_report
        for i in range(warmup + steps):
            g = torch.Generator().manual_seed(i)
            x = torch.randint(0, vocab, (c["mb"], c["seq"]), generator=g)
            if i == warmup:
                engine.inference_report()  # the timed forwards only
            t1 = time.perf_counter()
            with torch.no_grad():
                engine(x)
            times.append(time.perf_counter() - t1)
        rep = engine.inference_report()
    finally:
        engine.close()
        del engine
        gc.collect()
    return {
        "seconds": statistics.median(times[warmup:]),
        "all": times[warmup:],
        "load_s": load_s,
        "first_token_s": load_s + times[0],
        "nvme_read_bytes": rep.nvme_read_bytes_per_forward,
        "read_wait_s_per_forward": rep.read_wait_s / max(1, rep.forwards),
        "checkpoint_bytes_served": load.checkpoint_bytes_served,
        "swap_bytes_written": load.swap_bytes_written,
        "copy_reason": load.copy_reason,
        "placement": placement,
    }


def _config(c: Dict[str, Any], nvme: str) -> Dict[str, Any]:
    zo: Dict[str, Any] = {"stage": c.get("stage", 3), "sub_group_size": SUB_GROUP}
    if c.get("opt", "none") != "none":
        zo["offload_optimizer"] = {"device": c["opt"], "nvme_path": nvme}
        if "max_in_cpu" in c:
            zo["offload_optimizer"]["max_in_cpu"] = c["max_in_cpu"]
    if c["par"] != "none":
        zo["offload_param"] = {"device": c["par"], "nvme_path": nvme}  # no max_in_cpu: "auto" unless given
        if "max_in_cpu" in c:
            zo["offload_param"]["max_in_cpu"] = c["max_in_cpu"]
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": c["mb"], "zero_optimization": zo}
    if "budget" in c:
        cfg["zero_offload"] = {"pinned_budget_bytes": c["budget"]}
    if "opt" in c:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}
    return cfg


def _measure(name: str, c: Dict[str, Any], nvme: str, warmup: int, steps: int) -> Dict[str, Any]:
    import zero

    spec = {"size": {**SIZES[c["size"]], "vocab_size": 32000, "seq_len": c["seq"]}, "micro_batch": c["mb"]}
    model = make_model(spec)
    engine, *_ = zero.initialize(model=model, config=_config(c, nvme))
    placement = engine.placement()
    times: List[float] = []
    phases: List[Dict[str, Any]] = []  # training: each timed step's report (forward/backward/optimizer/I/O)
    nvme_read = 0.0
    try:
        for i in range(warmup + steps):
            x, y = batch(spec, i)
            t0 = time.perf_counter()
            if "opt" in c:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            else:
                if i == warmup:
                    engine.inference_report()  # the timed forwards only
                with torch.no_grad():
                    engine(x)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                if "opt" in c and engine.last_report is not None:
                    phases.append(engine.last_report.as_dict())
        if "opt" not in c:
            rep = engine.inference_report()
            nvme_read = rep.nvme_read_bytes_per_forward
        else:
            io = engine.last_param_io or {}
            nvme_read = float(engine.last_report.nvme_read_bytes + io.get("param_nvme_read_bytes", 0))
    finally:
        engine.close()
        del engine, model
        gc.collect()
    return {
        "seconds": statistics.median(times),
        "all": times,
        "nvme_read_bytes": nvme_read,
        "placement": placement,
        "phases": phases,
    }


def _predict(c: Dict[str, Any], shape: ModelShape, profile: Any) -> Any:
    train = "opt" in c  # training: a transformer block's forward + backward is probed too
    compute = probe_machine(
        tokens=c["mb"] * c["seq"],
        hidden=shape.hidden_size,
        dtype="fp32",
        device="cpu",
        seq_len=c["seq"] if train else None,
        heads=shape.num_heads,
    )
    if "opt" in c:
        pred = predict_training(
            shape,
            profile,
            compute,
            stage=c["stage"],
            offload_optimizer=c["opt"],
            offload_param=c["par"],
            micro_batch=c["mb"],
            precision="fp32",
            optimizer="adamw",
            sub_group_size=SUB_GROUP,
            param_max_in_cpu=c.get("max_in_cpu"),
            optimizer_max_in_cpu=c.get("max_in_cpu"),
        )
    else:
        pred = predict_inference(
            shape, profile, compute, offload_param=c["par"], precision="fp32", batch_size=c["mb"],
            pinned_budget=c.get("budget"),
        )  # fmt: skip
    return pred, compute


def main() -> None:
    """Run the configurations in rounds and write plan.json / plan.md."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True, help="machine profile JSON (ds-nvme-bench --json)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--repeats", type=int, default=2, help="rounds (A B A B)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nvme-dir", default=None, help="where swap files go (default: a temporary directory)")
    ap.add_argument("--out-name", default="plan")
    ap.add_argument("--checkpoint", help="inference configurations: load this HF checkpoint (see above)")
    ap.add_argument("--serve-checkpoint", choices=("auto", "false"), default="auto")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each run (root)")
    args = ap.parse_args()
    profile = load_machine_profile(args.profile)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"bench_plan: unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    ckpt = args.checkpoint

    def from_ckpt(n: str) -> bool:
        return bool(ckpt) and "opt" not in CONFIGS[n]

    shapes = {n: _checkpoint_shape(ckpt, CONFIGS[n]) if from_ckpt(n) else _shape(CONFIGS[n]) for n in names}
    serve = "auto" if args.serve_checkpoint == "auto" else False
    results: Dict[str, Dict[str, Any]] = {n: {"predicted": [], "measured": [], "runs": []} for n in names}
    with tempfile.TemporaryDirectory(prefix="zo-plan-", dir=args.nvme_dir) as nvme:
        for r in range(args.repeats):
            for n in names:
                c = CONFIGS[n]
                note = _drop_page_cache() if args.drop_caches else ""
                pred, compute = _predict(c, shapes[n], profile)
                load = os.getloadavg()
                if from_ckpt(n):
                    vocab = shapes[n].vocab_size
                    got = _measure_pretrained(c, ckpt, serve, nvme, vocab, args.warmup, args.steps)
                else:
                    got = _measure(n, c, nvme, args.warmup, args.steps)
                got.update(loadavg_before=load, loadavg_after=os.getloadavg(), cache_note=note)
                results[n]["predicted"].append(pred.seconds)
                results[n]["measured"].append(got["seconds"])
                results[n]["runs"].append(
                    {"prediction": pred.to_dict(), "compute_profile": compute.to_dict(), "measured": got}
                )
                print(
                    f"[plan] round {r + 1} {n}: predicted {pred.seconds:.3f} s ({pred.bound}), measured "
                    f"{got['seconds']:.3f} s, NVMe read {got['nvme_read_bytes'] / 1e6:.1f} MB (predicted "
                    f"{pred.nvme_read_bytes / 1e6:.1f}), load average "
                    f"{got['loadavg_before'][0]:.1f} -> {got['loadavg_after'][0]:.1f}"
                    + (
                        f", load {got['load_s']:.1f} s, first token {got['first_token_s']:.1f} s"
                        if "load_s" in got
                        else ""
                    ),
                    flush=True,
                )
    rows = []
    for n in names:
        p, m = statistics.median(results[n]["predicted"]), statistics.median(results[n]["measured"])
        last = results[n]["runs"][-1]
        results[n].update(predicted_median_s=p, measured_median_s=m, ratio=p / m)
        rows.append(
            [n, f"{p:.3f}", f"{m:.3f}", f"{p / m:.2f}", last["prediction"]["bound"],
             f"{last['measured']['nvme_read_bytes'] / 1e6:.1f}"]
        )  # fmt: skip
    table = markdown_table(
        [
            "configuration",
            "predicted s",
            "measured s",
            "predicted / measured",
            "bound (plan)",
            "NVMe MB read",
        ],
        rows,
    )
    print(table)
    write_outputs(args.out_name, {"profile": args.profile, "results": results}, table)


if __name__ == "__main__":
    main()
