"""The README's main job, end to end, as a newcomer runs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.criu, pytest.mark.slow]
ROOT = Path(__file__).parent.parent


def test_demo_end_to_end(tmp_path):
    """Also: the demo works in its own namespace (#36 finding 2). A user's checkpoint of demo-chat
    in the fleet file's store and the pid file of a worker started as the README says are as they
    were after a demo run (it deleted the one and killed the other's process before)."""
    import shutil

    user_ckpt = ROOT / ".ckptflow" / "store" / "demo-chat" / "20261201T000000Z-0000beef"
    user_pid = ROOT / ".ckptflow" / "run" / "demo-chat.pid"
    made = [p for p in (user_ckpt, user_pid) if not p.exists()]
    user_ckpt.mkdir(parents=True, exist_ok=True)
    (user_ckpt / "marker").write_text("a user's checkpoint")
    user_pid.parent.mkdir(parents=True, exist_ok=True)
    old_pid = user_pid.read_text() if user_pid.exists() else None
    if old_pid is None:
        user_pid.write_text("999999")
    try:
        env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
        env.pop("PREFECT_API_URL", None)
        out = subprocess.run([sys.executable, "-m", "ckptflow", "demo"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "continuation matched" in out.stdout
        assert "heartbeat 2" in out.stdout and "restore phase: restore" in out.stdout
        assert (user_ckpt / "marker").read_text() == "a user's checkpoint"
        assert user_pid.read_text() == (old_pid or "999999")
        assert list((ROOT / ".ckptflow" / "demo" / "store" / "demo-chat").iterdir())   # the demo's own
    finally:
        for p in made:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        if user_ckpt in made and not any(user_ckpt.parent.iterdir()):
            user_ckpt.parent.rmdir()
