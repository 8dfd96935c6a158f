"""The GPU backend contract (runners/gpu): one suite that every backend passes.

``FakeGpuBackend`` is a whole backend over "devices" that are directories: a process's device
memory is a file there, which its worker (helpers/fake_gpu_worker.py, a real CPU process) keeps
changing while it runs. Lock waits for the worker to finish its step in flight; checkpoint copies
the memory to host and frees the device; restore puts it back (onto another device, through a
device map), refusing first when it would not fit. It is the example of
docs/extending/gpu-backend.md and proves the interface is enough for a second vendor: the node
runner checkpoints and restores its worker with real CRIU, no line of it knowing which backend.

The CUDA backend runs the same suite where an NVIDIA GPU is (the H200); here it is skipped with
the reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import pytest

from conftest import HELPERS
from ckptflow.errors import ConfigError, GpuCheckpointError, NotEnoughGpuMemory
from ckptflow.runners import process
from ckptflow.runners.gpu import BACKENDS, DeviceState, GpuBackend, get_backend, register_backend

MIB = 2**20
GIB = 2**30


# --- the toy backend ------------------------------------------------------------------------------
@dataclass
class FakeProc:
    pid: int
    devices: dict[str, int] = field(default_factory=dict)   # device -> bytes it held (recover's gate)


class FakeGpuBackend(GpuBackend):
    """Devices are <root>/FAKE-<n>/ directories of ``CAPACITY`` bytes; a process's memory on one
    is <root>/FAKE-<n>/<pid>.mem; its state is <root>/state/<pid> (absent: running); a checkpoint
    holds its memory in <root>/host/<pid>/ (a real driver's host copy is inside the process, and
    so inside the CRIU image; this one lies beside it)."""

    usage_source = "the fake driver"
    default_root: ClassVar[Path | None] = None   # what a fresh instance (get_backend("fake")) reads
    CAPACITY = 4 * GIB           # a number only: the files hold a few MiB; the restore margin is 1 GiB

    def __init__(self, root: Path | None = None, lock_timeout_s: float = 2.0):
        self.root = Path(root or self.default_root or "/nonexistent")
        self.lock_timeout_s = lock_timeout_s

    # --- the node and its processes ---------------------------------------------------------
    def _devices(self) -> list[str]:
        return sorted(d.name for d in self.root.glob("FAKE-*") if d.is_dir()) if self.root.is_dir() else []

    def _mem(self, pid: int) -> dict[str, Path]:
        return {d: self.root / d / f"{pid}.mem" for d in self._devices() if (self.root / d / f"{pid}.mem").exists()}

    def _reap(self) -> None:
        """A dead process's device memory is freed (as a driver does when its context goes)."""
        for f in self.root.glob("FAKE-*/*.mem"):
            if not process.pid_alive(int(f.stem)):
                f.unlink(missing_ok=True)

    def available(self) -> tuple[bool, str]:
        return (True, "") if self._devices() else (False, f"no fake devices under {self.root}")

    def processes(self, root_pid: int) -> list[int]:
        self._reap()
        return [p for p in process.tree(root_pid) if self._mem(p)] or [root_pid]

    def usage(self, pids: list[int]) -> dict[int, dict[str, int]]:
        self._reap()
        return {p: {d: f.stat().st_size for d, f in self._mem(p).items()} for p in pids if self._mem(p)}

    def free_by_device(self) -> dict[str, int]:
        self._reap()
        return {d: self.CAPACITY - sum(f.stat().st_size for f in (self.root / d).glob("*.mem")) for d in self._devices()}

    def fingerprint_fields(self) -> tuple[dict[str, Any], str | None]:
        devs = self._devices()
        if not devs:
            return {}, f"no fake devices under {self.root}"
        return {"gpu_model": "FakeGPU-4G", "gpu_count": len(devs), "gpu_uuids": devs, "driver": "fake-1.0"}, None

    # --- the state machine ------------------------------------------------------------------
    def state(self, pid: int) -> DeviceState:
        if not process.pid_alive(pid):
            raise GpuCheckpointError(f"PID {pid}: no such process", fix="the worker exited")
        try:
            return DeviceState((self.root / "state" / str(pid)).read_text())
        except FileNotFoundError:
            return DeviceState.running

    def _set(self, pid: int, st: DeviceState) -> None:
        (self.root / "state").mkdir(exist_ok=True)
        (self.root / "state" / f"{pid}.ack").unlink(missing_ok=True)
        (self.root / "state" / str(pid)).write_text(st.value)

    def _expect(self, procs: list[FakeProc], want: DeviceState, step: str) -> None:
        bad = [f"PID {p.pid} is {st.value}" for p in procs if (st := self.state(p.pid)) != want]
        if bad:
            raise GpuCheckpointError(f"cannot {step}: expected {want.value}: " + ", ".join(bad))

    def lock(self, pids, usage=None, explain=None) -> list[FakeProc]:
        procs = [FakeProc(p, dict((usage or {}).get(p, {}))) for p in pids]
        self._expect(procs, DeviceState.running, "lock")
        for p in procs:
            self._set(p.pid, DeviceState.locked)
        deadline = time.monotonic() + self.lock_timeout_s
        waiting = [p.pid for p in procs]
        while waiting and time.monotonic() < deadline:
            waiting = [pid for pid in waiting if not (self.root / "state" / f"{pid}.ack").exists()]
            time.sleep(0.005)
        if waiting:  # every PID or none
            for p in procs:
                self._set(p.pid, DeviceState.running)
            said = explain() if explain else ""
            raise GpuCheckpointError(f"lock failed: PID {', '.join(map(str, waiting))} did not finish its device "
                                     f"work within {self.lock_timeout_s:g} s" + (f"\n  ranks: {said}" if said else ""))
        return procs

    def checkpoint(self, procs: list[FakeProc]) -> None:
        self._expect(procs, DeviceState.locked, "checkpoint")
        for p in procs:
            host = self.root / "host" / str(p.pid)
            shutil.rmtree(host, ignore_errors=True)
            host.mkdir(parents=True)
            for dev, f in self._mem(p.pid).items():
                p.devices[dev] = f.stat().st_size
                shutil.copyfile(f, host / dev)
                f.unlink()
            self._set(p.pid, DeviceState.checkpointed)

    def restore(self, procs, *, device_map=None, need_by_device=None, footprint_bytes=0) -> None:
        self._expect(procs, DeviceState.checkpointed, "restore")
        self.gate_memory(need_by_device or {}, footprint_bytes)
        pairs = dict(device_map or [])
        for p in procs:
            for copy in sorted((self.root / "host" / str(p.pid)).glob("FAKE-*")):
                dev = pairs.get(copy.name, copy.name)
                if dev not in self._devices():
                    raise GpuCheckpointError(f"PID {p.pid}: no device {dev} on this node")
                tmp = self.root / dev / f"{p.pid}.mem.tmp"
                shutil.copyfile(copy, tmp)
                os.replace(tmp, self.root / dev / f"{p.pid}.mem")
            self._set(p.pid, DeviceState.locked)

    def unlock(self, procs: list[FakeProc]) -> None:
        self._expect(procs, DeviceState.locked, "unlock")
        for p in procs:
            self._set(p.pid, DeviceState.running)

    def recover(self, procs: list[FakeProc]) -> list[str]:
        stuck = []
        for p in procs:
            if not process.pid_alive(p.pid):
                continue  # dumped for a migration: nothing to give back
            try:
                if self.state(p.pid) == DeviceState.checkpointed:
                    self.restore([p], need_by_device=p.devices)
                if self.state(p.pid) == DeviceState.locked:
                    self.unlock([p])
            except Exception as e:  # never let cleanup hide the first error
                stuck.append(f"PID {p.pid}: {e}")
        return stuck

    def checkpointed(self, pids: list[int]) -> list[FakeProc]:
        procs = []
        for pid in pids:
            for f in self._mem(pid).values():
                f.unlink()  # a process CRIU just restored holds no device memory yet
            self._set(pid, DeviceState.checkpointed)
            copies = (self.root / "host" / str(pid)).glob("FAKE-*")
            procs.append(FakeProc(pid, {c.name: c.stat().st_size for c in copies}))
        return procs


