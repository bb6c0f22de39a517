"""Optimizer steps overlapped with backward (offload_optimizer.pipeline_read / pipeline_write, NVMe tier).

Every sub-group is stepped on a worker thread as soon as its gradients are final. Each element's update
does not depend on the order the sub-groups run in, so the trajectory must be bit-identical to the
engine stepping after backward; an fp16 overflow found part way through the overlapped pass must undo
it (nothing committed, parameters restored), again giving the very same trajectory. With a share of the
state kept in RAM (`max_in_cpu`, zero/optimizer/tiers/split.py) the swapped sub-groups are stepped during
backward and the resident ones after it, with the same results.
"""

from __future__ import annotations

import threading

import pytest
import torch
from overlap_helpers import MODEL, SUB, overlap_config, overlap_run

import zero
from offload.pinned import PinnedPool
from offload.swap import OptimizerSwapper, SwapSpace
from zero.examples.models import GPT, corpus_bytes, get_batch
from zero.layout.partition import FlatParams, GradReadiness

RESIDENT = 3 * SUB  # max_in_cpu of the split cases: the first 3 sub-groups stay in pinned RAM
IN_RAM = [0, RESIDENT]


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert torch.equal(a["params"], b["params"])
    assert torch.equal(a["state"]["master"], b["state"]["master"])
    for x, y in zip(a["state"]["states"], b["state"]["states"]):
        assert torch.equal(x, y)
    assert a["skipped"] == b["skipped"]


@pytest.mark.parametrize("in_ram", IN_RAM)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_overlapped_steps_match_steps_after_backward(tmp_path, dtype, in_ram, device):
    plain = overlap_run(overlap_config(str(tmp_path), False, dtype, in_ram), steps=3)
    overlapped = overlap_run(overlap_config(str(tmp_path), True, dtype, in_ram), steps=3)
    assert not plain["early"] and overlapped["early"]
    assert plain["overlapped"] == [False] * 3 and overlapped["overlapped"] == [True] * 3
    _same(plain, overlapped)
    rep = overlapped["report"]
    assert rep.nvme_read_bytes > 0 and rep.nvme_write_bytes > 0
    assert rep.nvme_read_bytes == plain["report"].nvme_read_bytes  # the swapped share only, in both
    assert plain["report"].optimizer_chunks_in_backward == 0
    assert rep.optimizer_chunks == plain["report"].optimizer_chunks > 1  # every sub-group, in both
    # The trajectory really moved (a pass that never committed would also be "identical").
    assert overlapped["state"]["step"] == 3


def test_split_state_steps_its_swapped_share_during_backward(tmp_path):
    """max_in_cpu: the swapped sub-groups beat backward's end, the resident ones are stepped after it."""
    torch.manual_seed(0)
    engine = zero.initialize(model=GPT(MODEL), config=overlap_config(str(tmp_path), True, in_ram=RESIDENT))[0]
    info = engine.optimizer_state_info()
    assert engine.overlap.enabled and info.resident_numel == RESIDENT and info.swapped_numel > 2 * SUB
    swapped_chunks = info.chunks - RESIDENT // SUB  # the resident share walks whole sub-groups
    seen = []
    hook = engine.module.pos.weight.register_hook(
        lambda g: seen.append(engine.overlap.wait_updated(swapped_chunks, timeout=60))
    )
    x, y = (t.to(engine.device) for t in get_batch(corpus_bytes(), 2, MODEL.seq_len, 0))
    engine.backward(engine(x, y))
    engine.step()
    hook.remove()
    rep = engine.last_report
    engine.close()
    assert seen == [True]  # every swapped chunk was stepped while backward still ran
    assert rep.optimizer_chunks == info.chunks
    assert rep.optimizer_chunks_in_backward == swapped_chunks


@pytest.mark.parametrize("in_ram", IN_RAM)
def test_overlap_with_gradient_accumulation(tmp_path, in_ram, device):
    plain = overlap_run(overlap_config(str(tmp_path), False, in_ram=in_ram), steps=2, gas=2)
    overlapped = overlap_run(overlap_config(str(tmp_path), True, in_ram=in_ram), steps=2, gas=2)
    # every window's last backward ran the pass (the first one only accumulated), the other run's step did
    assert overlapped["overlapped"] == [True, True] and plain["overlapped"] == [False, False]
    assert overlapped["state"]["step"] == 2  # one update per window
    _same(plain, overlapped)


