"""The benches reach into ckptflow for what they drive (runners, engines, stores); CI runs none of
the GPU ones, so a name they import that was moved or made private breaks only on the device. Every
``from ckptflow... import name`` in bench/*.py (in-function ones included) must resolve here, to a
public name: found on the H200 when a refactor left bench/gpu_two_tier.py importing a private
helper that had moved (ImportError at the standby row)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"


def _imports() -> list[tuple[str, int, str, str]]:
    out = []
    for f in sorted(BENCH.glob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("ckptflow"):
                out += [(f.name, n.lineno, n.module, a.name) for a in n.names]
    return out


IMPORTS = _imports()


def _names(module: str) -> set[str]:
    """The module's names: imported, or read from its source where it needs what this machine
    lacks (torch, vLLM: the GPU modules)."""
    try:
        return set(dir(importlib.import_module(module)))
    except ModuleNotFoundError as e:
        if (e.name or "").startswith("ckptflow"):
            raise
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    names = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            names |= {t.id for t in ast.walk(n) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return names


def test_the_benches_import_ckptflow():
    assert len(IMPORTS) > 20 and any(m == "ckptflow.runners.node" for _, _, m, _ in IMPORTS)


@pytest.mark.parametrize("where,line,module,name", IMPORTS, ids=[f"{f}:{l}:{n}" for f, l, _, n in IMPORTS])
def test_every_name_a_bench_imports_from_ckptflow_exists_and_is_public(where, line, module, name):
    assert name in _names(module) or importlib.util.find_spec(f"{module}.{name}") is not None, \
        f"bench/{where}:{line} imports {name} from {module}, which has no such name"
    assert not name.startswith("_"), f"bench/{where}:{line} imports the private {module}.{name}: make it public there"
