"""zero-to-fp32: a checkpoint of every stage and optimizer tier (NVMe included, stage 3 with its parameters
on NVMe, two ranks) converts to exactly the engine's live fp32 master; safetensors / .bin / shards / dtypes;
the command; every bad input fails with the file named, before any output is written."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import digest_file
from dist_helpers import run_on_ranks
from safetensors.torch import load_file
from torch import nn

import zero
from zero.checkpoint._files import manifest_bytes
from zero.checkpoint.to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    parse_size,
)
from zero.cli_to_fp32 import main
from zero.errors import CheckpointError, CheckpointIntegrityError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, WIDTH = 64, 16


class Net(nn.Module):
    """Everything a state dict can hold: a tied head, a module with one frozen parameter (a mixed stage-3
    unit), a frozen module, a float and an integer buffer. `freeze=False`: nothing frozen."""

    def __init__(self, freeze: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 40), nn.Linear(40, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(not freeze)
        self.norm = nn.LayerNorm(WIDTH)
        self.norm.bias.requires_grad_(not freeze)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("count", torch.tensor([3, 4]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = self.norm(self.down(torch.relu(self.up(h))) * self.scale + self.frozen(h))
        return F.cross_entropy(self.head(h).view(-1, VOCAB), y.view(-1))


def config(stage: int, optim: str, nvme, param: str = "none", bf16: bool = False) -> dict:
    zo = {"stage": stage, "sub_group_size": 1024, "stage3_param_persistence_threshold": 0}
    if optim != "none":
        zo["offload_optimizer"] = {"device": optim, "nvme_path": str(nvme), "max_in_cpu": 0}
    if param != "none":
        zo["offload_param"] = {"device": param, "nvme_path": str(nvme), "max_in_cpu": 0}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": zo,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_and_save(ckpt, cfg, steps: int = 3, init: bool = False):
    """Train `Net` (built under zero.Init with `init`) a few steps, save; returns (live fp32 master, live
    whole state dict)."""
    torch.manual_seed(0)
    if init:  # nothing frozen: a parameter frozen after zero.Init partitioned it still gets a gradient hook
        with zero.Init(config=cfg):
            model = Net(freeze=False)
    else:
        model = Net()
    engine, *_ = zero.initialize(model=model, config=cfg)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randint(0, VOCAB, (2, 6), generator=g) for _ in range(2))
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(str(ckpt))
    master, whole = engine.fp32_master_state_dict(), engine.consolidated_state_dict()
    engine.close()
    return master, whole


def assert_matches(got, master, whole, dtype=torch.float32):
    assert sorted(got) == sorted(whole)
    for k, v in whole.items():
        k_master = "emb.weight" if k == "head.weight" else k  # tied: the master has it under its first name
        want = master[k_master] if k_master in master else v
        want = want.to(dtype) if want.is_floating_point() else want
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k


@pytest.mark.parametrize(
    "stage,optim,param,bf16,init",
    [
        (0, "cpu", "none", False, False),
        (0, "nvme", "none", False, False),
        (1, "cpu", "none", False, False),
        (1, "nvme", "none", True, False),
        (2, "cpu", "none", True, False),
        (2, "nvme", "none", False, False),
        (3, "cpu", "none", False, False),
        (3, "nvme", "none", True, False),
        (3, "nvme", "nvme", False, False),
        (3, "cpu", "nvme", True, False),
        (3, "nvme", "nvme", True, True),  # zero.Init: units named in construction order until attached
    ],
)
def test_equals_the_live_fp32_master(tmp_path, stage, optim, param, bf16, init):
    master, whole = train_and_save(tmp_path / "ckpt", config(stage, optim, tmp_path, param, bf16), init=init)
    got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    assert_matches(got, master, whole)
    assert list(got) == list(whole)  # in the model's state_dict order
    frozen = {"frozen.weight", "frozen.bias", "norm.bias"} if not init else set()
    assert set(master) == set(whole) - frozen - {"head.weight", "scale", "count"}
    assert got["head.weight"] is got["emb.weight"]  # tied: one tensor, as in the model
    if bf16:  # the master, not the 16-bit weights
        assert not torch.equal(got["up.weight"], whole["up.weight"].float())
    trained = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), exclude_frozen_parameters=True)
    assert sorted(trained) == sorted(set(whole) - frozen)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """One checkpoint (stage 2, optimizer states on NVMe, bf16 weights) and its live state."""
    tmp = tmp_path_factory.mktemp("ckpt")
    master, whole = train_and_save(tmp / "ckpt", config(2, "nvme", tmp, bf16=True))
    return tmp / "ckpt", master, whole


def test_safetensors_bin_dtypes_and_shards(tmp_path, ckpt):
    src, master, whole = ckpt
    files = convert_zero_checkpoint_to_fp32_state_dict(str(src), str(tmp_path / "a"))
    assert files == [str(tmp_path / "a" / "model.safetensors")]
    assert_matches(load_file(files[0]), master, whole)  # the tied copy is stored twice
    files = convert_zero_checkpoint_to_fp32_state_dict(
        str(src), str(tmp_path / "w.bin"), dtype=torch.bfloat16, safe_serialization=False
    )
    assert files == [str(tmp_path / "w.bin")]
    assert_matches(torch.load(files[0], weights_only=True), master, whole, torch.bfloat16)
    files = convert_zero_checkpoint_to_fp32_state_dict(
        str(src), str(tmp_path / "s"), dtype="fp16", max_shard_size="3KB"
    )
    index = json.loads(open(files[-1]).read())
    assert files[-1].endswith("model.safetensors.index.json") and len(files) > 3
    assert os.path.basename(files[0]) == f"model-00001-of-{len(files) - 1:05d}.safetensors"
    got = {}
    for f in files[:-1]:
        shard = load_file(f)
        assert all(index["weight_map"][k] == os.path.basename(f) for k in shard)
        got.update(shard)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in got.values())
    assert_matches({k: got[k] for k in whole}, master, whole, torch.float16)
    assert not [n for n in os.listdir(tmp_path / "s") if n.endswith(".tmp")]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size(7) == 7
    with pytest.raises(ValueError, match="size"):
        parse_size("5 parsecs")
    with pytest.raises(ValueError, match="should not end in .safetensors"):
        convert_zero_checkpoint_to_fp32_state_dict(
            str(src), str(tmp_path / "x.safetensors"), safe_serialization=False
        )


def test_command(tmp_path, ckpt):
    src, master, whole = ckpt
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [
        sys.executable,
        "-m",
        "zero.checkpoint.to_fp32",
        str(src),
        str(tmp_path / "out"),
        "--dtype",
        "bf16",
    ]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / "out" / "model.safetensors")]
    assert_matches(load_file(tmp_path / "out" / "model.safetensors"), master, whole, torch.bfloat16)
    tag = os.path.basename(open(src / "latest").read())
    assert (
        main([str(src), str(tmp_path / "o.bin"), "--tag", tag, "--no-safetensors", "--max-shard-size", "1GB"])
        == 0
    )
    assert_matches(torch.load(tmp_path / "o.bin", weights_only=True), master, whole)
    assert main([str(src / tag), str(tmp_path / "t.safetensors")]) == 0  # the tag's directory itself
    assert_matches(load_file(tmp_path / "t.safetensors"), master, whole)


def reseal(path, edit) -> None:
    """Change the manifest of checkpoint `path` with `edit(files)` and seal it again (a valid manifest)."""
    body = json.loads(open(path / "manifest.json").read())
    body.pop("manifest_digest")
    edit(body["files"])
    (path / "manifest.json").write_bytes(manifest_bytes(body))


def drop_optimizer(path) -> None:
    os.unlink(path / "optim_rank0.bin")
    reseal(path, lambda files: files.pop("optim_rank0.bin"))


def drop_index(path) -> None:
    ms = torch.load(path / "model_states.pt", weights_only=True)
    del ms["master_index"]
    torch.save(ms, path / "model_states.pt")
    reseal(
        path, lambda files: files.update({"model_states.pt": digest_file(str(path / "model_states.pt"), 0)})
    )


def truncate(path) -> None:
    os.truncate(path / "optim_rank0.bin", os.path.getsize(path / "optim_rank0.bin") - 4)


def flip_byte(path) -> None:
    with open(path / "optim_rank0.bin", "r+b") as f:  # inside the master: the converter reads it
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.parametrize(
    "damage,error,match",
    [
        (lambda p: shutil.rmtree(p.parent), FileNotFoundError, "directory .* does not exist"),
        (lambda p: os.unlink(p.parent / "latest"), FileNotFoundError, "latest does not exist"),
        (lambda p: os.rename(p, p.parent / "elsewhere"), FileNotFoundError, "global_step3 does not exist"),
        (lambda p: os.unlink(p / "rank0_states.pt"), CheckpointIntegrityError, "rank0_states.pt: missing"),
        (lambda p: os.unlink(p / "manifest.json"), CheckpointError, "no manifest.json"),
        (truncate, CheckpointIntegrityError, "optim_rank0.bin: .* bytes, the manifest records"),
        (flip_byte, CheckpointIntegrityError, "optim_rank0.bin: bytes .* checksums"),
        (drop_optimizer, CheckpointError, "no optim_rank0.bin: this checkpoint holds no optimizer states"),
        (drop_index, CheckpointError, "model_states.pt has no 'master_index'"),
    ],
    ids=[
        "no-dir",
        "no-latest",
        "no-tag",
        "no-rank-file",
        "no-manifest",
        "truncated",
        "corrupted",
        "no-optim",
        "old",
    ],
)
def test_bad_input_names_the_file_and_writes_nothing(tmp_path, ckpt, damage, error, match):
    src = tmp_path / "ckpt"
    shutil.copytree(ckpt[0], src)
    damage(src / "global_step3")
    with pytest.raises(error, match=match):
        convert_zero_checkpoint_to_fp32_state_dict(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert main([str(src), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def _two_ranks(rank: int, world_size: int, nvme: str, out: str):
    results = {}
    for stage, param in ((2, "none"), (3, "nvme")):
        cfg = config(stage, "nvme", nvme, param, bf16=stage == 3)
        results[stage] = train_and_save(os.path.join(out, f"stage{stage}"), cfg)
    return results if rank == 0 else None


def test_two_ranks(tmp_path):
    results, _ = run_on_ranks(_two_ranks, tmp_path)
    for stage in (2, 3):
        master, whole = results[0][stage]
        assert_matches(
            get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / f"stage{stage}")), master, whole
        )
    os.unlink(tmp_path / "stage2" / "global_step3" / "optim_rank1.bin")
    with pytest.raises(CheckpointIntegrityError, match="optim_rank1.bin: missing"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "stage2"))


# ----------------------------------------------------------------------------------- hostile inputs
def longer_index(path) -> None:
    """master_index claims more elements for the last parameter than the master holds (resealed)."""
    ms = torch.load(path / "model_states.pt", weights_only=True)
    ms["master_index"]["params"][-1][1][0] += 3
    torch.save(ms, path / "model_states.pt")
    reseal(
        path, lambda files: files.update({"model_states.pt": digest_file(str(path / "model_states.pt"), 0)})
    )


def test_index_that_does_not_cover_the_output_exactly_exits_2(tmp_path, ckpt, capsys):
    """Outputs are allocated uninitialised and filled where the index says: an index listing more elements
    than the files hold is refused before anything is read or written (not exported as heap garbage)."""
    src = tmp_path / "ckpt"
    shutil.copytree(ckpt[0], src)
    longer_index(src / "global_step3")
    with pytest.raises(CheckpointError, match="does not place every element of .* exactly once"):
        get_fp32_state_dict_from_zero_checkpoint(str(src))
    capsys.readouterr()
    assert main([str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not place every element" in err
    assert not (tmp_path / "out").exists()


def _umask(mask):
    old = os.umask(mask)
    return lambda: os.umask(old)


def test_outputs_never_write_through_a_planted_temporary_and_share_one_mode(tmp_path, ckpt):
    src, master, whole = ckpt
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "w.bin.tmp")  # the fixed temporary name a writer might use
    planted = out / "model.safetensors.tmp"
    planted.write_bytes(b"theirs")
    os.chmod(planted, 0o666)
    if os.geteuid() == 0:
        os.chown(planted, 65534, 65534)  # another user's file, as in a sticky shared directory
    restore = _umask(0o022)
    try:
        assert main([str(src), str(out / "w.bin"), "--no-safetensors"]) == 0
        assert main([str(src), str(out)]) == 0
    finally:
        restore()
    assert victim.read_bytes() == b"keep" and planted.read_bytes() == b"theirs"
    for name in ("w.bin", "model.safetensors"):
        st = os.lstat(out / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644, name
        assert st.st_uid == os.geteuid(), name
    assert_matches(torch.load(out / "w.bin", weights_only=True), master, whole)
    assert_matches(load_file(out / "model.safetensors"), master, whole)
    assert sorted(os.listdir(out)) == ["model.safetensors", "model.safetensors.tmp", "w.bin", "w.bin.tmp"]


def test_earlier_export_is_refused_unless_forced_and_then_replaced(tmp_path, ckpt, capsys):
    """An index written beside an old model.safetensors would load the old weights: refused; --force
    removes exactly the files an export writes (config.json stays)."""
    src, master, whole = ckpt
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main([str(src), str(out)]) == 0  # beside other files of a model directory: fine
    (out / "pytorch_model.bin").write_bytes(b"older still")
    capsys.readouterr()
    assert main([str(src), str(out), "--max-shard-size", "3KB"]) == 2
    assert "earlier export" in capsys.readouterr().err
    with pytest.raises(FileExistsError, match="model.safetensors"):
        convert_zero_checkpoint_to_fp32_state_dict(str(src), str(out), max_shard_size="3KB")
    files = convert_zero_checkpoint_to_fp32_state_dict(str(src), str(out), max_shard_size="3KB", force=True)
    assert sorted(os.listdir(out)) == sorted(["config.json", *map(os.path.basename, files)])
    assert not (out / "model.safetensors").exists() and not (out / "pytorch_model.bin").exists()
    got = {}
    for f in files[:-1]:
        got.update(load_file(f))
    assert_matches({k: got[k] for k in whole}, master, whole)
    assert main([str(src), str(out), "--force"]) == 0  # and back to one file: the shards and index go
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_a_name_with_an_extension_is_a_file(tmp_path, ckpt, capsys):
    src, master, whole = ckpt
    assert main([str(src), str(tmp_path / "out.pt"), "--no-safetensors"]) == 0
    assert (tmp_path / "out.pt").is_file()
    assert_matches(torch.load(tmp_path / "out.pt", weights_only=True), master, whole)
    capsys.readouterr()
    assert main([str(src), str(tmp_path / "other.pt")]) == 2  # safetensors files end in .safetensors
    assert "other.pt" in capsys.readouterr().err and not (tmp_path / "other.pt").exists()
    assert main([str(src), str(tmp_path / "out.pt"), "--no-safetensors"]) == 2  # exists: --force
    assert main([str(src), str(tmp_path / "out.pt"), "--no-safetensors", "--force"]) == 0
