"""CUDA runner: the driver's process checkpoint API (cuCheckpointProcess*), no Prefect.

Driver docs: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CHECKPOINT.html
Measured on an H200 with driver 580 (README "GPU path"): checkpoint ~2 GB/s and restore
~6 GB/s per process; a restore without enough free GPU memory breaks the worker for good,
so ``restore`` refuses first (``NotEnoughGpuMemory``) unless the gate passes.

The controller needs no CUDA context of its own: ``cuInit(0)`` and the five calls below.
Several PIDs of one worker are validated first, then acted on in parallel; any failure
after a lock unlocks every PID that was locked (or reports its exact stuck state).

Example:
    >>> cuda = CudaRunner()                      # doctest: +SKIP
    >>> cuda.available()                          # (True, "") or (False, "why")
    >>> with cuda.locked([pid]) as procs:         # lock -> checkpoint ... restore -> unlock
    ...     cuda.checkpoint(procs)
    ...     criu.dump(...)
    ...     cuda.restore(procs)
"""

from __future__ import annotations

import enum
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ckptflow.errors import CudaCheckpointError, RunnerUnavailable

LOCK_TIMEOUT_MS = 10_000     # a worker mid-kernel finishes well within 10 s; longer means stuck
RESTORE_MARGIN_GIB = 1.0     # CUDA context and allocator slack beyond the recorded footprint


class ProcessState(enum.IntEnum):
    """Mirrors CUprocessState exactly."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


@dataclass
class CudaProcess:
    pid: int
    state: ProcessState = ProcessState.RUNNING
    footprint: int = 0          # GPU bytes NVML saw before the checkpoint (gates a restore)
    timings: dict[str, float] = field(default_factory=dict)
    gpus: dict[str, int] = field(default_factory=dict)  # GPU UUID -> bytes of ``footprint`` held there


class DriverBackend:
    """cuda.bindings.driver. Each call returns the CUresult code (0 = success)."""

    name = "cuda-bindings"

    def __init__(self) -> None:
        from cuda.bindings import driver as d  # optional extra: ckptflow[gpu]

        self.d = d
        err, = d.cuInit(0)
        if int(err) != 0:
            raise RunnerUnavailable(f"cuInit failed: {self._name(err)}", fix="check the NVIDIA driver (nvidia-smi)")

    def _name(self, err: Any) -> str:
        try:
            return f"{int(err)} {self.d.cuGetErrorName(err)[1].decode()}"
        except Exception:
            return str(int(err))

    def error_name(self, code: int) -> str:
        return self._name(self.d.CUresult(code))

    def get_state(self, pid: int) -> tuple[int, int]:
        err, st = self.d.cuCheckpointProcessGetState(pid)
        return int(err), (int(st) if st is not None else -1)  # no state comes with an error

    def lock(self, pid: int, timeout_ms: int) -> int:
        a = self.d.CUcheckpointLockArgs()
        a.timeoutMs = timeout_ms
        return int(self.d.cuCheckpointProcessLock(pid, a)[0])

    def checkpoint(self, pid: int) -> int:
        return int(self.d.cuCheckpointProcessCheckpoint(pid, None)[0])

    def restore(self, pid: int, gpu_pairs: list[tuple[str, str]] | None) -> int:
        args = None
        if gpu_pairs:
            args = self.d.CUcheckpointRestoreArgs()
            pairs = []
            for old, new in gpu_pairs:
                p = self.d.CUcheckpointGpuPair()
                p.oldUuid = _uuid(self.d, old)
                p.newUuid = _uuid(self.d, new)
                pairs.append(p)
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
        return int(self.d.cuCheckpointProcessRestore(pid, args)[0])

    def unlock(self, pid: int) -> int:
        return int(self.d.cuCheckpointProcessUnlock(pid, None)[0])


def _uuid(d: Any, text: str) -> Any:
    """The driver's own CUuuid of the GPU named ``text`` (NVML's "GPU-…" form). The bindings'
    CUuuid is read-only (cuda-bindings 13.x), so it is taken from cuDeviceGetUuid."""
    want = bytes.fromhex(text.removeprefix("GPU-").replace("-", ""))
    err, n = d.cuDeviceGetCount()
    for i in range(n if int(err) == 0 else 0):
        _, dev = d.cuDeviceGet(i)
        err, u = d.cuDeviceGetUuid(dev)
        raw = u.bytes if isinstance(u.bytes, bytes) else bytes(b & 0xFF for b in u.bytes)
        if int(err) == 0 and raw == want:
            return u
    raise CudaCheckpointError(f"no GPU with UUID {text} on this node", fix="pass UUIDs of this node's GPUs "
                              "(nvidia-smi -L) in the restore's GPU pairs")


class BinaryBackend:
    """Fallback: NVIDIA's `cuda-checkpoint` utility (pays ~2.7 s of driver start per call)."""

    name = "cuda-checkpoint"

    def __init__(self, path: str) -> None:
        self.path = path

    def _run(self, *args: str) -> tuple[int, str]:
        out = subprocess.run([self.path, *args], capture_output=True, text=True, timeout=300)
        return out.returncode, (out.stdout + out.stderr).strip()

    def error_name(self, code: int) -> str:
        return f"cuda-checkpoint exit {code}"

    def get_state(self, pid: int) -> tuple[int, int]:
        rc, out = self._run("--get-state", "--pid", str(pid))
        names = {s.name.lower(): s.value for s in ProcessState}
        return rc, names.get(out.split()[-1].lower(), ProcessState.FAILED) if out else ProcessState.FAILED

    def lock(self, pid: int, timeout_ms: int) -> int:
        return self._run("--action", "lock", "--pid", str(pid), "--timeout", str(timeout_ms))[0]

    def checkpoint(self, pid: int) -> int:
        return self._run("--action", "checkpoint", "--pid", str(pid))[0]

    def restore(self, pid: int, gpu_pairs: list[tuple[str, str]] | None) -> int:
        if gpu_pairs:
            raise CudaCheckpointError("GPU UUID remapping needs the driver API (pip install 'ckptflow[gpu]')")
        return self._run("--action", "restore", "--pid", str(pid))[0]

    def unlock(self, pid: int) -> int:
        return self._run("--action", "unlock", "--pid", str(pid))[0]


