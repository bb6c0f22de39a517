"""Test modules share code through helper modules (tests/*_helpers.py), never by importing each other: a
test module imported by another would have its tests collected twice over and its fixtures leak."""

from __future__ import annotations

import ast
import os
import re
from typing import List

TESTS = os.path.dirname(os.path.abspath(__file__))


def imports_of_test_modules(source: str) -> List[str]:
    """The test modules (`test_*`, `tests.test_*`) that `source` imports, at any depth; string literals
    that are code (child-process scripts) are parsed too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: List[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                names = imports_of_test_modules(node.value)
            except SyntaxError:  # a template (str.format fields): its import lines
                names = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", node.value, flags=re.M)
        found += [n for n in names if n.split(".")[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another() -> None:
    offenders = {}
    for f in sorted(os.listdir(TESTS)):
        if f.endswith(".py") and f != os.path.basename(__file__):  # its own strings are examples
            with open(os.path.join(TESTS, f)) as fh:
                found = imports_of_test_modules(fh.read())
            if found:
                offenders[f] = found
    assert offenders == {}


def test_the_check_finds_imports_at_any_depth() -> None:
    code = 'def f():\n    from test_engine import x\n\nCHILD = """\nfrom tests.test_overlap import y\n"""\n'
    assert imports_of_test_modules(code) == ["test_engine", "tests.test_overlap"]
    template = 'CHILD = """\nsys.path.insert(0, {tests!r})\nfrom test_checkpoint import run\n"""\n'
    assert imports_of_test_modules(template) == ["test_checkpoint"]
    assert imports_of_test_modules("from engine_helpers import x\nimport testing") == []
