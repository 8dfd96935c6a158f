import subprocess
import sys


def test_pure_layers_load_no_prefect():
    code = ("import sys, importlib, pkgutil, ckptflow\n"
            "for pkg in ('ckptflow.policies', 'ckptflow.runners', 'ckptflow.store', 'ckptflow.engines'):\n"
            "    m = importlib.import_module(pkg)\n"
            "    for info in pkgutil.walk_packages(m.__path__, pkg + '.'):\n"
            "        importlib.import_module(info.name)\n"
            "bad = sorted(k for k in sys.modules if k == 'prefect' or k.startswith('prefect.'))\n"
            "print(len([k for k in sys.modules if k.startswith('ckptflow.')]), bad[:3])\n"
            "sys.exit(1 if bad else 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, f"a pure layer imported prefect: {out.stdout} {out.stderr[-2000:]}"
    # The check must have imported something, or it proves nothing.
    assert int(out.stdout.split()[0]) >= 6
