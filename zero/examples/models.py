"""A small GPT-style decoder in plain torch, and a byte-level corpus, for the demo, tests and benchmarks.

Nothing here depends on the engine: the same model trains under plain torch and under `zero.initialize`,
which is how the tests compare the two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "config_for_params", "corpus_bytes", "get_batch"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the small GPT: vocabulary, sequence length, layers, heads and width."""

    vocab_size: int = 256  # byte-level: any text trains without a tokenizer
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    dropout: float = 0.0


class Linear(nn.Linear):
    """nn.Linear initialised once, GPT-2 style: N(0, 0.02) weights, zero bias.

    Re-initialising after torch's default init would fill every weight twice (seconds at 350M parameters) and,
    under zero.Init, gather every partitioned layer once more to do it."""

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: normal weights (std 0.02), zero bias."""
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding initialised once with N(0, 0.02) (see Linear)."""

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: normal weights (std 0.02)."""
        nn.init.normal_(self.weight, std=0.02)


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-norm causal self-attention, then the GELU MLP, each added to the residual."""
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for y in (q, k, v))
        dropout = self.drop.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """Decoder-only transformer: token + position embeddings, pre-LN blocks, untied output head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when `targets` is given."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def num_params(cfg: GPTConfig) -> int:
    """The number of parameters of a GPT built from `cfg`."""
    d, v = cfg.d_model, cfg.vocab_size
    per_block = 12 * d * d + 13 * d
    return v * d + cfg.seq_len * d + cfg.n_layer * per_block + 2 * d + d * v


def config_for_params(target: int, seq_len: int = 128, vocab_size: int = 256) -> GPTConfig:
    """A GPTConfig of roughly `target` parameters (d_model a multiple of 64, about d_model/128 layers)."""
    best = GPTConfig(vocab_size=vocab_size, seq_len=seq_len)
    for d in range(64, 8192, 64):
        n_layer = max(1, round(target / (12 * d * d)))
        cfg = GPTConfig(
            vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=max(1, d // 64), d_model=d
        )
        if abs(num_params(cfg) - target) < abs(num_params(best) - target) and n_layer <= max(2, d // 64):
            best = cfg
    return best


def corpus_bytes() -> torch.Tensor:
    """Training text that ships with Python: the source of a few stdlib modules, as a uint8 tensor."""
    import argparse
    import inspect
    import textwrap

    chunks = []
    for mod in (argparse, inspect, textwrap):
        with open(os.path.abspath(mod.__file__), "rb") as f:
            chunks.append(f.read())
    return torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8)


def get_batch(
    data: torch.Tensor, batch: int, seq_len: int, step: int, seed: int = 0
) -> Tuple[torch.Tensor, ...]:
    """Batch number `step` of a deterministic stream: the same (step, seed) always gives the same batch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
    x = torch.stack([data[s : s + seq_len] for s in starts.tolist()]).long()
    y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts.tolist()]).long()
    return x, y
