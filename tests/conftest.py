"""Test-wide settings.

The default run checks the CPU paths on any machine, a GPU host included: the engines compute on the CPU
(ZO_ACCELERATOR=cpu) unless the environment already names an accelerator. The GPU paths have their own
tests (test_cuda_engine.py, test_cuda_overlap.py), which ask for CUDA themselves through the `on_cuda`
fixture and are skipped without it.
"""

import os

import pytest
import torch

if not any(os.environ.get(var) for var in ("ZO_ACCELERATOR", "DS_ACCELERATOR")):
    os.environ["ZO_ACCELERATOR"] = "cpu"  # inherited by the tests' child processes and torchrun ranks


@pytest.fixture
def on_cuda(monkeypatch):
    """Engines built by the test compute on the GPU, in fp32 math (TF32 off: it would round matmuls far
    more coarsely than the tolerances against torch, and differently from the CPU runs)."""
    monkeypatch.setenv("ZO_ACCELERATOR", "cuda")
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
