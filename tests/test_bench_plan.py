"""benchmarks/bench_plan.py with `--checkpoint`: the inference configurations load a Hugging Face checkpoint
through zero.from_pretrained (what a user does) instead of building a GPT; the planner's shape is the
checkpoint's, the run records the load, time to first token and what was served or copied."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks import bench_inference, bench_plan  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "tiny"
    bench_inference.write_checkpoint(str(path), "tiny", "fp32")
    return str(path)


def test_shape_is_the_checkpoints(ckpt):
    import torch
    import transformers

    shape = bench_plan._checkpoint_shape(ckpt, {"seq": 8})
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.largest_layer_params == 512 * 64  # the embedding (vocab x hidden), untied head alike
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size, shape.num_heads) == (64, 2, 512, 4)
    assert shape.seq_len == 8


@pytest.mark.parametrize("serve", ["auto", False])
def test_pretrained_run_streams_the_checkpoint(ckpt, tmp_path, serve):
    c = {"par": "nvme", "mb": 1, "seq": 8, "max_in_cpu": 0}
    shape = bench_plan._checkpoint_shape(ckpt, c)
    got = bench_plan._measure_pretrained(c, ckpt, serve, str(tmp_path), shape.vocab_size, 0, 1)
    weights = shape.params * 4
    assert len(got["all"]) == 1 and got["seconds"] > 0
    assert got["first_token_s"] > got["load_s"] > 0
    # the first forward reads every weight from disk (max_in_cpu 0)
    assert got["nvme_read_bytes"] == weights
    if serve == "auto":
        assert got["checkpoint_bytes_served"] == weights and got["swap_bytes_written"] == 0
        assert got["copy_reason"] is None
    else:
        assert got["checkpoint_bytes_served"] == 0 and got["swap_bytes_written"] == weights
        assert got["copy_reason"] == "serve_checkpoint=False"
    assert list(tmp_path.iterdir()) == []  # the engine removed its swap files
