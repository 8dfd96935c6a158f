"""Workers born in their own PID and mount namespaces (runners/isolate.py), with real CRIU:
a restore no longer needs the worker's old PIDs, and a verification copy runs beside the
live original (the layout in which the H200 restored a GPU copy beside its original)."""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import free_port, kill_pid_file
from squat import squat
from ckptflow.demo import launch
from ckptflow.errors import GpuCheckpointError, PidBusy
from ckptflow.models import CheckpointState
from ckptflow.runners.criu import TMP_PREFIX, image_isolated
from ckptflow.runners.fingerprint import node_fingerprint
from ckptflow.runners.gpu import NoGpu
from ckptflow.runners.isolate import is_isolated
from ckptflow.runners.node import NodeRunner
from ckptflow.runners.process import pid_alive
from ckptflow.runners.verify import VerifyOutcome, verify_checkpoint
from ckptflow.store.local import LocalStore

pytestmark = pytest.mark.criu


class Worker:
    def __init__(self, tmp_path: Path, name: str, isolated: bool):
        self.port = free_port()
        self.pid_file = tmp_path / f"{name}.pid"
        self.proc = launch.start_worker(self.port, self.pid_file, isolated=isolated)
        self.workload = launch.demo_workload(name, self.port, self.pid_file)

    @property
    def pid(self) -> int:
        return int(self.pid_file.read_text())

    def stop(self):
        kill_pid_file(self.pid_file, "ckptflow.demo.worker")
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def node(tmp_path):
    with NodeRunner(LocalStore(tmp_path / "store")) as n:
        yield n


@pytest.fixture
def worker(tmp_path):
    made = []

    def start(name="chat", isolated=True):
        made.append(Worker(tmp_path, name, isolated))
        return made[-1]

    yield start
    for w in made:
        w.stop()


def _take_pid(pid: int) -> subprocess.Popen:
    p = squat(pid)
    if p is None:
        pytest.fail(f"could not take PID {pid} for the test")
    return p


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        try:
            os.waitpid(pid, os.WNOHANG)  # a plain worker is this test's own child
        except ChildProcessError:
            pass
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.05)