# --- one case per backend: the backend, a worker holding device state, and a check it works ------
@dataclass
class Case:
    backend: GpuBackend
    start: Callable[[], int]              # starts a worker; its root PID
    works: Callable[[int], None]          # asserts the worker still computes, its device state intact
    stop: Callable[[], None]
    workers: list[subprocess.Popen] = field(default_factory=list)


def _fake_case(tmp_path: Path) -> Case:
    root = tmp_path / "fakegpu"
    for d in ("FAKE-0", "FAKE-1"):
        (root / d).mkdir(parents=True)
    workers: list[subprocess.Popen] = []

    def start() -> int:
        pid_file = tmp_path / f"fake{len(workers)}.pid"
        workers.append(subprocess.Popen([sys.executable, str(HELPERS / "fake_gpu_worker.py"), str(root), str(pid_file),
                                         str(8 * MIB)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.time() + 20
        while not pid_file.exists():
            assert time.time() < deadline, "the fake worker never started"
            time.sleep(0.01)
        return int(pid_file.read_text())

    def works(pid: int) -> None:
        assert fake_counter(root, pid) < _after(0.2, lambda: fake_counter(root, pid)), "the worker does not advance"
        [f] = root.glob(f"FAKE-*/{pid}.mem")
        assert f.read_bytes()[8:] == b"\x5a" * (8 * MIB - 8), "device memory came back changed"

    def stop() -> None:
        from conftest import kill_pid_file

        for p in workers:
            p.kill()
            p.wait()
        for pid_file in tmp_path.glob("fake*.pid"):  # a copy CRIU restored is no child of ours
            kill_pid_file(pid_file, "fake_gpu_worker.py")

    return Case(FakeGpuBackend(root), start, works, stop, workers)


def fake_counter(root: Path, pid: int) -> int:
    [f] = root.glob(f"FAKE-*/{pid}.mem")
    return int.from_bytes(f.read_bytes()[:8], "little")


def _after(seconds: float, fn: Callable[[], Any]) -> Any:
    time.sleep(seconds)
    return fn()


def _cuda_why() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch not installed (GPU nodes: pip install 'ckptflow[gpu]')"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    return None if (r := get_backend("cuda").available())[0] else r[1]


def _cuda_case(tmp_path: Path) -> Case:
    from conftest import free_port
    from ckptflow.demo import launch

    procs: list[tuple[subprocess.Popen, Path]] = []
    base: dict[int, tuple[str, dict]] = {}

    def start() -> int:
        port, pid_file = free_port(), tmp_path / f"g{len(procs)}.pid"
        procs.append((launch.start_gpu_worker(port, pid_file, ballast_gib=1), pid_file))
        pid = int(pid_file.read_text())
        url = f"http://127.0.0.1:{port}"
        base[pid] = (url, launch.http_json(f"{url}/v1/ballast/digest"))
        return pid

    def works(pid: int) -> None:
        url, digest = base[pid]
        assert launch.http_json(f"{url}/v1/ballast/digest") == digest, "device memory came back changed"

    def stop() -> None:
        for p, pid_file in procs:
            p.kill()
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass

    return Case(get_backend("cuda"), start, works, stop)


_CUDA_WHY = _cuda_why()


@pytest.fixture(params=["fake", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    _CUDA_WHY is not None, reason=f"GPU-only: {_CUDA_WHY}")])])
def case(request, tmp_path):
    c = _fake_case(tmp_path) if request.param == "fake" else _cuda_case(tmp_path)
    yield c
    c.stop()


