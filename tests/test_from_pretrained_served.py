"""`zero.from_pretrained` serving NVMe partitions straight from the checkpoint's safetensors files
(zero/inference/serving.py, zero/stage3/served.py): forwards bit-identical to the copy path, no weight in
the swap directory, conversions (a cast, quantization) copied with the reason in the LoadReport, damaged
files refused naming file and tensor, a file changed under a running engine failing its read, writes
refused, the disk rule and its override."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

import zero
from offload.aio import AioError
from zero.inference import serving
from zero.inference.pretrained import PretrainedCheckpointError

transformers = pytest.importorskip("transformers")

VOCAB = 256


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1,
            eos_token_id=2,
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Llama in shards small enough that some tensors of one module lie in different files."""
    path = tmp_path_factory.mktemp("served") / "llama"
    llama().save_pretrained(path, max_shard_size=30_000)
    return str(path)


def config(tmp_path, **extra):
    nvme = tmp_path / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    off = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}
    # no partition kept gathered between forwards: each forward reads every one from its file
    z = {"stage": 3, "offload_param": off, "stage3_param_persistence_threshold": 0}
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": z, **extra}


def ids():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def logits(engine):
    with torch.no_grad():
        return engine(ids()).logits


def swap_entries(tmp_path):
    """Every file under the swap directory (the private swap dirs' contents included)."""
    return [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "nvme") for f in fs]


def test_served_forward_is_bit_identical_to_the_copied_one_and_copies_nothing(ckpt, tmp_path):
    copied = zero.from_pretrained(ckpt, config=config(tmp_path), serve_checkpoint=False)
    want = logits(copied)
    assert copied.load_report.swap_bytes_written > 0 and copied.load_report.checkpoint_bytes_served == 0
    copied.close()
    engine = zero.from_pretrained(ckpt, config=config(tmp_path))  # the default: "auto"
    report = engine.load_report
    params = sum(u.numel * u.element_size for u in engine.layout.partitioner.units)
    assert report.checkpoint_bytes_served == params and report.copy_reason is None
    assert report.swap_bytes_written == 0 and report.checkpoint_bytes_read == 0
    assert swap_entries(tmp_path) == []  # no copy of any weight
    index = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    layer = [k for k in index if k.startswith("model.layers.0.self_attn.")]
    assert len({index[k] for k in layer}) == 2  # one module's tensors in two files: its partition reads both
    for _ in range(2):  # a second forward reads the checkpoint again, as it would read swap files
        assert torch.equal(logits(engine), want)
    engine.close()


def test_cast_tensors_are_copied_and_the_report_says_why(ckpt, tmp_path):
    """A float32 checkpoint loaded in bfloat16: every partition needs a cast, so all are copied."""
    engine = zero.from_pretrained(ckpt, config=config(tmp_path), dtype=torch.bfloat16)
    report = engine.load_report
    assert report.checkpoint_bytes_served == 0 and report.swap_bytes_written > 0
    assert "F32 tensors cast to bfloat16" in report.copy_reason
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(logits(engine), ref(ids()).logits)
    engine.close()


def test_quantized_units_are_copied_and_the_rest_served(ckpt, tmp_path):
    cfg = config(tmp_path, weight_quantization={"quantized_initialization": {"num_bits": 8}})
    engine = zero.from_pretrained(ckpt, config=cfg)
    store, units = engine.layout.partitioner.store, engine.layout.partitioner.units
    quantized = [u for u in units if store.codec(u) is not None]
    assert quantized and len(quantized) < len(units)
    report = engine.load_report
    assert f"{len(quantized)} unit(s): quantized" in report.copy_reason
    assert report.checkpoint_bytes_served == sum(u.part_nbytes for u in units if store.codec(u) is None)
    assert report.swap_bytes_written == sum(store.stored_nbytes(u) for u in quantized)
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path / "b")
    os.mkdir(tmp_path / "b")
    copied = zero.from_pretrained(ckpt, config=cfg, serve_checkpoint=False)
    assert torch.equal(logits(engine), logits(copied))
    copied.close()
    engine.close()


