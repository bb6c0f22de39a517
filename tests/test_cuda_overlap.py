"""The GPU-only part of optimizer steps during backward: at stages 0-2 each chunk's gradients are copied
to pinned host memory after an event recorded on backward's stream, chunk by chunk.

The engine-level overlap tests themselves (tests/test_overlap.py, tests/test_stage3_overlap.py) run on
the CPU and the GPU through the `device` fixture. Skipped on machines without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from test_overlap import MODEL, _config, _train

import zero
from zero.models import GPT, corpus_bytes, get_batch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("on_cuda"),  # tests/conftest.py: engines compute on the GPU, TF32 off
]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stage2_gradients_leave_the_gpu_chunk_by_chunk_during_backward(tmp_path, dtype):
    """Every chunk completed by a gradient hook (not by the end of backward), each copied once."""
    torch.manual_seed(0)
    engine = zero.initialize(model=GPT(MODEL), config=_config(str(tmp_path), True, dtype))[0]
    assert engine.device.type == "cuda"
    fetch = engine.overlap.fetch
    assert fetch is not None
    completed_in_backward = []
    done = fetch.backward_done

    def record_then_done() -> None:
        completed_in_backward.append(sum(fetch._recorded))
        done()

    fetch.backward_done = record_then_done
    x, y = (t.to(engine.device) for t in get_batch(corpus_bytes(), 2, MODEL.seq_len, 0))
    engine.backward(engine(x, y))
    engine.step()
    assert completed_in_backward == [engine.optimizer_state_info().chunks]
    grad_bytes = engine.part_numel * engine.layout.flat.grad_buffer.element_size()
    assert engine.last_report.device_to_host_bytes == grad_bytes
    engine.close()
    plain = _train(_config(str(tmp_path), False, dtype), steps=1)
    assert plain["report"].device_to_host_bytes == grad_bytes
