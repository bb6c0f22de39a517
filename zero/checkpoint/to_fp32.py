"""zero-to-fp32: the fp32 master weights of a checkpoint as one whole state dict (DeepSpeed's zero_to_fp32).

    from zero.checkpoint.to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint("ckpt"))   # tag: `latest`

or `zero-to-fp32 ckpt out/` (zero/cli_to_fp32.py; docs/engine.md). Any stage, any tier: every rank's
`optim_rank<r>.bin` starts with its partition of the fp32 master, wherever the optimizer states lived while
training, and `master_index` (model_states.pt) says which parameter each element is - stages 0-2: the trained
parameters back to back in one flat buffer, a slice [lo, hi) per rank; stage 3: one flat buffer per module
(unit), split evenly over the ranks, the units with trained parameters back to back in each rank's master.
Frozen parameters and buffers come in the model's dtype: from model_states.pt, at stage 3 from the ranks'
`param_rank<r>.bin`.

No GPU, no process group: plain reads straight into the output tensors (through a bounded buffer when the
dtype changes), each file once, front to back, every byte read checked against the manifest's checksums;
`.pt` files load with `torch.load(weights_only=True)`. Every error is raised before any output is written;
each output file is written atomically (`write_atomic`), a shard index last.
"""

from __future__ import annotations

import json
import os
import re
import runpy
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from offload.progress import progress
from zero.checkpoint._files import (
    FORMAT_VERSION,
    MANIFEST,
    StreamDigest,
    read_manifest,
    verify_file,
    verify_size,
    write_atomic,
)
from zero.checkpoint._state import check_tag, partition_of, weights_only_reason
from zero.errors import CheckpointError, CheckpointIntegrityError

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
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})

Pieces = List[Tuple[str, int, int, int, torch.dtype]]  # (file, byte offset, element lo, hi, dtype in file)


