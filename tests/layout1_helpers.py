"""The stage-3 checkpoint of the older partition layout (`stage3_layout` 1: a module's parameters back to
back in one flat buffer, cut into one contiguous range per rank) kept under tests/data/stage3_layout1/, and
the model it was trained from.

`python tests/layout1_helpers.py OUT_DIR`, run on a tree that writes that layout (see tests/data/README.md),
trains `LayoutNet` two steps on two gloo ranks at stage 3, saves the checkpoint to OUT_DIR/ckpt (tag
`global_step2`) and the gathered fp32 weights to OUT_DIR/expected.safetensors. Its module `odd` holds
parameters of 7, 10 and 33 elements and a frozen one of 5: none splits evenly over two ranks, so the
older layout's rank ranges cut through parameters where each parameter split on its own would not."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

LAYOUT1_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "stage3_layout1")
LAYOUT1_TAG = "global_step2"
LAYOUT1_WORLD = 2


class Odd(nn.Module):
    """One stage-3 unit: trained parameters of 7, 10 and 33 elements, a frozen one of 5."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(7))
        self.b = nn.Parameter(torch.randn(10))
        self.c = nn.Parameter(torch.randn(3, 11) / 4)
        self.f = nn.Parameter(torch.randn(5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x * self.a)
        h = torch.cat([h, h[:, :3]], dim=1) * self.b
        h = torch.cat([h, torch.ones_like(h[:, :1])], dim=1) @ self.c.t()
        return torch.cat([h, h[:, :2]], dim=1) * self.f


class LayoutNet(nn.Module):
    """`Odd`, then a Linear of 25 + 5 elements; the forward returns a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.odd = Odd()
        self.head = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.odd(x)).sin().pow(2).mean()


def layout1_model() -> LayoutNet:
    """The model the checkpoint started from (seeded)."""
    torch.manual_seed(0)
    return LayoutNet()


def layout1_config() -> dict:
    """The engine config the checkpoint was trained with."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu"},
        },
    }


def _train_and_save(rank: int, world_size: int, nvme_dir: str, out_dir: str) -> None:
    import zero

    engine, *_ = zero.initialize(model=layout1_model(), config=layout1_config())
    for step in range(2):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x))
        engine.step()
    engine.save_checkpoint(os.path.join(out_dir, "ckpt"), tag=LAYOUT1_TAG)
    master, whole = engine.fp32_master_state_dict(), engine.consolidated_state_dict()
    engine.close()
    if rank == 0:
        from safetensors.torch import save_file

        assert sorted(master) == ["head.bias", "head.weight", "odd.a", "odd.b", "odd.c"], sorted(master)
        weights = {k: master.get(k, v).float().contiguous() for k, v in whole.items()}
        save_file(weights, os.path.join(out_dir, "expected.safetensors"))


def main(out_dir: str) -> None:
    """Write the checkpoint and its expected weights into `out_dir` (created; must not exist)."""
    from pathlib import Path

    from dist_helpers import run_on_ranks

    out = Path(out_dir)
    out.mkdir(parents=True)
    run_on_ranks(_train_and_save, out, world_size=LAYOUT1_WORLD)
    for name in ("nvme", "init", *(f"rank{r}.pt" for r in range(LAYOUT1_WORLD))):
        path = out / name
        if path.is_dir():
            path.rmdir()
        elif path.exists():
            path.unlink()


if __name__ == "__main__":
    main(sys.argv[1])
