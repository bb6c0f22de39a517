"""load_checkpoint: validate everything on every rank, agree, and only then apply.

The checkpoint's directory is held open while loading and its files are opened relative to it (regular
files only, no symlink followed; `_dir.OpenDir`); the big files are applied from the very descriptors that
were verified.
"""

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
from zero.checkpoint._check import (
    check_counters,
    check_like,
    check_loss_scaler,
    check_plan_types,
    check_rng,
    check_step,
    param_mismatch,
)
from zero.checkpoint._dir import OpenDir
from zero.checkpoint._engine import CheckpointEngine
from zero.checkpoint._files import (
    FORMAT_VERSION,
    MANIFEST,
    PICKLED,
    STAGE3_LAYOUT,
    STAGE3_LAYOUTS,
    read_manifest,
    verify_file,
    verify_size,
)
from zero.errors import CheckpointError, CheckpointIntegrityError, CheckpointPickleError

_LEGACY_FORMAT = 1


@dataclass
class _Plan:
    """A validated checkpoint, ready to apply: nothing of the engine was touched to make it."""

    d: OpenDir
    ms: Dict[str, Any]
    rs: Dict[str, Any]
    pickled: Dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return self.d.path


LATEST_MAX_BYTES = 4096  # a tag is at most 255 bytes; what else a hand-edited `latest` holds is whitespace


def read_latest(d: OpenDir) -> Optional[str]:
    """The tag `latest` in directory `d` names (None: no `latest`); bounded read, content never quoted."""
    raw = d.read_small("latest", LATEST_MAX_BYTES)
    if raw is None:
        return None
    try:
        return st.check_tag(raw.decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError):
        raise CheckpointIntegrityError(f"{d.name('latest')}: does not hold a checkpoint tag") from None


def open_tag(d: OpenDir, tag: str) -> OpenDir:
    """Checkpoint `tag` in `d`, opened; its `.<tag>.old` while a save of the same tag, killed between moving
    the old one aside and renaming, left `<tag>` missing."""
    for name in (tag, f".{tag}.old"):
        if d.kind(name) is not None:
            return OpenDir(name, d)
    raise FileNotFoundError(f"checkpoint {d.name(tag)} does not exist")


def _resolve(load_dir: str, tag: Optional[str]) -> Optional[OpenDir]:
    if tag is None and not os.path.isdir(load_dir):
        warnings.warn(f"no 'latest' file in {load_dir} (no such directory): nothing loaded", stacklevel=4)
        return None
    with OpenDir(load_dir) as d:
        if tag is None:
            tag = read_latest(d)
            if tag is None:
                warnings.warn(
                    f"no 'latest' file in {load_dir}: nothing loaded (pass tag= to pick one)", stacklevel=4
                )
                return None
        return open_tag(d, st.check_tag(tag))


def _load_plain(d: OpenDir, name: str) -> Any:
    """torch.load(weights_only=True) of held file `name`: tensors and plain types only, never code."""
    path = d.name(name)
    try:
        with os.fdopen(os.dup(d.held(name)), "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointPickleError(
            f"{path}: refused to load: it holds objects that are not tensors or plain types, and loading "
            f"them could run code from the file ({st.weights_only_reason(e)})"
        ) from e
    except Exception as e:  # noqa: BLE001 - any other failure to parse the (checksummed) file
        raise CheckpointIntegrityError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:300]})") from e


