"""Stage 3 on one rank: partitioned parameters give the same outputs and gradients as plain torch."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from stage3_helpers import MLP, SharedModuleLM, TiedLM, TwiceMLP, attach, s3_config

from offload.swap.resident import resident_plan
from zero.examples.models import GPT, GPTConfig
from zero.stage3 import PartitionStatus, Stage3Partitioner, Unit, register_external_parameter

TIERS = ["none", "cpu", "nvme"]
TINY_GPT = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)


def reference_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    out = loss_fn(model)
    out.backward()
    return out.detach(), {n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()}


def check_step(ref, model, col, loss_fn, steps=2):
    ref_out, ref_grads = reference_grads(ref, loss_fn)
    for _ in range(steps):
        col.grads.clear()
        out = loss_fn(model)
        out.backward()
        # Same kernels on the same values in the same order: bit-exact, not just close.
        assert torch.equal(out.detach(), ref_out)
        assert set(col.grads) == set(ref_grads)
        for name, g in ref_grads.items():
            assert torch.equal(col.grads[name], g), name


@pytest.mark.parametrize("tier", TIERS)
def test_gpt_forward_and_grads_bit_exact(tier, tmp_path):
    torch.manual_seed(0)
    ref = GPT(TINY_GPT)
    model = copy.deepcopy(ref)
    # reuse distance 0: every unit is freed after each use, so the peak shows partitioning at work
    part, col = attach(model, s3_config(tier, tmp_path, stage3_max_reuse_distance=0))
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    check_step(ref, model, col, lambda m: m(x, y), steps=3)
    assert part.live_full_bytes == 0  # everything released after backward
    largest = max(u.nbytes for u in part.units)
    io = part.take_io_report()
    assert io.peak_full_bytes <= 2 * largest  # a layer and its neighbour at most, never the model
    if tier == "nvme":
        assert io.param_prefetch_hits > 0 and io.param_prefetch_hits == io.param_prefetches
        files = sorted(os.listdir(part.store.swap_dir))
        assert "blocks.0.qkv.param.swp" in files and "tok.param.swp" in files
        assert all(os.stat(os.path.join(part.store.swap_dir, f)).st_mode & 0o777 == 0o600 for f in files)
    part.close()


@pytest.mark.parametrize("tier", TIERS)
def test_mlp_bit_exact(tier, tmp_path):
    torch.manual_seed(1)
    ref = MLP()
    model = copy.deepcopy(ref)
    part, col = attach(model, s3_config(tier, tmp_path))
    x = torch.randn(5, 16)
    check_step(ref, model, col, lambda m: m(x).square().mean())
    part.close()


def test_released_params_carry_deepspeed_metadata():
    model = MLP()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    part, _ = attach(model, s3_config("cpu"))
    for n, p in model.named_parameters():
        assert p.numel() == 0 and p.ds_status is PartitionStatus.NOT_AVAILABLE
        assert p.ds_shape == shapes[n] and p.ds_numel == shapes[n].numel()
        assert p.ds_name == n and p.ds_partition_range == (0, p.ds_numel)
    assert [u.name for u in part.units] == ["inp", "hidden.0", "hidden.1", "hidden.2", "out"]
    part.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_module_called_twice_with_inplace_outputs(tier, tmp_path):
    torch.manual_seed(2)
    ref = TwiceMLP()
    model = copy.deepcopy(ref)
    part, col = attach(model, s3_config(tier, tmp_path))
    x = torch.randn(4, 8)
    check_step(ref, model, col, lambda m: m(x).sum())
    part.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_tied_weight_used_outside_its_module(tier, tmp_path):
    torch.manual_seed(3)
    ref = TiedLM()
    model = copy.deepcopy(ref)
    part, col = attach(model, s3_config(tier, tmp_path))
    idx = torch.randint(0, 50, (3, 7))
    check_step(ref, model, col, lambda m: F.cross_entropy(m(idx).view(-1, 50), idx.view(-1)), steps=3)
    # detected on first use and registered as external to the root, which now gathers it itself
    assert model.emb.weight.ds_unit in part.hooks.externals[model]
    part.close()


def test_shared_parameter_in_two_modules(tmp_path):
    torch.manual_seed(4)
    ref = SharedModuleLM()
    model = copy.deepcopy(ref)
    assert model.head.weight is model.emb.weight
    part, col = attach(model, s3_config("nvme", tmp_path))
    assert len(part.units) == 2  # emb (shared weight) and mix; head owns nothing new
    idx = torch.randint(0, 40, (2, 5))
    check_step(ref, model, col, lambda m: m(idx).logsumexp(-1).sum())
    part.close()


def test_register_external_parameter_for_a_hidden_use():
    torch.manual_seed(5)

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.w = [self.emb.weight]  # read through a list, not a module attribute: not detectable

        def forward(self, idx):
            return F.linear(self.emb(idx), self.w[0])

    ref = Hidden()
    model = copy.deepcopy(ref)
    model.w = [model.emb.weight]
    part, col = attach(model, s3_config("cpu"))
    idx = torch.tensor([[1, 2, 3]])
    with pytest.raises(RuntimeError):
        model(idx)
    register_external_parameter(model, model.emb.weight)
    check_step(ref, model, col, lambda m: m(idx).sum())
    part.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_no_grad_eval_and_persistence(tier, tmp_path):
    torch.manual_seed(6)
    ref = GPT(TINY_GPT).eval()
    model = copy.deepcopy(ref)
    part, _ = attach(model, s3_config(tier, tmp_path, stage3_param_persistence_threshold=100))
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want = ref(x)
        for _ in range(2):
            assert torch.equal(model(x), want)
    persistent = [u for u in part.units if u.persistent]
    assert persistent and all(u.numel < 100 for u in persistent)  # LayerNorms stay gathered
    assert all(u.present == u.persistent for u in part.units)
    assert part.live_full_bytes == sum(u.nbytes for u in persistent)
    part.close()


def test_unused_parameters_get_zero_gradients():
    class PartlyUsed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(3, 3)
            self.unused = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.used(x)

    model = PartlyUsed()
    part, col = attach(model, s3_config("cpu"))
    model(torch.randn(2, 3)).sum().backward()
    assert torch.equal(col.grads["unused.weight"], torch.zeros(9))
    assert col.grads["used.weight"].abs().sum() > 0
    part.close()


def test_partition_callback_frees_full_gradient():
    model = MLP()
    part, col = attach(model, s3_config("cpu"))
    model(torch.randn(2, 16)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(u.grad_flat is None for u in part.units)
    assert col.calls == len(part.units)
    part.close()


def test_nvme_streams_partitions_larger_than_the_staging_buffer(tmp_path):
    torch.manual_seed(7)
    ref = MLP(d=16, h=64, n=1)
    model = copy.deepcopy(ref)
    cfg = s3_config("nvme", tmp_path, offload_param={"buffer_size": 100, "buffer_count": 1})
    part, col = attach(model, cfg)
    assert max(u.part_numel for u in part.units) > 30 * 100  # 64x64 weight: 41 chunks of 100
    x = torch.randn(3, 16)
    check_step(ref, model, col, lambda m: m(x).sum())
    part.close()


def test_max_in_cpu_keeps_the_planned_partitions_in_memory(tmp_path):
    """The partitions kept in host memory are the ones `resident_plan` picks over the units in module
    order: the first, then spread (not the next ones in a row), within the budget."""
    model = MLP()
    budget = 16 * 40 + 40 + 40 * 40 + 40
    cfg = s3_config("nvme", tmp_path, offload_param={"max_in_cpu": budget})
    part, _ = attach(model, cfg)
    resident = [not part.store.on_nvme(u) for u in part.units]
    assert resident == resident_plan([u.part_numel for u in part.units], budget)
    assert resident[0] and not resident[1] and sum(resident) == 2
    assert part.store.in_cpu_numel == sum(u.part_numel for u, r in zip(part.units, resident) if r) <= budget
    assert all(part.store.swap_file(u) is None for u, r in zip(part.units, resident) if r)
    part.close()


@pytest.mark.parametrize("tier", TIERS)
def test_write_partition_round_trip(tier, tmp_path):
    model = MLP()
    part, _ = attach(model, s3_config(tier, tmp_path))
    u = part.units[1]
    new = torch.arange(u.part_numel, dtype=u.dtype)
    part.write_partition(u, new)
    assert torch.equal(part.read_partition(u, torch.empty(u.part_numel)), new)
    from zero.stage3 import GatheredParameters

    with GatheredParameters(model.hidden[0].parameters()):
        assert torch.equal(model.hidden[0].weight.reshape(-1), new[: 40 * 40])
        assert torch.equal(model.hidden[0].bias, new[40 * 40 :])
    part.close()


def test_exception_in_forward_does_not_leak_gathered_units():
    model = MLP()
    part, _ = attach(model, s3_config("cpu"))
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 15))  # wrong width
    model(torch.randn(2, 16))
    assert part.live_full_bytes == 0
    part.close()


def test_mixed_dtypes_in_one_module_are_refused():
    m = torch.nn.Linear(2, 2)
    m.bias.data = m.bias.data.double()
    with pytest.raises(ValueError, match="share one dtype"):
        Stage3Partitioner(s3_config("cpu")).attach(m)


def test_prefetch_follows_a_changed_module_order(tmp_path):
    class Switch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(12, 12) for _ in range(6))
            self.reverse = False

        def forward(self, x):
            for layer in reversed(self.layers) if self.reverse else self.layers:
                x = torch.tanh(layer(x))
            return x

    torch.manual_seed(8)
    ref = Switch()
    model = copy.deepcopy(ref)
    cfg = s3_config("nvme", tmp_path, offload_param={"buffer_size": 1000, "buffer_count": 4})
    part, col = attach(model, cfg)
    x = torch.randn(2, 12)
    n = len(part.units)
    for reverse in (False, False, True, True, False):
        ref.reverse = model.reverse = reverse
        check_step(ref, model, col, lambda m: m(x).sum(), steps=1)
        order = part.use_trace.order
        if reverse:  # the order kept is the one of the last finished pass: forward, then backward
            assert order in ([*range(n), *reversed(range(n))], [*reversed(range(n)), *range(n)])
    assert part.use_trace.order == [*reversed(range(n)), *range(n)]
    io = part.take_io_report()
    assert 0 < io.param_prefetch_hits <= io.param_prefetches
    part.close()


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3), min_size=1, max_size=4),
    world=st.integers(1, 5),
)
def test_rank_slices_cover_every_element_once(shapes, world):
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    names = [f"p{i}" for i in range(len(params))]
    seen = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in zip(names, params)}
    for rank in range(world):
        u = Unit(0, "m", params, names, world, rank, torch.device("cpu"))
        assert u.padded_numel == u.part_numel * world >= u.numel
        for s in u.slices():
            assert s.part_hi - s.part_lo == s.param_hi - s.param_lo
            assert 0 <= s.part_lo < s.part_hi <= u.part_numel
            seen[s.name][s.param_lo : s.param_hi] += 1
    assert all(torch.equal(c, torch.ones_like(c)) for c in seen.values())


@pytest.mark.parametrize("tier", TIERS)
def test_optimizer_steps_through_the_seam_equal_torch_sgd(tier, tmp_path):
    """What the engine will do: read each partition, update it with its gradient partition, write it back."""
    torch.manual_seed(9)
    ref = GPT(TINY_GPT)
    model = copy.deepcopy(ref)
    part = Stage3Partitioner(s3_config(tier, tmp_path, stage3_param_persistence_threshold=100))
    part.attach(model)  # default callback: gradient partitions summed in part.grad_partitions
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    lr = 0.1
    for step in range(3):
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        want = ref(x, x)
        want.backward()
        opt.step()
        part.grad_partitions.clear()
        got = model(x, x)
        got.backward()
        assert torch.equal(got, want)
        for u in part.units:
            values = part.read_partition(u, torch.empty(u.part_numel, dtype=u.dtype))
            values.add_(part.grad_partitions[u.index], alpha=-lr)
            part.write_partition(u, values)
    sd = part.gathered_state_dict(model)
    for name, p in ref.named_parameters():
        assert torch.equal(sd[name], p.detach()), name
    part.close()


def test_missing_swap_file_is_an_error_naming_it(tmp_path):
    model = MLP()
    part, _ = attach(model, s3_config("nvme", tmp_path))
    path = part.store.swap_file(part.units[2])
    os.unlink(path)
    with pytest.raises(OSError) as ei:
        model(torch.randn(2, 16))
    assert os.path.basename(path) in str(ei.value)
    part.close()


def test_bad_nvme_path_is_refused_at_construction(tmp_path):
    with pytest.raises(OSError, match="does not exist"):
        Stage3Partitioner(s3_config("nvme", tmp_path / "missing"))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant, tmp_path):
    """Recomputation runs module forwards inside backward: the hooks gather for it like for a forward."""
    from torch.utils.checkpoint import checkpoint

    class CkptMLP(MLP):
        def forward(self, x):
            x = torch.tanh(self.inp(x))
            for layer in self.hidden:
                x = checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), x, use_reentrant=reentrant)
            return self.out(x)

    torch.manual_seed(10)
    ref = CkptMLP()
    model = copy.deepcopy(ref)
    part, col = attach(model, s3_config("nvme", tmp_path))
    x = torch.randn(3, 16, requires_grad=reentrant)  # the reentrant variant needs an input requiring grad
    check_step(ref, model, col, lambda m: m(x).sum())
    assert part.live_full_bytes == 0
    part.close()


@pytest.mark.parametrize("pin", [False, True])
def test_memory_partitions_are_one_flat_segment_for_the_optimizer(pin):
    model = MLP()
    part = Stage3Partitioner(s3_config("cpu", offload_param={"pin_memory": pin}))
    part.attach(model)
    (segment,) = part.memory_segments()
    assert segment.numel() == sum(u.part_numel for u in part.units)
    offset = 0
    for u in part.units:  # back to back, in module order, each partition a view of the segment
        assert part.store.memory_location(u) == (0, offset)
        assert part.read_partition(u).data_ptr() == segment[offset:].data_ptr()
        offset += u.part_numel
    if pin:
        assert part.store.pool.bytes_in_use == segment.numel() * 4
    part.close()
    if pin:
        assert part.store.pool.bytes_in_use == 0


@pytest.mark.parametrize("pin", [False, True])
def test_a_model_built_on_meta_partitions_as_zeros(pin):
    """Parameters built on the meta device have no values: their partitions read as zeros (fresh pinned
    memory is zero already and is not written a second time)."""
    with torch.device("meta"):
        model = MLP()
    part = Stage3Partitioner(s3_config("cpu", offload_param={"pin_memory": pin}))
    part.attach(model)
    assert part.units and all(p.device.type != "meta" for p in model.parameters())
    for u in part.units:
        assert torch.equal(part.read_partition(u), torch.zeros(u.part_numel, dtype=u.dtype))
    part.close()


def test_a_backward_that_raises_does_not_poison_the_next_step():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom in backward")

    torch.manual_seed(11)
    ref = MLP()
    model = copy.deepcopy(ref)
    part, col = attach(model, s3_config("cpu"))
    x = torch.randn(2, 16)
    # fails half way through backward: after the output layers' pre-backward ran, before the input's
    handle = model.hidden[1].register_forward_hook(lambda m, a, out: Boom.apply(out))
    with pytest.raises(RuntimeError, match="boom"):
        model(x).sum().backward()
    handle.remove()
    assert part.in_backward  # the end-of-backward callback never ran
    check_step(ref, model, col, lambda m: m(x).sum())
    assert not part.in_backward and part.live_full_bytes == 0
    part.close()