def _per_device(usage: dict[int, dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for per in usage.values():
        for d, n in per.items():
            out[d] = out.get(d, 0) + n
    return out


def _states(b: GpuBackend, procs) -> set[DeviceState]:
    return {b.state(p.pid) for p in procs}


# --- the contract ------------------------------------------------------------------------------------
def test_available_with_fingerprint_fields_of_every_device(case):
    b = case.backend
    assert b.available() == (True, "")
    fields, why = b.fingerprint_fields()
    assert why is None
    assert fields["gpu_count"] == len(fields["gpu_uuids"]) >= 1 and fields["gpu_model"] and fields["driver"]
    assert set(b.free_by_device()) == set(fields["gpu_uuids"])


def test_processes_and_footprint_per_device(case):
    b = case.backend
    pid = case.start()
    pids = b.processes(pid)
    assert pid in pids
    usage = b.usage(pids)
    assert set(usage) == set(pids) and all(sum(per.values()) > 0 for per in usage.values())
    assert set(_per_device(usage)) <= set(b.free_by_device())


def test_heartbeat_sequence_frees_the_devices_and_brings_the_memory_back(case):
    b = case.backend
    pid = case.start()
    pids = b.processes(pid)
    need = _per_device(b.usage(pids))
    free0 = b.free_by_device()
    procs = b.lock(pids, b.usage(pids))
    assert [p.pid for p in procs] == pids and _states(b, procs) == {DeviceState.locked}
    b.checkpoint(procs)
    assert _states(b, procs) == {DeviceState.checkpointed}
    free1 = b.free_by_device()
    assert all(free1[d] >= free0[d] + n // 2 for d, n in need.items()), (free0, free1, need)
    b.restore(procs, need_by_device=need)
    assert _states(b, procs) == {DeviceState.locked}
    b.unlock(procs)
    assert _states(b, procs) == {DeviceState.running}
    case.works(pid)


def test_a_step_out_of_order_is_refused_naming_the_pid(case):
    b = case.backend
    pid = case.start()
    procs = b.lock(b.processes(pid))
    with pytest.raises(GpuCheckpointError, match=rf"PID {pid}\b"):
        b.restore(procs)                             # locked, not checkpointed
    assert _states(b, procs) == {DeviceState.locked}
    b.unlock(procs)
    with pytest.raises(GpuCheckpointError, match=rf"PID {pid}\b"):
        b.checkpoint(procs)                          # running, not locked
    case.works(pid)


def test_a_failure_inside_locked_gives_every_process_back(case):
    b = case.backend
    pid = case.start()
    pids = b.processes(pid)
    with pytest.raises(ValueError, match="the dump failed"):
        with b.locked(pids, b.usage(pids)) as procs:
            b.checkpoint(procs)
            raise ValueError("the dump failed")
    assert {b.state(p) for p in pids} == {DeviceState.running}
    case.works(pid)


def test_a_restore_that_does_not_fit_is_refused_and_leaves_the_process_checkpointed(case):
    b = case.backend
    pid = case.start()
    pids = b.processes(pid)
    usage = b.usage(pids)
    procs = b.lock(pids, usage)
    b.checkpoint(procs)
    too_much = {d: b.free_by_device()[d] + GIB for d in _per_device(usage)}
    with pytest.raises(NotEnoughGpuMemory, match="GiB free <"):
        b.restore(procs, need_by_device=too_much)
    assert _states(b, procs) == {DeviceState.checkpointed}
    assert b.recover(procs) == []
    assert _states(b, procs) == {DeviceState.running}
    case.works(pid)


def test_a_restore_onto_another_device_through_the_device_map(case):
    b = case.backend
    devices = b.fingerprint_fields()[0]["gpu_uuids"]
    if len(devices) < 2:
        pytest.skip("one device on this node: nothing to map onto")
    pid = case.start()
    pids = b.processes(pid)
    usage = b.usage(pids)
    [old] = _per_device(usage)
    new = next(d for d in devices if d != old)
    procs = b.lock(pids, usage)
    b.checkpoint(procs)
    b.restore(procs, device_map=[(old, new)], need_by_device={new: _per_device(usage)[old]})
    b.unlock(procs)
    assert set(_per_device(b.usage(pids))) == {new}
    case.works(pid)


def test_handles_of_a_restored_process_restore_and_unlock_it(case):
    """What the node runner does after CRIU restored a worker: handles from its PIDs alone."""
    b = case.backend
    pid = case.start()
    pids = b.processes(pid)
    need = _per_device(b.usage(pids))
    b.checkpoint(b.lock(pids))
    fresh = b.checkpointed(pids)
    b.restore(fresh, need_by_device=need)
    b.unlock(fresh)
    assert {b.state(p) for p in pids} == {DeviceState.running}
    case.works(pid)


# --- the fake's own: what cannot be forced on a real driver -----------------------------------------
def test_a_lock_that_times_out_locks_none_and_says_what_the_engine_was_doing(tmp_path):
    c = _fake_case(tmp_path)
    try:
        b = c.backend
        b.lock_timeout_s = 0.3
        pid = c.start()
        (b.root / "busy").touch()                    # the worker never finishes its step
        with pytest.raises(GpuCheckpointError) as e:
            b.lock([pid], explain=lambda: "rank 0: running ALLREDUCE for 12.0 s")
        assert f"PID {pid} did not finish" in str(e.value) and "rank 0: running ALLREDUCE" in str(e.value)
        assert b.state(pid) == DeviceState.running
        (b.root / "busy").unlink()
        c.works(pid)
    finally:
        c.stop()


# --- registration: a node names its backend -------------------------------------------------------
@contextlib.contextmanager
def _registered(tmp_path, name: str, cls: type[FakeGpuBackend]):
    """``cls`` registered as ``name`` over a fresh fake case's devices; all of it undone after."""
    from ckptflow.policies import compat
    from ckptflow.runners.fingerprint import node_fingerprint

    c = _fake_case(tmp_path)
    register_backend(name)(cls)
    cls.default_root = c.backend.root
    node_fingerprint.cache_clear()
    try:
        yield c
    finally:
        c.stop()
        BACKENDS.pop(name, None)
        compat.GATED.pop(f"gpu-{name}", None)
        cls.default_root = None
        node_fingerprint.cache_clear()


@pytest.fixture
def fake_registered(tmp_path):
    with _registered(tmp_path, "fake", FakeGpuBackend) as c:
        yield c


def test_a_registered_backend_is_chosen_per_node_and_fills_the_fingerprint(tmp_path, fake_registered):
    import yaml

    from ckptflow.fleet import load_fleet
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump({"fleet": "t", "nodes": [{"name": "n1", "work_pool": "n1", "gpu_backend": "fake"},
                                                          {"name": "n2", "work_pool": "n2"}]}))
    assert [n.gpu_backend for n in load_fleet(f).nodes] == ["fake", "cuda"]
    with NodeRunner(LocalStore(tmp_path / "store"), gpu="fake") as node:
        assert isinstance(node.gpu, FakeGpuBackend)
        assert node.node_fp.gpu_uuids == ["FAKE-0", "FAKE-1"] and node.node_fp.driver == "fake-1.0"


def test_an_unknown_backend_is_one_line_naming_the_known_ones(tmp_path):
    import yaml

    from ckptflow.fleet import load_fleet

    with pytest.raises(ConfigError, match=r"^unknown GPU backend 'rocm' \(known: cuda\)"):
        get_backend("rocm")
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump({"fleet": "t", "nodes": [{"name": "n1", "work_pool": "n1", "gpu_backend": "rocm"}]}))
    with pytest.raises(ConfigError) as e:
        load_fleet(f)
    assert f"{f}: nodes[0].gpu_backend (line " in str(e.value)
    assert "unknown GPU backend 'rocm' (known: cuda)" in str(e.value)


def test_a_node_step_gets_a_runner_with_the_backend_its_node_declares(tmp_path, fake_registered):
    """tasks.common.node_runner (every task's runner) builds the node's declared backend, from
    the whole fleet or from the scope a flow hands its tasks; a node that names none gets cuda.
    The fleet fingerprint a node reports comes from its own backend too."""
    import yaml

    from ckptflow.fleet import load_fleet
    from ckptflow.store.fleetstate import LocalFleetState
    from ckptflow.tasks.common import node_runner
    from ckptflow.tasks.fleet import report_node_fingerprint

    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump({"fleet": "t", "storage": {"kind": "local", "path": str(tmp_path / "store")},
                                 "nodes": [{"name": "n1", "work_pool": "n1", "gpu_backend": "fake"},
                                           {"name": "n2", "work_pool": "n2"}]}))
    fleet = load_fleet(f)
    for given in (fleet, fleet.scope()):
        with node_runner(given, "n1") as runner:
            assert isinstance(runner.gpu, FakeGpuBackend) and runner.gpu.name == "fake"
            assert runner.node_fp.gpu_uuids == ["FAKE-0", "FAKE-1"]
        with node_runner(given, "n2") as runner:
            assert runner.gpu.name == "cuda"
        with node_runner(given) as runner:                    # no node: the default
            assert runner.gpu.name == "cuda"
    assert report_node_fingerprint.fn(fleet.scope(), "n1")["driver"] == "fake-1.0"
    assert LocalFleetState(tmp_path / "store").node_fingerprints()["n1"].gpu_uuids == ["FAKE-0", "FAKE-1"]


