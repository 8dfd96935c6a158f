"""``process``: a worker that is a process tree on the host, found by its ``find:`` (pid file,
systemd unit or command line), dumped and restored by CRIU, its device state by the node's GPU
backend (runners/gpu). The node runner's pieces do the work (``NodeRunner.dump``,
``restore_verified``, ``resume_devices``, ``refuse_if_running``, ``gate_gpu_memory``); this
module says which of them a process workload's steps are.

Example:
    >>> from ckptflow.models import ProcessFinder, Workload
    >>> runtime_for(Workload(name="w", node="n", find=ProcessFinder(pid_file="w.pid"))).name
    'process'
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable

from ckptflow.errors import CriuError, WorkloadNotFound
from ckptflow.models import Manifest, Workload
from ckptflow.results import Stopped
from ckptflow.poll import PollTimeout, poll
from ckptflow.runners import devshm, engine, process
from ckptflow.runners.digests import VerifyResult
from ckptflow.runners.node import Dumped, write_pid_file
from ckptflow.runners.process import DeclaredProcess
from ckptflow.runners.runtime import WorkloadRuntime, register_runtime, runtime_for  # noqa: F401  (the example)
from ckptflow.runners.verify import verify_process_copy


@register_runtime("process")
class ProcessRuntime(WorkloadRuntime):
    """A host process tree: CRIU, plus the node's GPU backend for a GPU worker."""

    keeps_pid = True

    def refuse_replica(self, w: Workload) -> None:
        """Replicas are this runtime's: CRIU copies of a template in a network namespace of their own."""

    def resolve(self, w: Workload) -> DeclaredProcess:
        return process.resolve(w)

    def stop(self, w: Workload, grace_s: float = 30) -> Stopped:
        """SIGTERM the declared worker and wait for it to exit (SIGKILL after ``grace_s``)."""
        try:
            proc = process.resolve(w)
        except WorkloadNotFound:
            return {"stopped": False, "reason": "not running"}
        os.kill(proc.pid, signal.SIGTERM)
        try:
            poll(lambda: not process.pid_alive(proc.pid), grace_s, 0.1, what=f"PID {proc.pid} to exit")
        except PollTimeout:
            os.kill(proc.pid, signal.SIGKILL)
        return {"stopped": True, "pid": proc.pid}

    def clear_leftovers(self, w: Workload) -> list[str]:
        """The /dev/shm files of its newest checkpoints that no live process uses (the node's /dev/shm)."""
        return self._node().remove_devshm_leftovers(w)

    def dump(self, w: Workload, proc: DeclaredProcess, images_dir: Path, leave_running: bool) -> Dumped:
        d = self._node().dump(w, proc, images_dir, leave_running)
        if not leave_running:  # the worker is gone from here; its /dev/shm files travel in the image
            devshm.remove(images_dir)
        return d

    def dump_failed(self, w: Workload, proc: DeclaredProcess, e: CriuError) -> CriuError | None:
        return died_during_dump(w, proc.pid, e)

    def clear(self, w: Workload) -> None:
        self._node().refuse_if_running(w)

    def preflight(self, w: Workload, m: Manifest, gpu_pairs: list[tuple[str, str]] | None) -> None:
        self._node().gate_gpu_memory(w, m, gpu_pairs)  # before CRIU: refuse early, nothing touched

    def restore(self, w: Workload, m: Manifest, timings: dict[str, float]) -> int:
        return self._node().restore_verified(w, m, timings)

    def resumed(self, w: Workload, pid: int, m: Manifest, gpu_pairs: list[tuple[str, str]] | None,
                timings: dict[str, float]) -> None:
        timings.update(self._node().resume_devices(w, pid, m, gpu_pairs))
        if w.find.pid_file:
            write_pid_file(Path(w.find.pid_file), pid)

    def serving(self, w: Workload, pid: int, m: Manifest, timings: dict[str, float]) -> None:
        t0 = time.perf_counter()
        engine.answers_real_work(w, pid, f"restored from {m.id}")
        if w.golden is not None:
            timings["golden"] = round(time.perf_counter() - t0, 4)

    def verify_copy(self, w: Workload, m: Manifest, t: dict[str, float], timeout_s: float = 120,
                    inspect_copy: Callable | None = None) -> VerifyResult:
        return verify_process_copy(self._node(), w, m, t, timeout_s)


def died_during_dump(w: Workload, pid: int, e: CriuError) -> CriuError | None:
    """The dump failed because the worker exited under it (CRIU then says e.g. "Operation not
    permitted", whose usual fix, run as root, is wrong here): that error, said plainly; else None."""
    if process.pid_alive(pid):
        return None
    err = CriuError(f"criu dump of {w.name} failed: the worker (PID {pid}) exited during the dump, so "
                    "nothing was checkpointed", cmd=e.cmd, log_tail=e.log_tail, returncode=e.returncode,
                    fix="the worker is gone, not the permissions: recover it from its newest valid checkpoint "
                        "(ckptflow recover) and see its own log for why it exited")
    err.__cause__ = e
    return err
