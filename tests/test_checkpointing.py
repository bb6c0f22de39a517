"""zero.checkpointing: torch.utils.checkpoint's results bit for bit, with block inputs in place, on the host
or on NVMe; DeepSpeed's API; apply(); the engine's activation_checkpointing section; bad input."""

from __future__ import annotations

import copy
import errno
import logging
import os
import shutil
import stat
import tempfile

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import zero
import zero.checkpointing as zc
from offload.config import ConfigError, load_config
from tests.aio_helpers import run_child
from zero.activations.apply import applied_blocks

D = 64


class Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    """A stack of blocks; `ckpt` (function, tensor) -> tensor checkpoints each block, or None."""

    def __init__(self, n: int = 6, d: int = D) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)
        self.ckpt = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if self.ckpt is None else self.ckpt(block, h)
        return self.head(h).square().mean()


def torch_ckpt(fn, *args):
    return torch_checkpoint(fn, *args, use_reentrant=False)


@pytest.fixture(autouse=True)
def unconfigured():
    zc.close()
    yield
    zc.close()


def grads(model: nn.Module):
    return [p.grad for p in model.parameters()]


def run(model: nn.Module, x: torch.Tensor, seed: int = 7):
    torch.manual_seed(seed)  # dropout
    loss = model(x)
    loss.backward()
    return loss.detach(), grads(model), torch.rand(3)  # the RNG state after the step, too


def section(kind: str, tmp_path, **extra):
    s = {"offload_device": kind, **extra}
    if kind == "nvme":
        s["nvme_path"] = str(tmp_path)
    return {"activation_checkpointing": s}


TIERS = [
    ("none", {}),
    ("none", {"contiguous_memory_optimization": True, "number_checkpoints": 6}),
    ("cpu", {}),
    ("cpu", {"contiguous_memory_optimization": True, "number_checkpoints": 6}),
    ("nvme", {}),
    ("nvme", {"contiguous_memory_optimization": True, "number_checkpoints": 6}),
]


@pytest.mark.parametrize("kind,extra", TIERS, ids=[f"{k}{'-contig' if e else ''}" for k, e in TIERS])
def test_bit_identical_to_torch_checkpoint(kind, extra, tmp_path, device):
    torch.manual_seed(0)
    ref = Stack().to(device)
    ours = copy.deepcopy(ref)
    x = torch.randn(4, 64, D, device=device)
    ref.ckpt = torch_ckpt
    want = run(ref, x)
    zc.configure(deepspeed_config=section(kind, tmp_path, **extra))
    ours.ckpt = zc.checkpoint
    got = run(ours, x)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert torch.equal(got[2], want[2])  # dropout's RNG replayed without disturbing the stream
    rep = zc.take_report()
    assert rep.checkpoints == 6
    block_bytes = x.numel() * 4
    # "none" without preallocated buffers keeps every input where it is (no hooks); "cpu" moves on a GPU
    moves = kind == "nvme" or extra or (kind == "cpu" and device.type != "cpu")
    if moves:  # every block's input was stashed; all but the last went away and came back
        assert rep.saved_inputs == 6 and rep.saved_bytes == 6 * block_bytes
        assert rep.restored_bytes == 5 * block_bytes
        assert rep.prefetches >= (4 if kind != "none" and (kind == "nvme" or device.type != "cpu") else 0)
    if kind == "none" and not extra:
        assert rep.saved_inputs == 0
    if kind == "nvme":
        assert rep.nvme_write_bytes >= 5 * block_bytes and rep.nvme_read_bytes >= 5 * block_bytes
        assert rep.peak_resident_bytes <= 2 * block_bytes  # the rest waited on NVMe
        assert zc.current().scratch_files == []  # removed once the backward released the pass


