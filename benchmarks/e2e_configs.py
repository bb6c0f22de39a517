"""What benchmarks/bench_e2e.py compares: the GPT sizes, the configurations (ours and DeepSpeed's
zero_optimization sections from one description) and the --tiers grid's state dtypes and host budgets."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

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
    """The zero_optimization section of configuration cfg, for DeepSpeed or for ours."""
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
    """The whole config of configuration cfg (AdamW, aio settings, bf16 when asked), for DeepSpeed or ours."""
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
