"""Deferred write-back of the NVMe optimizer state (issue #8): a step returns with its last writes in flight.

What must hold: the trajectory is bit-identical to draining every write inside the step; whatever reads the
state next (prefetch, the next step, read_all, a checkpoint) sees the written data; a write that fails after
the step returned is written again from the staging slot that still holds it; if that fails too the step is
held (in memory, the live copy not read) and reported, typed and naming the file, by every next step,
read_all or checkpoint until a write succeeds - nothing lost, nothing changed - and at close as lost.
"""

from __future__ import annotations

import errno
import os
import textwrap

import pytest
import torch
from overlap_helpers import overlap_config  # the same small stage-2 NVMe config
from swap_helpers import ENGINE_CHILD_PRELUDE, fill_from, reference_state, run_child, snapshot

import zero
from offload.pinned import PinnedPool
from offload.swap import OptimizerSwapper, SwapSpace
from zero.examples.models import GPT, GPTConfig, corpus_bytes, get_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)


def _adam_like(start, n, master, states):
    # Depends on the previous state of every tensor, so a stale or lost chunk changes the result.
    states[0].mul_(0.9).add_(master, alpha=0.1)
    states[1].mul_(0.99).addcmul_(states[0], states[0], value=0.01)
    master.sub_(states[0] / (states[1].abs().sqrt() + 1e-3) * 1e-2)
    return True


@pytest.mark.parametrize("buffer_count,chunk,reverse", [(1, 1000, False), (2, 1500, True), (4, 1000, False)])
def test_deferred_steps_match_drained_steps_bit_exact(tmp_path, buffer_count, chunk, reverse):
    numel = 7_003
    master_ref, states_ref = reference_state(numel, 2, seed=buffer_count)
    pool = PinnedPool(64 << 20)
    results = {}
    with SwapSpace(str(tmp_path)) as space:
        for defer in (True, False):
            sw = OptimizerSwapper(
                space,
                numel,
                2,
                pool,
                chunk_numel=chunk,
                buffer_count=buffer_count,
                defer_writes=defer,
                name=f"defer{int(defer)}",
            )
            if reverse:
                sw.step_order = sw.step_order[::-1]  # as the engine does when stepping during backward
            sw.load(fill_from(master_ref, states_ref))
            for k in range(7):
                if k % 2:
                    sw.prefetch()  # reads of the next step queued while the last writes may still run
                assert sw.step(_adam_like)
                assert sw.writes_in_flight == defer
                sw.commit()
            results[defer] = snapshot(sw)
            assert not sw.writes_in_flight
            sw.close()
    (m_d, st_d), (m_s, st_s) = results[True], results[False]
    assert torch.equal(m_d, m_s) and all(torch.equal(a, b) for a, b in zip(st_d, st_s))
    assert not torch.equal(m_d, master_ref) and not m_d.isnan().any()
    assert pool.bytes_in_use == 0


def test_in_place_state_never_defers(tmp_path):
    pool = PinnedPool(16 << 20)
    with SwapSpace(str(tmp_path)) as space:
        sw = OptimizerSwapper(space, 3000, 1, pool, chunk_numel=1000, buffer_count=2, copies=1)
        sw.load(fill_from(*reference_state(3000, 1, seed=1)))
        assert sw.step(lambda s, n, m, st: True)
        assert not sw.writes_in_flight  # a failed in-place write would have no previous copy to go back to
        sw.commit()
        sw.close()


def test_abort_with_writes_in_flight_keeps_previous_state(tmp_path):
    pool = PinnedPool(16 << 20)
    master_ref, states_ref = reference_state(5000, 2, seed=2)
    with SwapSpace(str(tmp_path)) as space:
        sw = OptimizerSwapper(space, 5000, 2, pool, chunk_numel=1000, buffer_count=3)
        sw.load(fill_from(master_ref, states_ref))
        assert sw.step(_adam_like) and sw.writes_in_flight
        sw.abort()  # e.g. another rank found an overflow
        assert not sw.writes_in_flight
        with pytest.raises(RuntimeError, match="without a completed step"):
            sw.commit()
        assert torch.equal(snapshot(sw)[0], master_ref)
        sw.close()


