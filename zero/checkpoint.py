"""Checkpoints that survive a crash during the save and resume bit for bit.

Layout of `<save_dir>/<tag>/`:

* `model_states.pt` (rank 0): module state_dict, step counters, scheduler and loss-scaler state, client
  state, the config;
* `rank<r>_states.pt` (every rank): RNG states (torch, CUDA, numpy, python) and the optimizer's metadata
  (rule, hyperparameters, step count, partition bounds);
* stage 3: `param_rank<r>.bin`, the rank's parameter partitions in the model dtype, unit after unit
  (read one unit at a time from their tier; `rank<r>_states.pt` lists the units by their stable names), and
  `model_states.pt` holds only what is not partitioned (buffers);
* `optim_rank<r>.bin`: the rank's fp32 master and optimizer states, raw, tensor after tensor
  (`[master | state_1 | ...]`, partition-size each). It is streamed chunk by chunk through an aio handle,
  straight from NVMe-resident state (read back through the swapper's slots) or from host memory, so saving
  never needs the whole state in memory, and any offload device can load what any other saved.

Atomicity: everything is written into `.<tag>.tmp`, each file fsynced, the directory fsynced, renamed to
`<tag>` (an existing `<tag>` is first moved aside to `.<tag>.old`, which loading falls back to), the parent
fsynced, and only then `latest` is replaced atomically (temporary file, fsync, rename). A process killed at
any point leaves the previous checkpoint and `latest` loadable.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from zero.engine import ZeroEngine

__all__ = ["CRASH_ENV", "load_checkpoint", "save_checkpoint"]

# Test hook: SIGKILL this process when the save reaches the named point (see _crash_point calls).
CRASH_ENV = "ZERO_OFFLOAD_TEST_CRASH_AT"
FORMAT_VERSION = 1


def _crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _barrier(engine: ZeroEngine) -> None:
    if engine.world_size > 1:
        dist.barrier()


def _check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or os.sep in tag or tag.startswith(".") or tag == "latest":
        raise ValueError(f"checkpoint tag must be a plain name not starting with '.', got {tag!r}")
    return tag


def _rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _aio_handle(engine: ZeroEngine) -> Any:
    from offload.swap.optimizer_swapper import AioSettings

    return AioSettings.from_config(engine.config.aio).handle()


def _write_optimizer(engine: ZeroEngine, path: str) -> int:
    """Stream master + states into `path`, tensor after tensor; returns the bytes written."""
    part = engine.part_numel
    handle = _aio_handle(engine)
    written = 0

    def put(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
        nonlocal written
        for k, t in enumerate([master, *states]):
            handle.async_pwrite(t, path, (k * part + start) * 4)
            written += n * 4
        handle.wait()  # the views are only valid during this call

    try:
        engine._state.read_all(put)
    finally:
        handle.close()
    engine._state.stats.reset()  # checkpoint I/O is not part of the next step's report
    _fsync_path(path)
    return written


def _read_optimizer(engine: ZeroEngine, path: str) -> None:
    part = engine.part_numel
    expected = part * (1 + engine.rule.n_states) * 4
    size = os.path.getsize(path)
    if size != expected:
        raise ValueError(f"{path}: {size} bytes, expected {expected} for this partition and optimizer")
    handle = _aio_handle(engine)

    def fill(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
        for k, t in enumerate([master, *states]):
            handle.async_pread(t, path, (k * part + start) * 4)
        handle.wait()

    try:
        engine._state.load(fill)
    finally:
        handle.close()
    engine._state.stats.reset()


def _is_stage3(engine: ZeroEngine) -> bool:
    return getattr(engine, "partitioner", None) is not None


def _trainable_numel(engine: ZeroEngine) -> int:
    return engine.trainable_numel if _is_stage3(engine) else engine.flat.numel  # type: ignore[attr-defined]


def _module_state(engine: ZeroEngine) -> Dict[str, Any]:
    """The module's state dict; at stage 3 without the partitioned parameters (saved per rank)."""
    if not _is_stage3(engine):
        return engine.module.state_dict()
    from zero.stage3.unit import is_partitioned

    return {
        k: v.detach().clone()
        for k, v in engine.module.state_dict(keep_vars=True).items()
        if not is_partitioned(v)
    }


