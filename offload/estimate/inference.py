"""Memory of an engine without an optimizer (ZeRO-Inference, docs/inference.md): the weights on each tier,
the KV cache of a generation, and the NVMe prefetch buffers. `ds-estimate-memory --inference` prints these
rows (docs/estimator.md, "Inference").

The rows follow what the stage-3 engine allocates for one rank (zero/stage3/store.py):

* one unit per module (its own parameters; a shared parameter in its first owner's unit), each rank holding
  `ceil(numel / world_size)` elements of it;
* `offload_param.device` none: every partition on the device; cpu: every partition in host memory (pinned
  when `pin_memory`), packed back to back; nvme: the units `offload.swap.resident.resident_plan` picks
  for `max_in_cpu` elements stay in host memory, every other one gets a swap file of its partition's bytes
  rounded up to 4 KiB, and `buffer_count` pinned staging buffers of
  min(`buffer_size` elements, the largest NVMe partition) serve the reads (the prefetch depth);
* on the device: units under `stage3_param_persistence_threshold` elements stay whole once used (up to
  `stage3_model_persistence_threshold` elements in all), plus the one unit being computed (the largest);
* the KV cache: keys and values for every layer, `2 x layers x batch x kv_heads x seq x head_dim` elements
  of the compute dtype, on the device (transformers' DynamicCache);
* on a GPU, one rank: the partitions held in host memory are copied to the device ahead of their use, as
  far as `stage3_prefetch_bucket_size` elements of the units that follow the one in use (NVMe units count
  against the bucket too, persistent ones do not, a unit larger than what is left ends the window): the
  row is the largest such window's host-memory bytes (0 when the CPU computes).

Quantized weights (`weight_quantization.quantized_initialization.num_bits`, `group_size`) are counted as
`num_bits` bits per element plus `QUANT_GROUP_BYTES` per group of `group_size` elements (a 16-bit scale and
a 16-bit offset), the unit being computed dequantized to the compute dtype.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from offload.config.zero import ZeroConfig
from offload.swap.resident import resident_plan

from .errors import EstimateInputError
from .setup import SwapBufferSettings
from .units import format_bytes, format_count

__all__ = [
    "InferenceEstimate",
    "InferenceSetup",
    "KVCacheShape",
    "QUANT_GROUP_BYTES",
    "estimate_inference",
    "inference_choices",
    "kv_cache_shape",
    "render_inference",
    "unit_numels",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SWAP_ALIGNMENT = 4096  # swap files are allocated in whole 4 KiB blocks (offload.swap.space)
QUANT_GROUP_BYTES = 4  # per quantization group: a 16-bit scale and a 16-bit offset
DEFAULT_PERSISTENCE_THRESHOLD = ZeroConfig.stage3_param_persistence_threshold
DEFAULT_MODEL_PERSISTENCE = ZeroConfig.stage3_model_persistence_threshold
DEFAULT_PREFETCH_BUCKET = ZeroConfig.stage3_prefetch_bucket_size


@dataclass(frozen=True)
class KVCacheShape:
    """What the KV cache's size depends on (from a Hugging Face config.json or flags)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def numel(self, batch: int, seq: int) -> int:
        """Elements of keys and values of every layer for `batch` sequences of `seq` positions."""
        return 2 * self.num_layers * batch * self.num_kv_heads * seq * self.head_dim


def kv_cache_shape(config: Dict[str, Any], where: str = "config.json") -> KVCacheShape:
    """The KV cache shape of a Hugging Face config: layers, key/value heads (`num_key_value_heads`, else the
    attention heads), head dim (`head_dim`, else hidden size / heads); EstimateInputError naming what is
    missing."""

    def first(*keys: str) -> Optional[int]:
        for k in keys:
            v = config.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None

    layers = first("num_hidden_layers", "n_layer", "num_layers")
    heads = first("num_attention_heads", "n_head", "num_heads")
    hidden = first("hidden_size", "n_embd", "d_model")
    if layers is None or heads is None:
        raise EstimateInputError(f"{where}: the KV cache needs num_hidden_layers and num_attention_heads")
    kv_heads = first("num_key_value_heads") or heads
    head_dim = first("head_dim")
    if head_dim is None:
        if hidden is None:
            raise EstimateInputError(f"{where}: the KV cache needs head_dim or hidden_size")
        head_dim = hidden // heads
    return KVCacheShape(layers, kv_heads, head_dim)


def unit_numels(model: Any) -> List[int]:
    """The stage-3 units of `model` in the order the engine places them: each module's own parameters
    (recurse=False), a parameter shared by several modules counted in its first owner only."""
    seen = set()
    out = []
    for _, module in model.named_modules():
        n = 0
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        if n:
            out.append(n)
    return out


