"""The quantized-weight kernels (offload.ops.qmatmul) and the inference forwards that use them
(zero/stage3/fused.py): decoding bit-identical to zero.stage3.quant.dequantize on every SIMD level, the
product from the codes against a float64 reference, and an engine whose modules read a Linear's weight
besides its own forward."""

from __future__ import annotations

import pytest
import torch
from ops_sanitized import run_sanitized
from torch import nn

import zero
from offload.config.quantization import WeightQuantSpec
from offload.ops import available_simd_levels, force_simd_level, qmatmul
from offload.ops.qmatmul import (
    BLOCK_DECODE_MIN_ROWS,
    decodes_in_blocks,
    dequantize_into,
    quantized_conv1d,
    quantized_linear,
)
from zero.stage3.quant import dequantize, quantize


@pytest.fixture(params=available_simd_levels())
def simd(request):
    previous = force_simd_level(request.param)
    yield request.param
    force_simd_level(previous)


def encoded(n, bits, group, symmetric, seed=0):
    spec = WeightQuantSpec(num_bits=bits, group_size=group, symmetric=symmetric)
    w = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.05 + 0.01
    codes, scale, offset = quantize(w, spec)
    return spec, codes, scale, offset


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (4, 6), (8, 64), (8, 8), (8, 5)])
def test_dequantize_is_bit_identical_to_the_torch_decoder(simd, bits, group, symmetric):
    """Groups the AVX2 kernel takes (multiples of 16 / 8) and groups only the scalar one takes; a count
    that ends inside a group."""
    n = 48 * 192 + 7
    spec, codes, scale, offset = encoded(n, bits, group, symmetric)
    want = dequantize(codes, scale, offset, spec, n, torch.float32)
    got = dequantize_into(torch.full((n,), float("nan")), codes, scale, offset, bits, group)
    assert torch.equal(got, want)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits,group", [(4, 64), (4, 6), (8, 64), (8, 8)])
def test_product_from_the_codes_against_float64(simd, bits, group, symmetric, weight_dtype):
    """x @ W^T + b for batches around the kernel's tile of 8 rows, and from BLOCK_DECODE_MIN_ROWS on,
    where the weight is decoded block by block for torch's GEMM; W is the decoded weight rounded to the
    model dtype. Error within fp32 rounding of sums of |x| |W| terms."""
    rows, cols = 40, 12 * group
    spec, codes, scale, offset = encoded(rows * cols, bits, group, symmetric, seed=1)
    w = dequantize(codes, scale, offset, spec, rows * cols, weight_dtype).double().view(rows, cols)
    bias = torch.randn(rows)
    for batch in (
        1,
        3,
        8,
        9,
        17,
        BLOCK_DECODE_MIN_ROWS - 1,
        BLOCK_DECODE_MIN_ROWS,
        BLOCK_DECODE_MIN_ROWS + 7,
    ):
        x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
        y = quantized_linear(x, codes, scale, offset, bits, group, rows, bias, weight_dtype)
        want = x.double() @ w.T + bias.double()
        bound = 1e-6 * cols * float((x.double().abs() @ w.abs().T).max())
        assert y.shape == (batch, rows) and y.dtype == torch.float32
        assert float((y.double() - want).abs().max()) <= bound


