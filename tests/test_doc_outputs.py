"""The example outputs in the docs are what the tools print today.

Each block under `<!-- output: COMMAND -->` (tests/doc_blocks.py) must equal `$ COMMAND` and COMMAND's
output, run as scripts/regen_doc_outputs.py runs it (which rewrites the blocks: run it after changing what a
tool prints).
"""

from __future__ import annotations

import os

import pytest

from scripts import regen_doc_outputs as regen
from tests.doc_blocks import REPO, Block, blocks, pages


def _output_blocks():
    return [pytest.param(b, cmd, id=b.id) for p in pages() for b, cmd in regen.output_blocks(p)]


def test_the_estimator_examples_are_marked():
    marked = [b.id for p in pages() for b, _ in regen.output_blocks(p)]
    assert sum(i.startswith("docs/estimator.md:") for i in marked) >= 2, marked
    assert any(i.startswith("docs/engine.md:") for i in marked), marked  # zero-to-fp32 --help


@pytest.mark.parametrize("block, command", _output_blocks())
def test_output_block_is_what_the_tool_prints(block: Block, command: str):
    files = regen.page_files(blocks(block.page))
    want = regen.expected_text(command, files)
    assert block.text == want, (
        f"{block.id} differs from what `{command}` prints today: run scripts/regen_doc_outputs.py"
    )


def test_regenerating_rewrites_a_stale_block_and_is_idempotent():
    page = "docs/estimator.md"
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        text = f.read()
    row = "stage=1, offload_optimizer=cpu, offload_param=none"
    stale = text.replace(row, "stage=1, offload_optimizer=cpu", 1)
    assert stale != text
    fixed, changed = regen.regenerate(page, stale)
    assert fixed == text and len(changed) == 1  # the page as committed is what regenerating gives
    assert regen.regenerate(page, fixed) == (text, [])
