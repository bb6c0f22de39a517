"""ZeRO-Inference streaming vs accelerate's disk offload: greedy generation of a model larger than the
memory it may use.

A Llama-style model from a config (``--size``) with random weights is written once as safetensors shards
(tensor by tensor, so a model larger than RAM can be written). Both contenders load that checkpoint under
the same host-memory budget (``--cpu-budget``, bytes of weights allowed in RAM) and generate B x N new
tokens greedily from the same prompts:

* ``ours``: ``zero.from_pretrained`` at stage 3 with ``offload_param`` nvme, ``max_in_cpu`` = the budget
  in elements; each forward streams the weights from the swap files, prefetched ``buffer_count`` deep
  into staging buffers of ``buffer_size`` elements, with the ``aio`` section ds-nvme-bench writes for the
  disk's best read settings (what a ZeRO-Inference user gets from tuning; ``--default-aio`` keeps
  DeepSpeed's defaults, ``--aio-config FILE`` takes another);
* ``ours-copy`` (``--contenders ours,ours-copy`` compares the two loads): ours with
  ``serve_checkpoint=False``, the weights copied into swap files at load; ``ours`` serves the partitions
  that need no conversion straight from the checkpoint's safetensors files (zero.inference.serving);
* ``accelerate``: ``AutoModelForCausalLM.from_pretrained(device_map="auto", max_memory={"cpu": budget},
  offload_folder=...)``: what does not fit the budget is offloaded to disk and loaded by hooks per module.

``--param-tier cpu`` keeps every weight in host memory instead: ours with ``offload_param`` cpu (pinned;
on a GPU each layer is copied to it ahead of its use), accelerate with a CPU budget that holds the whole
model (on a GPU: ``--gpu-budget`` on the device, the rest in RAM); no disk ceiling is measured then.

Each run is its own process (peak RSS is its own) and the page cache is dropped before each one and again
between its load and its generation, so that generation starts cold for both (root:
``/proc/sys/vm/drop_caches``; otherwise skipped, with a note in the output; ``--keep-cache-after-load`` skips
the second drop); rounds alternate the contenders (A B A B). Ours reads with O_DIRECT and never uses the
page cache; accelerate (through transformers) reads its offloaded weights from the checkpoint's own
safetensors files, memory-mapped (offload_folder is only written for weights that need converting), so its
later forwards read from the page cache whatever RAM outside its budget can hold (this shows in its GB read
from the disk per forward).
Reported: tokens/s, s per forward, GB read from the disk per forward
(``/proc/self/io`` read_bytes; ours also the engine's own count), the achieved read GB/s and its fraction of
the disk's read ceiling (``--read-ceiling-gbs``, else measured with ``ds-nvme-bench --quick --read-only``;
given, ds-nvme-bench does not run, so our ``aio`` section stays at DeepSpeed's defaults unless
``--aio-config`` names one), peak RSS, load time, time to first token (load + the prompt's forward), and
whether all generated identical tokens.

    python -m benchmarks.bench_inference --size small --repeats 2
    python -m benchmarks.bench_inference --size 7b --nvme-path /local_nvme --read-ceiling-gbs 6.5
    python -m benchmarks.bench_inference --size 1b --device cuda
    python -m benchmarks.bench_inference --size 7b --device cuda --param-tier cpu
    python -m benchmarks.bench_inference --smoke            # seconds: what tests/test_bench_inference.py runs

Over 500 lines in one file because the parent (rounds, page cache, ceiling, table) re-runs this module as
each contender's child process with the same argument parser.

``--weight-bits 4`` (or 8) adds DeepSpeed's ``weight_quantization`` section to our config,
``{"quantized_initialization": {"num_bits": 4, "group_size": 64}}``; the engine needs weight quantization
support for that key (without it the config is refused) and accelerate stays unquantized, so the tokens
are then not expected to match.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.harness import markdown_table, write_outputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Llama shapes: hidden, intermediate, layers, heads, kv heads, vocab; shard bytes
SIZES: Dict[str, Dict[str, int]] = {
    "tiny": dict(hidden=64, inter=172, layers=2, heads=4, kv_heads=2, vocab=512, shard=256 << 10),
    "small": dict(hidden=768, inter=2048, layers=8, heads=12, kv_heads=12, vocab=32000, shard=100 << 20),
    "1b": dict(hidden=2048, inter=5632, layers=22, heads=32, kv_heads=4, vocab=32000, shard=1 << 30),
    "7b": dict(hidden=4096, inter=11008, layers=32, heads=32, kv_heads=32, vocab=32000, shard=2 << 30),
}
CONTENDERS = ("ours", "ours-copy", "accelerate")
OURS = ("ours", "ours-copy")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# ------------------------------------------------------------------------------------------ checkpoint
def llama_config(size: str, dtype: str) -> Any:
    """transformers' LlamaConfig of preset size, in dtype."""
    import transformers

    s = SIZES[size]
    return transformers.LlamaConfig(
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        vocab_size=s["vocab"],
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype=DTYPES[dtype],
    )


