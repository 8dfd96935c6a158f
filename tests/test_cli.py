import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ckptflow", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.criu
def test_doctor_lists_prerequisites_and_passes_here():
    out = _run("doctor")
    assert out.returncode == 0, out.stdout
    for name in ("criu >= 4.2", "criu check", "criu-ns", "NVML", "cuda-bindings"):
        assert name in out.stdout
    # No GPU on CI: NVML is "n/a" with the reason, not a crash.
    assert "NVML" in out.stdout


def test_doctor_names_a_missing_criu(tmp_path):
    import os
    env = {**os.environ, "CKPTFLOW_CRIU": "/nonexistent/criu"}
    out = subprocess.run([sys.executable, "-m", "ckptflow", "doctor"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**env, "COLUMNS": "200"})
    assert out.returncode == 1
    assert "FAIL" in out.stdout and "setup.sh" in out.stdout


def test_ls_on_a_bad_fleet_file_names_the_field(tmp_path):
    bad = tmp_path / "f.yaml"
    bad.write_text("fleet: x\nnodes: []\n")
    out = subprocess.run([sys.executable, "-m", "ckptflow", "ls", "--fleet", str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin"})
    assert out.returncode == 2
    assert "nodes" in out.stdout and "line 2" in out.stdout


def test_simulate_json_has_every_policy():
    import json

    out = _run("simulate", "--seed", "3", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    pol = json.loads(out.stdout)["policies"]
    for name in ("never", "fixed-3600", "young-daly", "ckptflow", "hindsight", "clairvoyant"):
        assert {"cost", "lost_gpu_s", "pause_gpu_s", "bytes"} <= set(pol[name])
    # The targets of the policy issue, on this seed:
    best_fixed = min(v["cost"] for k, v in pol.items() if k.startswith("fixed-"))
    assert pol["ckptflow"]["cost"] <= 1.10 * pol["hindsight"]["cost"]
    assert pol["ckptflow"]["cost"] <= 0.70 * best_fixed
    assert pol["clairvoyant"]["cost"] <= pol["ckptflow"]["cost"]
