"""Every public class, function and method of the library (zero/, offload/; not private modules) has a
docstring: a public name (no leading underscore, so dunder methods are left out), properties included,
`@overload` stubs excluded. Modules need one too."""

from __future__ import annotations

import ast
import os
from typing import Iterator, List, Union

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Paths whose methods are being documented by their owners; emptied when those land. A path ending in "/"
# covers its folder. Everything else must be complete now.

Def = Union[ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef]


def _public_modules() -> Iterator[str]:
    for top in ("zero", "offload"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            rel = os.path.relpath(root, REPO)
            if any(part.startswith("_") for part in rel.split(os.sep)):
                continue
            for f in sorted(files):
                if f.endswith(".py") and (f == "__init__.py" or not f.startswith("_")):
                    yield os.path.join(rel, f).replace(os.sep, "/")


def _exempt(node: Def) -> bool:
    """`@overload` stubs, and property setters and deleters (the getter carries the property's docstring)."""
    return any(
        (isinstance(d, ast.Name) and d.id == "overload")
        or (isinstance(d, ast.Attribute) and d.attr in ("overload", "setter", "deleter"))
        for d in node.decorator_list
    )


def undocumented(path: str, source: str) -> List[str]:
    """`path:line name` of each public class, function and method (nested classes too) in `source` that has
    no docstring; the module itself as `path (module)`."""
    tree = ast.parse(source)
    missing = [] if ast.get_docstring(tree) else [f"{path} (module)"]

    def walk(body: List[ast.stmt], prefix: str, top: bool) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_") or _exempt(node):
                continue
            if not ast.get_docstring(node):
                missing.append(f"{path}:{node.lineno} {prefix}{node.name}")
            if isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{node.name}.", False)

    walk(tree.body, "", True)
    return missing


def test_public_classes_functions_and_methods_have_docstrings() -> None:
    missing = []
    for path in _public_modules():
        with open(os.path.join(REPO, path)) as f:
            missing += undocumented(path, f.read())
    assert missing == [], "no docstring:\n" + "\n".join(missing)


def test_the_check_sees_methods_properties_and_nested_classes() -> None:
    source = '''
"""Module."""
from typing import overload


class A:
    """A."""

    def __init__(self):
        pass

    def _private(self):
        pass

    @property
    def size(self):
        return 1

    @size.setter
    def size(self, value):
        pass

    @overload
    def get(self, key: int) -> int: ...

    def get(self, key):
        """Get."""

    class Inner:
        def run(self):
            """Run."""


def helper():
    pass
'''
    assert undocumented("zero/x.py", source) == [
        "zero/x.py:16 A.size",
        "zero/x.py:29 A.Inner",
        "zero/x.py:34 helper",
    ]