def load_backend() -> tuple[Any | None, str]:
    """The best available backend, or (None, the reason there is none)."""
    reasons = []
    try:
        return DriverBackend(), ""
    except ImportError:
        reasons.append("cuda-bindings not installed (pip install 'ckptflow[gpu]')")
    except RunnerUnavailable as e:
        reasons.append(str(e).splitlines()[0])
    except Exception as e:  # a driver library that is missing or too old surfaces here
        reasons.append(f"CUDA driver not usable: {e}")
    binary = shutil.which("cuda-checkpoint")
    if binary:
        return BinaryBackend(binary), ""
    reasons.append("no cuda-checkpoint binary on PATH")
    return None, "; ".join(reasons)


class CudaRunner:
    """Lock, checkpoint, restore and unlock the CUDA state of a worker's processes."""

    def __init__(self, backend: Any | None = None, lock_timeout_ms: int = LOCK_TIMEOUT_MS):
        if backend is None:
            backend, self._why = load_backend()
        else:
            self._why = ""
        self.backend = backend
        self.lock_timeout_ms = lock_timeout_ms

    def available(self) -> tuple[bool, str]:
        return self.backend is not None, self._why

    def _need(self) -> Any:
        if self.backend is None:
            raise RunnerUnavailable(f"CUDA checkpoint unavailable: {self._why}",
                                    fix="run GPU workers on a node with the NVIDIA driver >= 570 and ckptflow[gpu]")
        return self.backend

    # --- state ---------------------------------------------------------------------------
    def state(self, pid: int) -> ProcessState:
        err, st = self._need().get_state(pid)
        if err != 0:
            raise CudaCheckpointError(f"PID {pid}: cuCheckpointProcessGetState failed: "
                                      f"{self.backend.error_name(err)}",
                                      fix="the process holds no CUDA context, or has exited")
        return ProcessState(st)

    def _expect(self, procs: list[CudaProcess], want: ProcessState, step: str) -> None:
        bad = []
        for p in procs:
            p.state = self.state(p.pid)
            if p.state != want:
                bad.append(f"PID {p.pid} is {p.state.name}")
        if bad:
            raise CudaCheckpointError(f"cannot {step}: expected {want.name}: " + ", ".join(bad))

    def _each(self, procs: list[CudaProcess], step: str, fn) -> None:
        """Run ``fn(pid)`` for every process in parallel; gather failures into one error."""
        def one(p: CudaProcess) -> str | None:
            t0 = time.perf_counter()
            err = fn(p.pid)
            p.timings[step] = time.perf_counter() - t0
            return None if err == 0 else f"PID {p.pid}: {self.backend.error_name(err)}"

        with ThreadPoolExecutor(max_workers=max(1, len(procs))) as ex:
            errors = [e for e in ex.map(one, procs) if e]
        if errors:
            raise CudaCheckpointError(f"{step} failed: " + "; ".join(errors))

    # --- steps ---------------------------------------------------------------------------
    def lock(self, pids: list[int], footprints: dict[int, int] | None = None,
             explain: Callable[[], str] | None = None,
             usage: dict[int, dict[str, int]] | None = None) -> list[CudaProcess]:
        """Lock every process, or none. ``explain`` says what the engine's processes were doing,
        for the error of a lock that timed out (e.g. a rank inside a collective). ``usage``: each
        PID's bytes per GPU (``process_gpu_usage``), which gates the restore of a failed step."""
        usage = usage or {}
        procs = [CudaProcess(pid, footprint=(footprints or {}).get(pid, sum(usage.get(pid, {}).values())),
                             gpus=dict(usage.get(pid, {}))) for pid in pids]
        self._need()
        self._expect(procs, ProcessState.RUNNING, "lock")
        try:
            self._each(procs, "lock", lambda pid: self.backend.lock(pid, self.lock_timeout_ms))
        except CudaCheckpointError as e:
            self.unlock_all(procs)
            said = explain() if explain else ""
            if said:
                raise CudaCheckpointError(f"{e.message}\n  ranks: {said}", fix=e.fix) from e
            raise
        return procs

    def checkpoint(self, procs: list[CudaProcess]) -> None:
        self._expect(procs, ProcessState.LOCKED, "checkpoint")
        self._each(procs, "checkpoint", self.backend.checkpoint)

    def restore(self, procs: list[CudaProcess], *, footprint_bytes: int = 0,
                gpu_pairs: list[tuple[str, str]] | None = None, free_bytes: int | None = None,
                need_by_gpu: dict[str, int] | None = None, free_by_gpu: dict[str, int] | None = None) -> None:
        """Bring device memory back. Refuses first when free GPU memory is too small: each GPU's
        own free memory against what the worker's processes need on it (``need_by_gpu``, target
        GPU UUID -> bytes: a TP worker's ranks each on their GPU), else ``footprint_bytes`` against
        the GPU with the most free memory (one GPU process).

        Raises:
            NotEnoughGpuMemory: free < footprint + margin (the worker stays CHECKPOINTED, intact).
        """
        from ckptflow.runners.gpu import gate_memory

        self._expect(procs, ProcessState.CHECKPOINTED, "restore")
        gate_memory(need_by_gpu, footprint_bytes, _free(free_by_gpu, free_bytes))
        self._each(procs, "restore", lambda pid: self.backend.restore(pid, gpu_pairs))

    def unlock(self, procs: list[CudaProcess]) -> None:
        self._expect(procs, ProcessState.LOCKED, "unlock")
        self._each(procs, "unlock", self.backend.unlock)

    def unlock_all(self, procs: list[CudaProcess]) -> list[str]:
        """Best effort after a failure: restore and unlock whatever can be; report the rest."""
        stuck = []
        for p in procs:
            if not os.path.exists(f"/proc/{p.pid}"):
                continue  # dumped for a migration (or died): nothing left to unlock
            try:
                st = self.state(p.pid)
                if st == ProcessState.CHECKPOINTED:
                    from ckptflow.runners.gpu import gate_memory

                    gate_memory(p.gpus, p.footprint, gpu_free_by_uuid)  # each GPU it held, against its own free memory
                    if self.backend.restore(p.pid, None) == 0:
                        st = ProcessState.LOCKED
                if st == ProcessState.LOCKED and self.backend.unlock(p.pid) == 0:
                    st = ProcessState.RUNNING
                p.state = st
                if st != ProcessState.RUNNING:
                    stuck.append(f"PID {p.pid} left {st.name}")
            except Exception as e:  # never let cleanup hide the first error
                stuck.append(f"PID {p.pid}: {e}")
        return stuck

    @contextmanager
    def locked(self, pids: list[int], footprints: dict[int, int] | None = None,
               explain: Callable[[], str] | None = None,
               usage: dict[int, dict[str, int]] | None = None) -> Iterator[list[CudaProcess]]:
        """Lock on entry; on any exception inside, restore + unlock every PID, then re-raise."""
        procs = self.lock(pids, footprints, explain, usage)
        try:
            yield procs
        except BaseException as e:
            stuck = self.unlock_all(procs)
            if stuck:
                raise CudaCheckpointError(f"{e}; cleanup: {'; '.join(stuck)}") from e
            raise
        else:
            # After a migrate dump the processes are gone; unlock only those still locked.
            locked = [p for p in procs if self.backend.get_state(p.pid) == (0, ProcessState.LOCKED)]
            if locked:
                self.unlock(locked)


