"""The planner chooses `offload_optimizer.ratio` and the NVMe buffer counts (offload.estimate.plan): a device
share pays on a GPU whose optimizer and PCIe are fast, never on a machine without a GPU; the buffer counts
stay within the pinned budget and the rejected ones say why."""

from __future__ import annotations

import dataclasses

import pytest
from plan_helpers import GPT125, llama7

from offload.config import load_config
from offload.estimate.machine import MachineProfile
from offload.estimate.plan import plan_training, predict_training
from offload.estimate.probe import ComputeProfile

GiB = 1 << 30
LLAMA7 = llama7(seq_len=2048)


def test_a_fast_gpu_takes_a_device_share_of_the_optimizer() -> None:
    """The CPU optimizer bounds the step; a device updating 50x faster over a fast link takes part of it."""
    rates = ComputeProfile(
        cpu_optimizer_elems_per_s=5e8, matmul_flops=4e14, device="cuda", h2d_gbps=50.0, d2h_gbps=50.0,
        device_optimizer_elems_per_s=2.5e10,
    )  # fmt: skip
    box = MachineProfile(gpu_bytes=80 * GiB, ram_bytes=256 * GiB, nvme_read_gbps=6.0, nvme_write_gbps=5.0)
    plan = plan_training(LLAMA7, box, rates, precision="bf16", offload_optimizer="cpu", stages=(3,))
    c = plan.chosen
    assert c.ratio < 1.0 and c.fits
    # the host share steps on the CPU while the device share steps on the GPU
    part = LLAMA7.params
    host = c.times["cpu optimizer"] * rates.cpu_optimizer_elems_per_s
    device = c.times["device optimizer"] * rates.device_optimizer_elems_per_s
    assert 0 < host < part and 0 < device and round(host + device) == part
    whole = [r for r, _ in plan.rejected if r.ratio == 1.0 and r.micro_batch == c.micro_batch]
    assert whole and all(r.seconds > c.seconds for r in whole if r.checkpointing == c.checkpointing)
    assert load_config(plan.config).zero_optimization.offload_optimizer.ratio == c.ratio


def test_without_a_gpu_the_ratio_stays_one() -> None:
    """On a CPU-only machine the device is the host: a device share would step on the same CPU."""
    rates = ComputeProfile(
        cpu_optimizer_elems_per_s=3e8,
        matmul_flops=6e10,
        host_copy_gbps=2.0,
        device_optimizer_elems_per_s=2.5e10,
    )
    box = MachineProfile(
        ram_bytes=32 * GiB, nvme_free_bytes=500 * GiB, nvme_read_gbps=2.0, nvme_write_gbps=1.5, cpu_only=True
    )
    plan = plan_training(GPT125, box, rates, precision="fp32", offload_optimizer="cpu", stages=(2,))
    assert plan.chosen.ratio == 1.0
    assert all(c.ratio == 1.0 for c, _ in plan.rejected)
    assert any("ratio stays 1: no GPU" in n for n in plan.notes)
    assert load_config(plan.config).zero_optimization.offload_optimizer.ratio == 1.0


def test_buffer_counts_stay_within_the_pinned_budget() -> None:
    """Every NVMe buffer count the plan weighs is charged to the pinned budget: a count whose staging slots
    exceed it is rejected as not fitting, and the chosen counts are in the printed config."""
    rates = ComputeProfile(cpu_optimizer_elems_per_s=3e8, matmul_flops=6e10, host_copy_gbps=2.0)
    box = MachineProfile(
        ram_bytes=32 * GiB, nvme_free_bytes=500 * GiB, nvme_read_gbps=2.0, nvme_write_gbps=1.5, cpu_only=True
    )
    budget = 3 * GiB
    plan = plan_training(
        LLAMA7, box, rates, precision="bf16", offload_optimizer="nvme", offload_param="nvme", stages=(3,),
        pinned_budget=budget, sub_group_size=100_000_000,
    )  # fmt: skip
    c = plan.chosen
    assert c.fits and c.staging_bytes <= budget
    counts = {(r.optimizer_buffer_count, r.param_buffer_count): (r, why) for r, why in plan.rejected}
    over = [(r, why) for r, why in counts.values() if r.staging_bytes > budget]
    assert over and all(not r.fits and "pinned" in why for r, why in over)
    weighed = [c, *(r for r, _ in counts.values())]
    assert {r.optimizer_buffer_count for r in weighed} >= {1, 2, 4, 8}
    assert {r.param_buffer_count for r in weighed} >= {1, 2, 5, 8}
    # one slot: the disk waits for the optimizer (and the optimizer for the disk)
    one = [r for r in weighed if r.optimizer_buffer_count == 1 and r.fits]
    for r in one:
        two = [
            t
            for t in weighed
            if t.optimizer_buffer_count == 2 and t.param_buffer_count == r.param_buffer_count
        ]
        assert two and r.times["disk (not overlapped)"] > two[0].times["disk (not overlapped)"]
        assert r.seconds > two[0].seconds
    assert one
    z = load_config(plan.config).zero_optimization
    assert z.offload_optimizer.buffer_count == c.optimizer_buffer_count
    assert z.offload_param.buffer_count == c.param_buffer_count


def test_the_training_block_rate_prices_the_transformer_blocks() -> None:
    """With a probed training-block rate (norms, activations, attention and autograd around the matmuls) the
    blocks' FLOPs run at it and only the rest (the output head) at the matmul rate."""
    box = MachineProfile(ram_bytes=32 * GiB, nvme_free_bytes=500 * GiB, cpu_only=True)
    base = ComputeProfile(cpu_optimizer_elems_per_s=3e8, matmul_flops=6e10, host_copy_gbps=2.0)
    slow = dataclasses.replace(base, train_flops=2e10)
    kw = dict(stage=2, offload_optimizer="cpu", precision="fp32", micro_batch=2)
    a = predict_training(GPT125, box, base, **kw)
    b = predict_training(GPT125, box, slow, **kw)
    per_token = 12 * (2 * 12 * 768**2 + 4 * 128 * 768)  # 12 layers: 12 h^2 weights and attention each
    assert GPT125.block_flops_per_token() == per_token
    blocks = 3 * per_token * 2 * 128
    assert b.times["compute"] - a.times["compute"] == pytest.approx(blocks / 2e10 - blocks / 6e10)
    # stage 3 without a GPU copies the parameters 4 times a step (gathers, gradient, updated master)
    s3 = predict_training(
        GPT125, box, base, stage=3, offload_param="cpu", offload_optimizer="cpu", precision="fp32"
    )
    assert s3.times["copies"] == pytest.approx(4 * GPT125.params * 4 / 2e9)


def test_probe_machine_measures_a_training_block_only_for_training() -> None:
    from offload.estimate.probe import probe_machine

    train = probe_machine(tokens=32, hidden=64, dtype="fp32", device="cpu", seq_len=16, heads=4)
    forward = probe_machine(tokens=32, hidden=64, dtype="fp32", device="cpu")
    assert train.train_flops is not None and train.train_flops > 0 and "train_flops" in train.sources
    assert forward.train_flops is None