def write_checkpoint(path: str, size: str, dtype: str) -> int:
    """config.json plus random weights as safetensors shards and their index, one tensor in memory at a
    time (each tensor's values from its own seed: the same checkpoint every time). Returns the bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = llama_config(size, dtype)
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    torch_dtype = getattr(torch, DTYPES[dtype])
    limit = SIZES[size]["shard"]
    shards: List[Dict[str, Any]] = [{}]
    sizes = [0]
    for name, p in model.state_dict().items():
        nbytes = p.numel() * torch_dtype.itemsize
        if sizes[-1] and sizes[-1] + nbytes > limit:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = p.shape
        sizes[-1] += nbytes
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in names.items():
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=torch_dtype)
            else:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                t = (torch.randn(shape, generator=g) * 0.02).to(torch_dtype)
            tensors[name] = t
            weight_map[name] = fname
            total += t.nbytes
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total


def our_config(args: argparse.Namespace, swap: str, element_bytes: float) -> Dict[str, Any]:
    """Stage 3, parameters on NVMe, at most the budget's elements kept in host memory (`element_bytes`:
    stored bytes per element), or with `--param-tier cpu` all in (pinned) host memory; `--weight-bits`
    adds DeepSpeed's weight_quantization section."""
    offload: Dict[str, Any] = {"device": "cpu", "pin_memory": True}
    if args.param_tier == "nvme":
        offload = {
            "device": "nvme",
            "nvme_path": swap,
            "max_in_cpu": int(args.cpu_budget // element_bytes),
            "buffer_count": args.buffer_count,
            "buffer_size": args.buffer_size,
        }
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_param": offload,
            # prefetch depth is also bounded by this many elements ahead: room for every staging buffer
            "stage3_prefetch_bucket_size": args.prefetch_bucket,
        },
    }
    if args.aio_config:
        with open(args.aio_config) as f:
            cfg["aio"] = json.load(f)["aio"]
    if args.weight_bits:
        cfg["weight_quantization"] = {
            "quantized_initialization": {"num_bits": args.weight_bits, "group_size": args.group_size}
        }
        if args.int8_activations:
            cfg["zero_offload"] = {"int8_activations": True}
    return cfg


def stored_element_bytes(args: argparse.Namespace, itemsize: int) -> float:
    """Bytes a weight element takes in RAM: the dtype's, or with `--weight-bits` its codes and float16
    constants, so that the budget (bytes) keeps as many bytes of weights in RAM quantized as not."""
    if not args.weight_bits:
        return float(itemsize)
    from offload.config.quantization import WeightQuantSpec
    from zero.stage3.quant import quantized_nbytes

    spec = WeightQuantSpec(num_bits=args.weight_bits, group_size=args.group_size)
    return quantized_nbytes(args.group_size, spec) / args.group_size


# ------------------------------------------------------------------------------------------- one run
def _read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io), -1 where unavailable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _time_each_forward(model: Any, device: Any) -> List[float]:
    """A list that the model's root forwards append their wall seconds to (the prefill first, then one per
    new token); on a GPU each forward's time runs until the work it queued has finished."""
    import torch

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    times: List[float] = []
    start: List[float] = []
    model.register_forward_pre_hook(lambda m, a: start.append(now()))
    model.register_forward_hook(lambda m, a, o: times.append(now() - start.pop()))
    return times


