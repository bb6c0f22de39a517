"""`zero.from_pretrained(..., swap_cache=True)` (zero/stage3/swap_cache.py): the parameter swap files of a
load kept in `<nvme_path>/zero-offload-cache/<fingerprint>/` and reused by a later load of the same
checkpoint.

Greedy generation equals transformers' on the load that builds the cache and on the one that reuses it; the
reusing load reads no weight bytes from the checkpoint and writes none to swap (`engine.load_report`, the
engine's inference report); a shard's mtime or size, the dtype or the quantization config give another
cache; a truncated cache file or a missing manifest is rebuilt with correct tokens; the cache survives
close() with its 0700/0600 modes; a complete cache is read-only; another process's lock makes a load fall
back to scratch swap; int4 weights round-trip through the cache."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat

import pytest
import torch
from checkpoint_helpers import failing_safe_open

import zero
from offload.swap.space import SwapSpaceError
from zero.stage3.swap_cache import CACHE_DIR, MANIFEST

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 256
NEW_TOKENS = 6


def llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1,
            eos_token_id=2,
        )
    )  # fmt: skip


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2
    )
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """llama: sharded (an index and several files); gpt2: one model.safetensors, tied head. With each, the
    greedy tokens of transformers' own load."""
    root = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    out = {}
    for name, model, kwargs in (("llama", llama(), {"max_shard_size": 60_000}), ("gpt2", gpt2(), {})):
        path = root / name
        model.save_pretrained(path, **kwargs)
        ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        out[name] = (path, generate(ref), sum(p.numel() * 4 for p in ref.parameters()))
    return out


def copy_ckpt(src, dst):
    dst.mkdir()
    for f in os.listdir(src):
        (dst / f).write_bytes((src / f).read_bytes())
        st = os.stat(src / f)
        os.utime(dst / f, ns=(st.st_atime_ns, st.st_mtime_ns))
    return dst


def config(tmp_path, **extra):
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    off = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": extra.pop("max_in_cpu", 0)}
    zero_cfg = {"stage": 3, "offload_param": off}
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero_cfg, **extra}


def generate(model):
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mask = torch.ones_like(ids)
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )


def load(path, cfg, **kwargs):
    """(engine's load report, its tokens, its inference report after generating); the engine is closed."""
    engine = zero.from_pretrained(path, config=cfg, swap_cache=True, **kwargs)
    try:
        tokens = generate(engine.module)
        return engine.load_report, tokens, engine.inference_report()
    finally:
        engine.close()


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_second_load_reuses_the_files_and_reads_no_weights(ckpts, tmp_path, arch):
    path, want, weight_bytes = ckpts[arch]
    cfg = config(tmp_path)
    first, tokens, inf = load(path, cfg)
    assert first.swap_cache == "built" and torch.equal(tokens, want)
    assert first.checkpoint_bytes_read >= weight_bytes - 4 * VOCAB * 64  # gpt2's tied head is one tensor
    assert first.swap_bytes_written >= first.checkpoint_bytes_read
    # survives close(), private: the cache root and its directory 0700, every file 0600
    d = first.swap_cache_dir
    assert os.path.isfile(os.path.join(d, MANIFEST))
    assert mode(tmp_path / "nvme" / CACHE_DIR) == 0o700 and mode(d) == 0o700
    names = os.listdir(d)
    assert len(names) > 3 and all(mode(os.path.join(d, n)) == 0o600 for n in names)
    assert sorted(os.listdir(tmp_path / "nvme")) == [CACHE_DIR]  # no scratch swap left

    second, tokens2, inf2 = load(path, cfg)
    assert second.swap_cache == "reused" and second.swap_cache_dir == d
    assert second.checkpoint_bytes_read == 0 and second.swap_bytes_written == 0
    assert torch.equal(tokens2, want)
    assert inf2.nvme_write_bytes == 0 and inf2.nvme_read_bytes == inf.nvme_read_bytes > 0
    assert sorted(os.listdir(d)) == sorted(names)


