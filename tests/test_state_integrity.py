"""The engine's training state stays consistent across failures, or the engine says it is not.

* Module-only loads rebuild the fp32 master from the loaded weights (`sync_master_from_module`), so a step
  at lr 0 afterwards leaves exactly the checkpoint's weights.
* An I/O error in an optimizer pass over state updated in place (one NVMe copy at stage 3, memory tiers whose
  parameter write-back fails) tears it: the engine is poisoned (`StateCorruptedError` from step, backward and
  saves) until a checkpoint is loaded, after which training continues bit for bit as from that checkpoint.
* With two NVMe copies the same error keeps the previous state: retrying the step gives exactly the run
  without the failure.
* A failed restore read poisons instead of being ignored; a deferred write-back failure is settled before a
  save reads any state, so no checkpoint pairs a step's weights with the optimizer state before it.

Faults are injected in-process on the aio handles the swapper queues its chunk writes on (the nth write is
cut short and its wait reports EIO), and on the stage-3 store's partition writes.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch
from engine_helpers import DATA, TINY, base_config, make_model, train
from state_helpers import ParamWriteFault, assert_same, fail_nth_write, weights

import zero
from zero import StateCorruptedError
from zero.examples.models import get_batch


def s3_config(param: str, optim: str, tmp, **extra):
    cfg = base_config(optim, tmp, stage=3, **extra)
    zo = cfg["zero_optimization"]
    zo["stage3_param_persistence_threshold"] = 0
    zo["sub_group_size"] = 4000  # many chunks: a failure part way through a pass is really part way
    if param != "none":
        zo["offload_param"] = {"device": param, "nvme_path": str(tmp), "max_in_cpu": 0}
    return cfg


def one_copy(monkeypatch) -> None:
    """Make the optimizer's NVMe state single-copy (updated in place), as on a disk too short for two."""
    from zero.optimizer.tiers import build as optimizer_state

    monkeypatch.setattr(optimizer_state, "_disk_free", lambda path: 1)


def fail_next_reads(swapper, times: int = 1) -> None:
    """The next `times` chunk reads queued on the swapper's handles report EIO at their wait."""
    left = [times]
    for h in swapper._handles:
        real_read = h.async_pread

        def read(buf, path, offset=0, h=h, real_read=real_read):
            res = real_read(buf, path, offset)
            if left[0] > 0:
                left[0] -= 1
                real_wait = h.wait

                def failing_wait():
                    real_wait()
                    del h.wait
                    raise OSError(errno.EIO, "injected read failure", path)

                h.wait = failing_wait
            return res

        h.async_pread = read


# ---------------------------------------------------------------------------------- module-only loads
MODULE_ONLY_CASES = {
    "stage2-cpu-bf16": lambda tmp: base_config("cpu", tmp, stage=2, bf16={"enabled": True}),
    "stage2-nvme": lambda tmp: base_config("nvme", tmp, stage=2),
    "stage3-nvme-nvme": lambda tmp: s3_config("nvme", "nvme", tmp),
}


def _lr_zero_step(engine, step: int) -> None:
    for g in engine.optimizer.param_groups:
        g["lr"] = 0.0
    train(engine, 1, start=step)


@pytest.mark.parametrize("case", sorted(MODULE_ONLY_CASES))
def test_module_only_load_rebuilds_the_master(tmp_path, case):
    """load_module_only: one step at lr 0 afterwards leaves exactly the checkpoint's weights (the old
    master would otherwise overwrite them)."""
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    engine, *_ = zero.initialize(model=make_model(), config=MODULE_ONLY_CASES[case](nvme))
    train(engine, 2)
    engine.save_checkpoint(str(ckpt), tag="two")
    saved = weights(engine)
    train(engine, 2, start=2)
    engine.load_checkpoint(str(ckpt), tag="two", load_module_only=True)
    assert_same(weights(engine), saved)
    _lr_zero_step(engine, 4)
    assert_same(weights(engine), saved)
    assert engine.state_error is None
    engine.close()


@pytest.mark.parametrize("case", ["stage2-nvme", "stage3-nvme-nvme"])
def test_sync_master_from_module_after_loading_weights_by_hand(tmp_path, case):
    """The public call on its own: weights put into the module, then the master rebuilt from them; the
    optimizer's moments are not touched."""
    engine, *_ = zero.initialize(model=make_model(), config=MODULE_ONLY_CASES[case](tmp_path))
    train(engine, 2)
    saved = weights(engine)
    moments = engine.optimizer.state_dict()["states"]
    train(engine, 2, start=2)
    moments_later = engine.optimizer.state_dict()["states"]
    if case.startswith("stage3"):
        engine.partitioner.load_state_dict_shard(saved)
    else:
        engine.module.load_state_dict(saved)
    engine.sync_master_from_module()
    sd = engine.optimizer.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(sd["states"], moments_later))
    assert not all(torch.equal(a, b) for a, b in zip(sd["states"], moments))
    _lr_zero_step(engine, 4)
    assert_same(weights(engine), saved)
    engine.close()


