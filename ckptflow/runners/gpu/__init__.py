"""GPU backends: what a vendor's driver does for a checkpoint, behind one interface.

A node declares its backend in the fleet file (``cuda`` when it says nothing)::

    nodes:
      - {name: gpu-node-01, work_pool: gpu-node-01, gpu_class: H200-141GB, gpus: 8, gpu_backend: cuda}

The node runner (runners/node.py) owns the sequence around a GPU worker's checkpoint (engine
quiesce, footprint refusal, lock -> checkpoint -> CRIU dump -> restore -> unlock, cleanup on any
failure, timings) and calls the backend for each device step; a backend owns only what its
driver does. ``backend_for(w, node_backend)`` is the one place that decides whether a workload
has device state at all: a CPU workload gets ``NO_GPU``, whose steps are no-ops.

A backend implements (docs/extending/gpu-backend.md walks through adding one):

| method | what it does |
|--------|--------------|
| ``available()`` | (True, "") or (False, why): checked before any step |
| ``processes(root_pid)`` | the PIDs of the worker's tree that hold device state |
| ``usage(pids)`` | footprint per device: {pid: {device UUID: bytes}}; raises when it cannot say |
| ``free_by_device()`` | free bytes per device UUID of this node (the restore's memory gate) |
| ``fingerprint_fields()`` | (fields of ``models.Fingerprint``, why they are empty) |
| ``lock(pids, usage, explain)`` | stop new device work in every PID, or in none; handles with ``.pid`` |
| ``checkpoint(procs)`` | device memory into the process's host memory; devices released |
| ``restore(procs, device_map=, need_by_device=)`` | device memory back (old -> new UUIDs), gated first |
| ``unlock(procs)`` | device work allowed again |
| ``recover(procs)`` | best effort after a failure: back to running; what stayed stuck |
| ``state(pid)`` | ``DeviceState`` of one PID |
| ``checkpointed(pids)`` | handles of a CRIU-restored worker's PIDs, whose device state is checkpointed |

Registered by name (``@register_backend("cuda")``) in ``BACKENDS``; the fleet loader checks a
node's ``gpu_backend`` against it.

Example:
    >>> sorted(BACKENDS)
    ['cuda']
    >>> get_backend("cuda").name
    'cuda'
    >>> get_backend("rocm")
    Traceback (most recent call last):
    ...
    ckptflow.errors.ConfigError: unknown GPU backend 'rocm' (known: cuda)
      fix: set the node's gpu_backend: to a registered backend
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, TypeVar

from ckptflow.errors import ConfigError, GpuCheckpointError, NotEnoughGpuMemory
from ckptflow.policies.compat import gate_group
from ckptflow.registry import GPU_BACKENDS

if TYPE_CHECKING:
    from ckptflow.models import Workload

RESTORE_MARGIN_GIB = 1.0     # context and allocator slack beyond the recorded footprint (as the CUDA runner's)
DEFAULT_BACKEND = "cuda"     # what a node that names none gets: every GPU node so far


class DeviceState(StrEnum):
    """Where one process's device state is; the states every backend maps its driver's onto."""

    running = "running"              # device work allowed
    locked = "locked"                # no new device work; in-flight work finished
    checkpointed = "checkpointed"    # device memory held in host memory; devices released
    failed = "failed"                # the driver says the process cannot be used any more


class GpuBackend(ABC):
    """One vendor's device checkpoint: see the module docstring for each method's contract."""

    name: ClassVar[str] = ""
    gated: ClassVar[tuple[str, ...]] = ("gpu",)   # fingerprint groups a restore must match (policies.compat.GATED)
    # Fields of its own that ``fingerprint_fields`` fills and a restore must match (a runtime or
    # firmware version the ``gpu`` group does not name): registering the backend gates them as
    # group ``gpu-<name>`` and adds it to ``gated``.
    gated_fields: ClassVar[tuple[str, ...]] = ()
    usage_source: ClassVar[str] = "the driver"    # who measures footprints, as errors name it
    # Whether a CRIU copy of a checkpointed worker can get its device state back beside the
    # running original (a sandbox verify, a template replica). CUDA cannot: measured on the H200,
    # runners/verify.py GPU_SANDBOX.
    restores_beside: ClassVar[bool] = False
    # Whether it can when the worker was started isolated (runners/isolate.py: PID 1 of its own
    # PID and mount namespaces), asked with the copy's host PIDs. CUDA can: measured on the H200
    # (driver 580.159.04, bench/results/gpu_pidns.json, born_in_namespace, layout "init").
    restores_isolated_copy: ClassVar[bool] = False

    @abstractmethod
    def available(self) -> tuple[bool, str]:
        """(True, "") where this node can checkpoint device state, else (False, the reason)."""

    @abstractmethod
    def processes(self, root_pid: int) -> list[int]:
        """The PIDs of ``root_pid``'s tree that hold device state (at least ``root_pid``)."""

    @abstractmethod
    def usage(self, pids: list[int]) -> dict[int, dict[str, int]]:
        """Device memory of each of ``pids``: {pid: {device UUID: bytes}} (a PID without any is absent).

        Raises:
            RunnerUnavailable: the driver cannot say; the caller refuses the checkpoint (a footprint
                read as 0 would let any restore of it through the memory gate).
        """

    @abstractmethod
    def free_by_device(self) -> dict[str, int]:
        """Free memory of each device of this node, by UUID.

        Raises:
            RunnerUnavailable: the driver cannot say (no restore is gated on a guess).
        """

    @abstractmethod
    def fingerprint_fields(self) -> tuple[dict[str, Any], str | None]:
        """The device fields of this node's fingerprint (``gpu_model``, ``gpu_count``, ``gpu_uuids``,
        ``driver``, and the backend's own), or ({}, why they are unknown)."""

    @abstractmethod
    def lock(self, pids: list[int], usage: dict[int, dict[str, int]] | None = None,
             explain: Callable[[], str] | None = None) -> list[Any]:
        """Lock every PID or none; handles (each with ``.pid``) for the next steps. ``explain``
        says what the engine was doing, for the error of a lock that timed out."""

    @abstractmethod
    def checkpoint(self, procs: list[Any]) -> None:
        """Locked -> checkpointed: device memory into each process's host memory."""

    @abstractmethod
    def restore(self, procs: list[Any], *, device_map: list[tuple[str, str]] | None = None,
                need_by_device: dict[str, int] | None = None, footprint_bytes: int = 0) -> None:
        """Checkpointed -> locked, onto ``device_map``'s new UUIDs (old -> new). Refuses first when
        a device has less free memory than ``need_by_device`` says it needs (``footprint_bytes``:
        the whole footprint, for a checkpoint that recorded no split).

        Raises:
            NotEnoughGpuMemory: the processes stay checkpointed, intact.
        """

    @abstractmethod
    def unlock(self, procs: list[Any]) -> None:
        """Locked -> running."""

    @abstractmethod
    def recover(self, procs: list[Any]) -> list[str]:
        """After a failure: bring every process still there back to running (restore, unlock)
        as far as it goes; one line per process left otherwise. Never raises."""

    @abstractmethod
    def state(self, pid: int) -> DeviceState:
        """Where ``pid``'s device state is."""

    @abstractmethod
    def checkpointed(self, pids: list[int]) -> list[Any]:
        """Handles of processes CRIU just restored: their device state is checkpointed."""

    # --- shared behaviour a backend may refine ----------------------------------------------
    def gate_memory(self, need_by_device: dict[str, int], footprint_bytes: int = 0) -> None:
        """Refuse a restore that would not fit: each device against its own share, else (a
        checkpoint that recorded only a total) the whole footprint against the freest device.

        Raises:
            NotEnoughGpuMemory: naming each device short of memory.
            RunnerUnavailable: free memory cannot be read.
        """
        gate_memory(need_by_device, footprint_bytes, self.free_by_device)

    def gate_restore(self, workload: str, checkpoint: str, need_by_device: dict[str, int],
                     footprint_bytes: int) -> None:
        """``gate_memory`` before any CRIU call, and a checkpoint that recorded no footprint at all
        is refused (nothing to check it against), not waved through."""
        if not need_by_device and not footprint_bytes:
            raise NotEnoughGpuMemory(
                f"checkpoint {checkpoint} of GPU workload {workload} recorded no GPU footprint, so free GPU memory "
                "cannot be checked before its restore; not restoring (one that runs out of memory breaks the worker)",
                fix="take a new checkpoint with this ckptflow (it refuses to checkpoint when NVML cannot say), "
                    "or cold start the worker")
        self.gate_memory(need_by_device, footprint_bytes)

    @contextmanager
    def locked(self, pids: list[int], usage: dict[int, dict[str, int]] | None = None,
               explain: Callable[[], str] | None = None) -> Iterator[list[Any]]:
        """Lock on entry; on any exception inside, ``recover`` every process, then re-raise (with
        what stayed stuck added). On a clean exit, unlock the processes still locked (after a
        migration's dump they are gone)."""
        procs = self.lock(pids, usage, explain)
        try:
            yield procs
        except BaseException as e:
            stuck = self.recover(procs)
            if stuck:
                raise GpuCheckpointError(f"{e}; cleanup: {'; '.join(stuck)}") from e
            raise
        else:
            still = [p for p in procs if _state_or_none(self, p.pid) == DeviceState.locked]
            if still:
                self.unlock(still)


