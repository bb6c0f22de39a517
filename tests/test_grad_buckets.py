"""Stage 2's gradient buckets (zero/layout/grad_buckets.py): gradients leave the device during backward.

Numerics: a stage-2 engine produces, bit for bit, the same gradient partition as the flat-buffer path
(stage 0 on one rank; stage 1 on two ranks), so its losses and weights equal that path's exactly - with
gradient accumulation, clipping and fp16 loss scaling (an overflowing step skipped), buckets smaller than a
parameter, one bucket larger than the whole model, one bucket per parameter. The flat path itself and the
bucketed one are checked against torch.optim.AdamW within the project's tolerance (the C++ kernel and
torch's AdamW round differently). Memory: `engine.gradient_memory()` counts the bucket and partition
tensors; stage 2 holds no gradient buffer of the model, and the counts equal what the estimator says.
"""

from __future__ import annotations

import logging

import pytest
import torch
from dist_helpers import run_on_ranks

import zero
from offload.estimate import SwapBufferSettings, TrainingSetup, count_parameters, estimate
from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch
from zero.layout.partition import PAD_ELEMS

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)
DATA = corpus_bytes()
STEPS = 5
BATCH = 4
LOSS_ATOL = 2e-5  # tests/test_engine.py: the kernel's rounding against torch's AdamW over a few steps
PARAM_ATOL = 2e-5
LARGEST = 256 * 32  # the embedding: larger than a 3000-element bucket


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY)


def config(
    stage, *, offload="none", tmp=None, gas=1, clip=0.0, fp16=False, bf16=False, batch=BATCH, **zero_keys
):
    zo = {"stage": stage, "sub_group_size": 8000, **zero_keys}
    if offload != "none":
        zo["offload_optimizer"] = {"device": offload, "nvme_path": str(tmp)}
    cfg = {
        "train_batch_size": batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": clip,
        "zero_optimization": zo,
    }
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def run(engine, rank=0, world_size=1, steps=STEPS, poison_step=None, same_data=False):
    """Train `steps` steps on this rank's share of each global batch; losses and final weights.
    `poison_step`: that step's last micro-batch backpropagates an infinite loss (an fp16 overflow)."""
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(steps):
        x, y = get_batch(DATA, BATCH, TINY.seq_len, step)
        share = BATCH // world_size
        mine = slice(0, share) if same_data else slice(rank * share, (rank + 1) * share)
        x, y = x[mine], y[mine]
        for k in range(gas):
            loss = engine(x[k * micro : (k + 1) * micro], y[k * micro : (k + 1) * micro])
            if step == poison_step and k == gas - 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    params = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    return losses, params


def train(cfg, **kw):
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    try:
        losses, params = run(engine, **kw)
        return losses, params, engine.gradient_memory(), engine.skipped_steps
    finally:
        engine.close()


# -------------------------------------------------------------------------------------------- one rank
ONE_RANK = {
    "fp32-none-gas2-clip-small": dict(gas=2, clip=0.05, reduce_bucket_size=3000, overlap_comm=True),
    "fp32-cpu-gas2-clip-whole": dict(offload="cpu", gas=2, clip=0.05, reduce_bucket_size=10**9),
    "fp16-none-gas2-per-param": dict(fp16=True, gas=2, reduce_bucket_size=0, overlap_comm=True),
    "fp16-cpu-clip-small": dict(fp16=True, offload="cpu", clip=0.05, reduce_bucket_size=3000),
    "bf16-nvme-pipeline": dict(offload="nvme", bf16=True, reduce_bucket_size=3000, overlap_comm=True),
}


@pytest.mark.parametrize("name", list(ONE_RANK))
def test_one_rank_equals_flat_buffer_bit_for_bit(tmp_path, name):
    kw = dict(ONE_RANK[name])
    zero_keys = {k: kw.pop(k) for k in ("reduce_bucket_size", "overlap_comm") if k in kw}
    poison = 2 if kw.get("fp16") else None
    flat = train(config(0, tmp=tmp_path, **kw), poison_step=poison)
    cfg2 = config(2, tmp=tmp_path, **kw, **zero_keys)
    if kw.get("offload") == "nvme":  # the optimizer steps sub-groups during backward, fed by the buckets
        cfg2["zero_optimization"]["offload_optimizer"]["pipeline_read"] = True
    got = train(cfg2, poison_step=poison)
    assert got[0] == flat[0]  # every micro-batch's loss
    assert torch.equal(got[1], flat[1])
    assert got[3] == flat[3]
    if poison is not None:
        assert got[3] == 1  # the overflowing step was skipped, by both
    mem = got[2]
    assert mem.full_buffer_bytes == 0 and flat[2].full_buffer_bytes > 0
    # one rank on a CPU-only machine: nothing to reduce or move, the gradients go straight into the
    # partition (no bucket); the buckets run with two ranks below and on a GPU
    assert mem.bucket_bytes == 0 and mem.buckets_reduced == 0


