"""`zero.from_pretrained`: a Hugging Face checkpoint streamed into stage-3 partitions, one shard at a time.

The model is built from the checkpoint's config.json as `AutoModelForCausalLM.from_config` builds it, with
its parameters on the meta device (buffers are real: rotary tables and the like are computed as usual), so
no weight exists in memory (zero.inference.weight_plan). The checkpoint's files are opened once, relative
to the directory's descriptor, and their headers read from those descriptors
(zero.inference.checkpoint_files). The stage-3 partitioner then gives every module's parameters an empty
partition on the configured tier (`zero_optimization.offload_param`). On NVMe, a partition whose tensors
need no conversion is served straight from the checkpoint's files (zero.inference.serving: nothing is
copied); every other one is filled from the files in turn (`safe_open` on the held descriptor,
memory-mapped), module by module: a partition is assembled in one buffer of its own size and written to
its tier (in place for the memory tiers, one write for a swap file). At any moment the process holds at
most the pages of the file being read and one module's partition. The engine is then built by
`zero.initialize` around the already partitioned model (as for a model built under `zero.Init`).

Everything that can be checked before a byte of weights is read is checked first, from the config and the
safetensors headers alone: the files exist and are complete, every checkpoint tensor has the shape of its
parameter, every parameter has a tensor. Errors name the file, the tensor and the sizes; the partitions and
swap files made before a later failure are removed (docs/inference.md, "Loading a checkpoint").

Over 500 lines in one module because the dtype rule, the swap cache's inputs, the copies and the two
public entry points share one failure path: each step's error must free what the earlier steps made.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from offload.config import ZeroOffloadConfig
from offload.progress import progress
from zero.inference.checkpoint_files import (
    INDEX_FILE,
    MAX_HEADER_BYTES,
    SINGLE_FILE,
    CheckpointTensor,
    PretrainedCheckpointError,
    open_files,
    proc_path,
    scan_headers,
    weight_files,
)
from zero.inference.hub import HUB_KWARGS, checkpoint_dir
from zero.inference.serving import PartitionServer, serve_decision
from zero.inference.weight_plan import WeightPlan, parameters_on_meta, plan_weights, renamer
from zero.stage3.served import CheckpointFds

if TYPE_CHECKING:
    from zero.engine.engine import ZeroEngine
    from zero.stage3.partitioner import Stage3Partitioner
    from zero.stage3.swap_cache import SwapCache

__all__ = [
    "MAX_HEADER_BYTES",
    "LoadReport",
    "PretrainedCheckpointError",
    "from_pretrained",
    "partitioned_model",
]

logger = logging.getLogger("zero")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# from_pretrained arguments about placement or quantization: the config's offload_param places the weights
_REFUSED_KWARGS = ("device_map", "max_memory", "offload_folder", "quantization_config", "tp_plan")


@dataclass(frozen=True)
class LoadReport:
    """What `from_pretrained` did (`engine.load_report`). `swap_cache`: "built" (the swap files were
    written into a persistent cache), "reused" (an earlier run's cache was used: no tensor of a unit on
    NVMe was read, no swap file written), None (no cache: private scratch swap). `checkpoint_bytes_read`:
    tensor bytes read from the safetensors files while loading; `swap_bytes_written`: bytes written to swap
    files; `checkpoint_bytes_served`: bytes of partitions on NVMe read straight from the checkpoint's files
    at each use, never copied (zero.inference.serving); `copy_reason`: why partitions on NVMe were copied
    into swap files instead (None when every one is served, or there is no NVMe tier)."""

    swap_cache: Optional[str]
    swap_cache_dir: Optional[str]
    checkpoint_bytes_read: int
    swap_bytes_written: int
    files: int
    seconds: float
    checkpoint_bytes_served: int = 0
    copy_reason: Optional[str] = None


# ------------------------------------------------------------------------------------------------ dtype
def _as_dtype(value: Any, what: str) -> Optional[torch.dtype]:
    if value is None or (isinstance(value, str) and value == "auto"):  # "auto": as if not given
        return None
    dtype = value if isinstance(value, torch.dtype) else _DTYPES.get(str(value).replace("torch.", ""))
    if dtype not in _DTYPES.values():
        raise ValueError(f"{what}={value!r}: the compute dtype must be torch.float32, float16 or bfloat16")
    return dtype


def _compute_dtype(dtype: Any, loaded: ZeroOffloadConfig, hf_raw: Mapping[str, Any]) -> torch.dtype:
    """dtype=, else the config's fp16/bf16, else the checkpoint's config.json dtype, else float32."""
    configured = torch.float16 if loaded.fp16.enabled else torch.bfloat16 if loaded.bf16.enabled else None
    explicit = _as_dtype(dtype, "dtype")
    if explicit is not None:
        if configured is not None and explicit != configured:
            raise ValueError(
                f"dtype={explicit} but the config enables {'fp16' if loaded.fp16.enabled else 'bf16'}: the "
                "engine computes in the config's dtype; leave dtype= out or change the config"
            )
        return explicit
    if configured is not None:
        return configured
    saved = hf_raw.get("dtype", hf_raw.get("torch_dtype"))
    return _DTYPES.get(str(saved).replace("torch.", ""), torch.float32)


def _with_dtype(raw: Mapping[str, Any], dtype: torch.dtype) -> Dict[str, Any]:
    """A copy of the config whose fp16/bf16 section enables `dtype` (the engine computes in that)."""
    out = copy.deepcopy(dict(raw))
    if dtype != torch.float32:
        key = ("fp16",) if dtype == torch.float16 else ("bfloat16",) if "bfloat16" in out else ("bf16",)
        out[key[0]] = {**dict(out.get(key[0]) or {}), "enabled": True}
    return out


# ------------------------------------------------------------------------------------------- swap cache
def _cache_root(swap_cache: Union[bool, str, os.PathLike], loaded: ZeroOffloadConfig) -> Optional[str]:
    """Where the cache lives (None: no cache); refuses what it cannot serve before any weight is read."""
    from offload.swap.space import check_nvme_path

    if swap_cache is False or swap_cache is None:
        return None
    if loaded.optimizer is not None:
        raise ValueError(
            "swap_cache= is for inference engines: the config has an optimizer block, and training writes "
            "the weights back into their swap files; leave swap_cache out or drop the optimizer"
        )
    off = loaded.zero_optimization.offload_param
    if off is None or off.device != "nvme":
        raise ValueError(
            "swap_cache= keeps the parameter swap files between runs and needs "
            f"zero_optimization.offload_param.device='nvme', got {None if off is None else off.device!r}"
        )
    return check_nvme_path(os.fspath(off.nvme_path or "") if swap_cache is True else os.fspath(swap_cache))


def _cache_inputs(
    root: str,
    files: List[str],
    compute: torch.dtype,
    loaded: ZeroOffloadConfig,
    world_size: int,
    rank: int,
    hf_kwargs: Mapping[str, Any],
    key_mapping: Optional[Dict[str, str]],
) -> Dict[str, Any]:
    """Everything that decides the names and bytes of this rank's swap files (the cache's fingerprint)."""
    import dataclasses
    import hashlib

    import transformers

    from offload import __version__
    from offload.swap.resident import RESIDENT_PLAN_VERSION

    def stat_of(path: str) -> List[Any]:
        st = os.stat(path)
        return [os.path.basename(path), st.st_size, st.st_mtime_ns]

    with open(os.path.join(root, "config.json"), "rb") as f:
        config_sha = hashlib.sha256(f.read()).hexdigest()
    index = os.path.join(root, INDEX_FILE)
    return {
        "package": __version__,
        "transformers": transformers.__version__,
        "checkpoint": os.path.realpath(root),
        "files": [stat_of(f) for f in sorted(files)] + ([stat_of(index)] if os.path.isfile(index) else []),
        "config_json_sha256": config_sha,
        "dtype": str(compute),
        "weight_quantization": json.loads(json.dumps(dataclasses.asdict(loaded.weight_quantization))),
        "world_size": world_size,
        "rank": rank,
        "max_in_cpu": _max_in_cpu_key(loaded),
        "resident_plan": RESIDENT_PLAN_VERSION,
        "hf_kwargs": {k: repr(v) for k, v in sorted(hf_kwargs.items())},
        "key_mapping": dict(key_mapping) if key_mapping else None,
    }


def _max_in_cpu_key(loaded: ZeroOffloadConfig) -> Any:
    """offload_param.max_in_cpu for the fingerprint: a count, or "auto" with the pinned budget it resolves
    against (zero.stage3.placement): another budget may keep other partitions in RAM."""
    from offload.pinned import default_pinned_budget

    value = loaded.zero_optimization.offload_param.max_in_cpu
    if value == "auto":
        return f"auto:{default_pinned_budget(loaded.zero_offload.pinned_budget_bytes)}"
    return int(value)


# ------------------------------------------------------------------------------------------- streaming
def _stream(
    part: Stage3Partitioner,
    model: nn.Module,
    plan: WeightPlan,
    skip: Optional[Callable[[Any], bool]] = None,
    *,
    tensors: Mapping[str, CheckpointTensor],
    desc: str,
    rank: int,
    held: CheckpointFds,
) -> int:
    """Copy every planned tensor into its partition (or buffer), file by file, except those of the units
    `skip(unit)` is true for (their partitions hold their values already), reading the files `held` open;
    returns bytes read. A progress
    bar `desc` (offload.progress) counts the bytes read against the headers' `tensors`."""
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    wanted = {k: v for k, v in plan.params.items() if skip is None or not skip(params[v[1]].ds_unit)}
    files = sorted({f for f, _ in wanted.values()} | {f for f, _ in plan.buffers.values()})
    written: set = set()  # units whose partition already holds some values (the rest start as zeros)
    nbytes = 0
    bar = progress(desc, _planned_bytes(tensors, [*wanted, *plan.buffers]), rank=rank)
    for file in files:
        by_unit: Dict[int, List[Tuple[str, int]]] = {}
        for key, (f, name) in wanted.items():
            if f == file:
                p = params[name]
                by_unit.setdefault(p.ds_unit.index, []).append((key, p.ds_index))
        key: Optional[str] = None
        try:
            with safe_open(proc_path(held, file), framework="pt") as f:  # the file checked, held open
                for index in sorted(by_unit):
                    unit = part.units[index]
                    in_place = part.memory_partition(unit) is not None  # raw, in memory
                    if in_place:
                        values = part.read_partition(unit)  # the partition itself: filled in place
                    elif index in written:
                        values = part.read_partition(unit, torch.empty(unit.part_numel, dtype=unit.dtype))
                    else:
                        values = torch.zeros(unit.part_numel, dtype=unit.dtype)
                    for key, i in by_unit[index]:
                        flat = f.get_tensor(key).reshape(-1)  # a view of the mapped file
                        lo, hi = unit.share(i)
                        at = unit.part_offsets[i]
                        values[at : at + hi - lo].copy_(flat[lo:hi])
                        nbytes += flat.numel() * flat.element_size()
                        bar.update(flat.numel() * flat.element_size())
                        del flat
                    if part.codec(unit) is not None and index in written:
                        # quantized: encode only this file's parameters (the others are not rounded twice)
                        part.write_partition(unit, values, only={i for _, i in by_unit[index]})
                    elif not in_place:
                        part.write_partition(unit, values)  # a swap file, or quantized: encoded as written
                    written.add(index)
                    del values
                for key, (fname, name) in plan.buffers.items():
                    if fname == file:
                        with torch.no_grad():
                            t = f.get_tensor(key)
                            buffers[name].copy_(t)
                            nbytes += t.numel() * t.element_size()
                            bar.update(t.numel() * t.element_size())
        except (OSError, MemoryError):
            bar.close()
            raise
        except Exception as e:
            bar.close()
            what = f"reading tensor {key!r}" if key is not None else "opening it"
            raise PretrainedCheckpointError(f"{file}: {what} failed: {e}") from e
    bar.close()
    return nbytes


