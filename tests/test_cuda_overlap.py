"""The GPU-only part of optimizer steps during backward: at stages 0-1 each chunk's gradients are copied
to pinned host memory after an event recorded on backward's stream, chunk by chunk (stage 2's gradients
reach the host in buckets during backward: tests/test_grad_buckets.py).

The engine-level overlap tests themselves (tests/test_overlap.py, tests/test_stage3_overlap.py) run on
the CPU and the GPU through the `device` fixture (tests/conftest.py). Skipped on machines without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from overlap_helpers import MODEL, overlap_config, overlap_run

import zero
from zero.examples.models import GPT, corpus_bytes, get_batch

pytestmark = pytest.mark.parametrize("device", ["cuda"], indirect=True)  # tests/conftest.py: GPU only


def _stage1(cfg: dict) -> dict:
    cfg["zero_optimization"]["stage"] = 1
    return cfg


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stage1_gradients_leave_the_gpu_chunk_by_chunk_during_backward(tmp_path, dtype, device):
    """Every chunk's gradients are fetched once a gradient hook completed it, not at the end of backward;
    each chunk is copied once."""
    torch.manual_seed(0)
    engine = zero.initialize(model=GPT(MODEL), config=_stage1(overlap_config(str(tmp_path), True, dtype)))[0]
    assert engine.device.type == device.type
    fetch = engine.overlap.fetch
    assert fetch is not None
    chunks = engine.optimizer_state_info().chunks
    assert chunks > 1
    # The end of backward releases the chunks no hook completed (their copy then waits for all of backward).
    # Held just before that: the optimizer thread can fetch and update every chunk, because the hooks
    # released them all, each with the event its copy waits for.
    all_updated_before_the_end = []
    done = fetch.backward_done

    def wait_then_done() -> None:
        all_updated_before_the_end.append(engine.overlap.wait_updated(chunks, timeout=60))
        done()

    fetch.backward_done = wait_then_done
    x, y = (t.to(engine.device) for t in get_batch(corpus_bytes(), 2, MODEL.seq_len, 0))
    engine.backward(engine(x, y))
    engine.step()
    assert all_updated_before_the_end == [True]
    assert engine.last_report.optimizer_chunks == chunks
    grad_bytes = engine.part_numel * engine.layout.flat.grad_buffer.element_size()
    assert engine.last_report.device_to_host_bytes == grad_bytes
    engine.close()
    plain = overlap_run(_stage1(overlap_config(str(tmp_path), False, dtype)), steps=1)
    assert plain["report"].device_to_host_bytes == grad_bytes