@pytest.mark.parametrize("device", ["cuda"], indirect=True)  # tests/conftest.py: skipped without CUDA
@pytest.mark.parametrize(
    "kw",
    [
        dict(gas=2, reduce_bucket_size=3000, overlap_comm=True),
        dict(bf16=True, offload="cpu", reduce_bucket_size=3000, overlap_comm=True),
        dict(bf16=True, offload="cpu", reduce_bucket_size=3000),
        dict(bf16=True, offload="nvme", reduce_bucket_size=3000, pipeline=True),
    ],
)
def test_cuda_side_stream_equals_flat_buffer_bit_for_bit(tmp_path, device, kw):
    """On a GPU the buckets are reduced and moved on a side stream (to the host through pinned staging):
    the same weights as the flat buffer, and gradient memory on the device is the buckets (+ partition)."""
    kw = dict(kw)
    zero_keys = {k: kw.pop(k) for k in ("reduce_bucket_size", "overlap_comm") if k in kw}
    pipeline = kw.pop("pipeline", False)

    def cuda_run(cfg):
        engine, *_ = zero.initialize(model=make_model(), config=cfg)
        assert engine.device.type == "cuda"
        try:
            losses = []
            gas = engine.gradient_accumulation_steps()
            micro = engine.train_micro_batch_size_per_gpu()
            for step in range(STEPS):
                x, y = (t.to(engine.device) for t in get_batch(DATA, BATCH, TINY.seq_len, step))
                for k in range(gas):
                    loss = engine(x[k * micro : (k + 1) * micro], y[k * micro : (k + 1) * micro])
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
            params = torch.cat([p.detach().float().cpu().reshape(-1) for p in engine.module.parameters()])
            return losses, params, engine.gradient_memory()
        finally:
            engine.close()

    flat = cuda_run(config(0, tmp=tmp_path, **kw))
    cfg2 = config(2, tmp=tmp_path, **kw, **zero_keys)
    if pipeline:
        cfg2["zero_optimization"]["offload_optimizer"]["pipeline_read"] = True
    got = cuda_run(cfg2)
    assert got[0] == flat[0] and torch.equal(got[1], flat[1])
    mem = got[2]
    assert mem.full_buffer_bytes == 0 and mem.buckets_reduced > 0
    if kw.get("offload"):
        assert mem.device_bytes == mem.bucket_bytes and mem.staging_bytes == mem.bucket_bytes


def _reference(steps, gas, clip):
    """torch.optim.AdamW on the same micro-batches: (loss / gas).backward() accumulates, then clip, step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    micro = BATCH // gas
    losses = []
    for step in range(steps):
        x, y = get_batch(DATA, BATCH, TINY.seq_len, step)
        for k in range(gas):
            loss = model(x[k * micro : (k + 1) * micro], y[k * micro : (k + 1) * micro])
            (loss / gas).backward()
            losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("stage", [1, 2])
def test_matches_torch_adamw_with_accumulation_and_clipping(stage):
    ref_losses, ref_params = _reference(STEPS, gas=2, clip=0.05)
    losses, params, mem, _ = train(config(stage, gas=2, clip=0.05, reduce_bucket_size=3000))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= LOSS_ATOL
    assert (params - ref_params).abs().max().item() <= PARAM_ATOL
    assert (mem.full_buffer_bytes == 0) == (stage == 2)


def _estimated_grads(numel, offload, bucket, overlap, world_size):
    """The estimator's 16-bit gradient bytes on the device for stage 2 (bf16 or fp16: 2 bytes)."""
    setup = TrainingSetup(
        numel,
        LARGEST,
        gpus_per_node=world_size,
        precision="bf16",
        optimizer="adamw",
        buffers=SwapBufferSettings(reduce_bucket_size=bucket, overlap_comm=overlap),
    )
    return estimate(setup, 2, offload).gpu["grads_16bit"]


def test_stage1_keeps_the_full_gradient_buffer():
    """Stage 1 keeps what DeepSpeed's stage 1 keeps: the whole model's 16-bit gradients."""
    losses, params, mem, _ = train(config(1, bf16=True, offload="cpu"), steps=1)
    assert mem.full_buffer_bytes >= count_parameters(make_model()).params * 2
    assert mem.bucket_bytes == 0


def test_gradient_keys_are_warned_when_ignored(caplog):
    cfg = config(2, contiguous_gradients=False, reduce_scatter=False, allgather_bucket_size=1000)
    with caplog.at_level(logging.WARNING):
        engine, *_ = zero.initialize(model=make_model(), config=cfg)
    engine.close()
    text = caplog.text
    for key in ("contiguous_gradients", "reduce_scatter", "allgather_bucket_size"):
        assert f"zero_optimization.{key}" in text and "ignored" in text


