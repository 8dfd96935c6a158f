"""Cold start: the worker from scratch, when no checkpoint can be restored."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from ckptflow.errors import RestoreFailed
from ckptflow.models import Workload
from ckptflow.runners.engine import wait_healthy


def cold_start(w: Workload) -> tuple[int, float]:
    """Start the worker from scratch with its declared start_command; wait until healthy.

    Raises:
        RestoreFailed: no start_command is declared, or the worker never became healthy.
    """
    if w.container is not None and w.container.image:  # `podman run` of its declared image
        from ckptflow.runners.container import ContainerRunner
        from ckptflow.runners.node import NodeRunner
        from ckptflow.store.local import LocalStore

        with NodeRunner(LocalStore(".")) as node:  # no store is read: only the runtime is called
            return ContainerRunner(node).start(w)
    if not w.start_command:
        raise RestoreFailed(f"workload {w.name}: no checkpoint can be restored and no start_command is declared",
                            fix="declare start_command in the fleet file, or start the worker by hand")
    t0 = time.perf_counter()
    p = subprocess.Popen(w.start_command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    wait_healthy(w, timeout_s=600)
    pid = int(Path(w.find.pid_file).read_text()) if w.find.pid_file else p.pid
    return pid, time.perf_counter() - t0