# --- NVML: free memory and the GPU fields of a fingerprint -----------------------------------
def _free(free_by_gpu: dict[str, int] | None, free_bytes: int | None) -> Callable[[], dict[str, int]]:
    """What the memory gate reads as free memory: given per GPU or as one GPU's bytes, else NVML's."""
    if free_by_gpu is not None:
        return lambda: free_by_gpu
    if free_bytes is not None:
        return lambda: {"GPU": free_bytes}
    return gpu_free_by_uuid


def gate_gpu_memory(footprint_bytes: int, free_bytes: int | None = None,
                    margin_gib: float = RESTORE_MARGIN_GIB) -> None:
    """Raise NotEnoughGpuMemory unless the freest GPU (NVML, or ``free_bytes``) has footprint + margin
    (``runners.gpu.gate_memory`` for a checkpoint that recorded only a total)."""
    from ckptflow.runners.gpu import gate_memory

    gate_memory(None, footprint_bytes, _free(None, free_bytes), margin_gib)


def gpu_free_by_uuid() -> dict[str, int]:
    """Free memory of each GPU of this node, by UUID (NVML).

    Raises:
        RunnerUnavailable: NVML cannot be read (no GPU here, no driver, or an NVML error).
    """
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise RunnerUnavailable(f"NVML unavailable: {e}", fix="no GPU here, or the driver is not loaded") from None
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out[_text(pynvml.nvmlDeviceGetUUID(h))] = pynvml.nvmlDeviceGetMemoryInfo(h).free
        return out
    except pynvml.NVMLError as e:
        raise RunnerUnavailable(f"NVML could not read the GPUs' free memory: {e}",
                                fix="check the driver (nvidia-smi); no restore is gated on a guess") from None
    finally:
        pynvml.nvmlShutdown()


