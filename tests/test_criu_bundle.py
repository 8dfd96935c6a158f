"""The relocatable CRIU bundle (scripts/criu-bundle.sh): found by the runner and by `doctor`
when `criu` is not on PATH, and a checkpoint round trip runs through it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptflow.runners.criu import CriuRunner, find_criu

pytestmark = pytest.mark.criu
ROOT = Path(__file__).parent.parent


def _path_without_criu() -> str:
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not (Path(d) / "criu").exists() and not (Path(d) / "criu-ns").exists()]
    path = os.pathsep.join(dirs)
    assert shutil.which("criu", path=path) is None
    return path


@pytest.fixture(scope="module")
def bundle_home(tmp_path_factory):
    """A directory holding .carry/criu, built from this machine's CRIU."""
    home = tmp_path_factory.mktemp("node")
    out = subprocess.run([str(ROOT / "scripts" / "criu-bundle.sh"), str(home / ".carry" / "criu")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (home / ".carry/criu/bin/criu").is_file() and (home / ".carry/criu/libexec/criu").is_file()
    return home


def test_doctor_reports_the_bundle_when_criu_is_not_on_path(bundle_home):
    env = {k: v for k, v in os.environ.items() if k != "CKPTFLOW_CRIU"}
    env.update(PATH=_path_without_criu(), COLUMNS="250")
    out = subprocess.run([sys.executable, "-m", "ckptflow", "doctor"], cwd=bundle_home, env=env,
                         capture_output=True, text=True, timeout=120)
    rows = {ln.split("│")[1].strip(): ln.split("│")[2:] for ln in out.stdout.splitlines() if ln.count("│") >= 3}
    state, detail = rows["criu binary"][0].strip(), rows["criu binary"][1]
    assert state == "ok" and f"{bundle_home}/.carry/criu/bin/criu" in detail and "bundle" in detail, out.stdout
    assert rows["criu >= 4.2"][0].strip() == "ok" and f"{bundle_home}/.carry/criu/bin/criu" in rows["criu >= 4.2"][1]
    assert rows["criu check"][0].strip() == "ok", out.stdout
    # Without the bundle, the same PATH has no CRIU at all: doctor says so and how to fix it.
    empty = bundle_home.parent / "empty"
    empty.mkdir(exist_ok=True)
    out = subprocess.run([sys.executable, "-m", "ckptflow", "doctor"], cwd=empty, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no bundle at .carry/criu/bin/criu" in out.stdout.replace("\n", " ")


def test_checkpoint_round_trip_through_the_bundle(bundle_home, monkeypatch, tmp_path, demo_worker):
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    w = demo_worker("bundled")
    w.complete("a session that must survive " * 8, 8, "s")
    digests = w.digests()
    monkeypatch.delenv("CKPTFLOW_CRIU", raising=False)
    monkeypatch.setenv("PATH", _path_without_criu())
    monkeypatch.chdir(bundle_home)
    found = find_criu()
    assert (found.source, found.path) == ("bundle", str(bundle_home / ".carry/criu/bin/criu"))
    with CriuRunner() as criu, NodeRunner(LocalStore(tmp_path / "store"), criu=criu) as node:
        assert criu.criu_bin == found.path
        m = node.checkpoint(w.workload, leave_running=False)
        assert m.fingerprint.criu == ".".join(map(str, criu.version()))   # read through the bundle too
        w.proc.wait()
        res = node.restore(w.workload)
    assert res.pid == m.pid and w.digests() == digests
    assert w.complete("next", 4, "s")  # and it serves on


def test_explicit_binary_wins_over_the_environment_everywhere(monkeypatch, tmp_path):
    """One lookup: the runner and the fingerprint agree (an explicit binary first, then $CKPTFLOW_CRIU)."""
    from ckptflow.runners.fingerprint import node_fingerprint

    monkeypatch.setenv("CKPTFLOW_CRIU", str(tmp_path / "nowhere" / "criu"))
    assert CriuRunner().criu_bin == str(tmp_path / "nowhere" / "criu")
    real = shutil.which("criu")
    if real is None:
        pytest.skip("no criu on PATH")
    assert CriuRunner(real).criu_bin == real
    assert node_fingerprint(real).criu is not None                       # the argument, not the env
