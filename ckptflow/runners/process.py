"""Find a declared workload's process, and refuse anything that is not one.

The node runner runs as root and can freeze or kill any process, so it only ever acts on
a PID that it found itself from the workload's declaration, and checks it again right
before acting (a PID file can go stale and the PID be reused).

Example:
    >>> proc = resolve(workload)          # doctest: +SKIP
    >>> proc.pid, proc.cmdline            # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

from ckptflow.errors import UndeclaredProcess, UnsupportedWorkload, WorkloadNotFound
from ckptflow.models import Workload


@dataclass(frozen=True)
class DeclaredProcess:
    """A PID proven to belong to a declared workload at ``start_time`` (jiffies since boot)."""

    workload: str
    pid: int
    start_time: int
    cmdline: str


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:  # gone (NoSuchProcess), or not ours to read
        return None


def cmdline(pid: int) -> str | None:
    """The command line, arguments joined by spaces; None when the process is gone or unreadable."""
    p = _proc(pid)
    try:
        return " ".join(p.cmdline()).strip() if p else None
    except psutil.Error:  # exited meanwhile, a zombie, or access denied
        return None


def _start_time(pid: int) -> int | None:
    p = _proc(pid)
    if p is None:
        return None
    # psutil gives boot time + start ticks / CLK_TCK; back to the ticks themselves, the unit
    # start times are recorded in (tasks.move keeps them to recognise a copy's init later).
    return round((p.create_time() - psutil.boot_time()) * _CLOCK_TICKS)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the PID, names one process
    for good, where a PID alone may be reused."""
    return _start_time(pid)


def environ(pid: int) -> dict[str, str]:
    """The environment a process was started with; {} if it is gone or unreadable."""
    p = _proc(pid)
    try:
        return p.environ() if p else {}
    except psutil.Error:
        return {}


def tree(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants, parents first (``[root_pid]`` if it is gone)."""
    p = _proc(root_pid)
    try:
        return [root_pid, *(c.pid for c in p.children(recursive=True))] if p else [root_pid]
    except psutil.Error:
        return [root_pid]


def _status(pid: int) -> str | None:
    p = _proc(pid)
    try:
        return p.status() if p else None
    except psutil.Error:
        return None


def restoring_criu(pid: int) -> int | None:
    """The PID of the ``criu`` still restoring ``pid`` (its parent until ``restore -d`` ends),
    e.g. one whose runner was killed mid-restore; None otherwise."""
    p = _proc(pid)
    try:
        parent = p.parent() if p else None
        return parent.pid if parent is not None and parent.name() == "criu" else None
    except psutil.Error:
        return None


def pid_stopped(pid: int) -> bool:
    """True while the process is stopped (state T), e.g. left by an interrupted restore."""
    return _status(pid) == psutil.STATUS_STOPPED


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    return _status(pid) not in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def pid_taken(pid: int) -> bool:
    """True while anything holds ``pid``: a live process, a zombie not yet reaped, or a thread
    of another process (CRIU can restore a task only into a PID nothing holds; psutil does not
    count thread IDs as PIDs, /proc does)."""
    return os.path.exists(f"/proc/{pid}")


def _candidates(w: Workload) -> list[int]:
    f = w.find
    if f.pid_file:
        path = Path(f.pid_file)
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            raise WorkloadNotFound(
                f"workload {w.name}: pid file {path} does not exist",
                fix="start the worker, or correct find.pid_file in the fleet file") from None
        if not text.isdigit():
            raise WorkloadNotFound(f"workload {w.name}: pid file {path} holds {text[:40]!r}, not a PID",
                                   fix="check the worker's --pid-file option")
        return [int(text)]
    if f.systemd_unit:
        try:
            out = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", f.systemd_unit],
                                 capture_output=True, text=True, timeout=10)
        except (FileNotFoundError, subprocess.TimeoutExpired) as e:
            raise WorkloadNotFound(f"workload {w.name}: cannot ask systemd for {f.systemd_unit}: {e}",
                                   fix="use find.pid_file or find.cmdline_match on nodes without systemd") from None
        pid = int(out.stdout.strip() or 0)
        return [pid] if pid > 0 else []
    pattern = re.compile(f.cmdline_match or "")
    me = os.getpid()
    found = []
    for p in psutil.process_iter(["cmdline"]):  # an unreadable one comes with cmdline None
        cmd = " ".join(p.info["cmdline"] or ()).strip()
        if p.pid != me and cmd and pattern.search(cmd):
            found.append(p.pid)
    return found


def resolve(w: Workload) -> DeclaredProcess:
    """Find the single live process of a declared workload by its ``find:`` (the process
    runtime's finder: a workload of another runtime is found by it, runners.runtime).

    Raises:
        WorkloadNotFound: no live process, or several match (ambiguous: refuse, never guess).
        UnsupportedWorkload: ``w`` declares no ``find:``.
    """
    if w.find is None:
        raise UnsupportedWorkload(f"workload {w.name} declares no find: it is found by its runtime, not as a process",
                                  fix="call runners.runtime.runtime_for(w).resolve(w)")
    pids = [p for p in _candidates(w) if pid_alive(p)]
    if not pids:
        raise WorkloadNotFound(f"workload {w.name}: no live process found ({_describe(w)})",
                               fix="start the worker, or run `ckptflow recover` to restore it")
    if len(pids) > 1:
        raise WorkloadNotFound(f"workload {w.name}: {len(pids)} processes match ({_describe(w)}): {pids}",
                               fix="make find.cmdline_match specific to one process")
    pid = pids[0]
    cmd = cmdline(pid) or ""
    guard = w.find.cmdline_must_contain
    if guard and guard not in cmd:
        raise UndeclaredProcess(
            f"workload {w.name}: PID {pid} runs {cmd[:120]!r}, which lacks {guard!r}",
            fix="the pid file is stale or points at another program; restart the worker")
    start = _start_time(pid)
    if start is None:
        raise WorkloadNotFound(f"workload {w.name}: PID {pid} exited while being resolved")
    return DeclaredProcess(workload=w.name, pid=pid, start_time=start, cmdline=cmd)


def recheck(w: Workload, proc: DeclaredProcess) -> DeclaredProcess:
    """Re-resolve right before acting and make sure it is still the very same process.

    Raises:
        UndeclaredProcess: the PID now belongs to a different process (reused) or workload.
    """
    now = resolve(w)
    if (now.pid, now.start_time) != (proc.pid, proc.start_time):
        raise UndeclaredProcess(
            f"workload {w.name}: process changed between resolve and action "
            f"(PID {proc.pid}@{proc.start_time} -> {now.pid}@{now.start_time}); refusing to act",
            fix="the worker restarted; run the step again")
    return now


def _describe(w: Workload) -> str:
    f = w.find
    return (f"pid_file={f.pid_file}" if f.pid_file else
            f"systemd_unit={f.systemd_unit}" if f.systemd_unit else f"cmdline_match={f.cmdline_match!r}")
