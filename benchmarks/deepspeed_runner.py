"""One benchmark configuration in its own process: DeepSpeed, and the measuring loop shared with bench_e2e.

    .dsvenv/bin/python benchmarks/deepspeed_runner.py SPEC.json OUT.json   (scripts/deepspeed_venv.sh)

This file is run by DeepSpeed's own interpreter (a separate venv), so it imports nothing of this project
but the model definition, loaded by file path: only the standard library, torch and (in `run_deepspeed`)
deepspeed. bench_e2e imports `measure`, `make_model`, `batch` and friends from here for its own contenders,
so both sides are timed by the same code.

SPEC keys: size (GPTConfig fields), dtype ("fp32" | "bf16"), steps, warmup, seed, micro_batch, lr,
weight_decay, ds_config (DeepSpeed only), nvme_dir, device ("cpu" | "cuda"; absent: "cpu"). On "cuda",
`measure` synchronises the GPU at every phase boundary and records its peak memory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

MODELS_PY = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zero", "examples", "models.py"
)


def load_models_module() -> Any:
    """zero/examples/models.py by path (DeepSpeed's venv does not have this project installed)."""
    name = "_bench_gpt_models"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, MODELS_PY)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the model definition from {MODELS_PY}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look the module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def make_model(spec: Dict[str, Any]) -> torch.nn.Module:
    """The spec's GPT (zero/examples/models.py), seeded from the spec."""
    mod = load_models_module()
    torch.manual_seed(int(spec.get("seed", 0)))
    return mod.GPT(mod.GPTConfig(**spec["size"]))


def batch(
    spec: Dict[str, Any], step: int, device: Optional[torch.device] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token batch number `step`: a pure function of (seed, step), identical in every process.

    Drawn on the CPU (the same tokens whatever the device), then moved to `device` when given.
    """
    size = spec["size"]
    g = torch.Generator().manual_seed(int(spec.get("seed", 0)) * 1_000_003 + step)
    tokens = torch.randint(
        0, size["vocab_size"], (int(spec["micro_batch"]), size["seq_len"] + 1), generator=g
    )
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def rss_bytes() -> int:
    """This process's resident set size in bytes (from /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """VmHWM: the peak resident set since start, or since the last `reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def storage_io() -> Tuple[int, int]:
    """(bytes read, bytes written) by this process at the storage layer, all threads (O_DIRECT included)."""
    read = written = 0
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "read_bytes":
                    read = int(value)
                elif key == "write_bytes":
                    written = int(value)
    except OSError:
        pass
    return read, written


def device_sync(spec: Dict[str, Any]) -> Callable[[], None]:
    """Waits for the device's queued work: GPU kernels run asynchronously, so a phase's wall time means
    something only once the GPU has finished it. A no-op on the CPU, so both modes share one timing path."""
    if spec.get("device", "cpu") == "cuda":
        return torch.cuda.synchronize
    return lambda: None


StepFns = Tuple[Callable[[int], torch.Tensor], Callable[[torch.Tensor], None], Callable[[], None]]


def measure(
    spec: Dict[str, Any],
    forward: Callable[[int], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    step: Callable[[], None],
    extra: Optional[Callable[[], Dict[str, float]]] = None,
) -> Dict[str, Any]:
    """`warmup` + `steps` training steps, each timed phase by phase; the per-step rows and losses.

    With spec["device"] == "cuda" the GPU is synchronised before each step and after each phase, and the
    result also holds peak_gpu_bytes / peak_gpu_reserved_bytes (torch's allocator, over the whole process:
    initialisation included).
    """
    sync = device_sync(spec)
    rows: List[Dict[str, float]] = []
    losses: List[float] = []
    total = int(spec["warmup"]) + int(spec["steps"])
    for i in range(total):
        if i == int(spec["warmup"]):
            reset_peak_rss()  # the steady-state peak, apart from the one of initialisation
        sync()  # nothing queued from before (initialisation's copies) is billed to this step
        r0, w0 = storage_io()
        t0 = time.perf_counter()
        loss = forward(i)
        sync()
        t1 = time.perf_counter()
        backward(loss)
        sync()
        t2 = time.perf_counter()
        step()
        sync()
        t3 = time.perf_counter()
        r1, w1 = storage_io()
        losses.append(float(loss.detach().float().item()))
        row = {
            "step_s": t3 - t0,
            "forward_s": t1 - t0,
            "backward_s": t2 - t1,
            "optimizer_s": t3 - t2,
            "disk_read_bytes": float(r1 - r0),
            "disk_write_bytes": float(w1 - w0),
        }
        if extra is not None:
            row.update(extra())
        rows.append(row)
    out: Dict[str, Any] = {
        "rows": rows[int(spec["warmup"]) :],
        "losses": losses,
        "steady_peak_rss_bytes": peak_rss_bytes(),
    }
    if spec.get("device", "cpu") == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def run_deepspeed(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Train the spec's model with DeepSpeed as one local rank; its timings and memory as a dict."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    # The JIT builds of DeepSpeed's CPU Adam and aio ops (cached after the first run) are not init time;
    # the accelerator's own builders are the ones deepspeed.initialize loads.
    get_accelerator().create_op_builder("CPUAdamBuilder").load()
    if "nvme" in json.dumps(spec["ds_config"]):
        get_accelerator().create_op_builder("AsyncIOBuilder").load()
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    ds_config = dict(spec["ds_config"])
    if ds_config.get("zero_optimization", {}).get("stage") == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = make_model(spec)
    else:
        model = make_model(spec)
    build_s = time.perf_counter() - t0
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    init_s = time.perf_counter() - t0
    init_peak = peak_rss_bytes()

    def forward(i: int) -> torch.Tensor:
        x, y = batch(spec, i)
        return engine(x, y)

    out = measure(spec, forward, engine.backward, engine.step)
    out.update(init_s=init_s, build_s=build_s, init_peak_rss_bytes=init_peak, rss_before_init_bytes=rss0)
    return out


def main(argv: List[str]) -> int:
    """Run the spec in argv[0] and write the results as JSON to argv[1]; the exit status."""
    if len(argv) != 2:
        print("usage: deepspeed_runner.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    out = run_deepspeed(spec)
    out["peak_rss_bytes"] = max(out["init_peak_rss_bytes"], out["steady_peak_rss_bytes"])
    with open(argv[1], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
