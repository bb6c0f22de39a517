"""Where the checkpoint named to `zero.from_pretrained` lives: a local directory, or a Hugging Face Hub
repository id resolved, as transformers' `from_pretrained` resolves one, to its snapshot in the Hub cache
(`huggingface_hub.snapshot_download`: downloaded when missing, taken from the cache offline).

Only what the load reads is fetched: config.json, generation_config.json and the safetensors weights with
their index (no `pytorch_model.bin`: pickled weights are never loaded). The Hub keyword arguments of
transformers' `from_pretrained` (`revision`, `token`, `cache_dir`, `local_files_only`, `force_download`,
`proxies`) go to `snapshot_download`; given with a local directory they are refused, not ignored.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Dict, Union

__all__ = ["HUB_KWARGS", "HUB_PATTERNS", "checkpoint_dir"]

HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")
HUB_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json")


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