def int8_activation_reference(x, codes, scale, offset, bits, group, rows):
    """float64 value of the int8-activation product: x rounded per group as the kernel rounds it (in
    float32), times the weight codes as the kernel multiplies them, plus the offset that goes with them
    times the rounded x's group sums."""
    batch, cols = x.shape
    xg = x.view(batch, -1, group)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    xq = (xg * inv).round().clamp(-127, 127).double()
    sx = (amax / 127.0).double()
    if bits == 4:
        q = torch.stack([codes >> 4, codes & 15], -1).view(-1)[: rows * cols].double()
    else:
        q = codes[: rows * cols].double() - 128
    q = q.view(rows, -1, group)
    s = scale[: rows * cols // group].double().view(rows, -1)
    if offset is not None:
        o = offset[: rows * cols // group].double().view(rows, -1) + (128 * s if bits == 8 else 0)
    else:
        o = -8 * s if bits == 4 else torch.zeros_like(s)
    isum = torch.einsum("mgk,rgk->mrg", xq, q)
    return (isum * s[None] * sx.squeeze(-1)[:, None]).sum(-1) + (xq.sum(-1) * sx.squeeze(-1)) @ o.T


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits,group", [(4, 64), (4, 128), (4, 32), (8, 32), (8, 64), (8, 8)])
def test_product_with_int8_activations_against_float64(simd, bits, group, symmetric):
    """The integer-dot path (AVX2 for int4 groups of 64k and int8 groups of 32k, scalar otherwise) against
    the float64 value of the same rounding; and its error against the exact product stays at the size
    of int8 rounding."""
    rows, cols = 40, 6 * max(group, 64)
    spec, codes, scale, offset = encoded(rows * cols, bits, group, symmetric, seed=2)
    w = dequantize(codes, scale, offset, spec, rows * cols, torch.float32).double().view(rows, cols)
    for batch in (1, 3, 4, 5, 9):
        x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch)) * 3
        x[0, :group] = 0.0  # a group of zeros: scale 0
        y = quantized_linear(x, codes, scale, offset, bits, group, rows, int8_activations=True)
        want = int8_activation_reference(x, codes, scale, offset, bits, group, rows)
        bound = 1e-6 * cols * float((x.double().abs() @ w.abs().T).max())
        assert y.shape == (batch, rows) and y.dtype == torch.float32
        assert float((y.double() - want).abs().max()) <= bound
        exact = x.double() @ w.T
        assert float((y.double() - exact).norm() / exact.norm()) < 2e-2


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group,symmetric", [(4, 64, False), (4, 6, True), (8, 8, False)])
def test_many_rows_are_decode_and_torch_matmul_block_by_block(
    monkeypatch, bits, group, symmetric, weight_dtype
):
    """From BLOCK_DECODE_MIN_ROWS input rows on (fp32 activations) the product is decode + torch's GEMM:
    with one block it equals `(W @ x^T)^T + b` over the weight decoded to the model dtype, bit for bit;
    blocks of 7 rows (the last one short) and of one row (a block budget smaller than a row) give the same
    values to fp32 rounding. Fewer rows, or int8 activations, never take this path."""
    rows, cols = 40, 16 * group
    spec, codes, scale, offset = encoded(rows * cols, bits, group, symmetric, seed=3)
    w = dequantize(codes, scale, offset, spec, rows * cols, weight_dtype).float().view(rows, cols)
    x = torch.randn(BLOCK_DECODE_MIN_ROWS + 3, cols, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(rows)
    exact = torch.mm(w, x.t()).t() + bias
    assert decodes_in_blocks(x.shape[0]) and not decodes_in_blocks(x.shape[0], int8_activations=True)
    assert not decodes_in_blocks(BLOCK_DECODE_MIN_ROWS - 1)
    whole = quantized_linear(x, codes, scale, offset, bits, group, rows, bias, weight_dtype)
    assert torch.equal(whole, exact)
    bound = 1e-6 * cols * float((x.abs() @ w.abs().T).max())
    for block_rows, block_bytes in ((7, 7 * cols * 4), (1, 4)):
        monkeypatch.setattr(qmatmul, "BLOCK_BYTES", block_bytes)
        got = quantized_linear(x, codes, scale, offset, bits, group, rows, bias, weight_dtype)
        assert got.is_contiguous() and got.shape == exact.shape
        assert float((got - exact).abs().max()) <= bound, block_rows


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group,symmetric", [(4, 64, False), (4, 6, True), (8, 64, True), (8, 8, False)])
def test_conv1d_product_against_float64(monkeypatch, bits, group, symmetric, weight_dtype):
    """transformers' Conv1D layout: `x @ W + b` for W [in_features, out_features] with groups along the
    outputs, decoded block by block (one block; blocks of 5 weight rows, the last one short; one row) for
    1 to 40 input rows, against float64 with W decoded to the model dtype; leading dimensions and x's
    dtype kept."""
    in_features, out_features = 43, 6 * group
    spec, codes, scale, offset = encoded(in_features * out_features, bits, group, symmetric, seed=5)
    w = dequantize(codes, scale, offset, spec, in_features * out_features, weight_dtype)
    w = w.double().view(in_features, out_features)
    bias = torch.randn(out_features)
    for block_bytes in (qmatmul.BLOCK_BYTES, 5 * out_features * 4, 4):
        monkeypatch.setattr(qmatmul, "BLOCK_BYTES", block_bytes)
        for batch in (1, 4, 40):
            x = torch.randn(batch, in_features, generator=torch.Generator().manual_seed(batch))
            y = quantized_conv1d(x, codes, scale, offset, bits, group, out_features, bias, weight_dtype)
            want = x.double() @ w + bias.double()
            bound = 1e-6 * in_features * float((x.double().abs() @ w.abs()).max())
            assert y.shape == (batch, out_features) and y.dtype == torch.float32
            assert float((y.double() - want).abs().max()) <= bound, (block_bytes, batch)
    x = torch.randn(2, 3, in_features, dtype=torch.bfloat16)
    y = quantized_conv1d(x, codes, scale, offset, bits, group, out_features)
    assert y.shape == (2, 3, out_features) and y.dtype == torch.bfloat16


def test_product_keeps_leading_dimensions_and_dtype():
    spec, codes, scale, offset = encoded(16 * 128, 4, 64, False)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    y = quantized_linear(x, codes, scale, offset, 4, 64, 16)
    w = dequantize(codes, scale, offset, spec, 16 * 128, torch.float32).view(16, 128)
    assert y.shape == (2, 3, 16) and y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), (x.float() @ w.T).bfloat16().float(), rtol=2e-2, atol=2e-2)