def run_child(args: argparse.Namespace) -> Dict[str, Any]:
    """One contender in this process: load, then one timed generation."""
    import torch
    import transformers

    import zero
    from zero.report import ForwardMeter

    dtype = getattr(torch, DTYPES[args.dtype])
    device = torch.device(args.device)
    ids = torch.randint(
        3,
        SIZES[args.size]["vocab"],
        (args.batch, args.prompt_len),
        generator=torch.Generator().manual_seed(1),
    )
    if args.gpu_memory_cap:  # a GPU smaller than this one: the model is larger than what the process may use
        index = torch.cuda.current_device() if device.index is None else device.index
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_cap / total), index)
    engine = None
    t0 = time.perf_counter()
    cfg = our_config(args, args.scratch, stored_element_bytes(args, dtype.itemsize))
    if args.child in OURS:
        engine = zero.from_pretrained(
            args.ckpt,
            config=cfg,
            dtype=dtype,
            swap_cache=args.swap_cache or False,
            serve_checkpoint="auto" if args.child == "ours" else False,
        )
        model = engine.module
        engine.inference_report()  # start counting at the generation
    else:
        max_memory: Dict[Any, Any] = {"cpu": int(args.cpu_budget)}
        if device.type == "cuda":
            max_memory[0] = int(args.gpu_budget)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.ckpt,
            device_map="auto",
            max_memory=max_memory,
            offload_folder=os.path.join(args.scratch, "offload"),
            dtype=dtype,
        ).eval()
    load_s = time.perf_counter() - t0
    if args.drop_after_load:
        drop_page_cache()  # the load read the checkpoint
    meter = ForwardMeter(model, device)
    each_s = _time_each_forward(model, device)
    read0 = _read_bytes()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids.to(device),
            attention_mask=torch.ones_like(ids).to(device),
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    read1 = _read_bytes()
    forwards, tokens, forward_s = meter.take()
    meter.close()
    result: Dict[str, Any] = {
        "forward_s_each": each_s,
        "load_s": load_s,
        "generate_s": gen_s,
        "forwards": forwards,
        "tokens_processed": tokens,
        "forward_s": forward_s,
        "disk_read_bytes": read1 - read0 if read0 >= 0 and read1 >= 0 else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tokens": out[:, ids.shape[1] :].tolist(),
    }
    if engine is not None:
        rep = engine.inference_report()
        result["report"] = rep.as_dict()
        result["aio"] = cfg.get("aio", "defaults")
        result["swap_cache"] = engine.load_report.swap_cache
        result["checkpoint_bytes_served"] = engine.load_report.checkpoint_bytes_served
        result["swap_bytes_written"] = engine.load_report.swap_bytes_written
        engine.close()
    else:
        result["device_map_tiers"] = sorted({str(v) for v in getattr(model, "hf_device_map", {}).values()})
        # where the weights sit between forwards ("meta": offloaded, loaded by accelerate's hooks)
        result["param_devices"] = sorted({p.device.type for p in model.parameters()})
    if device.type == "cuda":
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return result


