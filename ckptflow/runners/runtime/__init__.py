"""Workload runtimes: what a worker runs under, and what differs in checkpointing it there.

A fleet file's workload picks its runtime by what it declares, or by name::

    workloads:
      - {name: chat-a, node: n1, find: {pid_file: /run/chat-a.pid}}       # runtime: process
      - {name: chat-c, node: n1, container: {name: chat-c}}                # runtime: podman
      - {name: chat-k, node: n1, container: {name: chat-k, kubernetes: {namespace: serving, pod: chat-k-0,
                                                                        container: vllm}}}  # runtime: pod
      - {name: chat-t, node: n1, find: {pid_file: /run/chat-t.pid}, runtime: toy}   # a registered one, by name

The node runner (runners/node.py) owns the sequence of a checkpoint and of a restore: the workload
lock, the engine probe, the store's pending checkpoint and its commit, the fingerprint gate, the
candidates nearest first, the checksum fallback, health, the session check, the failed-restore
count. A runtime owns each step that differs:

| step | method | process | podman | pod |
|------|--------|---------|--------|-----|
| find the worker | ``resolve`` | pid file / unit / command line | ``podman inspect`` | the API server |
| before the probe | ``refuse`` | (in the dump) | what CRIU cannot carry | - |
| the manifest's record | ``record`` | - | the container | the pod |
| the image | ``dump`` | CRIU [+ the GPU backend] | ``podman container checkpoint`` | the kubelet |
| after the commit | ``dumped`` | - | remove a stopped container | delete the pod |
| before a restore | ``clear`` | refuse a live one, clear a half-restored one | refuse / remove | refuse / delete |
| before a candidate | ``preflight`` | GPU memory | ports, memory | memory |
| the restore | ``restore`` | CRIU + checksums in parallel | checksums, ``podman restore`` | checksums, a new pod |
| before health | ``resumed`` | device state back, pid file | - | - |
| after the checks | ``serving`` | the golden request | - | - |
| a copy beside it | ``verify_copy`` | criu-ns + netns | a copy, fresh ports | skipped |
| stop, cold start | ``stop``, ``cold_start`` | signals, start_command | ``podman stop/run`` | delete / the cluster's |

Adding one is one module with a ``WorkloadRuntime`` subclass and ``@register_runtime("<name>")``
(docs/EXTENDING.md); the built-ins are named in ``registry.WORKLOAD_RUNTIMES`` and imported on its
first lookup.

Example:
    >>> from ckptflow.models import ProcessFinder, Workload
    >>> runtime_name(Workload(name="w", node="n", find=ProcessFinder(pid_file="w.pid")))
    'process'
    >>> type(runtime_for(Workload(name="w", node="n", find=ProcessFinder(pid_file="w.pid")))).__name__
    'ProcessRuntime'
    >>> get_runtime("lxc")
    Traceback (most recent call last):
    ...
    ckptflow.errors.ConfigError: unknown workload runtime 'lxc' (known: pod, podman, process)
      fix: name a registered runtime, or leave runtime out
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, TypeVar

from ckptflow.errors import ConfigError, CriuError, RunnerUnavailable, UnsupportedWorkload
from ckptflow.models import Fingerprint, Manifest, ManifestProbe, Workload
from ckptflow.results import Stopped
from ckptflow.registry import WORKLOAD_RUNTIMES
from ckptflow.runners.coldstart import run_start_command
from ckptflow.runners.fingerprint import workload_fingerprint

if TYPE_CHECKING:
    from ckptflow.runners.digests import VerifyResult
    from ckptflow.runners.node import Dumped, NodeRunner
    from ckptflow.runners.process import DeclaredProcess

R = TypeVar("R", bound="type[WorkloadRuntime]")
COLD_START_TIMEOUT_S = 600  # as a CRIU call's: a model load of minutes is normal, ten means it never comes up


class WorkloadRuntime(ABC):
    """What one kind of worker runs under, on one node. ``node``: the node's runner (its store,
    CRIU and GPU backend); None for the steps that need none (resolve, stop, cold start)."""

    name: ClassVar[str] = ""
    what: ClassVar[str] = "worker"            # what messages call it ("cold start the <what>")
    gated: ClassVar[tuple[str, ...]] = ()     # fingerprint groups of its own a restore must match (policies.compat)
    # What a workload under it must declare (models.Workload checks it): "find", "container" or
    # "container.kubernetes"; a runtime named with the wrong one would act on nothing it can find.
    declares: ClassVar[str] = "find"
    # Whether a restore brings the worker back under its dumped PID (CRIU on the host does; a
    # container's restore gets a new host PID): only then does another PID mean a new worker.
    keeps_pid: ClassVar[bool] = False

    def __init__(self, node: "NodeRunner | None" = None):
        self.node = node

    def _node(self) -> "NodeRunner":
        if self.node is None:
            raise RunnerUnavailable(f"the {self.name} runtime needs a node runner for this step",
                                    fix="call it through NodeRunner.runtime_for(w)")
        return self.node

    # --- finding and stopping ---------------------------------------------------------------
    @abstractmethod
    def resolve(self, w: Workload) -> "DeclaredProcess":
        """The running worker of ``w`` (its host PID; 0 where the node never acts on its processes).

        Raises:
            WorkloadNotFound: it does not run (nothing declared to dump).
            UndeclaredProcess: what runs is not the declared worker.
        """

    @abstractmethod
    def stop(self, w: Workload, grace_s: float = 30) -> Stopped:
        """Stop the worker (TERM, KILL after ``grace_s``); ``{"stopped": False, ...}`` when it does not run."""

    def clear_leftovers(self, w: Workload) -> list[str]:
        """The worker is gone: remove what it left on the node (default: nothing; names removed)."""
        return []

    # --- checkpoint ---------------------------------------------------------------------------
    def fingerprint(self, w: Workload) -> Fingerprint:
        """What a restore of ``w``'s checkpoints must match (the node's, with ``w``'s engine and model)."""
        return workload_fingerprint(w, self._node().node_fp)

    def refuse(self, w: Workload, proc: "DeclaredProcess") -> None:
        """Refuse, before the probe and the store are touched, what this runtime cannot dump."""

    def record(self, w: Workload, proc: "DeclaredProcess", state: ManifestProbe) -> ManifestProbe:
        """The probe the manifest records, with what this runtime adds (default: as probed)."""
        return state

    @abstractmethod
    def dump(self, w: Workload, proc: "DeclaredProcess", images_dir: Path, leave_running: bool) -> "Dumped":
        """Write ``w``'s image into ``images_dir`` (the pending checkpoint, discarded on any error).

        Raises:
            CriuError: the dump failed (with ``leave_running`` the worker runs on).
        """

    def dump_failed(self, w: Workload, proc: "DeclaredProcess", e: CriuError) -> CriuError | None:
        """A plainer error than ``e`` for a failed dump, or None (default)."""
        return None

    def dumped(self, w: Workload, leave_running: bool) -> None:
        """After the manifest is committed (default: nothing)."""

    # --- restore ------------------------------------------------------------------------------
    @abstractmethod
    def clear(self, w: Workload) -> None:
        """Before a restore in place, the workload lock held: refuse a running worker, remove what
        a dead one (or an interrupted restore) left under its name.

        Raises:
            WorkloadRunning: the worker runs (nothing to recover).
        """

    def preflight(self, w: Workload, m: Manifest, gpu_pairs: list[tuple[str, str]] | None) -> None:
        """Refuse ``m`` before anything is restored, for a reason that is not the checkpoint's (default: none)."""

    @abstractmethod
    def restore(self, w: Workload, m: Manifest, timings: dict[str, float]) -> int:
        """Restore ``m`` in place, its bytes checked, its phases timed into ``timings``; the restored PID.

        Raises:
            ChecksumMismatch: the image's bytes differ (nothing runs; the next candidate is tried).
            CkptflowError: the restore failed (counted against the checkpoint).
        """

    def resumed(self, w: Workload, pid: int, m: Manifest, gpu_pairs: list[tuple[str, str]] | None,
                timings: dict[str, float]) -> None:
        """After the restore, before the health check (default: nothing)."""

    def serving(self, w: Workload, pid: int, m: Manifest, timings: dict[str, float]) -> None:
        """After health and the session check: the restored worker does real work (default: nothing more)."""

    # --- verify -------------------------------------------------------------------------------
    @abstractmethod
    def verify_copy(self, w: Workload, m: Manifest, t: dict[str, float], timeout_s: float = 120,
                    inspect_copy: Callable | None = None) -> "VerifyResult":
        """A copy of ``m`` beside the running original (its fingerprint and bytes passed already),
        asked and compared with the checkpoint, and removed; ``t``: the timings so far. Never
        raises for a bad checkpoint (that is the result). ``inspect_copy``: called with the
        running copy, where the runtime has one to show (tests)."""

    # --- cold start ---------------------------------------------------------------------------
    def can_cold_start(self, w: Workload) -> bool:
        """Whether ``w`` declares how to start it from scratch (default: a ``start_command``)."""
        return bool(w.start_command)

    def cold_start(self, w: Workload, timeout_s: float = COLD_START_TIMEOUT_S) -> tuple[int, float]:
        """Start ``w`` from scratch and wait until healthy: (PID, seconds). Default: its ``start_command``.

        Raises:
            RestoreFailed: nothing declared to start it from, or it never became healthy.
        """
        return run_start_command(w, timeout_s)

    def refuse_replica(self, w: Workload) -> None:
        """Refuse a scale-up replica (a copy from a template, beside the original) where this runtime has none.

        Raises:
            UnsupportedWorkload: not built for this runtime (the default: replicas are CRIU copies
                in a network namespace of their own, which only the process runtime makes).
        """
        raise UnsupportedWorkload(f"workload {w.name}: scale-up replicas are not built for the {self.name} runtime",
                                  fix="start another worker the runtime's own way")


