"""load_checkpoint: validate everything on every rank, agree, and only then apply."""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from offload.progress import progress
from zero.checkpoint import _state as st
from zero.checkpoint._agree import FAILED, NOTHING, OK, agree, attempt, codes, failed_ranks
from zero.checkpoint._engine import CheckpointEngine
from zero.checkpoint._files import FORMAT_VERSION, MANIFEST, PICKLED, read_manifest, verify_file, verify_size
from zero.errors import CheckpointError, CheckpointIntegrityError, CheckpointPickleError

_LEGACY_FORMAT = 1


@dataclass
class _Plan:
    """A validated checkpoint, ready to apply: nothing of the engine was touched to make it."""

    path: str
    ms: Dict[str, Any]
    rs: Dict[str, Any]
    pickled: Dict[str, Any] = field(default_factory=dict)


def _resolve(load_dir: str, tag: Optional[str]) -> Optional[str]:
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            warnings.warn(
                f"no 'latest' file in {load_dir}: nothing loaded (pass tag= to pick one)", stacklevel=4
            )
            return None
        with open(latest) as f:
            tag = f.read().strip()
    tag = st.check_tag(tag)
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        return path
    old = os.path.join(load_dir, f".{tag}.old")
    if os.path.isdir(old):  # a save of the same tag died between moving the old one aside and renaming
        return old
    raise FileNotFoundError(f"checkpoint {path} does not exist")