# ------------------------------------------------------------------------------------------- parent
def drop_page_cache() -> Optional[str]:
    """Drop the page cache (root only); a note saying why not, else None."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"page cache not dropped ({e.strerror}; needs root): warm-cache numbers"


def read_ceiling(args: argparse.Namespace, scratch: str) -> Tuple[Optional[float], str]:
    """The disk's sequential read bandwidth: --read-ceiling-gbs, else ds-nvme-bench's quick read test, whose
    best settings become our `aio` section (`args.aio_config`) unless --default-aio or --aio-config."""
    if args.read_ceiling_gbs is not None:
        return args.read_ceiling_gbs, "--read-ceiling-gbs"
    out = os.path.join(scratch, "nvme_profile.json")
    cmd = [sys.executable, "-m", "offload.cli.nvme_bench", "--path", scratch, "--quick", "--read-only"]
    tuned = os.path.join(scratch, "aio_tuned.json")
    if not (args.default_aio or args.aio_config):
        cmd += ["--write-config", tuned]
    proc = subprocess.run(cmd + ["--json", out], cwd=ROOT, capture_output=True, text=True)
    if os.path.isfile(tuned):
        args.aio_config = tuned
    try:
        with open(out) as f:
            value = json.load(f).get("nvme_read_gbps")
    except (OSError, ValueError):
        value = None
    if not value:
        return None, f"ds-nvme-bench failed (rc {proc.returncode}): {(proc.stdout + proc.stderr)[-300:]}"
    return float(value), "ds-nvme-bench --quick --read-only"


def _run(args: argparse.Namespace, contender: str, ckpt: str, scratch: str) -> Dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix=f"{contender}-", dir=scratch)
    cmd = [sys.executable, "-m", "benchmarks.bench_inference", "--child", contender, "--ckpt", ckpt]
    cmd += ["--scratch", run_dir, "--size", args.size, "--dtype", args.dtype, "--device", args.device]
    cmd += ["--param-tier", args.param_tier]
    cmd += [
        "--batch",
        str(args.batch),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
    ]
    cmd += ["--cpu-budget", str(args.cpu_budget), "--gpu-budget", str(args.gpu_budget)]
    if args.gpu_memory_cap:
        cmd += ["--gpu-memory-cap", str(args.gpu_memory_cap)]
    cmd += ["--buffer-count", str(args.buffer_count), "--group-size", str(args.group_size)]
    cmd += ["--prefetch-bucket", str(args.prefetch_bucket), "--buffer-size", str(args.buffer_size)]
    if args.aio_config:
        cmd += ["--aio-config", args.aio_config]
    if args.weight_bits:
        cmd += ["--weight-bits", str(args.weight_bits)]
    if args.int8_activations:
        cmd += ["--int8-activations"]
    if args.swap_cache and contender in OURS:
        cmd += ["--swap-cache", args.swap_cache]
    if not args.drop_after_load:
        cmd += ["--keep-cache-after-load"]
    env = dict(os.environ, ZO_ACCELERATOR=args.device)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": f"rc={proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"}
    return json.loads(line[len("RESULT ") :])


def summarize(runs: List[Dict[str, Any]], weight_bytes: int, ceiling: Optional[float]) -> Dict[str, Any]:
    """One contender over its runs: median times and tokens per second, peaks, disk reads against the
    read ceiling."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run"}

    def med(key: str) -> float:
        return statistics.median(r[key] for r in ok)

    s: Dict[str, Any] = {
        "runs": len(ok),
        "load_s": med("load_s"),
        # from the call that loads to the end of the first forward (the prompt's): time to first token
        "first_token_s": statistics.median(r["load_s"] + r["forward_s_each"][0] for r in ok),
        "generate_s": med("generate_s"),
        "forwards": ok[0]["forwards"],
        "new_tokens_per_s": statistics.median(
            len(r["tokens"]) * len(r["tokens"][0]) / r["generate_s"] for r in ok
        ),
        "s_per_forward": statistics.median(r["forward_s"] / r["forwards"] for r in ok),
        "prefill_s": statistics.median(r["forward_s_each"][0] for r in ok),
        "decode_s_per_forward": statistics.median(
            statistics.median(r["forward_s_each"][1:] or r["forward_s_each"]) for r in ok
        ),
        "peak_rss_bytes": med("peak_rss_bytes"),
        "weight_bytes": weight_bytes,
    }
    reads = [r["disk_read_bytes"] for r in ok if r.get("disk_read_bytes") is not None]
    if reads:
        s["disk_read_bytes_per_forward"] = statistics.median(reads) / ok[0]["forwards"]
        s["disk_read_gbps"] = statistics.median(
            r["disk_read_bytes"] / r["generate_s"] / 1e9 for r in ok if r.get("disk_read_bytes") is not None
        )
        s["read_ceiling_fraction"] = s["disk_read_gbps"] / ceiling if ceiling else None
    if "report" in ok[0]:
        s["param_nvme_read_bytes_per_forward"] = statistics.median(
            r["report"]["nvme_read_bytes_per_forward"] for r in ok
        )
        s["read_wait_s_per_forward"] = statistics.median(
            r["report"]["read_wait_s"] / max(1, r["report"]["forwards"]) for r in ok
        )
        s["prefetch_hits"] = ok[0]["report"]["param_prefetch_hits"]
        s["param_reads"] = ok[0]["report"]["param_reads"]
    if "device_map_tiers" in ok[0]:
        s["device_map_tiers"] = ok[0]["device_map_tiers"]
    if "peak_gpu_bytes" in ok[0]:
        s["peak_gpu_bytes"] = med("peak_gpu_bytes")
    return s