class FirmwareGpuBackend(FakeGpuBackend):
    """The fake backend whose devices also report a firmware version, a field of its own that a
    restore must match (``gated_fields``)."""

    firmware: ClassVar[str] = "1.0"
    gated_fields = ("fake_firmware",)

    def fingerprint_fields(self) -> tuple[dict[str, Any], str | None]:
        fields, why = super().fingerprint_fields()
        return ({**fields, "fake_firmware": self.firmware} if fields else fields), why


@pytest.fixture
def firmware_registered(tmp_path):
    with _registered(tmp_path, "fake-fw", FirmwareGpuBackend) as c:
        yield c
    FirmwareGpuBackend.firmware = "1.0"


def test_a_backends_own_fingerprint_fields_are_gated(tmp_path, firmware_registered):
    """A field the backend declares in ``gated_fields`` is gated like the gpu group's: a restore
    of a checkpoint taken under other firmware is refused naming the field, before any CRIU
    call; invalidate judges it the same way; a CPU workload on that node is not gated on it."""
    from ckptflow.errors import IncompatibleCheckpoint
    from ckptflow.models import Manifest, ProcessFinder, Workload
    from ckptflow.policies import compat
    from ckptflow.runners.fingerprint import node_fingerprint, workload_fingerprint
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    assert compat.GATED["gpu-fake-fw"] == ("fake_firmware",)
    assert FirmwareGpuBackend.gated == ("gpu", "gpu-fake-fw")
    w = Workload(name="fake-gpu", node="n1", gpu=True, find=ProcessFinder(pid_file=str(tmp_path / "x.pid")))
    cpu = w.model_copy(update={"gpu": False})
    with NodeRunner(LocalStore(tmp_path / "store"), gpu="fake-fw") as node:
        taken = workload_fingerprint(w, node.node_fp)
        assert taken.fake_firmware == "1.0"
        m = Manifest(id="20261201T040000Z-0a0b0c0d", workload=w.name, node="n1", fingerprint=taken)
        node.gate(w, m)                                           # same firmware: restorable
    FirmwareGpuBackend.firmware = "1.1"                           # the node's firmware was upgraded
    node_fingerprint.cache_clear()
    with NodeRunner(LocalStore(tmp_path / "store"), gpu="fake-fw") as node:
        with pytest.raises(IncompatibleCheckpoint, match=r"fake_firmware: '1.0' -> '1.1'") as e:
            node.gate(w, m)
        assert e.value.differences == {"fake_firmware": ("1.0", "1.1")}
        node.gate(cpu, m.model_copy(update={"workload": cpu.name}))   # no device state: the group does not apply
        now = {"n1": workload_fingerprint(w, node.node_fp)}
    [(old, why)] = compat.stale([m], now, gpu=True, gpu_groups=FirmwareGpuBackend.gated)
    assert old.id == m.id and "fake_firmware: '1.0' -> '1.1'" in why
    assert compat.stale([m], now, gpu=True) == []                 # the gpu group alone does not see it


