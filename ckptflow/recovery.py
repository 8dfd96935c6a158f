"""Recover's sequence, once: restore the workload from its nearest valid checkpoint, else cold
start it, alert either way, move its placement. Two ways to run it:

- the ``recover`` flow (flows/recover.py): each step a node-step run through the node's
  deployment (or a sub-flow), alerts as task runs, the report as a Prefect artifact;
- ``recover_here`` (what ``ckptflow recover`` runs when no Prefect server is configured): the
  same steps in this process, no Prefect imported at all. A temporary Prefect server took ~12 s
  to start before the worker was touched (issue #36); in an incident the worker comes first.

No Prefect here (imported only by the flow's way of running it).

Example:
    >>> recover_here("deployments/local.yaml", "demo-chat")     # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Protocol

from ckptflow.alerts import AlertKind, failure
from ckptflow.errors import CheckpointNotFound, ChecksumMismatch, IncompatibleCheckpoint, WorkloadRunning
from ckptflow.fleet import Fleet, FleetScope
from ckptflow.models import Workload
from ckptflow.render import render
from ckptflow.results import ColdStarted, Failure, Recovered, Skipped, WorkloadRestored
from ckptflow.store import open_fleet_state

# No checkpoint can come back: these never get better by retrying, so fall back to a cold start.
NO_CHECKPOINT = (CheckpointNotFound, ChecksumMismatch, IncompatibleCheckpoint)


def send_recovered(scope: FleetScope, workload: str, node: str, how: str, checkpoint: str | None,
                   skipped: list[Skipped], flow_run_id: str | None = None) -> bool:
    """The one "recovered" message of a successful recover; it closes the workload's open alert.
    Sent by the flow's task (which also emits the Prefect event) and by ``recover_here``."""
    from ckptflow.tasks.common import alerter

    return alerter(scope).resolve(workload, always=True, node=node, how=how, checkpoint=checkpoint,
                                  skipped=skipped, flow_run_id=flow_run_id)


def send_restore_failed(scope: FleetScope, workload: str, node: str, reason: str, checkpoint: str | None,
                        fallback: str | None, log_tail: str = "", cause: str | None = None, fix: str | None = None,
                        flow_run_id: str | None = None) -> bool:
    """Open (or re-post) the workload's restore-failed alert; ``node``: where it runs now;
    ``checkpoint``: the one tried; ``cause``: the first error line of CRIU's log; ``fix``: ckptflow's."""
    from ckptflow.tasks.common import alerter

    return alerter(scope).send(AlertKind.restore_failed, workload=workload, key=reason, node=node,
                               checkpoint=checkpoint, reason=reason, fallback=fallback, log_tail=log_tail,
                               cause=cause, fix=fix, flow_run_id=flow_run_id)


class Via(Protocol):
    """How each part of the sequence runs (the flow's way or this process's)."""

    def step(self, node: str, action: str) -> WorkloadRestored | ColdStarted: ...
    def recovered(self, scope: FleetScope, workload: str, node: str, how: str, checkpoint: str | None,
                  skipped: list[Skipped]) -> Any: ...
    def failed(self, scope: FleetScope, workload: str, node: str, f: Failure) -> Any: ...
    def place(self, scope: FleetScope, workload: str, node: str, checkpoint: str | None) -> Any: ...
    def artifact(self, key: str, markdown: str) -> None: ...


