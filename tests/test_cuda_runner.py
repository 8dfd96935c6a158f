"""The CUDA runner's logic on CPU, against a simulated driver (a GPU cannot exist on CI).

The real driver path runs in bench/gpu_checkpoint.py on the H200 (results in bench/RESULTS.md).
"""

import os
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


# --- the memory gate per GPU, against a stand-in NVML ------------------------------------------
class FakeNvml:
    """pynvml as NVML answers on an 8-GPU node: each GPU's UUID and free memory, and the
    compute processes on it with their used memory. ``fail``: the call that raises NVMLError."""

    class NVMLError(Exception):
        pass

    def __init__(self, free_gib, procs=None, fail=None):
        self.free = [int(f * GIB) for f in free_gib]
        self.procs = procs or {}        # GPU index -> [(pid, bytes)]
        self.fail = fail

    def _maybe(self, call):
        if self.fail == call:
            raise self.NVMLError(f"{call}: NVML_ERROR_UNKNOWN")

    def nvmlInit(self):
        self._maybe("nvmlInit")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.free)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:08d}"

    def nvmlDeviceGetMemoryInfo(self, h):
        from types import SimpleNamespace

        return SimpleNamespace(free=self.free[h])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        from types import SimpleNamespace

        self._maybe("nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.procs.get(h, [])]


TP8 = {i: [(100 + i, 20 * GIB)] for i in range(8)}     # a TP-8 worker: rank i (PID 100+i) on GPU i, 20 GiB each


@pytest.fixture
def nvml(monkeypatch):
    def install(*a, **k):
        import sys

        fake = FakeNvml(*a, **k)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake
    return install


def _tp8_manifest(tmp_path, **update):
    from ckptflow.models import Fingerprint, Manifest

    m = Manifest(id="20261130T120000Z-0a0b0c0d", workload="tp8", node="n", gpu_pids=list(range(100, 108)),
                 gpu_footprint_bytes=160 * GIB, gpu_footprints={f"GPU-{i:08d}": 20 * GIB for i in range(8)},
                 fingerprint=Fingerprint(gpu_uuids=[f"GPU-{i:08d}" for i in range(8)]))
    return m.model_copy(update=update)


def _node(tmp_path, uuids=None):
    from ckptflow.models import Fingerprint
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    return NodeRunner(LocalStore(tmp_path / "store"), criu=object(), cuda=CudaRunner(backend=SimDriver([])),
                      node_fp=Fingerprint(gpu_uuids=uuids or [f"GPU-{i:08d}" for i in range(8)]))


def _tp8_workload():
    from ckptflow.models import ProcessFinder, Workload

    return Workload(name="tp8", node="n", find=ProcessFinder(pid_file="/run/tp8.pid"), gpu=True, tensor_parallel=8)


def test_footprint_is_measured_per_rank_and_gpu(nvml):
    from ckptflow.runners.cuda import process_gpu_usage

    nvml([30] * 8, TP8)
    usage = process_gpu_usage(list(range(100, 108)))
    assert usage == {100 + i: {f"GPU-{i:08d}": 20 * GIB} for i in range(8)}


def test_a_tp8_worker_of_8_x_20_gib_restores_onto_8_gpus_with_30_gib_free_each(tmp_path, nvml):
    nvml([30] * 8)
    node = _node(tmp_path)
    node.gate_gpu_memory(_tp8_workload(), _tp8_manifest(tmp_path))  # 20 + 1 GiB on each GPU: fits


def test_one_gpu_short_of_its_ranks_share_is_refused_naming_that_gpu(tmp_path, nvml):
    nvml([30, 30, 30, 10, 30, 30, 30, 30])
    with pytest.raises(NotEnoughGpuMemory) as e:
        _node(tmp_path).gate_gpu_memory(_tp8_workload(), _tp8_manifest(tmp_path))
    assert "GPU-00000003: 10.0 GiB free < 21.0 GiB needed" in str(e.value)
    assert "GPU-00000002" not in str(e.value)


def test_the_gate_follows_gpu_pairs_and_other_uuids_by_index(tmp_path, nvml):
    nvml([30, 30, 30, 30, 30, 30, 30, 5])
    m = _tp8_manifest(tmp_path)
    with pytest.raises(NotEnoughGpuMemory, match="GPU-00000007: 5.0 GiB free"):  # rank 0 remapped onto GPU 7
        _node(tmp_path).gate_gpu_memory(_tp8_workload(), m, [("GPU-00000000", "GPU-00000007"),
                                                             ("GPU-00000007", "GPU-00000000")])
    # Another node's UUIDs: the same index; its GPU 7 is the one short of memory.
    other = [f"GPU-{i:08d}" for i in range(8)]
    m2 = m.model_copy(update={"gpu_footprints": {f"GPU-old{i}": 20 * GIB for i in range(8)},
                              "fingerprint": m.fingerprint.model_copy(update={"gpu_uuids": [f"GPU-old{i}" for i in range(8)]})})
    with pytest.raises(NotEnoughGpuMemory, match="GPU-00000007: 5.0 GiB free"):
        _node(tmp_path, other).gate_gpu_memory(_tp8_workload(), m2)


def test_the_heartbeats_cuda_restore_gates_each_gpu_not_the_sum(nvml):
    from ckptflow.runners.cuda import ProcessState

    nvml([30] * 8)
    drv = SimDriver(list(range(100, 108)))
    cuda = CudaRunner(backend=drv)
    need = {f"GPU-{i:08d}": 20 * GIB for i in range(8)}
    with cuda.locked(list(range(100, 108))) as procs:
        cuda.checkpoint(procs)
        cuda.restore(procs, footprint_bytes=160 * GIB, need_by_gpu=need)
    assert all(s == ProcessState.RUNNING for s in drv.st.values())


# --- fail closed: NVML errors and unknown footprints --------------------------------------------
@pytest.mark.fault
@pytest.mark.parametrize("fail", ["nvmlInit", "nvmlDeviceGetComputeRunningProcesses"])
def test_an_nvml_error_refuses_the_footprint_instead_of_reading_0(nvml, fail):
    from ckptflow.runners.cuda import process_gpu_bytes, process_gpu_usage

    nvml([30] * 8, TP8, fail=fail)
    with pytest.raises(RunnerUnavailable, match="NVML"):
        process_gpu_usage([100])
    with pytest.raises(RunnerUnavailable, match="NVML"):
        process_gpu_bytes([100])


def _gate_node(tmp_path, monkeypatch, pids):
    import ckptflow.runners.cuda as cuda_mod
    from ckptflow.runners import node as node_mod

    monkeypatch.setattr(cuda_mod, "cuda_pids", lambda root: list(pids))
    monkeypatch.setattr(node_mod, "tp_unsupported", lambda w, pids: None)
    node = _node(tmp_path)
    node.cuda.backend.st.update({p: ProcessState.RUNNING for p in pids})

    class Criu:  # the dump after the lock: recorded, not run
        dumped = []

        def dump(self, w, images_dir, leave_running, proc, refused=False):
            self.dumped.append(proc.pid)
            return type("R", (), {"pid": proc.pid, "seconds": 0.01})()

    node.criu = Criu()
    return node


class _Proc:
    def __init__(self, pid):
        self.pid = pid


@pytest.fixture
def other_pidns():
    """A process in a PID namespace of its own (root: unshare), its host PID."""
    import shutil
    import subprocess
    import time

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a second PID namespace")
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "60"])
    try:
        for _ in range(200):
            kids = [int(x) for x in open(f"/proc/{outer.pid}/task/{outer.pid}/children").read().split()]
            if kids and os.readlink(f"/proc/{kids[0]}/ns/pid") != os.readlink("/proc/self/ns/pid"):
                yield kids[0]
                break
            time.sleep(0.01)
        else:
            pytest.fail("unshare started no process in a new PID namespace")
    finally:
        outer.kill()
        outer.wait()