def _state_or_none(backend: GpuBackend, pid: int) -> DeviceState | None:
    try:
        return backend.state(pid)
    except Exception:  # gone (dumped for a migration): nothing to unlock
        return None


class NoGpu(GpuBackend):
    """A workload without device state: every step does nothing, so the sequence around it is
    CRIU alone."""

    name = "none"
    gated = ()
    restores_beside = True

    def available(self) -> tuple[bool, str]:
        return True, ""

    def processes(self, root_pid: int) -> list[int]:
        return []

    def usage(self, pids: list[int]) -> dict[int, dict[str, int]]:
        return {}

    def free_by_device(self) -> dict[str, int]:
        return {}

    def fingerprint_fields(self) -> tuple[dict[str, Any], str | None]:
        return {}, "no GPU backend"

    def lock(self, pids, usage=None, explain=None) -> list[Any]:
        return []

    def checkpoint(self, procs) -> None:
        pass

    def restore(self, procs, *, device_map=None, need_by_device=None, footprint_bytes=0) -> None:
        pass

    def unlock(self, procs) -> None:
        pass

    def recover(self, procs) -> list[str]:
        return []

    def state(self, pid: int) -> DeviceState:
        return DeviceState.running

    def checkpointed(self, pids: list[int]) -> list[Any]:
        return []

    def gate_restore(self, workload, checkpoint, need_by_device, footprint_bytes) -> None:
        pass  # no device memory to fit