def _touch(path):
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def _grow(path):
    """Re-save the file with one more metadata entry (same tensors, larger header), keeping its mtime."""
    st = os.stat(path)
    state = safetensors_torch.load_file(str(path))
    safetensors_torch.save_file(state, str(path), metadata={"format": "pt", "note": "x" * 100})
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size != st.st_size


@pytest.mark.parametrize("change", ["mtime", "size", "dtype", "quantization"])
def test_what_changes_the_partitions_gives_another_cache(ckpts, tmp_path, change):
    src, want, _ = ckpts["gpt2"]
    path = copy_ckpt(src, tmp_path / "ckpt")
    cfg = config(tmp_path)
    first, _, _ = load(path, cfg)
    assert first.swap_cache == "built"
    kwargs = {}
    if change == "mtime":
        _touch(path / "model.safetensors")
    elif change == "size":
        _grow(path / "model.safetensors")
    elif change == "dtype":
        kwargs["dtype"] = torch.bfloat16
    else:
        cfg = {**cfg, "weight_quantization": {"quantized_initialization": {"num_bits": 8, "group_size": 32}}}
    second, tokens, _ = load(path, cfg, **kwargs)
    assert second.swap_cache == "built" and second.swap_cache_dir != first.swap_cache_dir
    assert second.checkpoint_bytes_read > 0 and second.swap_bytes_written > 0
    if change in ("mtime", "size"):
        assert torch.equal(tokens, want)
    third, _, _ = load(path, cfg, **kwargs)  # and that one is reused in turn
    assert third.swap_cache == "reused" and third.swap_cache_dir == second.swap_cache_dir


def test_truncated_cache_file_is_named_and_rebuilt(ckpts, tmp_path, caplog):
    path, want, _ = ckpts["llama"]
    cfg = config(tmp_path)
    first, _, _ = load(path, cfg)
    d = first.swap_cache_dir
    victim = os.path.join(d, sorted(n for n in os.listdir(d) if n.endswith(".swp"))[0])
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="zero"):
        second, tokens, _ = load(path, cfg)
    assert f"{victim}: expected {size} bytes, found {size // 2} bytes" in caplog.text
    assert second.swap_cache == "built" and second.swap_bytes_written > 0 and torch.equal(tokens, want)
    assert os.path.getsize(victim) == size
    assert load(path, cfg)[0].swap_cache == "reused"


def test_cache_without_manifest_is_rebuilt(ckpts, tmp_path, caplog):
    """A build that died before its manifest (here: removed, and every file's bytes zeroed) is never used."""
    path, want, _ = ckpts["llama"]
    cfg = config(tmp_path)
    d = load(path, cfg)[0].swap_cache_dir
    os.unlink(os.path.join(d, MANIFEST))
    for n in os.listdir(d):
        with open(os.path.join(d, n), "r+b") as f:
            f.write(bytes(os.path.getsize(f.name)))
    with caplog.at_level(logging.WARNING, logger="zero"):
        second, tokens, _ = load(path, cfg)
    assert "has no manifest" in caplog.text
    assert second.swap_cache == "built" and torch.equal(tokens, want)
    assert os.path.isfile(os.path.join(d, MANIFEST))


def test_unfinished_cache_of_a_dead_builder_is_removed(ckpts, tmp_path):
    path, want, _ = ckpts["gpt2"]
    cfg = config(tmp_path)
    root = tmp_path / "nvme" / CACHE_DIR
    root.mkdir(mode=0o700)
    stale = root / "0123456789abcdef0123456789abcdef"
    stale.mkdir(mode=0o700)
    (stale / "x.param.swp").write_bytes(bytes(4096))
    report, tokens, _ = load(path, cfg)
    assert report.swap_cache == "built" and torch.equal(tokens, want)
    assert not stale.exists()