def test_reentrant_checkpoint_is_stashed_too(tmp_path):
    """use_reentrant=True saves the inputs with save_for_backward: the same hooks move them."""
    torch.manual_seed(0)
    ref = Stack()
    ours = copy.deepcopy(ref)
    x = torch.randn(4, 64, D)
    ref.ckpt = lambda f, a: torch_checkpoint(f, a, use_reentrant=True)
    want = run(ref, x)
    zc.configure(deepspeed_config=section("nvme", tmp_path))
    ours.ckpt = lambda f, a: zc.checkpoint(f, a, use_reentrant=True)
    got = run(ours, x)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert zc.take_report().nvme_read_bytes == 5 * x.numel() * 4


def test_no_grad_never_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(2, 16, D)
    model.eval()
    plain = model(x)
    zc.configure(deepspeed_config=section("nvme", tmp_path))
    model.ckpt = zc.checkpoint
    with torch.no_grad():
        out = model(x)
    assert torch.equal(out, plain)
    rep = zc.take_report()
    assert rep.checkpoints == 0 and rep.saved_inputs == 0 and rep.nvme_write_bytes == 0


def test_hf_gpt2_gradient_checkpointing_is_bit_identical(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=128, n_layer=4, n_head=4, n_positions=128, vocab_size=128)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg)
    ours = copy.deepcopy(ref)
    ref.train()
    ours.train()
    # torch's checkpoint through Hugging Face's own switch (activation_checkpointing_enable since 5.x)
    enable = getattr(ref, "activation_checkpointing_enable", None) or ref.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    zc.configure(deepspeed_config=section("nvme", tmp_path))
    names = zc.apply(ours)
    assert names == [f"transformer.h.{i}" for i in range(4)]
    ids = torch.randint(0, 128, (2, 96))  # hidden states of 96 KiB: above MIN_OFFLOAD_BYTES

    def step(m):
        torch.manual_seed(3)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach()

    assert torch.equal(step(ours), step(ref))
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), name
    rep = zc.take_report()
    assert rep.checkpoints == 4 and rep.nvme_write_bytes > 0 and rep.restored_bytes > 0


def test_apply_wraps_the_longest_modulelist_and_keeps_names(tmp_path):
    torch.manual_seed(0)
    model = Stack(n=5)
    model.extra = nn.ModuleList([nn.Linear(D, D), nn.ReLU()])  # mixed classes: never chosen
    keys = list(model.state_dict())
    assert zc.apply(model) == [f"blocks.{i}" for i in range(5)]
    assert zc.apply(model) == [f"blocks.{i}" for i in range(5)]  # again: nothing wrapped twice
    assert list(model.state_dict()) == keys
    ref = copy.deepcopy(model)  # a deep copy carries its own wrapped forwards
    zc.configure(deepspeed_config=section("nvme", tmp_path))
    x = torch.randn(2, 32, D)
    torch.manual_seed(1)
    model(x).backward()
    assert zc.take_report().checkpoints == 5
    torch.manual_seed(1)
    ref(x).backward()
    assert zc.take_report().checkpoints == 5
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        if not name.startswith("extra."):  # unused
            assert torch.equal(a.grad, b.grad), name  # a copy's blocks feed its own parameters' grads


def test_apply_with_block_types_and_without_a_modulelist():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Block()
            self.inner = nn.Sequential(Block(), nn.Linear(D, D))

        def forward(self, x):
            return self.inner(self.a(x))

    net = Net()
    with pytest.raises(ValueError, match="block_types"):
        zc.apply(net)
    assert zc.apply(net, Block) == ["a", "inner.0"]
    with pytest.raises(TypeError, match="block_types"):
        zc.apply(net, [3])


def test_block_hooks_run_once_in_forward_and_once_in_the_recompute():
    model = Stack(n=3)
    calls = []
    model.blocks[1].register_forward_pre_hook(lambda m, a: calls.append("pre"))
    zc.apply(model)
    model(torch.randn(2, 8, D)).backward()
    assert calls == ["pre", "pre"]  # the forward, then the recompute in backward


