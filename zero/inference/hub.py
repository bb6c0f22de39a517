"""Where the checkpoint named to `zero.from_pretrained` lives: a local directory, or a Hugging Face Hub
repository id resolved, as transformers' `from_pretrained` resolves one, to its snapshot in the Hub cache
(`huggingface_hub.snapshot_download`: downloaded when missing, taken from the cache offline).

Only what the load reads is fetched: config.json, generation_config.json and the safetensors weights with
their index (no `pytorch_model.bin`: pickled weights are never loaded). The Hub keyword arguments of
transformers' `from_pretrained` (`revision`, `token`, `cache_dir`, `local_files_only`, `force_download`,
`proxies`) go to `snapshot_download`; given with a local directory they are refused, not ignored.

Only a name that can be nothing but a repository id goes to the Hub: a `str` of the form `name` or
`org/name` (huggingface_hub's `validate_repo_id`) that does not look like a path. A missing local path is an
error, never a download: a `pathlib.Path` (or other `os.PathLike`), a name starting with `/`, `./`, `../` or
`~`, one with a separator other than the one `/` of `org/name`, one that exists but is not a directory, and
one whose first component exists here (`models/llama` beside a `models` directory).
"""

from __future__ import annotations

import errno
import os
from typing import Any, Dict, Union

__all__ = ["HUB_KWARGS", "HUB_PATTERNS", "checkpoint_dir", "looks_like_a_path"]

HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")
HUB_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json")


def looks_like_a_path(path: Union[str, os.PathLike]) -> str:
    """Why `path` names a local path rather than a Hub repository id ("" when it could be an id)."""
    if not isinstance(path, str):
        return f"it is a {type(path).__name__}, not a repository id string"
    name = path
    if name.startswith(("/", "./", "../", "~")) or name in (".", "..", "~"):
        return "it starts like a path"
    seps = [s for s in (os.sep, os.altsep) if s and s != "/"]
    if any(s in name for s in seps) or name.count("/") > 1:
        return "it has more path separators than a repository id's org/name"
    if os.path.lexists(name):
        return "it exists here but is not a directory"
    if "/" in name and os.path.lexists(name.split("/", 1)[0]):
        return f"{name.split('/', 1)[0]!r} exists here, so it is a path inside it"
    return ""


def checkpoint_dir(path: Union[str, os.PathLike], hub_kwargs: Dict[str, Any]) -> str:
    """The local directory of the checkpoint `path`: itself when it is a directory, else the snapshot of the
    Hub repository it names (`hub_kwargs`: HUB_KWARGS for `snapshot_download`). Raises FileNotFoundError
    naming `path` when it is neither, or when the snapshot cannot be had (offline and not cached, no such
    repository or revision, no access), and ValueError for Hub arguments given with a local directory."""
    name = os.fspath(path)
    if os.path.isdir(name):
        if hub_kwargs:
            raise ValueError(
                f"zero.from_pretrained: {', '.join(sorted(hub_kwargs))} applies to a Hub repository id; "
                f"{name!r} is a local directory"
            )
        return name
    why = looks_like_a_path(path)
    if why:
        raise FileNotFoundError(
            errno.ENOENT,
            f"zero.from_pretrained: no checkpoint directory at this path (it is a local path, not a Hugging "
            f"Face Hub repository id: {why}; the Hub is asked only for an id such as 'org/name')",
            name,
        )
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise FileNotFoundError(
            errno.ENOENT, "zero.from_pretrained needs a local checkpoint directory", name
        ) from None
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise FileNotFoundError(
            errno.ENOENT,
            "zero.from_pretrained needs a local checkpoint directory or a Hugging Face Hub repository id",
            name,
        ) from None
    try:
        return str(snapshot_download(repo_id=name, allow_patterns=list(HUB_PATTERNS), **hub_kwargs))
    except (OSError, ValueError) as e:  # huggingface_hub's errors derive from these
        raise FileNotFoundError(
            errno.ENOENT,
            f"{name!r} is not a local directory, and its Hugging Face Hub snapshot could not be had "
            f"({type(e).__name__}: {' '.join(str(e).split())[:300]})",
            name,
        ) from e