def _unit_index(engine: ZeroEngine) -> List[Tuple[str, int, str]]:
    return [(u.name, u.part_numel, str(u.dtype)) for u in engine.partitioner.units]  # type: ignore[attr-defined]


def _write_params(engine: ZeroEngine, path: str) -> None:
    """Stage 3: every unit's partition, back to back in unit order, one unit in memory at a time."""
    part = engine.partitioner  # type: ignore[attr-defined]
    with open(path, "wb") as f:
        for u in part.units:
            values = part.read_partition(u, torch.empty(u.part_numel, dtype=u.dtype))
            f.write(values.view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def _read_params(engine: ZeroEngine, path: str, saved_units: List[Tuple[str, int, str]]) -> None:
    part = engine.partitioner  # type: ignore[attr-defined]
    mine = _unit_index(engine)
    if [(n, k, d) for n, k, d in saved_units] != mine:
        diff = next(
            (f"{a} vs {b}" for a, b in zip(saved_units, mine) if tuple(a) != tuple(b)),
            f"{len(saved_units)} vs {len(mine)} units",
        )
        raise ValueError(f"{path}: saved parameter partitions do not match this model's units ({diff})")
    expected = sum(u.part_nbytes for u in part.units)
    size = os.path.getsize(path)
    if size != expected:
        raise ValueError(f"{path}: {size} bytes, expected {expected} for this model's partitions")
    with open(path, "rb") as f:
        for u in part.units:
            raw = bytearray(f.read(u.part_nbytes))
            values = torch.frombuffer(raw, dtype=torch.uint8).view(u.dtype)
            part.write_partition(u, values)


def _write_latest(save_dir: str, tag: str) -> None:
    tmp = os.path.join(save_dir, f".latest.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, "latest"))
    _fsync_path(save_dir, directory=True)


def save_checkpoint(
    engine: ZeroEngine,
    save_dir: str,
    tag: Optional[str] = None,
    client_state: Optional[Dict[str, Any]] = None,
) -> str:
    """Write a checkpoint of `engine` to `save_dir/tag` atomically; returns its path. All ranks call this."""
    engine._check_open()
    tag = _check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    save_dir = os.path.abspath(save_dir)
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".{tag}.tmp")
    old = os.path.join(save_dir, f".{tag}.old")
    if engine.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(engine)

    r = engine.rank
    _write_optimizer(engine, os.path.join(tmp, f"optim_rank{r}.bin"))
    _crash_point("after_optimizer")
    if _is_stage3(engine):
        _write_params(engine, os.path.join(tmp, f"param_rank{r}.bin"))
    rank_state = {
        "rng": _rng_state(),
        "optimizer": {
            "rule": engine.rule.kind,
            "param_groups": [engine.optimizer.hyperparameters()],
            "step": engine.optimizer.step_count,
            "partition": (engine.lo, engine.hi),
            "n_states": engine.rule.n_states,
        },
    }
    if _is_stage3(engine):
        rank_state["stage3_units"] = _unit_index(engine)
    _save_file(rank_state, os.path.join(tmp, f"rank{r}_states.pt"))
    if r == 0:
        model_states = {
            "format_version": FORMAT_VERSION,
            "module": _module_state(engine),
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "world_size": engine.world_size,
            "stage": engine.stage,
            "numel": _trainable_numel(engine),
            "padded_numel": engine.flat.padded_numel if not _is_stage3(engine) else engine.part_numel,
            "dtype": str(engine.dtype),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "client_state": client_state or {},
            "config": engine.config.to_dict(),
        }
        _save_file(model_states, os.path.join(tmp, "model_states.pt"))
        _crash_point("after_model")
    _barrier(engine)
    if r == 0:
        _fsync_path(tmp, directory=True)
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(final):
            os.rename(final, old)
            _crash_point("after_move_aside")
        os.rename(tmp, final)
        _fsync_path(save_dir, directory=True)
        _crash_point("before_latest")
        _write_latest(save_dir, tag)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(engine)
    return final


def _resolve(load_dir: str, tag: Optional[str]) -> Optional[str]:
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            warnings.warn(
                f"no 'latest' file in {load_dir}: nothing loaded (pass tag= to pick one)", stacklevel=3
            )
            return None
        with open(latest) as f:
            tag = f.read().strip()
    tag = _check_tag(tag)
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        return path
    old = os.path.join(load_dir, f".{tag}.old")
    if os.path.isdir(old):  # a save of the same tag died between moving the old one aside and renaming
        return old
    raise FileNotFoundError(f"checkpoint {path} does not exist")


def load_checkpoint(
    engine: ZeroEngine,
    load_dir: str,
    tag: Optional[str] = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """Restore `engine` from `load_dir/tag` (or `latest`): (path, client_state), (None, None) if none."""
    engine._check_open()
    path = _resolve(os.path.abspath(load_dir), tag)
    if path is None:
        return None, None
    ms = torch.load(os.path.join(path, "model_states.pt"), map_location="cpu", weights_only=False)
    if ms.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {ms.get('format_version')}, expected {FORMAT_VERSION}")
    if ms["numel"] != _trainable_numel(engine):
        raise ValueError(
            f"{path}: checkpoint has {ms['numel']} trainable elements, the model {_trainable_numel(engine)}"
        )
    if ms.get("stage", 0) == 3 and not _is_stage3(engine) or ms.get("stage", 0) != 3 and _is_stage3(engine):
        raise ValueError(
            f"{path}: saved at stage {ms.get('stage')}, this engine runs stage {engine.stage}: export with "
            "zero.consolidated_state_dict / save_16bit_model to move between stage 3 and stages 0-2"
        )
    rank_file = os.path.join(path, f"rank{engine.rank}_states.pt")
    rs = torch.load(rank_file, map_location="cpu", weights_only=False)
    with torch.no_grad():
        if _is_stage3(engine):
            missing, unexpected = engine.module.load_state_dict(ms["module"], strict=False)
            from zero.stage3.unit import is_partitioned

            own = dict(engine.module.state_dict(keep_vars=True))
            missing = [k for k in missing if not is_partitioned(own[k])]
            if load_module_strict and (missing or unexpected):
                raise ValueError(f"{path}: module state mismatch: missing {missing}, unexpected {unexpected}")
            if ms["world_size"] != engine.world_size:
                raise ValueError(
                    f"{path}: saved by {ms['world_size']} rank(s), this run has {engine.world_size}: stage-3 "
                    "partitions cannot be mapped"
                )
            _read_params(engine, os.path.join(path, f"param_rank{engine.rank}.bin"), rs["stage3_units"])
        else:
            engine.module.load_state_dict(ms["module"], strict=load_module_strict)
    if load_optimizer_states:
        meta = rs["optimizer"]
        if ms["world_size"] != engine.world_size or tuple(meta["partition"]) != (engine.lo, engine.hi):
            raise ValueError(
                f"{path}: saved by {ms['world_size']} rank(s) (partition {tuple(meta['partition'])}); "
                f"this run has {engine.world_size} (partition {(engine.lo, engine.hi)}): optimizer states "
                "cannot be mapped"
            )
        if meta["rule"] != engine.rule.kind:
            raise ValueError(
                f"{path}: optimizer states are for {meta['rule']}, this engine runs {engine.rule.kind}"
            )
        _read_optimizer(engine, os.path.join(path, f"optim_rank{engine.rank}.bin"))
        engine.optimizer.param_groups[0].update(meta["param_groups"][0])
        engine.optimizer.step_count = int(meta["step"])
        if engine.loss_scaler is not None and ms["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(ms["loss_scaler"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and ms["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(ms["lr_scheduler"])
    engine.global_steps = int(ms["global_steps"])
    engine.global_samples = int(ms["global_samples"])
    engine.micro_steps = int(ms["micro_steps"])
    engine.skipped_steps = int(ms["skipped_steps"])
    engine.zero_grad()
    _set_rng_state(rs["rng"])
    _barrier(engine)
    return path, ms["client_state"]
