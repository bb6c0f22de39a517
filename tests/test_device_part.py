"""Twin-Flow's device share stepped by torch (zero/optimizer/tiers/device_part.py: `TorchDevicePart`).

On CUDA the device share of a split (`offload_optimizer.ratio` below 1.0) is stepped by torch's fused
Adam/AdamW while the host steps the offloaded share. Here, without a GPU, the same part is forced with
`ZeroEngine(..., device_part="torch")` (torch's single-tensor Adam on the CPU):

* one part against `torch.optim.AdamW` / `Adam` on the same parameters: bit-exact, and against the CPU
  kernels within the project's tolerance;
* an engine with ratio 0.5 and the torch part against ratio 1.0 (CPU kernels only) over several steps with
  clipping, gradient accumulation and fp16 overflow skips: within tolerance, skips identical;
* other rules and non-fp32 states refused with the key named, before anything is left behind;
* checkpoints round-trip bit-exactly, into the torch part and into another split.

The CUDA tests run the real path (fused Adam on the GPU) and are skipped without one.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import LOSS_ATOL, PARAM_ATOL, make_model, train
from state_helpers import MICRO, SUB, assert_same, config, device_share, weights

import zero
from offload.config import load_config
from zero.engine import ZeroEngine
from zero.optimizer.rules import UpdateRule
from zero.optimizer.tiers.device import DeviceState
from zero.optimizer.tiers.device_part import TorchDevicePart, wants_torch_part

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ON_CUDA = pytest.mark.parametrize("device", ["cuda"], indirect=True)  # engines built on the GPU (conftest)


def group(adamw: bool = True, **kw) -> dict:
    g = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "adamw_mode": adamw}
    g.update(kw)
    return g


def part_over(master: torch.Tensor, kind: str = "adamw", **kw) -> TorchDevicePart:
    n = master.numel()
    z = [torch.zeros(n, device=master.device) for _ in range(2)]
    state = DeviceState(master, z, 1000, pinned=False)
    return TorchDevicePart(UpdateRule(kind), group(kind == "adamw"), state, **kw)


def engine(cfg: dict, device_part: str = "auto") -> ZeroEngine:
    return ZeroEngine(make_model(), load_config(cfg), device_part=device_part)


def run(cfg: dict, device_part: str = "auto", micro: int = MICRO) -> dict:
    e = engine(cfg, device_part)
    try:
        losses = train(e, micro)
        return {
            "losses": losses,
            "weights": weights(e),
            "state": e.optimizer.state_dict(),
            "skipped": e.skipped_steps,
            "info": e.optimizer_state_info(),
        }
    finally:
        e.close()


def assert_close_runs(got: dict, want: dict) -> None:
    assert got["skipped"] == want["skipped"]
    assert got["state"]["step"] == want["state"]["step"]
    worst = max(abs(a - b) for a, b in zip(got["losses"], want["losses"]))
    assert worst <= LOSS_ATOL, f"losses differ by {worst:.3g}"
    torch.testing.assert_close(got["state"]["master"], want["state"]["master"], rtol=2e-5, atol=PARAM_ATOL)
    for a, b in zip(got["state"]["states"], want["state"]["states"]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-7)


# ------------------------------------------------------------------------------------ one part
@pytest.mark.parametrize("adamw", [True, False])
def test_part_is_torch_adam_bit_for_bit(adamw):
    torch.manual_seed(0)
    n, scale = 5000, 4096.0
    init = torch.randn(n)
    part = part_over(init.clone(), "adamw" if adamw else "adam")
    ref_param = torch.nn.Parameter(init.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = cls([ref_param], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(1, 6):
        raw = torch.randn(n) * scale  # loss-scaled sums, as the engine hands them over
        keep = raw.clone()
        part.launch(raw, step, group(adamw), scale)
        assert torch.equal(raw, keep)  # the pass's gradients are not changed
        ref_param.grad = raw / scale
        ref.step()
        assert torch.equal(part.master, ref_param.detach())
    st = ref.state[ref_param]
    got = {}
    part.read_all(lambda s, k, m, states: got.setdefault(s, states))
    assert torch.equal(torch.cat([v[0] for _, v in sorted(got.items())]), st["exp_avg"])
    assert torch.equal(torch.cat([v[1] for _, v in sorted(got.items())]), st["exp_avg_sq"])
    assert part.launches == 5


def test_part_agrees_with_the_cpu_kernels():
    torch.manual_seed(1)
    n, scale = 4096, 8.0
    init = torch.randn(n)
    part = part_over(init.clone())
    master, states = init.clone(), [torch.zeros(n), torch.zeros(n)]
    rule = UpdateRule("adamw")
    for step in range(1, 6):
        raw = torch.randn(n) * scale
        part.launch(raw, step, group(), scale)
        g = dict(group(), bias_correction=True)
        rule.apply(
            master, raw, states, step=step, group=g, grad_scale=scale, param_copy=None, check_finite=False
        )
    torch.testing.assert_close(part.master, master, rtol=2e-5, atol=PARAM_ATOL)


def test_other_rules_and_states_are_refused_with_the_key():
    m = torch.zeros(10)
    for kind in ("adagrad", "lion"):
        st = DeviceState(m, [torch.zeros(10)], 10, pinned=False)
        with pytest.raises(NotImplementedError, match=f"optimizer.type '{kind}'.*ratio"):
            TorchDevicePart(UpdateRule(kind), group(), st)
    st = DeviceState(m, [torch.zeros(10, dtype=torch.bfloat16)] * 2, 10, pinned=False)
    with pytest.raises(NotImplementedError, match="state_dtype='bf16'.*ratio"):
        TorchDevicePart(UpdateRule("adamw", "bf16"), group(), st)
    st = DeviceState(m, [torch.zeros(10)] * 2, 10, pinned=False)
    with pytest.raises(NotImplementedError, match="bias_correction=false"):
        TorchDevicePart(UpdateRule("adamw"), group(bias_correction=False), st)
    with pytest.raises(ValueError, match="device_part='gpu'"):
        wants_torch_part("gpu", torch.device("cpu"))
    assert not wants_torch_part("auto", torch.device("cpu"))
    assert wants_torch_part("auto", torch.device("cuda")) and wants_torch_part("torch", torch.device("cpu"))


# ---------------------------------------------------------------------------------- in the engine
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_ratio_with_torch_part_matches_ratio_one(tmp_path, stage):
    """fp32 weights (the part steps the parameters' own memory), clipping 0.5, two micro-batches a step."""
    ref = run(config("cpu", tmp_path, stage, ratio=1.0, fp16=False))
    got = run(config("cpu", tmp_path, stage, ratio=0.5, fp16=False), device_part="torch")
    assert got["info"].device_numel == device_share(got["info"].numel, 0.5) > 0
    assert got["info"].device_part == "torch" and ref["info"].device_part == ""
    assert_close_runs(got, ref)
    # the device share really was torch's: its result differs from the CPU kernels' in the last bits
    kernels = run(config("cpu", tmp_path, stage, ratio=0.5, fp16=False))
    assert kernels["info"].device_part == "kernels"
    assert not torch.equal(got["state"]["master"], kernels["state"]["master"])
    assert torch.equal(kernels["state"]["master"], ref["state"]["master"])


def test_ratio_zero_steps_the_whole_state_with_torch(tmp_path):
    """ratio 0: everything on the device, stepped by torch alone (no host chunks)."""
    ref = run(config("cpu", tmp_path, 2, ratio=1.0, fp16=False))
    got = run(config("cpu", tmp_path, 2, ratio=0.0, fp16=False), device_part="torch")
    assert got["info"].device_numel == got["info"].numel and got["info"].device_part == "torch"
    assert_close_runs(got, ref)


def test_fp16_overflow_skips_both_shares(tmp_path):
    """A loss scale of 2^24 overflows the first steps: both shares skip them, then train alike."""
    cfgs = []
    for ratio in (1.0, 0.5):
        cfg = config("cpu", tmp_path, 2, ratio=ratio)
        cfg["fp16"]["initial_scale_power"] = 24
        cfgs.append(cfg)
    ref = run(cfgs[0], micro=2 * MICRO)
    got = run(cfgs[1], device_part="torch", micro=2 * MICRO)
    assert ref["skipped"] > 0 and ref["state"]["step"] > 0
    assert got["skipped"] == ref["skipped"] and got["state"]["step"] == ref["state"]["step"]
    worst = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    assert worst <= 1e-3  # fp16 weights: the shares' last-bit differences may round one weight apart
    torch.testing.assert_close(got["state"]["master"], ref["state"]["master"], rtol=1e-3, atol=1e-4)


def test_unsupported_rule_with_a_device_share_is_refused(tmp_path):
    cfg = config("cpu", tmp_path, 2, ratio=0.5, fp16=False)
    cfg["optimizer"] = {"type": "Adagrad", "params": {"lr": 1e-2}}
    with pytest.raises(NotImplementedError, match="optimizer.type 'adagrad'"):
        engine(cfg, device_part="torch")
    assert run(cfg, micro=2)["info"].device_numel > 0  # the CPU kernels step it on a CPU-only machine
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 1.0
    assert run(cfg, device_part="torch", micro=2)["info"].device_numel == 0  # no device share: no torch part


def test_checkpoint_round_trip_with_torch_part(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    cfg = config("nvme", tmp_path, 2, ratio=0.5, max_in_cpu=SUB, fp16=False)
    ref = run(cfg, device_part="torch", micro=2 * MICRO)
    e = engine(cfg, device_part="torch")
    train(e, MICRO)
    saved = e.optimizer.state_dict()
    e.save_checkpoint(ckpt, tag="t")
    e.close()
    e = ZeroEngine(make_model(seed=1), load_config(cfg), device_part="torch")
    e.load_checkpoint(ckpt, tag="t")
    loaded = e.optimizer.state_dict()
    assert torch.equal(loaded["master"], saved["master"])
    assert all(torch.equal(a, b) for a, b in zip(loaded["states"], saved["states"]))
    assert train(e, MICRO, start=MICRO) == ref["losses"][MICRO:]
    assert_same(weights(e), ref["weights"])
    e.close()
    # into an engine without a device share, continuing within tolerance of the uninterrupted run
    other = config("cpu", tmp_path, 2, ratio=1.0, fp16=False)
    e, *_ = zero.initialize(model=make_model(seed=1), config=other)
    e.load_checkpoint(ckpt, tag="t")
    losses = train(e, MICRO, start=MICRO)
    assert max(abs(a - b) for a, b in zip(losses, ref["losses"][MICRO:])) <= LOSS_ATOL
    e.close()


# ------------------------------------------------------------------------------------------- CUDA
@ON_CUDA
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_cuda_ratio_matches_ratio_one(tmp_path, stage, device):
    ref = run(config("cpu", tmp_path, stage, ratio=1.0, fp16=False, bf16={"enabled": True}))
    got = run(config("cpu", tmp_path, stage, ratio=0.5, fp16=False, bf16={"enabled": True}))
    assert got["info"].device_numel > 0 and got["info"].device_part == "torch"
    assert got["skipped"] == ref["skipped"] == 0
    worst = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    assert worst <= 1e-2  # bf16 weights: a last-bit master difference may round a weight apart
    torch.testing.assert_close(got["state"]["master"], ref["state"]["master"], rtol=1e-2, atol=1e-3)


@ON_CUDA
@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_cuda_fp32_ratio_matches_ratio_one(tmp_path, ratio, device):
    ref = run(config("cpu", tmp_path, 2, ratio=1.0, fp16=False))
    got = run(config("cpu", tmp_path, 2, ratio=ratio, fp16=False))
    assert got["info"].device_numel > 0 and got["info"].device_part == "torch"
    assert_close_runs(got, ref)


@CUDA
def test_cuda_part_is_fused_torch_adamw():
    torch.manual_seed(0)
    init = torch.randn(5000, device="cuda")
    part = part_over(init.clone())
    assert part.fused
    p = torch.nn.Parameter(init.clone())
    ref = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    for step in range(1, 4):
        raw = torch.randn(5000) * 64.0  # host gradients, as the engine's pinned partition
        part.launch(raw, step, group(), 64.0)
        p.grad = raw.cuda() / 64.0
        ref.step()
    torch.testing.assert_close(part.master, p.detach(), rtol=2e-5, atol=PARAM_ATOL)


@ON_CUDA
def test_cuda_three_tiers(tmp_path, device):
    """[GPU | pinned host | NVMe] against everything on NVMe."""
    ref = run(config("nvme", tmp_path, 2, ratio=1.0, max_in_cpu=0, fp16=False))
    got = run(config("nvme", tmp_path, 2, ratio=0.3, max_in_cpu=2 * SUB, fp16=False))
    dev = device_share(got["info"].numel, 0.3)
    assert got["info"].device_numel == dev > 0 and got["info"].resident_numel == dev + 2 * SUB
    assert_close_runs(got, ref)


@ON_CUDA
def test_cuda_adagrad_with_a_device_share_is_refused(tmp_path, device):
    cfg = config("cpu", tmp_path, 2, ratio=0.5, fp16=False)
    cfg["optimizer"] = {"type": "Adagrad", "params": {"lr": 1e-2}}
    with pytest.raises(NotImplementedError, match="optimizer.type 'adagrad'"):
        zero.initialize(model=make_model(), config=cfg)
