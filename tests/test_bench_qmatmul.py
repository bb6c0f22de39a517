"""benchmarks/bench_qmatmul.py on a small weight: every contender timed for every row count, the JSON and
table written, the ratios are torch's median over each contender's, and the transposed form says whether
its bits equal torch's."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_qmatmul


def test_small_run_writes_every_contender(tmp_path):
    bench_qmatmul.main(["--shapes", "96x128", "--rows", "1", "5", "--repeats", "2", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench_qmatmul.json").read_text())
    assert data["bits"] == 4 and data["group_size"] == 64
    seen = {(r["rows"], r["contender"]) for r in data["results"]}
    assert seen == {(m, c) for m in (1, 5) for c in ("torch", "torch-transposed", "codes", "codes-int8")}
    for m in (1, 5):
        rows = {r["contender"]: r for r in data["results"] if r["rows"] == m}
        for r in rows.values():
            assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
            assert r["speedup_vs_torch"] == pytest.approx(rows["torch"]["median_ms"] / r["median_ms"])
    for r in data["results"]:
        assert ("same_bits_as_torch" in r) == (r["contender"] == "torch-transposed")
    assert "| 96x128 | 5 | codes-int8 |" in (tmp_path / "bench_qmatmul.md").read_text()
