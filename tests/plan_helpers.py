"""Model shapes the planner's tests share (offload.estimate.plan.ModelShape)."""

from __future__ import annotations

from offload.estimate.plan import ModelShape

GPT125 = ModelShape(
    params=134_000_000, largest_layer_params=24_576_000, hidden_size=768, num_layers=12, seq_len=128,
    vocab_size=32000,
)  # fmt: skip


def llama7(seq_len: int) -> ModelShape:
    """A Llama-2-7B's shape at sequence length `seq_len`."""
    return ModelShape(
        params=6_738_000_000, largest_layer_params=131_072_000, hidden_size=4096, num_layers=32,
        seq_len=seq_len, vocab_size=32000,
    )  # fmt: skip
