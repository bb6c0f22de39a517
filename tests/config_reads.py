"""Which config paths the library reads, matched by full path (`bf16.enabled`, not any `.enabled`).

Used by tests/test_config_keys.py. Attribute loads are resolved to config paths through annotations naming a
config dataclass, local aliases (`off = zcfg.offload_optimizer`), what a class assigns to `self.x`, the
arguments call sites pass (bound to the parameters of every function of the callee's name, until nothing
changes), return annotations, `getattr` with a literal name, and names that conventionally hold a loaded
config where the code does not annotate them (`cfg`, `config`, `self.config`). A config class's own
methods and properties count as reads of the fields they use when code outside reads them (`via_members`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

from offload.config import ZeroOffloadConfig

Paths = FrozenSet[str]
NONE: Paths = frozenset()
ROOT: Paths = frozenset({""})
# Names that hold a loaded config where the code does not annotate them (`cfg`, `self.config`, `e.config`)
ROOT_NAMES = {"cfg", "config", "loaded", "ds_config"}


def dataclass_of(tp: Any) -> Any:
    for arg in typing.get_args(tp) or (tp,):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _sections(cls: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    yield prefix, cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = dataclass_of(hints[f.name])
        if inner is not None:
            yield from _sections(inner, f"{prefix}{f.name}.")


SECTIONS: Dict[str, Any] = {p.rstrip("."): c for p, c in _sections(ZeroOffloadConfig)}
CLASS_PATHS: Dict[str, Set[str]] = {}
for _p, _c in SECTIONS.items():
    CLASS_PATHS.setdefault(_c.__name__, set()).add(_p)


def _fields(cls: Any, prefix: str = "") -> Iterator[str]:
    for f in dataclasses.fields(cls):
        yield prefix + f.name
    for name, member in vars(cls).items():
        if not name.startswith("_") and (callable(member) or isinstance(member, property)):
            yield prefix + name


KNOWN = {p for s, c in SECTIONS.items() for p in _fields(c, f"{s}." if s else "")}


def _join(base: Paths, attr: str) -> Paths:
    """The config paths `base.attr` names (paths that are no field or member of a section are dropped)."""
    return frozenset(p for p in (f"{b}.{attr}" if b else attr for b in base) if p in KNOWN)


def _annotation_paths(ann: Optional[ast.AST]) -> Paths:
    """The config sections an annotation names (`FP16Config`, `Optional["ZeroConfig"]`)."""
    found: Set[str] = set()
    for node in ast.walk(ann) if ann is not None else ():
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                found |= _annotation_paths(ast.parse(node.value, mode="eval"))
            except SyntaxError:
                pass
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        found |= CLASS_PATHS.get(name, set())
    return frozenset(found)


class Reads:
    """Which config paths code reads: attribute loads resolved to full paths through annotations, local
    aliases, `self` attributes, arguments at call sites (by callee name, over every file walked) and
    `getattr` with a literal name."""

    def __init__(self, sources: List[str]) -> None:
        self.trees = [ast.parse(s) for s in sources]
        self.defs: Dict[str, List[Any]] = {}
        for tree in self.trees:
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.defs.setdefault(node.name, []).append(node)
                elif isinstance(node, ast.ClassDef):  # calling the class calls its __init__
                    for fn in node.body:
                        if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                            self.defs.setdefault(node.name, []).append(fn)
        self.bound: Dict[Tuple[int, str], Paths] = {}
        self.paths: Set[str] = set()
        self._assigned_in: Dict[int, List[Tuple[ast.AST, Optional[ast.AST], Optional[ast.AST]]]] = {}

    def run(self) -> Set[str]:
        """Walk every file until the call-site bindings stop growing; the paths read."""
        while True:
            before = dict(self.bound)
            self.paths = set()
            for tree in self.trees:
                self._walk(tree, {}, {})
            if self.bound == before:
                return self.paths

    # ------------------------------------------------------------------------------------ resolution
    def _resolve(self, node: ast.AST, names: Dict[str, Paths], attrs: Dict[str, Paths]) -> Paths:
        if isinstance(node, ast.Name):
            return names.get(node.id) or (ROOT if node.id in ROOT_NAMES else NONE)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and not names.get("self"):
                return attrs.get(node.attr) or (ROOT if node.attr in ROOT_NAMES else NONE)
            base = self._resolve(node.value, names, attrs)
            if base:
                return _join(base, node.attr)
            return ROOT if node.attr in ROOT_NAMES else NONE
        if isinstance(node, ast.Call):
            f = node.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if fname == "load_config":
                return ROOT
            returned = frozenset().union(*(_annotation_paths(fn.returns) for fn in self.defs.get(fname, ())))
            if returned:
                return returned
            if fname == "getattr" and len(node.args) >= 2:
                key = node.args[1]
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    return _join(self._resolve(node.args[0], names, attrs), key.value)
        if isinstance(node, ast.IfExp):
            return self._resolve(node.body, names, attrs) | self._resolve(node.orelse, names, attrs)
        return NONE

    def _bind(self, call: ast.Call, names: Dict[str, Paths], attrs: Dict[str, Paths]) -> None:
        f = call.func
        fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        for fn in self.defs.get(fname, ()):
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            if (isinstance(f, ast.Attribute) or fn.name == "__init__") and params[:1] in (["self"], ["cls"]):
                params = params[1:]
            pairs: List[Tuple[str, ast.AST]] = []
            for name, arg in zip(params, call.args):
                if isinstance(arg, ast.Starred):
                    break
                pairs.append((name, arg))
            pairs += [(k.arg, k.value) for k in call.keywords if k.arg]
            for name, arg in pairs:
                p = self._resolve(arg, names, attrs)
                key = (id(fn), name)
                if p and not p <= self.bound.get(key, NONE):
                    self.bound[key] = self.bound.get(key, NONE) | p

    # ---------------------------------------------------------------------------------------- scopes
    @staticmethod
    def _assignments(body: List[ast.stmt]) -> Iterator[Tuple[ast.AST, Optional[ast.AST], Optional[ast.AST]]]:
        """(target, value, annotation) of the assignments in `body`, nested scopes left out."""
        stack: List[ast.AST] = list(body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    yield t, node.value, getattr(node, "annotation", None)
            stack.extend(ast.iter_child_nodes(node))

    def _assigned(self, fn: Any) -> List[Tuple[ast.AST, Optional[ast.AST], Optional[ast.AST]]]:
        found = self._assigned_in.get(id(fn))
        if found is None:
            body = fn.body if isinstance(fn.body, list) else [ast.Expr(fn.body)]
            found = self._assigned_in[id(fn)] = list(self._assignments(body))
        return found

    def _function_names(self, fn: Any, outer: Dict[str, Paths], attrs: Dict[str, Paths]) -> Dict[str, Paths]:
        names = dict(outer)
        a = fn.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
            p = _annotation_paths(arg.annotation) or self.bound.get((id(fn), arg.arg), NONE)
            names[arg.arg] = p or (ROOT if arg.arg in ROOT_NAMES else NONE)
        for _ in range(2):  # aliases of aliases
            for target, value, ann in self._assigned(fn):
                if isinstance(target, ast.Name):
                    p = _annotation_paths(ann)
                    if not p and value is not None:
                        p = self._resolve(value, names, attrs)
                    names[target.id] = names.get(target.id, NONE) | p
        return names

    def _walk(self, node: ast.AST, names: Dict[str, Paths], attrs: Dict[str, Paths]) -> None:
        for child in ast.iter_child_nodes(node):
            self._visit(child, names, attrs)

    def _visit(self, node: ast.AST, names: Dict[str, Paths], attrs: Dict[str, Paths]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
                self._visit(d, names, attrs)
            inner = self._function_names(node, names, attrs)
            for stmt in node.body if isinstance(node.body, list) else [node.body]:
                self._visit(stmt, inner, attrs)
            return
        if isinstance(node, ast.ClassDef):
            self._class(node, names)
            return
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) or isinstance(node, ast.Call):
            self.paths |= self._resolve(node, names, attrs)
        if isinstance(node, ast.Call):
            self._bind(node, names, attrs)
        self._walk(node, names, attrs)

    def _class(self, cls: ast.ClassDef, outer: Dict[str, Paths]) -> None:
        """`self.x` resolves to whatever the class's methods assign to it (or its annotation names)."""
        attrs: Dict[str, Paths] = {}
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                attrs[stmt.target.id] = _annotation_paths(stmt.annotation)
        for _ in range(2):
            for fn in cls.body:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                names = self._function_names(fn, outer, attrs)
                for target, value, ann in self._assigned(fn):
                    is_self = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    if is_self and target.value.id == "self":
                        p = _annotation_paths(ann)
                        if not p and value is not None:
                            p = self._resolve(value, names, attrs)
                        attrs[target.attr] = attrs.get(target.attr, NONE) | p
        for stmt in cls.body:
            self._visit(stmt, outer, attrs)


def via_members() -> Dict[str, Set[str]]:
    """`section.member` -> the fields a config class's method or property reads from `self`."""
    out: Dict[str, Set[str]] = {}
    for path, cls in SECTIONS.items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        for fn in tree.body[0].body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                r = Reads([])
                names = {"self": frozenset({path})}
                r._visit(ast.Module(body=fn.body, type_ignores=[]), names, {})
                out[f"{path}.{fn.name}" if path else fn.name] = r.paths
    return out
