"""CPU Adam step: offload.ops.CPUAdam against torch.optim.AdamW(fused=True) and (foreach=True).

For each size (default 50M and 200M fp32 params) and layout (one flat tensor, 100 tensors) it times one
optimizer step of each contender, interleaved A B C A B C in one process, and reports the median, steps/s
and effective bandwidth (28 bytes/param: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg,
exp_avg_sq). A second table compares our step with the fused 16-bit copy-out (30 bytes/param) against
torch's fused step followed by a separate copy of the params into a bf16 buffer.

To fit in memory every contender updates the same param and grad tensors (values drift differently per
optimizer, which does not change the work done); each keeps its own optimizer state.

    .venv/bin/python -m benchmarks.bench_cpu_optim [--sizes 50e6,200e6] [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
from typing import Callable, Dict, List

import torch

import offload.ops as ops
from benchmarks.harness import interleave, markdown_table, write_outputs

BYTES_ADAM = 28
BYTES_ADAM_COPY = 30


def _make_params(n: int, pieces: int) -> List[torch.Tensor]:
    flat = torch.empty(n).uniform_(-1.0, 1.0)
    grad = torch.empty(n).uniform_(-1e-2, 1e-2)
    sizes = [n // pieces] * pieces
    sizes[-1] += n - sum(sizes)
    params = []
    for p_view, g_view in zip(flat.split(sizes), grad.split(sizes)):
        p = torch.nn.Parameter(p_view)
        p.grad = g_view
        params.append(p)
    return params


def _contenders(params: List[torch.Tensor], with_copy: bool) -> Dict[str, Callable[[], None]]:
    lr, wd = 1e-4, 0.01
    ours = ops.CPUAdam(params, lr=lr, weight_decay=wd)
    fused = torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=True)
    if not with_copy:
        foreach = torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=True)
        return {"ours": ours.step, "torch_fused": fused.step, "torch_foreach": foreach.step}

    # Our functional step writes the bf16 copy in the same pass; torch needs a second pass over params.
    copies = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    step = [0]

    def ours_with_copy() -> None:
        step[0] += 1
        for p, c, (m, v) in zip(params, copies, states):
            ops.adam_update(
                p,
                p.grad,
                m,
                v,
                step=step[0],
                lr=lr,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=wd,
                param_copy=c,
            )

    def torch_then_copy() -> None:
        fused.step()
        for p, c in zip(params, copies):
            c.copy_(p.detach())

    return {"ours+copy": ours_with_copy, "torch_fused+copy": torch_then_copy}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="50e6,200e6", help="comma-separated param counts")
    parser.add_argument("--pieces", default="1,100", help="comma-separated tensor counts per size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    rows, copy_rows, raw = [], [], {}
    for n in (int(float(s)) for s in args.sizes.split(",")):
        for pieces in (int(s) for s in args.pieces.split(",")):
            for with_copy in (False, True):
                params = _make_params(n, pieces)
                results = interleave(_contenders(params, with_copy), repeats=args.repeats, warmup=1)
                layout = "flat" if pieces == 1 else f"{pieces} tensors"
                per_param = BYTES_ADAM_COPY if with_copy else BYTES_ADAM
                base = results["torch_fused+copy" if with_copy else "torch_fused"].median
                for name, r in results.items():
                    ms = r.median * 1e3
                    row = [
                        f"{n / 1e6:g}M",
                        layout,
                        name,
                        ms,
                        1.0 / r.median,
                        n * per_param / r.median / 1e9,
                        base / r.median,
                        r.minimum * 1e3,
                        r.maximum * 1e3,
                    ]
                    (copy_rows if with_copy else rows).append(row)
                    raw[f"{n}/{pieces}/{name}"] = {"samples_s": r.samples, "median_s": r.median}
                del params, results
                gc.collect()

    headers = [
        "params",
        "layout",
        "contender",
        "median ms",
        "steps/s",
        "GB/s",
        "speedup vs torch fused",
        "min ms",
        "max ms",
    ]
    table = (
        f"Adam step, fp32, {args.threads} threads, SIMD {ops.simd_level()}, "
        f"{args.repeats} interleaved rounds\n\n"
        + markdown_table(headers, rows)
        + f"\n\nStep + bf16 copy of the params ({BYTES_ADAM_COPY} bytes/param)\n\n"
        + markdown_table(headers, copy_rows)
    )
    payload = {"threads": args.threads, "simd": ops.simd_level(), "repeats": args.repeats, "runs": raw}
    write_outputs("bench_cpu_optim", payload, table)


if __name__ == "__main__":
    main()
