"""Code outside zero/stage3 reaches the stage-3 partitions through Stage3Partitioner's documented methods
(docs/stage3.md, "The seam for the engine"), never through its PartitionStore (`partitioner.store`) or
the store module: the store's bookkeeping stays stage 3's to change."""

from __future__ import annotations

import ast
import os
from typing import Iterator, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSIDE = os.path.join("zero", "stage3") + os.sep


def _library_files() -> Iterator[str]:
    for top in ("zero", "offload", "benchmarks"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                rel = os.path.relpath(os.path.join(root, f), REPO)
                if f.endswith(".py") and not rel.startswith(INSIDE):
                    yield rel


def store_uses(source: str, path: str = "<source>") -> List[str]:
    """Where `source` reaches the stage-3 store: an attribute named `store`, or a name imported from
    zero.stage3.store other than its error types."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "store":
            found.append(f"{path}:{node.lineno} .store")
        elif isinstance(node, ast.ImportFrom) and node.module == "zero.stage3.store":
            found += [f"{path}:{node.lineno} {a.name}" for a in node.names if not a.name.endswith("Error")]
        elif isinstance(node, ast.ImportFrom) and node.module == "zero.stage3":
            found += [f"{path}:{node.lineno} {a.name}" for a in node.names if a.name == "store"]
        elif isinstance(node, ast.Import):
            found += [f"{path}:{node.lineno} {a.name}" for a in node.names if a.name == "zero.stage3.store"]
    return found


def test_store_uses_are_found() -> None:
    assert store_uses("part.store.on_nvme(u)") == ["<source>:1 .store"]
    assert store_uses("x = engine.partitioner.store") == ["<source>:1 .store"]
    assert store_uses("from zero.stage3.store import PartitionStore") == ["<source>:1 PartitionStore"]
    assert store_uses("from zero.stage3 import store") == ["<source>:1 store"]
    assert store_uses("import zero.stage3.store") == ["<source>:1 zero.stage3.store"]
    assert store_uses("from zero.stage3.store import Stage3PinnedBudgetError") == []
    assert store_uses("part.on_nvme(u); restore(x); part.stored_nbytes(u)") == []


def test_nothing_outside_stage3_reaches_the_store() -> None:
    found = []
    files = list(_library_files())
    assert os.path.join("zero", "layout", "units.py") in files  # the walk sees the seam's callers
    for path in files:
        with open(os.path.join(REPO, path)) as f:
            found += store_uses(f.read(), path)
    assert found == []