def main(argv: Optional[List[str]] = None) -> int:
    """Run the contenders and write the JSON and table; with --child, one contender, its result printed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 round, a few tokens: for the test")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--param-tier",
        choices=("nvme", "cpu"),
        default="nvme",
        help="where our weights live: nvme (streamed, --cpu-budget of them kept in RAM) or cpu (all in "
        "pinned host memory; accelerate then keeps them all in RAM too, nothing on disk)",
    )
    ap.add_argument(
        "--gpu-memory-cap",
        type=float,
        help="with --device cuda: bytes of GPU memory each contender's process may allocate (torch's "
        "per-process memory fraction), to run a model larger than the GPU it may use",
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of A B (medians over rounds)")
    ap.add_argument(
        "--cpu-budget",
        type=float,
        help="bytes of weights allowed in host memory, for both (default: a quarter of the model)",
    )
    ap.add_argument(
        "--gpu-budget", type=float, default=2e9, help="accelerate's GPU max_memory with --device cuda"
    )
    ap.add_argument(
        "--buffer-count", type=int, default=5, help="our offload_param.buffer_count (prefetch depth)"
    )
    ap.add_argument(
        "--buffer-size",
        type=int,
        default=int(1e8),
        help="our offload_param.buffer_size (elements per staging buffer; DeepSpeed's default 1e8)",
    )
    ap.add_argument(
        "--aio-config",
        help="a JSON file with our `aio` section (default: the best read settings ds-nvme-bench finds)",
    )
    ap.add_argument(
        "--default-aio", action="store_true", help="our `aio` section left at DeepSpeed's defaults"
    )
    ap.add_argument(
        "--prefetch-bucket",
        type=int,
        default=int(5e8),
        help="our stage3_prefetch_bucket_size (elements read ahead at most; DeepSpeed's default 5e7 holds"
        " one 7B layer's matrix, so the default here lets every staging buffer be in flight)",
    )
    ap.add_argument("--weight-bits", type=int, choices=(4, 8), help="our weight_quantization num_bits")
    ap.add_argument("--group-size", type=int, default=64, help="our weight_quantization group_size")
    ap.add_argument(
        "--int8-activations",
        action="store_true",
        help="with --weight-bits: our zero_offload.int8_activations (integer products on the CPU)",
    )
    ap.add_argument(
        "--read-ceiling-gbs",
        type=float,
        help="the disk's read bandwidth (skips ds-nvme-bench: our aio section is then DeepSpeed's defaults "
        "unless --aio-config)",
    )
    ap.add_argument(
        "--keep-cache-after-load",
        dest="drop_after_load",
        action="store_false",
        help="do not drop the page cache between a contender's load and its generation",
    )
    ap.add_argument(
        "--no-drop-caches", action="store_true", help="never drop the page cache (warm-cache numbers)"
    )
    ap.add_argument("--contenders", default="ours,accelerate")
    ap.add_argument("--nvme-path", default=os.environ.get("ZO_TEST_IO_DIR", "/var/tmp"))
    ap.add_argument("--checkpoint", help="checkpoint folder to reuse or create (default: a temporary one)")
    ap.add_argument(
        "--swap-cache",
        help="ours: zero.from_pretrained(swap_cache=DIR): the first run writes its swap files there, later "
        "runs (rounds, or a later invocation) reuse them; the report's load s shows the difference",
    )
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/out)")
    ap.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.size, args.new_tokens, args.prompt_len, args.batch = "tiny", 4, 8, 2
    if args.no_drop_caches:
        args.drop_after_load = False
    if args.gpu_memory_cap and args.device != "cuda":
        ap.error("--gpu-memory-cap applies to --device cuda")
    if args.int8_activations and not args.weight_bits:
        ap.error("--int8-activations applies to quantized weights: give --weight-bits too")
    if args.child:
        print("RESULT " + json.dumps(run_child(args)), flush=True)
        return 0
    if args.param_tier == "cpu" and (args.cpu_budget is not None or args.swap_cache):
        ap.error("--cpu-budget and --swap-cache apply to --param-tier nvme (cpu keeps every weight in RAM)")
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        ap.error(f"unknown contenders {unknown}; choose from {CONTENDERS}")

    notes: List[str] = []
    with tempfile.TemporaryDirectory(prefix="zo-bench-inf-", dir=args.nvme_path) as scratch:
        ckpt = args.checkpoint or os.path.join(scratch, "ckpt")
        t0 = time.perf_counter()
        if os.path.isfile(os.path.join(ckpt, "model.safetensors.index.json")):
            with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
                weight_bytes = json.load(f)["metadata"]["total_size"]
            print(f"reusing the checkpoint in {ckpt}", flush=True)
        else:
            weight_bytes = write_checkpoint(ckpt, args.size, args.dtype)
            print(
                f"wrote {weight_bytes / 1e9:.2f} GB of weights in {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
        if args.param_tier == "cpu":
            # every weight in RAM for both; accelerate's planner wants room beyond the weights themselves
            args.cpu_budget = float(weight_bytes * 1.25 + 2**30)
            ceiling, ceiling_source = None, "--param-tier cpu: no weights read from the disk"
        else:
            if args.cpu_budget is None:
                args.cpu_budget = float(weight_bytes // 4)
            ceiling, ceiling_source = read_ceiling(args, scratch)
        runs: Dict[str, List[Dict[str, Any]]] = {c: [] for c in contenders}
        for rnd in range(args.repeats):
            for c in contenders:
                note = (
                    "page cache not dropped (--no-drop-caches)" if args.no_drop_caches else drop_page_cache()
                )
                if note and note not in notes:
                    notes.append(note)
                runs[c].append(_run(args, c, ckpt, scratch))
                r = runs[c][-1]
                if "error" in r:
                    print(f"round {rnd} {c}: FAILED {r['error'][-500:]}", flush=True)
                else:
                    print(
                        f"round {rnd} {c}: generate {r['generate_s']:.2f} s, load {r['load_s']:.2f} s",
                        flush=True,
                    )

    summary = {c: summarize(rs, weight_bytes, ceiling) for c, rs in runs.items()}
    tokens = {c: rs[0]["tokens"] for c, rs in runs.items() if rs and "error" not in rs[0]}
    same = len(tokens) >= 2 and all(
        r["tokens"] == tokens[contenders[0]] for rs in runs.values() for r in rs if "error" not in r
    )
    if len(tokens) >= 2 and not same:
        notes.append(
            "the contenders generated DIFFERENT tokens" + (" (quantized weights)" if args.weight_bits else "")
        )
    base = summary.get("accelerate", {}).get("new_tokens_per_s")
    headers = [
        "contender",
        "new tokens/s",
        "vs accelerate",
        "s/forward",
        "prefill s",
        "decode s/forward",
        "read wait s/forward",
        "GB read/forward",
        "read GB/s",
        "of ceiling",
        "peak RSS GiB",
        "load s",
        "first token s",
    ] + (["peak GPU GiB"] if args.device == "cuda" else [])
    rows = []
    for c, s in summary.items():
        if "error" in s:
            rows.append([c, "failed"] + [""] * (len(headers) - 2))
            continue
        frac = s.get("read_ceiling_fraction")
        rows.append(
            [
                c,
                f"{s['new_tokens_per_s']:.3g}",
                f"{s['new_tokens_per_s'] / base:.2f}" if base else "",
                f"{s['s_per_forward']:.3g}",
                f"{s['prefill_s']:.3g}",
                f"{s['decode_s_per_forward']:.3g}",
                f"{s['read_wait_s_per_forward']:.3g}" if "read_wait_s_per_forward" in s else "",
                f"{s['disk_read_bytes_per_forward'] / 1e9:.3f}" if "disk_read_bytes_per_forward" in s else "",
                f"{s['disk_read_gbps']:.3f}" if "disk_read_gbps" in s else "",
                f"{frac:.0%}" if frac is not None else "",
                f"{s['peak_rss_bytes'] / 2**30:.2f}",
                f"{s['load_s']:.1f}",
                f"{s['first_token_s']:.1f}",
            ]
            + ([f"{s['peak_gpu_bytes'] / 2**30:.2f}"] if "peak_gpu_bytes" in s else [])
        )
    title = (
        f"Llama {args.size} ({weight_bytes / 1e9:.2f} GB {args.dtype}), {args.device}, weights on "
        f"{args.param_tier}, batch {args.batch} x "
        f"{args.new_tokens} new tokens (prompt {args.prompt_len}), "
        f"CPU budget {args.cpu_budget / 1e9:.2f} GB, "
        + (f"accelerate's GPU budget {args.gpu_budget / 1e9:.2f} GB, " if args.device == "cuda" else "")
        + (f"GPU memory capped at {args.gpu_memory_cap / 2**30:.2f} GiB, " if args.gpu_memory_cap else "")
        + f"{args.repeats} round(s); read ceiling "
        + (f"{ceiling:.2f} GB/s ({ceiling_source})" if ceiling else f"unknown ({ceiling_source})")
        + f"; tokens {'identical' if same else 'NOT identical' if len(tokens) >= 2 else 'not compared'}"
    )
    table = title + "\n\n" + markdown_table(headers, rows)
    if notes:
        table += "\n\n" + "\n".join(f"Note: {n}" for n in notes)
    tier = "" if args.param_tier == "nvme" else f"_{args.param_tier}"
    dtype = "" if args.dtype == "fp32" else f"_{args.dtype}"
    name = f"bench_inference_{'smoke' if args.smoke else args.size}{dtype}_{args.device}{tier}"
    write_outputs(
        name,
        {
            "args": vars(args),
            "weight_bytes": weight_bytes,
            "read_ceiling_gbs": ceiling,
            "read_ceiling_source": ceiling_source,
            "tokens_identical": same,
            "notes": notes,
            "summary": summary,
            "runs": runs,
        },
        table,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