# A child process limits its file size (RLIMIT_FSIZE) so that only the write of the last chunk in the step
# order fails: that write is queued last and left in flight, so the step itself returns True.
_SWAPPER_FAILURE_CHILD = """
import resource, signal, torch
from offload.pinned import PinnedPool
from offload.swap import OptimizerSwapper, SwapSpace
from offload.swap.optimizer_swapper import DeferredWriteError

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from the write, not a fatal signal
g = torch.Generator().manual_seed(0)
numel = 5000
master0 = torch.randn(numel, generator=g)
space = SwapSpace(NVME)
sw = OptimizerSwapper(space, numel, 1, PinnedPool(16 << 20), chunk_numel=1000, buffer_count=BUFFERS)

def fill(s, n, m, st):
    m.copy_(master0[s : s + n])
    st[0].fill_(1.0)

def add(s, n, m, st):
    m.add_(st[0])
    st[0].mul_(2.0)
    return True

def snapshot():
    out = torch.empty(numel)
    sw.read_all(lambda s, n, m, st: out[s : s + n].copy_(m))
    return out

sw.load(fill)
assert sw.step(add)
sw.commit()
after_one = snapshot()
spare = sw._files[sw._spare].path
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, ((len(sw.chunks) - 1) * sw.region_bytes, hard))
returned = sw.step(add)
in_flight = sw.writes_in_flight
sw.commit()
settled_in_flight = None
result.update(returned=returned, in_flight=in_flight, spare=spare)
# The limit stays until the write has surely run: the backend may only submit it when it is waited for.
if MODE == "prefetch_then_step":
    sw.prefetch()  # settles: the step is held, prefetch itself does not raise (nor read)
    result["settled_in_flight"] = sw.writes_in_flight
if MODE == "close":
    try:
        sw.close()  # the held step goes with the slots: reported as lost
    except DeferredWriteError as e:
        result.update(exc=type(e).__name__, errno=e.errno, filename=e.filename, str=str(e), lost=e.steps_lost)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    space.close()
else:
    raised = 0
    for _ in range(2):  # while the write keeps failing, every use of the state raises and changes nothing
        try:
            if MODE == "read_all":
                snapshot()
            else:
                sw.step(add)  # raises before it reads or writes anything
        except DeferredWriteError as e:
            raised += 1
            result.update(exc=type(e).__name__, errno=e.errno, filename=e.filename, str=str(e))
            result["lost"] = e.steps_lost
    result["raised"] = raised
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    result["held"] = torch.equal(snapshot(), master0 + 1 + 2)  # the settle wrote the held chunks
    assert sw.step(add)  # and the run goes on from the held step
    sw.commit()
    result["went_on"] = torch.equal(snapshot(), master0 + 1 + 2 + 4)
    sw.close()
    space.close()
"""


@pytest.mark.parametrize(
    "mode,buffers", [("step", 3), ("prefetch_then_step", 1), ("read_all", 2), ("close", 3)]
)
def test_failed_deferred_write_is_held_and_written_again(tmp_path, mode, buffers):
    from tests.aio_helpers import run_child

    res = run_child(
        _SWAPPER_FAILURE_CHILD,
        prelude=f"NVME = {str(tmp_path)!r}\nMODE = {mode!r}\nBUFFERS = {buffers}\n",
        timeout=120,
    )
    assert res.get("returned") is True and res.get("in_flight") is True, res  # the step did not wait
    if mode == "prefetch_then_step":
        assert res["settled_in_flight"] is False
    assert res["exc"] == "DeferredWriteError", res
    assert res["errno"] in (errno.EFBIG, errno.ENOSPC), res
    assert res["filename"] == res["spare"], res  # names the copy whose write failed
    assert res["spare"] in res["str"]
    if mode == "close":
        assert res["lost"] == 1 and "lost" in res["str"], res
        return
    assert res["lost"] == 0 and "held in memory" in res["str"] and "changed nothing" in res["str"], res
    assert res["raised"] == 2  # every try while the write keeps failing
    assert res["held"] is True  # once it can be written, the state is the last step's
    assert res["went_on"] is True


