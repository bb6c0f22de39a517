"""A safetensors `safe_open` whose read of one tensor fails: for the tests of a load that breaks half way."""

from __future__ import annotations

from typing import Any, Callable


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
