"""The sweep: which aio configurations to measure, parsed and validated before any I/O starts."""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .errors import BenchError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# The order of the keys is the order of the `aio` config section and of every table the tool prints.
GRID_KEYS = (
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "single_submit",
    "overlap_events",
    "backend",
)
KNOWN_BACKENDS = ("io_uring", "aio", "psync")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}


def parse_size(text: Any, what: str = "size") -> int:
    """'4M', '256KiB', '1.5G', 4096 -> bytes. Units are binary (K = 1024)."""
    if isinstance(text, bool):
        raise BenchError(f"{what}: expected a byte count such as 4096, '256K' or '1G', got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise BenchError(f"{what}: expected a byte count such as 4096, '256K' or '1G', got {text!r}")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise BenchError(f"{what}: must be positive, got {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """`nbytes` as a short size with a binary unit (e.g. 1M, 256K), as the grid labels use."""
    for unit, scale in (("G", GiB), ("M", MiB), ("K", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


@dataclass(frozen=True)
class AioParams:
    """One point of the sweep: exactly the keys of the config's `aio` section."""

    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool
    overlap_events: bool
    backend: str

    def as_dict(self) -> Dict[str, Any]:
        """The settings as a dict."""
        return asdict(self)

    def label(self) -> str:
        # Only the settings that differ from the engine's usual ones are named, to keep lines short.
        """A short label: backend, block size, queue depth, threads, and the flags that differ from the
        defaults."""
        text = f"{self.backend} bs={format_size(self.block_size)} qd={self.queue_depth}"
        text += f" t={self.intra_op_parallelism}"
        if self.single_submit:
            text += " single_submit"
        if not self.overlap_events:
            text += " no-overlap"
        return text


def default_grid(backends: Sequence[str]) -> Dict[str, List[Any]]:
    # Block sizes around DeepSpeed's usual 1 MiB; queue depths from shallow to deep; one and two threads
    # (more rarely helps a single NVMe and this tool must stay usable on small machines).
    """The full grid of aio parameters the bench sweeps for `backends`."""
    return {
        "block_size": [128 * KiB, 512 * KiB, 1 * MiB, 4 * MiB],
        "queue_depth": [8, 32, 128],
        "intra_op_parallelism": [1, 2],
        "single_submit": [False],
        "overlap_events": [True],
        "backend": list(backends),
    }


def quick_grid(backends: Sequence[str]) -> Dict[str, List[Any]]:
    """A small grid of aio parameters for `backends` (the --quick run)."""
    return {
        "block_size": [256 * KiB, 1 * MiB, 4 * MiB],
        "queue_depth": [8, 32],
        "intra_op_parallelism": [1],
        "single_submit": [False],
        "overlap_events": [True],
        "backend": list(backends),
    }


def read_grid_argument(text: str) -> Mapping[str, Any]:
    """`--grid` takes inline JSON or the name of a JSON file."""
    source = "--grid"
    if not text.lstrip().startswith("{") and os.path.exists(text):
        source = f"--grid file {text}"
        try:
            with open(text) as f:
                text = f.read()
        except OSError as e:
            raise BenchError(f"{source}: cannot read: {e.strerror} (errno {e.errno})") from None
    try:
        grid = json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchError(f"{source}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(grid, dict):
        raise BenchError(f'{source}: expected a JSON object such as {{"block_size": ["1M"]}}')
    return grid


def _as_list(key: str, value: Any) -> List[Any]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise BenchError(f"--grid: key '{key}' has an empty list")
    return values


def _int_value(key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BenchError(f"--grid: '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _bool_value(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise BenchError(f"--grid: '{key}' must be true or false, got {value!r}")
    return value


def expand_grid(
    grid: Mapping[str, Any], available_backends: Sequence[str], base: Optional[Mapping[str, Any]] = None
) -> List[AioParams]:
    """Cartesian product of the grid's values; keys left out take their single value from `base`.

    Every point is checked here (types, ranges, backend availability, and finally by the config schema
    itself) so that a typo ends the run before the first byte is written.
    """
    unknown = sorted(set(grid) - set(GRID_KEYS))
    if unknown:
        raise BenchError(f"--grid: unknown key '{unknown[0]}' (allowed: {', '.join(GRID_KEYS)})")
    base = dict(base or {})
    axes: Dict[str, List[Any]] = {}
    for key in GRID_KEYS:
        raw = _as_list(key, grid[key]) if key in grid else _as_list(key, base[key])
        if key == "block_size":
            values: List[Any] = []
            for v in raw:
                try:
                    values.append(parse_size(v, "--grid: 'block_size'"))
                except BenchError as e:
                    raise BenchError(str(e)) from None
        elif key in ("queue_depth", "intra_op_parallelism"):
            values = [_int_value(key, v) for v in raw]
        elif key in ("single_submit", "overlap_events"):
            values = [_bool_value(key, v) for v in raw]
        else:
            values = []
            for v in raw:
                if v == "auto":
                    if not available_backends:
                        raise BenchError("--grid: 'backend' auto: no I/O backend is usable on this system")
                    v = available_backends[0]
                if v not in KNOWN_BACKENDS:
                    raise BenchError(
                        f"--grid: 'backend' must be one of {', '.join(KNOWN_BACKENDS)} or auto, got {v!r}"
                    )
                if v not in available_backends:
                    raise BenchError(
                        f"--grid: backend '{v}' is not usable on this system "
                        f"(usable: {', '.join(available_backends) or 'none'})"
                    )
                values.append(v)
        # Keep the user's order but measure each value once.
        axes[key] = list(dict.fromkeys(values))
    points = [AioParams(*combo) for combo in itertools.product(*(axes[k] for k in GRID_KEYS))]
    for point in points:
        check_with_schema(point)
    return points


def check_with_schema(point: AioParams) -> None:
    """The config schema is the judge of what the engine accepts; a grid point it rejects is a bad grid."""
    from offload.config import ConfigError, validate_aio_section

    try:
        validate_aio_section({"aio": point.as_dict()})
    except ConfigError as e:
        raise BenchError(f"--grid: {point.label()} is not a valid aio config: {e}") from None
