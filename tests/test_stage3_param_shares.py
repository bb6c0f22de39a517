"""Stage 3 splits each parameter over the ranks on its own, as DeepSpeed does: with c = ceil(numel / W) on W
ranks, rank r's `ds_tensor` holds elements [r * c, (r + 1) * c) of the flattened parameter, the last ranks'
tails zero-padded, and `ds_tensor.numel() == ds_tensor.ds_numel == c` whatever the module's other
parameters. Gathers, gradient reduce-scatters, optimizer steps and checkpoints (zero-to-fp32 too) follow
that layout: one module with parameters of 7, 10 and 33 elements on two and three gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
from dist_helpers import run_on_ranks
from stage3_helpers import attach, s3_config
from torch import nn

import zero
import zero.utils as ds_utils
from zero.checkpoint.to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zero.stage3 import GatheredParameters, Unit


class Odd(nn.Module):
    """One module (one stage-3 unit) with parameters of 7, 10 and 33 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(7))
        self.b = nn.Parameter(torch.randn(10))
        self.c = nn.Parameter(torch.randn(3, 11) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x * self.a)
        h = torch.cat([h, h[:, :3]], dim=1) * self.b
        return torch.cat([h, torch.ones_like(h[:, :1])], dim=1) @ self.c.t()


class OddNet(nn.Module):
    """Two units: `Odd`, then a Linear of 15 + 5 elements; the forward returns a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.odd = Odd()
        self.head = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.odd(x)).sin().pow(2).mean()


def _model() -> OddNet:
    torch.manual_seed(0)
    return OddNet()


def _input(seed: int) -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(seed))


def _gathered(model: nn.Module) -> dict:
    out = {}
    for n, p in model.named_parameters():
        with GatheredParameters([p]):
            out[n] = p.detach().clone()
    return out


def _shares(rank, world_size, nvme_dir, out_dir):
    res = {}
    for tier in ("none", "cpu"):
        model = _model()
        part, col = attach(model, s3_config(tier))
        res[tier] = {
            n: (p.ds_numel, tuple(p.ds_shape), p.ds_tensor.numel(), p.ds_tensor.ds_numel, p.ds_tensor.clone())
            for n, p in model.named_parameters()
        }
        res[tier, "gathered"] = _gathered(model)
        model(_input(rank)).backward()  # each rank its own input: the reduced gradient is their sum
        res[tier, "grads"] = {n: g.clone() for n, g in col.grads.items()}
        part.close()
    return res


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_each_parameter_is_split_as_deepspeed_splits_it(world, tmp_path):
    ranks, _ = run_on_ranks(_shares, tmp_path, world_size=world)
    ref = _model()
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for r in range(world):
        ref(_input(r)).backward()  # gradients summed over the ranks' inputs
    for tier in ("none", "cpu"):
        for r, res in enumerate(ranks):
            for n, (ds_numel, ds_shape, numel, share_numel, share) in res[tier].items():
                full = want[n].reshape(-1)
                c = math.ceil(full.numel() / world)
                expect = torch.zeros(c)
                lo, hi = min(full.numel(), r * c), min(full.numel(), (r + 1) * c)
                expect[: hi - lo] = full[lo:hi]
                assert (ds_numel, ds_shape) == (full.numel(), tuple(want[n].shape)), (tier, r, n)
                assert numel == share_numel == c, (tier, r, n, numel, share_numel, c)
                assert torch.equal(share, expect), (tier, r, n)
                assert torch.equal(res[tier, "gathered"][n], want[n]), (tier, r, n)
                grad = dict(ref.named_parameters())[n].grad.reshape(-1)[lo:hi]
                got = res[tier, "grads"].get(n, torch.zeros(0))
                torch.testing.assert_close(got, grad, rtol=1e-6, atol=1e-7, msg=f"{tier} rank {r} {n}")


def _config(world_size, nvme_dir):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
    }


def _steps(engine, start, n):
    losses = []
    for step in range(start, start + n):
        loss = engine(_input(100 + step))  # the same batch on every rank: the averaged gradient is exact
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _fp32(engine):
    return {n: v.float().clone() for n, v in zero.consolidated_state_dict(engine).items()}


def _train_and_checkpoint(rank, world_size, nvme_dir, out_dir):
    cfg = _config(world_size, nvme_dir)
    engine, *_ = zero.initialize(model=_model(), config=cfg)
    shares = {n: p.ds_tensor.numel() for n, p in engine.module.named_parameters()}
    losses = _steps(engine, 0, 3)
    engine.save_checkpoint(f"{out_dir}/ckpt", tag="t3")
    saved = _fp32(engine)
    named = list(engine.module.named_parameters())
    local = {n: ds_utils.safe_get_local_fp32_param(p) for n, p in named}  # DeepSpeed's: the padded chunk
    full = {n: ds_utils.safe_get_full_fp32_param(p) for n, p in named}
    shares = (shares, local, full)
    want_next = _steps(engine, 3, 2)
    want_params = _fp32(engine)
    engine.close()
    torch.manual_seed(9)
    resumed, *_ = zero.initialize(model=OddNet(), config=cfg)
    resumed.load_checkpoint(f"{out_dir}/ckpt", tag="t3")
    loaded = _fp32(resumed)
    got_next = _steps(resumed, 3, 2)
    got_params = _fp32(resumed)
    refused = _old_layout_refused(resumed, out_dir)
    resumed.close()
    return shares, losses, saved, loaded, (want_next, want_params), (got_next, got_params), refused


def _old_layout_refused(engine, out_dir):
    """The error of loading a checkpoint labelled with the older stage-3 layout (None: it loaded)."""
    import zero.checkpoint.save as save

    save.STAGE3_LAYOUT = 1  # a checkpoint as written before parameters were split on their own
    try:
        engine.save_checkpoint(f"{out_dir}/old", tag="t1")
    finally:
        save.STAGE3_LAYOUT = 2
    try:
        engine.load_checkpoint(f"{out_dir}/old", tag="t1")
    except ValueError as e:
        return str(e)
    return None


def test_two_ranks_train_as_one_and_their_checkpoint_round_trips(tmp_path):
    """Bit for bit the one-rank run, close to torch's AdamW; the checkpoint loads (and one labelled with
    the older layout is refused) and converts with zero-to-fp32 to the model's values."""
    (r0, r1), _ = run_on_ranks(_train_and_checkpoint, tmp_path)
    cfg = _config(1, None)
    one, *_ = zero.initialize(model=_model(), config=cfg)
    one_losses = _steps(one, 0, 3)
    one_params = _fp32(one)
    one.close()
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        ref(_input(100 + step)).backward()
        opt.step()
        opt.zero_grad()
    sizes = {"odd.a": 4, "odd.b": 5, "odd.c": 17, "head.weight": 8, "head.bias": 3}  # ceil(numel / 2)
    for r, (shares, losses, saved, loaded, want, got, refused) in enumerate((r0, r1)):
        # a multi-rank checkpoint of the older layout is refused, naming it
        assert refused is not None and "stage-3 partition layout 1" in refused, refused
        assert "zero-to-fp32" in refused, refused
        shares, local, full = shares
        assert shares == sizes
        for n, c in sizes.items():
            flat = saved[n].reshape(-1)
            expect = torch.zeros(c)
            expect[: len(flat[r * c : (r + 1) * c])] = flat[r * c : (r + 1) * c]
            assert torch.equal(local[n], expect), (r, n)
            assert torch.equal(full[n], saved[n]), (r, n)
        assert losses == one_losses  # the same batch on both ranks: bit for bit the one-rank run
        for n, v in one_params.items():
            assert torch.equal(saved[n], v), n
            torch.testing.assert_close(v, dict(ref.named_parameters())[n].detach(), rtol=1e-5, atol=1e-6)
        assert all(torch.equal(loaded[n], v) for n, v in saved.items())
        assert got[0] == want[0] and all(torch.equal(got[1][n], v) for n, v in want[1].items())
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="t3")
    assert set(fp32) == set(r0[2]) and all(torch.equal(fp32[n], v) for n, v in r0[2].items())


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_pack_and_unpack_move_between_the_ranks_partitions_and_the_flat_buffer(world):
    params = [
        nn.Parameter(torch.arange(n, dtype=torch.float32) + 100 * k) for k, n in enumerate((7, 10, 33, 1))
    ]
    names = [f"p{k}" for k in range(len(params))]
    units = [Unit(0, "m", params, names, world, r, torch.device("cpu")) for r in range(world)]
    u = units[0]
    assert u.part_numel == sum(math.ceil(p.numel() / world) for p in params)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    full = torch.cat([flat, torch.zeros(u.padded_numel - u.numel)])
    rows = torch.full((u.padded_numel,), float("nan"))
    u.pack(full, rows)
    for r, unit in enumerate(units):
        part = rows.view(world, u.part_numel)[r]
        want = torch.zeros(u.part_numel)
        for i, p in enumerate(params):
            c, at = math.ceil(p.numel() / world), unit.part_offsets[i]
            piece = p.detach().reshape(-1)[r * c : (r + 1) * c]
            want[at : at + piece.numel()] = piece
        assert torch.equal(part, want), (world, r)
        assert torch.equal(unit.partition_of(full), want), (world, r)
    back = torch.full((u.padded_numel,), float("nan"))
    u.unpack(rows, back)
    assert torch.equal(back, full)
