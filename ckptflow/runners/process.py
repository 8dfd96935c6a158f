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

from ckptflow.errors import UndeclaredProcess, WorkloadNotFound
from ckptflow.models import Workload


@dataclass(frozen=True)
class DeclaredProcess:
    """A PID proven to belong to a declared workload at ``start_time`` (jiffies since boot)."""

    workload: str
    pid: int
    start_time: int
    cmdline: str


def _cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 22 (starttime) follows the ")" that closes the command name, which may hold spaces.
    return int(stat.rsplit(")", 1)[1].split()[19])


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the PID, names one process
    for good, where a PID alone may be reused."""
    return _start_time(pid)


def environ(pid: int) -> dict[str, str]:
    """The environment a process was started with (/proc/PID/environ); {} if unreadable."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def tree(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants, parents first."""
    pids, frontier = [], [root_pid]
    while frontier:
        pid = frontier.pop(0)
        pids.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    frontier += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return pids


def pid_stopped(pid: int) -> bool:
    """True while the process is stopped (state T), e.g. left by an interrupted restore."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def pid_alive(pid: int) -> bool:
    """True while /proc/PID exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


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
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            cmd = _cmdline(int(entry))
            if cmd and pattern.search(cmd):
                found.append(int(entry))
    return found


def resolve(w: Workload) -> DeclaredProcess:
    """Find the single live process of a declared workload.

    Raises:
        WorkloadNotFound: no live process, or several match (ambiguous: refuse, never guess).
    """
    pids = [p for p in _candidates(w) if pid_alive(p)]
    if not pids:
        raise WorkloadNotFound(f"workload {w.name}: no live process found ({_describe(w)})",
                               fix="start the worker, or run `ckptflow recover` to restore it")
    if len(pids) > 1:
        raise WorkloadNotFound(f"workload {w.name}: {len(pids)} processes match ({_describe(w)}): {pids}",
                               fix="make find.cmdline_match specific to one process")
    pid = pids[0]
    cmd = _cmdline(pid) or ""
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
