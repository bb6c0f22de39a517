"""Shared pieces of the stage-3 tests: configs, a gradient collector, small models."""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zero.stage3 import Stage3Partitioner, Unit


def s3_config(tier: str, nvme_dir: Optional[str] = None, **extra_zero) -> dict:
    off = {"device": tier}
    if tier == "nvme":
        off.update(nvme_path=str(nvme_dir), buffer_size=1000, buffer_count=2, max_in_cpu=0)
    off.update(extra_zero.pop("offload_param", {}))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": off}
    zero.update(extra_zero)
    return {"zero_optimization": zero}


class GradCollector:
    """A gradient sink (zero.stage3.grads.GradSink) that rebuilds each parameter's (this rank's share of
    the) gradient by name."""

    def __init__(self) -> None:
        self.grads: Dict[str, torch.Tensor] = {}
        self.calls = 0

    def accumulator(self, unit: Unit) -> None:
        return None  # every unit's reduced partition comes through partition_ready

    def unit_final(self, unit: Unit) -> None:
        pass

    def partition_ready(self, unit: Unit, part: torch.Tensor) -> None:
        self.calls += 1
        for s in unit.slices():
            g = part[s.part_lo : s.part_hi].clone()
            if s.name in self.grads:
                self.grads[s.name] = self.grads[s.name] + g
            else:
                self.grads[s.name] = g

    def full(self, unit_param_name: str) -> torch.Tensor:
        return self.grads[unit_param_name]


def attach(model: nn.Module, cfg: dict) -> tuple:
    col = GradCollector()
    part = Stage3Partitioner(cfg, grad_sink=col)
    part.attach(model)
    return part, col


class MLP(nn.Module):
    def __init__(self, d: int = 16, h: int = 40, n: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.hidden = nn.ModuleList(nn.Linear(h, h) for _ in range(n))
        self.out = nn.Linear(h, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


class TwiceMLP(nn.Module):
    """The same layer applied twice (and its output used in place), like a weight-shared RNN step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x).relu_()
        x = self.a(x).relu_()
        return self.b(x)


class TiedLM(nn.Module):
    """A tied embedding: the model's own forward reads `emb.weight` for the output head via F.linear."""

    def __init__(self, vocab: int = 50, d: int = 12) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(idx)))
        return F.linear(h, self.emb.weight)


class SharedModuleLM(nn.Module):
    """A tied head as its own module holding the embedding's Parameter (`head.weight = emb.weight`)."""

    def __init__(self, vocab: int = 40, d: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))