# ------------------------------------------------------------------------------- torn in-place state
def _uninterrupted(cfg, steps: int):
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    losses = train(engine, steps)
    w = weights(engine)
    state = engine.optimizer.state_dict()
    engine.close()
    return losses, w, state


def _continue_after_load(engine, ckpt: str, tag: str, start: int, steps: int):
    engine.load_checkpoint(ckpt, tag=tag)
    assert engine.state_error is None
    engine.check_state_usable()
    losses = train(engine, steps, start=start)
    return losses, weights(engine), engine.optimizer.state_dict()


def test_stage3_single_copy_write_error_poisons_until_a_checkpoint_is_loaded(tmp_path, monkeypatch):
    """One NVMe copy (a short disk): EIO on the third chunk write of a step leaves chunks 0-1 updated and
    the rest not. The step must not claim the previous state is kept, a retry must not apply Adam twice to
    the written chunks: step, backward and saves refuse until a checkpoint is loaded, and training from that
    checkpoint then matches an uninterrupted run bit for bit."""
    one_copy(monkeypatch)
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    with pytest.warns(UserWarning, match="updated in place"):
        cfg = s3_config("nvme", "nvme", nvme)
        ref_losses, ref_w, ref_state = _uninterrupted(cfg, 5)
    with pytest.warns(UserWarning, match="updated in place"):
        engine, *_ = zero.initialize(model=make_model(), config=cfg)
    sw = engine.optimizer_state
    assert sw.copies == 1 and len(sw.chunks) >= 4
    train(engine, 2)
    engine.save_checkpoint(str(ckpt), tag="good")

    fired = fail_nth_write(sw, 3)
    x, y = get_batch(DATA, 4, TINY.seq_len, 2)
    engine.backward(engine(x, y))
    with pytest.raises(StateCorruptedError) as info:
        engine.step()
    assert fired, "the injected failure did not fire"
    err = info.value
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.EIO
    assert err.errno == errno.EIO and err.filename == fired["path"]
    text = str(err)
    assert (
        "load a checkpoint to continue" in text
        and fired["path"] in text
        and "previous state is kept" not in text
    )
    assert engine.state_error is err.__cause__

    # every way on refuses, naming the original error
    with pytest.raises(StateCorruptedError, match="load a checkpoint"):
        engine.step()  # the retry that would apply Adam twice to chunks 0-1
    with pytest.raises(StateCorruptedError):
        engine.backward(engine(x, y))
    with pytest.raises(StateCorruptedError):
        engine.check_state_usable()
    with pytest.raises(StateCorruptedError):
        engine.prepare_checkpoint_save()
    with pytest.raises(StateCorruptedError, match="Errno 5"):
        engine.save_checkpoint(str(ckpt), tag="torn")
    assert sorted(os.listdir(ckpt)) == ["good", "latest"]  # nothing torn was published

    losses, w, state = _continue_after_load(engine, str(ckpt), "good", 2, 3)
    engine.close()
    assert losses == ref_losses[2:]
    assert_same(w, ref_w)
    assert torch.equal(state["master"], ref_state["master"]) and state["step"] == ref_state["step"]
    assert all(torch.equal(a, b) for a, b in zip(state["states"], ref_state["states"]))


def test_stage3_memory_tier_torn_by_a_parameter_write_error_is_poisoned(tmp_path, monkeypatch):
    """Optimizer state in host memory is updated in place; when writing the new weights of a unit to its
    NVMe partition fails part way through the pass (and again when written anew), neither master nor
    partitions are the previous state."""
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    cfg = s3_config("nvme", "cpu", nvme)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    train(engine, 2)
    engine.save_checkpoint(str(ckpt), tag="good")
    # the step's first write: waited for inside the pass (more units than writes in flight)
    fault = ParamWriteFault(monkeypatch, nth=1, sync_failures=1)
    x, y = get_batch(DATA, 4, TINY.seq_len, 2)
    engine.backward(engine(x, y))
    with pytest.raises(StateCorruptedError, match="load a checkpoint") as info:
        engine.step()
    assert info.value.errno == errno.EIO and fault.sync_refused == 1
    monkeypatch.undo()
    with pytest.raises(StateCorruptedError):
        engine.step()
    losses, w, _ = _continue_after_load(engine, str(ckpt), "good", 2, 2)
    engine.close()
    ref_losses, ref_w, _ = _uninterrupted(cfg, 4)
    assert losses == ref_losses[2:]
    assert_same(w, ref_w)