def recover_sequence(fleet: Fleet, workload: str, node: str | None, via: Via) -> Recovered:
    """The recover flow's body (its docstring says what it does), run ``via``.

    Raises:
        WorkloadRunning: the worker runs (no alert: the refusal says why).
        CheckpointNotFound and the rest of NO_CHECKPOINT: none came back and no cold start is declared.
    """
    w = fleet.workload(workload)
    target = node or w.node
    fleet.node(target)
    scope = fleet.scope()
    try:
        res = via.step(target, "restore")
    except NO_CHECKPOINT as e:
        f = failure(e)
        from ckptflow.runners.runtime import runtime_for

        can_start = runtime_for(w).can_cold_start(w)  # a start_command, or a container's image
        cold = via.step(target, "cold_start") if can_start else None
        f["fallback"] = (f"cold start on {target} ({cold['cold_start_s']:.1f} s)" if cold else
                         f"none: {workload} declares no start_command")
        _report_failure(scope, workload, w.node, target, f, via)
        if cold is None:
            raise
        if target != w.node:
            via.place(scope, workload, target, None)
        return {"workload": workload, "node": target, "cold_start": True, **cold}
    except WorkloadRunning:
        raise
    except Exception as e:
        f = failure(e)
        f["fallback"] = "none: the restore broke, so no cold start was tried over what it left"
        _report_failure(scope, workload, w.node, target, f, via)
        raise
    if any(s["id"] == res["checkpoint"] for s in res["skipped"]):  # a bad node copy, a good bucket one
        how = f"restored from the bucket copy of checkpoint {res['checkpoint']} (this node's copy failed its checks)"
    elif res["skipped"]:
        how = f"restored from older checkpoint {res['checkpoint']} (newer ones failed their checks)"
    else:
        how = f"restored from checkpoint {res['checkpoint']}"
    via.recovered(scope, workload, target, how, res["checkpoint"], res["skipped"])
    if target != w.node:  # heartbeats follow it there
        via.place(scope, workload, target, res["checkpoint"])
    via.artifact(f"restore-{workload}", render("restore_report.md.j2", workload=workload, node=target, result=res,
                                               error=None, skipped=res["skipped"]))
    return {**res, "cold_start": False}


def _report_failure(scope: FleetScope, workload: str, node: str, target: str, f: Failure, via: Via) -> None:
    """The restore-failed alert and the restore report, both naming the checkpoint tried, the
    fallback, the cause's first line and the fix (``alerts.failure`` of the error)."""
    via.failed(scope, workload, node, f)
    via.artifact(f"restore-{workload}", render("restore_report.md.j2", workload=workload, node=target, result=None,
                                               skipped=[], error=f["reason"], failed=f))


# --- in this process ---------------------------------------------------------------------------
def restore_workload(scope: FleetScope, w: Workload) -> WorkloadRestored:
    """Restore ``w`` on ``w.node`` from its newest valid checkpoint, read from the nearest copy:
    this node's store, else the shared tier (older ones if corrupt). The restore task's body."""
    from ckptflow.runners.modes import mode_runner
    from ckptflow.tasks.common import node_runner, node_slot, tier

    with node_slot(w.node), node_runner(scope, w.node) as runner:
        res = mode_runner(runner, w).restore(w, tier=tier(scope))
    return WorkloadRestored(workload=w.name, node=w.node, **res.summary())


def cold_start_row(w: Workload) -> ColdStarted:
    """Start ``w`` from scratch on this node through its runtime (its start_command, or a container's
    image), wait until healthy. The cold-start task's body."""
    from ckptflow.runners.runtime import runtime_for

    pid, seconds = runtime_for(w).cold_start(w)
    return ColdStarted(workload=w.name, pid=pid, cold_start_s=round(seconds, 3))


class Here:
    """The sequence in this process: this machine is the node; alerts and placement as the
    tasks do them, without a flow run (no Prefect events: no server to send them to)."""

    def __init__(self, fleet: Fleet, workload: str):
        self.fleet, self.workload = fleet, workload

    def step(self, node: str, action: str) -> WorkloadRestored | ColdStarted:
        from ckptflow.tasks.common import placed

        w = placed(self.fleet, self.workload, node)
        return restore_workload(self.fleet.scope(), w) if action == "restore" else cold_start_row(w)

    def recovered(self, scope, workload, node, how, checkpoint, skipped):
        return send_recovered(scope, workload, node, how, checkpoint, skipped)

    def failed(self, scope, workload, node, f):
        return send_restore_failed(scope, workload, node, f["reason"], f["checkpoint"], f["fallback"], f["log_tail"],
                                   f["cause"], f["fix"])

    def place(self, scope, workload, node, checkpoint):
        open_fleet_state(scope.storage).put_placement(workload, node, checkpoint or "cold-start")

    def artifact(self, key: str, markdown: str) -> None:
        return None   # no Prefect server: the command's own output is the report


def recover_here(fleet_file: str, workload: str, node: str | None = None) -> Recovered:
    """``recover`` in this process, without Prefect (see the module docstring)."""
    from ckptflow.tasks.common import open_fleet

    fleet = open_fleet(fleet_file)
    return recover_sequence(fleet, workload, node, Here(fleet, workload))
