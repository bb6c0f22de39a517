"""CPU Adam step: offload.ops.CPUAdam against torch.optim.AdamW(fused=True) and (foreach=True).

For each size (default 50M and 200M fp32 params) and layout (one flat tensor, 100 tensors) it times one
optimizer step of each contender, interleaved A B C A B C in one process, and reports the median, steps/s
and bandwidth. A second table compares our step with the fused 16-bit copy-out against torch's fused step
followed by a separate copy of the params into a bf16 buffer, with our copy written by non-temporal stores
(the default) and by plain stores. A third table times plain memory passes over arrays of the same size
(plain read, STREAM scale and triad loops on our own thread pool, then torch's read, copy, triad and
fp32 -> bf16 cast) as the bandwidth reference.

GB/s counts the bytes the memory system moves per element: the program's loads and stores, plus a
read-for-ownership of every line written by a plain store to a line not read first (a cache line must be
read before it can be partly written). Adam reads param, grad, exp_avg, exp_avg_sq and writes back param,
exp_avg, exp_avg_sq: 28 bytes, no RFO. The bf16 copy adds 2 bytes streamed or 2 + 2 plain; torch's separate
cast pass reads 4 and writes 2 + 2. So the fused pass moves 30 bytes against torch's 28 + 8 = 36, a 1.2x
ceiling at equal bandwidth.

To fit in memory every contender updates the same param and grad tensors (values drift differently per
optimizer, which does not change the work done); each keeps its own optimizer state.

The state-dtype table (section `dtypes`) times the functional Adam step over one flat fp32 param with its
states in fp32, bf16 (round to nearest even), bf16 with stochastic rounding and 8-bit block-quantized
codes, interleaved, and reports elements/s and the state bytes per element (param and grad are fp32 in
all four: 8 + 8 bytes moved for them, plus 2 x 4 x 2 / 2 x 2 x 2 / 2 x 2 x 2 / 2 x 1 x 2 for the states,
and 2 x 8 / 2048 for the two absmax arrays of the 8-bit states).

    .venv/bin/python -m benchmarks.bench_cpu_optim [--sizes 50e6,200e6] [--threads 2] [--repeats 5]
        [--sections main,dtypes]
"""

from __future__ import annotations

import argparse
import gc
from typing import Callable, Dict, List

import torch

import offload.ops as ops
from benchmarks.harness import interleave, markdown_table, write_outputs
from offload import _cpu_optim
from offload.ops import _runtime

# Memory-system bytes per element of each contender (see the module docstring).
BYTES = {
    "ours": 28,
    "torch_fused": 28,
    "torch_foreach": 28,
    "ours+copy": 30,
    "ours+copy plain stores": 32,
    "torch_fused+copy": 36,
    "read (sum)": 4,
    "copy fp32": 12,
    "triad fp32": 16,
    "cast fp32->bf16": 8,
    "native read": 4,
    "native scale": 12,
    "native triad": 16,
    "states fp32": 28,
    "states bf16": 20,
    "states bf16+SR": 20,
    "states int8": 16,
}
STATE_BYTES = {"fp32": 8, "bf16": 4, "bf16+SR": 4, "int8": 2}  # per element, both Adam states together


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

    def ours_with_copy(policy: str = "copy") -> None:
        _runtime.set_stream_policy(policy)
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

        _runtime.set_stream_policy("copy")

    def torch_then_copy() -> None:
        fused.step()
        for p, c in zip(params, copies):
            c.copy_(p.detach())

    return {
        "ours+copy": ours_with_copy,
        "ours+copy plain stores": lambda: ours_with_copy("none"),
        "torch_fused+copy": torch_then_copy,
    }


def _state_dtype_contenders(n: int) -> Dict[str, Callable[[], None]]:
    # One flat fp32 param, functional Adam, the four state formats. The states start from a first step so
    # that the 8-bit codes and absmax hold realistic values.
    p = torch.empty(n).uniform_(-1.0, 1.0)
    g = torch.empty(n).uniform_(-1e-2, 1e-2)
    nb = (n + ops.QUANT_BLOCK - 1) // ops.QUANT_BLOCK
    kinds = {
        "fp32": dict(exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n)),
        "bf16": dict(
            exp_avg=torch.zeros(n, dtype=torch.bfloat16), exp_avg_sq=torch.zeros(n, dtype=torch.bfloat16)
        ),
        "bf16+SR": dict(
            exp_avg=torch.zeros(n, dtype=torch.bfloat16),
            exp_avg_sq=torch.zeros(n, dtype=torch.bfloat16),
            stochastic_rounding=True,
            seed=1,
        ),
        "int8": dict(
            exp_avg=torch.zeros(n, dtype=torch.uint8),
            exp_avg_sq=torch.zeros(n, dtype=torch.uint8),
            exp_avg_absmax=torch.zeros(nb),
            exp_avg_sq_absmax=torch.zeros(nb),
        ),
    }
    steps = {k: [0] for k in kinds}

    def make(kind: str) -> Callable[[], None]:
        def run() -> None:
            steps[kind][0] += 1
            ops.adam_update(
                p,
                g,
                step=steps[kind][0],
                lr=1e-4,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                **kinds[kind],
            )

        run()
        return run

    return {f"states {k}": make(k) for k in kinds}