# ---------------------------------------------------------------------------- two copies: state kept
@pytest.mark.parametrize("stage", [2, 3])
def test_two_copies_write_error_keeps_the_previous_state(tmp_path, stage):
    """The same EIO with two NVMe copies: the step raises an OSError saying the previous state is kept, the
    engine stays usable, and redoing forward, backward and step gives exactly the run without the failure."""
    cfg = s3_config("nvme", "nvme", tmp_path) if stage == 3 else base_config("nvme", tmp_path, stage=2)
    cfg["zero_optimization"]["sub_group_size"] = 4000
    ref_losses, ref_w, ref_state = _uninterrupted(cfg, 4)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    sw = engine.optimizer_state
    assert sw.copies == 2 and len(sw.chunks) >= 6
    losses = train(engine, 2)
    before = weights(engine)
    fired = fail_nth_write(sw, 3)
    x, y = get_batch(DATA, 4, TINY.seq_len, 2)
    loss = engine(x, y)
    engine.backward(loss)
    with pytest.raises(OSError, match="previous state is kept") as info:
        engine.step()
    assert fired and info.value.errno == errno.EIO and info.value.filename == fired["path"]
    assert engine.state_error is None
    assert_same(weights(engine), before)  # the parameters are the committed state's again
    assert engine.optimizer.step_count == 2 and engine.global_steps == 2
    engine.step()  # the failed step's gradients were dropped: a step without a backward is skipped
    assert engine.optimizer.step_count == 2 and engine.global_steps == 2
    loss = engine(x, y)  # the one retry: forward, backward and step on the same batch
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    losses += train(engine, 1, start=3)
    w, state = weights(engine), engine.optimizer.state_dict()
    engine.close()
    assert losses == ref_losses
    assert_same(w, ref_w)
    assert torch.equal(state["master"], ref_state["master"]) and state["step"] == 4
    assert all(torch.equal(a, b) for a, b in zip(state["states"], ref_state["states"]))


def test_two_copies_parameter_write_error_keeps_the_previous_state(tmp_path, monkeypatch):
    """Stage 3, parameters and optimizer on NVMe: a unit's partition write fails part way through the pass,
    and again when written anew. The committed optimizer state is intact and every partition is rewritten
    from it; the retry is exact."""
    cfg = s3_config("nvme", "nvme", tmp_path)
    ref_losses, ref_w, _ = _uninterrupted(cfg, 4)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    assert engine.optimizer_state_info().copies == 2
    losses = train(engine, 2)
    before = weights(engine)
    # the step's first write (nothing reaches the disk): waited for inside the pass
    fault = ParamWriteFault(monkeypatch, nth=1, sync_failures=1)
    x, y = get_batch(DATA, 4, TINY.seq_len, 2)
    loss = engine(x, y)
    engine.backward(loss)
    with pytest.raises(OSError, match="previous state is kept") as info:
        engine.step()
    assert info.value.errno == errno.EIO and fault.sync_refused == 1
    assert fault.count > len(engine.layout.units)  # the restore rewrote the partitions
    assert engine.state_error is None
    assert_same(weights(engine), before)
    monkeypatch.undo()
    loss = engine(x, y)  # the one retry: forward, backward and step on the same batch
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    losses += train(engine, 1, start=3)
    w = weights(engine)
    engine.close()
    assert losses == ref_losses
    assert_same(w, ref_w)


@pytest.mark.parametrize("stage", [2, 3])
def test_failed_restore_read_poisons_instead_of_being_ignored(tmp_path, stage):
    """After a failed pass the committed master is read back into the parameters; when that read fails
    too the parameters are the aborted pass's: the engine is poisoned and the read error chained."""
    cfg = s3_config("nvme", "nvme", tmp_path) if stage == 3 else base_config("nvme", tmp_path, stage=2)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    sw = engine.optimizer_state
    train(engine, 1)
    fired = fail_nth_write(sw, 3)
    real_abort = sw.abort

    def abort_then_fail_reads():
        real_abort()
        fail_next_reads(sw, 1)

    sw.abort = abort_then_fail_reads
    x, y = get_batch(DATA, 4, TINY.seq_len, 1)
    engine.backward(engine(x, y))
    with pytest.raises(StateCorruptedError) as info:
        engine.step()
    assert fired
    cause = info.value.__cause__
    assert isinstance(cause, OSError) and "injected read failure" in str(cause)
    assert engine.state_error is cause
    sw.abort = real_abort
    with pytest.raises(StateCorruptedError, match="injected read failure"):
        engine.step()
    engine.close()


