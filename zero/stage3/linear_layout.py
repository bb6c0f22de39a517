"""Multi-row fp32 Linear forwards on the CPU computed as (W x^T)^T when that gives torch's bits, faster.

torch computes an `nn.Linear` forward `x W^T + b` with `x` as BLAS's left operand. For a forward with many
rows - a prefill, batch x prompt positions - MKL computes the same product written as `(W x^T)^T` faster on
some CPUs: on a 2-core AMD EPYC (AVX2) 1.5-1.8x faster from 16 to 64 rows at a 7B model's MLP shapes
(benchmarks/bench_qmatmul.py, `torch-transposed`). For those shapes the two forms also gave the same bits
there, but that is a property of the BLAS build and the CPU, not something torch promises. So it is
checked, never assumed: the first forward of each shape (rows, weight rows and columns, bias or not,
torch's thread count) computes both forms and keeps the transposed one for that shape only if every
output bit agrees. That forward returns torch's own result, so no value ever depends on the check; a
shape whose two results differ keeps torch's form for good. With few rows (a decoding step) the two forms
differ in rounding on that machine, and the transposed one is not tried.

`LinearLayouts` wraps the `forward` of each module of a stage-3 model that is exactly `nn.Linear` and has no
instance `forward` of its own (so a quantized Linear keeps the forward that reads its codes, fused.py). The
wrapped forward takes this path only on the CPU with grad mode off, contiguous fp32 input and weight, and
at least `MIN_ROWS` rows; anything else runs the module's own forward. `remove()` puts the original
forwards back.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from zero.stage3.forward_patch import ForwardPatches

__all__ = ["MIN_ROWS", "LinearLayouts", "transposed_linear"]

MIN_ROWS = 16  # fewer rows: MKL's small-matrix paths round differently in the two forms (measured)
_MAX_SHAPES = 1024  # verdicts kept (least recently used dropped): prompt lengths vary from call to call

_Shape = Tuple[int, int, int, bool, int]


def transposed_linear(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """`x2 @ weight^T + bias` for a 2-D `x2` [rows, in], computed as `(weight @ x2^T + bias)^T`; contiguous
    [rows, out] (callers view it, as transformers does)."""
    if bias is None:
        out = torch.mm(weight, x2.t())
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, x2.t())
    return out.t().contiguous()


class _Forward:
    """The forward of one wrapped nn.Linear."""

    def __init__(self, owner: LinearLayouts, module: nn.Linear) -> None:
        self.owner, self.module = owner, module
        self.original: Callable[[torch.Tensor], torch.Tensor] = module.forward

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # torch's name: `module(input=x)` works
        x = input
        w = self.module.weight
        if (
            torch.is_grad_enabled()
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or w.dtype != torch.float32
            or x.dim() < 2
            or not (x.is_contiguous() and w.is_contiguous())  # (a verdict holds for its strides only)
            or x.shape[-1] != w.shape[1]
            or x.numel() < MIN_ROWS * x.shape[-1]
        ):
            return self.original(x)
        return self.owner.linear(x, w, self.module.bias)


class LinearLayouts:
    """Wraps the eligible Linears of `model` (see the module doc) and keeps each shape's verdict."""

    def __init__(self, model: nn.Module) -> None:
        self.transposed = 0  # forwards computed as (W x^T)^T (read by the I/O report)
        self.probes = 0  # forwards that computed both forms to check a new shape
        self._verdicts: OrderedDict[_Shape, bool] = OrderedDict()
        self._patches = ForwardPatches()
        for m in model.modules():
            if type(m) is nn.Linear and ForwardPatches.free(m):
                self._patches.set(m, _Forward(self, m))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """`F.linear(x, weight, bias)`'s exact values, in the transposed form where checked to match."""
        rows = x.numel() // x.shape[-1]
        shape: _Shape = (rows, weight.shape[0], weight.shape[1], bias is not None, torch.get_num_threads())
        verdict = self._verdicts.get(shape)
        if verdict is False:
            self._verdicts.move_to_end(shape)
            return F.linear(x, weight, bias)
        out = transposed_linear(x.reshape(rows, x.shape[-1]), weight, bias)
        if verdict is None:
            want = F.linear(x, weight, bias)
            self._verdicts[shape] = torch.equal(want.reshape(rows, -1), out)
            if len(self._verdicts) > _MAX_SHAPES:
                self._verdicts.popitem(last=False)
            self.probes += 1
            return want
        self._verdicts.move_to_end(shape)
        self.transposed += 1
        return out.view(*x.shape[:-1], weight.shape[0])

    def verdict(self, rows: int, out_features: int, in_features: int, bias: bool) -> Optional[bool]:
        """Whether the transposed form was found to match torch's for this shape at the current thread
        count (None: not checked yet)."""
        return self._verdicts.get((rows, out_features, in_features, bias, torch.get_num_threads()))

    def remove(self) -> None:
        """Give every wrapped module its own forward back."""
        self._patches.remove()
