"""Node-level steps: checkpoint a batch of workloads, restore one workload."""

from __future__ import annotations

from datetime import datetime, timezone

from prefect import task
from prefect.runtime import flow_run

from ckptflow import recovery
from ckptflow.alerts import AlertKind
from ckptflow.errors import CkptflowError, WorkloadNotFound
from ckptflow.fleet import FleetScope, Node, PolicyChoice
from ckptflow.models import Action, Workload
from ckptflow.policies.cadence import decide, forced
from ckptflow.policies.sessions import export_context
from ckptflow.report import checkpoint_bytes
from ckptflow.results import CheckpointRow, Pushed, WorkloadRestored
from ckptflow.runners.facts import collect_facts, node_mtbf_s
from ckptflow.runners.modes import manifest_runner, mode_runner
from ckptflow.tasks import events
from ckptflow.tasks.common import alerter, fingerprints, node_runner, node_slot, retry_if_retryable
from ckptflow.tasks.common import run_logger as get_run_logger  # tolerant: also outside a run
from ckptflow.tasks.common import tier as fleet_tier


def checkpoint_batch(scope: FleetScope, node: Node, batch: list[PolicyChoice],
                     force: bool = False) -> list[CheckpointRow]:
    """Decide per workload of ``node`` with the policy its fleet rule chose, and checkpoint
    (leave running) those due.

    The flow resolved the fleet once (``scope``, the node's declaration, each workload with
    its policy): a task reads no fleet file and lists no placements. One failure does not stop
    the rest. A plain function, not a task: the heartbeat's ``checkpoint-nodes`` task runs a
    group of node batches (a task run costs ~20 KB of server DB and ~10 ms, which a fleet tick
    over thousands of workloads cannot afford) and retries a node's batch itself. ``force``
    checkpoints every selected workload (manual run).
    """
    log = get_run_logger()
    with node_runner(scope, node.name) as runner:
        tier = fleet_tier(scope)
        fingerprints(scope, tier).put_node_fingerprint(node.name, runner.node_fp)  # keeps what invalidate reads fresh
        alerts = alerter(scope, tier)
        gone_alerts = {k for k, a in alerts.open_alerts().items() if a.get("kind") == AlertKind.worker_gone}
        mtbf_s = node_mtbf_s(node.mtbf_hours, node.failures)
        maintenance = [(mw.start.timestamp(), mw.end.timestamp()) for mw in node.maintenance]
        out = []
        for choice in batch:
            w, name = choice.workload, choice.workload.name
            facts = collect_facts(w, runner.store, mtbf_s=mtbf_s, maintenance=maintenance, gpu=runner.gpu)
            d = decide(facts, choice.policy, choice.params)
            row = dict(workload=name, node=node.name, decision=d.action.value, reason=d.reason)
            if facts.gone:
                # No log line of its own: the row carries the reason and the flow fails with it (the
                # CLI's error line, the run's final state), the alert takes it to Slack; each more
                # was the same line again.
                # What it left in the node's /dev/shm (a container's is its own), once: the first
                # heartbeat that finds it gone (its alert not yet open), not every tick after.
                if name not in gone_alerts:
                    runner.runtime_for(w).clear_leftovers(w)
                newest = next(runner.store.valid(name), None)
                alerts.send(AlertKind.worker_gone, workload=name, key=facts.gone, node=node.name, reason=facts.gone,
                            checkpoint=newest.id if newest else None, flow_run_id=flow_run.get_id())
                out.append(CheckpointRow(**row, ok=False, checkpoint=None, error=facts.gone,
                                         error_type=WorkloadNotFound.__name__, gone=True))
                continue
            if facts.template_sessions:  # the turn-end export weighs sessions in it until the next tick
                runner.store.put_export_context(name, export_context(facts, d).model_dump_json())
            if name in gone_alerts:  # restarted by someone else: the worker-gone alert is over
                alerts.resolve(name, kinds={AlertKind.worker_gone}, node=node.name, how="seen running again",
                               flow_run_id=flow_run.get_id())
            if not (force or (d.due and d.action in (Action.protect, Action.checkpoint_now))):
                log.info("%s: %s (%s)", name, d.action.value, d.reason)
                out.append(CheckpointRow(**row, ok=True, checkpoint=None))
                continue
            if force:  # the row says what was done; the policy's view stays in the reason
                row["decision"] = "forced"
                row["reason"] = forced(d).reason
            began = datetime.now(timezone.utc).replace(microsecond=0)   # manifests keep whole seconds
            try:
                with node_slot(node.name):
                    m = mode_runner(runner, w).checkpoint(w, None if force else export_context(facts, d))
            except CkptflowError as e:
                log.error("checkpoint of %s failed: %s", name, e)
                # gone: the worker vanished between its facts and the dump; the flow decides on this
                # flag (its recover-if-gone rule), not on the exception's name.
                out.append(CheckpointRow(**row, ok=False, error=str(e).splitlines()[0], error_type=type(e).__name__,
                                         gone=isinstance(e, WorkloadNotFound)))
                continue
            size = checkpoint_bytes(m)  # a session checkpoint's bytes are in the chunks it names
            log.info("checkpoint %s (%s) of %s: %.1f MiB%s, pause %.2f s", m.id, m.kind, name, size / 2**20,
                     f" ({m.probe.export.moved_bytes / 2**20:.1f} MiB written)" if m.probe.export else "",
                     m.timings.get("pause", 0.0))
            if m.probe.template:  # a template taken by this heartbeat is most of its bytes: say so
                try:
                    tmpl = runner.store.get(m.probe.template.workload, m.probe.template.id)
                except CkptflowError:  # only a log line: the checkpoint itself stands
                    tmpl = None
                if tmpl is not None and tmpl.created >= began:
                    log.info("  with a new template %s of %s: %.1f MiB", tmpl.id, tmpl.workload,
                             checkpoint_bytes(tmpl) / 2**20)
            pushed: Pushed | dict[str, str] = {}
            if tier is not None:
                try:  # a session checkpoint goes up with its template (once) and the chunks it names
                    pushed = manifest_runner(runner, w, m).push(m, tier)
                except CkptflowError as e:  # the local copy stands; the next heartbeat pushes again
                    log.error("upload of %s to the shared tier failed: %s", m.id, e)
                    pushed = {"upload_error": str(e).splitlines()[0]}
            out.append(CheckpointRow(**row, ok=True, checkpoint=m.id, bytes=size, **pushed,
                                     **{f"{k}_s": v for k, v in m.timings.items()}))
    for row in out:
        events.checkpoint_row(row, scope.fleet)
    return out


@task(name="restore-workload", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_if_retryable)
def restore_workload(scope: FleetScope, w: Workload) -> WorkloadRestored:
    """Restore a lost workload on ``w.node`` (the flow placed it: ``tasks.common.placed``) from
    its newest valid checkpoint, read from the nearest copy: this node's store, else the shared
    tier (older ones if corrupt)."""
    return recovery.restore_workload(scope, w)
