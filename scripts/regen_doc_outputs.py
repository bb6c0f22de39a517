#!/usr/bin/env python
"""Rewrite the example outputs in README.md and docs/*.md from the tools that print them.

A block under `<!-- output: COMMAND -->` becomes `$ COMMAND` followed by what COMMAND prints today (its
stdout). COMMAND is one of the installed tools (ds-estimate-memory, ds-nvme-bench, zero-to-fp32), run from
this checkout with `python -m`, in a scratch directory holding the page's `<!-- file: NAME -->` blocks
(a machine profile, a config), with a fixed terminal width: anything a tool would read from the machine is
given by flags or those files, so the output is the same on every machine. A command may span lines with
a trailing backslash, as in a shell. See tests/doc_blocks.py for the markers.

    python scripts/regen_doc_outputs.py           # rewrite the pages in place (idempotent)
    python scripts/regen_doc_outputs.py --check   # exit 1 naming the blocks that differ; change nothing

tests/test_doc_outputs.py runs the same commands and checks the pages equal their output.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests.doc_blocks import Block, blocks, pages  # noqa: E402

TOOLS: Dict[str, List[str]] = {
    "ds-estimate-memory": ["-m", "offload.cli.estimate_memory"],
    "ds-nvme-bench": ["-m", "offload.cli.nvme_bench"],
    "zero-to-fp32": ["-m", "zero.checkpoint.to_fp32"],
}
COLUMNS = "110"  # argparse wraps help text to the terminal width


def argv_of(command: str) -> List[str]:
    """The command line of an output marker as an argv for this checkout's Python."""
    words = shlex.split(command.replace("\\\n", " "))
    if not words or words[0] not in TOOLS:
        raise ValueError(f"output marker {command!r}: the command must start with one of {sorted(TOOLS)}")
    return [sys.executable, *TOOLS[words[0]], *words[1:]]


def page_files(page_blocks: List[Block]) -> Dict[str, str]:
    """The page's `<!-- file: NAME -->` blocks: NAME -> text."""
    files: Dict[str, str] = {}
    for b in page_blocks:
        for name in b.directives.get("file", []):
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise ValueError(f"{b.id}: file marker {name!r} must be a plain file name")
            files[name] = b.text if b.text.endswith("\n") else b.text + "\n"
    return files


def run_output(command: str, files: Dict[str, str]) -> str:
    """What `command` prints (stdout), run in a fresh scratch directory holding `files`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(COLUMNS=COLUMNS, LINES="50", TERM="dumb", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="doc-output-") as cwd:
        for name, text in files.items():
            with open(os.path.join(cwd, name), "w", encoding="utf-8") as f:
                f.write(text)
        run = subprocess.run(argv_of(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"{command!r} exited with {run.returncode}:\n{run.stderr}")
    return run.stdout


def expected_text(command: str, files: Dict[str, str]) -> str:
    """The text an output block of `command` should hold: the command line, then its output."""
    return f"$ {command}\n{run_output(command, files).rstrip()}"


def output_blocks(page: str, text: Optional[str] = None) -> List[Tuple[Block, str]]:
    """The output blocks of `page` (its current text, or `text`) and the command of each."""
    out = []
    for b in blocks(page, text):
        commands = b.directives.get("output", [])
        if len(commands) > 1:
            raise ValueError(f"{b.id}: one output marker per block, found {len(commands)}")
        if commands:
            out.append((b, commands[0]))
    return out


def regenerate(page: str, text: Optional[str] = None) -> Tuple[str, List[str]]:
    """The page's text (its current text, or `text`) with every output block regenerated, and the ids of the
    blocks that changed."""
    if text is None:
        with open(os.path.join(REPO, page), encoding="utf-8") as f:
            text = f.read()
    lines = text.split("\n")
    files = page_files(blocks(page, text))
    changed = []
    for b, command in reversed(output_blocks(page, text)):
        want = expected_text(command, files)
        if want != b.text:
            changed.append(b.id)
            body = [(b.indent + line) if line else line for line in want.split("\n")]
            lines[b.start + 1 : b.end] = body
    return "\n".join(lines), sorted(changed)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        if not output_blocks(page):
            continue
        text, changed = regenerate(page)
        stale += changed
        if changed and not args.check:
            with open(os.path.join(REPO, page), "w", encoding="utf-8") as f:
                f.write(text)
        for block_id in changed:
            print(f"{'differs' if args.check else 'rewrote'}: {block_id}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