def _load_pickled(d: OpenDir, name: str) -> Any:
    """torch.load(weights_only=False) of `name` in `d` (only with allow_pickle: it runs code)."""
    if not d.holds(name):
        d.hold(name, d.open(name))
    with os.fdopen(os.dup(d.held(name)), "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=False)


def _legacy_plan(engine: CheckpointEngine, d: OpenDir, allow_pickle: bool) -> _Plan:
    path = d.path
    if not allow_pickle:
        raise CheckpointPickleError(
            f"{path} has no {MANIFEST}: it was written by an older version of zero-offload (checkpoint "
            f"format {_LEGACY_FORMAT}: no checksums, loaded by unpickling, which can run code from the "
            "files), or its manifest is missing. If you trust it, load it with allow_pickle=True and save "
            f"it again to convert it to format {FORMAT_VERSION}."
        )
    ms = _load_pickled(d, "model_states.pt")
    if ms.get("format_version") != _LEGACY_FORMAT:
        raise CheckpointIntegrityError(f"{path}: format {ms.get('format_version')} but no {MANIFEST}")
    rank_file = f"rank{engine.rank}_states.pt"
    if d.kind(rank_file) is None:
        raise ValueError(f"{path}: no {rank_file}: saved by {ms['world_size']} rank(s)")
    rs = _load_pickled(d, rank_file)
    return _Plan(d, ms, rs)


def _check_meta(engine: CheckpointEngine, plan: _Plan, strict: bool, optimizer: bool) -> None:
    """Every check that does not need the big files; raises ValueError on a mismatch."""
    path, ms, rs = plan.path, plan.ms, plan.rs
    if ms.get("format_version") not in (FORMAT_VERSION, _LEGACY_FORMAT):
        raise ValueError(f"{path}: checkpoint format {ms.get('format_version')}, expected {FORMAT_VERSION}")
    check_plan_types(ms, rs, optimizer, st.is_stage3(engine), path)
    layout = ms.get("stage3_layout", 1)
    if st.is_stage3(engine) and ms.get("stage") == 3 and ms["world_size"] > 1 and layout != STAGE3_LAYOUT:
        raise ValueError(
            f"{path}: stage-3 partition layout {layout} ({STAGE3_LAYOUTS.get(layout, 'unknown')}); this "
            f"version reads layout {STAGE3_LAYOUT} ({STAGE3_LAYOUTS[STAGE3_LAYOUT]}) on several ranks: "
            "convert the checkpoint with zero-to-fp32 (which reads both) and load the weights"
        )
    check_counters(ms, path)
    if engine.optimizer is not None:
        mismatch, shape = param_mismatch(ms.get("master_index"), engine.layout.master_index())
        if ms["numel"] != st.trainable_numel(engine) or shape:
            raise ValueError(
                f"{path}: checkpoint has {ms['numel']} trainable elements, the model "
                f"{st.trainable_numel(engine)}" + (f": {mismatch}" if mismatch else "")
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
        check_step(meta, engine.optimizer.group_hyperparameters(), path)
        if engine.loss_scaler is not None and ms.get("loss_scaler") is not None:
            check_loss_scaler(engine.loss_scaler, ms["loss_scaler"], path)
    check_rng(rs.get("rng"), path)


def _check_scheduler(engine: CheckpointEngine, plan: _Plan, scheduler: bool) -> None:
    sched = plan.pickled["lr_scheduler"] if "lr_scheduler" in plan.pickled else plan.ms.get("lr_scheduler")
    if scheduler and engine.lr_scheduler is not None and sched is not None:
        check_like(sched, engine.lr_scheduler.state_dict(), f"{plan.path}: the LR scheduler's state", True)


def _needed_pickled(ms: Dict[str, Any], scheduler: bool) -> List[str]:
    keys = list(ms.get("pickled", []))
    return [k for k in keys if k != "lr_scheduler" or scheduler]


def _plan(
    engine: CheckpointEngine, d: OpenDir, strict: bool, optimizer: bool, scheduler: bool, allow_pickle: bool
) -> _Plan:
    """Read and check everything this rank needs; the engine is not touched. The files applied later stay
    open in `d`."""
    path = d.path
    r = engine.rank
    manifest = read_manifest(d)
    if manifest is None:
        plan = _legacy_plan(engine, d, allow_pickle)
        _check_meta(engine, plan, strict, optimizer)
        _check_scheduler(engine, plan, scheduler)
        if optimizer:
            fd = d.hold(f"optim_rank{r}.bin", d.open(f"optim_rank{r}.bin"))
            size = os.fstat(fd).st_size
            need = st.optimizer_nbytes(engine, st.saved_state_dtype(plan.rs["optimizer"]))
            if size != need:
                raise ValueError(
                    f"{path}: optim_rank{r}.bin has {size} bytes, this model and optimizer need {need}"
                )
        if st.is_stage3(engine):
            fd = d.hold(f"param_rank{r}.bin", d.open(f"param_rank{r}.bin"))
            excluded = bool(plan.ms.get("exclude_frozen_parameters", False))
            if os.fstat(fd).st_size != st.check_units(engine, plan.rs["stage3_units"], path, excluded):
                raise ValueError(
                    f"{path}: param_rank{r}.bin has {os.fstat(fd).st_size} bytes, not this model's"
                )
        return plan
    if manifest["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {manifest['format_version']}, this version reads {FORMAT_VERSION}"
        )
    listed = manifest["files"]
    rank_name = f"rank{r}_states.pt"
    if rank_name not in listed:
        raise ValueError(
            f"{path}: no {rank_name}: saved by {manifest['world_size']} rank(s), this run has "
            f"{engine.world_size}"
        )
    for name in ("model_states.pt", rank_name):
        if name not in listed:
            raise CheckpointIntegrityError(f"{path}: {MANIFEST} does not list {name}")
        d.hold(name, verify_file(d, name, listed[name]))
    plan = _Plan(d, _load_plain(d, "model_states.pt"), _load_plain(d, rank_name))
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
        os.close(verify_size(d, name, listed[name]))
        if name in expected and listed[name]["size"] != expected[name]:
            raise ValueError(
                f"{path}: {name} has {listed[name]['size']} bytes, this model and optimizer need "
                f"{expected[name]}"
            )
    with progress("load_checkpoint: verifying", sum(int(listed[n]["size"]) for n in big), rank=r) as bar:
        for name in big:
            d.hold(name, verify_file(d, name, listed[name], on_read=bar.update))
    if pickled:
        plan.pickled = _load_pickled(d, PICKLED)
        if not isinstance(plan.pickled, dict):
            raise CheckpointIntegrityError(f"{d.name(PICKLED)}: not a dict")
    _check_scheduler(engine, plan, scheduler)
    return plan


def _apply(engine: CheckpointEngine, plan: _Plan, strict: bool, optimizer: bool, scheduler: bool) -> None:
    ms, rs = plan.ms, plan.rs
    engine.zero_grad()  # also stops an optimizer pass that backward started: it would use stale state
    with torch.no_grad():
        if st.is_stage3(engine):
            engine.module.load_state_dict(ms["module"], strict=False)
            name = f"param_rank{engine.rank}.bin"
            excluded = bool(ms.get("exclude_frozen_parameters", False))
            st.read_params(engine, plan.d.held(name), plan.d.name(name), excluded)
        else:  # a checkpoint without the frozen parameters: the module keeps its own
            frozen_excluded = bool(ms.get("exclude_frozen_parameters", False))
            engine.module.load_state_dict(ms["module"], strict=strict and not frozen_excluded)
    if optimizer:
        meta = rs["optimizer"]
        name = f"optim_rank{engine.rank}.bin"
        st.read_optimizer(engine, plan.d.held(name), plan.d.name(name), st.saved_state_dtype(meta))
        engine.optimizer.load_hyperparameters(meta["param_groups"], plan.d.name(name))
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
        d = _resolve(os.path.abspath(load_dir), tag)
        if d is None:
            return None
        path = d.path
        try:
            return _plan(engine, d, load_module_strict, optimizer, scheduler, allow_pickle)
        except BaseException:
            d.close()
            raise

    result, err = attempt(plan)
    try:
        return _agree_and_apply(engine, result, err, path, load_dir, load_module_strict, optimizer, scheduler)
    finally:
        if result is not None:
            result.d.close()


def _agree_and_apply(
    engine: CheckpointEngine,
    result: Optional[_Plan],
    err: Optional[BaseException],
    path: Optional[str],
    load_dir: str,
    strict: bool,
    optimizer: bool,
    scheduler: bool,
) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
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
            _apply(engine, result, strict, optimizer, scheduler)
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
