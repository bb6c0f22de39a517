"""What a checkpoint holds and how the engine's state streams in and out of its files.

Everything in `model_states.pt` and `rank<r>_states.pt` is a tensor or a plain type (dict, list, tuple,
int, float, str, bool, None, dtypes), so both load with torch.load(weights_only=True), which never runs
code from the file. RNG states are stored in that form too (python's and numpy's as int64 tensors).
"""

from __future__ import annotations

import io
import math
import os
import random
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from offload.progress import progress
from offload.swap.optimizer_swapper import STATE_TORCH_DTYPES
from offload.swap.slots import QUANT_BLOCK, StateFormat
from zero.checkpoint._engine import CheckpointEngine
from zero.checkpoint._files import Entry, StreamDigest, create_private, digest_fd, plain_name
from zero.optimizer.state_convert import convert_states, warn_if_lossy


def is_stage3(engine: CheckpointEngine) -> bool:
    return engine.partitioner is not None


def trainable_numel(engine: CheckpointEngine) -> int:
    """Elements of the trained parameters, the same on every rank (at stage 3 the whole parameters', not
    this rank's share)."""
    if not is_stage3(engine):
        return engine.trainable_numel
    units = engine.layout.master_index()["units"]
    return sum(math.prod(shape) for params in units for _, shape, trained in params if trained)


def check_tag(tag: Any) -> str:
    """`tag` as a checkpoint's directory name: one printable path component without surrounding whitespace
    (it would not survive the `latest` file, whose content is stripped), not hidden, not `latest`."""
    tag = str(tag)
    if tag != tag.strip():
        raise ValueError(f"checkpoint tag {tag!r} has leading or trailing whitespace: pass {tag.strip()!r}")
    if not plain_name(tag) or tag == "latest":
        raise ValueError(
            f"checkpoint tag must be a plain printable name (one path component of at most 255 bytes, not "
            f"starting with '.', not 'latest'), got {tag!r}"
        )
    return tag


