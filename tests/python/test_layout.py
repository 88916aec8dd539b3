"""The package's layout (issue 16, the renovation): no import cycle between the package's modules at import time, and
no module that grows back into a god file (core.py under 450 lines, every other module under 600)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "python" / "tapesac"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(("tapesac",) + p.relative_to(PKG).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def _import_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module-level imports between the package's modules (imports inside functions run later and cannot cycle)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    target = ".".join(parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    if f"{target}.{a.name}" == "tapesac._C":  # the extension module: a leaf
                        continue
                    if f"{target}.{a.name}" in mods:
                        edges[m].add(f"{target}.{a.name}")
                    elif target in mods and target != m:
                        edges[m].add(target)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods)
    return edges


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> list[str] | None:
        state[n] = 1
        for t in sorted(edges[n]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (c := visit(t, path + [t])):
                return c
        state[n] = 2
        return None

    for m in sorted(edges):
        if m not in state and (c := visit(m, [m])):
            return c
    return None


def test_no_import_cycle_between_the_package_modules() -> None:
    edges = _import_edges(_modules())
    assert edges["tapesac.core"], "the import scan found nothing: it is broken"
    assert _find_cycle(edges) is None, " -> ".join(_find_cycle(edges) or [])


def test_a_cycle_is_found_when_there_is_one() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_god_files() -> None:
    sizes = {p.relative_to(PKG).as_posix(): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert sizes["core.py"] < 450, sizes["core.py"]
    assert {f: n for f, n in sizes.items() if n >= 600} == {}