def _planned_bytes(tensors: Mapping[str, CheckpointTensor], keys: Any) -> int:
    """Bytes of the checkpoint tensors `keys` (the progress bar's total), from the headers' shapes."""
    return sum(tensors[k].nbytes for k in keys if k in tensors)


# ---------------------------------------------------------------------------------------------- public
def partitioned_model(
    path: Union[str, os.PathLike],
    config: Union[str, os.PathLike, Dict[str, Any]],
    dtype: Optional[Union[torch.dtype, str]] = None,
    **hf_kwargs: Any,
) -> nn.Module:
    """The causal LM of the Hugging Face checkpoint directory `path`, its weights streamed into stage-3
    partitions one safetensors file at a time, without an engine: the model as a `zero.Init` block leaves
    it. `zero.initialize(model=...)` - or a `zero.integrations.transformers.ZeroTrainer` - takes its
    partitions over; give it a config with the same compute dtype (fp16/bf16 section). Arguments, dtype
    rule and errors as `from_pretrained`; the model is in train mode, as transformers builds it. Its
    partitions live until the engine that takes it over is closed (or the process exits)."""
    return _load(path, config, dtype, hf_kwargs)[0]


def _load(
    path: Union[str, os.PathLike],
    config: Union[str, os.PathLike, Dict[str, Any]],
    dtype: Optional[Union[torch.dtype, str]],
    hf_kwargs: Dict[str, Any],
    swap_cache: Union[bool, str, os.PathLike] = False,
    serve: Union[bool, str] = False,
) -> Tuple[nn.Module, Dict[str, Any], Stage3Partitioner, LoadReport]:
    """(partitioned model, the config with its compute dtype enabled, its partitioner, what the load did):
    from_pretrained. The checkpoint's files are held open for the load (the store keeps its own
    descriptors of those it serves partitions from)."""
    held = CheckpointFds()
    try:
        return _load_held(held, path, config, dtype, hf_kwargs, swap_cache, serve)
    finally:
        held.close()


