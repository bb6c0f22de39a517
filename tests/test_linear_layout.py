"""Multi-row fp32 Linear forwards computed as (W x^T)^T (zero/stage3/linear_layout.py): the first forward
of a shape checks that form against torch's bit for bit and returns torch's result; later forwards of a
matching shape use it (counted by `transposed_linears` in the partitioner's I/O report), a shape that does
not match never does, and everything else (few rows, a strided input, grad mode, bf16) runs the module's
own forward.
Values: always torch's, for plain modules, a stage-3 engine on NVMe, and a transformers Llama prefill."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zero
import zero.stage3.linear_layout as linear_layout
from zero.stage3.linear_layout import MIN_ROWS, LinearLayouts

transformers = pytest.importorskip("transformers")


def exact_values(*shape, seed=0):
    """Small integers as fp32: every sum of products is exact, so both forms agree on any BLAS."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=g).float()


def integer_mlp(bias=True):
    model = nn.Sequential(nn.Linear(48, 64, bias=bias), nn.ReLU(), nn.Linear(64, 32, bias=bias))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(exact_values(*p.shape, seed=10 + i))
    return model.eval()


@pytest.mark.parametrize("bias", [True, False])
def test_first_forward_checks_later_forwards_use_the_transposed_form(bias):
    model = integer_mlp(bias)
    ref = copy.deepcopy(model)
    layouts = LinearLayouts(model)
    x = exact_values(2, 20, 48, seed=1)  # 40 rows, 3-D as transformers passes them
    with torch.no_grad():
        want = ref(x)
        first = model(x)
        assert layouts.probes == 2 and layouts.transposed == 0  # one check per Linear shape
        assert layouts.verdict(40, 64, 48, bias) is True and layouts.verdict(40, 32, 64, bias) is True
        second = model(x)
    assert layouts.transposed == 2 and layouts.probes == 2
    assert torch.equal(first, want) and torch.equal(second, want)
    assert second.is_contiguous() and second.shape == want.shape
    with torch.no_grad():
        assert torch.equal(model[0](input=x), ref[0](input=x))  # torch's argument name works too
    layouts.remove()
    assert "forward" not in model[0].__dict__


def test_a_shape_whose_forms_differ_keeps_torchs_product(monkeypatch):
    model = integer_mlp()
    ref = copy.deepcopy(model)
    layouts = LinearLayouts(model)
    real = linear_layout.transposed_linear
    monkeypatch.setattr(linear_layout, "transposed_linear", lambda x, w, b: real(x, w, b) + 1.0)
    x = exact_values(MIN_ROWS, 48, seed=2)
    with torch.no_grad():
        want = ref(x)
        for _ in range(3):
            assert torch.equal(model(x), want)
    assert layouts.probes == 2 and layouts.transposed == 0
    assert layouts.verdict(MIN_ROWS, 64, 48, True) is False


def test_few_rows_strided_input_grad_mode_and_bf16_run_the_modules_own_forward():
    model = integer_mlp()
    ref = copy.deepcopy(model)
    layouts = LinearLayouts(model)
    with torch.no_grad():
        model(exact_values(MIN_ROWS - 1, 48))  # a decoding step's few rows
        x = exact_values(48, MIN_ROWS).t()  # strides torch's BLAS call sees differently
        assert torch.equal(model[0](x), ref[0](x))
        model.to(torch.bfloat16)(exact_values(MIN_ROWS, 48).bfloat16())
    model.float()
    out = model(exact_values(MIN_ROWS, 48))  # grad mode: autograd's graph through torch's own product
    assert out.requires_grad
    assert layouts.probes == 0 and layouts.transposed == 0


def test_stage3_engine_on_nvme_counts_transposed_forwards(tmp_path):
    model = integer_mlp()
    ref = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
        },
    }
    engine, *_ = zero.initialize(model=model, config=config)
    x = exact_values(3, 8, 48, seed=3)
    with torch.no_grad():
        want = ref(x)
        engine.partitioner.take_io_report()
        assert torch.equal(engine(x), want)
        assert engine.partitioner.take_io_report().transposed_linears == 0  # the first forward checks
        assert torch.equal(engine(x), want)
        io = engine.partitioner.take_io_report()
        assert torch.equal(engine(x[:, :2]), ref(x[:, :2]))  # 6 rows: torch's form
    assert io.transposed_linears == 2 and io.param_nvme_read_bytes > 0
    assert engine.partitioner.take_io_report().transposed_linears == 0
    engine.close()


def test_llama_prefill_logits_equal_transformers(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )
    ).eval()  # fmt: skip
    ref = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
        },
    }
    engine, *_ = zero.initialize(model=model, config=config)
    ids = torch.randint(3, 128, (4, 12), generator=torch.Generator().manual_seed(1))  # 48 rows
    with torch.no_grad():
        want = ref(ids).logits
        for _ in range(3):
            assert torch.equal(engine(ids).logits, want)
        tokens = engine.module.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
    engine.close()
