"""The model ladder of benchmarks/bench_gpu.py: Llama shapes by rung, the configurations it compares
(CONFIGS), their DeepSpeed-style configs and what the estimator (offload.estimate) says fits a machine."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

# name -> (stage, offload_optimizer, offload_param); None: plain torch
CONFIGS: Dict[str, Optional[Tuple[int, str, str]]] = {
    "torch": None,
    "zero2-opt-cpu": (2, "cpu", "none"),
    "zero3-opt-cpu-param-cpu": (3, "cpu", "cpu"),
    "zero3-opt-nvme-param-nvme": (3, "nvme", "nvme"),
    "zero3-opt-cpu": (3, "cpu", "none"),  # DeepSpeed's partial offload (ratio) is a stage-3 feature
    # zero_offload.delayed_update: the host step of step t behind step t+1's forward and backward
    "zero2-opt-cpu-delayed": (2, "cpu", "none"),
}
DELAYED = "-delayed"  # a configuration whose name ends so runs with the delayed update
CAPACITY = ("torch", "zero2-opt-cpu", "zero3-opt-cpu-param-cpu", "zero3-opt-nvme-param-nvme")
RATIOS = (0.0, 0.5, 1.0)
TORCH_BYTES_PER_PARAM = (
    8  # bf16 weights, gradients, exp_avg, exp_avg_sq (torch keeps state in the param dtype)
)


# ----------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """One Llama shape (untied head, no biases, as many KV heads as heads)."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int

    @property
    def params(self) -> int:
        """Parameters of the model (embeddings, layers, final norm, untied head)."""
        h, i = self.hidden, self.intermediate
        return 2 * self.vocab * h + self.layers * (4 * h * h + 3 * h * i + 2 * h) + h

    @property
    def largest_layer(self) -> int:
        """Elements of the largest parameter (embedding or head, or an MLP matrix)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)

    def hf_config(self, seq: int) -> Any:
        """transformers' LlamaConfig of this shape for sequences of up to seq tokens."""
        import transformers

        return transformers.LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=seq,
            use_cache=False,
            attn_implementation="sdpa",
        )


def rung(k: int, s: argparse.Namespace) -> Shape:
    """Rung k of the ladder: hidden s.unit x k, k layers, hidden / head_dim heads."""
    hidden = s.unit * k
    inter = s.inter_multiple * math.ceil(8 * hidden / 3 / s.inter_multiple)
    return Shape(hidden, k, max(1, hidden // s.head_dim), inter, s.vocab)


# ------------------------------------------------------------------------------------ configs and fit
def engine_config(
    name: str, s: argparse.Namespace, nvme_dir: str, micro: int, accum: int, shape: Shape, ratio: float = 1.0
) -> Dict[str, Any]:
    """The DeepSpeed-style config of configuration `name` (not plain torch)."""
    stage, opt, par = CONFIGS[name]  # type: ignore[misc]
    zo: Dict[str, Any] = {"stage": stage, "sub_group_size": s.sub_group}
    off: Dict[str, Any] = {"device": opt}
    if opt == "nvme":
        off.update(nvme_path=nvme_dir, buffer_count=4)
    if ratio != 1.0:
        off["ratio"] = ratio
    zo["offload_optimizer"] = off
    if stage == 3:
        zo["stage3_param_persistence_threshold"] = 0
        if par != "none":
            p: Dict[str, Any] = {"device": par}
            if par == "nvme":  # every partition in its swap file; buffers hold the largest layer
                p.update(nvme_path=nvme_dir, max_in_cpu=0, buffer_count=5)
                p["buffer_size"] = max(100_000_000, shape.largest_layer)
            zo["offload_param"] = p
    conf: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": zo,
    }
    if name.endswith(DELAYED):
        conf["zero_offload"] = {"delayed_update": {"enabled": True, "warmup_steps": 1}}
    return conf


def activations(shape: Shape, micro: int, seq: int, ckpt: bool) -> Any:
    """The estimator's activation settings for this shape, micro-batch and sequence."""
    from offload.estimate import ActivationSettings

    return ActivationSettings(
        batch_size=micro,
        seq_len=seq,
        hidden_size=shape.hidden,
        num_layers=shape.layers,
        checkpointing=ckpt,
        num_heads=shape.heads,
        vocab_size=shape.vocab,
    )


def estimate_row(name: str, shape: Shape, s: argparse.Namespace, act: Any, machine: Any) -> Dict[str, Any]:
    """The estimator's bytes for `name` at `shape` and whether they fit `machine`."""
    from offload.estimate import (
        SwapBufferSettings,
        TrainingSetup,
        activation_bytes,
        check_fit,
        estimate,
    )

    if CONFIGS[name] is None:  # plain torch: the estimator has no pure-bf16 row; 8 B/param + activations
        gpu = TORCH_BYTES_PER_PARAM * shape.params + activation_bytes(act, 2)
        return {"per_gpu_bytes": gpu, "per_cpu_bytes": 0, "nvme_bytes": 0, "fits": gpu <= machine.gpu_bytes}
    stage, opt, par = CONFIGS[name]  # type: ignore[misc]
    bufs = SwapBufferSettings(
        sub_group_size=s.sub_group,
        param_max_in_cpu=0,
        param_buffer_size=max(100_000_000, shape.largest_layer),
    )
    setup = TrainingSetup(
        shape.params, shape.largest_layer, precision="bf16", optimizer="adamw", buffers=bufs, activations=act
    )
    est = estimate(setup, stage, opt, par, nvme_free_bytes=machine.nvme_free_bytes)
    fit = check_fit(est, machine)
    return {
        "per_gpu_bytes": est.per_gpu_bytes,
        "per_cpu_bytes": est.per_cpu_bytes,
        "nvme_bytes": est.nvme_min_bytes,
        "fits": fit.fits,
    }


def largest_rung(name: str, s: argparse.Namespace, machine: Any) -> Tuple[int, Dict[str, Any]]:
    """The largest rung the estimate fits on `machine` (0 when none), with its estimate."""
    best, row = 0, {}
    for k in range(1, s.max_rung + 1):
        shape = rung(k, s)
        r = estimate_row(name, shape, s, activations(shape, s.micro, s.seq, False), machine)
        if not r["fits"]:
            break
        best, row = k, r
    return best, row


def stage0_bytes(shape: Shape) -> int:
    """The estimator's training state at stage 0 without offload (bf16, AdamW), activations not counted."""
    from offload.estimate import TrainingSetup, estimate

    setup = TrainingSetup(shape.params, shape.largest_layer, precision="bf16", optimizer="adamw")
    return estimate(setup, 0).per_gpu_bytes


def fmt_params(n: int) -> str:
    """A parameter count as 1.23B or 4.56M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