@dataclass(frozen=True)
class InferenceSetup:
    """One inference configuration: the model's units, the tier, the buffers, the generation's shape."""

    units: Tuple[int, ...]  # elements of each stage-3 unit, in placement order
    precision: str = "bf16"  # the compute dtype (fp32, bf16, fp16)
    offload_param: str = "nvme"
    buffers: SwapBufferSettings = field(default_factory=SwapBufferSettings)
    world_size: int = 1
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD
    model_persistence_threshold: int = DEFAULT_MODEL_PERSISTENCE
    prefetch_bucket: int = DEFAULT_PREFETCH_BUCKET  # stage3_prefetch_bucket_size: elements read ahead
    weight_bits: Optional[int] = None  # quantized weights: bits per element
    group_size: int = 64
    batch_size: Optional[int] = None
    seq_len: Optional[int] = None  # prompt plus new tokens: the positions the cache holds at the end
    kv: Optional[KVCacheShape] = None
    # one rank's pinned budget, for offload_param.max_in_cpu "auto" (None: this process's, as the engine's)
    pinned_budget: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.units or any(n < 1 for n in self.units):
            raise EstimateInputError("the model has no parameters")
        if self.precision not in DTYPE_BYTES:
            raise EstimateInputError(
                f"precision must be one of {sorted(DTYPE_BYTES)}, got {self.precision!r}"
            )
        if self.offload_param not in ("none", "cpu", "nvme"):
            raise EstimateInputError(f"offload_param must be none, cpu or nvme, got {self.offload_param!r}")
        if self.weight_bits is not None and self.weight_bits not in (4, 8):
            raise EstimateInputError(f"weight bits must be 4 or 8, got {self.weight_bits!r}")
        if (self.batch_size is None) != (self.seq_len is None):
            raise EstimateInputError("the KV cache needs both the batch size and the sequence length")
        if self.batch_size is not None and self.kv is None:
            raise EstimateInputError(
                "the KV cache needs the model's layers, key/value heads and head dim (--model config.json)"
            )

    @property
    def dtype_bytes(self) -> int:
        """Bytes per weight element in the setup's precision."""
        return DTYPE_BYTES[self.precision]

    def stored_bytes(self, numel: int) -> int:
        """Bytes of `numel` elements as stored on a tier (16-bit/fp32, or quantized)."""
        if self.weight_bits is None:
            return numel * self.dtype_bytes
        return (
            math.ceil(numel * self.weight_bits / 8) + math.ceil(numel / self.group_size) * QUANT_GROUP_BYTES
        )