def _load_plain(path: str) -> Any:
    """torch.load(weights_only=True): tensors and plain types only, never code from the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointPickleError(
            f"{path}: refused to load: it holds objects that are not tensors or plain types, and loading "
            f"them could run code from the file ({st.weights_only_reason(e)})"
        ) from e
    except Exception as e:  # noqa: BLE001 - any other failure to parse the (checksummed) file
        raise CheckpointIntegrityError(f"{path}: unreadable ({type(e).__name__}: {e})") from e


def _legacy_plan(engine: CheckpointEngine, path: str, allow_pickle: bool) -> _Plan:
    if not allow_pickle:
        raise CheckpointPickleError(
            f"{path} has no {MANIFEST}: it was written by an older version of zero-offload (checkpoint "
            f"format {_LEGACY_FORMAT}: no checksums, loaded by unpickling, which can run code from the "
            "files), or its manifest is missing. If you trust it, load it with allow_pickle=True and save "
            f"it again to convert it to format {FORMAT_VERSION}."
        )
    ms = torch.load(os.path.join(path, "model_states.pt"), map_location="cpu", weights_only=False)
    if ms.get("format_version") != _LEGACY_FORMAT:
        raise CheckpointIntegrityError(f"{path}: format {ms.get('format_version')} but no {MANIFEST}")
    rank_file = os.path.join(path, f"rank{engine.rank}_states.pt")
    if not os.path.isfile(rank_file):
        raise ValueError(f"{path}: no {os.path.basename(rank_file)}: saved by {ms['world_size']} rank(s)")
    rs = torch.load(rank_file, map_location="cpu", weights_only=False)
    return _Plan(path, ms, rs)


def _check_meta(engine: CheckpointEngine, plan: _Plan, strict: bool, optimizer: bool) -> None:
    """Every check that does not need the big files; raises ValueError on a mismatch."""
    path, ms, rs = plan.path, plan.ms, plan.rs
    if ms.get("format_version") not in (FORMAT_VERSION, _LEGACY_FORMAT):
        raise ValueError(f"{path}: checkpoint format {ms.get('format_version')}, expected {FORMAT_VERSION}")
    if engine.optimizer is not None and ms["numel"] != st.trainable_numel(engine):
        raise ValueError(
            f"{path}: checkpoint has {ms['numel']} trainable elements, the model {st.trainable_numel(engine)}"
        )
    saved3, mine3 = ms.get("stage", 0) == 3, st.is_stage3(engine)
    if saved3 != mine3:
        raise ValueError(
            f"{path}: saved at stage {ms.get('stage')}, this engine runs stage {engine.stage}: export with "
            "zero.consolidated_state_dict / save_16bit_model to move between stage 3 and stages 0-2"
        )
    excluded = bool(ms.get("exclude_frozen_parameters", False))
    st.check_module_state(engine, ms["module"], strict, path, excluded)
    if mine3:
        if ms["world_size"] != engine.world_size:
            raise ValueError(
                f"{path}: saved by {ms['world_size']} rank(s), this run has {engine.world_size}: stage-3 "
                "partitions cannot be mapped"
            )
        st.check_units(engine, rs["stage3_units"], path, excluded)
    if optimizer:
        meta = rs["optimizer"]
        if ms["world_size"] != engine.world_size or st.partition_of(meta) != (engine.lo, engine.hi):
            raise ValueError(
                f"{path}: saved by {ms['world_size']} rank(s) (partition {st.partition_of(meta)}); "
                f"this run has {engine.world_size} (partition {(engine.lo, engine.hi)}): optimizer states "
                "cannot be mapped"
            )
        if meta["rule"] != engine.rule.kind:
            raise ValueError(
                f"{path}: optimizer states are for {meta['rule']}, this engine runs {engine.rule.kind}"
            )
        engine.optimizer.check_hyperparameters(meta["param_groups"], path)


def _needed_pickled(ms: Dict[str, Any], scheduler: bool) -> List[str]:
    keys = list(ms.get("pickled", []))
    return [k for k in keys if k != "lr_scheduler" or scheduler]


def _plan(
    engine: CheckpointEngine, path: str, strict: bool, optimizer: bool, scheduler: bool, allow_pickle: bool
) -> _Plan:
    """Read and check everything this rank needs; the engine is not touched."""
    manifest = read_manifest(path)
    if manifest is None:
        plan = _legacy_plan(engine, path, allow_pickle)
        _check_meta(engine, plan, strict, optimizer)
        if optimizer:
            size = os.path.getsize(os.path.join(path, f"optim_rank{engine.rank}.bin"))
            need = st.optimizer_nbytes(engine, st.saved_state_dtype(plan.rs["optimizer"]))
            if size != need:
                raise ValueError(
                    f"{path}: optim_rank{engine.rank}.bin has {size} bytes, this model and "
                    f"optimizer need {need}"
                )
        if st.is_stage3(engine):
            size = os.path.getsize(os.path.join(path, f"param_rank{engine.rank}.bin"))
            excluded = bool(plan.ms.get("exclude_frozen_parameters", False))
            if size != st.check_units(engine, plan.rs["stage3_units"], path, excluded):
                raise ValueError(f"{path}: param_rank{engine.rank}.bin has {size} bytes, not this model's")
        return plan
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {manifest.get('format_version')}, this version reads {FORMAT_VERSION}"
        )
    listed = manifest["files"]
    r = engine.rank
    rank_name = f"rank{r}_states.pt"
    if rank_name not in listed:
        raise ValueError(
            f"{path}: no {rank_name}: saved by {manifest.get('world_size')} rank(s), this run has "
            f"{engine.world_size}"
        )
    for name in ("model_states.pt", rank_name):
        if name not in listed:
            raise CheckpointIntegrityError(f"{path}: {MANIFEST} does not list {name}")
        verify_file(os.path.join(path, name), listed[name])
    plan = _Plan(path, _load_plain(os.path.join(path, "model_states.pt")), {})
    plan.rs = _load_plain(os.path.join(path, rank_name))
    _check_meta(engine, plan, strict, optimizer)
    big = []
    if optimizer:
        big.append(f"optim_rank{r}.bin")
    if st.is_stage3(engine):
        big.append(f"param_rank{r}.bin")
    pickled = _needed_pickled(plan.ms, scheduler)
    if pickled:
        if not allow_pickle:
            raise CheckpointPickleError(
                f"{path}: the {' and '.join(pickled)} of this checkpoint "
                f"hold{'s' if len(pickled) == 1 else ''} Python objects that only pickle can restore "
                f"({PICKLED}), and unpickling can run code from the file. If you trust this checkpoint, "
                "pass allow_pickle=True to load_checkpoint."
            )
        big.append(PICKLED)
    for name in big:
        if name not in listed:
            raise CheckpointIntegrityError(f"{path}: {MANIFEST} does not list {name}")
    expected = {}
    if optimizer:
        saved_dtype = st.saved_state_dtype(plan.rs["optimizer"])
        expected[f"optim_rank{r}.bin"] = st.optimizer_nbytes(engine, saved_dtype)
    if st.is_stage3(engine):
        excluded = bool(plan.ms.get("exclude_frozen_parameters", False))
        expected[f"param_rank{r}.bin"] = st.check_units(engine, plan.rs["stage3_units"], path, excluded)
    for name in big:  # sizes first: a truncated file is found without reading the others
        verify_size(os.path.join(path, name), listed[name])
        if name in expected and listed[name]["size"] != expected[name]:
            raise ValueError(
                f"{path}: {name} has {listed[name]['size']} bytes, this model and optimizer need "
                f"{expected[name]}"
            )
    with progress("load_checkpoint: verifying", sum(int(listed[n]["size"]) for n in big), rank=r) as bar:
        for name in big:
            verify_file(os.path.join(path, name), listed[name], on_read=bar.update)
    if pickled:
        plan.pickled = torch.load(os.path.join(path, PICKLED), map_location="cpu", weights_only=False)
    return plan


def _apply(engine: CheckpointEngine, plan: _Plan, strict: bool, optimizer: bool, scheduler: bool) -> None:
    path, ms, rs = plan.path, plan.ms, plan.rs
    engine.zero_grad()  # also stops an optimizer pass that backward started: it would use stale state
    with torch.no_grad():
        if st.is_stage3(engine):
            engine.module.load_state_dict(ms["module"], strict=False)
            excluded = bool(ms.get("exclude_frozen_parameters", False))
            st.read_params(engine, os.path.join(path, f"param_rank{engine.rank}.bin"), excluded)
        else:  # a checkpoint without the frozen parameters: the module keeps its own
            frozen_excluded = bool(ms.get("exclude_frozen_parameters", False))
            engine.module.load_state_dict(ms["module"], strict=strict and not frozen_excluded)
    if optimizer:
        meta = rs["optimizer"]
        st.read_optimizer(
            engine, os.path.join(path, f"optim_rank{engine.rank}.bin"), st.saved_state_dtype(meta)
        )
        engine.optimizer.load_hyperparameters(meta["param_groups"], path)
        engine.optimizer.step_count = int(meta["step"])
        if engine.loss_scaler is not None and ms["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(ms["loss_scaler"])
    sched = plan.pickled["lr_scheduler"] if "lr_scheduler" in plan.pickled else ms["lr_scheduler"]
    if scheduler and engine.lr_scheduler is not None and sched is not None:
        engine.lr_scheduler.load_state_dict(sched)
    engine.global_steps = int(ms["global_steps"])
    engine.global_samples = int(ms["global_samples"])
    engine.micro_steps = int(ms["micro_steps"])
    engine.skipped_steps = int(ms["skipped_steps"])
    engine.zero_grad()
    st.set_rng_state(rs["rng"])
    if optimizer:
        engine.mark_state_restored()
        if not engine.config.zero_optimization.load_from_fp32_weights:
            # DeepSpeed's load_from_fp32_weights: false - the master from the (16-bit) module weights
            engine.sync_master_from_module()
    else:
        engine.sync_master_from_module()  # the master would otherwise overwrite the loaded weights


def load_checkpoint(
    engine: CheckpointEngine,
    load_dir: str,
    tag: Optional[str] = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    *,
    allow_pickle: bool = False,
) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """Restore `engine` from `load_dir/tag` (or `latest`): (path, client_state), (None, None) if none.

    Every rank first checks everything it needs (manifest, checksums, sizes, metadata); the ranks agree,
    and only then is anything applied, so a bad checkpoint leaves every engine as it was. `allow_pickle`:
    also load what only pickle can restore (a client_state of arbitrary objects, format-1 checkpoints);
    unpickling can run code from the files, so pass it only for checkpoints you trust. An engine without
    an optimizer (inference) loads the module's weights and counters only, checked by key and shape.
    """
    engine.check_open()
    training = engine.optimizer is not None  # else an inference engine: weights and counters only
    optimizer = load_optimizer_states and not load_module_only and training
    scheduler = load_lr_scheduler_states and not load_module_only and training
    path = None

    def plan() -> Optional[_Plan]:
        nonlocal path
        path = _resolve(os.path.abspath(load_dir), tag)
        if path is None:
            return None
        return _plan(engine, path, load_module_strict, optimizer, scheduler, allow_pickle)

    result, err = attempt(plan)
    votes = codes(engine, FAILED if err is not None else NOTHING if result is None else OK)
    if err is not None:
        raise err
    if failed_ranks(votes):
        raise CheckpointError(
            f"checking checkpoint {path} failed on {failed_ranks(votes)} (its error says why); nothing was "
            f"loaded on rank {engine.rank} either"
        )
    if result is None or any(v == NOTHING for v in votes):
        if result is not None or any(v == OK for v in votes):
            raise CheckpointError(f"the ranks disagree on whether {load_dir} holds a checkpoint ('latest')")
        return None, None

    def apply() -> None:
        try:
            _apply(engine, result, load_module_strict, optimizer, scheduler)
        except BaseException as e:
            engine.poison_state(e)
            raise

    _, err = attempt(apply)
    try:
        agree(engine, err, f"applying checkpoint {result.path}")
    except CheckpointError as e:
        if err is None:  # this rank is loaded, another is not: together they are not a usable state
            engine.poison_state(e)
        raise
    client = result.pickled["client_state"] if "client_state" in result.pickled else result.ms["client_state"]
    return result.path, client
