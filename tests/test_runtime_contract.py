"""Workload runtimes registered by name (ckptflow/runners/runtime/): the fleet file's ``runtime:`` (or
what a workload declares: ``find:``, ``container:``, ``container.kubernetes:``) picks one, and the
node runner's sequence calls it the same way whatever it is.

``DirRuntime`` is the example of docs/EXTENDING.md: a fourth runtime, registered here, whose
"worker" is a directory (running while it holds ``alive``, its state the file ``state``). It goes
through the real callers (the heartbeat task, the restore task recover's node step runs, the verify
task's mode, the stop and cold-start tasks), not around them: a runtime whose method takes other
arguments than the caller passes fails here with a TypeError.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from ckptflow.errors import ConfigError, WorkloadNotFound, WorkloadRunning
from ckptflow.fleet import load_fleet
from ckptflow.models import Fingerprint, Manifest, VerifyOutcome, Workload
from ckptflow.registry import WORKLOAD_RUNTIMES
from ckptflow.runners.digests import VerifyResult
from ckptflow.runners.node import Dumped, NodeRunner
from ckptflow.runners.process import DeclaredProcess
from ckptflow.runners.runtime import WorkloadRuntime, get_runtime, register_runtime, runtime_for, runtime_name
from ckptflow.store.local import LocalStore

from conftest import one_workload_fleet as _fleet  # noqa: E402


# --- the toy: a worker that is a directory ---------------------------------------------------------
def _home(w: Workload) -> Path:
    return Path(w.labels["home"])  # the toy's own setting; a real runtime reads its own declaration


class DirRuntime(WorkloadRuntime):
    """Runs while ``<home>/alive`` exists; its state is ``<home>/state``, dumped as the image's one file."""

    what = "directory"

    def resolve(self, w: Workload) -> DeclaredProcess:
        if not (_home(w) / "alive").exists():
            raise WorkloadNotFound(f"workload {w.name}: {_home(w)} is not alive")
        return DeclaredProcess(workload=w.name, pid=0, start_time=0, cmdline=f"dir {_home(w)}")

    def stop(self, w: Workload, grace_s: float = 30) -> dict:
        try:
            self.resolve(w)
        except WorkloadNotFound:
            return {"stopped": False, "reason": "not running"}
        (_home(w) / "alive").unlink()
        return {"stopped": True, "home": str(_home(w))}

    def dump(self, w: Workload, proc: DeclaredProcess, images_dir: Path, leave_running: bool) -> Dumped:
        t0 = time.perf_counter()
        shutil.copyfile(_home(w) / "state", images_dir / "state")
        if not leave_running:
            (_home(w) / "alive").unlink()
        took = round(time.perf_counter() - t0, 4)
        return Dumped(proc.pid, {"dump": took, "pause": took})

    def clear(self, w: Workload) -> None:
        if (_home(w) / "alive").exists():
            raise WorkloadRunning(f"workload {w.name} is running; refusing to restore over it")

    def restore(self, w: Workload, m: Manifest, timings: dict[str, float]) -> int:
        t0 = time.perf_counter()
        self._node().store.verify_bytes(m)
        timings["checksum"] = round(time.perf_counter() - t0, 4)
        shutil.copyfile(self._node().store.images_dir(m) / "state", _home(w) / "state")
        (_home(w) / "alive").touch()
        return 0

    def verify_copy(self, w: Workload, m: Manifest, t: dict[str, float], timeout_s: float = 120,
                    inspect_copy=None) -> VerifyResult:
        held = hashlib.sha256((self._node().store.images_dir(m) / "state").read_bytes()).hexdigest()
        ok = any(f.sha256 == held for f in m.files)
        return VerifyResult(VerifyOutcome.verified if ok else VerifyOutcome.verify_failed, "state file digest", t)

    def cold_start(self, w: Workload, timeout_s: float = 600) -> tuple[int, float]:
        (_home(w) / "state").write_text("fresh")
        (_home(w) / "alive").touch()
        return 0, 0.0


@pytest.fixture
def dir_runtime():
    register_runtime("dir")(DirRuntime)
    yield DirRuntime
    del WORKLOAD_RUNTIMES.entries["dir"]


