"""The import graph of ckptflow/: no cycles, nothing importing upward, no private names across modules.

The layers are the table in docs/ARCHITECTURE.md (read from there, so the page is the rule). Every
import counts, at module level and inside functions; only ``if TYPE_CHECKING:`` blocks are left out
(they never run). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg`` (its ``__init__``); importing ``a.b.c`` from outside package ``a.b`` runs ``a.b``'s
``__init__`` too, so that is an edge as well.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PKG = ROOT / "ckptflow"
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                continue
            stack.append(child)


def _owner(dotted: str) -> str | None:
    """The module of ours that ``dotted`` names (or lies in), None for another package."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _edges() -> tuple[dict[str, dict[str, int]], list[str]]:
    """module -> {imported module: first line}, and every private name imported across modules."""
    edges: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    private: list[str] = []
    for mod, path in MODULES.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            targets: list[tuple[str, str | None]] = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append((sub, None) if sub in MODULES else (base, a.name))
            for dotted, name in targets:
                target = _owner(dotted)
                if target is None or target == mod:
                    continue
                # the target and the packages above it that the importer is not inside of
                chain = [target] + [p for p in _parents(target) if not (mod == p or mod.startswith(p + "."))]
                for t in chain:  # the first line that imports it
                    edges[mod][t] = min(edges[mod].get(t, node.lineno), node.lineno)
                if name and name.startswith("_") and not name.startswith("__"):
                    private.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {target} import {name}")
    return edges, private


def _parents(mod: str) -> list[str]:
    parts = mod.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(2, len(parts))) if p in MODULES]


def _layers() -> dict[str, tuple[int, str]]:
    """path under ckptflow/ -> (layer, what), from the table in docs/ARCHITECTURE.md."""
    table: dict[str, tuple[int, str]] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"-?\d+", cells[0]):
            for path in re.findall(r"`([^`]+)`", cells[2]):
                table[path] = (int(cells[0]), cells[1])
    assert table, f"no layer table found in {DOC}"
    return table


def layer_of(mod: str, table: dict[str, tuple[int, str]]) -> int:
    rel = MODULES[mod].relative_to(PKG).as_posix()
    best = max((p for p in table if rel == p or (p.endswith("/") and rel.startswith(p))), key=len, default=None)
    assert best is not None, f"ckptflow/{rel} is in no layer of docs/ARCHITECTURE.md: add it to the table"
    return table[best][0]


def _cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component of more than one module
    (Tarjan for the components, breadth-first for the path)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:
        paths, seen = [], set()
        for start in sorted(comp):  # a shortest circle through each module of the component
            path = _shortest_cycle(edges, comp, start)
            key = frozenset(zip(path, path[1:]))
            if key not in seen:
                seen.add(key)
                paths.append(path)
        out.append((sorted(comp), paths))
    return out


def _shortest_cycle(edges: dict[str, dict[str, int]], comp: set[str], start: str) -> list[str]:
    prev: dict[str, str] = {}
    todo = [start]
    while todo:
        nxt = []
        for v in todo:
            for w in sorted(edges[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        todo = nxt
    raise AssertionError(f"{start} is in no circle of its component")


def _fmt_edge(edges, a: str, b: str) -> str:
    return f"{MODULES[a].relative_to(ROOT)}:{edges[a][b]} -> {b}"


def test_every_module_has_a_layer():
    table = _layers()
    for mod in MODULES:
        layer_of(mod, table)
    assert len(MODULES) > 100, "the walk found too few modules to prove anything"


# Edges that still close a circle inside runners/, each with why and what removes it. To shrink:
# an entry whose import is gone fails the test below until it is taken out of this list.
CYCLE_ALLOWED = {
    ("ckptflow.runners.gpu", "ckptflow.runners.gpu.cuda"):
        "the registration import at the bottom of gpu/__init__.py (BACKENDS is read directly, so cuda must "
        "be there on import); goes when every reader asks registry.GPU_BACKENDS, which imports it",
}


def test_no_import_cycles():
    edges, _ = _edges()
    stale = [f"{a} -> {b}" for a, b in CYCLE_ALLOWED if b not in edges[a]]
    assert not stale, "allow-listed edges that are gone (take them out of CYCLE_ALLOWED):\n" + "\n".join(stale)
    for a, b in CYCLE_ALLOWED:
        del edges[a][b]
    found = _cycles(edges)
    report = []
    for comp, paths in found:
        report.append(f"{len(comp)} modules in one knot ({', '.join(comp)}); its circles:")
        report += ["  " + "  ->  ".join(f"{_fmt_edge(edges, a, b)}" for a, b in zip(p, p[1:])) for p in paths]
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(report)


def test_nothing_imports_upward():
    edges, _ = _edges()
    table = _layers()
    up = [f"{_fmt_edge(edges, a, b)}  (layer {layer_of(a, table)} -> {layer_of(b, table)})"
          for a in sorted(edges) for b in sorted(edges[a]) if layer_of(b, table) > layer_of(a, table)]
    assert not up, f"{len(up)} upward import(s):\n" + "\n".join(up)


def test_private_names_stay_in_their_module():
    _, private = _edges()
    assert not private, f"{len(private)} private name(s) imported across modules:\n" + "\n".join(private)


def test_modules_are_imported_by_name_only_in_the_registries():
    """``importlib.import_module`` of a ckptflow module hides an edge from this test: only the seams'
    registries load implementations that way (docs/ARCHITECTURE.md, Rules)."""
    allowed = {"ckptflow.registry", "ckptflow.modes"}
    # The allow-list, to shrink: each entry with why it is still here.
    allowed |= {
        # the CLI imports a flow only for the command that runs it (no Prefect at start-up); down only
        "ckptflow.cli",
        # old deployments' entrypoints (flows/migrate.py:drain) load the moved flows until a redeploy
        "ckptflow.flows.migrate",
    }
    hits = []
    for mod, path in MODULES.items():
        if mod in allowed or mod.startswith("ckptflow.demo."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not hits, "modules imported by name outside the registries:\n" + "\n".join(hits)


def test_the_checker_sees_what_it_must():
    """The walk finds in-function imports, resolves relative ones and leaves TYPE_CHECKING out."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
                     "def f():\n    from . import b\n    import c.d\n")
    found = sorted(getattr(n, "module", None) or n.names[0].name for n in _import_nodes(tree))
    assert found == ["b", "c.d", "typing"]
    edges, _ = _edges()
    # the CLI's commands import their layers inside functions: those edges are seen
    assert {"ckptflow.deploy", "ckptflow.demo.main"} <= set(edges["ckptflow.cli"])
    # relative imports resolve (engines/vllm_connector.py: from .vllm_layout import ...)
    assert "ckptflow.engines.vllm_layout" in edges["ckptflow.engines.vllm_connector"]


def test_no_module_shadows_the_standard_library():
    """A script run from a package folder (``python ckptflow/engines/vllm_model.py``, as the vLLM
    helpers and the how-to do) has that folder first on sys.path: a module there named like a
    standard one is imported in its place. ``engines/http.py`` did that to ``http.client``, and
    every vLLM model write failed inside torch's import."""
    import sys

    shadows = sorted(str(p.relative_to(PKG.parent)) for p in PKG.rglob("*")
                     if (p.suffix == ".py" and p.stem in sys.stdlib_module_names)
                     or (p.is_dir() and p.name in sys.stdlib_module_names))
    assert not shadows, f"named like standard-library modules: {shadows}"
