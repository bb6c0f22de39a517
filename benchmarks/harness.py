"""Shared benchmark plumbing: interleaved A/B runs, medians, ratios, JSON + markdown output.

Every benchmark in this folder measures its competitor in the same process, alternating the contenders
(A B A B ...) so that noise on these shared machines hits both alike, and reports medians and ratios.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


@dataclass
class Result:
    name: str
    samples: List[float] = field(default_factory=list)  # seconds per run
    extra: Dict[str, float] = field(default_factory=dict)

    @property
    def median(self) -> float:
        """Median of the samples."""
        return statistics.median(self.samples)

    @property
    def minimum(self) -> float:
        """Smallest sample."""
        return min(self.samples)

    @property
    def maximum(self) -> float:
        """Largest sample."""
        return max(self.samples)


def interleave(
    contenders: Dict[str, Callable[[], Optional[Dict[str, float]]]],
    repeats: int,
    warmup: int = 1,
) -> Dict[str, Result]:
    """Run each contender `warmup` times, then `repeats` rounds of A B C ... in turn.

    A contender may return a dict of extra per-run numbers (bytes moved, CPU seconds); their medians are
    kept in Result.extra.
    """
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    results = {name: Result(name) for name in contenders}
    extras: Dict[str, Dict[str, List[float]]] = {name: {} for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            more = fn()
            results[name].samples.append(time.perf_counter() - t0)
            for key, value in (more or {}).items():
                extras[name].setdefault(key, []).append(value)
    for name, per_key in extras.items():
        results[name].extra = {key: statistics.median(vals) for key, vals in per_key.items()}
    return results


def machine_info() -> Dict[str, object]:
    """Host, platform, Python, CPU count and date (and the GPU when there is one) for a results file."""
    info: Dict[str, object] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table of `rows` under `headers` (floats to 3 significant digits)."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_outputs(name: str, payload: Dict[str, object], table: str, out_dir: Optional[str] = None) -> str:
    """Write `<name>.json` (payload + machine info) and `<name>.md` (the table); return the JSON path."""
    out_dir = out_dir or OUT_DIR
    os.makedirs(out_dir, exist_ok=True)
    payload = {"benchmark": name, "machine": machine_info(), **payload}
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=2, default=float)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"\nwrote {json_path}")
    return json_path