def test_launch_writes_the_host_pid_and_the_worker_is_init_of_its_namespace(worker):
    w = worker()
    assert is_isolated(w.pid)
    assert Path(f"/proc/{w.pid}/cmdline").read_text().startswith(launch.sys.executable)
    assert os.readlink(f"/proc/{w.pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    plain = worker("plain", isolated=False)
    assert not is_isolated(plain.pid)


@contextlib.contextmanager
def _killed_and_pid_taken(w: Worker):
    old = w.pid
    _kill(old)
    sleeper = _take_pid(old)
    try:
        yield old
    finally:
        sleeper.kill()
        sleeper.wait()


def test_restore_succeeds_when_the_old_pid_is_taken_on_the_node(worker, node):
    w = worker()
    launch.complete(w.port, "a long session to keep " * 10, 12, "s1")
    m = node.checkpoint(w.workload)
    assert image_isolated(node.store.images_dir(m))
    digests = launch.session_digests(w.port)
    reference = launch.complete(w.port, "and the next turn", 8, "s1")  # what the restored worker must say
    with _killed_and_pid_taken(w) as old:
        r = node.restore(w.workload)
        assert r.pid != old and w.pid == r.pid and is_isolated(r.pid)  # the pid file follows the worker
        assert launch.session_digests(w.port) == digests
        assert launch.complete(w.port, "and the next turn", 8, "s1") == reference


def test_a_plain_worker_cannot_be_restored_while_its_pid_is_taken(worker, node):
    """What the isolated layout fixes: the same steps on a worker in the node's namespace."""
    w = worker("plain", isolated=False)
    node.criu.pid_free_timeout_s = 1
    node.checkpoint(w.workload)
    with _killed_and_pid_taken(w) as old, pytest.raises(PidBusy, match=str(old)):
        node.restore(w.workload, fallback=False)


def _checkpointed(worker, node):
    w = worker()
    launch.complete(w.port, "keep this session " * 10, 12, "s1")
    return w, node.checkpoint(w.workload)


def test_verify_runs_a_copy_beside_the_live_original(tmp_path, worker, node):
    w, m = _checkpointed(worker, node)
    pid, digests = w.pid, launch.session_digests(w.port)
    res = verify_checkpoint(node, w.workload, m)
    assert res.state == VerifyOutcome.verified, res
    assert "1 session digest(s) equal" in res.reason
    # The original kept running and answering with its own state; no copy is left behind.
    assert w.pid == pid and launch.session_digests(w.port) == digests
    left = subprocess.run(["pgrep", "-f", f"^[^ ]*python[^ ]* -m ckptflow.demo.worker .*{tmp_path}/"],
                          capture_output=True, text=True)
    assert {int(p) for p in left.stdout.split()} == {pid}
    mounts = subprocess.run(["mount"], capture_output=True, text=True).stdout
    assert f"{TMP_PREFIX}{os.getpid()}-" not in mounts  # the rbind of / was never in the node's mount table


def test_verify_of_a_changed_image_fails(worker, node):
    """The copy really is the checkpoint: a session digest recorded differently fails verify."""
    w, m = _checkpointed(worker, node)
    m = node.store.set_state(m, CheckpointState.complete, sessions={"s1": "0" * 64})
    res = verify_checkpoint(node, w.workload, m)
    assert res.state == VerifyOutcome.verify_failed and "s1" in res.reason


def test_the_cli_starts_an_isolated_worker(tmp_path):
    port, pid_file, log = free_port(), tmp_path / "cli.pid", tmp_path / "cli.log"
    proc = subprocess.Popen([launch.sys.executable, "-m", "ckptflow", "run-isolated", "--pid-file", str(pid_file),
                             "--log", str(log), "--", launch.sys.executable, "-m", "ckptflow.demo.worker",
                             "--port", str(port), "--pid-file", str(tmp_path / "inner.pid")],
                            start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        launch.wait_healthy(f"http://127.0.0.1:{port}/health", 30, proc=proc)
        assert is_isolated(int(pid_file.read_text())) and (tmp_path / "inner.pid").read_text().strip() == "1"
    finally:
        kill_pid_file(pid_file, "ckptflow.demo.worker")
        proc.kill()
        proc.wait()


def test_the_cli_refuses_no_command_with_one_line(tmp_path):
    out = subprocess.run([launch.sys.executable, "-m", "ckptflow", "run-isolated", "--pid-file", str(tmp_path / "p")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[0] == "error: run-isolated: no worker command given"


class _RecordingDevice(NoGpu):
    """A backend like CUDA in what it can restore (no copy beside a plain worker's original, a
    copy of an isolated one by the copy's host PIDs); it records the device calls a verify makes."""

    restores_beside = False
    restores_isolated_copy = True

    def __init__(self, fail_restore: bool = False):
        self.calls: list[tuple] = []
        self.fail_restore = fail_restore

    def gate_restore(self, workload, checkpoint, need_by_device, footprint_bytes) -> None:
        self.calls.append(("gate", footprint_bytes))

    def checkpointed(self, pids):
        self.calls.append(("checkpointed", list(pids)))
        return list(pids)

    def restore(self, procs, *, device_map=None, need_by_device=None, footprint_bytes=0) -> None:
        self.calls.append(("restore", list(procs)))
        if self.fail_restore:
            raise GpuCheckpointError("restore: CUDA_ERROR_ILLEGAL_STATE")

    def unlock(self, procs) -> None:
        self.calls.append(("unlock", list(procs)))


def _gpu_checkpoint(tmp_path, worker, device, isolated=True):
    """A real CRIU checkpoint of a demo worker declared ``gpu: true`` (no device state is really
    held: the manifest names the worker's PID as its one GPU process, as a CUDA dump would)."""
    w = worker(isolated=isolated)
    w.workload = w.workload.model_copy(update={"gpu": True})
    launch.complete(w.port, "keep this session " * 10, 12, "s1")
    node = NodeRunner(LocalStore(tmp_path / f"store-{isolated}"), gpu=device)
    node._node_fp = node_fingerprint(node.criu.criu_bin)   # the recorder is not registered by name
    m = node.checkpoint(w.workload)
    m = m.model_copy(update={"gpu_pids": [w.pid], "gpu_footprint_bytes": 1 << 30})
    return w, node, m


def test_a_gpu_copy_of_an_isolated_worker_gets_its_device_state_back_by_the_copys_host_pid(tmp_path, worker):
    device = _RecordingDevice()
    w, node, m = _gpu_checkpoint(tmp_path, worker, device)
    with node:
        res = verify_checkpoint(node, w.workload, m)
    assert res.state == VerifyOutcome.verified, res
    assert [c[0] for c in device.calls] == ["gate", "checkpointed", "restore", "unlock"]
    (copy_pid,) = device.calls[2][1]
    # Not the original's PID: the copy's, which is the original's PID 1 inside its own namespace.
    assert copy_pid != w.pid and "device_restore" in res.timings
    assert device.calls[1][1] == device.calls[2][1] == device.calls[3][1]
    assert not pid_alive(copy_pid)                                   # the copy is gone (a zombie at most)


def test_a_failed_device_restore_of_the_copy_fails_verify_and_leaves_nothing(tmp_path, worker):
    device = _RecordingDevice(fail_restore=True)
    w, node, m = _gpu_checkpoint(tmp_path, worker, device)
    with node:
        res = verify_checkpoint(node, w.workload, m)
    assert res.state == VerifyOutcome.verify_failed and "ILLEGAL_STATE" in res.reason, res
    (copy_pid,) = device.calls[2][1]
    assert not pid_alive(copy_pid) and launch.session_digests(w.port)  # the original serves on


def test_a_gpu_copy_of_a_plain_worker_is_skipped_and_says_how_to_make_it_verifiable(tmp_path, worker):
    device = _RecordingDevice()
    w, node, m = _gpu_checkpoint(tmp_path, worker, device, isolated=False)
    with node:
        res = verify_checkpoint(node, w.workload, m)
    assert res.state == VerifyOutcome.skipped and "run-isolated" in res.reason
    assert device.calls == []                                      # nothing restored, nothing gated
