"""The README's main job, end to end, as a newcomer runs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.criu, pytest.mark.slow]
ROOT = Path(__file__).parent.parent


def test_demo_end_to_end(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run([sys.executable, "-m", "ckptflow", "demo"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "continuation matched" in out.stdout
    assert "heartbeat 2" in out.stdout and "restore phase: restore" in out.stdout