def gate_gpu_memory_per_gpu(need_by_gpu: dict[str, int], free_by_gpu: dict[str, int] | None = None,
                            margin_gib: float = RESTORE_MARGIN_GIB) -> None:
    """Raise NotEnoughGpuMemory unless every GPU has free >= what is needed on it + margin.

    ``need_by_gpu``: target GPU UUID -> bytes (a TP-8 worker of 8 x 20 GiB needs 20 GiB + margin
    on each of its 8 GPUs, not 160 GiB on one). A target GPU this node does not have is refused.

    Example:
        >>> gate_gpu_memory_per_gpu({"GPU-a": 20 * 2**30, "GPU-b": 20 * 2**30},
        ...                         {"GPU-a": 30 * 2**30, "GPU-b": 30 * 2**30})   # each fits its own GPU
    """
    from ckptflow.runners.gpu import gate_memory

    gate_memory(need_by_gpu, 0, _free(free_by_gpu, None), margin_gib)


def restore_needs(gpu_footprints: dict[str, int], gpu_pairs: list[tuple[str, str]] | None = None,
                  taken_on: list[str] | None = None, here: list[str] | None = None) -> dict[str, int]:
    """What a restore needs on each GPU of this node: the checkpoint's bytes per GPU (by the UUID
    it ran on), moved to where the restore puts them — ``gpu_pairs`` (old -> new UUID), else the
    same GPU when this node has it, else the GPU of the same index (``taken_on``: the checkpoint
    node's UUIDs in index order; ``here``: this node's).

    Example:
        >>> restore_needs({"GPU-a": 5, "GPU-b": 7}, [("GPU-a", "GPU-b"), ("GPU-b", "GPU-a")])
        {'GPU-b': 5, 'GPU-a': 7}
        >>> restore_needs({"GPU-a": 5}, taken_on=["GPU-x", "GPU-a"], here=["GPU-0", "GPU-1"])
        {'GPU-1': 5}
    """
    from ckptflow.runners.gpu import restore_needs as needs

    return needs(gpu_footprints, gpu_pairs, taken_on, here)


