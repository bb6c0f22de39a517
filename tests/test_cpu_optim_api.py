"""offload.ops as an API: optimizer classes, state_dict round trips (ours <-> torch), input errors,
threads and SIMD switches. Numerics are in test_cpu_optim.py."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import threading

import pytest
import torch

import offload.ops as ops


def _params(seed: int, shapes=((33,), (7, 5), (1,)), dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in shapes]


def _set_grads(params, gen):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _clone_params(params):
    return [p.detach().clone().requires_grad_(True) for p in params]


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- state_dict ----


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: ops.CPUAdam(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: ops.CPUAdam(ps, lr=1e-2, weight_decay=0.1, adamw_mode=False, fp32_optimizer_states=False),
        lambda ps: ops.CPUAdagrad(ps, lr=1e-2, lr_decay=0.1, initial_accumulator_value=0.5),
        lambda ps: ops.CPULion(ps, lr=1e-3, weight_decay=0.1),
    ],
    ids=["adamw", "adam-bf16-states", "adagrad", "lion"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_bit_exactly(make, dtype):
    k, total = 4, 9
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    straight = _params(0, dtype=dtype)
    opt = make(straight)
    for _ in range(total):
        _set_grads(straight, gen_a)
        opt.step()

    resumed = _params(0, dtype=dtype)
    first = make(resumed)
    for _ in range(k):
        _set_grads(resumed, gen_b)
        first.step()
    saved = _roundtrip(first.state_dict())
    fresh_params = _clone_params(resumed)
    second = make(fresh_params)
    second.load_state_dict(saved)
    for _ in range(total - k):
        _set_grads(fresh_params, gen_b)
        second.step()

    for a, b in zip(straight, fresh_params):
        assert torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))
    for a, b in zip(straight, fresh_params):
        for key, value in opt.state[a].items():
            other = second.state[b][key]
            assert other.dtype == value.dtype, key
            assert torch.equal(other, value), key


def test_state_layout_is_torchs():
    (p,) = _params(0, shapes=((10,),))
    opt = ops.CPUAdam([p])
    p.grad = torch.ones(10)
    opt.step()
    state = opt.state[p]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert (
        torch.is_tensor(state["step"])
        and state["step"].dtype == torch.float32
        and state["step"].item() == 1.0
    )
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == p.shape


def test_bf16_params_keep_fp32_states_through_load():
    # torch's own loader casts states to the param dtype; ours must restore fp32 states bit-exactly.
    params = _params(3, dtype=torch.bfloat16)
    opt = ops.CPUAdam(params, lr=1e-2)
    _set_grads(params, torch.Generator().manual_seed(0))
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    other = ops.CPUAdam(_clone_params(params), lr=1e-2)
    other.load_state_dict(sd)
    for p_old, p_new in zip(opt.param_groups[0]["params"], other.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert other.state[p_new][key].dtype == torch.float32
            assert torch.equal(other.state[p_new][key], opt.state[p_old][key])


@pytest.mark.parametrize("adamw", [True, False])
def test_torch_state_dict_loads_into_cpu_adam_and_back(adamw):
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    gen = torch.Generator().manual_seed(2)
    theirs = _params(4)
    topt = torch_cls(theirs, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        _set_grads(theirs, gen)
        topt.step()
    ours = _clone_params(theirs)
    oopt = ops.CPUAdam(ours, lr=5.0, weight_decay=0.0, adamw_mode=not adamw)  # overwritten by the load
    oopt.load_state_dict(_roundtrip(topt.state_dict()))
    group = oopt.param_groups[0]
    assert group["lr"] == 1e-2 and group["weight_decay"] == 0.1 and group["adamw_mode"] is adamw
    assert group["bias_correction"] is True
    for _ in range(5):
        _set_grads(theirs, gen)
        for a, b in zip(theirs, ours):
            b.grad = a.grad.clone()
        topt.step()
        oopt.step()
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
        assert oopt.state[b]["step"].item() == topt.state[a]["step"].item() == 8

    # ...and ours loads into torch's optimizer, which then continues like ours.
    back = _clone_params(ours)
    topt2 = torch_cls(back, lr=1.0)
    topt2.load_state_dict(_roundtrip(oopt.state_dict()))
    _set_grads(ours, gen)
    for a, b in zip(ours, back):
        b.grad = a.grad.clone()
    oopt.step()
    topt2.step()
    for a, b in zip(ours, back):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)


def test_torch_adagrad_state_dict_loads():
    gen = torch.Generator().manual_seed(3)
    theirs = _params(5)
    topt = torch.optim.Adagrad(theirs, lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.2)
    _set_grads(theirs, gen)
    topt.step()
    ours = _clone_params(theirs)
    oopt = ops.CPUAdagrad(ours)
    oopt.load_state_dict(_roundtrip(topt.state_dict()))
    for _ in range(3):
        _set_grads(theirs, gen)
        for a, b in zip(theirs, ours):
            b.grad = a.grad.clone()
        topt.step()
        oopt.step()
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)


# ---- optimizer behaviour ----


def test_params_without_grad_are_skipped():
    a, b = _params(6, shapes=((8,), (8,)))
    before = b.detach().clone()
    opt = ops.CPUAdam([a, b], lr=1e-2)
    a.grad = torch.ones(8)
    opt.step()
    assert torch.equal(b.detach(), before)
    assert len(opt.state[b]) == 0
    assert opt.state[a]["step"].item() == 1


def test_amsgrad_rejected():
    with pytest.raises(ValueError, match="amsgrad"):
        ops.CPUAdam(_params(0), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        ops.CPUAdamW(_params(0), amsgrad=True)
    topt = torch.optim.Adam(_params(0), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        ops.CPUAdam(_params(0)).load_state_dict(topt.state_dict())


def test_constructor_matches_deepspeed_cpu_adam_order():
    # DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode,
    # fp32_optimizer_states): positional calls written for it mean the same here.
    opt = ops.CPUAdam(_params(0), 3e-3, False, (0.8, 0.9), 1e-6, 0.2, False, False, False)
    g = opt.param_groups[0]
    got = (g["lr"], g["bias_correction"], g["betas"], g["eps"], g["weight_decay"])
    assert got == (3e-3, False, (0.8, 0.9), 1e-6, 0.2)
    assert g["adamw_mode"] is False and g["fp32_optimizer_states"] is False
    assert ops.CPUAdamW(_params(0)).param_groups[0]["adamw_mode"] is True


def test_bf16_states_option():
    params = _params(0)
    opt = ops.CPUAdam(params, fp32_optimizer_states=False)
    _set_grads(params, torch.Generator().manual_seed(0))
    opt.step()
    assert opt.state[params[0]]["exp_avg"].dtype == torch.bfloat16


# ---- bad inputs ----


def _adam_args(n=16, **over):
    args = dict(param=torch.zeros(n), grad=torch.ones(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))
    args.update(over)
    return args


def _call_adam(args, **kw):
    return ops.adam_update(
        args["param"],
        args["grad"],
        args["exp_avg"],
        args["exp_avg_sq"],
        step=kw.pop("step", 1),
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        **kw,
    )


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(grad=torch.ones(15)), "grad has 15 elements"),
        (dict(exp_avg=torch.zeros(17)), "exp_avg has 17 elements"),
        (dict(grad=torch.ones(32)[::2]), "grad is not contiguous"),
        (dict(param=torch.zeros(16, 2)[:, 0]), "param is not contiguous"),
        (dict(param=torch.zeros(16, dtype=torch.float64)), "param has dtype torch.float64"),
        (dict(grad=torch.ones(16, dtype=torch.int32)), "grad has dtype torch.int32"),
        (dict(exp_avg_sq=torch.zeros(16, dtype=torch.float16)), "exp_avg_sq has dtype torch.float16"),
        (dict(exp_avg_sq=torch.zeros(16, dtype=torch.bfloat16)), "share one dtype"),
        (dict(grad=torch.ones(16).to_sparse()), "grad is a torch.sparse_coo tensor"),
        (dict(param=torch.zeros(16, device="meta")), "param is on meta"),
    ],
)
def test_bad_inputs_raise_and_modify_nothing(over, match):
    args = _adam_args(**over)
    snapshot = {k: v.clone() for k, v in args.items() if v.device.type == "cpu" and v.layout == torch.strided}
    with pytest.raises(ValueError, match=match):
        _call_adam(args)
    for k, v in snapshot.items():
        assert torch.equal(args[k], v), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_rejected():
    with pytest.raises(ValueError, match="is on cuda"):
        _call_adam(_adam_args(param=torch.zeros(16, device="cuda")))


def test_bad_scalars_and_copy_dtype():
    with pytest.raises(ValueError, match="step must be"):
        _call_adam(_adam_args(), step=0)
    with pytest.raises(ValueError, match="grad_scale"):
        _call_adam(_adam_args(), grad_scale=0.0)
    with pytest.raises(ValueError, match="param_copy has dtype torch.float32"):
        _call_adam(_adam_args(), param_copy=torch.zeros(16))
    with pytest.raises(ValueError, match="param_copy has 8 elements"):
        _call_adam(_adam_args(), param_copy=torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="grad must be a torch.Tensor"):
        ops.lion_update(
            torch.zeros(4), [0.0] * 4, torch.zeros(4), lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0
        )


def test_optimizer_errors_name_the_parameter():
    good, bad = _params(0, shapes=((4,), (3, 2)))
    opt = ops.CPUAdam([{"params": [good]}, {"params": [bad]}])
    good.grad = torch.ones(4)
    bad.grad = torch.ones(2, 3).t()  # right shape, not contiguous
    with pytest.raises(
        ValueError,
        match=r"param 0 of param group 1 \(shape \(3, 2\), dtype torch.float32\).*"
        r"grad is not contiguous",
    ):
        opt.step()
    assert opt.state[bad] == {} or opt.state[bad]["step"].item() == 0

    sparse_p = torch.zeros(5, requires_grad=True)
    sparse_p.grad = torch.ones(5).to_sparse()
    with pytest.raises(ValueError, match=r"param 0 of param group 0 .*sparse"):
        ops.CPUAdagrad([sparse_p]).step()

    meta_p = torch.zeros(5, device="meta", requires_grad=True)
    meta_p.grad = torch.zeros(5, device="meta")
    with pytest.raises(ValueError, match=r"param 0 of param group 0 \(shape \(5,\).*param is on meta"):
        ops.CPULion([meta_p]).step()


# ---- threads, SIMD switches ----


def test_thread_counts_give_identical_results():
    n = 300_001  # several chunks per thread count, with uneven ends
    gen = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(n, generator=gen), [torch.randn(n, generator=gen) for _ in range(3)]
    previous = ops.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 5):
            ops.set_num_threads(threads)
            assert ops.get_num_threads() == threads
            p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
            for step, g in enumerate(grads, start=1):
                ops.adam_update(p, g, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
            outs.append((p, m, v))
    finally:
        ops.set_num_threads(previous)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_set_num_threads_rejects_bad_values():
    with pytest.raises(ValueError, match=">= 1"):
        ops.set_num_threads(0)
    with pytest.raises(TypeError):
        ops.set_num_threads(2.0)


def test_concurrent_calls_from_python_threads_are_correct():
    # The GIL is released during a step, so two Python threads can be inside the kernels at once.
    n = 200_003
    gen = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(n, generator=gen), torch.randn(n, generator=gen)) for _ in range(4)]

    def run(p, g):
        m, v = torch.zeros(n), torch.zeros(n)
        for step in range(1, 4):
            ops.adam_update(p, g, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
        return p

    expected = [run(p.clone(), g) for p, g in inputs]
    got = [p.clone() for p, _ in inputs]
    threads = [threading.Thread(target=run, args=(got[i], inputs[i][1])) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_force_simd_level():
    previous = ops.simd_level()
    try:
        for level in ops.available_simd_levels():
            ops.force_simd_level(level)
            assert ops.simd_level() == level
        ops.force_simd_level(None)
        assert ops.simd_level() == ops.best_simd_level()
        with pytest.raises(ValueError, match="unknown SIMD level"):
            ops.force_simd_level("sse9")
        if ops.best_simd_level() != "avx512":
            with pytest.raises(ValueError, match="not supported by this CPU"):
                ops.force_simd_level("avx512")
    finally:
        ops.force_simd_level(previous)


def test_environment_sets_level_and_threads_at_import():
    # The default thread count is torch's intra-op thread count at import.
    code = (
        "import torch; torch.set_num_threads(1); import offload.ops as o; "
        "print(o.simd_level(), o.get_num_threads())"
    )
    env = dict(os.environ, ZO_SIMD="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["scalar", "1"]
    bad_env = dict(os.environ, ZO_SIMD="nope")
    bad = subprocess.run(
        [sys.executable, "-c", "import offload.ops"], env=bad_env, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "ZO_SIMD='nope'" in bad.stderr


@pytest.mark.parametrize("threads", [1, 3])
def test_multi_tensor_step_equals_per_tensor_updates(threads):
    # The optimizers run a param group as one pass split over the threads across tensor boundaries; it
    # must equal updating each tensor on its own.
    sizes = [1, 70_001, 5, 33_000, 17, 40_000, 64]
    gen = torch.Generator().manual_seed(8)
    init = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(3)]
    previous = ops.get_num_threads()
    try:
        ops.set_num_threads(threads)
        params = [t.clone().requires_grad_(True) for t in init]
        opt = ops.CPUAdam(params, lr=1e-2, weight_decay=0.1)
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g
            opt.step()
    finally:
        ops.set_num_threads(previous)
    for i, t in enumerate(init):
        p, m, v = t.clone(), torch.zeros_like(t), torch.zeros_like(t)
        for step, gs in enumerate(grads, start=1):
            ops.adam_update(
                p, gs[i], m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1
            )
        assert torch.equal(params[i].detach(), p)
        assert torch.equal(opt.state[params[i]]["exp_avg_sq"], v)


def test_step_in_forked_child_does_not_hang():
    # A forked child inherits the pool object but not its worker threads; it must rebuild the pool.
    code = (
        "import os, torch, offload.ops as o\n"
        "torch.set_num_threads(1)  # libgomp's own pool is not fork-safe; keep torch out of the question\n"
        "o.set_num_threads(2)\n"
        "n = 200_000\n"
        "p, g, m, v = torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n)\n"
        "kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)\n"
        "o.adam_update(p, g, m, v, step=1, **kw)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    o.adam_update(p, g, m, v, step=2, **kw)\n"
        "    os._exit(0 if o.get_num_threads() == 2 and bool((p < 1).all()) else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "0"


def test_many_back_to_back_pool_runs_stay_exact():
    # Hundreds of short runs with more threads than cores: late workers are skipped or join, and the
    # result must not depend on which.
    n = 200_003
    gen = torch.Generator().manual_seed(12)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    previous = ops.get_num_threads()
    results = []
    try:
        for threads in (1, 4):
            ops.set_num_threads(threads)
            p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
            for step in range(1, 201):
                ops.adam_update(p, g, m, v, step=step, **kw)
            results.append(p)
    finally:
        ops.set_num_threads(previous)
    assert torch.equal(results[0], results[1])


_PORTABLE_MAIN = r"""
#include <cstdio>
#include <vector>
#include "dispatch.h"
using namespace zo_optim;
int main() {
    set_num_threads(3);
    const size_t n = 100003;
    std::vector<float> p(n, 1.0f), g(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
    Arrays a;
    a.param = p.data(); a.grad = g.data(); a.state_a = m.data(); a.state_b = v.data();
    const bool ok = adam_step(a, n, AdamHyper{1, 1e-3, 0.9, 0.999, 1e-8, 0.0, true, true}, 1.0, true);
    bool refused = false;
    try { set_simd_level("avx2"); } catch (const std::exception&) { refused = true; }
    std::printf("%s %d %d %d", simd_level_name(simd_level()), num_threads(), ok, refused);
    std::printf(" %.9g %.9g\n", p[0], p[n - 1]);
    return 0;
}
"""


@pytest.mark.slow  # compiles the kernels from scratch
def test_portable_build_compiles_and_runs(tmp_path):
    # What a non-x86 machine builds (SIMD files empty, scalar only), checked here by defining
    # ZO_FORCE_PORTABLE: the sources must compile, link without any SIMD symbol and compute.
    import shutil

    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops_csrc")
    sources = [
        os.path.join(src, f) for f in sorted(os.listdir(src)) if f.endswith(".cpp") and f != "bindings.cpp"
    ]
    main = tmp_path / "main.cpp"
    main.write_text(_PORTABLE_MAIN)
    exe = tmp_path / "portable"
    cmd = [
        cxx,
        "-O1",
        "-std=c++17",
        "-DZO_FORCE_PORTABLE",
        "-pthread",
        f"-I{src}",
        *sources,
        str(main),
        "-o",
        str(exe),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=60).stdout.split()
    assert out[:4] == ["scalar", "3", "1", "1"]
    assert float(out[4]) == float(out[5]) and abs(float(out[4]) - 0.999) < 1e-6


def test_bandwidth_probe_computes_its_loops():
    # The benchmark's bandwidth reference must do the work it is credited with.
    from offload import _cpu_optim

    n = 100_003  # several blocks at 2 threads, with a tail
    a = torch.arange(n, dtype=torch.float32) % 7
    b = torch.full((n,), 2.0)
    out = torch.zeros(n)
    assert _cpu_optim.bandwidth_probe("read", 0, a.data_ptr(), 0, n) == float(a.double().sum())
    _cpu_optim.bandwidth_probe("scale", out.data_ptr(), a.data_ptr(), 0, n)
    assert torch.equal(out, a * 0.5)
    _cpu_optim.bandwidth_probe("triad", out.data_ptr(), a.data_ptr(), b.data_ptr(), n)
    assert torch.equal(out, a + 1.0)
    with pytest.raises(ValueError, match="unknown bandwidth probe 'copy'"):
        _cpu_optim.bandwidth_probe("copy", out.data_ptr(), a.data_ptr(), 0, n)
