"""Shared by the streamed-inference tests: a small Llama and its prompt and generation sizes."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


VOCAB = 128


BATCH, PROMPT, NEW_TOKENS = 2, 6, 8


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
            eos_token_id=2,
        )
    ).eval()  # fmt: skip
