"""No import cycle inside the package: every module's imports (module level, inside functions and under
TYPE_CHECKING alike; relative imports resolved) form a graph without a cycle. Read with ast, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pdcheck"
PKG = "pdcheck"


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The package module an import of `name` runs: the longest prefix that is a module of ours."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports anywhere in its source (a package's own __init__ excluded)."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if is_pkg else module.split(".")[:-1]  # the package a relative import starts from
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg itself.
            names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        for name in names:
            if name.split(".")[0] != PKG:
                continue
            tgt = _target(name, modules)
            if tgt is not None and tgt != module:
                out.add(tgt)
    return out


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {mod: imports_of(mod, path, modules) for mod, path in modules.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(g):
        if v not in index:
            strong(v)
    return [_path(g, set(c)) for c in comps]


def _path(g: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first back to it)."""
    start = min(comp)
    prev: dict[str, str] = {}
    todo = [start]
    while todo:
        nxt = []
        for v in todo:
            for w in sorted(g[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        todo = nxt
    return sorted(comp)


def test_the_walker_sees_every_kind_of_import() -> None:
    g = graph()
    assert "pdcheck.messages" in g["pdcheck.vllm.handshake"]  # `from pdcheck import messages as m`
    assert "pdcheck.vllm.wire" in g["pdcheck.vllm.probe"]  # `from pdcheck.vllm.wire import FORMATS` (a package)
    assert "pdcheck.raylaunch" in g["pdcheck.launcher"]  # inside a function
    assert "pdcheck.vllm.wire.schemas" in g["pdcheck.vllm.wire.formats"]  # `from pdcheck.vllm.wire.schemas import ...`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle() -> None:
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)
