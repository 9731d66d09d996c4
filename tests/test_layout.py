"""The house's map: docs/layout.md is equal to the code it is drawn from, and no module of the house
imports its way back to itself (no circle, type-only imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

from cli.layout import DOC, HOUSE, ROOT, with_generated


def test_the_layout_page_is_the_code() -> None:
    text = DOC.read_text()
    assert with_generated(text) == text, "run `python -m cli.layout --write`"


def _graph() -> dict[str, set[str]]:
    modules: dict[str, Path] = {}
    for top in HOUSE:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                names = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                ]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                found = resolve(name)
                if found is not None and found != module:
                    edges[module].add(found)
    return edges


def test_no_module_imports_its_way_back_to_itself() -> None:
    edges = _graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(edges[module]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert circles == [], [" -> ".join(c) for c in circles]
