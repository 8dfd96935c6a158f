import subprocess
import sys


def test_pure_layers_load_no_prefect():
    # Modules an engine imports inside its own environment (they need vllm, torch or the CUDA
    # driver's bindings, not Prefect).
    engine_side = {"ckptflow.engines.vllm_connector", "ckptflow.engines.vmm", "ckptflow.engines.gpuhash"}
    code = ("import sys, importlib, pkgutil, ckptflow\n"
            f"engine_side = {engine_side!r}\n"
            "for pkg in ('ckptflow.policies', 'ckptflow.runners', 'ckptflow.store', 'ckptflow.engines'):\n"
            "    m = importlib.import_module(pkg)\n"
            "    for info in pkgutil.walk_packages(m.__path__, pkg + '.'):\n"
            "        if info.name not in engine_side:\n"
            "            importlib.import_module(info.name)\n"
            "bad = sorted(k for k in sys.modules if k == 'prefect' or k.startswith('prefect.'))\n"
            "print(len([k for k in sys.modules if k.startswith('ckptflow.')]), bad[:3])\n"
            "sys.exit(1 if bad else 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, f"a pure layer imported prefect: {out.stdout} {out.stderr[-2000:]}"
    # The check must have imported something, or it proves nothing.
    assert int(out.stdout.split()[0]) >= 6


def test_the_vllm_connector_imports_only_the_engines_own_packages():
    """vLLM loads it from its own environment: no pydantic-era ckptflow module, no Prefect."""
    import ast
    from pathlib import Path

    src = Path(__file__).parents[1] / "ckptflow" / "engines" / "vllm_connector.py"
    roots = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    assert roots <= {"__future__", "hashlib", "json", "os", "struct", "dataclasses", "pathlib", "typing",
                     "torch", "safetensors", "vllm", "ckptflow"}, roots
    layout = ast.parse(src.with_name("vllm_layout.py").read_text())   # its one ckptflow import
    assert [n.module for n in ast.walk(layout) if isinstance(n, (ast.Import, ast.ImportFrom))] == ["__future__"]


def test_the_vllm_worker_extension_imports_only_torch_and_the_weight_chunks():
    """It is mixed into every vLLM worker process: the standard library, torch (and numpy, the
    CUDA driver's bindings where a GPU needs them) and ckptflow's engine-side chunk code only."""
    import ast
    from pathlib import Path

    engines = Path(__file__).parents[1] / "ckptflow" / "engines"
    for name, inside in (("vllm_worker.py", {"ckptflow.engines.weight_chunks"}),
                         ("weight_chunks.py", {"ckptflow.engines.vmm"}), ("vmm.py", set())):
        roots, ours = set(), set()
        for node in ast.walk(ast.parse((engines / name).read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            roots |= {m.split(".")[0] for m in mods}
            ours |= {m for m in mods if m.startswith("ckptflow")}
        assert roots - {"ckptflow"} <= {"__future__", "collections", "concurrent", "contextlib", "ctypes", "hashlib", "os",
                                        "pathlib", "threading", "time", "typing", "numpy", "torch", "cuda"}, (name, roots)
        assert ours == inside, (name, ours)
