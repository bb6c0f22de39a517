"""transformers' `pipeline("text-generation")` over an inference engine's module: the tool a Hugging Face
user already calls, with the weights streamed from NVMe, gives the text of the same pipeline over the plain
model."""

from __future__ import annotations

import copy

import pytest
import torch

import zero

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["[UNK]", "[PAD]"] + [f"w{i}" for i in range(94)]


def tokenizer():
    """A word-level tokenizer over WORDS, built in memory (no download)."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, "[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def test_text_generation_pipeline_over_the_engine(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    ref = copy.deepcopy(model)
    off = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": off}}
    engine, *_ = zero.initialize(model=model, config=config)
    prompts = ["w3 w4 w5", "w7 w8", "w40"]
    kwargs = {"max_new_tokens": 5, "do_sample": False}
    tok = tokenizer()
    want = transformers.pipeline("text-generation", model=ref, tokenizer=tok)(prompts, **kwargs)
    engine.inference_report()
    got = transformers.pipeline("text-generation", model=engine.module, tokenizer=tok)(prompts, **kwargs)
    assert got == want
    report = engine.inference_report()
    assert report.forwards > 0 and report.nvme_read_bytes > 0  # the weights were streamed
    engine.close()
