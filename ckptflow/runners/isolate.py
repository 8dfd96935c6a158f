"""Workers born in their own PID and mount namespaces, as a container runtime starts them.

A worker started plainly lives in the node's PID namespace, and CRIU restores PIDs exactly:
a restore fails whenever any of the worker's PIDs has been taken on the node since, and a copy
can never be restored beside its running original. A worker that is PID 1 of its own PID
namespace (and has a mount namespace of its own) is dumped with its namespaces, so every
restore makes new ones: the node's PIDs do not matter, and a verification copy runs beside
the original. On an H200 this is also the layout in which the CUDA driver restored a GPU copy
beside its running original (``bench/results/gpu_pidns.json``, ``born_in_namespace``).

Start the worker with :func:`isolated_argv`; ckptflow sees it by its host PID (written to the
declared pid file before the worker runs), detects the layout itself, and records it beside
the image so that the restore does the same.

Example:
    >>> argv = isolated_argv(["python3", "-m", "ckptflow.demo.worker", "--port", "8100"],
    ...                      pid_file="/run/ckptflow/chat.pid")
    >>> argv[:4]
    ['unshare', '--pid', '--fork', '--mount']
"""

from __future__ import annotations

import os
from pathlib import Path

# sh reads its own host PID from the node's /proc (still mounted: the new /proc comes after),
# writes it where ckptflow looks, mounts a /proc of the new PID namespace and becomes the
# worker. sh is PID 1 there and not a process-group leader, so `setsid` does not fork. Its
# stdio is opened inside the new mount namespace: a descriptor opened outside points at a mount
# the namespace's copy of the mount table does not hold, and CRIU cannot dump it.
_BOOT = ('read -r pid _ < /proc/self/stat && printf "%s\\n" "$pid" > "$0.tmp" && mv "$0.tmp" "$0" && '
         'mount -t proc proc /proc && log=$1 && shift && exec setsid "$@" </dev/null >>"$log" 2>&1')


def isolated_argv(argv: list[str], pid_file: str | os.PathLike, log: str | os.PathLike = os.devnull) -> list[str]:
    """The command that starts ``argv`` as PID 1 of new PID and mount namespaces; run it in a
    session of its own (``setsid``, or ``start_new_session=True``) like any detached worker.

    Its stdout and stderr are appended to ``log``, its stdin is /dev/null. The host PID of the worker is written to ``pid_file`` before ``argv`` runs; the worker
    itself must not write that file (it would write 1, its PID inside the namespace). As PID 1
    it gets no signal it has no handler for, except SIGKILL and SIGSTOP; stop it by the PID in
    ``pid_file`` (killing ``unshare`` leaves it running, as a restored worker would be).
    """
    # No --kill-child: CRIU restores the parent-death signal, which would then kill the restored
    # worker the moment criu (its parent during a restore) exits.
    return ["unshare", "--pid", "--fork", "--mount", "--propagation", "private",
            "sh", "-c", _BOOT, str(pid_file), str(log), *argv]


def nspid(pid: int) -> list[int]:
    """``pid``'s PID in each namespace from ours inward (/proc/PID/status NSpid); [] if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def _ns(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def is_isolated(pid: int) -> bool:
    """True when ``pid`` is PID 1 of a PID namespace below ours and has its own mount namespace."""
    ids = nspid(pid)
    return (len(ids) > 1 and ids[-1] == 1 and _ns(pid, "pid") != _ns("self", "pid")
            and _ns(pid, "mnt") != _ns("self", "mnt"))


def write_pid_file(pid_file: str | os.PathLike, pid: int) -> None:
    """Point the workload's pid file at a restored worker (its host PID changed with its namespace)."""
    path = Path(pid_file)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{pid}\n")
    os.replace(tmp, path)
