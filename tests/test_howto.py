"""How-to pages run as written (issue #36, finding 3: docs/engines/vllm.md's step 2 failed with
the model its generator writes, and the fix lived only in engines/vllm.py). A block marked
``<!-- howto:NAME -->`` is run by bash from the repository root, command by command (``-e``: the
first failing command fails the test, named in the output), with only its directory and port
replaced."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import free_port

ROOT = Path(__file__).parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.criu]


def howto(doc: Path, name: str) -> str:
    """The bash block that follows ``<!-- howto:NAME -->`` in ``doc``."""
    m = re.search(rf"<!-- howto:{name} -->\n```bash\n(.*?)\n```", doc.read_text(), re.S)
    assert m, f"{doc}: no howto:{name} block"
    return m.group(1)


def test_the_vllm_two_tier_howto_runs_as_written(vllm_install, io_uring_off):
    from ckptflow.engines import vllm

    script = howto(ROOT / "docs" / "engines" / "vllm.md", "vllm")
    first = "H=.ckptflow/howto; PORT=18300;"
    assert script.startswith(first)
    h = f".ckptflow/howto-test-{os.getpid()}"
    script = script.replace(first, f"H={h}; PORT={free_port()};", 1)
    pid_file = ROOT / h / "vllm.pid"
    try:
        r = subprocess.run(["bash", "-euo", "pipefail", "-x", "-c", script], cwd=ROOT, capture_output=True, text=True,
                           timeout=1500)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-6000:]
        assert f"restored chat-vllm on local from" in r.stdout, out[-3000:]
        hits = re.findall(r"^vllm:external_prefix_cache_hits_total(?:\{[^}]*\})? ([0-9.e+]+)$", r.stdout, re.M)
        # 384 tokens: the three full blocks of the first turn's prompt, loaded from the store.
        assert hits and float(hits[-1]) >= 384, out[-3000:]
    finally:
        try:
            vllm.kill_tree(int(pid_file.read_text()))
        except (OSError, ValueError):
            pass
        shutil.rmtree(ROOT / h, ignore_errors=True)