@dataclass
class InferenceEstimate:
    """The rows of one inference configuration: bytes per component and tier for one rank."""

    options: str
    rows: Dict[str, Dict[str, int]]  # component -> {"device", "cpu", "cpu_pinned", "nvme"}
    notes: List[str] = field(default_factory=list)

    def total(self, tier: str) -> int:
        """The bytes of every component on `tier`."""
        return sum(r.get(tier, 0) for r in self.rows.values())

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready: the rows and the totals per tier."""
        d = asdict(self)
        d["totals"] = {t: self.total(t) for t in ("device", "cpu", "cpu_pinned", "nvme")}
        return d


def _row(device: int = 0, cpu: int = 0, pinned: bool = False, nvme: int = 0) -> Dict[str, int]:
    return {"device": device, "cpu": cpu, "cpu_pinned": cpu if pinned else 0, "nvme": nvme}


def estimate_inference(setup: InferenceSetup) -> InferenceEstimate:
    """Weights per tier, the gathered working set, the prefetch buffers and the KV cache of `setup`."""
    b = setup.buffers
    tier = setup.offload_param
    parts = [math.ceil(n / setup.world_size) for n in setup.units]
    itemsize = max((setup.stored_bytes(p) // max(1, p) for p in parts), default=1)
    in_cpu = b.param_in_cpu(parts, max(1, itemsize), setup.pinned_budget) if tier == "nvme" else 0
    resident = resident_plan(parts, in_cpu) if tier == "nvme" else [True] * len(parts)
    on_nvme = [p for p, r in zip(parts, resident) if not r]
    placed_cpu = [p for p, r in zip(parts, resident) if r]
    in_host = [r and tier != "none" for r in resident]  # per unit: its partition lives in host memory
    stored = sum(setup.stored_bytes(p) for p in placed_cpu)
    pinned = b.param_pin_memory and tier != "none"
    rows: Dict[str, Dict[str, int]] = {}
    if tier == "none":
        rows["weights"] = _row(device=stored)
    else:
        nvme = sum(math.ceil(setup.stored_bytes(p) / SWAP_ALIGNMENT) * SWAP_ALIGNMENT for p in on_nvme)
        rows["weights"] = _row(cpu=stored, pinned=pinned, nvme=nvme)
    # whole on the device: persistent units (kept after their first use) and the unit being computed
    persistent, budget = 0, setup.model_persistence_threshold
    streamed = []
    kept: List[bool] = []  # per unit: persistent (gathered for good after its first use)
    for n in setup.units:
        kept.append(n < setup.persistence_threshold and n <= budget)
        if kept[-1]:
            persistent += n
            budget -= n
        else:
            streamed.append(n)
    if tier != "none" or setup.world_size > 1 or setup.weight_bits is not None:
        rows["gathered weights"] = _row(device=(persistent + max(streamed, default=0)) * setup.dtype_bytes)
    notes = []
    if on_nvme:
        slot = min(b.param_buffer_size * setup.dtype_bytes, setup.stored_bytes(max(on_nvme)))
        rows["prefetch buffers"] = _row(cpu=b.param_buffer_count * slot, pinned=True)
        notes.append(
            f"prefetch depth: up to {b.param_buffer_count} units read ahead (offload_param.buffer_count), "
            "within stage3_prefetch_bucket_size elements"
        )
    if setup.world_size == 1 and any(in_host):
        ahead = _read_ahead_bytes(setup, parts, in_host, kept)
        rows["copies ahead (GPU)"] = _row(device=ahead)
        notes.append(
            "copies ahead (GPU): host-memory partitions copied to a GPU before their use, within "
            "stage3_prefetch_bucket_size elements; 0 when the CPU computes"
        )
    if setup.kv is not None and setup.batch_size is not None and setup.seq_len is not None:
        kv = setup.kv.numel(setup.batch_size, setup.seq_len) * setup.dtype_bytes
        rows["KV cache"] = _row(device=kv)
    options = f"offload_param={tier}"
    if tier == "nvme":
        options += f", max_in_cpu={format_count(in_cpu)}"
        if b.param_max_in_cpu == "auto":
            options += " (auto)"
    if setup.weight_bits is not None:
        options += f", weights int{setup.weight_bits} (group {setup.group_size})"
        notes.append("quantized weights: the weight_quantization key needs the engine's weight quantization")
    return InferenceEstimate(options=options, rows=rows, notes=notes)


def _read_ahead_bytes(setup: InferenceSetup, parts: List[int], in_host: List[bool], kept: List[bool]) -> int:
    """The most host-memory bytes the copies ahead hold at once: over every unit in use, the units after
    it within the prefetch bucket (zero/stage3/trace.py's window), counting the host ones' stored bytes."""
    best = 0
    for start in range(len(parts)):  # start 0: a pass begins, no unit in use yet
        left, total = setup.prefetch_bucket, 0
        for i in range(start, len(parts)):
            if kept[i]:
                continue
            if parts[i] > left:
                break
            left -= parts[i]
            total += setup.stored_bytes(parts[i]) if in_host[i] else 0
        best = max(best, total)
    return best


def inference_choices(config_path: Optional[str]) -> Dict[str, Any]:
    """What `--inference` reads from a DeepSpeed-style config beyond ds_config: the persistence thresholds,
    `stage3_prefetch_bucket_size` and `weight_quantization.quantized_initialization` (num_bits,
    group_size)."""
    if config_path is None:
        return {}
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise EstimateInputError(f"--config {config_path}: {e}") from None
    zero = config.get("zero_optimization") or {}
    out: Dict[str, Any] = {}
    for key, name in (
        ("stage3_param_persistence_threshold", "persistence_threshold"),
        ("stage3_model_persistence_threshold", "model_persistence_threshold"),
        ("stage3_prefetch_bucket_size", "prefetch_bucket"),
    ):
        v = zero.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise EstimateInputError(f"--config {config_path}: zero_optimization.{key} must be >= 0")
            out[name] = int(v)
    quant = (config.get("weight_quantization") or {}).get("quantized_initialization")
    if quant is not None:
        bits, group = quant.get("num_bits", 8), quant.get("group_size", 64)
        if bits not in (4, 8) or isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise EstimateInputError(
                f"--config {config_path}: weight_quantization.quantized_initialization needs num_bits 4 or "
                f"8 and a positive group_size, got {quant!r}"
            )
        out["weight_bits"], out["group_size"] = bits, group
    return out


def render_inference(estimates: Sequence[InferenceEstimate], header_lines: Sequence[str]) -> str:
    """The inference estimates as text: a table of components per configuration."""
    lines = list(header_lines)
    for est in estimates:
        lines += ["", est.options]
        table = [["", "device", "CPU", "(pinned)", "NVMe"]]
        tiers = ("device", "cpu", "cpu_pinned", "nvme")
        totals = {t: est.total(t) for t in tiers}
        for name, r in list(est.rows.items()) + [("total", totals)]:
            table.append([name] + [format_bytes(r[t]) for t in tiers])
        widths = [max(len(row[i]) for row in table) for i in range(5)]
        for k, row in enumerate(table):
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
            lines.append(" | ".join(cells).rstrip())
            if k == 0:
                lines.append("-+-".join("-" * w for w in widths))
        lines += ["Note: " + n for n in est.notes]
    return "\n".join(lines)