@pytest.mark.fault
def test_a_device_pid_nvml_lists_no_memory_for_counts_0_when_its_namespace_is_seen(tmp_path, nvml, monkeypatch):
    """vLLM's tree on the H200: the API server holds a device context, NVML lists memory only for
    EngineCore. The footprint covers what the tree holds; the checkpoint goes on (it was refused
    before, so no vLLM could be checkpointed on a GPU)."""
    api, core = os.getpid(), os.getppid()            # two PIDs of one namespace
    nvml([30] * 8, {0: [(core, 20 * GIB)]})
    node = _gate_node(tmp_path, monkeypatch, [api, core])
    d = node._dump_gpu(_tp8_workload(), _Proc(api), tmp_path / "img", leave_running=True)
    assert d.footprint == 20 * GIB and d.per_gpu == {"GPU-00000000": 20 * GIB}
    assert node.criu.dumped == [api]
    steps = [c[0] for c in node.cuda.backend.calls]
    assert steps.count("lock") == 2 and steps.count("unlock") == 2   # both device PIDs locked and let go


@pytest.mark.fault
def test_a_gpu_checkpoint_whose_footprint_nvml_cannot_see_is_refused_before_the_lock(tmp_path, nvml, monkeypatch):
    api, core = os.getpid(), os.getppid()
    nvml([30] * 8, {0: [(99999999, 20 * GIB)]})      # NVML lists PIDs of another namespace only
    node = _gate_node(tmp_path, monkeypatch, [api, core])
    with pytest.raises(RunnerUnavailable, match=rf"NVML attributes no GPU memory to any of PID\(s\) {api}, {core}"):
        node._dump_gpu(_tp8_workload(), _Proc(api), tmp_path / "img", leave_running=True)
    assert node.cuda.backend.calls == []            # nothing locked


@pytest.mark.fault
def test_a_rank_in_a_pid_namespace_nvml_does_not_see_is_refused_though_another_is_seen(tmp_path, nvml, monkeypatch,
                                                                                      other_pidns):
    me = os.getpid()
    nvml([30] * 8, {0: [(me, 20 * GIB)]})            # the rank in the other namespace is not listed
    node = _gate_node(tmp_path, monkeypatch, [me, other_pidns])
    with pytest.raises(RunnerUnavailable, match=rf"no GPU memory to any of PID\(s\) {other_pidns} \(of {me}, {other_pidns}\)"):
        node._dump_gpu(_tp8_workload(), _Proc(me), tmp_path / "img", leave_running=True)
    assert node.cuda.backend.calls == []


@pytest.mark.fault
def test_a_gpu_checkpoint_without_a_recorded_footprint_is_refused_not_waved_through(tmp_path, nvml):
    nvml([30] * 8)
    m = _tp8_manifest(tmp_path, gpu_footprint_bytes=0, gpu_footprints={})
    with pytest.raises(NotEnoughGpuMemory, match="recorded no GPU footprint"):
        _node(tmp_path).gate_gpu_memory(_tp8_workload(), m)