# --- the fleet file chooses ------------------------------------------------------------------------
def test_what_a_workload_declares_names_its_runtime(tmp_path):
    w = load_fleet(_fleet(tmp_path)).workloads[0]
    assert runtime_name(w) == "process" and type(runtime_for(w)).__name__ == "ProcessRuntime"
    c = load_fleet(_fleet(tmp_path, find=None, container={"name": "chat-c"})).workloads[0]
    assert runtime_name(c) == "podman" and type(runtime_for(c)).__name__ == "PodmanRuntime"
    k = load_fleet(_fleet(tmp_path, find=None, container={
        "name": "chat-k", "kubernetes": {"namespace": "serving", "pod": "chat-k-0", "container": "vllm"}})).workloads[0]
    assert runtime_name(k) == "pod" and type(runtime_for(k)).__name__ == "PodRuntime"
    assert WORKLOAD_RUNTIMES.known() == ["pod", "podman", "process"]
    assert all(issubclass(get_runtime(n), WorkloadRuntime) for n in WORKLOAD_RUNTIMES.known())


def test_a_registered_runtime_is_chosen_by_name_and_an_unknown_one_refused(tmp_path, dir_runtime):
    w = load_fleet(_fleet(tmp_path, runtime="dir")).workloads[0]
    assert w.runtime == "dir" and isinstance(runtime_for(w), DirRuntime)
    with pytest.raises(ConfigError) as e:
        load_fleet(_fleet(tmp_path, runtime="lxc"))
    assert "workloads[0].runtime" in str(e.value) and "unknown workload runtime 'lxc' (known: dir, pod, podman, process)" \
        in str(e.value)