def test_inplace_change_of_a_stashed_input_raises(tmp_path):
    zc.configure(deepspeed_config=section("nvme", tmp_path))
    blocks = [Block() for _ in range(3)]
    x = torch.randn(4, 64, D)
    h1 = zc.checkpoint(blocks[0], x)
    h2 = zc.checkpoint(blocks[1], h1)
    h1.add_(1.0)  # block 1's saved input changed after its forward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        zc.checkpoint(blocks[2], h2)  # block 1's input goes to NVMe now, and is checked first


def test_configure_api(tmp_path):
    assert not zc.is_configured()
    c = zc.configure(None, deepspeed_config=None, checkpoint_in_cpu=True, profile=True)
    assert zc.is_configured() and zc.current() is c
    assert c.config.offload_device == "cpu" and c.config.cpu_checkpointing and c.config.profile
    # arguments override the section, as in DeepSpeed
    c = zc.configure(
        deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}},
        checkpoint_in_cpu=False,
        contiguous_checkpointing=True,
        num_checkpoints=2,
    )
    assert c.config.offload_device == "none" and c.config.contiguous_memory_optimization
    with pytest.raises(ValueError, match="num_checkpoints"):
        zc.configure(contiguous_checkpointing=True)

    class MPU:
        def get_model_parallel_world_size(self):
            return 2

    with pytest.raises(NotImplementedError, match="partition_activations"):
        zc.configure(MPU(), partition_activations=True)
    zc.configure(None, partition_activations=True)  # one model-parallel rank: nothing to split
    zc.reset()  # DeepSpeed's reset: a new pass, configuration kept
    assert zc.is_configured()
    zc.close()
    assert not zc.is_configured()


def test_contiguous_buffers_too_few_raise_naming_the_key():
    zc.configure(contiguous_checkpointing=True, num_checkpoints=2)
    model = Stack(n=4)
    model.ckpt = zc.checkpoint
    with pytest.raises(zc.CheckpointBufferError, match="number_checkpoints"):
        model(torch.randn(4, 64, D))  # 64 KiB block inputs: stashed


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="'activation_checkpointing' section"):
        load_config({"checkpoint_activations": True})
    with pytest.raises(ConfigError, match="number_checkpoints"):
        load_config({"activation_checkpointing": {"contiguous_memory_optimization": True}})
    with pytest.raises(ConfigError, match="nvme_path"):
        load_config({"activation_checkpointing": {"offload_device": "nvme"}})
    with pytest.raises(ConfigError, match="cpu_checkpointing"):
        load_config({"activation_checkpointing": {"cpu_checkpointing": True, "offload_device": "none"}})
    with pytest.raises(ConfigError, match="offload_device"):
        load_config({"activation_checkpointing": {"offload_device": "disk"}})
    cfg = load_config({"activation_checkpointing": {"cpu_checkpointing": True}})
    assert cfg.activation_checkpointing.offload_device == "cpu"


def test_bad_nvme_path_fails_at_configure(tmp_path):
    with pytest.raises(OSError, match="does not exist") as e:
        zc.configure(deepspeed_config=section("nvme", tmp_path / "missing"))
    assert str(tmp_path / "missing") in str(e.value)
    afile = tmp_path / "f"
    afile.write_text("")
    with pytest.raises(OSError, match="not a directory"):
        zc.configure(
            deepspeed_config={"activation_checkpointing": {"offload_device": "nvme", "nvme_path": str(afile)}}
        )


def test_unwritable_nvme_path_fails_at_initialize():
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user cannot write, then drop privileges")
    top = tempfile.mkdtemp(prefix="zo-act-perm-", dir="/var/tmp")
    try:
        os.chmod(top, 0o755)  # readable and searchable by nobody, writable only by root
        result = run_child(
            f"""
            import os, torch, zero
            warm = {{"optimizer": {{"type": "AdamW"}}}}
            zero.initialize(model=torch.nn.Linear(4, 4), config=warm)  # every import, as root
            os.setgid(65534)
            os.setuid(65534)
            cfg = {{"optimizer": {{"type": "AdamW", "params": {{}}}},
                   "activation_checkpointing": {{"offload_device": "nvme", "nvme_path": {top!r}}}}}
            zero.initialize(model=torch.nn.Linear(4, 4), config=cfg)
            result = {{"raised": None}}
            """
        )
    finally:
        shutil.rmtree(top)
    assert result["exc"] == "SwapSpaceError" and result["errno"] == errno.EACCES, result
    assert top in result["str"] and "not writable" in result["str"]


