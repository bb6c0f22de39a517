"""Every public class and function of the library (zero/, offload/; not private modules) has a docstring."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _public_modules():
    for top in ("zero", "offload"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            rel = os.path.relpath(root, REPO)
            if any(part.startswith("_") for part in rel.split(os.sep)):
                continue
            for f in files:
                if f.endswith(".py") and (f == "__init__.py" or not f.startswith("_")):
                    yield os.path.join(rel, f)


def test_public_classes_and_functions_have_docstrings() -> None:
    missing = []
    for path in _public_modules():
        tree = ast.parse(open(os.path.join(REPO, path)).read())
        if not ast.get_docstring(tree):
            missing.append(f"{path} (module)")
        for node in tree.body:
            is_def = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if is_def and not node.name.startswith("_") and not ast.get_docstring(node):
                missing.append(f"{path}:{node.lineno} {node.name}")
    assert missing == []


def test_public_methods_of_the_optimizer_package_have_docstrings() -> None:
    """zero/optimizer/ (the optimizer and its state tiers): every public method too, not only top level."""
    missing = []
    for path in _public_modules():
        if not path.startswith(os.path.join("zero", "optimizer") + os.sep):
            continue
        tree = ast.parse(open(os.path.join(REPO, path)).read())
        for cls in tree.body:
            if not isinstance(cls, ast.ClassDef) or cls.name.startswith("_"):
                continue
            for node in cls.body:
                is_def = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                if is_def and not node.name.startswith("_") and not ast.get_docstring(node):
                    missing.append(f"{path}:{node.lineno} {cls.name}.{node.name}")
    assert missing == []
