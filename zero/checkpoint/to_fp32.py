"""zero-to-fp32: the fp32 master weights of a checkpoint as one whole state dict (DeepSpeed's zero_to_fp32).

    from zero.checkpoint.to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint("ckpt"))   # tag: `latest`

or `zero-to-fp32 ckpt out/` (zero/cli_to_fp32.py; docs/engine.md). Any stage, any tier: every rank's
`optim_rank<r>.bin` starts with its partition of the fp32 master, wherever the optimizer states lived while
training, and `master_index` (model_states.pt) says which parameter each element is - stages 0-2: the trained
parameters back to back in one flat buffer, a slice [lo, hi) per rank; stage 3: the parameters of one module
(unit), each split over the ranks on its own (`stage3_layout` 2; 1, of older checkpoints: the unit's
parameters back to back, split evenly), the units with trained parameters back to back in each rank's master.
Frozen parameters and buffers come in the model's dtype: from model_states.pt, at stage 3 from the ranks'
`param_rank<r>.bin`.

No GPU, no process group: plain reads straight into the output tensors (through a bounded buffer when the
dtype changes), each file once, front to back, every byte read checked against the manifest's checksums;
`.pt` files load with `torch.load(weights_only=True)`. Every error is raised before any output is written;
each output file is written atomically (`write_atomic`), a shard index last.
"""

from __future__ import annotations

import math
import os
import re
import runpy
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from offload.progress import progress
from zero.checkpoint._dir import OpenDir
from zero.checkpoint._files import (
    FORMAT_VERSION,
    MANIFEST,
    StreamDigest,
    read_manifest,
    verify_file,
    verify_size,
)
from zero.checkpoint._state import check_tag, partition_of, weights_only_reason
from zero.checkpoint.hf_files import OutputTarget, write_state_dict
from zero.checkpoint.load import open_tag, read_latest
from zero.errors import CheckpointError, CheckpointIntegrityError
from zero.stage3.unit import chunk_range, param_shares

__all__ = [
    "DTYPES",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "parse_size",
    "resolve_checkpoint",
]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_CAST_NUMEL = 4 << 20  # elements per read when the dtype changes on the way (16 MiB of fp32)
_SKIP_BYTES = 1 << 20
_MAX_INT = 1 << 62  # elements, bytes: any larger number in a checkpoint's metadata is malformed
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})

Pieces = List[Tuple[str, int, int, int, torch.dtype]]  # (file, byte offset, element lo, hi, dtype in file)