_ENGINE_FAILURE_CHILD = ENGINE_CHILD_PRELUDE + textwrap.dedent(
    """

    e = engine()
    got = []
    for s in range(2):
        got.append(fwd_bwd(e, s))
        e.step()
    sw = e.optimizer_state
    got.append(fwd_bwd(e, 2))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    last = sw.step_order[-1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (last * sw.region_bytes, hard))  # the last chunk's write fails
    e.step()  # returns: that write is still in flight
    in_flight = sw.writes_in_flight
    params_after = [p.detach().clone() for p in e.module.parameters()]
    fwd_bwd(e, 3)  # the prefetch settles: the write fails again, the step is held
    err = None
    try:
        e.step()
    except OSError as exc:
        err = exc
    kept = all(torch.equal(a, p.detach()) for a, p in zip(params_after, e.module.parameters()))
    step_after_error = e.optimizer.step_count
    counters = [e.global_steps, e.global_samples, e.micro_steps]
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    got.append(fwd_bwd(e, 3))  # the one retry: forward, backward and step on the same batch
    e.step()
    state = e.optimizer.state_dict()
    same = (
        torch.equal(state["master"], ref_state["master"])
        and all(torch.equal(a, b) for a, b in zip(state["states"], ref_state["states"]))
        and all(torch.equal(a, p.detach()) for a, p in zip(ref_params, e.module.parameters()))
        and state["step"] == ref_state["step"]
    )
    swap_dir = e.swap_dir
    e.close()
    print(json.dumps({
        "type": type(err).__name__, "errno": getattr(err, "errno", None),
        "filename": getattr(err, "filename", None), "message": str(err), "swap_dir": swap_dir,
        "in_flight": in_flight, "kept": kept, "step_after_error": step_after_error, "counters": counters,
        "lost": getattr(err, "steps_lost", None), "same": same, "got": got, "want": want,
    }))
    """
)


def test_engine_holds_a_failing_write_back_and_the_one_retry_is_exact(tmp_path):
    """The last step's write fails after it returned, and again when written anew: the next step raises
    (nothing lost, nothing changed: weights, step counts as after the held step); once the disk takes the
    write, redoing forward, backward and step on the same batch gives the undisturbed run bit for bit."""
    res = run_child(_ENGINE_FAILURE_CHILD, str(tmp_path))
    assert res["in_flight"] is True  # the failing write really was deferred past the step
    assert res["type"] == "DeferredWriteError" and res["lost"] == 0, res
    assert res["errno"] in (errno.EFBIG, errno.ENOSPC), res["message"]
    assert res["filename"] and res["filename"].startswith(res["swap_dir"] + os.sep), res
    assert res["kept"] is True  # the held step's weights stay
    assert res["step_after_error"] == 3
    assert res["counters"] == [3, 6, 3]  # global_steps, global_samples (2 a step), micro_steps
    assert res["same"] is True  # identical to an undisturbed run
    assert res["got"] == res["want"]
    assert os.listdir(tmp_path) == []


def _train(nvme: str, pipeline: bool, defer: bool, steps: int, save_dir: str = ""):
    torch.manual_seed(0)
    engine = zero.initialize(model=GPT(MODEL), config=overlap_config(nvme, pipeline))[0]
    assert engine.optimizer_state.defer_writes  # on by default
    engine.optimizer_state.defer_writes = defer
    data = corpus_bytes()
    losses, in_flight = [], []
    for s in range(steps):
        x, y = get_batch(data, 2, MODEL.seq_len, s)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        in_flight.append(engine.optimizer_state.writes_in_flight)
        losses.append(loss.item())
    if save_dir:
        engine.save_checkpoint(save_dir, tag="last")  # right after the step, writes still in flight
    state = engine.optimizer.state_dict()
    params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    engine.close()
    return {"losses": losses, "state": state, "params": params, "in_flight": in_flight}