def test_truncated_tensor_is_named_before_anything_is_served(ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(ckpt):
        (bad / f).write_bytes(open(os.path.join(ckpt, f), "rb").read())
    shard = bad / "model-00002-of-00010.safetensors" if (bad / "model-00002-of-00010.safetensors").exists() \
        else bad / sorted(f for f in os.listdir(bad) if f.endswith(".safetensors"))[1]  # fmt: skip
    header = json.loads(shard.read_bytes()[8 : 8 + int.from_bytes(shard.read_bytes()[:8], "little")])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    size = shard.stat().st_size
    os.truncate(shard, size - 4)
    with pytest.raises(PretrainedCheckpointError) as e:
        zero.from_pretrained(bad, config=config(tmp_path))
    msg = str(e.value)
    assert str(shard) in msg and repr(last) in msg and f"the file has {size - 4} bytes" in msg
    assert swap_entries(tmp_path) == []


def test_header_whose_offsets_do_not_fit_the_shape_is_named(ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(ckpt):
        (bad / f).write_bytes(open(os.path.join(ckpt, f), "rb").read())
    shard = bad / sorted(f for f in os.listdir(bad) if f.endswith(".safetensors"))[0]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__" and len(header[k]["shape"]) == 2)
    header[key]["shape"] = [header[key]["shape"][0], header[key]["shape"][1] // 2]  # half the bytes
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    shard.write_bytes(raw[:8] + text + raw[8 + n :])
    with pytest.raises(PretrainedCheckpointError, match=rf"{shard}: tensor '{key}' is F32 .* corrupt header"):
        zero.from_pretrained(bad, config=config(tmp_path))


def test_a_checkpoint_file_truncated_under_a_running_engine_fails_its_read(ckpt, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    for f in os.listdir(ckpt):
        (live / f).write_bytes(open(os.path.join(ckpt, f), "rb").read())
    engine = zero.from_pretrained(live, config=config(tmp_path))
    logits(engine)
    shard = live / sorted(f for f in os.listdir(live) if f.endswith(".safetensors"))[-1]
    os.truncate(shard, 100)
    with pytest.raises(AioError) as e:
        logits(engine)
    assert e.value.errno == errno.ENODATA and str(shard) in str(e.value)
    engine.close()


def test_hub_style_symlinked_files_are_served(ckpt, tmp_path):
    """A Hub snapshot's files are symlinks into its blobs: the link's target is opened and served."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in os.listdir(ckpt):
        (blobs / f).write_bytes(open(os.path.join(ckpt, f), "rb").read())
        os.symlink(os.path.join("..", "..", "blobs", f), snap / f)
    engine = zero.from_pretrained(snap, config=config(tmp_path))
    assert engine.load_report.checkpoint_bytes_served > 0 and engine.load_report.copy_reason is None
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        assert torch.equal(logits(engine), ref(ids()).logits)
    engine.close()


def test_writes_into_a_served_partition_are_refused(ckpt, tmp_path):
    engine = zero.from_pretrained(ckpt, config=config(tmp_path))
    part = engine.layout.partitioner
    unit = part.units[1]
    before = part.read_partition(unit).clone()
    with pytest.raises(OSError, match="served read-only from the checkpoint") as e:
        part.write_partition(unit, torch.zeros_like(before))
    assert e.value.errno == errno.EROFS and e.value.filename.startswith(ckpt)
    assert torch.equal(part.read_partition(unit), before)
    engine.close()


def test_rule_optimizer_slow_disk_and_override(ckpt, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="serve_checkpoint must be 'auto', True or False, got 'yes'"):
        zero.from_pretrained(ckpt, config=config(tmp_path), serve_checkpoint="yes")
    opt = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine = zero.from_pretrained(ckpt, config=config(tmp_path, **opt))
    assert "optimizer block" in engine.load_report.copy_reason
    assert engine.load_report.checkpoint_bytes_served == 0
    engine.close()
    monkeypatch.setattr(serving, "_fs_type", lambda dev: "nfs4")  # as if the checkpoint were on NFS
    engine = zero.from_pretrained(ckpt, config=config(tmp_path))
    assert "is on a nfs4 filesystem" in engine.load_report.copy_reason
    assert engine.load_report.checkpoint_bytes_served == 0 and engine.nvme_bytes > 0
    engine.close()
    engine = zero.from_pretrained(ckpt, config=config(tmp_path), serve_checkpoint=True)
    assert engine.load_report.copy_reason is None and engine.nvme_bytes == 0
    engine.close()


def test_a_fifo_in_a_checkpoint_files_place_is_refused_not_waited_on(tmp_path):
    """The loader holds each file by the descriptor it opens: a FIFO put where a shard was (after the
    directory was listed) is refused naming it, instead of blocking the open forever. In a child process,
    so that a regression fails by its timeout rather than hanging the suite."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    script = (
        "from zero.inference.checkpoint_files import PretrainedCheckpointError, open_files\n"
        "from zero.stage3.served import CheckpointFds\n"
        "try:\n"
        f"    open_files({str(tmp_path)!r}, [{str(fifo)!r}], CheckpointFds())\n"
        "except PretrainedCheckpointError as e:\n"
        "    print(e)\n"
    )
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{fifo}: not a regular file" in out.stdout


def test_placement_counts_the_served_bytes_on_nvme(ckpt, tmp_path):
    """engine.placement(): partitions served from the checkpoint are on NVMe as much as copied ones."""
    copied = zero.from_pretrained(ckpt, config=config(tmp_path), serve_checkpoint=False)
    want = copied.placement()["parameters"]
    copied.close()
    served = zero.from_pretrained(ckpt, config=config(tmp_path), serve_checkpoint=True)
    got = served.placement()["parameters"]
    report = served.load_report
    served.close()
    assert report.checkpoint_bytes_served > 0
    assert got["nvme_bytes"] >= report.checkpoint_bytes_served
    # the swap files are 4 KiB-rounded: the copied partitions take at least the served bytes
    assert report.checkpoint_bytes_served <= want["nvme_bytes"] < report.checkpoint_bytes_served + 4096 * 64
    assert "served from the checkpoint's files" in got["why"]
    assert "served" not in want["why"]
