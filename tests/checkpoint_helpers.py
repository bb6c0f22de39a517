"""Checkpoint tests' helpers: a file's manifest entry as it is now (`digest_file`), and a safetensors
`safe_open` whose read of one tensor fails, for the tests of a load that breaks half way."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict

from zero.checkpoint._files import digest_fd


def digest_file(path: str, segment: int) -> Dict[str, Any]:
    """The manifest entry of file `path` as it is now, digested in segments of `segment` bytes (what a
    checkpoint's save records), for tests that edit a checkpoint the way anyone who can write it could."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return digest_fd(fd, segment, os.fstat(fd).st_size, path)
    finally:
        os.close(fd)


def failing_safe_open(real: Callable[..., Any], failing_key: str) -> type:
    """A drop-in for `safetensors.safe_open` (`real`) that raises RuntimeError("simulated read error") when
    `failing_key` is read and behaves as `real` otherwise."""

    class Failing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.f = real(*args, **kwargs)

        def __enter__(self) -> Failing:
            self.f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.f.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def get_tensor(self, key: str) -> Any:
            if key == failing_key:
                raise RuntimeError("simulated read error")
            return self.f.get_tensor(key)

    return Failing