def process_gpu_usage(pids: list[int]) -> dict[int, dict[str, int]]:
    """GPU memory NVML attributes to each of ``pids``, per GPU UUID ({pid: {uuid: bytes}}; a PID
    NVML does not list is absent).

    Raises:
        RunnerUnavailable: NVML cannot be read. The caller refuses the checkpoint: a footprint
            read as 0 would switch the restore's memory gate off.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:
        raise RunnerUnavailable(f"NVML unavailable, so the GPU footprint cannot be measured: {e}",
                                fix="check the driver (nvidia-smi) and nvidia-ml-py on the node") from None
    try:
        out: dict[int, dict[str, int]] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = None
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid in pids and p.usedGpuMemory:
                    uuid = uuid or _text(pynvml.nvmlDeviceGetUUID(h))
                    per = out.setdefault(p.pid, {})
                    per[uuid] = per.get(uuid, 0) + p.usedGpuMemory
        return out
    except pynvml.NVMLError as e:
        raise RunnerUnavailable(f"NVML could not list the GPU processes: {e}",
                                fix="check the driver (nvidia-smi); retry once it answers") from None
    finally:
        pynvml.nvmlShutdown()


def process_gpu_bytes(pids: list[int]) -> int:
    """GPU memory NVML attributes to ``pids``, all GPUs together.

    Raises:
        RunnerUnavailable: NVML cannot be read (see ``process_gpu_usage``).
    """
    return sum(b for per in process_gpu_usage(pids).values() for b in per.values())


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def cuda_pids(root_pid: int) -> list[int]:
    """The root PID and its descendants that hold /dev/nvidia* open (they carry CUDA state)."""
    from ckptflow.runners.process import tree

    pids = tree(root_pid)
    out = []
    for pid in pids:
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia") for fd in os.listdir(f"/proc/{pid}/fd")):
                out.append(pid)
        except OSError:
            pass
    return out or [root_pid]
