"""The optimizer-state tiers behind one protocol (zero/optimizer/tiers/base.py: `StateTier`).

Callers use the protocol's members only: no code in zero/ or offload/ outside the tiers package asks which
tier it holds (`isinstance` on a tier class), and every tier class has every member the protocol declares.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import textwrap
from typing import List

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIER_CLASSES = {"DeviceState", "SplitTier", "OptimizerSwapper", "TorchDevicePart", "StateTier", "DevicePart"}
TIERS_PACKAGE = ROOT / "zero" / "optimizer" / "tiers"


def _names(node: ast.AST) -> List[str]:
    return [
        n.id if isinstance(n, ast.Name) else n.attr
        for n in ast.walk(node)
        if isinstance(n, (ast.Name, ast.Attribute))
    ]


def tier_isinstance_calls(root: pathlib.Path) -> List[str]:
    """`path:line` of every isinstance/issubclass call naming a tier class, outside the tiers package."""
    found = []
    for pkg in ("zero", "offload"):
        for path in sorted((root / pkg).rglob("*.py")):
            if TIERS_PACKAGE in path.parents:
                continue
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "issubclass")
                    and len(node.args) == 2
                    and TIER_CLASSES & set(_names(node.args[1]))
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_tier_isinstance_outside_the_tiers_package():
    assert tier_isinstance_calls(ROOT) == []


def test_the_check_finds_a_tier_isinstance(tmp_path):
    """The scan itself: an isinstance on a tier class outside the package is reported, inside it is not."""
    (tmp_path / "zero" / "optimizer" / "tiers").mkdir(parents=True)
    (tmp_path / "offload").mkdir()
    (tmp_path / "zero" / "x.py").write_text("def f(t):\n    return isinstance(t, (int, SplitTier))\n")
    (tmp_path / "offload" / "y.py").write_text("import a\nok = isinstance(1, a.OptimizerSwapper)\n")
    (tmp_path / "zero" / "optimizer" / "tiers" / "z.py").write_text("ok = isinstance(1, DeviceState)\n")
    global TIERS_PACKAGE
    saved, TIERS_PACKAGE = TIERS_PACKAGE, tmp_path / "zero" / "optimizer" / "tiers"
    try:
        assert tier_isinstance_calls(tmp_path) == ["zero/x.py:2", "offload/y.py:2"]
    finally:
        TIERS_PACKAGE = saved


def _protocol_members(proto: type) -> List[str]:
    names = set()
    for klass in proto.__mro__:
        if klass is object or klass.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n in vars(klass) if not n.startswith("_")}
        names |= set(getattr(klass, "__annotations__", {}))
    return sorted(names)


def _tier_classes():
    from offload.swap.optimizer_swapper import OptimizerSwapper
    from zero.optimizer.tiers.device import DeviceState
    from zero.optimizer.tiers.device_part import TorchDevicePart
    from zero.optimizer.tiers.split import SplitTier

    return [DeviceState, OptimizerSwapper, SplitTier, TorchDevicePart]


@pytest.mark.parametrize("cls", _tier_classes(), ids=lambda c: c.__name__)
def test_every_tier_class_has_every_protocol_member(cls):
    from zero.optimizer.tiers.base import StateTier

    init = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    instance_attrs = {
        t.attr
        for node in ast.walk(init)
        for t in (node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    missing = [m for m in _protocol_members(StateTier) if m not in instance_attrs and not hasattr(cls, m)]
    assert missing == []


def test_tiers_agree_on_the_placement_of_a_memory_state():
    """A whole device state, the same state as a torch-stepped device part, and a split of it into two memory
    tiers report one placement; the split visits the same chunks (in element coordinates)."""
    import torch

    from zero.optimizer.rules import UpdateRule
    from zero.optimizer.tiers.device import DeviceState
    from zero.optimizer.tiers.device_part import TorchDevicePart
    from zero.optimizer.tiers.split import SplitTier

    def state(n, start=0, pinned=False):
        return DeviceState(
            torch.arange(start, start + n, dtype=torch.float32), [torch.zeros(n)] * 2, 4, pinned
        )

    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "adamw_mode": True}
    whole, part = state(12), TorchDevicePart(UpdateRule("adamw"), group, state(12), fused=False)
    split = SplitTier(state(8), state(4, 8, pinned=True), on_device=True)
    for t in (whole, part, split):
        assert (t.numel, t.copies, t.pass_bytes, t.swapped_numel, t.atomic_from) == (12, 1, 0, 0, 12)
        assert t.overlap_chunks is None and t.take_lost() is None
    assert whole.device_part is None and split.device_part is None and part.device_part is part
    assert (whole.device_numel, part.device_numel, split.device_numel) == (12, 12, 8)
    assert split.chunks == [(0, 4), (4, 4), (8, 4)] == whole.chunks
    seen = []
    split.read_all(lambda s, n, m, st: seen.append(m.tolist()))
    assert sum(seen, []) == list(range(12))
