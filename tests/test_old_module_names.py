"""Module names earlier releases documented keep importing after the packages moved: `zero.models` (with a
DeprecationWarning, the same objects as zero.examples.models) and `python -m zero.demo`."""

import importlib
import subprocess
import sys

import pytest


def test_zero_models_warns_and_gives_the_same_objects() -> None:
    sys.modules.pop("zero.models", None)
    with pytest.warns(DeprecationWarning, match="zero.examples.models"):
        old = importlib.import_module("zero.models")
    new = importlib.import_module("zero.examples.models")
    assert (old.GPT, old.GPTConfig, old.get_batch) == (new.GPT, new.GPTConfig, new.get_batch)


def test_python_m_zero_demo_still_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "zero.demo", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "zero.examples.demo" in out.stdout
