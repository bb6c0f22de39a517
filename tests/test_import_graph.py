"""The packages import each other without a cycle of any kind.

Every import counts: at module level, inside functions (lazy ones), under `if TYPE_CHECKING:`, and
`importlib.import_module("...")` of a literal name. `from X import name` where `X.name` is a module is an
edge to that module, otherwise an edge to `X` (a package's `__init__`); a package `__init__` has edges to
what it imports like any other module. Importing a submodule does not count as an edge to its parent
packages (Python runs their `__init__` first, but that is no choice of the importing module's), so a
package `__init__` that imports its own submodules is fine as long as none of them imports the package.
"""

import ast
import functools
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("zero", "offload", "benchmarks")


def _module_files() -> Dict[str, Path]:
    """Every Python module of PACKAGES by dotted name (a package by its own name, for its __init__.py)."""
    modules: Dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _extension_modules() -> Set[str]:
    """The compiled extensions (offload._aio, offload._cpu_optim): modules that import nothing of ours."""
    names = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.so"):
            parts = path.relative_to(ROOT).parts
            names.add(".".join(parts[:-1] + (path.name.split(".")[0],)))
    return names


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports_of(module: str, path: Path, known: Set[str]) -> Set[str]:
    """The modules of `known` that `module` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found: Set[str] = set()

    def add(name: str) -> None:
        # `import a.b.c` of a module not among ours (a name bound in a module, an outside package) counts as
        # its closest enclosing module of ours
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                source = _resolve_relative(module, is_package, node.level, node.module)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in known else source)
        elif isinstance(node, ast.Call):
            func = node.func
            name = getattr(func, "attr", None) or getattr(func, "id", "")
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                if isinstance(node.args[0].value, str) and not node.args[0].value.startswith("."):
                    add(node.args[0].value)
    found.discard(module)
    return found


@functools.lru_cache(maxsize=1)
def import_graph() -> Dict[str, Set[str]]:
    """Module -> the modules of PACKAGES it imports (one parse per test session; not to be changed)."""
    files = _module_files()
    known = set(files) | _extension_modules()
    return {module: _imports_of(module, path, known) for module, path in files.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle of `graph` as a path whose first and last entries are the same module, or None."""
    done: Set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: List[str] = [start]
        on_path = {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
                continue
            if nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            if nxt in done:
                continue
            path.append(nxt)
            on_path.add(nxt)
            stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_graph_sees_every_kind_of_import():
    """The parser itself: lazy, type-only, relative, submodule-by-from and import_module edges are found."""
    graph = import_graph()
    assert "zero.initialization" in graph["zero"]  # lazy, inside __getattr__
    assert "offload.swap.optimizer_swapper" in graph["offload.swap"]  # importlib.import_module
    assert "offload.ops.lion" in graph["offload.ops"]  # relative `from .lion import CPULion`
    assert "zero.engine.engine" in graph["zero.engine"]  # a package __init__'s re-export
    assert {"zero.errors", "offload.config"} <= graph["zero"]  # a module-level `from package import name`


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_find_cycle_reports_the_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_offload_imports_nothing_of_zero():
    """The memory tiers sit below the engine (docs/architecture.md)."""
    graph = import_graph()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.split(".")[0] == "offload"
        for target in targets
        if target.split(".")[0] != "offload"
    )
    assert upward == []


def test_no_module_imports_a_package_it_is_in():
    """A package's `__init__` may import its submodules (lazily or not), so a submodule that imports a
    package containing it (`import zero` inside zero/) closes a cycle as soon as that `__init__` reaches
    it; inside a package the defining submodule is imported instead."""
    files = _module_files()
    packages = {module for module, path in files.items() if path.name == "__init__.py"}
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets
        if target in packages and module.startswith(target + ".")
    )
    assert upward == []


def test_engine_parts_stay_below_their_users():
    """docs/architecture.md: nothing in zero/ outside zero/integrations/ imports an integration, and the
    checkpoint code sees the engine only through its protocol (zero/checkpoint/_engine.py)."""
    graph = import_graph()
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if (
            module.startswith("zero.")
            and not module.startswith("zero.integrations")
            and target.startswith("zero.integrations")
        )
        or (
            module.startswith("zero.checkpoint") and target.startswith(("zero.engine", "zero.initialization"))
        )
    )
    assert wrong == []


# The package __init__s that import anything: each re-exports its package's public names (zero's on first
# use), or is a module of DeepSpeed's in package form (zero.utils). Every other __init__ imports nothing.
REEXPORTING_PACKAGES = {
    "zero",
    "zero.activations",
    "zero.checkpoint",
    "zero.engine",
    "zero.stage3",
    "zero.utils",
    "offload.config",
    "offload.estimate",
    "offload.ops",
    "offload.swap",
}


def test_only_the_reexporting_package_inits_import():
    files = _module_files()
    graph = import_graph()
    importing = {module for module, path in files.items() if path.name == "__init__.py" and graph[module]}
    assert importing == REEXPORTING_PACKAGES