# ------------------------------------------------------------------------ deferred write-back and saves
def test_save_after_a_failed_write_back_writes_it_again_and_saves_that_step(tmp_path):
    """Step 3's last write fails (once) after the step returned. The save settles the writes: the chunk is
    written again from its staging slot, so nothing is lost, and the checkpoint holds step 3's weights with
    step 3's optimizer state."""
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    cfg = base_config("nvme", nvme, stage=2)
    _, ref_w, ref_state = _uninterrupted(cfg, 3)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    sw = engine.optimizer_state
    train(engine, 2)
    x, y = get_batch(DATA, 4, TINY.seq_len, 2)
    engine.backward(engine(x, y))
    fire_at = len(sw.chunks)  # the step's last write, left in flight when step() returns
    fired = fail_nth_write(sw, fire_at)
    engine.step()
    assert sw.writes_in_flight
    engine.save_checkpoint(str(ckpt), tag="after")
    assert fired and engine.optimizer.step_count == 3
    assert_same(weights(engine), ref_w)
    engine.close()

    fresh, *_ = zero.initialize(model=make_model(seed=1), config=cfg)
    fresh.load_checkpoint(str(ckpt), tag="after")
    state = fresh.optimizer.state_dict()
    got = weights(fresh)
    fresh.close()
    assert state["step"] == 3 and torch.equal(state["master"], ref_state["master"])
    assert all(torch.equal(a, b) for a, b in zip(state["states"], ref_state["states"]))
    assert_same(got, ref_w)


def test_prepare_checkpoint_save_discards_an_overlapped_pass(tmp_path):
    """Between backward and step with steps during backward: the save sees the committed state."""
    cfg = base_config("nvme", tmp_path, stage=2)
    cfg["zero_optimization"]["offload_optimizer"]["pipeline_read"] = True
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    train(engine, 1)
    committed = weights(engine)
    x, y = get_batch(DATA, 4, TINY.seq_len, 1)
    engine.backward(engine(x, y))
    assert engine.overlap.running
    engine.prepare_checkpoint_save()
    assert not engine.overlap.running
    assert_same(weights(engine), committed)
    assert engine.optimizer.step_count == 1
    engine.close()


def test_save_between_backward_and_step_after_a_failed_write_back(tmp_path):
    """With steps during backward, the next backward's prefetch is the first to meet the last step's failed
    write-back and writes it again; discarding the overlapped pass for a save then saves step 3 whole."""
    cfg = base_config("nvme", tmp_path, stage=2)
    cfg["zero_optimization"]["offload_optimizer"]["pipeline_read"] = True
    _, ref_w, ref_state = _uninterrupted(cfg, 3)
    engine, *_ = zero.initialize(model=make_model(), config=cfg)
    sw = engine.optimizer_state
    train(engine, 2)
    x, y = get_batch(DATA, 4, TINY.seq_len, 2)
    fired = fail_nth_write(sw, len(sw.chunks))  # the step's last write (during backward), left in flight
    engine.backward(engine(x, y))
    engine.step()
    assert fired and sw.writes_in_flight
    x, y = get_batch(DATA, 4, TINY.seq_len, 3)
    engine.backward(engine(x, y))  # settles the writes: the failed chunk is written again
    engine.prepare_checkpoint_save()
    assert engine.optimizer.step_count == 3
    assert_same(weights(engine), ref_w)
    state = engine.optimizer.state_dict()
    assert torch.equal(state["master"], ref_state["master"])
    engine.close()


def test_poison_state_and_mark_state_restored(tmp_path):
    """The loader's calls: poison_state when applying a checkpoint stops half way, mark_state_restored
    once one was applied completely."""
    engine, *_ = zero.initialize(model=make_model(), config=base_config("cpu", tmp_path, stage=2))
    assert engine.state_error is None
    engine.check_state_usable()
    e = OSError(errno.EIO, "injected", "/some/ckpt/optim_rank0.bin")
    engine.poison_state(e)
    assert engine.state_error is e
    with pytest.raises(StateCorruptedError, match="/some/ckpt/optim_rank0.bin") as info:
        engine.step()
    engine.poison_state(info.value)  # a StateCorruptedError keeps naming its original error
    assert engine.state_error is e
    engine.mark_state_restored()
    assert engine.state_error is None
    train(engine, 1)
    engine.close()


def test_failed_master_rebuild_poisons(tmp_path):
    """sync_master_from_module that fails part way leaves master and module different: poisoned, with the
    write error chained, and steps refuse until a checkpoint is loaded."""
    engine, *_ = zero.initialize(model=make_model(), config=base_config("nvme", tmp_path, stage=2))
    train(engine, 1)
    fired = fail_nth_write(engine.optimizer_state, 2)
    with pytest.raises(StateCorruptedError, match="rebuilding the fp32 master") as info:
        engine.sync_master_from_module()
    assert fired and "injected write failure" in str(info.value.__cause__)
    with pytest.raises(StateCorruptedError, match="injected write failure"):
        engine.step()
    engine.close()
