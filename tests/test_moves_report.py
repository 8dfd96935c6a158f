"""A move that cannot happen says so in the fleet flow: a drain that left a workload behind ends
Failed and does not mark its node; a fleet without a shared tier is refused before any node
step runs; a node step's own error line reaches the flow that waited for it."""

from pathlib import Path

import pytest
import yaml

from ckptflow.errors import ConfigError, NotDrained
from ckptflow.flows import steps
from ckptflow.models import ProcessFinder, TrafficClass, Workload

ROOT = Path(__file__).parent.parent
NO_TIER = "moving workloads between nodes needs a shared tier, and storage.kind local has none"


def _ghost(tmp_path, name, traffic=TrafficClass.long_sessions) -> Workload:
    """A declared workload whose worker is gone (no pid file): its migrate_out fails."""
    return Workload(name=name, node="node-a", traffic=traffic, find=ProcessFinder(pid_file=str(tmp_path / f"{name}.pid")))


def _fleet(tmp_path, workloads, **storage) -> str:
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump({
        "fleet": "moves", "storage": {"kind": "local", "path": str(tmp_path / "store" / "{node}"), **storage},
        "nodes": [{"name": "node-a", "work_pool": "node-a", "gpu_class": "cpu"},
                  {"name": "node-b", "work_pool": "node-b", "gpu_class": "cpu"}],
        "workloads": [w.model_dump(mode="json", exclude_none=True) for w in workloads]}))
    return str(f)


def _no_node_step(monkeypatch):
    started = []

    def run_deployment(**kw):
        started.append(kw["parameters"]["action"])
        raise AssertionError(f"node step {kw['parameters']['action']} started")
    monkeypatch.setattr(steps, "run_deployment", run_deployment)
    return started


@pytest.mark.parametrize("flow", ["migrate", "drain", "scale_up"])
def test_a_move_on_a_fleet_without_a_shared_tier_is_refused_before_any_node_step(tmp_path, prefect_harness,
                                                                                monkeypatch, flow):
    from ckptflow.flows.drain import drain
    from ckptflow.flows.migrate import migrate
    from ckptflow.flows.scale import scale_up

    started = _no_node_step(monkeypatch)
    fleet = _fleet(tmp_path, [_ghost(tmp_path, "chat"), _ghost(tmp_path, "api", TrafficClass.short_requests)])
    run = {"migrate": lambda: migrate(fleet, "chat", "node-b", return_state=True),
           "drain": lambda: drain(fleet, "node-a", return_state=True),
           "scale_up": lambda: scale_up(fleet, "chat", "node-b", return_state=True)}[flow]
    state = run()
    assert state.is_failed() and started == []
    with pytest.raises(ConfigError) as e:
        state.result()
    assert NO_TIER in e.value.message and e.value.fix.startswith("set storage: {kind: s3")
    assert NO_TIER in state.message and "fix: set storage" in state.message   # what the Prefect UI shows
    assert not (tmp_path / "store" / "node-a" / ".nodes" / "node-a.drained").exists()


def test_a_failed_target_steps_own_error_reaches_the_migrate_that_waited_for_it(tmp_path, prefect_harness):
    """The trial's chain: node-b's migrate_in fails (here: no shared tier, raised in the task);
    node-a's migrate_out, waiting for it to be ready, fails; the fleet flow reads node-a's step.
    Each level's message carries node-b's own error line, not only "ended Failed"."""
    from prefect.client.orchestration import get_client

    from ckptflow.flows.node_step import node_step

    fleet = _fleet(tmp_path, [_ghost(tmp_path, "chat")])
    target = node_step(fleet, "migrate_in", "chat", "node-b", checkpoint_from="k", return_state=True)
    assert target.is_failed()
    target_id = str(target.state_details.flow_run_id)
    with pytest.raises(steps.StepFailed, match="before it was ready") as e:
        steps.wait_ready(target_id, timeout_s=30)
    assert f"(ConfigError: fleet moves: {NO_TIER}): nothing was checkpointed" in str(e.value)

    source = node_step(fleet, "migrate_out", "chat", "node-a", when_ready=target_id, return_state=True)
    assert source.is_failed()
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(source.state_details.flow_run_id)
    with pytest.raises(steps.StepFailed) as e:
        steps.step_result(fr, "migrate_out", "chat", "node-a")
    first = str(e.value).splitlines()[0]
    assert first.startswith("migrate_out of chat on node-a: flow run ") and f"ConfigError: fleet moves: {NO_TIER}" in first