def open_checkpoint(checkpoint_dir: Union[str, os.PathLike], tag: Optional[str] = None) -> OpenDir:
    """Checkpoint `tag` in `checkpoint_dir`, opened (`resolve_checkpoint`)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir} does not exist")
    with OpenDir(checkpoint_dir) as d:
        if tag is None:
            tag = read_latest(d)
            if tag is None and d.kind(MANIFEST) == "file":
                return OpenDir(checkpoint_dir)  # the tag's directory itself
            if tag is None:
                raise FileNotFoundError(
                    f"{d.name('latest')} does not exist: name the checkpoint with tag= (--tag)"
                )
        try:
            return open_tag(d, check_tag(tag))
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint {d.name(tag)} does not exist (tag {tag!r})") from None


def resolve_checkpoint(checkpoint_dir: Union[str, os.PathLike], tag: Optional[str] = None) -> str:
    """The directory of checkpoint `tag` in `checkpoint_dir`; `tag=None`: the one the `latest` file names
    (or `checkpoint_dir` itself when it is a checkpoint, holding a manifest and no `latest`)."""
    with open_checkpoint(checkpoint_dir, tag) as d:
        return d.path


def parse_size(size: Union[int, str]) -> int:
    """Bytes of `size`: an int, or e.g. "5GB" (10**9, as transformers counts), "500MiB" (2**20)."""
    if isinstance(size, int):
        return size
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    unit = found.group(2).upper() if found else ""
    if not found or unit not in _UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"size {size!r}: expected a number of bytes, e.g. 5GB, 500MB or 2GiB")
    return int(float(found.group(1)) * _UNITS[unit])


class _Reader:
    """One checkpoint file (open as `fd`) read front to back, every byte on the way hashed and checked
    against the manifest's checksum of its segment; `read` calls must come at increasing offsets."""

    def __init__(self, fd: int, path: str, entry: Dict[str, Any]) -> None:
        self.path, self.entry, self.pos = path, entry, 0
        self.digest = StreamDigest(entry["segment_bytes"])
        self.fd = fd

    def _take(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], self.pos + done)
            if not n:
                raise CheckpointIntegrityError(f"{self.path}: ended at byte {self.pos + done}, truncated")
            done += n
        self.digest.update(view)
        self.pos += len(view)

    def _skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, _SKIP_BYTES)))
        while n > 0:
            self._take(scratch[: min(n, len(scratch))])
            n -= min(n, len(scratch))

    def read(self, offset: int, out: torch.Tensor, src: torch.dtype) -> None:
        """Fill `out` (contiguous) with the values of dtype `src` that start at byte `offset`."""
        if offset < self.pos:
            raise CheckpointError(f"{self.path}: read at byte {offset} after byte {self.pos}")
        self._skip(offset - self.pos)
        if out.dtype == src:
            self._take(memoryview(out.view(torch.uint8).numpy()).cast("B"))
            return
        buf = torch.empty(min(out.numel(), _CAST_NUMEL), dtype=src)
        for a in range(0, out.numel(), _CAST_NUMEL):
            part = buf[: min(_CAST_NUMEL, out.numel() - a)]
            self._take(memoryview(part.view(torch.uint8).numpy()).cast("B"))
            out[a : a + part.numel()].copy_(part)

    def finish(self) -> None:
        """Read to the end of the last segment touched and compare its checksums with the manifest's."""
        seg, size = self.entry["segment_bytes"], self.entry["size"]
        if self.pos:
            self._skip(min(size, -(-self.pos // seg) * seg) - self.pos)
            got, want = self.digest.entry()["digests"], self.entry["digests"]
            if got != want[: len(got)]:
                raise CheckpointIntegrityError(
                    f"{self.path}: bytes 0..{self.pos} do not match their checksums in the manifest: "
                    "the file is corrupted"
                )


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < _MAX_INT


def _is_names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(n, str) for n in v)  # empty: no name in the module


def _is_shape(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_is_int(d) for d in v)


def _check_index(index: Any, path: str) -> None:
    """`master_index` (model_states.pt): every field by type, so what follows computes only with ints."""
    if not isinstance(index, dict) or index.get("kind") not in ("flat", "units"):
        raise CheckpointError(
            f"{path}: model_states.pt has no 'master_index' (saved by an older version of zero-offload): "
            "load the checkpoint into an engine and save it again"
        )
    for key in ("keys", "buffers"):
        v = index.get(key)
        if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
            raise CheckpointError(f"{path}: master_index['{key}'] is not a list of names")
    if index["kind"] == "flat":
        params = index.get("params")
        ok = isinstance(params, list) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and _is_names(p[0]) and _is_shape(p[1])
            for p in params
        )
    else:
        units = index.get("units")
        ok = isinstance(units, list) and all(
            isinstance(u, list)
            and all(
                isinstance(p, (list, tuple))
                and len(p) == 3
                and _is_names(p[0])
                and _is_shape(p[1])
                and isinstance(p[2], bool)
                for p in u
            )
            for u in units
        )
    if not ok:
        raise CheckpointError(f"{path}: master_index lists a parameter that is not [names, shape(, trained)]")


class _Checkpoint:
    """The checked metadata of one opened checkpoint directory; `fd(name)`: a listed file, size verified,
    held open until `close()`."""

    def __init__(self, d: OpenDir) -> None:
        self.d, self.path = d, d.path
        path = self.path
        manifest = read_manifest(d)
        if manifest is None:
            raise CheckpointError(
                f"{path}: no {MANIFEST}: not a checkpoint of zero-offload format {FORMAT_VERSION} (format 1 "
                "checkpoints: load them into an engine with allow_pickle=True and save them again)"
            )
        if manifest["format_version"] != FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format {manifest['format_version']}")
        self.listed: Dict[str, Any] = manifest["files"]
        self.world: int = manifest["world_size"]
        self.layout: int = manifest.get("stage3_layout", 1)  # checked by read_manifest
        self.ms = self._load("model_states.pt")
        self.index = self.ms.get("master_index")
        _check_index(self.index, path)
        if not _is_int(self.ms.get("numel")) or not isinstance(self.ms.get("module"), dict):
            raise CheckpointError(f"{path}: model_states.pt has no 'numel' (an int) or no 'module' (a dict)")
        self.ranks = [self._load(f"rank{r}_states.pt") for r in range(self.world)]
        self.parts: List[Tuple[int, int]] = []
        for r in range(self.world):
            name = f"optim_rank{r}.bin"
            if name not in self.listed:
                raise CheckpointError(
                    f"{path}: no {name}: this checkpoint holds no optimizer states, so it has no fp32 "
                    "master weights to convert (use its model_states.pt / save_16bit_model weights)"
                )
            meta = self.ranks[r].get("optimizer")
            part = meta.get("partition") if isinstance(meta, dict) else None
            if not isinstance(part, (list, tuple)) or len(part) != 2 or not all(_is_int(v) for v in part):
                raise CheckpointError(f"{path}: rank{r}_states.pt has no partition [lo, hi] of ints >= 0")
            lo, hi = partition_of(meta)
            if hi < lo or self.listed[name]["size"] < (hi - lo) * 4:
                raise CheckpointIntegrityError(f"{path}: {name} is smaller than rank {r}'s fp32 master")
            self.parts.append((lo, hi))
            self.fd(name)

    def fd(self, name: str) -> int:
        """The open file `name`: listed in the manifest, a regular file of the size it records."""
        if name not in self.listed:
            raise CheckpointIntegrityError(f"{self.path}: {MANIFEST} does not list {name}")
        if not self.d.holds(name):
            self.d.hold(name, verify_size(self.d, name, self.listed[name]))
        return self.d.held(name)

    def _load(self, name: str) -> Dict[str, Any]:
        if name not in self.listed:
            raise CheckpointIntegrityError(f"{self.path}: {MANIFEST} does not list {name}")
        self.d.hold(name, verify_file(self.d, name, self.listed[name]))
        try:  # mmap (of the very file verified): the module's 16-bit weights are read only where used
            obj = torch.load(self.d.fd_path(name), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - checksummed, so a file of another format, or unsafe
            raise CheckpointIntegrityError(
                f"{self.d.name(name)}: unreadable ({weights_only_reason(e)})"
            ) from e
        if not isinstance(obj, dict):
            raise CheckpointIntegrityError(f"{self.d.name(name)}: not a dict")
        return obj


def _check_coverage(ck: _Checkpoint, jobs: List[Tuple[List[str], List[int], Pieces]]) -> None:
    """Each output tensor's elements are read exactly once, from inside the files: the pieces of each
    tile [0, numel) without gap or overlap, and each lies within its file (else an output would keep
    uninitialised memory, or a read run past a file). Raises before anything is read or written."""
    for names, shape, pieces in jobs:
        n, at = math.prod(shape), 0
        for file, offset, a, z, src in sorted(pieces, key=lambda p: p[2]):
            end = offset + (z - a) * src.itemsize
            if a != at or z <= a or end > ck.listed[file]["size"]:
                break
            at = z
        if at != n:
            name = names[0] if names else "a parameter"
            raise CheckpointError(
                f"{ck.path}: master_index does not place every element of {name} (shape {list(shape)}) "
                f"exactly once inside the checkpoint's files ({at} of {n} in order): a malformed index"
            )


def _flat_pieces(ck: _Checkpoint, numel: int) -> List[Pieces]:
    """Stages 0-2: where the elements of each trainable parameter lie (the ranks' slices of the buffer)."""
    spans, covered = [], 0
    for r, (lo, hi) in enumerate(ck.parts):  # stage 0: every rank holds all; rank 0's copy is read
        a, z = max(lo, covered), min(hi, numel)
        if a < z:
            spans.append((f"optim_rank{r}.bin", lo, a, z))
            covered = z
    if covered < numel:
        raise CheckpointError(f"{ck.path}: the ranks' partitions hold {covered} of {numel} master elements")
    out, start = [], 0
    for _, shape in ck.index["params"]:
        n = int(torch.Size(shape).numel())
        pieces = [
            (f, (max(a, start) - lo) * 4, max(a, start) - start, min(z, start + n) - start, torch.float32)
            for f, lo, a, z in spans
            if a < start + n and start < z
        ]
        out.append(pieces)
        start += n
    return out


def _unit_pieces(ck: _Checkpoint) -> List[List[Pieces]]:
    """Stage 3: per unit, per parameter, where its elements lie: the ranks' masters for trained ones,
    their `param_rank<r>.bin` (model dtype) for the others."""
    saved = ck.ranks[0].get("stage3_units", [])
    if not isinstance(saved, list) or not all(
        isinstance(u, (list, tuple)) and len(u) == 3 and isinstance(u[0], str) and _is_int(u[1], 1)
        for u in saved
    ):
        raise CheckpointError(
            f"{ck.path}: rank0_states.pt's 'stage3_units' is not a list of [name, numel, dtype]"
        )
    if len(saved) != len(ck.index["units"]):
        raise CheckpointError(f"{ck.path}: rank0_states.pt lists {len(saved)} units, master_index another")
    result, moff, poff = [], 0, 0
    for params, (name, part, dtype) in zip(ck.index["units"], saved):
        numels = [math.prod(shape) for _, shape, _ in params]
        spans = _unit_spans(numels, ck.world, ck.layout)
        if int(part) != spans[0]:
            raise CheckpointError(
                f"{ck.path}: unit {name}: partition of {part} elements, not its parameters' "
                f"(stage-3 layout {ck.layout}, {ck.world} rank(s))"
            )
        dt = getattr(torch, str(dtype).replace("torch.", ""), None)
        if not isinstance(dt, torch.dtype):
            raise CheckpointError(f"{ck.path}: unit {name}: unknown dtype {dtype!r}")
        size, unit = torch.empty(0, dtype=dt).element_size(), []
        for (_, _, trained), ranks in zip(params, spans[1]):
            pieces = []
            for r, (at, a, z) in enumerate(ranks):
                if trained:
                    pieces.append((f"optim_rank{r}.bin", (moff + at) * 4, a, z, torch.float32))
                else:
                    pieces.append((f"param_rank{r}.bin", poff + at * size, a, z, dt))
            unit.append([p for p in pieces if p[3] > p[2]])
        result.append(unit)
        moff += int(part) if any(t for _, _, t in params) else 0
        poff += int(part) * size
    return result


def _unit_spans(numels: List[int], world: int, layout: int) -> Tuple[int, List[List[Tuple[int, int, int]]]]:
    """(partition elements, per parameter per rank (offset in the rank's partition, [a, z) of the
    parameter)) of a stage-3 unit of parameters of `numels` split over `world` ranks in `layout`."""
    if layout == 1:  # the parameters back to back, split evenly
        part, start, spans = max(1, -(-sum(numels) // world)), 0, []
        for n in numels:
            ranks = []
            for r in range(world):
                a, z = max(start, r * part), min(start + n, (r + 1) * part)
                ranks.append((a - r * part, a - start, max(a, z) - start))
            spans.append(ranks)
            start += n
        return part, spans
    chunks, starts, part = param_shares(numels, world, 0)
    return part, [
        [(at, *chunk_range(n, c, r)) for r in range(world)] for n, c, at in zip(numels, chunks, starts)
    ]


def _dtype(dtype: Union[torch.dtype, str]) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)} (or the torch dtype)")


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: Union[str, os.PathLike],
    tag: Optional[str] = None,
    dtype: Union[torch.dtype, str] = torch.float32,
    exclude_frozen_parameters: bool = False,
) -> Dict[str, torch.Tensor]:
    """The whole model's state dict from a checkpoint of any stage and tier (DeepSpeed's name): trained
    parameters from the fp32 master, consolidated over the ranks, in their shapes; frozen parameters and
    buffers as saved; floating-point tensors as `dtype` (fp32, fp16 or bf16). `tag=None`: the checkpoint
    `latest` names. Keys in the order of `model.state_dict()`; tied parameters share one tensor."""
    out_dtype = _dtype(dtype)
    with open_checkpoint(checkpoint_dir, tag) as d:
        return _state_dict(_Checkpoint(d), out_dtype, exclude_frozen_parameters)


def _state_dict(
    ck: _Checkpoint, out_dtype: torch.dtype, exclude_frozen_parameters: bool
) -> Dict[str, torch.Tensor]:
    index, module = ck.index, ck.ms["module"]
    frozen_ok = not exclude_frozen_parameters
    jobs: List[Tuple[List[str], List[int], Pieces]] = []  # (names, shape, pieces) of the weights to read
    if index["kind"] == "flat":
        for (names, shape), pieces in zip(index["params"], _flat_pieces(ck, int(ck.ms["numel"]))):
            jobs.append((names, shape, pieces))
    else:
        for params, unit in zip(index["units"], _unit_pieces(ck)):
            jobs.extend(
                (names, shape, p) for (names, shape, trained), p in zip(params, unit) if trained or frozen_ok
            )
    readers: Dict[str, _Reader] = {}
    for name in sorted({p[0] for _, _, pieces in jobs for p in pieces}):
        readers[name] = _Reader(ck.fd(name), ck.d.name(name), ck.listed[name])
    _check_coverage(ck, jobs)
    out: Dict[str, torch.Tensor] = {}
    total = sum(torch.Size(shape).numel() for _, shape, _ in jobs) * out_dtype.itemsize
    with progress("zero-to-fp32: reading", total) as bar:
        for names, shape, pieces in jobs:
            value = torch.empty(shape, dtype=out_dtype)
            flat = value.view(-1)
            for file, offset, a, z, src in pieces:
                readers[file].read(offset, flat[a:z], src)
            out.update((n, value) for n in names)
            bar.update(value.numel() * value.element_size())
    for r in readers.values():
        r.finish()
    buffers = set(index["buffers"])
    for key, v in module.items():
        if key not in out and isinstance(v, torch.Tensor) and (frozen_ok or key in buffers):
            out[key] = v.to(out_dtype, copy=True) if v.is_floating_point() else v.clone()
    missing = [k for k in index["keys"] if k not in out and (frozen_ok or k in buffers)]
    if missing:
        raise CheckpointError(f"{ck.path}: no value for {missing[:5]} in model_states.pt")
    return {k: out[k] for k in index["keys"] if k in out}


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: Union[str, os.PathLike],
    output_path: Union[str, os.PathLike],
    tag: Optional[str] = None,
    dtype: Union[torch.dtype, str] = torch.float32,
    safe_serialization: bool = True,
    max_shard_size: Union[int, str] = "5GB",
    exclude_frozen_parameters: bool = False,
    force: bool = False,
) -> List[str]:
    """Write `get_fp32_state_dict_from_zero_checkpoint(...)` as safetensors (or a torch file with
    `safe_serialization=False`); returns the files written. `output_path`: a directory (model.safetensors /
    pytorch_model.bin in it) or a file name with an extension (.safetensors; a torch file: .bin, .pt, ...).
    Above `max_shard_size` the state dict is split into `<stem>-0000k-of-0000n<ext>` shards plus
    `<name>.index.json`, as transformers does. An output holding an earlier export's weights is refused
    (FileExistsError) unless `force`, which removes them first (zero/checkpoint/hf_files.py)."""
    limit = parse_size(max_shard_size)
    target = OutputTarget(os.fspath(output_path), safe_serialization)
    target.check(force)
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, dtype, exclude_frozen_parameters)
    target.check(force)  # again: one may have appeared while converting
    target.remove_previous()
    return write_state_dict(sd, target, limit)


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: Union[str, os.PathLike], tag: Optional[str] = None
) -> torch.nn.Module:
    """DeepSpeed's: load the checkpoint's consolidated fp32 weights into `model`, moved to the CPU first
    (non-strict: keys the checkpoint lacks keep their values); returns `model`. The weights are read
    entirely before the model changes, so a bad checkpoint leaves it as it was."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


if __name__ == "__main__":  # python -m zero.checkpoint.to_fp32 ...: the zero-to-fp32 command (which imports
    runpy.run_module("zero.cli_to_fp32", run_name="__main__")  # this module: run, not imported back)