@pytest.mark.parametrize("in_ram", IN_RAM)
def test_overflow_in_overlapped_pass_is_undone(tmp_path, in_ram, device):
    """fp16: the fused finite check stops the speculative pass; nothing is committed, params restored.
    A split state checks its resident share's gradients before stepping it in place."""
    plain = overlap_run(overlap_config(str(tmp_path), False, "fp16", in_ram), steps=8)
    overlapped = overlap_run(overlap_config(str(tmp_path), True, "fp16", in_ram), steps=8)
    assert 0 < overlapped["skipped"] < 8  # some steps overflowed and were undone, later ones went through
    assert overlapped["overlapped"] == [True] * 8  # each of them during backward
    _same(plain, overlapped)


@pytest.mark.parametrize("in_ram", IN_RAM)
@pytest.mark.parametrize("clip", [0.05, 1e6], ids=["clipping-triggers", "clipping-idle"])
def test_speculative_steps_with_clipping_match_steps_after_backward(tmp_path, clip, in_ram, device):
    """With clipping the sub-groups are stepped during backward with coefficient 1 and validated after
    it (zero/optimizer/speculative.py): kept when clipping does not trigger, undone from the old NVMe copy
    and redone with the true coefficient when it does - bit-identical to stepping after backward."""
    plain = overlap_run(overlap_config(str(tmp_path), False, in_ram=in_ram, gradient_clipping=clip), steps=3)
    spec = overlap_run(overlap_config(str(tmp_path), True, in_ram=in_ram, gradient_clipping=clip), steps=3)
    assert spec["early"]
    _same(plain, spec)
    assert spec["state"]["step"] == 3
    rep = spec["report"]
    assert rep.optimizer_chunks == plain["report"].optimizer_chunks
    if clip < 1:  # every sub-group stepped during backward was redone
        assert rep.optimizer_chunks_redone > 0 and rep.optimizer_chunks_in_backward == 0
    else:  # the speculation stood: the pass started during backward was kept (how many of its chunks ran
        # before backward ended depends on timing)
        assert rep.optimizer_chunks_redone == 0 and rep.optimizer_overlapped


@pytest.mark.parametrize("clip", [0.05, 1e6], ids=["clipping-triggers", "clipping-idle"])
def test_speculative_steps_with_clipping_and_accumulation(tmp_path, clip):
    plain = overlap_run(overlap_config(str(tmp_path), False, gradient_clipping=clip), steps=2, gas=2)
    spec = overlap_run(overlap_config(str(tmp_path), True, gradient_clipping=clip), steps=2, gas=2)
    _same(plain, spec)


@pytest.mark.parametrize("in_ram", IN_RAM)
def test_speculative_steps_with_clipping_and_fp16_overflow(tmp_path, in_ram):
    """fp16 with clipping: overflowing steps are dropped and skipped, the others validated as above."""
    plain = overlap_run(overlap_config(str(tmp_path), False, "fp16", in_ram, gradient_clipping=0.5), steps=8)
    spec = overlap_run(overlap_config(str(tmp_path), True, "fp16", in_ram, gradient_clipping=0.5), steps=8)
    assert spec["early"] and 0 < spec["skipped"] < 8
    _same(plain, spec)
    assert spec["report"].optimizer_chunks_redone > 0 or spec["report"].optimizer_overlapped


@pytest.mark.parametrize("in_ram", IN_RAM)
def test_state_dict_between_backward_and_step_sees_committed_state(tmp_path, in_ram, device):
    torch.manual_seed(0)
    engine = zero.initialize(model=GPT(MODEL), config=overlap_config(str(tmp_path), True, in_ram=in_ram))[0]
    data = corpus_bytes()
    x, y = (t.to(engine.device) for t in get_batch(data, 2, MODEL.seq_len, 0))
    before = [p.detach().clone() for p in engine.module.parameters()]
    committed = engine.optimizer.state_dict()
    engine.backward(engine(x, y))
    mid = engine.optimizer.state_dict()  # discards the overlapped pass, restores the parameters
    assert torch.equal(mid["master"], committed["master"]) and mid["step"] == 0
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))
    engine.step()  # the update then runs after backward, from the same gradients
    assert not engine.last_report.optimizer_overlapped
    assert engine.optimizer.state_dict()["step"] == 1
    assert not all(torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))
    engine.close()


