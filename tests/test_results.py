"""The typed results (ckptflow/results.py) are what the steps and flows really return: every key a
model requires is there, and no step writes a key its model does not declare, through the real
heartbeat and recover flows and back through Prefect's result storage (what ``run_deployment``
hands a fleet flow). A renamed or dropped key a caller reads fails here."""

import os
import pickle
import signal
import typing

import pytest

from conftest import write_fleet
from ckptflow import results


def conforms(row: dict, model, timings: bool = False) -> dict:
    """``row`` has each key ``model`` requires and only keys it declares (``<phase>_s`` too,
    with ``timings``); ``row`` back, for a chained assert."""
    missing = model.__required_keys__ - row.keys()
    extra = {k for k in row.keys() - model.__annotations__.keys() if not (timings and k.endswith("_s"))}
    assert not missing and not extra, f"{model.__name__}: missing {sorted(missing)}, undeclared {sorted(extra)}: {row}"
    return row


def test_every_result_model_declares_its_keys_once():
    models = [v for v in vars(results).values() if typing.is_typeddict(v)]
    assert {m.__name__ for m in models} >= {"CheckpointRow", "WorkloadRestored", "Recovered", "MigratedOut",
                                            "MigratedIn", "MoveRow", "StepParams", "Failure"}
    for m in models:
        assert m.__required_keys__ <= m.__annotations__.keys()
        assert not m.__required_keys__ & m.__optional_keys__, m.__name__


def test_a_move_row_survives_prefects_result_serializer_and_reads_as_its_string():
    from prefect.serializers import PickleSerializer

    from ckptflow.render import render

    rows = [results.MoveRow(workload="chat", action=results.MoveAction.failed, target="node-b", reason="no room"),
            results.MoveRow(workload="api", action=results.MoveAction.stopped, target="-", stopped=True, pid=7)]
    back = PickleSerializer().loads(PickleSerializer().dumps(rows))
    assert back == rows and back[0]["action"] is results.MoveAction.failed and back[0]["action"] == "FAILED"
    assert [results.MoveAction.left_behind(r["action"]) for r in back] == [True, False]
    assert "| chat | FAILED | node-b | no room |" in render("drain_report.md.j2", node="n", rows=back)
    assert pickle.loads(pickle.dumps(results.MoveAction.not_moved)) == "NOT MOVED"


def test_run_step_takes_named_parameters_only_and_sends_no_none_option():
    from ckptflow.flows import steps

    with pytest.raises(TypeError):
        steps.run_step("node-a", "restore", "fleet.yaml", "chat")  # type: ignore[misc]
    p = steps.step_params(node="node-a", action="migrate_in", fleet_file="f.yaml", workload="chat",
                          checkpoint_from="k")
    assert p == {"fleet_file": "f.yaml", "action": "migrate_in", "workload": "chat", "node": "node-a",
                 "checkpoint": None, "checkpoint_from": "k"}
    conforms(p, results.StepParams)


def _persisted(state):
    """The flow run's result as another process reads it: from the server's state, through the
    result storage (what flows.steps.step_result does with run_deployment's flow run)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        return c.read_flow_run(state.state_details.flow_run_id).state.result()


@pytest.mark.criu
def test_heartbeat_and_recover_results_carry_the_keys_their_models_declare(tmp_path, prefect_harness, demo_worker):
    from ckptflow.flows.heartbeat import HeartbeatFailed, heartbeat
    from ckptflow.flows.node_step import node_step
    from ckptflow.flows.recover import recover

    w = demo_worker("chat")
    fleet = str(write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store"))
    w.complete("a long agent transcript " * 30, 16, "agent")

    forced = conforms(heartbeat(fleet, force=True)[0], results.CheckpointRow, timings=True)
    assert forced["ok"] and forced["checkpoint"] and forced["decision"] == "forced" and forced["pause_s"] > 0
    taken = {forced["checkpoint"]}
    for row in heartbeat(fleet):  # the policy's own decision: taken or not, the same model
        taken.add(conforms(row, results.CheckpointRow, timings=True)["checkpoint"] or forced["checkpoint"])

    os.kill(w.pid, signal.SIGKILL)
    with pytest.raises(HeartbeatFailed) as e:
        heartbeat(fleet)
    gone = conforms(e.value.rows[0], results.CheckpointRow)
    assert gone["gone"] is True and not gone["ok"] and gone["error_type"] == "WorkloadNotFound"

    # The restore step as a fleet flow gets it: persisted by the node-step flow, read back.
    state = node_step(fleet, "restore", "chat", "local", return_state=True)
    restored = conforms(_persisted(state), results.WorkloadRestored)
    assert restored["checkpoint"] in taken and restored["workload"] == "chat"
    assert restored == state.result()

    os.kill(w.pid, signal.SIGKILL)
    rec = conforms(recover(fleet, "chat"), results.Recovered)
    assert rec["cold_start"] is False and rec["pid"] == w.pid
