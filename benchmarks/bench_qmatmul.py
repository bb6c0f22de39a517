"""Linear products on the CPU: x @ W^T from quantized codes, with fp32 or int8 activations, and torch's fp32
matmul of the decoded weight in both of its forms.

    .venv/bin/python -m benchmarks.bench_qmatmul [--bits 4] [--rows 1 4 8 64] [--repeats 7]

For each weight shape of a 7B Llama's MLP (11008 x 4096 and 4096 x 11008; `--shapes` to change) and each
number of input rows: `torch` is `F.linear` on the fp32 weight decoded once beforehand (a decoded model's
matmul, the decode not timed), `torch-transposed` the same product as `(W x^T)^T`
(`zero.stage3.linear_layout.transposed_linear`, what a stage-3 engine on the CPU uses for a multi-row fp32
Linear where its bits equal torch's; "same bits" says whether they do for that shape here), `codes` is
`offload.ops.qmatmul.quantized_linear` (fp32 activations, the engine's default), `codes-int8` the same with
`int8_activations=True` (zero_offload.int8_activations). Contenders alternate (A B C D A B C D), medians of
`--repeats` rounds; ratios are torch's median over the contender's. Writes
benchmarks/out/bench_qmatmul.{json,md}.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from benchmarks.harness import interleave, markdown_table, write_outputs
from offload.config.quantization import WeightQuantSpec
from offload.ops.qmatmul import quantized_linear
from zero.stage3.linear_layout import transposed_linear
from zero.stage3.quant import dequantize, quantize


def contenders(
    rows: int, cols: int, batch: int, spec: WeightQuantSpec
) -> Dict[str, Callable[[], Optional[Dict[str, float]]]]:
    """The four products of one [rows, cols] weight with `batch` input rows."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(rows * cols, generator=gen) * 0.02
    codes, scale, offset = quantize(w, spec)
    decoded = dequantize(codes, scale, offset, spec, rows * cols, torch.float32).view(rows, cols)
    x = torch.randn(batch, cols, generator=gen)
    bits, group = spec.num_bits, spec.group_size

    def run_torch() -> None:
        F.linear(x, decoded)

    def run_transposed() -> None:
        transposed_linear(x, decoded, None)

    def run_codes() -> None:
        quantized_linear(x, codes, scale, offset, bits, group, rows)

    def run_codes_int8() -> None:
        quantized_linear(x, codes, scale, offset, bits, group, rows, int8_activations=True)

    return {
        "torch": run_torch,
        "torch-transposed": run_transposed,
        "codes": run_codes,
        "codes-int8": run_codes_int8,
    }


def same_bits(rows: int, cols: int, batch: int) -> bool:
    """Whether `transposed_linear` gives F.linear's bits for this shape on this machine (random values)."""
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(rows, cols, generator=gen), torch.randn(batch, cols, generator=gen)
    return torch.equal(F.linear(x, w), transposed_linear(x, w, None))


def main(argv: Optional[List[str]] = None) -> None:
    """Command line: time quantized matmuls against dense ones for the given shapes and rows."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 64], help="input rows (tokens)")
    ap.add_argument("--shapes", nargs="+", default=["11008x4096", "4096x11008"], help="out x in features")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/out)")
    args = ap.parse_args(argv)
    spec = WeightQuantSpec(num_bits=args.bits, group_size=args.group_size)
    results: List[Dict[str, Any]] = []
    table: List[List[object]] = []
    for shape in args.shapes:
        rows, cols = (int(v) for v in shape.split("x"))
        for batch in args.rows:
            timed = interleave(contenders(rows, cols, batch, spec), args.repeats)
            base = timed["torch"].median
            equal = same_bits(rows, cols, batch)
            for name, r in timed.items():
                bits = ("yes" if equal else "no") if name == "torch-transposed" else ""
                ops = 2.0 * batch * rows * cols / r.median / 1e9
                results.append(
                    {
                        "shape": shape,
                        "rows": batch,
                        "contender": name,
                        "median_ms": r.median * 1e3,
                        "min_ms": r.minimum * 1e3,
                        "max_ms": r.maximum * 1e3,
                        "gops": ops,
                        "speedup_vs_torch": base / r.median,
                        **({"same_bits_as_torch": equal} if name == "torch-transposed" else {}),
                    }
                )
                table.append([shape, batch, name, r.median * 1e3, ops, base / r.median, bits])
            print(results[-len(timed) :], flush=True)
    md = markdown_table(["weight", "rows", "contender", "median ms", "GOP/s", "vs torch", "same bits"], table)
    write_outputs(
        "bench_qmatmul",
        {"bits": args.bits, "group_size": args.group_size, "repeats": args.repeats, "results": results},
        md,
        args.out,
    )


if __name__ == "__main__":
    main()
