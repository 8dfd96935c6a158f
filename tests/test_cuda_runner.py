"""The CUDA runner's logic on CPU, against a simulated driver (a GPU cannot exist on CI).

The real driver path runs in bench/gpu_checkpoint.py on the H200 (results in bench/RESULTS.md).
"""

import threading

import pytest

from ckptflow.errors import CudaCheckpointError, NotEnoughGpuMemory, RunnerUnavailable
from ckptflow.runners.cuda import CudaRunner, ProcessState, gate_gpu_memory, load_backend

OK, ILLEGAL, TIMEOUT, OOM = 0, 401, 909, 2
GIB = 2**30


class SimDriver:
    """Mirrors the driver's per-process state machine and its error codes."""

    name = "sim"

    def __init__(self, pids, fail=None):
        self.st = {p: ProcessState.RUNNING for p in pids}
        self.fail = fail or {}          # (step, pid) -> error code
        self.calls = []
        self.lock_ = threading.Lock()

    def _call(self, step, pid, frm, to):
        with self.lock_:
            self.calls.append((step, pid))
        if (step, pid) in self.fail:
            return self.fail[(step, pid)]
        if self.st.get(pid) != frm:
            return ILLEGAL
        self.st[pid] = to
        return OK

    def error_name(self, code):
        return {ILLEGAL: "401 CUDA_ERROR_ILLEGAL_STATE", TIMEOUT: "909 CUDA_ERROR_TIMEOUT", OOM: "2 OOM"}.get(code, str(code))

    def get_state(self, pid):
        return (OK, int(self.st[pid])) if pid in self.st else (1, 0)

    def lock(self, pid, timeout_ms):
        return self._call("lock", pid, ProcessState.RUNNING, ProcessState.LOCKED)

    def checkpoint(self, pid):
        return self._call("checkpoint", pid, ProcessState.LOCKED, ProcessState.CHECKPOINTED)

    def restore(self, pid, pairs):
        return self._call("restore", pid, ProcessState.CHECKPOINTED, ProcessState.LOCKED)

    def unlock(self, pid):
        return self._call("unlock", pid, ProcessState.LOCKED, ProcessState.RUNNING)


def test_full_heartbeat_sequence_over_several_pids():
    drv = SimDriver([10, 11, 12])
    cuda = CudaRunner(backend=drv)
    with cuda.locked([10, 11, 12]) as procs:
        cuda.checkpoint(procs)
        assert all(drv.st[p] == ProcessState.CHECKPOINTED for p in (10, 11, 12))
        cuda.restore(procs)
    assert all(s == ProcessState.RUNNING for s in drv.st.values())
    assert [c[0] for c in drv.calls].count("unlock") == 3
    assert all("checkpoint" in p.timings for p in procs)


@pytest.mark.fault
def test_lock_timeout_on_one_pid_unlocks_the_others():
    drv = SimDriver([1, 2, 3], fail={("lock", 2): TIMEOUT})
    cuda = CudaRunner(backend=drv)
    with pytest.raises(CudaCheckpointError, match="lock failed: PID 2: 909 CUDA_ERROR_TIMEOUT"):
        cuda.lock([1, 2, 3])
    assert drv.st == {1: ProcessState.RUNNING, 2: ProcessState.RUNNING, 3: ProcessState.RUNNING}


def test_failure_after_checkpoint_restores_and_unlocks_every_pid():
    drv = SimDriver([1, 2])
    cuda = CudaRunner(backend=drv)
    with pytest.raises(RuntimeError, match="criu dump failed"):
        with cuda.locked([1, 2]) as procs:
            cuda.checkpoint(procs)
            raise RuntimeError("criu dump failed")
    assert drv.st == {1: ProcessState.RUNNING, 2: ProcessState.RUNNING}
    assert ("restore", 1) in drv.calls and ("unlock", 2) in drv.calls


def test_stuck_state_is_reported_exactly():
    drv = SimDriver([1], fail={("restore", 1): 304})
    cuda = CudaRunner(backend=drv)
    with pytest.raises(CudaCheckpointError, match="PID 1 left CHECKPOINTED"):
        with cuda.locked([1]) as procs:
            cuda.checkpoint(procs)
            raise RuntimeError("boom")


def test_state_checked_before_each_step():
    drv = SimDriver([1])
    cuda = CudaRunner(backend=drv)
    procs = cuda.lock([1])
    with pytest.raises(CudaCheckpointError, match="cannot restore: expected CHECKPOINTED: PID 1 is LOCKED"):
        cuda.restore(procs)
    assert ("restore", 1) not in drv.calls  # refused before calling the driver
    cuda.unlock(procs)
    with pytest.raises(CudaCheckpointError, match="cannot lock: expected RUNNING"):
        drv.st[1] = ProcessState.FAILED
        cuda.lock([1])


@pytest.mark.fault
def test_memory_gate_refuses_before_restoring():
    drv = SimDriver([1])
    cuda = CudaRunner(backend=drv)
    procs = cuda.lock([1])
    cuda.checkpoint(procs)
    with pytest.raises(NotEnoughGpuMemory, match=r"7.0 GiB free on the GPU < 9.0 GiB needed"):
        cuda.restore(procs, footprint_bytes=8 * GIB, free_bytes=7 * GIB)
    assert drv.st[1] == ProcessState.CHECKPOINTED  # untouched, still restorable
    cuda.restore(procs, footprint_bytes=8 * GIB, free_bytes=10 * GIB)
    assert drv.st[1] == ProcessState.LOCKED


def test_gate_margin_and_zero_footprint():
    gate_gpu_memory(0, 0)
    gate_gpu_memory(GIB, 2 * GIB)
    with pytest.raises(NotEnoughGpuMemory):
        gate_gpu_memory(GIB, 2 * GIB - 1)


def test_unavailable_without_a_driver_says_why():
    backend, why = load_backend()
    if backend is not None:
        pytest.skip("a CUDA driver is present here")
    cuda = CudaRunner()
    ok, reason = cuda.available()
    assert not ok and "cuda-bindings" in reason
    with pytest.raises(RunnerUnavailable, match="CUDA checkpoint unavailable"):
        cuda.lock([1])


def test_nvml_missing_is_a_clear_unavailable():
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML present here")
    except pynvml.NVMLError:
        pass
    with pytest.raises(RunnerUnavailable, match="NVML unavailable"):
        gate_gpu_memory(GIB)
