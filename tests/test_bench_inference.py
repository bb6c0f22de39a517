"""benchmarks/bench_inference.py --smoke: both contenders (ours: zero.from_pretrained with the weights on
NVMe; accelerate: device_map="auto" with disk offload) load the same tiny Llama checkpoint, generate the same
tokens, and the JSON holds the throughput columns; our run streamed weights and wrote none back.
`--weight-bits` builds DeepSpeed's weight_quantization section; `--param-tier cpu` keeps every weight in
RAM for both."""

from __future__ import annotations

import argparse
import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from benchmarks import bench_inference  # noqa: E402


@pytest.mark.slow  # three processes importing transformers: minutes on a loaded 2-core machine
def test_smoke_run_compares_both_contenders(tmp_path):
    out = tmp_path / "out"
    argv = ["--smoke", "--read-ceiling-gbs", "2.0", "--no-drop-caches", "--out", str(out)]
    argv += ["--nvme-path", str(tmp_path)]
    assert bench_inference.main(argv) == 0
    data = json.loads((out / "bench_inference_smoke_cpu.json").read_text())
    assert data["tokens_identical"] is True
    assert data["read_ceiling_gbs"] == 2.0
    ours, acc = data["summary"]["ours"], data["summary"]["accelerate"]
    for s in (ours, acc):
        assert s["forwards"] == 4 and s["new_tokens_per_s"] > 0 and s["peak_rss_bytes"] > 0
    run = data["runs"]["ours"][0]
    assert len(run["tokens"]) == 2 and len(run["tokens"][0]) == 4  # batch 2 x 4 new tokens
    rep = run["report"]
    assert rep["forwards"] == 4 and rep["nvme_write_bytes"] == 0
    # a quarter of the weights may stay in RAM: the rest is read from the swap files, every forward
    assert 0 < rep["nvme_read_bytes"] <= 4 * data["weight_bytes"]
    assert "disk" in acc["device_map_tiers"]
    assert "meta" in data["runs"]["accelerate"][0]["param_devices"]  # offloaded weights
    table = (out / "bench_inference_smoke_cpu.md").read_text()
    assert "| ours |" in table and "| accelerate |" in table and "tokens identical" in table
    assert not [p for p in os.listdir(tmp_path) if p.startswith("zo-bench-inf-")]  # scratch removed


@pytest.mark.slow  # three processes importing transformers
def test_smoke_run_compares_served_and_copied_loads(tmp_path):
    """ours serves the weights from the checkpoint (nothing written), ours-copy copies them into swap
    files; the same tokens; load and time to first token reported for both."""
    out = tmp_path / "out"
    argv = ["--smoke", "--read-ceiling-gbs", "2.0", "--no-drop-caches", "--out", str(out)]
    argv += ["--nvme-path", str(tmp_path), "--contenders", "ours,ours-copy"]
    assert bench_inference.main(argv) == 0
    data = json.loads((out / "bench_inference_smoke_cpu.json").read_text())
    assert data["tokens_identical"] is True
    served, copied = data["runs"]["ours"][0], data["runs"]["ours-copy"][0]
    assert served["checkpoint_bytes_served"] > 0 and served["swap_bytes_written"] == 0
    assert copied["checkpoint_bytes_served"] == 0 and copied["swap_bytes_written"] > 0
    for c in ("ours", "ours-copy"):
        s = data["summary"][c]
        assert s["first_token_s"] > s["load_s"] > 0
    table = (out / "bench_inference_smoke_cpu.md").read_text()
    assert "| ours-copy |" in table and "first token s" in table


@pytest.mark.slow  # three processes importing transformers
def test_smoke_run_with_every_weight_in_ram(tmp_path):
    """--param-tier cpu: ours on the cpu tier reads nothing from NVMe, accelerate keeps every weight in
    RAM (nothing on disk), the tokens are identical and no disk ceiling is measured."""
    out = tmp_path / "out"
    argv = ["--smoke", "--param-tier", "cpu", "--no-drop-caches", "--out", str(out)]
    argv += ["--nvme-path", str(tmp_path)]
    assert bench_inference.main(argv) == 0
    data = json.loads((out / "bench_inference_smoke_cpu_cpu.json").read_text())
    assert data["tokens_identical"] is True and data["read_ceiling_gbs"] is None
    rep = data["runs"]["ours"][0]["report"]
    assert rep["forwards"] == 4 and rep["nvme_read_bytes"] == 0
    assert data["runs"]["accelerate"][0]["param_devices"] == ["cpu"]
    assert "weights on cpu" in (out / "bench_inference_smoke_cpu_cpu.md").read_text()


def test_param_tier_cpu_refuses_a_cpu_budget(capsys):
    with pytest.raises(SystemExit):
        bench_inference.main(["--smoke", "--param-tier", "cpu", "--cpu-budget", "1e9"])
    assert "--cpu-budget and --swap-cache apply to --param-tier nvme" in capsys.readouterr().err


def test_our_config_builds_the_deepspeed_sections(tmp_path):
    aio = tmp_path / "aio.json"
    aio.write_text(json.dumps({"aio": {"block_size": 4194304, "queue_depth": 32}}))
    args = argparse.Namespace(
        cpu_budget=4e6, buffer_count=3, buffer_size=10**7, weight_bits=4, group_size=64,
        prefetch_bucket=10**8, aio_config=str(aio), int8_activations=False, param_tier="nvme",
    )  # fmt: skip
    cfg = bench_inference.our_config(args, "/swap", 4)
    assert cfg["weight_quantization"] == {"quantized_initialization": {"num_bits": 4, "group_size": 64}}
    assert "zero_offload" not in cfg
    off = cfg["zero_optimization"]["offload_param"]
    want = {
        "device": "nvme",
        "nvme_path": "/swap",
        "max_in_cpu": 10**6,
        "buffer_count": 3,
        "buffer_size": 10**7,
    }
    assert off == want
    assert cfg["zero_optimization"]["stage3_prefetch_bucket_size"] == 10**8
    assert cfg["aio"] == {"block_size": 4194304, "queue_depth": 32}
    args.int8_activations = True
    assert bench_inference.our_config(args, "/swap", 4)["zero_offload"] == {"int8_activations": True}
    args.weight_bits = args.aio_config = None
    cfg = bench_inference.our_config(args, "/swap", 4)
    assert "weight_quantization" not in cfg and "aio" not in cfg
    args.param_tier = "cpu"  # every weight in pinned host memory
    off = bench_inference.our_config(args, "/swap", 4)["zero_optimization"]["offload_param"]
    assert off == {"device": "cpu", "pin_memory": True}


def test_int8_activations_without_quantized_weights_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_inference.main(["--smoke", "--int8-activations"])
    assert (
        "--int8-activations applies to quantized weights: give --weight-bits too" in capsys.readouterr().err
    )


def test_gpu_memory_cap_needs_cuda(capsys):
    with pytest.raises(SystemExit):
        bench_inference.main(["--smoke", "--gpu-memory-cap", "4e9"])
    assert "--gpu-memory-cap applies to --device cuda" in capsys.readouterr().err