def _bandwidth_references(n: int) -> Dict[str, Callable[[], None]]:
    # Plain loops on our thread pool (offload._cpu_optim.bandwidth_probe: the machine's bandwidth as this
    # process sees it), then torch's own elementwise kernels, over flat arrays of n elements at the
    # benchmark's thread count (torch splits all of these over its threads).
    a = torch.empty(n).uniform_(-1.0, 1.0)
    b = torch.empty(n).uniform_(-1.0, 1.0)
    out = torch.empty(n)
    half = torch.empty(n, dtype=torch.bfloat16)

    # Each returns None: the harness reads a contender's return value as extra numbers.
    def read_sum() -> None:
        a.sum()

    def copy_fp32() -> None:
        out.copy_(a)

    def triad() -> None:
        torch.add(a, b, alpha=0.5, out=out)

    def cast() -> None:
        half.copy_(a)

    def native(kind: str) -> Callable[[], None]:
        def run() -> None:
            _cpu_optim.bandwidth_probe(kind, out.data_ptr(), a.data_ptr(), b.data_ptr(), n)

        return run

    return {
        "native read": native("read"),
        "native scale": native("scale"),
        "native triad": native("triad"),
        "read (sum)": read_sum,
        "copy fp32": copy_fp32,
        "triad fp32": triad,
        "cast fp32->bf16": cast,
    }


def _row(n: int, layout: str, name: str, r, base: float) -> List[object]:
    return [
        f"{n / 1e6:g}M",
        layout,
        name,
        r.median * 1e3,
        n * BYTES[name] / r.median / 1e9,
        n * BYTES[name] / r.minimum / 1e9,
        base / r.median,
        r.minimum * 1e3,
        r.maximum * 1e3,
    ]


def main() -> None:
    """Command line: time offload.ops.CPUAdam against torch's fused and foreach AdamW."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="50e6,200e6", help="comma-separated param counts")
    parser.add_argument("--pieces", default="1,100", help="comma-separated tensor counts per size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sections", default="main,dtypes", help="main (step, copy, bandwidth), dtypes")
    args = parser.parse_args()
    sections = set(args.sections.split(","))

    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    rows: List[List[object]] = []
    copy_rows: List[List[object]] = []
    ref_rows: List[List[object]] = []
    dtype_rows: List[List[object]] = []
    raw: Dict[str, object] = {}
    for n in (int(float(s)) for s in args.sizes.split(",")):
        if "dtypes" in sections:
            results = interleave(_state_dtype_contenders(n), repeats=args.repeats, warmup=1)
            base = results["states fp32"].median
            for name, r in results.items():
                kind = name.split(" ", 1)[1]
                dtype_rows.append(
                    [
                        f"{n / 1e6:g}M",
                        kind,
                        STATE_BYTES[kind],
                        r.median * 1e3,
                        n / r.median / 1e6,
                        n / r.minimum / 1e6,
                        n * BYTES[name] / r.median / 1e9,
                        base / r.median,
                    ]
                )
                raw[f"{n}/dtypes/{name}"] = {"samples_s": r.samples, "median_s": r.median}
            del results
            gc.collect()
        if "main" not in sections:
            continue
        for pieces in (int(s) for s in args.pieces.split(",")):
            for with_copy in (False, True):
                params = _make_params(n, pieces)
                results = interleave(_contenders(params, with_copy), repeats=args.repeats, warmup=1)
                layout = "flat" if pieces == 1 else f"{pieces} tensors"
                base = results["torch_fused+copy" if with_copy else "torch_fused"].median
                for name, r in results.items():
                    (copy_rows if with_copy else rows).append(_row(n, layout, name, r, base))
                    raw[f"{n}/{pieces}/{name}"] = {"samples_s": r.samples, "median_s": r.median}
                del params, results
                gc.collect()
        results = interleave(_bandwidth_references(n), repeats=args.repeats, warmup=1)
        base = results["native triad"].median
        for name, r in results.items():
            ref_rows.append(_row(n, "flat", name, r, base))
            raw[f"{n}/ref/{name}"] = {"samples_s": r.samples, "median_s": r.median}
        del results
        gc.collect()

    headers = [
        "params",
        "layout",
        "contender",
        "median ms",
        "GB/s (median)",
        "GB/s (best)",
        "speedup vs torch",
        "min ms",
        "max ms",
    ]
    dtype_headers = [
        "params",
        "states",
        "state bytes/elem",
        "median ms",
        "M elem/s (median)",
        "M elem/s (best)",
        "GB/s (median)",
        "speedup vs fp32 states",
    ]
    dtype_table = (
        f"Functional Adam step by state dtype, fp32 param and grad, {args.threads} threads, SIMD "
        f"{ops.simd_level()}, {args.repeats} interleaved rounds\n\n"
        + markdown_table(dtype_headers, dtype_rows)
    )
    if "main" not in sections:
        payload = {"threads": args.threads, "simd": ops.simd_level(), "repeats": args.repeats, "runs": raw}
        write_outputs("bench_cpu_optim", payload, dtype_table)
        return
    table = (
        f"Adam step, fp32, {args.threads} threads, SIMD {ops.simd_level()}, "
        f"{args.repeats} interleaved rounds. GB/s: memory-system bytes (28/param); speedup vs torch fused\n\n"
        + markdown_table(headers, rows)
        + "\n\nStep + bf16 copy of the params (30 bytes/param streamed, 32 plain, torch 28 + 8); "
        "speedup vs torch fused + copy\n\n"
        + markdown_table(headers, copy_rows)
        + "\n\nBandwidth reference: plain loops on our pool, then torch's elementwise passes (read 4, "
        "scale/copy 12, triad 16, cast 8 bytes/elem with RFO); 'speedup' is native triad's time over "
        "this row's\n\n" + markdown_table(headers, ref_rows) + ("\n\n" + dtype_table if dtype_rows else "")
    )
    payload = {"threads": args.threads, "simd": ops.simd_level(), "repeats": args.repeats, "runs": raw}
    write_outputs("bench_cpu_optim", payload, table)


if __name__ == "__main__":
    main()