def test_a_runtime_named_against_the_declaration_is_refused_and_names_both(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_fleet(_fleet(tmp_path, runtime="podman"))  # find: given, podman needs a container
    assert "runtime podman runs a workload declared with container, and this one gives find" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_fleet(_fleet(tmp_path, find=None, container={"name": "chat-c"}, runtime="pod"))
    assert "declared with container.kubernetes, and this one gives container" in str(e.value)
    assert load_fleet(_fleet(tmp_path, find=None, container={"name": "chat-c"}, runtime="podman")).workloads[0]


def test_no_built_in_runtime_leaves_a_step_abstract():
    for name in WORKLOAD_RUNTIMES.known():
        assert not getattr(get_runtime(name), "__abstractmethods__", None), name


def _toy(tmp_path: Path, state: str) -> tuple[Path, Workload]:
    """A running toy worker holding ``state``, and its workload as the fleet file declares it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "state").write_text(state)
    (home / "alive").touch()
    return home, load_fleet(_fleet(tmp_path, runtime="dir", labels={"home": str(home)})).workloads[0]


# --- through the real callers ----------------------------------------------------------------------
def test_a_registered_runtime_runs_through_the_heartbeat_restore_verify_stop_and_cold_start_tasks(
        tmp_path, dir_runtime, monkeypatch):
    """The heartbeat task (``checkpoint_batch``, whose facts ask the runtime whether the worker
    runs), then the restore task recover's node step runs, the verify task's mode, the drain's stop
    and recover's cold start: each calls the runtime as the built-ins are called."""
    from ckptflow import recovery
    from ckptflow.fleet import FleetScope, Node, PolicyChoice, Storage
    from ckptflow.runners.modes import manifest_runner
    from ckptflow.tasks import common
    from ckptflow.tasks import node as node_tasks
    from ckptflow.tasks.move import stop_workload

    home, w = _toy(tmp_path, "turn 1")
    store = LocalStore(tmp_path / "store")

    @contextmanager
    def runner(scope, node):       # the node's runner, without CRIU: this runtime calls none
        with NodeRunner(store, criu=object(), node_fp=Fingerprint()) as r:
            yield r

    for mod in (node_tasks, common):
        monkeypatch.setattr(mod, "node_runner", runner)
    monkeypatch.setattr(node_tasks, "get_run_logger", lambda: logging.getLogger("test"))
    scope = FleetScope(fleet="t", storage=Storage(path=str(tmp_path / "store")))

    row = node_tasks.checkpoint_batch(scope, Node(name="n1", work_pool="n1"), [PolicyChoice(workload=w)],
                                      force=True)[0]
    assert row["ok"] and row["checkpoint"], row
    m = store.get("w1", row["checkpoint"])
    assert m.kind == "heartbeat" and [f.path for f in m.files] == ["state"] and m.pid == 0

    with pytest.raises(WorkloadRunning):                    # over the running worker: refused by the runtime
        node_tasks.restore_workload.fn(scope, w)
    (home / "state").write_text("turn 2, then the worker died")
    assert stop_workload.fn(w) == {"stopped": True, "home": str(home)}
    assert stop_workload.fn(w)["stopped"] is False

    got = node_tasks.restore_workload.fn(scope, w)
    assert got["checkpoint"] == m.id and got["pid"] == 0, got
    assert (home / "state").read_text() == "turn 1" and (home / "alive").exists()
    assert {"checksum", "health"} <= set(got["timings"])

    with NodeRunner(store, criu=object(), node_fp=Fingerprint()) as node:
        res = manifest_runner(node, w, m).verify(w, m)
    assert res.state == VerifyOutcome.verified and "checksum" in res.timings

    (home / "alive").unlink()
    assert recovery.cold_start_row(w) == {"workload": "w1", "pid": 0, "cold_start_s": 0.0}
    assert (home / "state").read_text() == "fresh"


def test_a_runtime_whose_step_takes_other_arguments_fails_through_the_caller(tmp_path, dir_runtime):
    """A toy whose ``dump`` forgot ``leave_running`` passes a test that calls it by hand, and fails here."""

    class Forgetful(DirRuntime):
        def dump(self, w, proc, images_dir):  # type: ignore[override]
            return super().dump(w, proc, images_dir, True)

    register_runtime("dir")(Forgetful)
    home, w = _toy(tmp_path, "x")
    with NodeRunner(LocalStore(tmp_path / "store"), criu=object(), node_fp=Fingerprint()) as node:
        with pytest.raises(TypeError):
            node.checkpoint(w)
        assert list(node.store.list("w1")) == []           # the pending checkpoint was discarded


def test_a_runtime_whose_tools_are_unavailable_never_counts_against_the_last_good_checkpoint(tmp_path, dir_runtime,
                                                                                           monkeypatch):
    """A cluster out of reach (the pod runtime's API server, podman missing) fails every restore the
    same way; counted, the third would mark the only checkpoint verify_failed and retention delete it."""
    from ckptflow.errors import RunnerUnavailable
    from ckptflow.runners.node import MAX_FAILED_RESTORES

    home, w = _toy(tmp_path, "x")
    with NodeRunner(LocalStore(tmp_path / "store"), criu=object(), node_fp=Fingerprint()) as node:
        m = node.checkpoint(w, leave_running=False)

        def unreachable(self, w, m, timings):
            raise RunnerUnavailable("the API server at https://10.0.0.1:6443 does not answer")

        monkeypatch.setattr(DirRuntime, "restore", unreachable)
        for _ in range(MAX_FAILED_RESTORES + 1):
            with pytest.raises(RunnerUnavailable):
                node.restore(w)
        got = node.store.get("w1", m.id)
        assert got.state.restorable and not got.probe.restores.failures
        monkeypatch.setattr(DirRuntime, "restore", lambda self, w, m, t: (_ for _ in ()).throw(
            __import__("ckptflow.errors", fromlist=["RestoreFailed"]).RestoreFailed("the image is torn")))
        with pytest.raises(Exception):
            node.restore(w)
        assert len(node.store.get("w1", m.id).probe.restores.failures) == 1   # the checkpoint's own fault counts


def test_template_sessions_and_replicas_are_refused_under_a_runtime_that_is_not_process(tmp_path, dir_runtime):
    with pytest.raises(ConfigError) as e:
        load_fleet(_fleet(tmp_path, runtime="dir", checkpoint="template-sessions"))
    assert "template-sessions runs only under the process runtime, not runtime: dir" in str(e.value)
    from ckptflow.errors import UnsupportedWorkload

    w = load_fleet(_fleet(tmp_path, runtime="dir")).workloads[0]
    with pytest.raises(UnsupportedWorkload):
        runtime_for(w).refuse_replica(w)
    runtime_for(load_fleet(_fleet(tmp_path)).workloads[0]).refuse_replica(w)   # process: built