def register_runtime(name: str) -> Callable[[R], R]:
    """Register a ``WorkloadRuntime`` subclass as ``name`` (a fleet file's ``runtime: <name>``)."""

    def add(cls: R) -> R:
        cls.name = name
        WORKLOAD_RUNTIMES.add(name, cls)
        return cls

    return add


def get_runtime(name: str) -> type[WorkloadRuntime]:
    """The runtime registered as ``name``.

    Raises:
        ConfigError: an unknown name (``Registry.unknown``'s line).
    """
    cls = WORKLOAD_RUNTIMES.get(name)
    if cls is None:
        raise ConfigError(WORKLOAD_RUNTIMES.unknown(name), fix="name a registered runtime, or leave runtime out")
    return cls


def runtime_name(w: Workload) -> str:
    """The runtime ``w`` runs under: its ``runtime:``, else the one its declaration names (the one
    place that reads which of ``find:``, ``container:`` and ``container.kubernetes:`` it gives)."""
    if w.runtime:
        return w.runtime
    if w.container is None:
        return "process"
    return "pod" if w.container.kubernetes is not None else w.container.runtime.value


def runtime_for(w: Workload, node: "NodeRunner | None" = None) -> WorkloadRuntime:
    """``w``'s runtime on ``node`` (None: for the steps that need no node runner)."""
    return get_runtime(runtime_name(w))(node)

