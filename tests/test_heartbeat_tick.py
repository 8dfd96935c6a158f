"""The heartbeat tick over many nodes: a few task runs of node groups decide exactly what one task
run per node decided, a failing node neither hides the others nor skips its retry, and an
unchanged node fingerprint is not rewritten every tick."""

import os
import subprocess

import pytest
import yaml

from ckptflow.errors import StorageUnavailable


def _fleet(tmp_path, nodes: int, per_node: int, pid: int, dead: set[str] = frozenset()):
    """A fleet of short-request workloads (the policy says skip) whose pid files name ``pid``,
    except the workloads in ``dead``, whose pid names no process."""
    ws = []
    for i in range(nodes):
        for j in range(per_node):
            name = f"w-{i:02d}-{j}"
            pf = tmp_path / f"{name}.pid"
            pf.write_text(str(2**22 + 1 if name in dead else pid))  # above pid_max: never a live process
            ws.append({"name": name, "node": f"node-{i:02d}", "traffic": "short_requests",
                       "find": {"pid_file": str(pf)}})
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump({"fleet": "tick", "storage": {"kind": "local", "path": str(tmp_path / "store")},
                                 "nodes": [{"name": f"node-{i:02d}", "work_pool": f"node-{i:02d}"}
                                           for i in range(nodes)],
                                 "workloads": ws}))
    return f


@pytest.fixture
def live():
    p = subprocess.Popen(["sleep", "600"])
    yield p.pid
    p.kill()
    p.wait()


def _per_node_rows(fleet_file) -> list[dict]:
    """What each node batch decides (tasks.node.checkpoint_batch, outside Prefect)."""
    from collections import defaultdict

    from prefect.logging import disable_run_logger

    from ckptflow.tasks.common import open_fleet
    from ckptflow.tasks.node import checkpoint_batch

    fleet = open_fleet(str(fleet_file))
    by_node = defaultdict(list)
    for w in fleet.workloads:
        by_node[w.node].append(fleet.policy_choice(w))
    nodes = {n.name: n for n in fleet.nodes}
    with disable_run_logger():
        return [r for n in sorted(by_node) for r in checkpoint_batch(fleet.scope(), nodes[n], by_node[n])]


def _task_runs(flow_run_id, settle_s: float = 60) -> list:
    """The flow run's task runs once each has a final state: Prefect 3 records task-run states
    from events on the server, so a read right after the flow returns can still see Running."""
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + settle_s
    with get_client(sync_client=True) as c:
        while True:
            runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            if (runs and all(r.state and r.state.is_final() for r in runs)) or time.monotonic() > deadline:
                return runs
            time.sleep(0.5)


def test_a_tick_over_40_nodes_runs_a_few_task_runs_and_decides_as_one_per_node(tmp_path, prefect_harness, live):
    from ckptflow.flows.heartbeat import NODE_GROUPS, heartbeat

    fleet = _fleet(tmp_path, nodes=40, per_node=3, pid=live)
    state = heartbeat(str(fleet), return_state=True)
    rows = state.result()
    keep = ("workload", "node", "decision", "reason", "ok", "checkpoint")
    assert [{k: r[k] for k in keep} for r in rows] == [{k: r[k] for k in keep} for r in _per_node_rows(fleet)]
    assert len(rows) == 120 and {r["decision"] for r in rows} == {"skip"}
    runs = _task_runs(state.state_details.flow_run_id)
    assert 1 < len(runs) <= NODE_GROUPS < 40
    assert {r.name for r in runs} >= {"checkpoint-nodes-node-00-to-node-02"}
    assert all(r.state.is_completed() for r in runs)


def test_a_gone_worker_on_one_node_fails_the_tick_with_every_other_row(tmp_path, prefect_harness, live):
    from ckptflow.flows.heartbeat import HeartbeatFailed, heartbeat

    fleet = _fleet(tmp_path, nodes=20, per_node=2, pid=live, dead={"w-07-1"})
    with pytest.raises(HeartbeatFailed) as e:
        heartbeat(str(fleet))
    rows = {r["workload"]: r for r in e.value.rows}
    assert len(rows) == 40
    assert rows["w-07-1"]["error_type"] == "WorkloadNotFound" and not rows["w-07-1"]["ok"]
    assert all(r["ok"] for n, r in rows.items() if n != "w-07-1")


def test_a_node_group_retries_a_retryable_failure_once_and_runs_every_node_before_raising(tmp_path, monkeypatch, live):
    from prefect.logging import disable_run_logger

    from ckptflow.tasks import fleet as fleet_tasks
    from ckptflow.tasks.common import open_fleet
    from ckptflow.tasks.node import checkpoint_batch

    f = open_fleet(str(_fleet(tmp_path, nodes=4, per_node=2, pid=live)))
    batches = [(n, [f.policy_choice(w) for w in f.workloads if w.node == n.name]) for n in f.nodes]
    calls: list[str] = []

    def batch(scope, node, choices, force=False):
        calls.append(node.name)
        if node.name == "node-01" and calls.count("node-01") == 1:
            raise StorageUnavailable("bucket unreachable")            # retryable: tried once more
        if node.name == "node-02":
            raise ValueError("a bug")                                 # not retryable: raised at the end
        return checkpoint_batch(scope, node, choices, force)

    monkeypatch.setattr(fleet_tasks, "checkpoint_batch", batch)
    with disable_run_logger(), pytest.raises(ValueError, match="a bug"):
        fleet_tasks.checkpoint_nodes.fn(f.scope(), batches)
    assert calls == ["node-00", "node-01", "node-01", "node-02", "node-03"]

    monkeypatch.setattr(fleet_tasks, "checkpoint_batch", checkpoint_batch)
    calls.clear()
    with disable_run_logger():
        rows = fleet_tasks.checkpoint_nodes.fn(f.scope(), batches)
    assert [r["workload"] for r in rows] == [w.name for w in f.workloads]


def test_an_unchanged_node_fingerprint_is_not_rewritten_and_a_changed_one_is(tmp_path):
    from ckptflow.models import Fingerprint
    from ckptflow.store.fleetstate import LocalFleetState

    state = LocalFleetState(tmp_path)
    state.put_node_fingerprint("n1", Fingerprint(kernel="6.8.0"))
    path = tmp_path / ".nodes" / "n1.json"
    first = os.stat(path)
    state.put_node_fingerprint("n1", Fingerprint(kernel="6.8.0"))
    assert os.stat(path).st_ino == first.st_ino  # an atomic rewrite would be a new inode
    state.put_node_fingerprint("n1", Fingerprint(kernel="6.9.1"))
    assert os.stat(path).st_ino != first.st_ino
    assert state.node_fingerprints()["n1"].kernel == "6.9.1"