# ------------------------------------------------------------------------------------------- RNG states
def rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch": torch.get_rng_state()}
    version, internal, gauss = random.getstate()
    state["python"] = {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "kind": str(kind),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what rng_state() saved (also the raw tuples of format-1 checkpoints)."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    if isinstance(py, dict):
        py = (py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"])
    random.setstate(py)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        st = state["numpy"]
        if isinstance(st, dict):
            key = st["key"].numpy().astype(np.uint32)
            st = (st["kind"], key, st["pos"], st["has_gauss"], st["cached_gaussian"])
        np.random.set_state(st)


# --------------------------------------------------------------------------------------- plain objects
def pickle_needed(obj: Any) -> Optional[str]:
    """None if torch.load(weights_only=True) restores `obj`; otherwise what stops it (e.g. a class name)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal means the same: pickle would be needed
        return weights_only_reason(e)
    return None


def weights_only_reason(e: BaseException) -> str:
    """What torch.load(weights_only=True) refused, e.g. 'Unsupported global: GLOBAL mymodule.MyClass'."""
    found = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed global.*)?$", str(e), re.M)
    return found.group(1) if found else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


# ---------------------------------------------------------------------------------------- module state
def frozen_names(engine: CheckpointEngine) -> List[str]:
    """The state-dict names of the module's parameters with requires_grad False (tied aliases included)."""
    return [n for n, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad]


def module_state(engine: CheckpointEngine, exclude_frozen: bool = False) -> Dict[str, Any]:
    """The module's state dict; at stage 3 without the partitioned parameters (saved per rank).
    `exclude_frozen`: without the parameters with requires_grad False (DeepSpeed's
    `exclude_frozen_parameters`)."""
    drop = set(frozen_names(engine)) if exclude_frozen else set()
    if not is_stage3(engine):
        return {k: v for k, v in engine.module.state_dict().items() if k not in drop}
    from zero.stage3.unit import is_partitioned

    return {
        k: v.detach().clone()
        for k, v in engine.module.state_dict(keep_vars=True).items()
        if not is_partitioned(v) and k not in drop
    }


def expected_module_state(engine: CheckpointEngine) -> Dict[str, Optional[torch.Size]]:
    """What load_state_dict will accept: key -> shape (None for stage-3 partitioned parameters)."""
    own = engine.module.state_dict(keep_vars=True)
    if not is_stage3(engine):
        return {k: v.shape for k, v in own.items()}
    from zero.stage3.unit import is_partitioned

    return {k: None if is_partitioned(v) else v.shape for k, v in own.items()}


def check_module_state(
    engine: CheckpointEngine, saved: Dict[str, Any], strict: bool, where: str, frozen_excluded: bool = False
) -> None:
    """Raise unless `saved` fits the module (strict: the same keys). A checkpoint saved with
    `exclude_frozen_parameters` may lack the frozen parameters: the module keeps its own values of them."""
    mine = expected_module_state(engine)
    not_tensor = [k for k, v in saved.items() if k in mine and not isinstance(v, torch.Tensor)]
    if not_tensor:
        raise ValueError(f"{where}: module state {not_tensor[0]!r} is not a tensor")
    optional = set(frozen_names(engine)) if frozen_excluded else set()
    missing = [k for k, shape in mine.items() if k not in saved and shape is not None and k not in optional]
    unexpected = [k for k in saved if k not in mine]
    if strict and (missing or unexpected):
        raise ValueError(f"{where}: module state mismatch: missing {missing}, unexpected {unexpected}")
    wrong = [
        f"{k}: saved {tuple(v.shape)}, model {tuple(mine[k])}"
        for k, v in saved.items()
        if mine.get(k) is not None and isinstance(v, torch.Tensor) and v.shape != mine[k]
    ]
    if wrong:
        raise ValueError(f"{where}: module state shape mismatch: {'; '.join(wrong[:5])}")


def saved_units(engine: CheckpointEngine, exclude_frozen: bool = False) -> List[Any]:
    """The stage-3 units whose partitions the parameter file holds: all, or (`exclude_frozen`) those with
    a trainable parameter (a unit holding only frozen parameters keeps the module's values on load)."""
    units = engine.partitioner.units
    return [u for u in units if u.trainable] if exclude_frozen else list(units)


def unit_index(engine: CheckpointEngine, exclude_frozen: bool = False) -> List[List[Any]]:
    return [[u.name, u.part_numel, str(u.dtype)] for u in saved_units(engine, exclude_frozen)]


def check_units(engine: CheckpointEngine, index: List[Any], where: str, exclude_frozen: bool = False) -> int:
    """Raise unless the saved stage-3 units (`index`) are this model's; returns the parameter file's size."""
    mine = unit_index(engine, exclude_frozen)
    saved = [[n, int(k), str(d)] for n, k, d in index]
    if saved != mine:
        diff = next(
            (f"{a} vs {b}" for a, b in zip(saved, mine) if a != b), f"{len(saved)} vs {len(mine)} units"
        )
        raise ValueError(f"{where}: saved parameter partitions do not match this model's units ({diff})")
    return sum(u.part_nbytes for u in saved_units(engine, exclude_frozen))


# ------------------------------------------------------------------------------- streamed binary files
def _aio_handle(engine: CheckpointEngine) -> Any:
    return engine.config.aio.handle()


def _host_bytes(t: torch.Tensor) -> Any:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(torch.uint8).numpy()


def _direct(fd: int, flags: int) -> int:
    """A second descriptor of the file open as `fd`, with O_DIRECT (which the aio core honours), opened
    through its /proc/self/fd link - the very same inode, not a path anyone could swap; a duplicate of `fd`
    where the filesystem refuses O_DIRECT. The caller closes it."""
    try:
        return os.open(f"/proc/self/fd/{fd}", flags | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return os.dup(fd)


def _close_quietly(handle: Any) -> None:
    try:
        handle.close()
    except BaseException:  # noqa: BLE001 - the error already being raised is the one that matters
        pass


def state_format(engine: CheckpointEngine, state_dtype: Optional[str] = None) -> StateFormat:
    """The layout of the engine's optimizer state, or of the same optimizer with states in `state_dtype`."""
    return StateFormat(engine.rule.n_states, state_dtype or engine.rule.state_dtype)


def saved_state_dtype(meta: Dict[str, Any]) -> str:
    """The dtype a checkpoint's optimizer states were saved in (checkpoints before it was recorded: fp32)."""
    return str(meta.get("state_dtype", "fp32"))


def _file_parts(fmt: StateFormat, part: int) -> List[Tuple[torch.dtype, int, int]]:
    """(dtype, numel, byte offset) of each tensor in `optim_rank<r>.bin`: the fp32 master, the states in
    their dtype, then (int8) their absmax scales, back to back."""
    out, off = [], 0
    for dtype, numel, _ in fmt.parts(part):
        tdt = STATE_TORCH_DTYPES[dtype]
        out.append((tdt, numel, off))
        off += numel * tdt.itemsize
    return out


def _chunk_offsets(fmt: StateFormat, part: int, start: int) -> List[int]:
    """Byte offset in the file of each tensor of the chunk starting at element `start`."""
    n_values = 1 + fmt.n_states
    return [
        off + (start if k < n_values else start // QUANT_BLOCK) * tdt.itemsize
        for k, (tdt, _, off) in enumerate(_file_parts(fmt, part))
    ]


def optimizer_nbytes(engine: CheckpointEngine, state_dtype: Optional[str] = None) -> int:
    return state_format(engine, state_dtype).whole_bytes(engine.part_numel)


def write_optimizer(engine: CheckpointEngine, name: str, dir_fd: int) -> Entry:
    """Stream master + states (in the dtype they live in) into new file `name` in directory `dir_fd`,
    tensor after tensor, hashing each region on the way (fp32 states: equal regions; otherwise the file is
    digested after it is written). The aio writes go to the descriptor created here, never to a path."""
    part = engine.part_numel
    fmt = state_format(engine)
    fd = create_private(name, dir_fd, read=True)  # 0600 from the start
    digests = [StreamDigest() for _ in range(fmt.n_tensors)]
    expect, in_order = 0, fmt.dtype == "fp32"
    io_fd = -1
    bar = progress("save_checkpoint: optimizer state", optimizer_nbytes(engine), rank=engine.rank)
    try:
        io_fd = _direct(fd, os.O_RDWR)
        handle = _aio_handle(engine)

        def put(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
            nonlocal expect, in_order
            tensors = [master, *states]
            for t, off in zip(tensors, _chunk_offsets(fmt, part, start)):
                handle.async_pwrite(t, io_fd, off)
            in_order = in_order and start == expect
            if in_order:  # hash while the writes run
                for d, t in zip(digests, tensors):
                    d.update(_host_bytes(t))
            expect = start + n
            handle.wait()  # the views are only valid during this call
            bar.update(sum(t.numel() * t.element_size() for t in tensors))

        try:
            engine.stream_optimizer_state(put)
        except OSError as e:
            _close_quietly(handle)
            raise OSError(e.errno, f"writing {name}: {e}") from e
        except BaseException:
            _close_quietly(handle)
            raise
        handle.close()
        os.fsync(fd)
        if not (in_order and expect == part):
            return digest_fd(fd, part * 4, os.fstat(fd).st_size, name)
    finally:
        bar.close()
        if io_fd >= 0:
            os.close(io_fd)
        os.close(fd)
    return {
        "size": optimizer_nbytes(engine),
        "segment_bytes": part * 4,
        "digests": [d.entry()["digests"][0] for d in digests],
    }


def read_optimizer(engine: CheckpointEngine, fd: int, path: str, state_dtype: str = "fp32") -> None:
    """Fill the engine's optimizer state from open file `fd` (`path`, for messages), saved with states in
    `state_dtype`: straight into the tier's buffers when that is the engine's dtype, else converted chunk by
    chunk (a warning when that rounds them)."""
    size = os.fstat(fd).st_size
    if size != optimizer_nbytes(engine, state_dtype):
        raise ValueError(f"{path}: {size} bytes, expected {optimizer_nbytes(engine, state_dtype)}")
    src, dst = state_format(engine, state_dtype), state_format(engine)
    if src != dst:
        warn_if_lossy(src.dtype, dst.dtype, path)
    fd = _direct(fd, os.O_RDONLY)
    try:
        _read_optimizer(engine, fd, path, src, dst)
    finally:
        os.close(fd)


def _read_optimizer(engine: CheckpointEngine, fd: int, path: str, src: StateFormat, dst: StateFormat) -> None:
    part = engine.part_numel
    handle = _aio_handle(engine)

    def fill(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
        offsets = _chunk_offsets(src, part, start)
        if src == dst:
            for t, off in zip([master, *states], offsets):
                handle.async_pread(t, fd, off)
            handle.wait()
            return
        saved = [torch.empty(k, dtype=STATE_TORCH_DTYPES[d]) for d, k, _ in src.parts(n)]
        for t, off in zip(saved, offsets):
            handle.async_pread(t, fd, off)
        handle.wait()
        master.copy_(saved[0])
        for t, v in zip(states, convert_states(saved[1:], src, dst, engine.rule.signed)):
            t.copy_(v)

    def fill_counted(start: int, n: int, master: torch.Tensor, states: List[torch.Tensor]) -> None:
        fill(start, n, master, states)
        bar.update(src.whole_bytes(n))

    bar = progress("load_checkpoint: optimizer state", os.fstat(fd).st_size, rank=engine.rank)
    try:
        engine.load_optimizer_state(fill_counted)
    except OSError as e:
        _close_quietly(handle)
        raise OSError(e.errno, f"reading {path}: {e}") from e
    except BaseException:
        _close_quietly(handle)
        raise
    finally:
        bar.close()
    handle.close()


def write_params(engine: CheckpointEngine, name: str, dir_fd: int, exclude_frozen: bool = False) -> Entry:
    """Stage 3: every unit's partition (`saved_units`) into new file `name` in directory `dir_fd`, back to
    back in unit order, one unit in memory at a time."""
    part = engine.partitioner
    digest = StreamDigest()
    units = saved_units(engine, exclude_frozen)
    bar = progress("save_checkpoint: parameters", sum(u.part_nbytes for u in units), rank=engine.rank)
    with os.fdopen(create_private(name, dir_fd), "wb") as f, bar:
        for u in units:
            raw = part.read_partition(u, torch.empty(u.part_numel, dtype=u.dtype)).view(torch.uint8).numpy()
            digest.update(raw)
            f.write(raw.data)
            bar.update(raw.nbytes)
        f.flush()
        os.fsync(f.fileno())
    return digest.entry()


def read_params(engine: CheckpointEngine, fd: int, path: str, exclude_frozen: bool = False) -> None:
    """Stage 3: the partitions (`saved_units`) from open file `fd` (`path`, for messages)."""
    part = engine.partitioner
    units = saved_units(engine, exclude_frozen)
    pos = 0
    with progress("load_checkpoint: parameters", sum(u.part_nbytes for u in units), rank=engine.rank) as bar:
        for u in units:
            values = torch.empty(u.part_numel, dtype=u.dtype)
            view = memoryview(values.view(torch.uint8).numpy()).cast("B")  # read straight into the tensor
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], pos + done)
                if not n:
                    raise OSError(f"{path}: ended inside unit {u.name}")
                done += n
            pos += done
            part.write_partition(u, values)
            bar.update(u.part_nbytes)


def optimizer_meta(engine: CheckpointEngine) -> Dict[str, Any]:
    return {
        "rule": engine.rule.kind,
        "param_groups": engine.optimizer.group_hyperparameters(),
        "step": engine.optimizer.step_count,
        "partition": [engine.lo, engine.hi],
        "n_states": engine.rule.n_states,
        "state_dtype": engine.rule.state_dtype,
    }


def partition_of(meta: Dict[str, Any]) -> Tuple[int, int]:
    lo, hi = meta["partition"]
    return int(lo), int(hi)
