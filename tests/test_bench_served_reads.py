"""benchmarks/bench_served_reads.py: both placements of served reads read the checkpoint's bytes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import bench_inference, bench_served_reads  # noqa: E402


def test_both_placements_read_the_same_bytes(tmp_path):
    ckpt = tmp_path / "ckpt"
    bench_inference.write_checkpoint(str(ckpt), "tiny", "fp32")
    out = tmp_path / "out"
    assert (
        bench_served_reads.main(
            ["--checkpoint", str(ckpt), "--gb", "0.0002", "--rounds", "2", "--out", str(out)]
        )
        == 0
    )
    data = json.loads((out / "bench_served_reads.json").read_text())
    assert data["same_bytes"] is True and data["bytes"] >= 200_000
    assert all(len(ts) == 2 for ts in data["times"].values())
    tensors = bench_served_reads.tensors(str(ckpt), 10**12)
    assert (
        sum(n for _, _, n in tensors)
        == json.loads((ckpt / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    )
