"""Stacked bars of benchmarks/out/e2e.json: forward / backward / optimizer time per configuration and engine.

    .venv/bin/python -m benchmarks.plot_e2e [--json benchmarks/out/e2e.json] [--out benchmarks/out/e2e.png]

matplotlib is optional: without it the same breakdown is printed as text bars.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.harness import OUT_DIR

PHASES = (("forward_s", "forward"), ("backward_s", "backward"), ("optimizer_s", "optimizer (after backward)"))


def bars(payload: Dict[str, Any]) -> List[Tuple[str, Dict[str, float], float]]:
    """(label, phase seconds, median step seconds) per configuration and engine, in file order."""
    out = []
    for name, by_engine in payload["results"].items():
        for eng, s in by_engine.items():
            phases = {key: float(s.get(key) or 0.0) for key, _ in PHASES}
            out.append((f"{name}\n{eng}", phases, float(s["step_s"])))
    return out


def text_plot(rows: List[Tuple[str, Dict[str, float], float]], width: int = 60) -> str:
    """A text bar chart of each row's forward, backward and optimizer seconds."""
    longest = max(step for _, _, step in rows) or 1.0
    lines = []
    for label, phases, step in rows:
        bar = "".join(ch * round(phases[key] / longest * width) for (key, _), ch in zip(PHASES, "FBO"))
        lines.append(f"{label.replace(chr(10), ' / '):45s} {bar} {step:.2f} s")
    lines.append("F forward, B backward, O optimizer after backward")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Print the end-to-end results JSON as a text bar chart and save it as an image; the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=os.path.join(OUT_DIR, "e2e.json"))
    ap.add_argument("--out", default=None, help="image path (default: next to the JSON, .png)")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        payload = json.load(f)
    rows = bars(payload)
    print(text_plot(rows))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: text plot only")
        return 0
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows)), 5))
    bottom = [0.0] * len(rows)
    for key, name in PHASES:
        vals = [phases[key] for _, phases, _ in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, (_, _, step) in enumerate(rows):
        ax.text(i, bottom[i], f"{step:.2f} s", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [label for label, _, _ in rows], fontsize=7)
    ax.set_ylabel("seconds per step (median)")
    model = payload.get("model", {})
    ax.set_title(
        f"GPT {payload.get('size', '')} ({model.get('n_layer')}x{model.get('d_model')}, "
        f"{payload.get('dtype', '')}, micro batch {payload.get('micro_batch')})"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
