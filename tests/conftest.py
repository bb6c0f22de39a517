"""Test-wide settings.

The default run checks the CPU paths on any machine, a GPU host included: the engines compute on the CPU
(ZO_ACCELERATOR=cpu) unless the environment already names an accelerator. A test that builds engines on a
GPU asks for it in one way only, the `device` fixture:

- `def test_x(device, ...)`: the same test on the CPU and on the GPU (ids `[cpu]`, `[cuda]`);
- `@pytest.mark.parametrize("device", ["cuda"], indirect=True)` on a test, or as a module's `pytestmark`
  (tests/test_cuda_*.py): the GPU case only.

Without a GPU the cuda case is skipped ("needs a CUDA device").
"""

import os

import pytest
import torch

if not any(os.environ.get(var) for var in ("ZO_ACCELERATOR", "DS_ACCELERATOR")):
    os.environ["ZO_ACCELERATOR"] = "cpu"  # inherited by the tests' child processes and torchrun ranks


@pytest.fixture(params=["cpu", "cuda"])
def device(request, monkeypatch):
    """The device the engines a test builds compute on; returned as a torch.device.

    On the GPU in fp32 math: TF32 is off (it would round matmuls far more coarsely than the tolerances
    against torch, and differently from the CPU runs)."""
    kind = request.param
    if kind == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("ZO_ACCELERATOR", kind)
    if kind != "cuda":
        yield torch.device(kind)
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.device(kind)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """zero.Init starts a one-process group when none exists (as DeepSpeed's): a group a test started is
    ended after it, so each test begins with the process-group state it found."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reference():
    """The engine tests' plain torch AdamW run (tests/engine_helpers.py `torch_reference`): losses, model."""
    from engine_helpers import STEPS, torch_reference

    return torch_reference(STEPS)