@pytest.mark.criu
def test_a_drain_that_left_a_workload_behind_fails_and_does_not_mark_the_node(tmp_path, prefect_harness, s3):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from ckptflow.flows.drain import drain

    fleet = _fleet(tmp_path, [_ghost(tmp_path, "chat"), _ghost(tmp_path, "api", TrafficClass.short_requests)],
                   kind="s3", bucket=s3.bucket("ckpt-drain-left"), endpoint_url=s3.endpoint)
    state = drain(fleet, "node-a", via_deployments=False, return_state=True)
    assert state.is_failed()
    with pytest.raises(NotDrained) as e:
        state.result()
    assert e.value.message.startswith("drain of node-a: 1 workload(s) did not move off it, so it is not marked drained: "
                                      "chat (workload chat: pid file ")
    assert "run drain again" in e.value.fix and "still on node-a" in e.value.fix
    assert not (tmp_path / "store" / "node-a" / ".nodes" / "node-a.drained").exists()
    # The report still has every row, the failed one with its reason.
    with get_client(sync_client=True) as c:
        [art] = c.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["drain-node-a"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    assert "| chat | FAILED | node-b | workload chat: pid file " in art.data
    # The node stays in service, so its short-request worker was not stopped for nothing.
    assert "| api | kept (drain incomplete) | - |" in art.data


def test_deploy_warns_once_for_several_nodes_without_a_shared_tier(tmp_path, capsys):
    from ckptflow.deploy import render_prefect_yaml

    f = Path(_fleet(tmp_path, []))
    render_prefect_yaml(f, ROOT)                                          # it still renders (and deploys)
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: fleet moves has 2 nodes and storage.kind local has no shared tier: migrate, "
                           "drain and recover-node cannot move workloads between its nodes")
    assert line.endswith("(fix: set storage.kind to s3 or another shared tier)")
    one = yaml.safe_load(f.read_text())
    one["nodes"] = one["nodes"][:1]
    f.write_text(yaml.safe_dump(one))
    render_prefect_yaml(f, ROOT)
    assert capsys.readouterr().err == ""


def test_a_recover_node_that_left_a_workload_behind_ends_failed_with_the_report(tmp_path, prefect_harness):
    """No node of the lost node's GPU class is left: the workload cannot come back. The run ends
    Failed naming it and why (a green recover-node means every workload serves again), and the
    report still has its row."""
    from prefect.artifacts import Artifact

    from ckptflow.errors import NotRecovered
    from ckptflow.flows.recover import recover_node

    ghost = _ghost(tmp_path, "chat")
    f = Path(_fleet(tmp_path, [ghost]))
    data = yaml.safe_load(f.read_text())
    data["nodes"][1]["gpu_class"] = "H200-141GB"          # no other node of node-a's class
    f.write_text(yaml.safe_dump(data))
    state = recover_node(str(f), "node-a", return_state=True)
    assert state.is_failed()
    with pytest.raises(NotRecovered) as e:
        state.result()
    assert "chat (" in e.value.message and "1 of 1" in e.value.message and e.value.fix
    art = Artifact.get("recover-node-node-a")
    assert art is not None and "chat" in art.data and "NOT RECOVERED" in art.data


def test_the_recover_node_command_prints_every_row_then_the_error_and_exits_1(tmp_path):
    import os
    import subprocess
    import sys

    f = Path(_fleet(tmp_path, [_ghost(tmp_path, "chat")]))
    data = yaml.safe_load(f.read_text())
    data["nodes"][1]["gpu_class"] = "H200-141GB"          # no other node of node-a's class
    f.write_text(yaml.safe_dump(data))
    out = subprocess.run([str(Path(sys.executable).with_name("ckptflow")), "recover-node", str(f), "node-a"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "COLUMNS": "200", "PREFECT_HOME": str(tmp_path / "prefect")})
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-2000:])
    assert "chat" in out.stdout and "NOT RECOVERED" in out.stdout                  # the table, every row
    assert "error: recover-node node-a: 1 of 1 workload(s) did not come back: chat (" in out.stderr
    assert "\nfix: " in out.stderr and "Traceback" not in out.stderr
