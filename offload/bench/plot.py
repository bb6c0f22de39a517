"""Bandwidth against block size: read and write side by side, one line per (backend, queue depth).

Where the grid also varies threads, single_submit or overlap_events, each point of a line is the best over
those (the legend says so), so a line shows what that backend and depth can reach at that block size.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .grid import format_size
from .outputs import write_atomically

_LINESTYLES = {"io_uring": ("-", "o"), "aio": ("--", "s"), "psync": (":", "^")}


def plot_available() -> bool:
    """Whether matplotlib can be imported (plots are skipped without it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _lines(results: Sequence[Dict[str, Any]], op: str) -> Dict[Tuple[str, int], Dict[int, float]]:
    lines: Dict[Tuple[str, int], Dict[int, float]] = {}
    for r in results:
        value = r.get(f"{op}_gbps")
        if value is None:
            continue
        points = lines.setdefault((r["backend"], r["queue_depth"]), {})
        points[r["block_size"]] = max(value, points.get(r["block_size"], 0.0))
    return lines


def _varied(results: Sequence[Dict[str, Any]]) -> List[str]:
    keys = ("intra_op_parallelism", "single_submit", "overlap_events")
    return [k for k in keys if len({r[k] for r in results}) > 1]


def plot_results(
    results: Sequence[Dict[str, Any]],
    out_path: str,
    title: str,
    fio: Optional[Sequence[Dict[str, Any]]] = None,
    overwrite: bool = True,
) -> None:
    """Draw the plot into `out_path` (format from its extension, PNG without one), written atomically."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    ops = [op for op in ("read", "write") if _lines(results, op)]
    fig, axes = plt.subplots(1, max(1, len(ops)), figsize=(6.5 * max(1, len(ops)), 4.8), squeeze=False)
    depths = sorted({r["queue_depth"] for r in results})
    colors = plt.get_cmap("tab10")
    block_sizes = sorted({r["block_size"] for r in results})
    varied = _varied(results)
    ymax = 0.0
    for ax, op in zip(axes[0], ops):
        best: Optional[Tuple[float, int, str]] = None
        for (backend, depth), points in sorted(_lines(results, op).items()):
            xs = sorted(points)
            ys = [points[x] for x in xs]
            style, marker = _LINESTYLES.get(backend, ("-.", "d"))
            ax.plot(
                xs,
                ys,
                linestyle=style,
                marker=marker,
                color=colors(depths.index(depth) % 10),
                label=f"{backend} qd={depth}",
            )
            for x, y in zip(xs, ys):
                if best is None or y > best[0]:
                    best = (y, x, f"{backend} qd={depth}")
            ymax = max(ymax, max(ys))
        if best is not None:
            ax.plot(
                [best[1]],
                [best[0]],
                marker="*",
                markersize=16,
                color="gold",
                markeredgecolor="black",
                zorder=5,
            )
        for c in fio or ():
            if c.get("op") == op and c.get("fio_gbps"):
                ax.plot(
                    [c["aio"]["block_size"]],
                    [c["fio_gbps"]],
                    marker="X",
                    markersize=10,
                    color="black",
                    linestyle="none",
                    label=f"fio, same parameters ({c['fio_iomem']})",
                )
                ymax = max(ymax, c["fio_gbps"])
        ax.set_xscale("log", base=2)
        ax.set_xticks(block_sizes)
        ax.set_xticklabels([format_size(b) for b in block_sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size")
        ax.set_ylabel(f"{op} bandwidth (GB/s, 10^9 B/s)")
        # The winner goes in the title (with the star on its point): an annotation would hide lines.
        headline = f"{op}: best {best[0]:.2f} GB/s with {best[2]} bs={format_size(best[1])}" if best else op
        ax.set_title(
            headline + (f"\n(each point: best over {', '.join(varied)})" if varied else ""), fontsize=10
        )
        ax.grid(True, alpha=0.3)
        # Below the panel: a legend inside would hide the low-bandwidth lines, which matter most.
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    for ax in axes[0]:
        ax.set_ylim(0, ymax * 1.15 if ymax > 0 else 1)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fmt = os.path.splitext(out_path)[1][1:].lower() or "png"
    try:
        write_atomically(
            out_path, lambda f: fig.savefig(f, format=fmt, dpi=110, bbox_inches="tight"), overwrite=overwrite
        )
    finally:
        plt.close(fig)