@pytest.mark.criu
def test_the_node_runner_checkpoints_and_restores_a_fake_gpu_worker_with_real_criu(tmp_path, fake_registered):
    """Heartbeat, kill, restore: the node runner's device sequence around real CRIU, through a
    backend it knows only by the interface."""
    from ckptflow.models import ProcessFinder, Workload
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    c = fake_registered
    root = c.backend.root
    pid = c.start()
    w = Workload(name="fake-gpu", node="n1", gpu=True, find=ProcessFinder(
        pid_file=str(tmp_path / "fake0.pid"), cmdline_must_contain="fake_gpu_worker.py"))
    with NodeRunner(LocalStore(tmp_path / "store"), gpu="fake") as node:
        m = node.checkpoint(w)
        assert m.gpu_pids == [pid] and m.gpu_footprints == {"FAKE-0": 8 * MIB} and m.gpu_footprint_bytes == 8 * MIB
        assert {"lock", "cuda_checkpoint", "dump", "cuda_restore", "unlock", "pause"} <= set(m.timings)
        assert m.fingerprint.gpu_uuids == ["FAKE-0", "FAKE-1"]
        at_ckpt = int.from_bytes((root / "host" / str(pid) / "FAKE-0").read_bytes()[:8], "little")
        c.works(pid)                                     # the heartbeat left it serving
        os.kill(pid, signal.SIGKILL)
        for p in c.workers:
            p.wait()                                     # reaped: CRIU gets its PID back
        res = node.restore(w)
        assert res.pid == pid and {"cuda_restore", "unlock"} <= set(res.timings)
        assert node.gpu.state(pid) == DeviceState.running
        assert fake_counter(root, pid) >= at_ckpt       # the device state is the checkpoint's, and advances
        c.works(pid)


def test_no_workload_gpu_branch_in_the_runners_outside_the_backend_room():
    """runners/gpu.backend_for is the one place that reads Workload.gpu."""
    runners = Path(__file__).parents[1] / "ckptflow" / "runners"
    hits = [f"{p.relative_to(runners)}:{i}" for p in runners.rglob("*.py") if p.parent.name != "gpu"
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bw\.gpu\b(?!_)", line)]
    assert hits == []


def test_the_backend_modules_examples_run():
    import doctest

    import ckptflow.runners.gpu as gpu

    res = doctest.testmod(gpu, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted > 0
