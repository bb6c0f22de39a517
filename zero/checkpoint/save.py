"""save_checkpoint: every rank writes its files into `.<tag>.tmp`, rank 0 seals and publishes them.

Each rank opens `.<tag>.tmp` once (no symlink followed; it must be a private directory of this user) and
creates every file relative to that descriptor: no file is ever reopened by a path another user could swap.
"""

from __future__ import annotations

import os
import shutil
import stat
import warnings
from typing import Any, Dict, Optional

from zero.checkpoint import _state as st
from zero.checkpoint._agree import agree, all_gather_json, attempt
from zero.checkpoint._engine import CheckpointEngine
from zero.checkpoint._files import (
    FORMAT_VERSION,
    HASH,
    MANIFEST,
    PICKLED,
    STAGE3_LAYOUT,
    Entry,
    crash_point,
    create_private,
    fsync_path,
    manifest_bytes,
    mkdir_private,
    save_object,
    write_bytes,
)
from zero.errors import CheckpointError, CheckpointTagError


def _make_tmp(save_dir: str, tmp: str) -> None:
    if not os.path.isdir(save_dir):
        parent = os.path.dirname(save_dir)
        os.makedirs(parent, exist_ok=True)
        try:
            mkdir_private(save_dir)
        except FileExistsError:
            pass  # made meanwhile by someone else: theirs, leave its mode alone
    shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
    _remove_dead_latest_tmp(save_dir)
    mkdir_private(tmp)


def _open_tmp(tmp: str) -> int:
    """A descriptor of `.<tag>.tmp`, checked to be a directory (not a symlink) private to this user."""
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st_ = os.fstat(fd)
    if st_.st_uid != os.geteuid() or stat.S_IMODE(st_.st_mode) & 0o077:
        os.close(fd)
        raise CheckpointError(
            f"{tmp}: owned by uid {st_.st_uid} with mode {stat.S_IMODE(st_.st_mode):04o}, not a private "
            "directory of this user (0700): refused"
        )
    return fd


def _remove_dead_latest_tmp(save_dir: str) -> None:
    """Remove `.latest.tmp-<pid>` files whose process is gone (killed between writing and renaming)."""
    for name in os.listdir(save_dir):
        pid = name[len(".latest.tmp-") :] if name.startswith(".latest.tmp-") else ""
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(save_dir, name))
        except FileNotFoundError:
            pass


def _needs_pickle(obj: Any, what: str, pickled: Dict[str, Any], key: str) -> Any:
    """`obj` if it loads weights-only; otherwise moves it to `pickled[key]` (with a warning), returns None."""
    problem = st.pickle_needed(obj)
    if problem is None:
        return obj
    warnings.warn(
        f"the {what} holds objects that only pickle can restore ({problem}); it is saved in {PICKLED}, "
        "which load_checkpoint reads only when called with allow_pickle=True (unpickling runs code from "
        "the file). Keep it to dicts, lists, numbers, strings, bools, None and tensors to avoid this.",
        UserWarning,
        stacklevel=2,
    )
    pickled[key] = obj
    return None


def _write_rank_files(
    engine: CheckpointEngine, tmp: str, client_state: Optional[Dict[str, Any]], exclude_frozen: bool
) -> Dict[str, Entry]:
    fd = _open_tmp(tmp)
    try:
        return _write_into(engine, fd, client_state, exclude_frozen)
    finally:
        os.close(fd)


def _write_into(
    engine: CheckpointEngine, fd: int, client_state: Optional[Dict[str, Any]], exclude_frozen: bool
) -> Dict[str, Entry]:
    r = engine.rank
    files: Dict[str, Entry] = {}
    files[f"optim_rank{r}.bin"] = st.write_optimizer(engine, f"optim_rank{r}.bin", fd)
    crash_point("after_optimizer")
    if st.is_stage3(engine):
        files[f"param_rank{r}.bin"] = st.write_params(engine, f"param_rank{r}.bin", fd, exclude_frozen)
    rank_state: Dict[str, Any] = {"rng": st.rng_state(), "optimizer": st.optimizer_meta(engine)}
    if st.is_stage3(engine):
        rank_state["stage3_units"] = st.unit_index(engine, exclude_frozen)
    problem = st.pickle_needed(rank_state["optimizer"])
    if problem is not None:
        raise ValueError(f"the optimizer's hyperparameters hold objects that need pickle ({problem})")
    files[f"rank{r}_states.pt"] = save_object(rank_state, f"rank{r}_states.pt", fd)
    if r != 0:
        return files
    pickled: Dict[str, Any] = {}
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    meta = {
        "format_version": FORMAT_VERSION,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "world_size": engine.world_size,
        "stage": engine.stage,
        "stage3_layout": STAGE3_LAYOUT,
        "numel": st.trainable_numel(engine),
        "padded_numel": engine.layout.padded_numel,
        "dtype": str(engine.dtype),
        "master_index": engine.layout.master_index(),  # which parameter each master element is (to_fp32)
        "lr_scheduler": _needs_pickle(scheduler, "lr scheduler's state", pickled, "lr_scheduler"),
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "client_state": _needs_pickle(client_state or {}, "client_state", pickled, "client_state"),
        "config": engine.config.to_dict(),
        "exclude_frozen_parameters": exclude_frozen,  # the frozen parameters are not in the checkpoint
    }
    meta["pickled"] = sorted(pickled)
    problem = st.pickle_needed(meta)
    if problem is not None:
        raise ValueError(f"the engine's checkpoint metadata holds objects that need pickle ({problem})")
    if pickled:
        files[PICKLED] = save_object(pickled, PICKLED, fd)
    model_states = {**meta, "module": st.module_state(engine, exclude_frozen)}
    files["model_states.pt"] = save_object(model_states, "model_states.pt", fd)
    crash_point("after_model")
    return files