NO_GPU = NoGpu()

B = TypeVar("B", bound=type[GpuBackend])
BACKENDS: dict[str, type[GpuBackend]] = GPU_BACKENDS.entries  # the registry's (registry.py): fleet.py checks names there


def register_backend(name: str) -> Callable[[B], B]:
    """Register a ``GpuBackend`` class under ``name`` (what a node's ``gpu_backend:`` names).
    Its ``gated_fields``, if any, become fingerprint group ``gpu-<name>`` (policies.compat
    ``gate_group``), which its ``gated`` then names: a restore refuses a checkpoint whose value
    of one of them differs from this node's."""
    def add(cls: B) -> B:
        cls.name = name
        if cls.gated_fields:
            group = gate_group(f"gpu-{name}", tuple(cls.gated_fields))
            cls.gated = tuple(g for g in cls.gated if not g.startswith("gpu-")) + (group,)
        GPU_BACKENDS.add(name, cls)
        return cls
    return add


def unknown_backend(name: str) -> str:
    """The line that refuses backend ``name`` (``registry.Registry.unknown``'s)."""
    return GPU_BACKENDS.unknown(name)


def get_backend(name: str | None = None, **kwargs: Any) -> GpuBackend:
    """A new instance of the backend registered as ``name`` (default: ``cuda``). Building one
    loads no driver: that happens at its first step.

    Raises:
        ConfigError: no backend of that name, naming the known ones.
    """
    try:
        cls = BACKENDS[name or DEFAULT_BACKEND]
    except KeyError:
        raise ConfigError(unknown_backend(str(name)),
                          fix="set the node's gpu_backend: to a registered backend") from None
    return cls(**kwargs)


def holds_device_state(w: "Workload") -> bool:
    """Whether ``w`` holds device memory (the one place that reads ``Workload.gpu``)."""
    return w.gpu


def backend_for(w: "Workload", node_backend: GpuBackend) -> GpuBackend:
    """The backend that handles ``w``'s device state: the node's for a GPU workload, else NO_GPU."""
    return node_backend if holds_device_state(w) else NO_GPU


# --- what every backend shares: which memory a restore needs where --------------------------------
def restore_needs(footprints: dict[str, int], device_map: list[tuple[str, str]] | None = None,
                  taken_on: list[str] | None = None, here: list[str] | None = None) -> dict[str, int]:
    """What a restore needs on each device of this node: the checkpoint's bytes per device (by the
    UUID it ran on), moved to where the restore puts them — ``device_map`` (old -> new UUID), else
    the same device when this node has it, else the device of the same index (``taken_on``: the
    checkpoint node's UUIDs in index order; ``here``: this node's).

    Example:
        >>> restore_needs({"GPU-a": 5, "GPU-b": 7}, [("GPU-a", "GPU-b"), ("GPU-b", "GPU-a")])
        {'GPU-b': 5, 'GPU-a': 7}
        >>> restore_needs({"GPU-a": 5}, taken_on=["GPU-x", "GPU-a"], here=["GPU-0", "GPU-1"])
        {'GPU-1': 5}
    """
    pairs = dict(device_map or [])
    out: dict[str, int] = {}
    for old, need in footprints.items():
        new = pairs.get(old, old)
        if new == old and here and old not in here and taken_on and old in taken_on and taken_on.index(old) < len(here):
            new = here[taken_on.index(old)]
        out[new] = out.get(new, 0) + need
    return out


