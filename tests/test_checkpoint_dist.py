"""Checkpoints on two gloo ranks: a failure on one rank raises on both (nobody hangs in a collective), a
failed save is rolled back, and a load that fails validation on one rank changes neither engine."""

from __future__ import annotations

import errno
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_helpers import TINY, make_config, rank_steps, run_on_ranks

import zero
from zero.examples.models import GPT

CASE = {"stage": 2, "offload": "nvme"}
TIMEOUT_S = 300  # the ranks finish in well under a minute; a rank left in a barrier would wait 30 minutes


def _engine(world_size, nvme_dir):
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=GPT(TINY), config=make_config(CASE, world_size, nvme_dir))
    return engine


def _params(engine):
    return torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(e).__name__}: {e}"
    return None


def _failed_load(rank, world_size, nvme_dir, ckpt):
    """Rank 1's optimizer file is truncated: both ranks raise, neither engine changes."""
    ref = _engine(world_size, nvme_dir)
    rank_steps(ref, rank, 0, 4)
    ref_after4 = _params(ref)
    ref_loss = rank_steps(ref, rank, 4, 1)
    ref_after5 = _params(ref)
    ref.close()

    engine = _engine(world_size, nvme_dir)
    rank_steps(engine, rank, 0, 3)
    path = engine.save_checkpoint(ckpt, tag="t")
    listed = None
    if os.path.exists(os.path.join(path, "manifest.json")):
        with open(os.path.join(path, "manifest.json")) as f:
            listed = sorted(json.load(f)["files"])
    rank_steps(engine, rank, 3, 1)
    if rank == 1:
        optim = os.path.join(path, "optim_rank1.bin")
        os.truncate(optim, os.path.getsize(optim) - 4096)
    dist.barrier()
    error = _error(lambda: engine.load_checkpoint(ckpt, tag="t"))
    unchanged = torch.equal(_params(engine), ref_after4) and engine.global_steps == 4
    loss = rank_steps(engine, rank, 4, 1)
    same_step = loss == ref_loss and torch.equal(_params(engine), ref_after5)
    engine.close()
    return {"listed": listed, "error": error, "unchanged": unchanged, "same_step": same_step}


def _failed_saves(rank, world_size, nvme_dir, ckpt):
    """A save that fails on one rank raises on both, is rolled back, and the next save works."""
    import offload.aio

    engine = _engine(world_size, nvme_dir)
    rank_steps(engine, rank, 0, 2)
    engine.save_checkpoint(ckpt, tag="good")
    rank_steps(engine, rank, 2, 1)
    out = {}
    real_write = offload.aio.AioHandle.async_pwrite

    def no_space(self, buffer, path, offset=0):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    if rank == 1:
        offload.aio.AioHandle.async_pwrite = no_space
    try:
        out["write_error"] = _error(lambda: engine.save_checkpoint(ckpt, tag="next"))
    finally:
        offload.aio.AioHandle.async_pwrite = real_write
    dist.barrier()
    out["after_write_error"] = sorted(os.listdir(ckpt))

    def refuse():
        raise RuntimeError("deferred write-back failed")

    if rank == 0:
        engine.prepare_checkpoint_save = refuse
    out["prepare_error"] = _error(lambda: engine.save_checkpoint(ckpt, tag="next"))
    if rank == 0:
        del engine.prepare_checkpoint_save
    dist.barrier()
    out["after_prepare_error"] = sorted(os.listdir(ckpt))
    out["retry_error"] = _error(lambda: engine.save_checkpoint(ckpt, tag="next"))
    out["after_retry"] = sorted(os.listdir(ckpt))
    engine.close()
    return out


def _disagreeing_load(rank, world_size, nvme_dir, out_dir):
    """Rank 0 is pointed at a checkpoint, rank 1 at a directory without one: both raise, nothing loads."""
    ckpt, empty = os.path.join(out_dir, "ckpt_one"), os.path.join(out_dir, f"empty{rank}")
    engine = _engine(world_size, nvme_dir)
    rank_steps(engine, rank, 0, 1)
    engine.save_checkpoint(ckpt, tag="t")
    before = _params(engine)
    os.makedirs(empty, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 1's "no 'latest' file" warning
        error = _error(lambda: engine.load_checkpoint(ckpt if rank == 0 else empty))
    unchanged = torch.equal(_params(engine), before) and engine.global_steps == 1
    engine.close()
    return {"error": error, "unchanged": unchanged}


def _rank_main(rank, world_size, nvme_dir, out_dir):
    return {
        "load": _failed_load(rank, world_size, nvme_dir, os.path.join(out_dir, "ckpt_load")),
        "save": _failed_saves(rank, world_size, nvme_dir, os.path.join(out_dir, "ckpt_save")),
        "disagree": _disagreeing_load(rank, world_size, nvme_dir, out_dir),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    res, nvme = run_on_ranks(_rank_main, tmp_path_factory.mktemp("ckdist"), timeout_s=TIMEOUT_S)
    assert os.listdir(nvme) == []
    return res


def test_failed_load_on_one_rank_raises_on_both_and_changes_nothing(results):
    r0, r1 = results[0]["load"], results[1]["load"]
    assert r0["listed"] == [
        "model_states.pt",
        "optim_rank0.bin",
        "optim_rank1.bin",
        "rank0_states.pt",
        "rank1_states.pt",
    ]
    assert r1["error"] is not None and "optim_rank1.bin" in r1["error"], r1["error"]
    assert r0["error"] is not None and "rank 1" in r0["error"] and "CheckpointError" in r0["error"], r0[
        "error"
    ]
    for r, res in enumerate((r0, r1)):
        assert res["unchanged"], f"rank {r}: the failed load changed the engine"
        assert res["same_step"], f"rank {r}: the next step differs from a run that never tried the load"


def test_failed_save_on_one_rank_raises_on_both_and_rolls_back(results):
    r0, r1 = results[0]["save"], results[1]["save"]
    assert "No space left" in r1["write_error"], r1["write_error"]
    assert "rank 1" in r0["write_error"], r0["write_error"]
    assert "deferred write-back failed" in r0["prepare_error"], r0["prepare_error"]
    assert "rank 0" in r1["prepare_error"], r1["prepare_error"]
    for res in (r0, r1):
        assert res["after_write_error"] == ["good", "latest"]
        assert res["after_prepare_error"] == ["good", "latest"]
        assert res["retry_error"] is None, res["retry_error"]
        assert res["after_retry"] == ["good", "latest", "next"]


def test_ranks_that_disagree_on_whether_there_is_a_checkpoint_both_raise(results):
    for r in range(2):
        res = results[r]["disagree"]
        assert res["error"] is not None and "disagree" in res["error"], res["error"]
        assert res["unchanged"], f"rank {r}: the refused load changed the engine"
