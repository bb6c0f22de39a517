"""ZO_ACCELERATOR / DS_ACCELERATOR pick the compute device; bad values are clear errors."""

import pytest
import torch

from zero.accelerator import accelerator_name, compute_device, dist_backend


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("ZO_ACCELERATOR", raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    return monkeypatch


def test_default_follows_torch(clean_env):
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert accelerator_name() == expected
    assert compute_device(0).type == expected


def test_cpu_override(clean_env):
    clean_env.setenv("DS_ACCELERATOR", "CPU")  # DeepSpeed's variable, any case
    assert compute_device(0) == torch.device("cpu")
    assert dist_backend() == "gloo"


def test_own_variable_wins_over_deepspeeds(clean_env):
    clean_env.setenv("ZO_ACCELERATOR", "cpu")
    clean_env.setenv("DS_ACCELERATOR", "bogus")
    assert accelerator_name() == "cpu"


def test_unknown_value_names_the_variable(clean_env):
    clean_env.setenv("ZO_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match=r"ZO_ACCELERATOR='tpu'.*'cpu', 'cuda'"):
        accelerator_name()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(clean_env):
    clean_env.setenv("ZO_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError, match="ZO_ACCELERATOR=cuda but torch sees no usable CUDA device"):
        compute_device(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_when_asked(clean_env):
    clean_env.setenv("ZO_ACCELERATOR", "cuda")
    assert compute_device(0) == torch.device("cuda", 0)
    assert dist_backend() == "nccl"
