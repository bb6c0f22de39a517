"""The optimizer state split between tiers (zero/optimizer/tiers/split.py): Twin-Flow
(`offload_optimizer.ratio`) and RAM-first NVMe placement (`offload_optimizer.max_in_cpu`).

* Every split steps every element with the same fused kernel (the device part is host memory on a CPU-only
  machine), so parameters, losses and optimizer state are bit-identical to the unsplit run, at every stage,
  with gradient accumulation, clipping and fp16 loss scaling.
* The NVMe bytes a step moves are those of the swapped share only (`swap_pass_bytes`, the estimator's
  formula), and none when everything stays in memory; `optimizer_state_info()` says how many elements are
  resident, swapped and on the device.
* `max_in_cpu: "auto"` takes exactly the whole sub-groups the pinned budget has left.
* Checkpoints move between splits; an NVMe write error in a split pass poisons the engine until a checkpoint
  is loaded, after which training continues exactly as without the failure.
"""

from __future__ import annotations

import errno
import json
import logging
import math

import pytest
import torch
from dist_helpers import run_on_ranks
from engine_helpers import DATA, TINY, make_model, train
from state_helpers import MICRO, SUB, assert_same, config, device_share, fail_nth_write, weights

import zero
from offload.config.zero import OffloadOptimizerConfig
from offload.swap.slots import swap_chunk
from offload.swap.split import auto_max_in_cpu, host_granule, split_numel, swap_file_bytes, swap_pass_bytes
from zero import StateCorruptedError
from zero.examples.models import get_batch
from zero.optimizer.tiers.split import plan_split


def run(cfg, micro: int = MICRO):
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    try:
        losses = train(engine, micro)
        return {
            "losses": losses,
            "weights": weights(engine),
            "state": engine.optimizer.state_dict(),
            "skipped": engine.skipped_steps,
            "info": engine.optimizer_state_info(),
            "report": engine.last_report,
        }
    finally:
        engine.close()


