"""Parameter counting: tied weights once, largest module's own parameters, meta-device models cost nothing."""

from __future__ import annotations

import gc
import textwrap

import psutil
import pytest
import torch

from offload.estimate import EstimateInputError, count_parameters, load_model_on_meta


class TiedLM(torch.nn.Module):
    def __init__(self, vocab: int = 100, hidden: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.block = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2 and LLaMA-style models do


def test_tied_weights_count_once():
    count = count_parameters(TiedLM())
    assert count.params == 100 * 16 + 16 * 16 + 16
    assert count.largest_layer_params == 100 * 16


def test_parameters_sharing_storage_count_once():
    model = TiedLM()
    # a distinct Parameter object viewing the same storage is still one tensor in memory
    model.head.weight = torch.nn.Parameter(model.embed.weight.data)
    assert model.head.weight is not model.embed.weight
    assert count_parameters(model).params == 100 * 16 + 16 * 16 + 16


def test_largest_layer_counts_a_module_own_parameters_only():
    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(30))
            self.inner = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 5))

    count = count_parameters(Outer())
    assert count.params == 30 + 110 + 55
    assert count.largest_layer_params == 110
    assert count.largest_layer_name == "inner.0"


def test_meta_models_are_counted_without_allocating(tmp_path):
    """A 10B-parameter model (40 GB in fp32) built on meta grows RSS by almost nothing."""
    factory = tmp_path / "big_model.py"
    factory.write_text(
        textwrap.dedent(
            """
            import torch

            def build():
                # no device argument: load_model_on_meta makes meta the default device
                return torch.nn.Sequential(*[torch.nn.Linear(31623, 31623, bias=False) for _ in range(10)])
            """
        )
    )
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    model = load_model_on_meta(f"{factory}:build")
    count = count_parameters(model)
    rss_growth = psutil.Process().memory_info().rss - rss_before
    assert count.params == 10 * 31623 * 31623 > 10e9
    assert count.largest_layer_params == 31623 * 31623
    assert all(p.device.type == "meta" for p in model.parameters())
    assert rss_growth < 64 * 2**20, f"RSS grew {rss_growth} bytes"


def test_meta_tied_weights_dedupe_by_identity():
    with torch.device("meta"):
        model = TiedLM()
    assert count_parameters(model).params == 100 * 16 + 16 * 16 + 16


def test_model_spec_errors_are_one_clear_line(tmp_path):
    bad = tmp_path / "bad_model.py"
    bad.write_text(
        "import torch\n\ndef build():\n    return 3\n\ndef fails():\n    raise RuntimeError('boom')\n"
    )
    with pytest.raises(EstimateInputError, match="not a torch.nn.Module"):
        load_model_on_meta(f"{bad}:build")
    with pytest.raises(EstimateInputError, match="RuntimeError: boom"):
        load_model_on_meta(f"{bad}:fails")
    with pytest.raises(EstimateInputError, match="has no attribute 'missing'"):
        load_model_on_meta(f"{bad}:missing")
    with pytest.raises(EstimateInputError, match="cannot import no_such_module_xyz"):
        load_model_on_meta("no_such_module_xyz:build")
    with pytest.raises(EstimateInputError, match="expected a Hugging Face config.json"):
        load_model_on_meta("just_a_name")
