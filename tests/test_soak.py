"""The soak's short mode (bench/soak.py --cycles 10): kills at every moment, zeros where required.

The full run (200+ cycles) is in bench/RESULTS.md; this keeps the soak itself working in CI.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.criu, pytest.mark.fault]
ROOT = Path(__file__).parent.parent


def test_short_soak_loses_nothing_and_leaves_nothing(tmp_path):
    out = tmp_path / "soak.json"
    res = subprocess.run([sys.executable, "bench/soak.py", "--cycles", "10", "--seed", "7", "--ballast-mib", "64",
                          "--session-epoch", "3", "--no-record", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    assert s["cycles"] == 10
    for key in ("lost", "leaked_temp_dirs", "leaked_netns", "stopped_left", "stopped_left_at_end", "stuck_runs",
                "open_alerts_at_end", "gone_missed", "unexpected_flow_failures"):
        assert s[key] == 0, (key, s)
    # Not vacuous: every moment was drawn, the kills mostly landed inside it, every recovery was
    # compared token for token (sessions replaced by new ones every 3 cycles), flows ran, alerts
    # opened and closed, a sandbox verify ran.
    by = s["by_moment"]
    assert all(b["cycles"] >= 2 for b in by.values()), by
    assert sum(b["hit"] for b in by.values()) >= 6, by
    assert by["mid_upload"]["hit"] == s["uploads_interrupted"] == s["uploads_resumed"]
    assert s["next_tokens_checked"] == s["digest_checked"] == 10
    assert s["flow_runs"] >= 6 and s["verify_runs"] >= 1
    assert s["alerts_opened"] == s["alerts_resolved"] >= 1
    assert "| sessions lost beyond the last checkpoint | 0 | 0 |" in res.stdout