def _load_held(
    held: CheckpointFds,
    path: Union[str, os.PathLike],
    config: Union[str, os.PathLike, Dict[str, Any]],
    dtype: Optional[Union[torch.dtype, str]],
    hf_kwargs: Dict[str, Any],
    swap_cache: Union[bool, str, os.PathLike],
    serve: Union[bool, str],
) -> Tuple[nn.Module, Dict[str, Any], Stage3Partitioner, LoadReport]:
    import transformers

    from offload.config import ConfigError, load_config
    from offload.config._reader import read_json_file
    from zero.accelerator import compute_device
    from zero.engine.engine import init_distributed
    from zero.stage3.partitioner import Stage3Partitioner
    from zero.stage3.swap_cache import SwapCacheMismatch, open_swap_cache

    start = time.monotonic()
    root = checkpoint_dir(path, {k: hf_kwargs.pop(k) for k in HUB_KWARGS if k in hf_kwargs})
    config_json = os.path.join(root, "config.json")
    if not os.path.isfile(config_json):
        raise FileNotFoundError(
            errno.ENOENT,
            f"{root}: no config.json (a Hugging Face checkpoint directory holds config.json and "
            f"{SINGLE_FILE} or {INDEX_FILE} with its shards)",
            config_json,
        )
    refused = [k for k in _REFUSED_KWARGS if k in hf_kwargs]
    if refused:
        raise ValueError(
            f"zero.from_pretrained does not take {', '.join(refused)}: the config's "
            "zero_optimization.offload_param places the weights"
        )
    if dtype is None and "torch_dtype" in hf_kwargs:
        dtype = hf_kwargs.pop("torch_dtype")
    key_mapping = hf_kwargs.pop("key_mapping", None)
    files, index_map = weight_files(root)
    open_files(root, files, held)  # once, relative to the directory's fd; every later read uses them
    tensors = scan_headers(files, index_map, held)

    rank, world_size, local_rank = init_distributed()
    raw = read_json_file(os.fspath(config)) if isinstance(config, (str, os.PathLike)) else config
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a dict or the path of a JSON file, got {type(config).__name__}")
    loaded = load_config(raw, world_size)
    if int(loaded.zero_optimization.stage) != 3:
        raise ConfigError(
            f"zero.from_pretrained streams the weights into stage-3 partitions and needs "
            f"zero_optimization.stage=3, got {loaded.zero_optimization.stage}; at stages 0-2 every rank "
            "holds the whole model: load it with transformers and pass it to zero.initialize"
        )
    with open(config_json, encoding="utf-8") as f:
        compute = _compute_dtype(dtype, loaded, json.load(f))
    raw = _with_dtype(raw, compute)
    loaded = load_config(raw, world_size)
    if loaded.weight_quantization.enabled and loaded.optimizer is not None:
        from zero.inference.parts import refuse_weight_quantization

        refuse_weight_quantization(loaded)  # before any weight is read

    cache_root = _cache_root(swap_cache, loaded)  # checked before any weight is read
    serving, copy_reason = serve_decision(serve, loaded, held, cache_root is not None)  # the rule
    trust = {k: hf_kwargs[k] for k in ("trust_remote_code",) if k in hf_kwargs}
    hf_config = transformers.AutoConfig.from_pretrained(root, **trust)

    def build() -> Tuple[nn.Module, WeightPlan]:
        with parameters_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=compute, **hf_kwargs)
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != compute:  # e.g. modules a model keeps in fp32
                p.data = p.data.to(compute)
        return model, plan_weights(model, tensors, renamer(model, key_mapping))

    model, plan = build()  # every check of the checkpoint against the model: before the cache is opened
    cache: Optional[SwapCache] = None
    inputs: Dict[str, Any] = {}
    if cache_root is not None:
        inputs = _cache_inputs(root, files, compute, loaded, world_size, rank, hf_kwargs, key_mapping)
        inputs["serve_checkpoint"] = serving  # served partitions have no swap file in the cache
        cache = open_swap_cache(cache_root, inputs)
    while True:
        part: Optional[Stage3Partitioner] = None
        reused = cache is not None and cache.reused
        server: Optional[PartitionServer] = None
        try:
            part = Stage3Partitioner(loaded, device=compute_device(local_rank))
            if serving:  # partitions read straight from the checkpoint where no conversion is needed
                direct = held.for_direct_io()
                server = PartitionServer(model, plan, tensors, direct)
                part.serve_from(direct, server)  # the partitioner closes `direct`
            if cache is not None:
                part.use_swap_space(cache)  # the partitioner closes it
            if loaded.weight_quantization.enabled:  # each selected weight is quantized as it streams in
                from zero.stage3.quant import quantization_plan

                part.set_quantization(quantization_plan(model, loaded.weight_quantization))
            part.partition_model(model)  # zero partitions; the pinned budget is checked here
            if cache is not None and reused:
                cache.check_complete()
            # reusing: the swap files hold their units' values; only the partitions in memory are read
            desc = "zero.from_pretrained: " + (
                "building the swap cache" if cache is not None and not reused else "loading"
            )
            skip = part.on_nvme if reused else part.served if serving else None
            nbytes = _stream(part, model, plan, skip, tensors=tensors, desc=desc, rank=rank, held=held)
            if cache is not None:
                cache.seal()  # every file fsync'd, then the manifest: complete from here on
            break
        except BaseException as e:
            if part is not None:
                part.close()  # partitions, pinned buffers, swap files of this load (a cache being built too)
            if cache is not None:
                cache.close()  # a complete cache stays; its lock is released
            if not isinstance(e, SwapCacheMismatch):
                raise
            logger.warning("zero.from_pretrained: %s; rebuilding the swap cache from the checkpoint", e)
        assert cache_root is not None
        model, plan = build()  # the first model's parameters belong to the closed partitioner
        cache = open_swap_cache(cache_root, inputs, rebuild=True)
    if getattr(model, "can_generate", lambda: False)() and os.path.isfile(
        os.path.join(root, "generation_config.json")
    ):
        model.generation_config = transformers.GenerationConfig.from_pretrained(root)
    report = LoadReport(
        swap_cache=None if cache is None else "reused" if reused else "built",
        swap_cache_dir=None if cache is None else cache.dir,
        checkpoint_bytes_read=nbytes,
        swap_bytes_written=part.swap_bytes_written,
        files=len(files),
        seconds=time.monotonic() - start,
        checkpoint_bytes_served=part.served_bytes,
        copy_reason=_copy_reason(part, copy_reason, server),
    )
    logger.info(
        "zero.from_pretrained: %d tensors (%.1f MB read, %.1f MB served from the checkpoint) from %d "
        "file(s) into %d units on %s in %.1f s%s",
        len(plan.params) + len(plan.buffers),
        nbytes / 1e6,
        report.checkpoint_bytes_served / 1e6,
        len(files),
        len(part.units),
        part.tier,
        report.seconds,
        f" (swap cache {report.swap_cache}: {report.swap_cache_dir})" if cache is not None else "",
    )
    return model, raw, part, report