def assert_same_run(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["skipped"] == b["skipped"]
    assert_same(a["weights"], b["weights"])
    assert torch.equal(a["state"]["master"], b["state"]["master"])
    assert all(torch.equal(x, y) for x, y in zip(a["state"]["states"], b["state"]["states"]))
    assert a["state"]["step"] == b["state"]["step"]


# ------------------------------------------------------------------------------------------- Twin-Flow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ratio_splits_are_bit_identical(tmp_path, stage):
    ref = run(config("cpu", tmp_path, stage, ratio=1.0))
    numel = ref["info"].numel
    assert ref["info"].device_numel == 0 and ref["info"].resident_numel == numel
    for ratio in (0.3, 0.0):
        got = run(config("cpu", tmp_path, stage, ratio=ratio))
        assert_same_run(got, ref)
        info = got["info"]
        assert info.device_numel == device_share(numel, ratio) > 0
        assert info.resident_numel == numel and info.swapped_numel == 0
    # three tiers: device, pinned host, NVMe
    nv = run(config("nvme", tmp_path, stage, ratio=0.3, max_in_cpu=2 * SUB))
    assert_same_run(nv, ref)
    dev = device_share(numel, 0.3)
    assert nv["info"].device_numel == dev
    assert nv["info"].resident_numel == dev + 2 * SUB
    assert nv["info"].swapped_numel == numel - dev - 2 * SUB
    assert nv["report"].nvme_read_bytes == swap_pass_bytes(numel - dev - 2 * SUB, SUB, 2) > 0


def _dist_ratio_run(rank: int, world: int, nvme: str, out: str):
    results = {}
    for ratio in (1.0, 0.3):
        cfg = config("cpu", nvme, 2, ratio=ratio, fp16=False, bf16={"enabled": True})
        cfg["zero_optimization"]["sub_group_size"] = 2048
        engine, *_ = zero.initialize(model=make_model(), config=cfg)
        losses = train(engine, 4)
        results[ratio] = (losses, weights(engine), engine.optimizer_state_info().device_numel)
        engine.close()
    return results


@pytest.mark.slow
def test_ratio_on_two_ranks_is_bit_identical(tmp_path):
    results, _ = run_on_ranks(_dist_ratio_run, tmp_path)
    for r in results:
        assert r[0.3][0] == r[1.0][0]
        assert_same(r[0.3][1], r[1.0][1])
        assert r[0.3][2] > 0 and r[1.0][2] == 0
    assert results[0][0.3][0] == results[1][0.3][0]


def test_ratio_on_cuda_plans_a_device_share():
    """On CUDA the device share is planned as on the CPU (torch's fused Adam steps it: test_device_part)."""

    off = OffloadOptimizerConfig(device="cpu", ratio=0.5, max_in_cpu=0, buffer_count=4)
    for dev in ("cuda", "cpu"):
        plan = plan_split(
            10_000, 2, tier="cpu", offload=off, sub_group=1000, device=torch.device(dev),
            cap_bytes=1 << 30, in_use_bytes=0, reserved_bytes=0, alignment=4096,
        )  # fmt: skip
        assert (plan.device, plan.host, plan.offload) == (5000, 0, 5000)


# ------------------------------------------------------------------------------------- RAM-first NVMe
@pytest.mark.parametrize("stage", [2, 3])
def test_max_in_cpu_shrinks_nvme_traffic_and_keeps_results(tmp_path, stage):
    on_disk = run(config("nvme", tmp_path, stage, max_in_cpu=0))
    numel = on_disk["info"].numel
    assert on_disk["info"].swapped_numel == numel
    half = numel // 2
    resident_half = half // SUB * SUB
    all_in_ram = numel
    full = swap_pass_bytes(numel, SUB, 2)
    assert on_disk["report"].nvme_read_bytes == on_disk["report"].nvme_write_bytes == full
    for max_in_cpu, resident in ((half, resident_half), (all_in_ram, numel), (10 * numel, numel)):
        got = run(config("nvme", tmp_path, stage, max_in_cpu=max_in_cpu))
        assert_same_run(got, on_disk)
        info, rep = got["info"], got["report"]
        assert (info.resident_numel, info.swapped_numel, info.device_numel) == (resident, numel - resident, 0)
        want = swap_pass_bytes(numel - resident, SUB, 2)
        assert rep.nvme_read_bytes == rep.nvme_write_bytes == info.pass_read_bytes == want
        assert info.disk_bytes == swap_file_bytes(numel - resident, SUB, 2)  # two copies, swapped share only
        if resident == numel:
            assert want == 0 and rep.nvme_bytes_in_use == 0
        else:
            assert 0 < want < full


def _pinned_after_build(cfg) -> tuple:
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    try:
        return engine.pinned_bytes, engine.optimizer_state_info(), engine.swap_dir
    finally:
        engine.close()


def test_auto_takes_what_the_pinned_budget_has_left(tmp_path):
    cfg0 = config("nvme", tmp_path, 2, max_in_cpu=0, fp16=False)
    base, info0, _ = _pinned_after_build(cfg0)  # gradients + swap slots, everything else on NVMe
    g = host_granule(SUB)  # max_in_cpu's granularity: min(sub-group, 2048) elements
    numel, per_g = info0.numel, g * 3 * 4  # master + 2 Adam states, fp32
    for extra, slack in ((5, 0), (5, per_g - 1), (0, per_g - 1)):
        cfg = config("nvme", tmp_path, 2, max_in_cpu="auto", fp16=False)
        cfg["zero_offload"] = {"pinned_budget_bytes": base + extra * per_g + slack}
        pinned, info, swap_dir = _pinned_after_build(cfg)
        assert info.resident_numel == extra * g
        assert pinned <= cfg["zero_offload"]["pinned_budget_bytes"] < pinned + per_g  # one more won't fit
        assert swap_dir is not None
    # a budget that holds everything: no swap space at all
    cfg = config("nvme", tmp_path, 2, max_in_cpu="auto", fp16=False)
    cfg["zero_offload"] = {"pinned_budget_bytes": base + numel * 12}
    _, info, swap_dir = _pinned_after_build(cfg)
    assert (info.resident_numel, info.swapped_numel, info.disk_bytes, swap_dir) == (numel, 0, 0, None)


def test_auto_keeps_a_share_in_ram_with_the_overlap(tmp_path):
    """With pipeline_read "auto" still keeps what the pinned budget holds, and the overlap stays on (that
    its swapped share is stepped during backward: tests/test_overlap.py)."""

    def pipelined(budget=None):
        cfg = config("nvme", tmp_path, 2, max_in_cpu="auto", fp16=False, clip=0.0)
        cfg["zero_optimization"]["offload_optimizer"]["pipeline_read"] = True
        if budget is not None:
            cfg["zero_offload"] = {"pinned_budget_bytes": budget}
        return cfg

    cfg0 = config("nvme", tmp_path, 2, max_in_cpu=0, fp16=False, clip=0.0)
    cfg0["zero_optimization"]["offload_optimizer"]["pipeline_read"] = True
    base, info0, _ = _pinned_after_build(cfg0)
    per_g = host_granule(SUB) * 3 * 4
    _, info, swap_dir = _pinned_after_build(pipelined(base + 5 * per_g))  # room for a share only
    assert 0 < info.resident_numel < info0.numel and swap_dir is not None
    engine, *_ = zero.initialize(model=make_model(), config=pipelined(base + 5 * per_g))
    try:
        assert engine.overlap.enabled
        train(engine, 2)
        rep, info = engine.last_report, engine.optimizer_state_info()
        assert (rep.optimizer_chunks, rep.nvme_read_bytes) == (info.chunks, info.pass_read_bytes)
    finally:
        engine.close()


def test_split_arithmetic():
    s = split_numel(10_000, 1000, tier="nvme", ratio=0.25, max_in_cpu=2500)
    assert (s.device, s.host, s.offload) == (7000, 2000, 1000)  # ceil(0.25 x 10) = 3 sub-groups offloaded
    assert split_numel(10_000, 1000, tier="cpu", ratio=0.25, max_in_cpu=2500).host == 0  # cpu: no RAM-first
    assert split_numel(10_500, 1000, tier="nvme", max_in_cpu=10_500).host == 10_500  # covers the last piece
    assert split_numel(10_000, 1000, tier="none", ratio=0.0).device == 0  # nothing offloaded: no Twin-Flow
    assert auto_max_in_cpu(10_000, 2, 1000, 4, free_bytes=10_000 * 12) == 10_000
    # the resident share is sized at the state dtype's bytes per element (fp32 12, bf16 8, int8 6 + scales)
    assert auto_max_in_cpu(10_000, 2, 1000, 4, free_bytes=10_000 * 8, state_dtype="bf16") == 10_000
    assert auto_max_in_cpu(10_000, 2, 1000, 4, free_bytes=10_000 * 8) < 10_000
    int8 = 6 * 8192 + 2 * 4 * 4  # 8192 elements: int8 moments and one fp32 absmax per 2048 per moment
    assert auto_max_in_cpu(8192, 2, 2048, 4, free_bytes=int8, state_dtype="int8") == 8192
    assert auto_max_in_cpu(8192, 2, 2048, 4, free_bytes=int8 - 1, state_dtype="int8") < 8192
    assert swap_pass_bytes(10_000, 4096, 2) == 2 * 49152 + 24576  # 3 x 1808 x 4 bytes padded to 4 KiB
    assert swap_file_bytes(10_000, 4096, 2) == 2 * 3 * 49152


# --------------------------------------------------------------------------------- checkpoints, faults
def test_checkpoint_moves_between_splits(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    a = config("nvme", tmp_path, 2, ratio=0.3, max_in_cpu=3 * SUB)
    ref = run(a, 2 * MICRO)
    engine, *_ = zero.initialize(model=make_model(), config=a)
    train(engine, MICRO)
    engine.save_checkpoint(ckpt, tag="split")
    engine.close()
    for other in (config("nvme", tmp_path, 2, max_in_cpu=0), config("cpu", tmp_path, 2, ratio=0.0)):
        engine, *_ = zero.initialize(model=make_model(seed=1), config=other)
        engine.load_checkpoint(ckpt, tag="split")
        losses = train(engine, MICRO, start=MICRO)
        assert losses == ref["losses"][MICRO:]
        assert_same(weights(engine), ref["weights"])
        engine.close()


def test_nvme_write_error_in_the_swapped_share_keeps_the_state(tmp_path):
    """Two NVMe copies: the swapped share is stepped first and out of place, so an error there leaves the
    resident share untouched and the committed state whole: the step raises, redoing the window goes on
    exactly."""
    cfg = config("nvme", tmp_path, 2, max_in_cpu=4 * SUB, fp16=False)
    ref = run(cfg, 2 * MICRO)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    train(engine, MICRO)
    fired = fail_nth_write(engine.optimizer_state.back, 2)
    for step in (MICRO, MICRO + 1):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        engine.backward(engine(x, y))
        if step == MICRO:
            engine.step()  # inside the accumulation window: no optimizer pass
    with pytest.raises(OSError, match="previous state is kept") as info:
        engine.step()
    assert fired and info.value.errno == errno.EIO
    engine.check_state_usable()
    for step in (MICRO, MICRO + 1):  # the one retry: the accumulation window's micro-batches again
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        engine.backward(engine(x, y))
        engine.step()
    losses = train(engine, MICRO - 2, start=MICRO + 2)
    assert losses == ref["losses"][MICRO + 2 :]
    assert_same(weights(engine), ref["weights"])
    engine.close()


def test_nvme_write_error_in_a_split_pass_poisons_until_a_checkpoint_is_loaded(tmp_path):
    """One NVMe copy: the swapped share is updated in place too, so a failed write tears the state."""
    ckpt = str(tmp_path / "ckpt")
    cfg = config("nvme", tmp_path, 2, max_in_cpu=4 * SUB, fp16=False)
    cfg["zero_optimization"]["offload_optimizer"]["nvme_copies"] = 1
    ref = run(cfg, 2 * MICRO)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    train(engine, MICRO)
    engine.save_checkpoint(ckpt, tag="good")
    fired = fail_nth_write(engine.optimizer_state.back, 2)
    for step in (MICRO, MICRO + 1):
        x, y = get_batch(DATA, 4, TINY.seq_len, step)
        engine.backward(engine(x, y))
        if step == MICRO:
            engine.step()
    with pytest.raises(StateCorruptedError, match="load a checkpoint") as info:
        engine.step()
    assert fired and isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
    with pytest.raises(StateCorruptedError):
        engine.step()  # a retry would step the updated sub-groups twice
    engine.load_checkpoint(ckpt, tag="good")
    engine.check_state_usable()
    losses = train(engine, MICRO, start=MICRO)
    assert losses == ref["losses"][MICRO:]
    assert_same(weights(engine), ref["weights"])
    engine.close()


def test_overlap_over_three_tiers_says_it_is_not_used(tmp_path, caplog):
    """[device | pinned | NVMe]: the NVMe share sits behind two in-place shares; the pass steps after
    backward, and says so."""
    cfg = config("nvme", tmp_path, 2, ratio=0.5, max_in_cpu=2 * SUB, fp16=False, clip=0.0)
    cfg["zero_optimization"]["offload_optimizer"]["pipeline_read"] = True
    with caplog.at_level(logging.WARNING, logger="zero"):
        got = run(cfg, 2)
    assert "does not step during backward" in caplog.text
    assert got["info"].device_numel > 0 and got["info"].resident_numel > got["info"].device_numel
    assert got["report"].optimizer_chunks_in_backward == 0
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    try:
        with pytest.raises(RuntimeError, match="not overlappable"):
            engine.optimizer_state.step_swapped(lambda *a: True, lambda c: True)
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------ estimator
def test_estimator_rows_follow_the_split():
    from offload.cli.estimate_memory import run as estimate_cli
    from offload.estimate.formulas import estimate
    from offload.estimate.setup import SwapBufferSettings, TrainingSetup
    from offload.estimate.split import apply_split

    bufs = SwapBufferSettings(sub_group_size=10**7)
    setup = TrainingSetup(
        params=10**9, largest_layer_params=10**7, gpus_per_node=2, precision="bf16", buffers=bufs
    )
    part, per_elem = 5 * 10**8, 12  # per rank at stage 2 on 2 ranks; fp32 master + Adam's two moments
    nvme = estimate(setup, 2, "nvme")
    assert apply_split(nvme, setup) is nvme  # ratio 1.0, max_in_cpu 0: every sub-group on NVMe
    half = apply_split(nvme, setup, max_in_cpu=part // 2)
    kept = part // 2 // host_granule(10**7) * host_granule(10**7)  # rounded down to 2048-element pieces
    moved = kept * per_elem * 2  # per node: two ranks
    assert nvme.nvme_read_bytes_per_step - half.nvme_read_bytes_per_step == moved
    assert nvme.nvme_write_bytes_per_step - half.nvme_write_bytes_per_step == moved
    assert half.per_cpu_pinned_bytes - nvme.per_cpu_pinned_bytes == moved
    chunk = swap_chunk(10**7, part - kept, 8)  # the swapped rest's chunk; two copies, two ranks
    assert half.nvme_bytes == 2 * 2 * math.ceil((part - kept) / chunk) * chunk * per_elem
    assert half.per_gpu_bytes == nvme.per_gpu_bytes
    every = apply_split(nvme, setup, max_in_cpu=part)
    assert (
        every.nvme_bytes == 0
        and every.nvme_read_bytes_per_step == nvme.nvme_read_bytes_per_step - 2 * part * 12
    )
    cpu = estimate(setup, 2, "cpu")
    twin = apply_split(cpu, setup, ratio=0.3)
    on_gpu = (50 - 15) * 10**7  # ceil(0.3 x 50 sub-groups) = 15 offloaded
    assert twin.per_gpu_bytes - cpu.per_gpu_bytes == on_gpu * per_elem
    assert cpu.per_cpu_bytes - twin.per_cpu_bytes == 2 * on_gpu * per_elem
    args = [
        "--params",
        "1B",
        "--stage",
        "2",
        "--offload-optimizer",
        "nvme",
        "--sub-group-size",
        "1e7",
        "--json",
    ]
    row = json.loads(estimate_cli([*args, "--max-in-cpu", "1e9"]))["rows"][0]
    assert row["nvme_bytes"] == 0 and "0 on nvme" in row["notes"][-1]
    assert json.loads(estimate_cli([*args, "--max-in-cpu", "0"]))["rows"][0]["nvme_bytes"] > 0
    with pytest.raises(Exception, match="--ratio must be a number in"):
        estimate_cli(["--params", "1B", "--ratio", "1.5"])


@pytest.mark.parametrize("param", ["none", "cpu"])
def test_estimate_of_the_split_matches_the_engine(tmp_path, param):
    """Stage 3, NVMe optimizer state with half of it in pinned RAM: the engine's pinned and NVMe bytes are
    the estimate's (apply_split over the formulas' row), as tests/test_estimate_engine.py checks unsplit."""
    from estimate_helpers import PADDING_ALLOWANCE, stage3_engine_config, stage3_setup

    from offload.estimate.counting import count_parameters
    from offload.estimate.formulas import estimate
    from offload.estimate.split import apply_split

    sub_group = 20_000
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    count = count_parameters(model)
    half = count.params // 2
    config = stage3_engine_config(tmp_path, param, "nvme", sub_group)
    config["zero_optimization"]["offload_optimizer"]["max_in_cpu"] = half
    engine, *_ = zero.initialize(model=model, config=config)
    try:
        engine.backward(engine(torch.randn(2, 256, dtype=torch.bfloat16)).float().square().mean())
        engine.step()
        pinned, nvme, info = engine.pinned_bytes, engine.nvme_bytes, engine.optimizer_state_info()
        read = engine.last_report.nvme_read_bytes
    finally:
        engine.close()
    setup = stage3_setup(count, sub_group)
    est = apply_split(estimate(setup, 3, "nvme", param), setup, max_in_cpu=half)
    assert info.resident_numel == half // host_granule(sub_group) * host_granule(sub_group) > 0
    assert 0 <= pinned - est.per_cpu_pinned_bytes <= PADDING_ALLOWANCE, (pinned, est.per_cpu_pinned_bytes)
    assert 0 <= nvme - est.nvme_bytes <= PADDING_ALLOWANCE, (nvme, est.nvme_bytes)
    assert 0 <= read - est.nvme_read_bytes_per_step <= PADDING_ALLOWANCE, (read, est.nvme_read_bytes_per_step)