def test_disk_too_small_fails_in_the_first_forward_naming_the_file(tmp_path):
    # the file-size limit stands in for a full disk: the scratch file cannot grow to one step's checkpoints
    result = run_child(
        f"""
        import resource, signal, torch
        import zero.checkpointing as zc
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        zc.configure(deepspeed_config={{"activation_checkpointing": {{"offload_device": "nvme",
                                                                     "nvme_path": {str(tmp_path)!r}}}}})
        x = torch.randn(1024, 256, requires_grad=True)
        layers = [torch.nn.Linear(256, 256) for _ in range(4)]
        for layer in layers:
            x = zc.checkpoint(layer, x)
        result = {{"raised": None}}
        """
    )
    assert result["exc"] == "SwapSpaceError", result
    assert result["errno"] == errno.EFBIG
    assert "pass-0.bin" in result["filename"] and "bytes" in result["str"]


def test_io_error_mid_step_raises_and_the_next_pass_uses_a_new_file(tmp_path):
    c = zc.configure(deepspeed_config=section("nvme", tmp_path, synchronize_checkpoint_boundary=True))
    torch.manual_seed(0)
    model = Stack(n=4)
    model.ckpt = zc.checkpoint
    x = torch.randn(4, 64, D)
    loss = model(x)  # synchronize_checkpoint_boundary: the writes are done when the forward returns
    (scratch,) = c.scratch_files
    mode = os.stat(scratch).st_mode
    assert stat.S_IMODE(mode) == 0o600 and stat.S_IMODE(os.stat(os.path.dirname(scratch)).st_mode) == 0o700
    os.truncate(scratch, 0)  # the checkpoints are gone from under the pass
    with pytest.raises(RuntimeError, match="pass-0.bin") as e:
        loss.backward()
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno is not None
    del loss, e
    assert c.scratch_files == []  # the failed pass's file is removed, never read again
    model.zero_grad()
    ref = copy.deepcopy(model)
    ref.ckpt = torch_ckpt
    got, want = run(model, x), run(ref, x)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert c.scratch_files == []


def test_engine_configures_from_its_config_and_reports(tmp_path, caplog):
    torch.manual_seed(0)
    model = Stack(n=4)
    ref = copy.deepcopy(model)
    zc.apply(model)
    base = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
            "stage3_param_persistence_threshold": 0,  # every layer partitioned and read from NVMe
        },
    }
    cfg = dict(
        base, activation_checkpointing={"offload_device": "nvme", "nvme_path": str(tmp_path), "profile": True}
    )
    engine, *_ = zero.initialize(model=model, config=cfg)
    assert zc.is_configured() and zc.current().config.offload_device == "nvme"
    ref.ckpt = torch_ckpt
    ref_engine, *_ = zero.initialize(model=ref, config=base)  # stage 3 NVMe params, torch's checkpoint
    xs = [torch.randn(4, 64, D) for _ in range(4)]
    for x in xs:  # two optimizer steps of two micro-batches
        for e in (engine, ref_engine):
            torch.manual_seed(5)
            loss = e(x)
            e.backward(loss)
            e.step()
    rep = engine.last_report.activations
    assert rep["checkpoints"] == 2 * 4 and rep["nvme_write_bytes"] > 0 and rep["restore_wait_s"] > 0
    # the recompute's gathers follow the same trace as with torch's checkpoint: prefetch is not confused
    waits = {"param_read_wait_s": 0.0, "param_write_wait_s": 0.0}  # every count, not the time spent waiting
    io = dict(engine.last_param_io, **waits)
    assert io == dict(ref_engine.last_param_io, **waits)
    assert io["gathers"] > 0 and io["param_nvme_read_bytes"] > 0
    ours = engine.consolidated_state_dict()
    theirs = ref_engine.consolidated_state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    act_dirs = [d for d in os.listdir(tmp_path) if d.startswith("zero-offload-act-")]
    assert len(act_dirs) == 1
    engine.close()
    ref_engine.close()
    assert not zc.is_configured()
    assert not any(d.startswith("zero-offload-act-") for d in os.listdir(tmp_path))  # swap space removed