def resolve_checkpoint(checkpoint_dir: Union[str, os.PathLike], tag: Optional[str] = None) -> str:
    """The directory of checkpoint `tag` in `checkpoint_dir`; `tag=None`: the one the `latest` file names
    (or `checkpoint_dir` itself when it is a checkpoint, holding a manifest and no `latest`)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir} does not exist")
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest) and os.path.isfile(os.path.join(checkpoint_dir, MANIFEST)):
            return checkpoint_dir  # the tag's directory itself
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"{latest} does not exist: name the checkpoint with tag= (--tag)")
        with open(latest) as f:
            tag = f.read().strip()
    tag = check_tag(tag)
    path, old = os.path.join(checkpoint_dir, tag), os.path.join(checkpoint_dir, f".{tag}.old")
    # `.old`: a save of this tag died between moving the previous one aside and renaming (as load does)
    if not os.path.isdir(path) and os.path.isdir(old):
        return old
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist (tag {tag!r})")
    return path


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
    """One checkpoint file read front to back, every byte on the way hashed and checked against the
    manifest's checksum of its segment; `read` calls must come at increasing offsets."""

    def __init__(self, path: str, entry: Dict[str, Any]) -> None:
        self.path, self.entry, self.pos = path, entry, 0
        self.digest = StreamDigest(int(entry["segment_bytes"]))
        self.f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by finish()

    def _take(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = self.f.readinto(view[done:])
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
        seg, size = int(self.entry["segment_bytes"]), int(self.entry["size"])
        if self.pos:
            self._skip(min(size, -(-self.pos // seg) * seg) - self.pos)
            got, want = self.digest.entry()["digests"], self.entry["digests"]
            if got != want[: len(got)]:
                raise CheckpointIntegrityError(
                    f"{self.path}: bytes 0..{self.pos} do not match their checksums in the manifest: "
                    "the file is corrupted"
                )
        self.f.close()


class _Checkpoint:
    """The checked metadata of one checkpoint directory; `file(name)` is a listed file, size verified."""

    def __init__(self, path: str) -> None:
        self.path = path
        manifest = read_manifest(path)
        if manifest is None:
            raise CheckpointError(
                f"{path}: no {MANIFEST}: not a checkpoint of zero-offload format {FORMAT_VERSION} (format 1 "
                "checkpoints: load them into an engine with allow_pickle=True and save them again)"
            )
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format {manifest.get('format_version')}")
        self.listed: Dict[str, Any] = manifest["files"]
        self.world = int(manifest["world_size"])
        self.ms = self._load("model_states.pt")
        self.index = self.ms.get("master_index")
        if not isinstance(self.index, dict) or self.index.get("kind") not in ("flat", "units"):
            raise CheckpointError(
                f"{path}: model_states.pt has no 'master_index' (saved by an older version of zero-offload): "
                "load the checkpoint into an engine and save it again"
            )
        self.ranks = [self._load(f"rank{r}_states.pt") for r in range(self.world)]
        for r in range(self.world):
            name = f"optim_rank{r}.bin"
            if name not in self.listed:
                raise CheckpointError(
                    f"{path}: no {name}: this checkpoint holds no optimizer states, so it has no fp32 "
                    "master weights to convert (use its model_states.pt / save_16bit_model weights)"
                )
            lo, hi = partition_of(self.ranks[r]["optimizer"])
            if self.listed[name]["size"] < (hi - lo) * 4:
                raise CheckpointIntegrityError(f"{path}: {name} is smaller than rank {r}'s fp32 master")
            self.file(name)

    def file(self, name: str) -> str:
        """The path of `name`, checked to be listed in the manifest and of the size it records."""
        if name not in self.listed:
            raise CheckpointIntegrityError(f"{self.path}: {MANIFEST} does not list {name}")
        file = os.path.join(self.path, name)
        verify_size(file, self.listed[name])
        return file

    def _load(self, name: str) -> Dict[str, Any]:
        file = self.file(name)
        verify_file(file, self.listed[name])
        try:  # mmap: the module's 16-bit weights are read only where they are used
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - checksummed, so a file of another format, or unsafe
            raise CheckpointIntegrityError(f"{file}: unreadable ({weights_only_reason(e)})") from e


def _flat_pieces(ck: _Checkpoint, numel: int) -> List[Pieces]:
    """Stages 0-2: where the elements of each trainable parameter lie (the ranks' slices of the buffer)."""
    spans, covered = [], 0
    for r, rs in enumerate(ck.ranks):  # stage 0: every rank holds all; rank 0's copy is read
        lo, hi = partition_of(rs["optimizer"])
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
    if len(saved) != len(ck.index["units"]):
        raise CheckpointError(f"{ck.path}: rank0_states.pt lists {len(saved)} units, master_index another")
    result, moff, poff = [], 0, 0
    for params, (name, part, dtype) in zip(ck.index["units"], saved):
        numels = [int(torch.Size(shape).numel()) for _, shape, _ in params]
        if int(part) != max(1, -(-sum(numels) // ck.world)):
            raise CheckpointError(
                f"{ck.path}: unit {name}: partition of {part} elements, not its parameters'"
            )
        dt = getattr(torch, str(dtype).replace("torch.", ""), None)
        if not isinstance(dt, torch.dtype):
            raise CheckpointError(f"{ck.path}: unit {name}: unknown dtype {dtype!r}")
        size, unit, start = torch.empty(0, dtype=dt).element_size(), [], 0
        for (_, _, trained), n in zip(params, numels):
            pieces = []
            for r in range(ck.world):
                a, z = max(start, r * part), min(start + n, (r + 1) * part)
                if a < z:
                    at = a - r * part
                    if trained:
                        pieces.append(
                            (f"optim_rank{r}.bin", (moff + at) * 4, a - start, z - start, torch.float32)
                        )
                    else:
                        pieces.append((f"param_rank{r}.bin", poff + at * size, a - start, z - start, dt))
            unit.append(pieces)
            start += n
        result.append(unit)
        moff += int(part) if any(t for _, _, t in params) else 0
        poff += int(part) * size
    return result


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
    ck = _Checkpoint(resolve_checkpoint(checkpoint_dir, tag))
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
        readers[name] = _Reader(ck.file(name), ck.listed[name])
    out: Dict[str, torch.Tensor] = {}
    total = sum(torch.Size(shape).numel() for _, shape, _ in jobs) * out_dtype.itemsize
    bar = progress("zero-to-fp32: reading", total)
    try:
        for names, shape, pieces in jobs:
            value = torch.empty(shape, dtype=out_dtype)
            flat = value.view(-1)
            for file, offset, a, z, src in pieces:
                readers[file].read(offset, flat[a:z], src)
            out.update((n, value) for n in names)
            bar.update(value.numel() * value.element_size())
        for r in readers.values():
            r.finish()
    finally:
        bar.close()
        for r in readers.values():
            r.f.close()
    buffers = set(index["buffers"])
    for key, v in module.items():
        if key not in out and isinstance(v, torch.Tensor) and (frozen_ok or key in buffers):
            out[key] = v.to(out_dtype, copy=True) if v.is_floating_point() else v.clone()
    missing = [k for k in index["keys"] if k not in out and (frozen_ok or k in buffers)]
    if missing:
        raise CheckpointError(f"{ck.path}: no value for {missing[:5]} in model_states.pt")
    return {k: out[k] for k in index["keys"] if k in out}


def _shards(sd: Dict[str, torch.Tensor], limit: int) -> List[List[str]]:
    shards: List[List[str]] = [[]]
    size = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    return shards


def _safetensors_save() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(
            "safetensors is not installed: pip install safetensors, or write a torch .bin "
            "(safe_serialization=False, --no-safetensors)"
        ) from e
    return save_file


def _write(sd: Dict[str, torch.Tensor], file: str, safe: bool) -> None:
    if not safe:
        write_atomic(file, lambda tmp: torch.save(sd, tmp))
        return
    save_file = _safetensors_save()
    seen, own = set(), {}
    for k, v in sd.items():  # safetensors refuses tensors sharing memory (tied parameters): one copy each
        own[k] = v.clone() if v.data_ptr() in seen else v
        seen.add(v.data_ptr())
    write_atomic(file, lambda tmp: save_file(own, tmp, metadata={"format": "pt"}))


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: Union[str, os.PathLike],
    output_path: Union[str, os.PathLike],
    tag: Optional[str] = None,
    dtype: Union[torch.dtype, str] = torch.float32,
    safe_serialization: bool = True,
    max_shard_size: Union[int, str] = "5GB",
    exclude_frozen_parameters: bool = False,
) -> List[str]:
    """Write `get_fp32_state_dict_from_zero_checkpoint(...)` as safetensors (or a torch .bin with
    `safe_serialization=False`); returns the files written. `output_path`: a directory (model.safetensors /
    pytorch_model.bin in it) or a file name ending in .safetensors / .bin. Above `max_shard_size` the state
    dict is split into `<stem>-0000k-of-0000n<ext>` shards plus `<name>.index.json`, as transformers does."""
    limit = parse_size(max_shard_size)
    output_path = os.fspath(output_path)
    ext = ".safetensors" if safe_serialization else ".bin"
    if output_path.endswith((".safetensors", ".bin")):
        if not output_path.endswith(ext):
            raise ValueError(f"{output_path}: safe_serialization={safe_serialization} writes {ext} files")
        out_dir, base = os.path.dirname(os.path.abspath(output_path)), os.path.basename(output_path)
    else:
        out_dir, base = output_path, "model.safetensors" if safe_serialization else "pytorch_model.bin"
    if safe_serialization:
        _safetensors_save()  # missing: say so before the work
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, dtype, exclude_frozen_parameters)
    shards = _shards(sd, limit)
    if len(shards) == 1:
        _write(sd, os.path.join(out_dir, base), safe_serialization)
        return [os.path.join(out_dir, base)]
    stem = base[: -len(ext)]
    names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}" for i in range(len(shards))]
    written = []
    for keys, name in zip(shards, names):
        _write({k: sd[k] for k in keys}, os.path.join(out_dir, name), safe_serialization)
        written.append(os.path.join(out_dir, name))
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: n for keys, n in zip(shards, names) for k in keys},
    }
    index_file = os.path.join(out_dir, f"{base}.index.json")
    write_atomic(index_file, lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2) + "\n"))
    return [*written, index_file]


if __name__ == "__main__":  # python -m zero.checkpoint.to_fp32 ...: the zero-to-fp32 command (which imports
    runpy.run_module("zero.cli_to_fp32", run_name="__main__")  # this module: run, not imported back)


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
