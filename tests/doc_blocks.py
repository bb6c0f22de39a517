"""The fenced blocks of README.md and docs/*.md, for the tests that run them and scripts/regen_doc_outputs.py.

A block is a Markdown fence (```lang ... ```, indented or not) with the HTML comments on the lines right above
it (blank lines between them allowed), which say what a test does with it:

- `<!-- doc-test: slow -->` over a ```python block: it runs in the `-m slow` run only (builds a Hugging Face
  model, trains, or otherwise takes more than ~10 s);
- `<!-- output: COMMAND -->` over a ``` block: the block is `$ COMMAND` followed by what COMMAND prints
  (scripts/regen_doc_outputs.py writes it, tests/test_doc_outputs.py checks it);
- `<!-- file: NAME -->` over a block: its text is the file NAME the page's output commands read (a machine
  profile, a config), written into their scratch directory before they run.
"""

from __future__ import annotations

import glob
import os
import re
import textwrap
from dataclasses import dataclass, field
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_COMMENT = re.compile(r"<!--\s*(doc-test|output|file):\s*(.*?)\s*-->", re.S)


@dataclass
class Block:
    """One fenced block: its page (relative to the repository), the fence's line (1-based), language, text
    (dedented), the lines it spans in the page (the fence lines included) and its directives."""

    page: str
    line: int
    lang: str
    text: str
    start: int  # index of the opening fence line
    end: int  # index of the closing fence line
    indent: str
    directives: Dict[str, List[str]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def directive(self, kind: str) -> Optional[str]:
        values = self.directives.get(kind)
        return values[0] if values else None


def pages() -> List[str]:
    """README.md and every docs/*.md, relative to the repository root."""
    docs = glob.glob(os.path.join(REPO, "docs", "*.md"))
    found = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in docs)
    return [p for p in found if os.path.exists(os.path.join(REPO, p))]


def _comments_above(lines: List[str], start: int) -> Dict[str, List[str]]:
    """The directives of the HTML comments right above line `start` (blank lines between them allowed; a
    comment may span lines)."""
    texts: List[str] = []
    i = start - 1
    while i >= 0:
        if not lines[i].strip():
            i -= 1
            continue
        if not lines[i].rstrip().endswith("-->"):
            break
        j = i
        while j >= 0 and "<!--" not in lines[j]:
            j -= 1
        if j < 0:
            break
        texts.insert(0, "\n".join(lines[j : i + 1]))
        i = j - 1
    out: Dict[str, List[str]] = {}
    for kind, value in _COMMENT.findall("\n".join(texts)):
        out.setdefault(kind, []).append(value)
    return out


def blocks(page: str, text: Optional[str] = None) -> List[Block]:
    """The fenced blocks of `page` (its current text, or `text`)."""
    if text is None:
        with open(os.path.join(REPO, page), encoding="utf-8") as f:
            text = f.read()
    lines = text.split("\n")
    found: List[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not (lines[j].strip() == "```" and lines[j].startswith(indent)):
            j += 1
        if j == len(lines):
            raise ValueError(f"{page}:{i + 1}: the ``` fence opened here is never closed")
        body = textwrap.dedent("\n".join(lines[i + 1 : j]))
        found.append(Block(page, i + 1, lang, body, i, j, indent, _comments_above(lines, i)))
        i = j + 1
    return found


def python_blocks() -> List[Block]:
    """Every ```python block of README.md and docs/*.md."""
    return [b for p in pages() for b in blocks(p) if b.lang == "python"]
