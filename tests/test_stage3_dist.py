"""Stage 3 over two gloo ranks equals one rank: outputs, gradients, GatheredParameters, Init."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_on_ranks

from zero.examples.models import GPT, GPTConfig

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)
# Each rank's gradient is the sum of two half-batch gradients where one process computes them in one go:
# float rounding differs by ~1e-7 relative; a lost or misplaced partition is off by far more.
GRAD_ATOL = 1e-6


def _config(tier: str, nvme: str) -> dict:
    off = {"device": tier}
    if tier == "nvme":
        off.update(nvme_path=nvme, buffer_size=2000, buffer_count=3, max_in_cpu=0)
    return {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": off}}


def _batches():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 256, (4, 16), generator=g)
    y = torch.randint(0, 256, (4, 16), generator=g)
    return x, y


def _rank_main(rank: int, world: int, nvme: str, out_dir: str) -> dict:
    from zero.stage3 import GatheredParameters, Init, Stage3Partitioner, SummingSink

    x, y = _batches()
    half = slice(rank * 2, rank * 2 + 2)
    results = {}
    for tier in ("none", "cpu", "nvme"):
        torch.manual_seed(0)
        if tier == "nvme":
            with Init(config=_config(tier, nvme)) as zi:
                model = GPT(TINY)
        else:
            model = GPT(TINY)
        shares = {}

        class Collect(SummingSink):
            def partition_ready(self, unit, g, shares=shares):
                for s in unit.slices():
                    shares[s.name] = (s.param_lo, s.param_hi, g[s.part_lo : s.part_hi].clone())

        # under Init: the Init's partitioner, taken over with the sink; else a new one
        part = Stage3Partitioner.for_model(model, _config(tier, nvme), grad_sink=Collect())
        if tier == "nvme":
            assert part is zi.partitioner
        losses = []
        for _ in range(2):
            shares.clear()
            loss = model(x[half], y[half])
            loss.backward()
            losses.append(loss.detach())
        results[tier] = {"losses": losses, "shares": dict(shares), "part": [u.part_numel for u in part.units]}
        if tier == "cpu":
            w = model.blocks[1].fc.weight
            with GatheredParameters([w], modifier_rank=1):
                if rank == 1:
                    w.data.fill_(0.25)
            with GatheredParameters([w]):
                results["modified"] = torch.equal(w, torch.full_like(w, 0.25))
        part.close()
    return results


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    results, _ = run_on_ranks(_rank_main, tmp_path_factory.mktemp("s3dist"))
    return results


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_two_ranks_equal_one(two_rank_results, tier):
    torch.manual_seed(0)
    ref = GPT(TINY)
    x, y = _batches()
    # The two ranks' gradients are summed (unscaled, as in stages 1-2): compare with the sum of the
    # two half-batch losses.
    halves = [ref(x[r * 2 : r * 2 + 2], y[r * 2 : r * 2 + 2]) for r in range(2)]
    (halves[0] + halves[1]).backward()
    for r, res in enumerate(two_rank_results):
        for loss in res[tier]["losses"]:
            assert torch.equal(loss, halves[r].detach())
    for name, p in ref.named_parameters():
        got = torch.zeros(p.numel())
        covered = torch.zeros(p.numel(), dtype=torch.int32)
        for res in two_rank_results:
            if name in res[tier]["shares"]:
                lo, hi, g = res[tier]["shares"][name]
                got[lo:hi] = g
                covered[lo:hi] += 1
        assert torch.equal(covered, torch.ones_like(covered)), name  # every element owned by one rank
        torch.testing.assert_close(got, p.grad.reshape(-1), rtol=0, atol=GRAD_ATOL, msg=name)
    # each rank holds half of every unit (rounded up)
    assert two_rank_results[0][tier]["part"] == two_rank_results[1][tier]["part"]


def test_gathered_parameters_modifier_rank_broadcasts(two_rank_results):
    assert all(res["modified"] for res in two_rank_results)
