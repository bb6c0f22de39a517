"""zero.from_pretrained with a Hugging Face Hub repository id (zero/inference/hub.py): resolved to its
snapshot in the Hub cache as transformers resolves it. The tests build the cache's layout (refs/<branch>
naming a commit, snapshots/<commit>/ holding the files) and load with `local_files_only=True`, so nothing
reaches the network: the same code path a download ends in."""

from __future__ import annotations

import shutil

import pytest
import torch

import zero

transformers = pytest.importorskip("transformers")

VOCAB = 64
REPO = "zo-test/tiny-llama"


def llama(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def publish(cache, repo, model, ref="main", commit="a" * 40, **save_kwargs):
    """Put `model` into the Hub cache `cache` as `repo` at `ref` (a branch or tag naming `commit`)."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    model.save_pretrained(repo_dir / "snapshots" / commit, **save_kwargs)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)
    return repo_dir / "snapshots" / commit


def config(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    off = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": off}}


def generate(model, ids):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
    )


def prompt():
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))


def test_repository_id_loads_its_snapshot_like_transformers(tmp_path):
    """A sharded checkpoint under a repository id, two revisions: each loads the weights transformers
    loads for it (greedy tokens and logits identical)."""
    cache = tmp_path / "hub"
    publish(cache, REPO, llama(0), max_shard_size=20_000)
    publish(cache, REPO, llama(1), ref="v2", commit="b" * 40)
    hub = {"cache_dir": str(cache), "local_files_only": True}
    ids = prompt()
    for revision in ("main", "v2"):
        engine = zero.from_pretrained(REPO, config=config(tmp_path), revision=revision, **hub)
        ref = transformers.AutoModelForCausalLM.from_pretrained(REPO, revision=revision, **hub).eval()
        with torch.no_grad():
            assert torch.equal(engine.module(ids).logits, ref(ids).logits)
            assert torch.equal(generate(engine.module, ids), generate(ref, ids))
        assert engine.load_report.files == (6 if revision == "main" else 1)  # the shards of that revision
        engine.close()


def test_hub_errors_name_the_repository(tmp_path):
    cache = tmp_path / "hub"
    hub = {"cache_dir": str(cache), "local_files_only": True}
    with pytest.raises(FileNotFoundError, match="zo-test/absent.*Hub snapshot could not be had") as e:
        zero.from_pretrained("zo-test/absent", config=config(tmp_path), **hub)
    assert e.value.filename == "zo-test/absent"
    with pytest.raises(FileNotFoundError, match="local checkpoint directory or a Hugging Face Hub"):
        zero.from_pretrained("not a repo", config=config(tmp_path))
    local = tmp_path / "local"
    llama(0).save_pretrained(local)
    with pytest.raises(ValueError, match="revision applies to a Hub repository id"):
        zero.from_pretrained(local, config=config(tmp_path), revision="main")
    # a repository with pickled weights only: they are not read
    snap = publish(cache, "zo-test/bin-only", llama(0))
    for f in snap.glob("*.safetensors"):
        f.unlink()
    torch.save(llama(0).state_dict(), snap / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="only safetensors checkpoints are read"):
        zero.from_pretrained("zo-test/bin-only", config=config(tmp_path), **hub)
    shutil.rmtree(tmp_path / "nvme")


@pytest.mark.parametrize(
    "name, why",
    [
        ("./org/model", "it starts like a path"),
        ("/no/such/model", "it starts like a path"),
        ("~/model", "it starts like a path"),
        ("../model", "it starts like a path"),
        ("models/org/model", "it has more path separators"),
        ("present/model", "'present' exists here, so it is a path inside it"),
        ("afile", "it exists here but is not a directory"),
        ("PATHOBJ", "it is a PosixPath"),
    ],
)
def test_a_missing_path_is_never_fetched_from_the_hub(tmp_path, monkeypatch, name, why):
    """A name that looks like a path is a local path: missing, it is an error naming it, and the Hub is
    not asked (snapshot_download is replaced by a recorder); an id like 'org/model' is still fetched."""
    import huggingface_hub

    asked = []

    def snapshot_download(repo_id, **kwargs):
        asked.append(repo_id)
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "present").mkdir()
    (tmp_path / "afile").write_text("")
    arg = type(tmp_path)("org/model") if name == "PATHOBJ" else name  # a Path, shaped like an id
    with pytest.raises(FileNotFoundError, match=f"not a Hugging Face Hub repository id: {why}") as e:
        zero.from_pretrained(arg, config=config(tmp_path))
    assert e.value.filename == str(arg)
    assert asked == []
    with pytest.raises(FileNotFoundError, match="Hub snapshot could not be had"):
        zero.from_pretrained("org2/model", config=config(tmp_path))
    assert asked == ["org2/model"]
