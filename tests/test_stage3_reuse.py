"""stage3_max_reuse_distance: units whose next use comes soon are kept whole instead of fetched again."""

from __future__ import annotations

import pytest
import torch
from stage3_helpers import TiedLM, TwiceMLP, attach, s3_config

from zero.examples.models import GPT, GPTConfig

TINY_GPT = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32)


def run_steps(model: torch.nn.Module, cfg: dict, loss_fn, steps: int = 3) -> tuple:
    """Passes (forward + backward) through stage 3; returns losses, gradients, the partitioner."""
    part, col = attach(model, cfg)
    losses, grads = [], []
    for _ in range(steps):
        col.grads.clear()
        loss = loss_fn(model)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append(dict(col.grads))
    return losses, grads, part


def fetch_counts(model_fn, loss_fn, tier: str, tmp_path, distance: int, **extra) -> tuple:
    torch.manual_seed(3)
    model = model_fn()
    cfg = s3_config(tier, tmp_path / f"d{distance}", stage3_max_reuse_distance=distance, **extra)
    (tmp_path / f"d{distance}").mkdir(exist_ok=True)
    losses, grads, part = run_steps(model, cfg, loss_fn)
    # the first pass only records the order; count the fetches of the last one
    part.take_io_report()
    part.peak_live_numel = part.live_numel
    loss = loss_fn(model)
    loss.backward()
    losses.append(loss.detach().clone())
    io = part.take_io_report()
    out = (losses, grads, io.gathers, io.param_reads, part.peak_live_numel, part)
    assert part.live_full_bytes == 0  # whatever was kept for reuse is freed when backward ends
    part.close()
    return out


CASES = {
    # the same layer called twice: its second call comes right after the first
    "twice": (TwiceMLP, lambda m: m(torch.ones(4, 8)).square().sum()),
    # a tied embedding read again by the output head
    "tied": (TiedLM, lambda m: m(torch.arange(12).view(2, 6)).logsumexp(-1).sum()),
    # the last layers turn around from forward into backward
    "gpt": (lambda: GPT(TINY_GPT), lambda m: m(torch.arange(32).view(2, 16) % 64, torch.ones(2, 16).long())),
}


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_large_reuse_distance_fetches_less_with_identical_results(case, tier, tmp_path):
    model_fn, loss_fn = CASES[case]
    off = fetch_counts(model_fn, loss_fn, tier, tmp_path, distance=0)
    on = fetch_counts(model_fn, loss_fn, tier, tmp_path, distance=10**9)
    losses0, grads0, gathers0, reads0, _, _ = off
    losses1, grads1, gathers1, reads1, _, part1 = on
    assert gathers1 < gathers0
    if tier == "nvme":
        assert reads1 < reads0  # every gather saved is an NVMe read saved
    assert part1.use_trace.reuse_keeps > 0
    # the kept units are the same values: losses and gradients bit-exact
    assert all(torch.equal(a, b) for a, b in zip(losses0, losses1))
    for g0, g1 in zip(grads0, grads1):
        assert g0.keys() == g1.keys()
        assert all(torch.equal(g0[k], g1[k]) for k in g0)


def test_distance_counts_elements_between_uses(tmp_path):
    """GPT: the head's next use is right after its forward (distance 0 elements); the first block's comes
    after every other unit's two uses. A distance just below that keeps the last layers only."""
    torch.manual_seed(3)
    model = GPT(TINY_GPT)
    part, _ = attach(model, s3_config("cpu", tmp_path, stage3_max_reuse_distance=1))
    x = torch.arange(32).view(2, 16) % 64
    for _ in range(2):
        model(x, x).backward()
    part.take_io_report()
    model(x, x).backward()
    # distance 1: only a unit used again with nothing in between is kept: the head (forward, then its own
    # backward next); every other unit is gathered twice (forward and backward)
    assert part.use_trace.order[len(part.units) - 1 : len(part.units) + 1] == [part.units[-1].index] * 2
    assert part.take_io_report().gathers == 2 * len(part.units) - 1
    part.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_kept_units_stay_within_max_live_parameters(tier, tmp_path):
    torch.manual_seed(3)
    probe, _ = attach(GPT(TINY_GPT), s3_config("cpu", tmp_path))
    largest = max(u.numel for u in probe.units)
    total = sum(u.numel for u in probe.units)
    probe.close()
    model_fn, loss_fn = CASES["gpt"]
    max_live = 3 * largest  # room for a few units, far from the whole model
    assert max_live < total
    bound = {"stage3_max_live_parameters": max_live}
    free = fetch_counts(model_fn, loss_fn, tier, tmp_path, distance=0, **bound)
    kept = fetch_counts(model_fn, loss_fn, tier, tmp_path, distance=10**9, **bound)
    unbounded = fetch_counts(model_fn, loss_fn, tier, tmp_path, distance=10**9)
    assert kept[4] <= max(max_live, free[4])  # peak live elements: never above max_live because of reuse
    assert unbounded[4] > max_live  # without the bound the same run keeps more than max_live
    assert unbounded[2] < kept[2] < free[2]  # fewer gathers the more may be kept
    assert all(torch.equal(a, b) for a, b in zip(free[0], kept[0]))


class MaybeTwice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 3)
        self.twice = True
        self.a_present_in_b: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.twice:
            x = self.a(x)
        return self.b(x)


def test_changed_order_frees_what_was_kept(tmp_path):
    """A pass that leaves the recorded order drops kept units at once (they would never be reused)."""
    torch.manual_seed(3)
    model = MaybeTwice()
    part, _ = attach(model, s3_config("cpu", tmp_path))
    # registered after stage 3's own pre-hook, so it runs after b's fetch; reads the unit, not the
    # parameter (reading `model.a.weight` inside a forward would gather it)
    unit_a = model.a.weight.ds_unit
    model.b.register_forward_pre_hook(lambda m, args: model.a_present_in_b.append(unit_a.present))
    x = torch.ones(4, 8)
    for _ in range(2):
        model(x).sum().backward()
    assert part.use_trace.reuse_keeps > 0  # a, between its two calls
    model.twice = False
    model.a_present_in_b.clear()
    with torch.no_grad():
        model(x)  # a was kept after its call for the second one that does not come: b's fetch frees it
    assert model.a_present_in_b == [False]
    assert not part.use_trace.kept and part.live_full_bytes == 0
    part.close()
