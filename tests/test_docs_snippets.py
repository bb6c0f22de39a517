"""Every ```python block of README.md and docs/*.md runs as written.

The rule: each block is a standalone program. It runs on its own, in a fresh Python process whose working
directory is a new, empty temporary directory, with this checkout first on the import path and no network
(Hugging Face offline). A block does not build on the blocks before it on its page: it has its own imports and
makes what it uses (a tiny model from a config, its data, its files), so a reader can paste any one block and
run it. Relative paths in a block land in its scratch directory; /tmp paths are fine for scratch space.

Blocks not meant to run (pseudo-code, signatures, output, shell) are fenced ```text / ```bash instead (every
fence names its language, so none hides a Python example). A block
under `<!-- doc-test: slow -->` (tests/doc_blocks.py) runs only in the `-m slow` run; every block runs in one
of the two.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.doc_blocks import REPO, Block, blocks, pages, python_blocks

TIMEOUT_S = 600


def _params():
    out = []
    for block in python_blocks():
        marks = [pytest.mark.slow] if block.directive("doc-test") == "slow" else []
        out.append(pytest.param(block, id=block.id, marks=marks))
    return out


def run_block(block: Block, cwd: str) -> subprocess.CompletedProcess:
    """Run `block` as a script in `cwd` (its own process, this checkout importable, no network)."""
    script = os.path.join(cwd, "snippet.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(block.text)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONHASHSEED="0")
    return subprocess.run(
        [sys.executable, script], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def test_blocks_are_found():
    ids = [b.id for b in python_blocks()]
    assert any(i.startswith("README.md:") for i in ids), "README.md has no Python block"
    assert len(ids) == len(set(ids))


def test_every_block_names_its_language():
    """A bare ``` fence hides whether its text is meant to run: Python is ```python (and runs here), the rest
    ```text, ```bash, ```json..."""
    bare = [b.id for p in pages() for b in blocks(p) if not b.lang]
    assert bare == [], f"fences without a language: {bare}"


@pytest.mark.parametrize("block", _params())
def test_doc_python_block_runs(block: Block, tmp_path):
    run = run_block(block, str(tmp_path))
    assert run.returncode == 0, f"{block.id} failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