def test_bad_arguments_name_what_is_wrong():
    _, codes, scale, offset = encoded(16 * 128, 4, 64, False)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="in_features 100 is not a whole number of groups of 64"):
        quantized_linear(torch.randn(2, 100), codes, scale, offset, 4, 64, 16)
    with pytest.raises(ValueError, match="codes: .* need 1024 values, got 512"):
        quantized_linear(x, codes[:512], scale, offset, 4, 64, 16)
    with pytest.raises(ValueError, match="scale: expected a contiguous CPU torch.float16"):
        quantized_linear(x, codes, scale.float(), offset, 4, 64, 16)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        dequantize_into(torch.empty(16), codes, scale, offset, 3, 64)
    with pytest.raises(ValueError, match="out: expected a contiguous CPU float32"):
        dequantize_into(torch.empty(16, dtype=torch.float64), codes, scale, offset, 4, 64)
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        quantized_linear(x, codes, scale, offset, 4, 64, 16, weight_dtype=torch.float64)
    with pytest.raises(ValueError, match="out_features 96 is not a whole number of groups of 64"):
        quantized_conv1d(torch.randn(2, 16), codes, scale, offset, 4, 64, 96)
    with pytest.raises(ValueError, match="codes: .* need 1024 values, got 512"):
        quantized_conv1d(torch.randn(2, 16), codes[:512], scale, offset, 4, 64, 128)