# ------------------------------------------------------------------------------------------- two ranks
# different halves per rank, one micro-batch: stage 2 and stage 1 sum the same two gradients -> identical.
# 3000-element buckets are smaller than the embedding (8192): it passes through in pieces.
TWO_RANK = {
    "fp16-cpu-clip": dict(fp16=True, offload="cpu", clip=0.05, reduce_bucket_size=3000, overlap_comm=True),
    "fp32-none": dict(reduce_bucket_size=3000, overlap_comm=True),
    "bf16-nvme": dict(bf16=True, offload="nvme", reduce_bucket_size=3000, overlap_comm=True),
    "bf16-cpu-whole": dict(bf16=True, offload="cpu", reduce_bucket_size=10**9),
    "bf16-none-per-param": dict(bf16=True, reduce_bucket_size=0, overlap_comm=True),
    "fp16-none-one-bucket": dict(fp16=True, reduce_bucket_size=3000),
}


def _two_rank_main(rank, world_size, nvme_dir, out_dir):
    out = {}
    for name, kw in TWO_RANK.items():
        poison = 2 if kw.get("fp16") else None
        res = {}
        for stage in (1, 2):
            cfg = config(stage, tmp=nvme_dir, **kw)
            engine, *_ = zero.initialize(model=make_model(), config=cfg)
            losses, params = run(engine, rank, world_size, poison_step=poison)
            res[stage] = (losses, params, engine.gradient_memory(), engine.skipped_steps, engine.part_numel)
            res[f"comm{stage}"] = engine.last_report.comm_bytes
            engine.close()
        out[name] = res
    # accumulation over two micro-batches, each rank its own half / both ranks the same half
    for same in (False, True):
        cfg = config(2, offload="cpu", gas=2, reduce_bucket_size=3000, overlap_comm=True)
        engine, *_ = zero.initialize(model=make_model(), config=cfg)
        out[f"gas2-same{same}"] = run(engine, rank, world_size, same_data=same)
        engine.close()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    results, _ = run_on_ranks(_two_rank_main, tmp_path_factory.mktemp("buckets"))
    return results


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_two_ranks_stage2_equals_stage1_bit_for_bit(two_ranks, name):
    for r in range(2):
        res = two_ranks[r][name]
        assert res[2][0] == res[1][0]
        assert torch.equal(res[2][1], res[1][1])
        assert res[2][3] == res[1][3]
        if name.startswith("fp16"):
            assert res[2][3] == 1
        assert res["comm2"] > 0
    assert torch.equal(two_ranks[0][name][2][1], two_ranks[1][name][2][1])  # all-gathered weights


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_two_ranks_gradient_memory_is_the_partition_plus_buckets(two_ranks, name):
    kw = TWO_RANK[name]
    offload, bucket, overlap = (
        kw.get("offload", "none"),
        kw["reduce_bucket_size"],
        kw.get("overlap_comm", False),
    )
    elem = 4 if not (kw.get("fp16") or kw.get("bf16")) else 2
    numel = count_parameters(make_model()).params
    capacity = min(bucket, numel) if bucket > 0 else LARGEST
    for r in range(2):
        res = two_ranks[r][name]
        mem, part = res[2][2], res[2][4]
        assert mem.buckets_reduced > 0
        assert mem.full_buffer_bytes == 0 and mem.bucket_bytes == (2 if overlap else 1) * capacity * elem
        if offload != "none":  # the fp32 partition in pinned host memory; on the device only the buckets
            assert mem.partition_host_bytes == part * 4 and mem.device_bytes == mem.bucket_bytes
        else:  # the partition in the model dtype, on the device
            assert mem.partition_device_bytes == part * elem and mem.partition_host_bytes == 0
        assert res[1][2].full_buffer_bytes == 2 * part * elem  # stage 1: the whole model's gradients
        if elem == 2:  # the estimator's device gradients: the same, up to the flat buffer's padding
            est = _estimated_grads(numel, offload, bucket, overlap, world_size=2)
            assert 0 <= mem.device_bytes - est <= PAD_ELEMS * 2


def test_two_ranks_accumulation_matches_one_rank(two_ranks):
    # both ranks given the same half: the reduced sum is exactly twice one rank's, and the mean equal
    cfg = config(2, offload="cpu", gas=2, batch=BATCH // 2, reduce_bucket_size=3000)
    one_same, params_same, _, _ = train(cfg, world_size=2, same_data=True)
    for r in range(2):
        losses, params = two_ranks[r]["gas2-sameTrue"]
        assert losses == one_same and torch.equal(params, params_same)
    # each rank its own half: one rank with the whole batch, up to summation order
    ref_losses, ref_params, _, _ = train(config(2, offload="cpu", gas=4, reduce_bucket_size=3000))
    for r in range(2):
        losses, params = two_ranks[r]["gas2-sameFalse"]
        assert (params - ref_params).abs().max().item() <= PARAM_ATOL
        assert losses[:2] == ref_losses[2 * r : 2 * r + 2]  # the first step's micro-batches: same weights
