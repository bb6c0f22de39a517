"""Optimizer sub-groups stepped during backward with the model on a GPU (pipeline_read / pipeline_write).

The engine-level tests of tests/test_overlap.py (stages 0-2) and tests/test_stage3_overlap.py (stage 3) run
here again with the compute device set to CUDA, where the overlap has its own paths: at stages 0-2 each
chunk's gradients are copied to pinned host memory after an event recorded on backward's stream, and the
updated weights go back on a side stream while backward still runs; at stage 3 the optimizer thread
rewrites host partitions and persistent units' device copies. Every trajectory must still be
bit-identical to the same engine stepping after backward. Skipped on machines without CUDA.
"""

from __future__ import annotations

import pytest
import test_overlap as stage2
import test_stage3_overlap as stage3
import torch
from test_overlap import MODEL, _config, _train

import zero
from zero.models import GPT, corpus_bytes, get_batch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("on_cuda"),  # tests/conftest.py: engines compute on the GPU, TF32 off
]

# Re-run here on the GPU: pytest collects test functions from this module's namespace.
test_stage2_matches_stepping_after_backward = stage2.test_overlapped_steps_match_steps_after_backward
test_stage2_with_gradient_accumulation = stage2.test_overlap_with_gradient_accumulation
test_stage2_fp16_overflow_is_undone = stage2.test_overflow_in_overlapped_pass_is_undone
test_stage2_state_dict_between_backward_and_step = (
    stage2.test_state_dict_between_backward_and_step_sees_committed_state
)
test_stage2_failed_backward_cancels_the_pass = stage2.test_failed_backward_cancels_the_pass
test_stage3_matches_stepping_after_backward = stage3.test_overlapped_steps_match_steps_after_backward
test_stage3_bf16_partly_frozen_unit = stage3.test_bf16_and_a_partly_frozen_unit_on_nvme
test_stage3_with_gradient_accumulation = stage3.test_with_gradient_accumulation
test_stage3_fp16_overflow_is_undone = stage3.test_fp16_overflow_in_the_overlapped_pass_is_undone
test_stage3_released_during_backward = stage3.test_sub_groups_are_stepped_while_backward_runs
test_stage3_forward_between_backward_and_step = (
    stage3.test_forward_between_backward_and_step_sees_the_committed_weights
)
test_stage3_failed_backward_cancels_the_pass = stage3.test_failed_backward_cancels_the_pass


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