def _copy_reason(
    part: Stage3Partitioner, rule: Optional[str], server: Optional[PartitionServer]
) -> Optional[str]:
    """Why partitions on NVMe were copied into swap files rather than served (None: every one served)."""
    copied = [u for u in part.units if part.on_nvme(u) and not part.served(u)]
    if not copied:
        return None
    if rule is not None:
        return rule
    notes = dict(server.copied) if server is not None else {}
    quantized = sum(1 for u in copied if part.codec(u) is not None)
    if quantized:
        notes["quantized"] = quantized
    return "; ".join(f"{n} unit(s): {why}" for why, n in notes.items()) or None


def from_pretrained(
    path: Union[str, os.PathLike],
    config: Union[str, os.PathLike, Dict[str, Any]],
    dtype: Optional[Union[torch.dtype, str]] = None,
    swap_cache: Union[bool, str, os.PathLike] = False,
    serve_checkpoint: Union[bool, str] = "auto",
    **hf_kwargs: Any,
) -> ZeroEngine:
    """Build the causal LM of the Hugging Face checkpoint directory `path` straight into stage-3 partitions
    on the config's `offload_param` tier, one safetensors file at a time, and return the inference engine.

    `path`: a local directory with config.json and either model.safetensors or model.safetensors.index.json
    with its shards (transformers' save_pretrained layout), or a Hugging Face Hub repository id, resolved
    to its snapshot in the Hub cache and downloaded when missing (zero.inference.hub: only config.json,
    generation_config.json and the safetensors files; `revision=`, `token=`, `cache_dir=`,
    `local_files_only=`, `force_download=`, `proxies=` go there). The model class is the one
    `AutoModelForCausalLM` picks for config.json; `hf_kwargs` go to `AutoModelForCausalLM.from_config`
    (e.g. `attn_implementation=`, `trust_remote_code=`), except `key_mapping=` (a {regex: replacement}
    dict of checkpoint-key renames, as transformers' from_pretrained takes it). `config`: the DeepSpeed
    config (dict or JSON path) with `zero_optimization.stage` 3.

    Compute dtype: `dtype=` if given and not "auto" (it must agree with the config's fp16/bf16 section
    when one is enabled); else the config's fp16/bf16 setting; else the dtype config.json saved the weights
    in (`dtype`, or `torch_dtype` in older files) when it is float32, float16 or bfloat16; else float32.
    The config handed to the engine enables fp16/bf16 accordingly. Floating-point tensors are cast to it.

    Returns what `zero.initialize(model=..., config=...)` returns first: a `ZeroEngine` without an
    optimizer (with one if the config has an `optimizer` block), in eval mode; the Hugging Face model is
    `engine.module` (`engine.module.generate(...)`). `engine.close()` removes the swap files (not a swap
    cache's). `engine.load_report` (a `LoadReport`) says what the load read and wrote.

    `swap_cache`: True (or a directory to use instead of `offload_param.nvme_path`) keeps the parameter swap
    files in `<nvme_path>/zero-offload-cache-<uid>/<fingerprint>/` after the engine is closed, and a later
    load with the same fingerprint (checkpoint files' names, sizes and mtimes, config.json, dtype,
    quantization, world size, rank, `max_in_cpu`, hf_kwargs, package versions) reuses them without reading
    the weights they hold (zero.stage3.swap_cache; docs/inference.md, "Reusing the swap files of an earlier
    load").
    Needs `offload_param.device` "nvme" and no optimizer block (`ValueError` otherwise).

    Raises `FileNotFoundError` (no config.json, no weights, a shard the index names is missing),
    `PretrainedCheckpointError` (a truncated or corrupt shard, a tensor whose shape or dtype does not fit
    its parameter, parameters the checkpoint lacks - tied ones and the model's ignore patterns excepted),
    `ConfigError`/`ValueError` (not stage 3, a dtype that contradicts the config) before any weight is
    read, and `Stage3PinnedBudgetError` when the pinned budget cannot hold the largest layer's buffers.
    Checkpoint tensors the model does not have are skipped with a warning (logger `zero`), as
    transformers does. Whatever was partitioned before an error is freed, its swap files removed.
    """
    from zero.initialization import initialize

    model, raw, part, report = _load(path, config, dtype, hf_kwargs, swap_cache, serve_checkpoint)
    try:
        engine = initialize(model=model, config=raw)[0]  # takes the partitioner over (as after zero.Init)
    except BaseException:
        part.close()
        raise
    engine.eval()
    engine.load_report = report
    return engine
