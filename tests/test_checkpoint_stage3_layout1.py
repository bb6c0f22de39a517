"""A real stage-3 checkpoint of the older partition layout (tests/data/stage3_layout1: two ranks, each
module's parameters back to back cut into one range per rank; tests/layout1_helpers.py wrote it):
zero-to-fp32 still reads it, to the weights the two ranks held at the save, bit for bit; the engine refuses
to load it, naming the layout and zero-to-fp32, before changing anything; and the weights zero-to-fp32
gives load into a model an engine then trains from."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from layout1_helpers import LAYOUT1_DIR, LAYOUT1_TAG, LAYOUT1_WORLD, layout1_config, layout1_model
from safetensors.torch import load_file

import zero
from zero.checkpoint.to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from zero.cli_to_fp32 import main


@pytest.fixture
def ckpt(tmp_path):
    """A copy of the checkpoint (the repository's files stay untouched) and its expected weights."""
    shutil.copytree(LAYOUT1_DIR, tmp_path / "data")
    return tmp_path / "data" / "ckpt", load_file(tmp_path / "data" / "expected.safetensors")


def assert_equal(got, want) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def test_the_fixture_is_a_two_rank_checkpoint_of_the_older_layout(ckpt):
    path, want = ckpt
    manifest = json.loads((path / LAYOUT1_TAG / "manifest.json").read_text())
    assert (manifest["stage"], manifest["world_size"]) == (3, LAYOUT1_WORLD)
    assert "stage3_layout" not in manifest  # written before the key: layout 1
    assert {k: v.numel() for k, v in want.items() if k.startswith("odd.")} == {
        "odd.a": 7,
        "odd.b": 10,
        "odd.c": 33,
        "odd.f": 5,
    }
    start = layout1_model().state_dict()
    assert not torch.equal(want["odd.c"], start["odd.c"])  # trained
    assert torch.equal(want["odd.f"], start["odd.f"])  # frozen


def test_zero_to_fp32_reads_it_to_the_weights_at_the_save(ckpt, tmp_path):
    path, want = ckpt
    assert_equal(get_fp32_state_dict_from_zero_checkpoint(str(path)), want)
    files = convert_zero_checkpoint_to_fp32_state_dict(str(path), str(tmp_path / "api"), tag=LAYOUT1_TAG)
    assert files == [str(tmp_path / "api" / "model.safetensors")]
    assert_equal(load_file(files[0]), want)
    assert main([str(path), str(tmp_path / "cli.safetensors")]) == 0
    assert_equal(load_file(tmp_path / "cli.safetensors"), want)
    trained = get_fp32_state_dict_from_zero_checkpoint(str(path), exclude_frozen_parameters=True)
    assert_equal(trained, {k: v for k, v in want.items() if k != "odd.f"})


def test_the_engine_refuses_it_unchanged_and_loads_the_converted_weights(ckpt):
    path, want = ckpt
    engine, *_ = zero.initialize(model=layout1_model(), config=layout1_config())
    try:
        before = zero.consolidated_state_dict(engine)
        with pytest.raises(ValueError, match="stage-3 partition layout 1 .*zero-to-fp32"):
            engine.load_checkpoint(str(path))
        assert_equal(zero.consolidated_state_dict(engine), before)
        assert engine.global_steps == 0
    finally:
        engine.close()
    model = load_state_dict_from_zero_checkpoint(layout1_model(), str(path))  # what the error advises
    engine, *_ = zero.initialize(model=model, config=layout1_config())
    try:
        assert_equal(zero.consolidated_state_dict(engine), want)
        loss = engine(torch.randn(4, 7, generator=torch.Generator().manual_seed(5)))
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss) and engine.global_steps == 1
    finally:
        engine.close()
