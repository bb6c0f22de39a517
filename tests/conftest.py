"""Test-wide settings.

The default run checks the CPU paths on any machine, a GPU host included: the engines compute on the CPU
(ZO_ACCELERATOR=cpu) unless the environment already names an accelerator. The GPU paths have their own
tests, which ask for it through one of two fixtures: `device` (parametrized over cpu and cuda: the same
test on both; the cuda case is skipped without a GPU) or `on_cuda` (GPU-only tests, in test_cuda_*.py).
"""

import contextlib
import os

import pytest
import torch

if not any(os.environ.get(var) for var in ("ZO_ACCELERATOR", "DS_ACCELERATOR")):
    os.environ["ZO_ACCELERATOR"] = "cpu"  # inherited by the tests' child processes and torchrun ranks


@contextlib.contextmanager
def _compute_on(monkeypatch, kind: str):
    """Engines built inside compute on `kind`; on the GPU in fp32 math (TF32 off: it would round matmuls far
    more coarsely than the tolerances against torch, and differently from the CPU runs)."""
    monkeypatch.setenv("ZO_ACCELERATOR", kind)
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.device(kind)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture
def on_cuda(monkeypatch):
    """GPU-only tests: engines built by the test compute on the GPU."""
    with _compute_on(monkeypatch, "cuda"):
        yield


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
        ),
    ]
)
def device(request, monkeypatch):
    """The same test on the CPU and, where there is one, the GPU: the engines it builds compute there."""
    with _compute_on(monkeypatch, request.param) as dev:
        yield dev