@pytest.mark.parametrize("in_ram", IN_RAM)
def test_failed_backward_cancels_the_pass(tmp_path, in_ram, device):
    torch.manual_seed(0)
    engine = zero.initialize(model=GPT(MODEL), config=overlap_config(str(tmp_path), True, in_ram=in_ram))[0]
    data = corpus_bytes()
    x, y = (t.to(engine.device) for t in get_batch(data, 2, MODEL.seq_len, 0))
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine(x, y)
    hook = loss.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("backward failed")))
    with pytest.raises(RuntimeError, match="backward failed"):
        engine.backward(loss)
    hook.remove()
    assert not engine.overlap.running
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))
    assert engine.optimizer.state_dict()["step"] == 0
    engine.close()


def test_sub_groups_are_stepped_while_backward_runs(tmp_path):
    """The overlap happens: sub-groups whose gradients are final are stepped before backward returns.

    A hook on the position embedding (its gradient comes last in backward) holds backward until the pass
    reports an updated chunk, so the order does not depend on thread scheduling."""
    torch.manual_seed(0)
    engine = zero.initialize(model=GPT(MODEL), config=overlap_config(str(tmp_path), True))[0]
    chunks = engine.optimizer_state_info().chunks
    assert engine.overlap.enabled and chunks > 2
    seen = []
    hook = engine.module.pos.weight.register_hook(
        lambda g: seen.append(engine.overlap.wait_updated(1, timeout=60))
    )
    x, y = (t.to(engine.device) for t in get_batch(corpus_bytes(), 2, MODEL.seq_len, 0))
    engine.backward(engine(x, y))
    engine.step()
    hook.remove()
    rep = engine.last_report
    assert seen == [True]
    assert rep.optimizer_chunks == chunks
    assert 1 <= rep.optimizer_chunks_in_backward <= chunks
    engine.close()


def test_grad_readiness_waits_for_every_parameter_of_a_chunk():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3000, 500, 4000, 600)]
    flat = FlatParams(params)
    chunks = [(s, min(2048, flat.padded_numel - s)) for s in range(0, flat.padded_numel, 2048)]
    gate = GradReadiness.for_flat(flat, 0, chunks)
    # parameter 0 covers [0, 3000): chunks 0 and 1; parameter 1 [3000, 3500): chunk 1; ...
    assert gate.chunks_of[0] == [0, 1] and gate.chunks_of[1] == [1]
    assert gate.counts[1] == 3  # parameters 0, 1 and 2 overlap [2048, 4096)
    gate.begin()
    released = []

    def waiter(c: int) -> None:
        released.append((c, gate.wait(c)))

    t = threading.Thread(target=waiter, args=(1,))
    t.start()
    gate.param_ready(0)
    gate.param_ready(1)
    t.join(timeout=0.2)
    assert t.is_alive() and released == []  # parameter 2 still missing
    gate.param_ready(2)
    t.join()
    assert released == [(1, True)]
    assert gate.wait(0)  # parameter 0 alone made chunk 0 ready
    gate.cancel()
    assert not gate.wait(3)
    gate.begin()
    gate.all_ready()
    assert gate.wait(3)  # backward finished: unused parameters never fire their hooks


def test_swapper_step_order_and_ready_gate(tmp_path):
    pool = PinnedPool(16 << 20)
    with SwapSpace(str(tmp_path)) as space:
        sw = OptimizerSwapper(space, 5000, 1, pool, chunk_numel=1000, buffer_count=2)
        values = torch.arange(5000, dtype=torch.float32)

        def fill(start, n, master, states):
            master.copy_(values[start : start + n])
            states[0].zero_()

        sw.load(fill)
        sw.step_order = [4, 3, 2, 1, 0]
        sw.prefetch()  # lines up with the reversed order: the step uses these reads
        read0 = sw.stats.bytes_read
        visited, gated = [], []

        def ready(i):
            gated.append(i)
            return True

        def add(start, n, master, states):
            visited.append(start // 1000)
            master.add_(1)
            return True

        assert sw.step(add, ready=ready)
        sw.commit()
        assert visited == [4, 3, 2, 1, 0] and gated == visited
        assert sw.stats.bytes_read == read0 + 3 * (sw.region_bytes)  # 2 prefetched, 3 read in the step
        got = torch.empty(5000)

        def take(start, n, master, states):
            got[start : start + n].copy_(master)

        sw.read_all(take)
        assert torch.equal(got, values + 1)
        assert not sw.step(add, ready=lambda i: i != 2)  # a cancelled pass is not committed
        sw.abort()
        sw.read_all(take)
        assert torch.equal(got, values + 1)
        sw.close()