def _write_latest(save_dir: str, tag: str) -> None:
    tmp = os.path.join(save_dir, f".latest.tmp-{os.getpid()}")
    try:
        with os.fdopen(create_private(tmp), "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(save_dir, "latest"))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _publish(
    engine: CheckpointEngine, save_dir: str, tag: str, files: Dict[str, Entry], save_latest: bool = True
) -> None:
    """Rank 0: manifest last, then `.<tag>.tmp` -> `<tag>` and (`save_latest`) `latest`; rolled back if
    that fails."""
    tmp, final, old = (os.path.join(save_dir, n) for n in (f".{tag}.tmp", tag, f".{tag}.old"))
    body = {
        "format_version": FORMAT_VERSION,
        "hash": HASH,
        "tag": tag,
        "world_size": engine.world_size,
        "stage": engine.stage,
        "stage3_layout": STAGE3_LAYOUT,
        "files": files,
    }
    fd = _open_tmp(tmp)
    try:
        write_bytes(MANIFEST, manifest_bytes(body), fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    moved_aside = renamed = False
    try:
        if os.path.isdir(final):
            # `final` is complete (only a finished rename makes it), so an older `.old` is not needed
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            moved_aside = True
            crash_point("after_move_aside")
        # else a `.old` stays: after a save that died having moved `final` aside it is the only copy
        os.rename(tmp, final)
        renamed = True
        fsync_path(save_dir, directory=True)
        crash_point("before_latest")
        if save_latest:
            _write_latest(save_dir, tag)
    except BaseException:
        # back to where the save started; the caller removes `tmp`
        try:
            if renamed:
                os.rename(final, tmp)
            if moved_aside:
                os.rename(old, final)
            fsync_path(save_dir, directory=True)
        except OSError:
            pass
        raise
    fsync_path(save_dir, directory=True)  # `latest` is durable: the copy moved aside may go
    shutil.rmtree(old, ignore_errors=True)


def agreed_tag(engine: CheckpointEngine, tag: Optional[Any]) -> str:
    """The tag every rank saves under (DeepSpeed's rules): `global_step<N>` when None, else `str(tag)`.
    Ranks that give different tags (a collective compares them) save under rank 0's, with a warning under
    `checkpoint.tag_validation` "Warn" (the default), silently under "Ignore"; under "Fail" every rank raises
    CheckpointTagError (an AssertionError too, as DeepSpeed's)."""
    tag = st.check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    tags = all_gather_json(engine, tag)
    if all(t == tag for t in tags):
        return tag
    mode = engine.config.checkpoint.tag_validation
    msg = (
        f"checkpoint tags differ across ranks ({', '.join(f'rank {r}: {t!r}' for r, t in enumerate(tags))}):"
        " a tag must be the same on every rank (rank-specific tags cannot be restored with another world"
        " size)"
    )
    if mode == "Fail":
        raise CheckpointTagError(f"{msg}; checkpoint.tag_validation is 'Fail'")
    if mode == "Warn":
        warnings.warn(f"{msg}; saved under rank 0's tag {tags[0]!r}", RuntimeWarning, stacklevel=3)
    return st.check_tag(tags[0])


def save_checkpoint(
    engine: CheckpointEngine,
    save_dir: Any,
    tag: Optional[Any] = None,
    client_state: Optional[Dict[str, Any]] = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> str:
    """Write a checkpoint of `engine` to `save_dir/tag` atomically; returns its path. All ranks call this.

    `save_dir`: a non-empty path (str or os.PathLike; ValueError otherwise, as DeepSpeed); the tag: see
    `agreed_tag`. `save_latest=False`: the `latest` file is left as it was.
    `exclude_frozen_parameters` (DeepSpeed's): the parameters with requires_grad False are left out (at
    stage 3, the partitions of the units that hold only frozen parameters); loading it keeps the module's
    own values of them, so the model must be built with them first (the base model of an adapter).

    A failure on any rank raises on every rank (no rank is left waiting), removes `.<tag>.tmp` and leaves
    the previous checkpoint and `latest` as they were.
    """
    if not isinstance(save_dir, (str, os.PathLike)) or not os.fspath(save_dir):
        raise ValueError(f"save_dir must be a non-empty path, got {save_dir!r}")
    engine.check_open()
    tag = agreed_tag(engine, tag)
    save_dir = os.path.abspath(os.fspath(save_dir))
    tmp = os.path.join(save_dir, f".{tag}.tmp")
    rank0 = engine.rank == 0
    _, err = attempt(engine.prepare_checkpoint_save)
    agree(engine, err, "settling the engine's state before the checkpoint")
    _, err = attempt(lambda: _make_tmp(save_dir, tmp) if rank0 else None)
    try:
        agree(engine, err, f"creating {tmp}")
        files, err = attempt(lambda: _write_rank_files(engine, tmp, client_state, exclude_frozen_parameters))
        agree(engine, err, f"writing the checkpoint files into {tmp}")
        merged: Dict[str, Entry] = {}
        for part in all_gather_json(engine, files):
            merged.update(part)
        _, err = attempt(lambda: _publish(engine, save_dir, tag, merged, save_latest) if rank0 else None)
        agree(engine, err, f"publishing {os.path.join(save_dir, tag)}")
    except BaseException:
        if rank0:  # every rank has stopped writing into it: the vote above came after their writes
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.join(save_dir, tag)
