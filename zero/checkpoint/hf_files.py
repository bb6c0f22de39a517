"""Where `zero-to-fp32` writes: the output's file names, shards and index, and what an earlier export left.

`OUTPUT` is a file when it names one with an extension (`model.safetensors`, `out.pt`) and is not an
existing directory; otherwise a directory that gets `model.safetensors` (`pytorch_model.bin` without
safetensors). A state dict above the shard size is split as transformers does: `<stem>-0000k-of-0000n<ext>`
plus `<name>.index.json`. An output already holding an earlier export's weights is refused unless `force`,
which first removes exactly those files (the other files of a model directory, `config.json` say, stay): a
sharded export beside an old single file, or the reverse, would otherwise load the old weights.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any, Dict, List

import torch

from zero.checkpoint._output import write_atomic, write_atomic_path

__all__ = ["OutputTarget", "write_state_dict"]

_DIR_BASES = ("model.safetensors", "pytorch_model.bin")


def _safetensors_save() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(
            "safetensors is not installed: pip install safetensors, or write a torch .bin "
            "(safe_serialization=False, --no-safetensors)"
        ) from e
    return save_file


class OutputTarget:
    """The directory and file name an export writes, checked before any work (see the module docstring)."""

    def __init__(self, output_path: str, safe: bool) -> None:
        self.safe = safe
        name = os.path.basename(os.path.normpath(output_path))
        suffix = os.path.splitext(name)[1]
        self.is_file = bool(suffix) and not os.path.isdir(output_path) and not output_path.endswith(os.sep)
        if self.is_file:
            if safe and suffix != ".safetensors":
                raise ValueError(
                    f"{output_path}: a name with an extension is written as a file, and safetensors files "
                    "end in .safetensors: name it *.safetensors, or write a torch file (--no-safetensors, "
                    "safe_serialization=False)"
                )
            if not safe and suffix == ".safetensors":
                raise ValueError(
                    f"{output_path}: a torch file (--no-safetensors) should not end in .safetensors"
                )
            self.dir, self.base = os.path.dirname(os.path.abspath(output_path)), name
        else:
            self.dir, self.base = output_path, _DIR_BASES[0] if safe else _DIR_BASES[1]
        if safe:
            _safetensors_save()  # missing: say so before the work

    def _patterns(self) -> List[re.Pattern]:
        bases = [self.base] if self.is_file else list(_DIR_BASES)
        out = []
        for base in bases:
            stem, ext = os.path.splitext(base)
            out.append(re.compile(rf"{re.escape(base)}(\.index\.json)?"))
            out.append(re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}{re.escape(ext)}"))
        return out

    def previous(self) -> List[str]:
        """Names of the files an earlier export to this output wrote (sorted)."""
        try:
            names = os.listdir(self.dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        pats = self._patterns()
        return sorted(n for n in names if any(p.fullmatch(n) for p in pats))

    def check(self, force: bool) -> None:
        """Refuse an output holding an earlier export's weights, unless `force`."""
        old = self.previous()
        if old and not force:
            raise FileExistsError(
                f"{os.path.join(self.dir, old[0])}: the output already holds an earlier export's weights "
                f"({len(old)} file(s): {', '.join(old[:3])}); pass --force (force=True) to replace them"
            )

    def remove_previous(self) -> None:
        """Remove the files an earlier export wrote (regular files and symlinks only), relative to the
        output directory's descriptor."""
        old = self.previous()
        if not old:
            return
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in old:
                try:
                    if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    pass
            os.fsync(fd)
        finally:
            os.close(fd)


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


def _write(sd: Dict[str, torch.Tensor], file: str, safe: bool) -> None:
    if not safe:
        write_atomic(file, lambda f: torch.save(sd, f))
        return
    save_file = _safetensors_save()
    seen, own = set(), {}
    for k, v in sd.items():  # safetensors refuses tensors sharing memory (tied parameters): one copy each
        own[k] = v.clone() if v.data_ptr() in seen else v
        seen.add(v.data_ptr())
    write_atomic_path(file, lambda tmp: save_file(own, tmp, metadata={"format": "pt"}))  # takes a path


def write_state_dict(sd: Dict[str, torch.Tensor], target: OutputTarget, limit: int) -> List[str]:
    """Write `sd` to `target` (one file, or shards and then their index); returns the paths written."""
    shards = _shards(sd, limit)
    if len(shards) == 1:
        path = os.path.join(target.dir, target.base)
        _write(sd, path, target.safe)
        return [path]
    stem, ext = os.path.splitext(target.base)
    names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}" for i in range(len(shards))]
    written = []
    for keys, name in zip(shards, names):
        _write({k: sd[k] for k in keys}, os.path.join(target.dir, name), target.safe)
        written.append(os.path.join(target.dir, name))
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: n for keys, n in zip(shards, names) for k in keys},
    }
    index_file = os.path.join(target.dir, f"{target.base}.index.json")
    write_atomic(index_file, lambda f: f.write((json.dumps(index, indent=2) + "\n").encode()))
    return [*written, index_file]