# ------------------------------------------------------------------------------------------ the engine
class ReadsTheWeight(nn.Module):
    """A parent that uses its child Linear's weight besides calling the child."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(128, 128)
        self.out = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        h = self.lin(x) + x @ self.lin.weight.T
        return self.out(h)


def config(tier, tmp_path):
    off = {"device": tier, "nvme_path": str(tmp_path)} if tier == "nvme" else {"device": tier}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "offload_param": off, "stage3_param_persistence_threshold": 0},
        "weight_quantization": {"quantized_initialization": {"num_bits": 4, "group_size": 64}},
    }


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_weight_read_outside_its_forward_is_decoded(tmp_path, tier):
    """The parent's read of `lin.weight` decodes it (the same values as a gather that decodes); `out`,
    read by nothing else, computes from its codes in every forward. Forwards agree with the grad-enabled
    (decoding) forward to fp32 rounding, first forward and later ones."""
    torch.manual_seed(0)
    model = ReadsTheWeight()
    engine, *_ = zero.initialize(model=model, config=config(tier, tmp_path))
    x = torch.randn(3, 128)
    with torch.enable_grad():
        want = engine(x).detach()
    engine.partitioner.take_io_report()
    for _ in range(3):
        with torch.no_grad():
            got = engine(x)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
        io = engine.partitioner.take_io_report()
        assert io.quantized_matmuls >= 1  # `out` at least; `lin` once its weight is known to be read
    engine.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_many_row_forwards_decode_in_blocks_in_the_engine(tmp_path, tier):
    """An inference forward of BLOCK_DECODE_MIN_ROWS rows or more (counted over x's leading dimensions)
    computes each quantized Linear by decoding its weight block by block for torch's GEMM, counted by
    `quantized_block_matmuls`; one row fewer takes the register kernel. Both agree with the decoding
    (grad-enabled) forward to fp32 rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 192), nn.ReLU(), nn.Linear(192, 64))
    engine, *_ = zero.initialize(model=model, config=config(tier, tmp_path))
    n = BLOCK_DECODE_MIN_ROWS
    for shape, blocks in (((2, n // 2, 128), 2), ((n, 128), 2), ((n - 1, 128), 0)):
        x = torch.randn(*shape)
        with torch.enable_grad():
            want = engine(x).detach()
        engine.partitioner.take_io_report()
        with torch.no_grad():
            got = engine(x)
        io = engine.partitioner.take_io_report()
        assert (io.quantized_matmuls, io.quantized_block_matmuls) == (2, blocks), shape
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    engine.close()


def test_int8_activations_in_the_engine(tmp_path):
    """zero_offload.int8_activations: each Linear's inference forward is quantized_linear with int8
    activations over the codes of its weight (bit-identical to that call on the same quantized weight),
    and differs from the exact product; with grad mode on the weights are decoded as usual."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 192), nn.ReLU(), nn.Linear(192, 64))
    spec = WeightQuantSpec(num_bits=4, group_size=64)
    quantized = [quantize(model[i].weight.detach().reshape(-1), spec) for i in (0, 2)]
    biases = [model[i].bias.detach().clone() for i in (0, 2)]
    cfg = config("cpu", tmp_path)
    cfg["zero_offload"] = {"int8_activations": True}
    engine, *_ = zero.initialize(model=model, config=cfg)
    x = torch.randn(5, 128)
    h = x
    for (codes, scale, offset), b, rows in zip(quantized, biases, (192, 64)):
        h = quantized_linear(h, codes, scale, offset, 4, 64, rows, b, int8_activations=True)
        h = h.relu() if rows == 192 else h
    engine.partitioner.take_io_report()
    with torch.no_grad():
        got = engine(x)
    assert engine.partitioner.take_io_report().quantized_matmuls == 2
    assert torch.equal(got, h)
    with torch.enable_grad():
        exact = engine(x).detach()
    assert not torch.equal(got, exact)
    assert float((got - exact).norm() / exact.norm()) < 2e-2
    engine.close()


def _int8_activations_on_two_ranks(rank, world_size, nvme_dir, out_dir):
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 192), nn.ReLU(), nn.Linear(192, 64))
    cfg = config("cpu", nvme_dir)
    cfg["zero_offload"] = {"int8_activations": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zero.initialize(model=model, config=cfg)
    x = torch.randn(5, 128)
    with torch.no_grad():
        got = engine(x)
    with torch.enable_grad():
        decoded = engine(x).detach()
    io = engine.partitioner.take_io_report()
    engine.close()
    said = [str(w.message) for w in caught if "int8_activations is ignored" in str(w.message)]
    return said, torch.equal(got, decoded), io.quantized_matmuls


def test_int8_activations_on_several_ranks_warn_that_they_are_ignored(tmp_path):
    """Several ranks never compute from the codes: the key is ignored with a warning naming why, and the
    inference forward equals the decoding one."""
    from dist_helpers import run_on_ranks

    results, _ = run_on_ranks(_int8_activations_on_two_ranks, tmp_path)
    for said, equal, products in results:
        assert len(said) == 1 and "2 rank(s)" in said[0]
        assert equal and products == 0


def test_int8_activations_need_weight_quantization():
    from offload.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="zero_offload.int8_activations.*enable weight_quantization"):
        load_config({"zero_offload": {"int8_activations": True}})


@pytest.mark.slow  # compiles the kernels from scratch
def test_kernels_under_sanitizers(tmp_path):
    """ops_csrc/tests/qmatmul_test.cpp: exact-size arrays, every SIMD level, 1 and 3 threads."""
    run_sanitized("qmatmul_test.cpp", tmp_path)


def test_a_unit_held_for_good_keeps_no_staging_slot(tmp_path):
    """Persistent units (every unit, by the threshold) on NVMe compute from their codes from a copy of
    their bytes: no staging slot stays lent to them after the forward."""
    torch.manual_seed(0)
    model = ReadsTheWeight()
    cfg = config("nvme", tmp_path)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10**9
    engine, *_ = zero.initialize(model=model, config=cfg)
    x = torch.randn(3, 128)
    engine.partitioner.take_io_report()
    with torch.no_grad():  # first: the units are then gathered (for good) encoded
        got = engine(x)
    assert engine.partitioner.take_io_report().quantized_matmuls >= 1
    assert not any(engine.partitioner.store.lent(u) for u in engine.partitioner.units)
    with torch.enable_grad():
        want = engine(x).detach()
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    engine.close()


def test_an_embedding_decodes_only_the_rows_it_looks_up(tmp_path):
    """Bit-identical to the decoding (grad-enabled) forward; an id out of range is torch's IndexError."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 128), nn.Linear(128, 64))
    engine, *_ = zero.initialize(model=model, config=config("cpu", tmp_path))
    ids = torch.tensor([[3, 99, 0], [3, 17, 42]])
    with torch.enable_grad():
        want = engine.module[0](ids).detach()
    engine.partitioner.take_io_report()
    with torch.no_grad():
        got = engine.module[0](ids)
        assert engine.partitioner.take_io_report().quantized_matmuls == 1
        assert torch.equal(got, want)
        with pytest.raises(IndexError, match="index out of range"):
            engine.module[0](torch.tensor([100]))
    engine.close()


def test_a_backward_after_inference_forwards_differentiates_the_decoded_weights(tmp_path):
    """Units kept gathered (encoded) from an inference forward are decoded for a forward with grad mode on:
    the input gets its gradient, equal to the one through the decoded weights."""
    torch.manual_seed(0)
    model = ReadsTheWeight()
    cfg = config("cpu", tmp_path)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10**9  # every unit kept gathered
    engine, *_ = zero.initialize(model=model, config=cfg)
    x = torch.randn(3, 128)
    with torch.no_grad():
        engine(x)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    for xi in xs:
        engine(xi).square().sum().backward()
    assert xs[0].grad is not None and torch.equal(xs[0].grad, xs[1].grad)
    engine.close()


def test_the_kernels_own_checks_refuse_bad_arguments():
    """The C++ layer re-checks what keeps it memory safe, whatever its Python face lets through."""
    from offload import _cpu_optim

    _, codes, scale, offset = encoded(16 * 128, 4, 64, False)
    x, y, out = torch.randn(2, 128), torch.empty(2, 16), torch.empty(16 * 128)
    a = (codes.data_ptr(), scale.data_ptr(), offset.data_ptr())
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        _cpu_optim.dequantize_f32(*a, 3, 64, out.numel(), out.data_ptr())
    with pytest.raises(ValueError, match="group size 63 must be positive"):
        _cpu_optim.dequantize_f32(*a, 4, 63, out.numel(), out.data_ptr())
    with pytest.raises(ValueError, match="null data pointer"):
        _cpu_optim.dequantize_f32(0, a[1], a[2], 4, 64, out.numel(), out.data_ptr())
    with pytest.raises(ValueError, match="100 columns are not a whole number of groups of 64"):
        _cpu_optim.quantized_matmul_f32(*a, 4, 64, 16, 100, x.data_ptr(), 2, y.data_ptr())
    with pytest.raises(ValueError, match="unknown dtype code 7"):
        _cpu_optim.quantized_matmul_f32(*a, 4, 64, 16, 128, x.data_ptr(), 2, y.data_ptr(), 7)
    with pytest.raises(ValueError, match="100 columns are not a whole number of groups of 64"):
        _cpu_optim.quantized_matmul_int8_activations(*a, 4, 64, 16, 100, x.data_ptr(), 2, y.data_ptr())
    with pytest.raises(ValueError, match="null data pointer"):
        _cpu_optim.quantized_matmul_int8_activations(
            0, a[1], a[2], 4, 64, 16, 128, x.data_ptr(), 2, y.data_ptr()
        )
    with pytest.raises(ValueError, match="x: expected a floating-point CPU tensor"):
        quantized_linear(torch.ones(2, 128, dtype=torch.int64), codes, scale, offset, 4, 64, 16)
