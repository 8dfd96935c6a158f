"""The CUDA backend: NVIDIA's driver checkpoint API (runners/cuda.py) and NVML behind ``GpuBackend``.

Every call goes through the ``runners.cuda`` module at call time, so what is measured and
refused there (the driver's state machine, NVML's footprint, the per-GPU memory gate) is
exactly what a node running CUDA workers did before backends had names.

Example:
    >>> from ckptflow.runners.gpu import get_backend
    >>> cuda = get_backend("cuda")                # loads no driver yet
    >>> cuda.available()                          # doctest: +SKIP
    (False, "cuda-bindings not installed (pip install 'ckptflow[gpu]'); no cuda-checkpoint binary on PATH")
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ckptflow.runners import cuda as C
from ckptflow.runners.gpu import DeviceState, GpuBackend, register_backend

if TYPE_CHECKING:
    from ckptflow.runners.cuda import CudaProcess, CudaRunner

_STATES = {C.ProcessState.RUNNING: DeviceState.running, C.ProcessState.LOCKED: DeviceState.locked,
           C.ProcessState.CHECKPOINTED: DeviceState.checkpointed, C.ProcessState.FAILED: DeviceState.failed}


@register_backend("cuda")
class CudaBackend(GpuBackend):
    """cuCheckpointProcess* through a ``CudaRunner``; NVML for footprints, free memory and the
    fingerprint. ``runner``: one built already (a test's simulated driver); default: built at the
    first step, which loads cuda-bindings or finds the cuda-checkpoint binary."""

    usage_source = "NVML"
    restores_isolated_copy = True   # see GpuBackend: an isolated worker's copy, by its host PIDs

    def __init__(self, runner: "CudaRunner | Any | None" = None):
        self._runner = runner

    @property
    def runner(self) -> "CudaRunner":
        if self._runner is None:  # imports the driver bindings only when a GPU worker is handled
            self._runner = C.CudaRunner()
        return self._runner

    def available(self) -> tuple[bool, str]:
        return self.runner.available()

    def processes(self, root_pid: int) -> list[int]:
        return C.cuda_pids(root_pid)

    def usage(self, pids: list[int]) -> dict[int, dict[str, int]]:
        return C.process_gpu_usage(pids)

    def free_by_device(self) -> dict[str, int]:
        return C.gpu_free_by_uuid()

    def fingerprint_fields(self) -> tuple[dict[str, Any], str | None]:
        return nvml_fingerprint_fields()

    def lock(self, pids: list[int], usage: dict[int, dict[str, int]] | None = None,
             explain: Callable[[], str] | None = None) -> list["CudaProcess"]:
        return self.runner.lock(pids, None, explain, usage)

    @contextmanager
    def locked(self, pids: list[int], usage: dict[int, dict[str, int]] | None = None,
               explain: Callable[[], str] | None = None) -> Iterator[list["CudaProcess"]]:
        # The runner's own: its cleanup reports each PID's exact driver state.
        with self.runner.locked(pids, None, explain=explain, usage=usage) as procs:
            yield procs

    def checkpoint(self, procs: list["CudaProcess"]) -> None:
        self.runner.checkpoint(procs)

    def restore(self, procs: list["CudaProcess"], *, device_map: list[tuple[str, str]] | None = None,
                need_by_device: dict[str, int] | None = None, footprint_bytes: int = 0) -> None:
        self.runner.restore(procs, footprint_bytes=footprint_bytes, gpu_pairs=device_map, need_by_gpu=need_by_device)

    def unlock(self, procs: list["CudaProcess"]) -> None:
        self.runner.unlock(procs)

    def recover(self, procs: list["CudaProcess"]) -> list[str]:
        return self.runner.unlock_all(procs)

    def state(self, pid: int) -> DeviceState:
        return _STATES[self.runner.state(pid)]

    def checkpointed(self, pids: list[int]) -> list["CudaProcess"]:
        # CRIU gives every process its PID back; after a CUDA checkpoint they hold no GPU files,
        # so the ranks are known only from the manifest (or, for an older one, the tree).
        return [C.CudaProcess(p, state=C.ProcessState.CHECKPOINTED) for p in pids]


def nvml_fingerprint_fields() -> tuple[dict[str, Any], str | None]:
    """GPU model, count, UUIDs, driver and CUDA driver version from NVML, or ({}, why not)."""
    try:
        import pynvml
    except ImportError:
        return {}, "pynvml missing (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:  # NVMLError_LibraryNotFound on a machine without a driver
        return {}, f"no NVML: {e}"
    try:
        n = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]

        def s(v):
            return v.decode() if isinstance(v, bytes) else v

        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        return {"gpu_model": s(pynvml.nvmlDeviceGetName(handles[0])) if handles else None,
                "gpu_count": n, "gpu_uuids": [s(pynvml.nvmlDeviceGetUUID(h)) for h in handles],
                "driver": s(pynvml.nvmlSystemGetDriverVersion()),
                "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}"}, None
    except pynvml.NVMLError as e:
        return {}, f"NVML query failed: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