def test_max_in_cpu_units_are_read_from_the_checkpoint(ckpts, tmp_path):
    """Partitions in host memory are not cached: a reusing load reads just their tensors."""
    path, want, weight_bytes = ckpts["llama"]
    cfg = config(tmp_path, max_in_cpu=weight_bytes // 8)
    first, tokens, _ = load(path, cfg)
    second, tokens2, _ = load(path, cfg)
    assert first.swap_cache == "built" and second.swap_cache == "reused"
    assert 0 < second.checkpoint_bytes_read < first.checkpoint_bytes_read
    assert second.swap_bytes_written == 0
    assert torch.equal(tokens, want) and torch.equal(tokens2, want)


def test_int4_weights_round_trip_through_the_cache(ckpts, tmp_path):
    path, _, _ = ckpts["llama"]
    quant = {"quantized_initialization": {"num_bits": 4, "group_size": 32}}
    cfg = config(tmp_path, weight_quantization=quant)
    first, tokens, inf = load(path, cfg)
    second, tokens2, inf2 = load(path, cfg)
    assert first.swap_cache == "built" and second.swap_cache == "reused"
    assert second.checkpoint_bytes_read == 0 and second.swap_bytes_written == 0
    assert torch.equal(tokens, tokens2)
    assert inf2.nvme_read_bytes == inf.nvme_read_bytes < first.checkpoint_bytes_read  # encoded: smaller


def test_complete_cache_is_read_only(ckpts, tmp_path):
    path, _, _ = ckpts["gpt2"]
    cfg = config(tmp_path)
    load(path, cfg)
    engine = zero.from_pretrained(path, config=cfg, swap_cache=True)
    try:
        assert engine.load_report.swap_cache == "reused"
        weight = engine.module.transformer.h[0].mlp.c_fc.weight
        with pytest.raises(SwapSpaceError) as e:
            with zero.GatheredParameters(weight, modifier_rank=0):
                weight.data.zero_()
        assert e.value.errno == errno.EROFS and "c_fc" in str(e.value)
    finally:
        engine.close()
    assert load(path, cfg)[0].swap_cache == "reused"  # untouched


def test_two_engines_share_a_complete_cache_and_a_builder_lock_means_scratch(ckpts, tmp_path, caplog):
    path, want, _ = ckpts["gpt2"]
    cfg = config(tmp_path)
    a = zero.from_pretrained(path, config=cfg, swap_cache=True)
    b = zero.from_pretrained(path, config=cfg, swap_cache=True)  # while `a` uses it
    try:
        assert a.load_report.swap_cache == "built" and b.load_report.swap_cache == "reused"
        assert torch.equal(generate(a.module), want) and torch.equal(generate(b.module), want)
    finally:
        a.close()
        b.close()
    d = a.load_report.swap_cache_dir
    os.unlink(os.path.join(d, MANIFEST))  # unfinished, and another process holds the lock: building it
    fd = os.open(d + ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with caplog.at_level(logging.WARNING, logger="zero"):
            report, tokens, _ = load(path, cfg)
    finally:
        os.close(fd)
    assert "private scratch swap" in caplog.text and d in caplog.text
    assert report.swap_cache is None and torch.equal(tokens, want)
    assert sorted(os.listdir(tmp_path / "nvme")) == [CACHE_DIR]  # the scratch swap is gone


def test_refusals_before_anything_is_written(ckpts, tmp_path):
    path, _, _ = ckpts["gpt2"]
    cfg = config(tmp_path)
    with pytest.raises(ValueError, match="inference engines"):
        zero.from_pretrained(
            path, config={**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, swap_cache=True
        )
    cpu = {**cfg, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    with pytest.raises(ValueError, match="offload_param.device='nvme'"):
        zero.from_pretrained(path, config=cpu, swap_cache=True)
    assert os.listdir(tmp_path / "nvme") == []


def test_a_directory_argument_holds_the_cache(ckpts, tmp_path):
    path, want, _ = ckpts["gpt2"]
    elsewhere = tmp_path / "cache"
    elsewhere.mkdir()
    engine = zero.from_pretrained(path, config=config(tmp_path), swap_cache=str(elsewhere))
    try:
        assert engine.load_report.swap_cache_dir.startswith(str(elsewhere / CACHE_DIR) + os.sep)
        assert torch.equal(generate(engine.module), want)
    finally:
        engine.close()
    assert json.loads(open(os.path.join(engine.load_report.swap_cache_dir, MANIFEST)).read())["files"]


def test_manifest_naming_other_files_is_rebuilt(ckpts, tmp_path, caplog):
    """A manifest whose files are not the ones the model asks for (one renamed, on disk and in the manifest):
    the load notices while placing the units, warns and rebuilds."""
    path, want, _ = ckpts["gpt2"]
    cfg = config(tmp_path)
    d = load(path, cfg)[0].swap_cache_dir
    manifest_path = os.path.join(d, MANIFEST)
    manifest = json.loads(open(manifest_path).read())
    name = sorted(manifest["files"])[0]
    manifest["files"]["renamed.param.swp"] = manifest["files"].pop(name)
    os.rename(os.path.join(d, name), os.path.join(d, "renamed.param.swp"))
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with caplog.at_level(logging.WARNING, logger="zero"):
        report, tokens, _ = load(path, cfg)
    assert os.path.join(d, name) in caplog.text and "does not list it" in caplog.text
    assert report.swap_cache == "built" and torch.equal(tokens, want)
    assert not os.path.exists(os.path.join(d, "renamed.param.swp"))
    assert load(path, cfg)[0].swap_cache == "reused"


def test_failure_while_building_leaves_no_cache(ckpts, tmp_path, monkeypatch):
    import safetensors

    path, want, _ = ckpts["gpt2"]
    real = safetensors.safe_open

    Failing = failing_safe_open(real, "transformer.h.1.mlp.c_fc.weight")

    cfg = config(tmp_path)
    monkeypatch.setattr(safetensors, "safe_open", Failing)
    with pytest.raises(zero.inference.pretrained.PretrainedCheckpointError, match="simulated read error"):
        zero.from_pretrained(path, config=cfg, swap_cache=True)
    root = tmp_path / "nvme" / CACHE_DIR
    assert [n for n in os.listdir(root) if not n.endswith(".lock")] == []  # the unfinished build is gone
    assert sorted(os.listdir(tmp_path / "nvme")) == [CACHE_DIR]
    monkeypatch.setattr(safetensors, "safe_open", real)
    report, tokens, _ = load(path, cfg)
    assert report.swap_cache == "built" and torch.equal(tokens, want)


def test_a_builder_killed_before_its_manifest_leaves_nothing_usable(ckpts, tmp_path):
    """A child dies of SIGKILL with every swap file written but no manifest; a later cached load (here of
    another fingerprint: bf16) removes its directory, since the dead builder's lock is free."""
    import signal
    import subprocess
    import sys

    from tests.aio_helpers import REPO

    path, _, _ = ckpts["gpt2"]
    cfg = config(tmp_path)
    script = (
        f"import os, signal, sys\nsys.path.insert(0, {REPO!r})\nimport zero\n"
        "from zero.stage3.swap_cache import SwapCache\n"
        "SwapCache.seal = lambda self: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"zero.from_pretrained({str(path)!r}, config={cfg!r}, swap_cache=True)\n"
    )
    env = {**os.environ, "ZO_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    root = tmp_path / "nvme" / CACHE_DIR
    [name] = [n for n in os.listdir(root) if not n.endswith(".lock")]
    left = os.listdir(root / name)
    assert left and MANIFEST not in left  # the files were written, the manifest never
    report, _, _ = load(path, cfg, dtype=torch.bfloat16)
    assert report.swap_cache == "built" and report.swap_cache_dir != str(root / name)
    assert not (root / name).exists()


@pytest.mark.parametrize(
    "damage, warning",
    [
        (lambda m, d: "{not json", "unreadable"),
        (lambda m, d: json.dumps({**m, "files": []}), "lists no files"),
        (lambda m, d: _list_extra_file(m, d), "did not ask for 1 file(s) of the manifest"),
    ],
    ids=["unreadable", "no-files", "extra-file"],
)
def test_damaged_manifest_is_rebuilt_with_a_warning(ckpts, tmp_path, caplog, damage, warning):
    """A manifest that is not JSON, lists no files, or lists a file the model does not ask for (present with
    its listed size): the load warns, rebuilds from the checkpoint, and the next load reuses the rebuild."""
    path, want, _ = ckpts["gpt2"]
    cfg = config(tmp_path)
    d = load(path, cfg)[0].swap_cache_dir
    manifest_path = os.path.join(d, MANIFEST)
    manifest = json.loads(open(manifest_path).read())
    text = damage(manifest, d)
    with open(manifest_path, "w") as f:
        f.write(text)
    with caplog.at_level(logging.WARNING, logger="zero"):
        report, tokens, _ = load(path, cfg)
    assert warning in caplog.text
    assert report.swap_cache == "built" and torch.equal(tokens, want)
    assert load(path, cfg)[0].swap_cache == "reused"


def _list_extra_file(manifest, directory):
    with open(os.path.join(directory, "extra.param.swp"), "wb") as f:
        f.write(b"\0" * 4096)
    return json.dumps({**manifest, "files": {**manifest["files"], "extra.param.swp": 4096}})


def test_cache_root_that_is_not_a_directory_is_refused(ckpts, tmp_path):
    """`<nvme_path>/zero-offload-cache` is a file (or a symlink): SwapCacheError (EPERM) naming it, before any
    weight is read or swap file made."""
    from zero.stage3.swap_cache import SwapCacheError

    path, _, _ = ckpts["gpt2"]
    cfg = config(tmp_path)
    root = tmp_path / "nvme" / CACHE_DIR
    root.write_bytes(b"")
    with pytest.raises(SwapCacheError, match="not a directory of this user") as e:
        zero.from_pretrained(path, config=cfg, swap_cache=True)
    assert e.value.errno == errno.EPERM and e.value.filename == str(root)
    assert os.listdir(tmp_path / "nvme") == [CACHE_DIR]


def test_a_manifest_that_cannot_be_written_leaves_no_cache(tmp_path, monkeypatch):
    """seal(): the rename of the manifest fails (EIO): SwapCacheError naming the temporary file and the errno;
    closing removes the unfinished directory and a later build succeeds."""
    from zero.stage3.swap_cache import SwapCacheError, open_swap_cache

    inputs = {"checkpoint": "x"}
    cache = open_swap_cache(str(tmp_path), inputs)
    cache.create("a.param.swp", 100)

    def failing_replace(src, dst, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(SwapCacheError, match="cannot write the swap cache manifest") as e:
        cache.seal()
    assert e.value.errno == errno.EIO and e.value.filename.endswith(MANIFEST + ".tmp")
    monkeypatch.undo()
    cache.close()
    assert not os.path.exists(cache.dir)
    again = open_swap_cache(str(tmp_path), inputs)
    assert not again.reused
    again.create("a.param.swp", 100)
    again.seal()
    again.close()
    reused = open_swap_cache(str(tmp_path), inputs)
    assert reused.reused and reused.read_only
    reused.close()


def test_a_closed_cache_and_a_bad_file_name_are_refused(tmp_path):
    from zero.stage3.swap_cache import SwapCacheError, open_swap_cache

    cache = open_swap_cache(str(tmp_path), {"checkpoint": "y"})
    with pytest.raises(ValueError, match="plain file name"):
        cache.create("../escape.swp", 100)
    with pytest.raises(ValueError, match="plain file name"):
        cache.create(MANIFEST, 100)
    cache.close()
    with pytest.raises(SwapCacheError, match="swap cache is closed") as e:
        cache.create("a.param.swp", 100)
    assert e.value.errno == errno.EBADF
