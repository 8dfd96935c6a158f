"""A failed node step keeps what failed, and tasks retry only what a retry can help."""

import errno
from types import SimpleNamespace
from uuid import uuid4

import httpx
import pytest
from prefect.states import Completed, Failed

from ckptflow.errors import CriuTimeout, IncompatibleCheckpoint, RestoreFailed
from ckptflow.flows import steps
from ckptflow.tasks.common import retry_if_retryable


def _run_deployment_ending(state):
    def fake(**kw):
        assert kw["name"] == "node-step/test:node-a"   # per-node deployments carry the fleet's name
        return SimpleNamespace(id=uuid4(), state=state)
    return fake


@pytest.fixture
def fleet(tmp_path):
    from conftest import write_fleet
    from ckptflow.models import ProcessFinder, Workload

    w = Workload(name="chat", node="local", find=ProcessFinder(pid_file=str(tmp_path / "w.pid")))
    return str(write_fleet(tmp_path / "fleet.yaml", [w], tmp_path / "store"))


def test_a_failed_steps_error_type_and_first_line_reach_the_caller(monkeypatch, fleet):
    monkeypatch.setattr(steps, "run_deployment", _run_deployment_ending(
        Failed(data=KeyError("gpu_pids"), message="Flow run encountered an exception")))
    with pytest.raises(steps.StepFailed) as e:
        steps.run_step(node="node-a", action="restore", fleet_file=fleet, workload="chat")
    assert e.value.error_type == "KeyError"
    assert "restore of chat on node-a" in str(e.value) and "KeyError: 'gpu_pids'" in str(e.value)
    assert isinstance(e.value.__cause__, KeyError)


def test_a_failed_steps_ckptflow_error_is_raised_as_itself(monkeypatch, fleet):
    monkeypatch.setattr(steps, "run_deployment", _run_deployment_ending(
        Failed(data=RestoreFailed("not healthy", fix="run verify"))))
    with pytest.raises(RestoreFailed, match="not healthy"):
        steps.run_step(node="node-a", action="restore", fleet_file=fleet, workload="chat")


def test_a_completed_step_returns_its_result(monkeypatch, fleet):
    monkeypatch.setattr(steps, "run_deployment", _run_deployment_ending(Completed(data={"pid": 7})))
    assert steps.run_step(node="node-a", action="restore", fleet_file=fleet, workload="chat") == {"pid": 7}


@pytest.mark.parametrize("error,retry", [
    (IncompatibleCheckpoint({"driver": ("580", "590")}, checkpoint="c"), False),
    (CriuTimeout("slow", cmd=["criu"]), True),
    (ConnectionResetError("peer reset"), True),
    (TimeoutError("slow disk"), True),
    (OSError(errno.EIO, "I/O error"), True),
    (httpx.ConnectError("refused"), True),
    (KeyError("gpu_pids"), False),
    (TypeError("unsupported operand"), False),
    (AttributeError("'NoneType' object has no attribute 'pid'"), False),
    (ValueError("bad literal"), False),
    (OSError(errno.ENOENT, "No such file"), False),
    (PermissionError(errno.EACCES, "denied"), False),
], ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else str(x))
def test_retries_only_retryable_ckptflow_errors_and_transient_io(error, retry):
    assert retry_if_retryable(None, None, Failed(data=error)) is retry


def test_a_forced_heartbeat_row_says_forced_next_to_the_checkpoint_it_made(tmp_path, monkeypatch):
    import logging
    from contextlib import contextmanager

    from ckptflow.fleet import FleetScope, Node, PolicyChoice, Storage
    from ckptflow.models import Fingerprint, ProcessFinder, Workload
    from ckptflow.policies.cadence import WorkloadFacts
    from ckptflow.store.local import LocalStore
    from ckptflow.tasks import node as node_tasks

    store = LocalStore(tmp_path / "store")

    class Runner:
        node_fp = Fingerprint()
        gpu = None  # no GPU backend: the process mode needs none for a CPU worker

        def __init__(self):
            self.store = store

        def checkpoint(self, w, leave_running):
            p = store.begin(w.name, node=w.node)
            (p.images_dir / "core-1.img").write_bytes(b"x" * 4096)
            return store.commit(p, timings={"pause": 0.1})

    @contextmanager
    def runner(scope, node):
        yield Runner()

    monkeypatch.setattr(node_tasks, "node_runner", runner)
    monkeypatch.setattr(node_tasks, "get_run_logger", lambda: logging.getLogger("test"))
    # The policy says skip: nothing new since the last checkpoint.
    monkeypatch.setattr(node_tasks, "collect_facts", lambda w, *a, **k: WorkloadFacts(
        name=w.name, traffic="long_sessions", tokens_since_ckpt=0, seconds_since_ckpt=60.0))
    w = Workload(name="chat", node="n1", find=ProcessFinder(pid_file=str(tmp_path / "w.pid")), traffic="long_sessions")
    scope = FleetScope(fleet="t", storage=Storage(path=str(tmp_path / "store")))
    node = Node(name="n1", work_pool="n1")
    quiet = node_tasks.checkpoint_batch(scope, node, [PolicyChoice(workload=w)])[0]
    assert quiet["decision"] == "skip" and quiet["checkpoint"] is None
    row = node_tasks.checkpoint_batch(scope, node, [PolicyChoice(workload=w)], force=True)[0]
    assert row["checkpoint"] and row["decision"] == "forced"
    assert row["reason"].startswith("forced (policy said skip: nothing new")


def test_a_step_whose_deployment_does_not_exist_names_it_and_how_to_make_it(tmp_path, prefect_harness):
    """A fleet deployed before per-node names carried the fleet (or never deployed): Prefect says
    `ObjectNotFound: None`; the step says which deployment and the command that makes it."""
    from conftest import write_fleet
    from ckptflow.errors import ConfigError
    from ckptflow.models import ProcessFinder, Workload

    w = Workload(name="w", node="local", find=ProcessFinder(pid_file=str(tmp_path / "w.pid")))
    f = write_fleet(tmp_path / "fleet.yaml", [w], tmp_path / "store")
    with pytest.raises(ConfigError) as e:
        steps.run_step(node="local", action="restore", fleet_file=str(f), workload="w", via_deployments=True)
    assert str(e.value).splitlines() == ["no deployment node-step/test:local on the Prefect server",
                                         f"  fix: run `ckptflow deploy {f}` (per-node deployments are named "
                                         "<fleet>:<node>)"]
