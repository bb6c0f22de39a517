"""Numerics of the CPU optimizer kernels (offload.ops): parity with torch, dtypes, ISA paths, fused extras.

Tolerances, and why:
- fp32, against the same torch ops that torch.optim.Adam/AdamW/Adagrad run (_single_tensor_* paths)
  with one change, an exactly rounded sqrt: BITWISE. torch's CPU sqrt goes through MKL's vsSqrt, which is
  not always correctly rounded (1 ulp off on about 0.5% of elements); the kernels use IEEE sqrt.
- fp32, against torch.optim.Adam/AdamW/Adagrad themselves over 20 steps: rtol 1e-6, atol 1e-7 (the
  MKL sqrt ulps, amplified a little by the steps). test_tolerance_catches_wrong_bias_correction shows
  this is tight enough to see a wrong bias correction.
- 16-bit params/grads/states: BITWISE against the same reference computed in fp32 and rounded to the
  storage dtype after every step (the kernels compute in fp32 and round once per store).
- Lion has no sqrt: BITWISE against the torch reference.
- Every ISA path (scalar, AVX2, AVX-512 where the CPU has it) is bitwise equal to the scalar path.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import offload.ops as ops
import offload.ops._runtime as ops_runtime

LEVELS = ops.available_simd_levels()
TAIL_SIZES = [1, 7, 15, 17, 31, 33, 1023]
BIG = 1_000_003
VALUE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STATE_DTYPES = [torch.float32, torch.bfloat16]
COPY_DTYPES = [None, torch.bfloat16, torch.float16]
STEPS = 20


@pytest.fixture(params=LEVELS)
def level(request):
    previous = ops.force_simd_level(request.param)
    yield request.param
    ops.force_simd_level(previous)


@pytest.fixture(autouse=True)
def _restore_level():
    previous = ops.simd_level()
    yield
    ops.force_simd_level(previous)


def exact_sqrt(t: torch.Tensor) -> torch.Tensor:
    # sqrt in double of an fp32 value, rounded once to fp32, is the correctly rounded fp32 sqrt.
    return t.double().sqrt().float()


# ---- references: torch's single-tensor optimizer code on fp32 tensors, sqrt exactly rounded ----


def ref_adam(p, g, m, v, *, step, lr, beta1, beta2, eps, wd, adamw, bias_correction=True):
    if wd != 0:
        if adamw:
            p.mul_(1 - lr * wd)
        else:
            g = g.add(p, alpha=wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size, bc2_sqrt = lr, 1.0
    if bias_correction:
        step_size = lr / (1 - beta1**step)
        bc2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exact_sqrt(v) / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


def ref_adagrad(p, g, s, *, lr, eps, wd):
    if wd != 0:
        g = g.add(p, alpha=wd)
    s.addcmul_(g, g, value=1)
    std = exact_sqrt(s).add_(eps)
    p.addcdiv_(g, std, value=-lr)


def ref_lion(p, g, m, *, lr, beta1, beta2, wd):
    # lucidrains/lion-pytorch's update, written in torch.
    p.mul_(1 - lr * wd)
    update = m.clone().mul_(beta1).add(g, alpha=1 - beta1).sign_()
    p.add_(update, alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1 - beta2)


def _f32(t: torch.Tensor) -> torch.Tensor:
    # Always a new tensor: t.float() of an fp32 tensor is t itself, and the reference must never
    # update the kernel's own tensors.
    return t.to(torch.float32, copy=True)


def _random_grad(n, dtype, gen, scale=1.0):
    return (torch.randn(n, generator=gen) * scale).to(dtype)


def _run_adam_case(n, pdt, gdt, sdt, cdt, *, adamw=True, bias_correction=True, wd=0.01, grad_scale=1.0):
    """Runs STEPS kernel steps and the rounded fp32 reference side by side; returns both end states."""
    gen = torch.Generator().manual_seed(n * 7 + 3)
    p = torch.randn(n, generator=gen).to(pdt)
    m = torch.zeros(n, dtype=sdt)
    v = torch.zeros(n, dtype=sdt)
    copy = torch.full((n,), -7.0, dtype=cdt) if cdt is not None else None
    rp, rm, rv = _f32(p), _f32(m), _f32(v)
    rcopy = None
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
    for step in range(1, STEPS + 1):
        g = _random_grad(n, gdt, gen, scale=grad_scale)
        ok = ops.adam_update(
            p,
            g,
            m,
            v,
            step=step,
            weight_decay=wd,
            adamw_mode=adamw,
            bias_correction=bias_correction,
            grad_scale=grad_scale,
            param_copy=copy,
            **hyper,
        )
        assert ok
        gf = _f32(g) / grad_scale if grad_scale != 1.0 else _f32(g)
        ref_adam(rp, gf, rm, rv, step=step, wd=wd, adamw=adamw, bias_correction=bias_correction, **hyper)
        if cdt is not None:
            rcopy = rp.to(cdt)
        # The kernel stores 16-bit tensors rounded; the reference continues from the rounded values.
        rp, rm, rv = _f32(rp.to(pdt)), _f32(rm.to(sdt)), _f32(rv.to(sdt))
    return (p, m, v, copy), (rp.to(pdt), rm.to(sdt), rv.to(sdt), rcopy)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, what
    a, e = actual.float(), expected.float()
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    if not bool(same.all()):
        idx = int((~same).nonzero()[0])
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {a.numel()} elements differ; first at {idx}: "
            f"{a[idx].item()!r} vs {e[idx].item()!r}"
        )


# ---- Adam / AdamW ----


@pytest.mark.parametrize("n", TAIL_SIZES)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "nobc"])
def test_adam_fp32_bitwise_vs_torch_ops(level, n, adamw, bias_correction):
    (p, m, v, _), (rp, rm, rv, _) = _run_adam_case(
        n, torch.float32, torch.float32, torch.float32, None, adamw=adamw, bias_correction=bias_correction
    )
    assert_bitwise(p, rp, "param")
    assert_bitwise(m, rm, "exp_avg")
    assert_bitwise(v, rv, "exp_avg_sq")


@pytest.mark.parametrize(
    "pdt,gdt,sdt,cdt", list(itertools.product(VALUE_DTYPES, VALUE_DTYPES, STATE_DTYPES, COPY_DTYPES))
)
@pytest.mark.parametrize("n", [7, 33, 1023])
def test_adam_dtype_combinations_bitwise(level, n, pdt, gdt, sdt, cdt):
    (p, m, v, copy), (rp, rm, rv, rcopy) = _run_adam_case(n, pdt, gdt, sdt, cdt, adamw=n != 33)
    assert_bitwise(p, rp, "param")
    assert_bitwise(m, rm, "exp_avg")
    assert_bitwise(v, rv, "exp_avg_sq")
    if cdt is not None:
        assert_bitwise(copy, rcopy, "param_copy")


@pytest.mark.parametrize(
    "pdt,gdt,sdt,cdt",
    [
        (torch.float32, torch.float32, torch.float32, None),
        (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float16, torch.bfloat16, torch.float16),
    ],
)
def test_adam_large_bitwise(pdt, gdt, sdt, cdt):
    # 1M+3 elements: several threads' chunks and a vector tail in the last one; best ISA only.
    (p, m, v, copy), (rp, rm, rv, rcopy) = _run_adam_case(BIG, pdt, gdt, sdt, cdt)
    assert_bitwise(p, rp, "param")
    assert_bitwise(m, rm, "exp_avg")
    assert_bitwise(v, rv, "exp_avg_sq")
    if cdt is not None:
        assert_bitwise(copy, rcopy, "param_copy")


@pytest.mark.slow
@pytest.mark.parametrize(
    "pdt,gdt,sdt,cdt", list(itertools.product(VALUE_DTYPES, VALUE_DTYPES, STATE_DTYPES, COPY_DTYPES))
)
def test_adam_large_all_dtypes_bitwise(level, pdt, gdt, sdt, cdt):
    (p, m, v, copy), (rp, rm, rv, rcopy) = _run_adam_case(BIG, pdt, gdt, sdt, cdt)
    assert_bitwise(p, rp, "param")
    assert_bitwise(m, rm, "exp_avg")
    assert_bitwise(v, rv, "exp_avg_sq")
    if cdt is not None:
        assert_bitwise(copy, rcopy, "param_copy")


@pytest.mark.parametrize("grad_scale", [1024.0, 3.0])
def test_adam_grad_scale_divides_grads(level, grad_scale):
    (p, m, v, _), (rp, rm, rv, _) = _run_adam_case(
        1023, torch.float32, torch.float16, torch.float32, None, grad_scale=grad_scale
    )
    assert_bitwise(p, rp, "param")
    assert_bitwise(m, rm, "exp_avg")
    assert_bitwise(v, rv, "exp_avg_sq")


def _torch_vs_ours(torch_cls, ours_kwargs, torch_kwargs, shapes=((1023,), (17, 3), (1,)), steps=STEPS):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    theirs = [t.clone().requires_grad_(True) for t in init]
    ours = [t.clone().requires_grad_(True) for t in init]
    opt_t = torch_cls(theirs, **torch_kwargs)
    opt_o = ours_kwargs.pop("cls")(ours, **ours_kwargs)
    for _ in range(steps):
        for a, b in zip(theirs, ours):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        opt_t.step()
        opt_o.step()
    return theirs, ours, opt_t, opt_o


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_cpu_adam_matches_torch_optim(level, adamw):
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05)
    theirs, ours, opt_t, opt_o = _torch_vs_ours(torch_cls, dict(cls=ops.CPUAdam, adamw_mode=adamw, **kw), kw)
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
        sa, sb = opt_t.state[a], opt_o.state[b]
        torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], rtol=1e-6, atol=1e-9)
        assert sb["step"].item() == sa["step"].item() == STEPS


def test_tolerance_catches_wrong_bias_correction():
    # The same comparison as above fails when only the bias correction differs: the tolerance has teeth.
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    theirs, ours, _, _ = _torch_vs_ours(
        torch.optim.AdamW, dict(cls=ops.CPUAdam, bias_correction=False, **kw), kw, steps=3
    )
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ours[0].detach(), theirs[0].detach(), rtol=1e-6, atol=1e-7)


def test_cpu_adam_param_groups_match_torch(level):
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=gen) for s in ((64,), (33,), (5, 7))]
    theirs = [t.clone().requires_grad_(True) for t in init]
    ours = [t.clone().requires_grad_(True) for t in init]

    def groups(ps):
        return [
            {"params": [ps[0]], "lr": 1e-3, "weight_decay": 0.1},
            {"params": [ps[1], ps[2]], "lr": 3e-2, "betas": (0.5, 0.9), "eps": 1e-6},
        ]

    opt_t = torch.optim.AdamW(groups(theirs), lr=1e-2, weight_decay=0.0)
    opt_o = ops.CPUAdamW(groups(ours), lr=1e-2, weight_decay=0.0)
    for _ in range(10):
        for a, b in zip(theirs, ours):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        opt_t.step()
        opt_o.step()
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)


# ---- Adagrad ----


@pytest.mark.parametrize("n", TAIL_SIZES + [BIG])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adagrad_fp32_bitwise_vs_torch_ops(level, n, wd):
    if n == BIG and level != LEVELS[-1]:
        pytest.skip("large size on the best ISA only")
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    s = torch.full((n,), 0.1)
    rp, rs = p.clone(), s.clone()
    lr, lr_decay, eps = 1e-2, 0.01, 1e-10
    for step in range(1, STEPS + 1):
        g = torch.randn(n, generator=gen)
        clr = lr / (1 + (float(step) - 1) * lr_decay)
        assert ops.adagrad_update(p, g, s, lr=clr, eps=eps, weight_decay=wd)
        ref_adagrad(rp, g, rs, lr=clr, eps=eps, wd=wd)
    assert_bitwise(p, rp, "param")
    assert_bitwise(s, rs, "sum")


@pytest.mark.parametrize(
    "pdt,gdt,sdt,cdt", list(itertools.product(VALUE_DTYPES, VALUE_DTYPES, STATE_DTYPES, COPY_DTYPES))
)
def test_adagrad_dtype_combinations_bitwise(level, pdt, gdt, sdt, cdt):
    n = 37
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(n, generator=gen).to(pdt)
    s = torch.zeros(n, dtype=sdt)
    copy = torch.zeros(n, dtype=cdt) if cdt is not None else None
    rp, rs = _f32(p), _f32(s)
    for _ in range(STEPS):
        g = torch.randn(n, generator=gen).to(gdt)
        assert ops.adagrad_update(p, g, s, lr=0.05, eps=1e-10, weight_decay=0.01, param_copy=copy)
        ref_adagrad(rp, _f32(g), rs, lr=0.05, eps=1e-10, wd=0.01)
        rcopy = rp.to(cdt) if cdt is not None else None
        rp, rs = _f32(rp.to(pdt)), _f32(rs.to(sdt))
    assert_bitwise(p, rp.to(pdt), "param")
    assert_bitwise(s, rs.to(sdt), "sum")
    if cdt is not None:
        assert_bitwise(copy, rcopy, "param_copy")


def test_cpu_adagrad_matches_torch_optim(level):
    kw = dict(lr=5e-2, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.1, eps=1e-10)
    theirs, ours, opt_t, opt_o = _torch_vs_ours(torch.optim.Adagrad, dict(cls=ops.CPUAdagrad, **kw), kw)
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt_o.state[b]["sum"], opt_t.state[a]["sum"], rtol=1e-6, atol=1e-7)


# ---- Lion ----


@pytest.mark.parametrize("n", TAIL_SIZES + [BIG])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_fp32_bitwise_vs_reference(level, n, wd):
    if n == BIG and level != LEVELS[-1]:
        pytest.skip("large size on the best ISA only")
    gen = torch.Generator().manual_seed(n + 11)
    p = torch.randn(n, generator=gen)
    m = torch.zeros(n)
    rp, rm = p.clone(), m.clone()
    for _ in range(STEPS):
        g = torch.randn(n, generator=gen)
        assert ops.lion_update(p, g, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=wd)
        ref_lion(rp, g, rm, lr=1e-3, beta1=0.9, beta2=0.99, wd=wd)
    assert_bitwise(p, rp, "param")
    assert_bitwise(m, rm, "exp_avg")


@pytest.mark.parametrize(
    "pdt,gdt,sdt,cdt", list(itertools.product(VALUE_DTYPES, VALUE_DTYPES, STATE_DTYPES, COPY_DTYPES))
)
def test_lion_dtype_combinations_bitwise(level, pdt, gdt, sdt, cdt):
    n = 37
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(n, generator=gen).to(pdt)
    m = torch.zeros(n, dtype=sdt)
    copy = torch.zeros(n, dtype=cdt) if cdt is not None else None
    rp, rm = _f32(p), _f32(m)
    for _ in range(STEPS):
        g = torch.randn(n, generator=gen).to(gdt)
        assert ops.lion_update(p, g, m, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, param_copy=copy)
        ref_lion(rp, _f32(g), rm, lr=1e-2, beta1=0.9, beta2=0.99, wd=0.1)
        rcopy = rp.to(cdt) if cdt is not None else None
        rp, rm = _f32(rp.to(pdt)), _f32(rm.to(sdt))
    assert_bitwise(p, rp.to(pdt), "param")
    assert_bitwise(m, rm.to(sdt), "exp_avg")
    if cdt is not None:
        assert_bitwise(copy, rcopy, "param_copy")


def test_cpu_lion_optimizer_matches_reference(level):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(40, 3, generator=gen)
    ours = w.clone().requires_grad_(True)
    ref_p, ref_m = w.clone(), torch.zeros_like(w)
    opt = ops.CPULion([ours], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.5)
    for _ in range(STEPS):
        g = torch.randn(w.shape, generator=gen)
        ours.grad = g.clone()
        opt.step()
        ref_lion(ref_p, g, ref_m, lr=1e-3, beta1=0.9, beta2=0.99, wd=0.5)
    assert_bitwise(ours.detach(), ref_p, "param")
    assert_bitwise(opt.state[ours]["exp_avg"], ref_m, "exp_avg")


# ---- ISA paths against each other, conversions, special values ----


def _special_values(n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen) * torch.logspace(-45, 38, n, base=2.0)
    specials = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1e-40, 65504.0, 65520.0, 65519.0, 6e-8, 3e-8, 1e38, -1e38]
    )
    x[: specials.numel()] = specials
    return x


@pytest.mark.parametrize("other", [lvl for lvl in LEVELS if lvl != "scalar"])
@pytest.mark.parametrize(
    "pdt,sdt,cdt",
    [
        (torch.float32, torch.float32, torch.bfloat16),
        (torch.float16, torch.bfloat16, torch.float16),
        (torch.bfloat16, torch.float32, torch.float16),
    ],
)
def test_simd_paths_equal_scalar_with_special_values(other, pdt, sdt, cdt):
    n = 4099
    gen = torch.Generator().manual_seed(3)
    base_p = _special_values(n, gen).to(pdt)
    grads = [_special_values(n, gen) for _ in range(5)]
    grads[2][100] = float("inf")  # without check_finite the update proceeds and reports it
    grads[3][n - 1] = float("nan")
    results = {}
    for lvl in ("scalar", other):
        ops.force_simd_level(lvl)
        p, m, v = base_p.clone(), torch.zeros(n, dtype=sdt), torch.zeros(n, dtype=sdt)
        copy = torch.zeros(n, dtype=cdt)
        flags = []
        for step, g in enumerate(grads, start=1):
            flags.append(
                ops.adam_update(
                    p,
                    g,
                    m,
                    v,
                    step=step,
                    lr=1e-3,
                    beta1=0.9,
                    beta2=0.999,
                    eps=1e-8,
                    weight_decay=0.01,
                    grad_scale=2.0,
                    param_copy=copy,
                )
            )
        results[lvl] = (p, m, v, copy, flags)
    for a, b, what in zip(results["scalar"], results[other], ("param", "exp_avg", "exp_avg_sq", "copy")):
        assert_bitwise(b, a, what)
    assert results["scalar"][4] == results[other][4] == [True, True, False, False, True]


@pytest.mark.parametrize("cdt", [torch.bfloat16, torch.float16])
def test_param_copy_equals_torch_cast_for_every_bit_pattern(level, cdt):
    # lr=0 and no decay leave the param unchanged, so the copy must equal casting the param: this runs
    # the fp32 -> 16-bit conversion over all 2^16 upper-half bit patterns (with random low halves) and
    # boundary cases of each path.
    gen = torch.Generator().manual_seed(4)
    hi = torch.arange(0, 1 << 16, dtype=torch.int64) << 16
    lo = torch.randint(0, 1 << 16, (1 << 16,), generator=gen, dtype=torch.int64)
    ties = hi | 0x8000  # exact bf16 halfway cases
    bits = torch.cat([hi | lo, ties, hi]).to(torch.int64)
    p = ((bits + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32).view(torch.float32).clone()
    p[torch.isinf(p)] = 0.0  # inf - inf would make NaN in the (zero) update
    grad = torch.zeros_like(p)
    copy = torch.zeros(p.numel(), dtype=cdt)
    ops.adam_update(
        p,
        grad,
        torch.zeros_like(p),
        torch.zeros_like(p),
        step=1,
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        param_copy=copy,
    )
    expected = p.to(cdt)
    finite = ~torch.isnan(p)
    assert torch.equal(copy.view(torch.int16)[finite], expected.view(torch.int16)[finite])
    assert bool(torch.isnan(copy[~finite].float()).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_loads_are_exact(level, dtype):
    # Every 16-bit pattern as a param: lr=0 keeps it, so storing it back must give the same bits.
    p = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).clone()
    keep = ~torch.isnan(p.float()) & ~torch.isinf(p.float())
    p = p[keep].contiguous()
    before = p.clone()
    n = p.numel()
    copy = torch.zeros(n, dtype=dtype)
    ops.adam_update(
        p,
        torch.zeros(n),
        torch.zeros(n),
        torch.zeros(n),
        step=1,
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        param_copy=copy,
    )
    assert torch.equal(p.view(torch.int16), before.view(torch.int16))
    assert torch.equal(copy.view(torch.int16), before.view(torch.int16))


# ---- check_finite: nothing modified ----


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 500, 1022])
@pytest.mark.parametrize("opt", ["adam", "adagrad", "lion"])
def test_check_finite_leaves_everything_untouched(level, bad, where, opt):
    n = 1023
    gen = torch.Generator().manual_seed(6)
    p = torch.randn(n, generator=gen)
    s1, s2 = torch.rand(n, generator=gen), torch.rand(n, generator=gen)
    copy = torch.randn(n, generator=gen).to(torch.bfloat16)
    g = torch.randn(n, generator=gen).to(torch.float16)
    g[where] = bad
    before = [t.clone() for t in (p, s1, s2, copy)]
    common = dict(grad_scale=128.0, param_copy=copy, check_finite=True)
    if opt == "adam":
        hyper = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
        ok = ops.adam_update(p, g, s1, s2, **hyper, **common)
    elif opt == "adagrad":
        ok = ops.adagrad_update(p, g, s1, lr=1e-2, eps=1e-10, weight_decay=0.1, **common)
    else:
        ok = ops.lion_update(p, g, s1, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, **common)
    assert ok is False
    for after, orig in zip((p, s1, s2, copy), before):
        assert torch.equal(after.view(torch.uint8), orig.view(torch.uint8))


def test_check_finite_with_finite_grads_updates(level):
    n = 100
    p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
    g = torch.full((n,), 60000.0, dtype=torch.float16)
    assert ops.adam_update(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, check_finite=True)
    assert bool((p < 1).all())
    assert ops.grads_finite(g)
    g[n - 1] = float("inf")
    assert not ops.grads_finite(g)


@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("cdt", [torch.bfloat16, torch.float16])
def test_param_copy_at_any_alignment(level, offset, cdt):
    # Aligned copies take the non-temporal store path, misaligned ones the plain one: same bits.
    n = 70_001  # large enough for several threads' blocks
    gen = torch.Generator().manual_seed(offset)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    buf = torch.zeros(n + offset, dtype=cdt)
    copy = buf[offset:]
    ops.adam_update(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, param_copy=copy)
    assert torch.equal(copy.view(torch.int16), p.to(cdt).view(torch.int16))
    assert bool((buf[:offset] == 0).all())


# ---- non-temporal store paths ----

STREAM_MIN = 4096  # kMinStreamElems in ops_csrc/kernels_impl.h: shorter ranges never stream
# A range long enough to stream, with every tail length of an 8- or 16-lane vector; then past two thread
# blocks (32768 elements each at 2 threads), where each block picks its own path.
STREAM_SIZES = [STREAM_MIN + k for k in range(17)] + [2 * 32768 + STREAM_MIN + k for k in (0, 9)]


@pytest.fixture
def restore_stream_policy():
    previous = ops_runtime.stream_policy()
    yield
    ops_runtime.set_stream_policy(previous)


def _offset_view(n: int, offset: int, dtype: torch.dtype, fill: torch.Tensor) -> torch.Tensor:
    # A view starting `offset` elements into a fresh buffer: offset 1 misaligns it for every vector store,
    # offset 8 aligns a 16-bit array to 16 bytes (AVX2 width) but not 32 (AVX-512).
    buf = torch.zeros(n + offset, dtype=dtype)
    view = buf[offset:]
    view.copy_(fill)
    return view


@pytest.mark.parametrize("simd", [lv for lv in LEVELS if lv != "scalar"])  # scalar never streams
@pytest.mark.parametrize("policy", ["none", "copy", "all"])
@pytest.mark.parametrize("copy_off,rmw_off", [(0, 0), (1, 0), (0, 1), (8, 8), (3, 5)])
@pytest.mark.parametrize("cdt", [torch.bfloat16, torch.float16])
def test_param_copy_equals_cast_on_every_store_path(
    simd, restore_stream_policy, policy, copy_off, rmw_off, cdt
):
    # Each store policy and alignment takes its own loop in the kernel (streamed copy, streamed
    # param/states, plain stores); every one must give the plain path's bits, and the copy must equal
    # the cast of the updated param, tails included.
    ops.force_simd_level(simd)
    gen = torch.Generator().manual_seed(copy_off * 10 + rmw_off)
    for n in STREAM_SIZES:
        p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m0, v0 = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
        outs = []
        for pol in dict.fromkeys(("none", policy)):
            ops_runtime.set_stream_policy(pol)
            p, m, v = (_offset_view(n, rmw_off, torch.float32, t) for t in (p0, m0, v0))
            copy = _offset_view(n, copy_off, cdt, torch.zeros(n))
            hyper = dict(step=2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
            assert ops.adam_update(p, g, m, v, **hyper, param_copy=copy)
            assert torch.equal(copy.view(torch.int16), p.to(cdt).view(torch.int16)), f"n={n}"
            outs.append((p, m, v, copy))
        for a, b in zip(outs[0], outs[-1]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"n={n}"


def test_stream_policy_switch(restore_stream_policy):
    assert ops_runtime.stream_policy() == "none"  # the default
    for policy in ops_runtime.STREAM_POLICIES:
        ops_runtime.set_stream_policy(policy)
        assert ops_runtime.stream_policy() == policy
    with pytest.raises(ValueError, match="unknown stream policy 'fast'"):
        ops_runtime.set_stream_policy("fast")