@pytest.mark.parametrize("pipeline", [False, True])
def test_engine_deferred_matches_drained_bit_exact(tmp_path, pipeline):
    a = _train(str(tmp_path), pipeline, defer=True, steps=6)
    b = _train(str(tmp_path), pipeline, defer=False, steps=6)
    assert all(a["in_flight"]) and not any(b["in_flight"])
    assert a["losses"] == b["losses"]
    assert torch.equal(a["params"], b["params"])
    assert torch.equal(a["state"]["master"], b["state"]["master"])
    assert all(torch.equal(x, y) for x, y in zip(a["state"]["states"], b["state"]["states"]))


def test_checkpoint_right_after_step_sees_written_state(tmp_path):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    a = _train(str(nvme), False, defer=True, steps=3, save_dir=str(ckpt))
    b = _train(str(nvme), False, defer=False, steps=3)
    assert a["in_flight"][-1]
    torch.manual_seed(1)  # different initial weights: everything must come from the checkpoint
    fresh = zero.initialize(model=GPT(MODEL), config=overlap_config(str(nvme), False))[0]
    fresh.load_checkpoint(str(ckpt), tag="last")
    got = fresh.optimizer.state_dict()
    fresh.close()
    assert got["step"] == 3
    assert torch.equal(got["master"], b["state"]["master"])
    assert all(torch.equal(x, y) for x, y in zip(got["states"], b["state"]["states"]))


def _fail_last_write(sw, times: int) -> list:
    """The next `times` waits on the slot of the step's last write report EIO (after the write finished);
    the returned list records each firing."""
    handle = sw._handles[(len(sw.step_order) - 1) % sw.buffer_count]
    real_wait = handle.wait
    fired: list = []

    def failing_wait():
        real_wait()
        fired.append(True)
        if len(fired) == times:
            del handle.wait
        raise OSError(errno.EIO, "injected write failure", sw._files[sw._live].path)

    handle.wait = failing_wait
    return fired


def test_write_back_failing_once_with_steps_during_backward_is_written_again(tmp_path):
    """The overlapped pass (pipeline_read/write): a write-back that fails once is written again from its
    slot when the next backward's prefetch settles it: no error, and the run is the undisturbed one.

    The failure is injected at the wait of the slot that holds the last write of the step (chunk 0 in the
    reversed order of that pass, so a file size limit cannot single it out).
    """
    data = corpus_bytes()

    def fwd_bwd(e, s):
        x, y = get_batch(data, 2, MODEL.seq_len, s)
        loss = e(x, y)
        e.backward(loss)
        return loss.item()

    ref = _train(str(tmp_path), True, defer=False, steps=4)
    torch.manual_seed(0)
    e = zero.initialize(model=GPT(MODEL), config=overlap_config(str(tmp_path), True))[0]
    assert e.overlap.enabled
    got = [fwd_bwd(e, 0), None]
    e.step()
    got[1] = fwd_bwd(e, 1)
    e.step()
    got.append(fwd_bwd(e, 2))
    e.step()
    sw = e.optimizer_state
    assert sw.writes_in_flight
    fired = _fail_last_write(sw, times=1)
    got.append(fwd_bwd(e, 3))
    e.step()
    assert fired == [True]
    state = e.optimizer.state_dict()
    params = torch.cat([p.detach().reshape(-1) for p in e.module.parameters()])
    e.close()
    assert got == ref["losses"]
    assert torch.equal(params, ref["params"]) and state["step"] == 4
    assert torch.equal(state["master"], ref["state"]["master"])


def test_engine_close_reports_lost_write_back_and_still_removes_swap_files(tmp_path):
    torch.manual_seed(0)
    e = zero.initialize(model=GPT(MODEL), config=overlap_config(str(tmp_path), False))[0]
    x, y = get_batch(corpus_bytes(), 2, MODEL.seq_len, 0)
    e.backward(e(x, y))
    e.step()
    sw = e.optimizer_state
    assert sw.writes_in_flight
    _fail_last_write(sw, times=1_000_000)  # the write again from its slot fails too
    swap_dir = e.swap_dir
    with pytest.raises(OSError) as info:
        e.close()  # nothing else has settled the writes: close is where the loss is reported
    assert type(info.value).__name__ == "DeferredWriteError" and info.value.errno == errno.EIO
    assert not os.path.exists(swap_dir)  # scratch files go even so
    assert os.listdir(tmp_path) == []
