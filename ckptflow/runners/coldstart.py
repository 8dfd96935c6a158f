"""Cold start: the worker from its ``start_command``, when no checkpoint can be restored (the
default every workload runtime inherits; a container's runtime starts its image instead:
``runners.runtime.WorkloadRuntime.cold_start``)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from ckptflow.errors import RestoreFailed
from ckptflow.models import Workload
from ckptflow.runners.engine import wait_healthy


def run_start_command(w: Workload, timeout_s: float = 600) -> tuple[int, float]:
    """Start the worker from scratch with its declared start_command; wait until healthy.

    Raises:
        RestoreFailed: no start_command is declared, or the worker never became healthy.
    """
    if not w.start_command:
        raise RestoreFailed(f"workload {w.name}: no checkpoint can be restored and no start_command is declared",
                            fix="declare start_command in the fleet file, or start the worker by hand")
    t0 = time.perf_counter()
    p = subprocess.Popen(w.start_command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    wait_healthy(w, timeout_s=timeout_s)
    pid = int(Path(w.find.pid_file).read_text()) if w.find and w.find.pid_file else p.pid
    return pid, time.perf_counter() - t0

