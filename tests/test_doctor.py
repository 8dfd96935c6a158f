"""`ckptflow doctor`'s checks that read the node's settings, on settings written for the test."""

import subprocess
import sys
from pathlib import Path

import pytest

from ckptflow.doctor import WARN, checks, io_uring_check

ROOT = Path(__file__).parent.parent
FIX = "run `sysctl -w kernel.io_uring_disabled=2` before starting it (persist it in /etc/sysctl.d/)"


@pytest.mark.parametrize("value,state,says", [
    ("2", True, "2: io_uring is off, so an engine's event loop uses epoll and CRIU can dump it"),
    ("0", WARN, f"0: io_uring is open to every process; a vLLM, SGLang or tensor-parallel worker started now maps "
                f"a ring CRIU cannot dump: {FIX}; CPU demo workers need nothing"),
    ("1", WARN, "1: io_uring is open to root's processes (an engine's, as a node runs it);"),
])
def test_io_uring_disabled_is_reported_with_its_value_and_what_to_do(tmp_path, value, state, says):
    """Issue #36: doctor did not look at the sysctl CRIU needs for vLLM and SGLang trees."""
    sysctl = tmp_path / "io_uring_disabled"
    sysctl.write_text(value + "\n")
    name, ok, detail = io_uring_check(sysctl)
    assert name == "kernel.io_uring_disabled (engines)" and ok == state
    assert detail.startswith(says), detail
    if value != "2":
        assert FIX in detail


def test_a_kernel_without_the_sysctl_needs_nothing(tmp_path):
    assert io_uring_check(tmp_path / "absent")[1:] == (None, "no such sysctl on this kernel (before 6.6): nothing to set")


def test_doctor_lists_the_io_uring_row_and_a_warning_fails_nothing():
    assert any(name == "kernel.io_uring_disabled (engines)" for name, _, _ in checks())
    out = subprocess.run([sys.executable, "-m", "ckptflow", "doctor"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"COLUMNS": "250", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"})
    row = next(line for line in out.stdout.splitlines() if "kernel.io_uring_disabled" in line)
    sysctl = Path("/proc/sys/kernel/io_uring_disabled")
    if not sysctl.exists():
        assert "│ n/a" in row, row
        return
    value = sysctl.read_text().strip()
    assert ("│ ok" if value == "2" else "│ warn") in row and f"│ {value}: io_uring is" in row, row
    assert out.returncode == 0 or "FAIL" in out.stdout.replace(row, "")   # the warning alone fails nothing


def test_vllms_launcher_leaves_io_uring_off_for_the_engines_lifetime_and_the_page_says_why(tmp_path, monkeypatch):
    """engines.vllm.start_server sets the sysctl doctor reports and never puts it back (by design);
    docs/engines/vllm.md says so and why (issue #36: it was undocumented)."""
    from ckptflow.engines import vllm
    from ckptflow.errors import RunnerUnavailable

    sysctl = tmp_path / "io_uring_disabled"
    sysctl.write_text("0\n")
    monkeypatch.setattr(vllm, "IO_URING_SYSCTL", sysctl)
    monkeypatch.setattr(vllm, "server_args", lambda *a, **k: ["true"])

    class Exited:
        pid, returncode = 0, 0

        def poll(self):
            return 0

    monkeypatch.setattr(vllm.subprocess, "Popen", lambda *a, **k: Exited())
    monkeypatch.setattr(vllm, "wait_url", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("exited")))
    with pytest.raises(RunnerUnavailable):
        vllm.start_server(None, tmp_path / "model", port=1, run_dir=tmp_path / "run", timeout_s=0.1)
    assert sysctl.read_text().strip() == "2"                     # left at 2, the start having failed too
    page = " ".join((ROOT / "docs" / "engines" / "vllm.md").read_text().split())
    assert ("`engines.vllm.start_server` (the tests and benches start vLLM with it), sets the sysctl to 2 itself "
            "when it can and leaves it at 2 for the engine's lifetime, by design") in page
    assert "the kernel reads it each time a process sets up a ring" in page
