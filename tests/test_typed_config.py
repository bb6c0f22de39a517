"""Config travels typed: no function in zero/ or offload/ takes a config parameter typed `Any`.

After `offload.config.load_config` the config is frozen dataclasses (`ZeroOffloadConfig` and its sections);
a parameter that carries one is annotated with its dataclass (or `ConfigInput` where a public entry point
also takes a dict or a JSON path), so a type checker sees every read.
"""

from __future__ import annotations

import ast
import pathlib
from typing import List

ROOT = pathlib.Path(__file__).resolve().parent.parent
# parameter names that carry a config or one of its sections
CONFIG_NAMES = {
    "cfg",
    "config",
    "zcfg",
    "offload",
    "off",
    "fp16",
    "bf16",
    "aio",
    "ds_config",
    "deepspeed_config",
    "config_dict_or_path",
    "zero_config",
    "offload_param",
    "offload_optimizer",
    "zero_optimization",
    "activation_checkpointing",
}


def _is_config_name(name: str) -> bool:
    return name in CONFIG_NAMES or name.endswith(("_cfg", "_config"))


def _is_any(annotation: ast.expr) -> bool:
    """`Any`, `typing.Any`, `Optional[Any]` or a quoted one of them."""
    text = ast.unparse(annotation).strip("'\"").replace("typing.", "")
    return text in ("Any", "Optional[Any]", "Union[Any, None]", "Any | None")


def any_typed_config_parameters(root: pathlib.Path) -> List[str]:
    """`path:line name` of every function parameter named like a config and annotated `Any`."""
    found = []
    for pkg in ("zero", "offload"):
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                    if arg.annotation is not None and _is_config_name(arg.arg) and _is_any(arg.annotation):
                        found.append(f"{path.relative_to(root)}:{arg.lineno} {arg.arg}")
    return found


def test_no_config_parameter_is_typed_any():
    assert any_typed_config_parameters(ROOT) == []


def test_the_check_finds_an_any_typed_config(tmp_path):
    (tmp_path / "zero").mkdir()
    (tmp_path / "offload").mkdir()
    (tmp_path / "zero" / "a.py").write_text(
        "from typing import Any, Optional\n"
        "def f(x: Any, cfg: 'ZeroOffloadConfig', *, off: Optional[Any] = None) -> None: ...\n"
        "class C:\n    def m(self, zero_cfg: Any, fp16: FP16Config) -> None: ...\n"
    )
    (tmp_path / "offload" / "b.py").write_text("def g(aio: 'Any') -> None: ...\n")
    assert any_typed_config_parameters(tmp_path) == [
        "zero/a.py:2 off",
        "zero/a.py:4 zero_cfg",
        "offload/b.py:1 aio",
    ]