def gate_memory(need_by_device: dict[str, int] | None, footprint_bytes: int,
                free_by_device: Callable[[], dict[str, int]], margin_gib: float = RESTORE_MARGIN_GIB) -> None:
    """The one GPU memory gate of a restore (the node's before CRIU, a backend's before its device
    restore, the cleanup of a failed checkpoint): each target device against its own share
    (``need_by_device``: every rank of a TP worker on its own device, so a rank whose device lacks
    room is refused even when the sum would fit on another), else, for a checkpoint that recorded
    only a total, the whole ``footprint_bytes`` against the freest device. ``free_by_device`` is
    read only when something must fit.

    Example:
        >>> gate_memory({"GPU-a": 20 * 2**30, "GPU-b": 20 * 2**30}, 40 * 2**30,
        ...             lambda: {"GPU-a": 10 * 2**30, "GPU-b": 100 * 2**30})
        Traceback (most recent call last):
        ...
        ckptflow.errors.NotEnoughGpuMemory: not restoring: GPU-a: 10.0 GiB free < 21.0 GiB needed (footprint 20.0 GiB + 1 GiB margin); a restore that runs out of memory breaks the worker for good
          fix: free GPU memory on those GPUs (stop or move another worker), remap the worker onto GPUs with room (gpu_pairs), or restore on another node

    Raises:
        NotEnoughGpuMemory: naming each device short of memory.
        RunnerUnavailable: free memory cannot be read (from ``free_by_device``).
    """
    if need_by_device:
        gate_per_device(need_by_device, free_by_device(), margin_gib)
    elif footprint_bytes:
        gate_total(footprint_bytes, max(free_by_device().values(), default=0), margin_gib)


def gate_total(footprint_bytes: int, free_bytes: int, margin_gib: float = RESTORE_MARGIN_GIB) -> None:
    """Raise NotEnoughGpuMemory unless ``free_bytes`` >= footprint + margin (one device holds it all)."""
    if not footprint_bytes:
        return
    need = footprint_bytes + int(margin_gib * 2**30)
    if free_bytes < need:
        raise NotEnoughGpuMemory(
            f"{free_bytes / 2**30:.1f} GiB free on the GPU < {need / 2**30:.1f} GiB needed "
            f"(footprint {footprint_bytes / 2**30:.1f} GiB + {margin_gib:g} GiB margin); not restoring: a restore "
            "that runs out of memory breaks the worker for good",
            fix="free GPU memory (stop or move another worker) or restore on another node")


def gate_per_device(need_by_device: dict[str, int], free: dict[str, int],
                    margin_gib: float = RESTORE_MARGIN_GIB) -> None:
    """Raise NotEnoughGpuMemory unless every device has free >= what is needed on it + margin.

    ``need_by_device``: target UUID -> bytes (a TP-8 worker of 8 x 20 GiB needs 20 GiB + margin on
    each of its 8 devices, not 160 GiB on one). A target device this node does not have is refused.

    Example:
        >>> gate_per_device({"GPU-a": 20 * 2**30, "GPU-b": 20 * 2**30},
        ...                 {"GPU-a": 30 * 2**30, "GPU-b": 30 * 2**30})   # each fits its own GPU
    """
    margin = int(margin_gib * 2**30)
    short = []
    for uuid, need in sorted(need_by_device.items()):
        if uuid not in free:
            short.append(f"{uuid}: not on this node (its GPUs: {', '.join(sorted(free)) or 'none'})")
        elif need and free[uuid] < need + margin:
            short.append(f"{uuid}: {free[uuid] / 2**30:.1f} GiB free < {(need + margin) / 2**30:.1f} GiB needed "
                         f"(footprint {need / 2**30:.1f} GiB + {margin_gib:g} GiB margin)")
    if short:
        raise NotEnoughGpuMemory(
            f"not restoring: {'; '.join(short)}; a restore that runs out of memory breaks the worker for good",
            fix="free GPU memory on those GPUs (stop or move another worker), remap the worker onto GPUs with "
                "room (gpu_pairs), or restore on another node")


# Registration: each backend module registers itself on import.
from ckptflow.runners.gpu import cuda as _cuda  # noqa: E402,F401
