"""Verification and recovery steps that end in alerts."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.runtime import flow_run

from ckptflow.alerts import AlertKind
from ckptflow.fleet import FleetScope
from ckptflow.models import CheckpointState, VerifyOutcome, Workload
from ckptflow.recovery import cold_start_row, send_recovered, send_restore_failed
from ckptflow.results import ColdStarted, Skipped, Verified
from ckptflow.runners.modes import manifest_runner
from ckptflow.tasks import events
from ckptflow.tasks.common import alerter, node_runner, node_slot, open_fleet


@task(name="verify-workload")
def verify_workload(scope: FleetScope, w: Workload) -> Verified:
    """Verify the newest unverified valid checkpoint of one workload in a sandbox (``w`` on
    the node it runs on now, as the flow resolved it)."""
    workload = w.name
    with node_runner(scope, w.node) as node:
        m = next((x for x in node.store.valid(workload) if x.state == CheckpointState.complete), None)
        if m is None:
            return Verified(workload=workload, state=VerifyOutcome.skipped.value,
                            reason="no unverified valid checkpoint")
        with node_slot(w.node):
            res = manifest_runner(node, w, m).verify(w, m)
    row = Verified(workload=workload, node=w.node, checkpoint=m.id, state=res.state.value, reason=res.reason,
                   **{f"{k}_s": v for k, v in res.timings.items()})
    if res.state in (VerifyOutcome.skipped, VerifyOutcome.unverified):  # not proven: the checkpoint stays "complete"
        get_run_logger().warning("verify of %s %s: %s", workload, res.state.value, res.reason)
        return row
    node.store.set_state(m, CheckpointState(res.state.value), res.reason, verify_timings=res.timings)
    events.emit(f"verify.{res.state.value}", workload=workload, node=w.node, fleet=scope.fleet, checkpoint=m.id,
                reason=res.reason)
    a = alerter(scope)
    if res.state == VerifyOutcome.verify_failed:
        a.send(AlertKind.verify_failed, workload=workload, key=m.id, node=w.node, checkpoint=m.id,
               reason=res.reason, log_tail=res.log_tail, flow_run_id=flow_run.get_id())
    else:
        a.resolve(workload, kinds={AlertKind.verify_failed}, node=w.node, how=f"checkpoint {m.id} verified",
                  checkpoint=m.id, flow_run_id=flow_run.get_id())
    return row




@task(name="cold-start-placed")
def cold_start_placed(w: Workload) -> ColdStarted:
    """Start ``w`` (as the flow placed it: ``tasks.common.placed``) from its start_command on
    this node. It reads no fleet file and no fleet state: any storage kind, resolved once."""
    return cold_start_row(w)


@task(name="alert-restore-failed")
def alert_restore_failed(scope: FleetScope, workload: str, node: str, reason: str, checkpoint: str | None,
                         fallback: str | None, log_tail: str = "", cause: str | None = None,
                         fix: str | None = None) -> bool:
    """recovery.send_restore_failed, with its Prefect event and this flow run's link."""
    events.emit("restore.failed", workload=workload, node=node, fleet=scope.fleet, checkpoint=checkpoint,
                reason=reason, cause=cause, fix=fix, fallback=fallback)
    return send_restore_failed(scope, workload, node, reason, checkpoint, fallback, log_tail, cause, fix,
                               flow_run_id=flow_run.get_id())


@task(name="alert-recovered")
def alert_recovered(scope: FleetScope, workload: str, node: str, how: str, checkpoint: str | None,
                    skipped: list[Skipped]) -> bool:
    """recovery.send_recovered, with its Prefect event and this flow run's link."""
    events.emit("restore.succeeded", workload=workload, node=node, fleet=scope.fleet, checkpoint=checkpoint, how=how,
                skipped=[s["id"] for s in skipped] or None)
    return send_recovered(scope, workload, node, how, checkpoint, skipped, flow_run_id=flow_run.get_id())
