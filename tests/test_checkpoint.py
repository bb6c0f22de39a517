"""Checkpoints: bit-identical resume for every offload device (and across devices), crash-safe saves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from checkpoint_helpers import config, new_engine, params_of, run

import zero
from zero.checkpoint import CRASH_ENV
from zero.examples.models import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "save_dev,load_dev,fp16",
    [
        ("none", "none", False),
        ("cpu", "cpu", False),
        ("nvme", "nvme", False),
        ("nvme", "cpu", False),
        ("none", "nvme", False),
        ("cpu", "nvme", True),
    ],
)
def test_resume_is_bit_identical(tmp_path, save_dev, load_dev, fp16):
    ckpt = tmp_path / "ckpt"
    torch.manual_seed(1234)
    full = new_engine(save_dev, tmp_path, fp16=fp16)
    torch.manual_seed(1234)
    want = run(full, 0, 6)
    want_params = params_of(full)
    want_lr = full.get_lr()
    full.close()

    first = new_engine(save_dev, tmp_path, fp16=fp16)
    torch.manual_seed(1234)
    assert run(first, 0, 3) == want[:3]
    path = first.save_checkpoint(str(ckpt), client_state={"epoch": 7})
    assert os.path.basename(path) == "global_step3"
    first.close()

    resumed = new_engine(load_dev, tmp_path, seed=99, fp16=fp16)  # different init and RNG: all must load
    torch.manual_seed(4321)
    got_path, client = resumed.load_checkpoint(str(ckpt))
    assert got_path == path and client == {"epoch": 7}
    assert resumed.global_steps == 3 and resumed.optimizer.step_count == 3 - resumed.skipped_steps
    got = run(resumed, 3, 3)
    assert got == want[3:]  # exact float equality
    for a, b in zip(params_of(resumed), want_params):
        assert torch.equal(a, b)
    assert resumed.get_lr() == want_lr
    resumed.close()
    assert sorted(os.listdir(ckpt)) == ["global_step3", "latest"]
    assert sorted(os.listdir(ckpt / "global_step3")) == [
        "manifest.json",
        "model_states.pt",
        "optim_rank0.bin",
        "rank0_states.pt",
    ]


def test_no_latest_returns_none(tmp_path):
    engine = new_engine("none", tmp_path)
    with pytest.warns(UserWarning, match="latest"):
        assert engine.load_checkpoint(str(tmp_path / "empty")) == (None, None)
    with pytest.raises(FileNotFoundError):
        engine.load_checkpoint(str(tmp_path), tag="nope")
    with pytest.raises(ValueError, match="tag"):
        engine.save_checkpoint(str(tmp_path), tag="../x")
    engine.close()


def test_mismatched_model_is_rejected(tmp_path):
    engine = new_engine("cpu", tmp_path)
    engine.save_checkpoint(str(tmp_path / "c"), tag="t")
    engine.close()
    torch.manual_seed(0)
    other, *_ = zero.initialize(
        model=GPT(GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=32)),
        config=config("cpu", tmp_path),
    )
    with pytest.raises(ValueError, match="trainable elements"):
        other.load_checkpoint(str(tmp_path / "c"))
    other.close()


_CHILD = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from checkpoint_helpers import new_engine, run
    ckpt, nvme, second_tag = sys.argv[1], sys.argv[2], sys.argv[3]
    engine = new_engine("nvme", nvme)
    run(engine, 0, 2)
    engine.save_checkpoint(ckpt, tag="good")
    torch.save({{"params": [p.detach().clone() for p in engine.module.parameters()],
                "state": engine.optimizer.state_dict()}}, os.path.join(nvme, "expected.pt"))
    run(engine, 2, 1)
    os.environ[{env!r}] = sys.argv[4]
    engine.save_checkpoint(ckpt, tag=second_tag)
    print("save finished: the crash hook did not fire")
    """
)


@pytest.mark.parametrize(
    "point,second_tag",
    [
        ("after_optimizer", "next"),
        ("after_model", "next"),
        ("before_latest", "next"),
        ("after_move_aside", "good"),
    ],
)
def test_killed_during_save_leaves_previous_checkpoint(tmp_path, point, second_tag):
    ckpt, nvme = tmp_path / "ckpt", tmp_path / "nvme"
    nvme.mkdir()
    code = _CHILD.format(tests=os.path.join(REPO, "tests"), env=CRASH_ENV)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ckpt), str(nvme), second_tag, point],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    expected = torch.load(nvme / "expected.pt", weights_only=False)
    engine = new_engine("cpu", tmp_path, seed=5)
    path, _ = engine.load_checkpoint(str(ckpt))
    assert path is not None and os.path.basename(path) in ("good", ".good.old")
    assert engine.global_steps == 2
    for a, b in zip(params_of(engine), expected["params"]):
        assert torch.equal(a, b)
    state = engine.optimizer.state_dict()
    assert state["step"] == 2 and torch.equal(state["master"], expected["state"]["master"])
    assert all(torch.equal(a, b) for a, b in zip(state["states"], expected["state"]["states"]))
    engine.close()
    # The killed process's swap directory is gone only if it exited normally; SIGKILL leaves it behind.
    leftovers = [d for d in os.listdir(nvme) if d.startswith("zero-offload-")]
    assert len(leftovers) <= 1
