"""Stage 3 with parameters on NVMe: the optimizer pass leaves its partition writes in flight
(zero.stage3.write_back). They overlap the pass and the next forward, a failed one is written again from the
buffer it holds, and one that keeps failing holds the step (DeferredWriteError, steps_lost 0) until the disk
takes it: training then goes on bit for bit as if nothing had failed."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from engine_helpers import DATA, TINY, make_model, s3_config, train
from state_helpers import ParamWriteFault

import zero
from offload.swap.optimizer_swapper import DeferredWriteError
from zero.examples.models import get_batch


def _engine(tmp_path):
    return zero.initialize(model=make_model(), config=s3_config("nvme", "nvme", tmp_path))[0]


def _nvme_units(e) -> int:
    return sum(1 for u in e.layout.units if e.partitioner.on_nvme(u))


def _reference(tmp_path, steps: int):
    e = _engine(tmp_path / "ref")
    losses = train(e, steps)
    weights = {k: v.clone() for k, v in zero.consolidated_state_dict(e).items()}
    master = e.optimizer.state_dict()["master"]
    e.close()
    return losses, weights, master


def _assert_same_run(e, losses, ref) -> None:
    ref_losses, ref_weights, ref_master = ref
    assert losses == ref_losses
    got = zero.consolidated_state_dict(e)
    assert all(torch.equal(got[k], ref_weights[k]) for k in ref_weights)
    assert torch.equal(e.optimizer.state_dict()["master"], ref_master)


def test_write_back_is_left_in_flight_and_overlaps(tmp_path):
    """Every partition write of a step is queued without waiting, several run at once, and the step
    returns with writes still in flight (the next forward overlaps them); the weights read back are the
    step's."""
    (tmp_path / "a").mkdir()
    e = _engine(tmp_path / "a")
    train(e, 2)
    io = e.last_param_io
    written = sum(u.part_nbytes for u in e.layout.units)
    assert io["param_nvme_write_bytes"] == written
    assert io["param_async_write_bytes"] == written  # none waited for one by one
    assert io["param_peak_writes_in_flight"] > 1  # concurrent
    assert io["param_writes_in_flight"] > 0  # still running when step() returned
    assert io["param_write_retries"] == 0
    e.close()


@pytest.mark.parametrize("which", ["in_pass", "after_return"])
def test_a_failed_write_back_is_written_again_bit_identically(tmp_path, monkeypatch, which):
    """One write fails (EIO at its wait): settled inside the pass (the first write, waited for once every
    handle is busy) or after the step returned (the last one, waited for by the next forward), it is
    written again from its buffer: no error, and the run is the undisturbed one bit for bit."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    ref = _reference(tmp_path, 4)
    e = _engine(tmp_path / "run")
    losses = train(e, 2)
    n = _nvme_units(e)
    assert n > 8  # more units than writes in flight (queue_depth 8): the first is waited for in the pass
    fault = ParamWriteFault(monkeypatch, nth=1 if which == "in_pass" else n)
    losses += train(e, 1, start=2)
    assert fault.target and fault.target.endswith(".param.swp")
    retries = e.last_param_io["param_write_retries"]
    losses += train(e, 1, start=3)
    retries += e.last_param_io["param_write_retries"]
    assert retries == 1 and fault.sync_refused == 0
    _assert_same_run(e, losses, ref)
    e.close()


def test_a_write_back_that_keeps_failing_holds_the_step(tmp_path, monkeypatch):
    """The last write of a step fails, and again when written anew: the next forward raises
    DeferredWriteError (steps_lost 0, errno and file), and so do a checkpoint save and the optimizer's
    state_dict, while the disk refuses it; once it takes the write, redoing the batch gives the undisturbed
    run bit for bit."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    ref = _reference(tmp_path, 4)
    e = _engine(tmp_path / "run")
    losses = train(e, 2)
    fault = ParamWriteFault(monkeypatch, nth=_nvme_units(e), sync_failures=3)
    losses += train(e, 1, start=2)
    x, y = get_batch(DATA, 4, TINY.seq_len, 3)
    with pytest.raises(DeferredWriteError) as info:
        e(x, y)
    err = info.value
    assert err.steps_lost == 0 and err.errno == errno.EIO and err.filename == fault.target
    assert "held in memory" in str(err) and "nothing is lost" in str(err)
    with pytest.raises(DeferredWriteError):
        e.save_checkpoint(str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt" / "latest")
    with pytest.raises(DeferredWriteError):
        e.optimizer.state_dict()
    assert fault.sync_refused == 3 and e.optimizer.step_count == 3
    losses += train(e, 1, start=3)  # the disk takes it now: the batch redone as the retry rule says
    _assert_same_run(e, losses, ref)
    e.close()


def test_close_reports_a_write_back_still_failing_as_lost(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    e = _engine(tmp_path / "a")
    train(e, 1)
    ParamWriteFault(monkeypatch, nth=_nvme_units(e), sync_failures=1_000_000)
    train(e, 1, start=1)
    with pytest.raises(DeferredWriteError) as info:
        e.close()
    assert info.value.steps_lost == 1 and "lost" in str(info.value)
    assert os.listdir(tmp_path / "a") == []  # the swap files go even so