def test_engine_warns_when_its_section_checkpoints_nothing(tmp_path, caplog):
    model = Stack(n=2)  # blocks never checkpointed
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "activation_checkpointing": {"cpu_checkpointing": True},
    }
    engine, *_ = zero.initialize(model=model, config=cfg)
    with caplog.at_level(logging.WARNING, logger="zero"):
        loss = engine(torch.randn(1, 4, D))
        engine.backward(loss)
        engine.step()
    warned = [r.getMessage() for r in caplog.records if "checkpointed no block" in r.getMessage()]
    assert len(warned) == 1 and "call zero.checkpointing.apply(model)" in warned[0]
    assert engine.last_report.activations == {}
    engine.close()


def test_engine_warning_names_eval_mode_of_an_applied_hf_model(tmp_path, caplog):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=64)
    section = {"activation_checkpointing": {"cpu_checkpointing": True}}
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    ids = torch.randint(0, 64, (2, 16))
    for training in (False, True):
        model = transformers.GPT2LMHeadModel(cfg).train(training)  # from_pretrained's models are in eval mode
        assert zc.apply(model) == applied_blocks(model)
        engine, *_ = zero.initialize(model=model, config={**base, **section})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zero"):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        warned = [r.getMessage() for r in caplog.records if "checkpointed no block" in r.getMessage()]
        if training:
            assert warned == [] and engine.last_report.activations["checkpoints"] == 2
        else:
            assert len(warned) == 1 and "eval mode" in warned[0] and "model.train()" in warned[0]
            assert "call zero.activations.apply" not in warned[0]  # it was called
        engine.close()


def test_estimator_checkpoint_rows_match_what_the_stash_moved(tmp_path):
    from offload.estimate.activations import RESIDENT_CHECKPOINTS, ActivationSettings, activation_placement

    layers, batch, seq = 6, 4, 64
    act = ActivationSettings(batch, seq, D, layers, checkpointing=True, checkpoint_device="nvme")
    place = activation_placement(act, element_bytes=4)
    zc.configure(deepspeed_config=section("nvme", tmp_path))
    model = Stack(n=layers)
    model.ckpt = zc.checkpoint
    model(torch.randn(batch, seq, D)).backward()
    rep = zc.take_report()
    assert rep.nvme_write_bytes == place["nvme_write"] == place["nvme"]
    assert rep.nvme_read_bytes == place["nvme_read"]
    assert rep.peak_resident_bytes <= RESIDENT_CHECKPOINTS * batch * seq * D * 4


def test_a_checkpoint_larger_than_the_preallocated_buffers_raises_naming_the_key():
    zc.configure(contiguous_checkpointing=True, num_checkpoints=4)
    blocks = [Block() for _ in range(3)]
    h = zc.checkpoint(blocks[0], torch.randn(4, 64, D))  # the buffers are sized for this first input
    h = zc.checkpoint(blocks[1], torch.cat([h, h]))  # twice as large
    with pytest.raises(zc.CheckpointBufferError, match="contiguous_memory_optimization"):
        zc.checkpoint(blocks[2], h)  # block 1's input goes into a buffer now


def test_apply_with_block_types_that_match_nothing():
    with pytest.raises(ValueError, match="no submodule of type"):
        zc.apply(Stack(n=2), nn.LSTM)
