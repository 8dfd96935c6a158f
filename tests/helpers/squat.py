"""Take a given host PID, as a busy node eventually does by chance (the kernel hands out
ns_last_pid + 1 next)."""

import os
import subprocess
from pathlib import Path


def squat(pid: int, tries: int = 200) -> subprocess.Popen | None:
    """A sleeping process holding host PID ``pid``, or None if others took it first each time."""
    for _ in range(tries):
        if os.path.exists(f"/proc/{pid}"):
            return None
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        p = subprocess.Popen(["sleep", "600"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None
