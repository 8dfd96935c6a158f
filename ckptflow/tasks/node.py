"""Node-level steps: checkpoint a batch of workloads, restore one workload."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.runtime import flow_run

from ckptflow.errors import CkptflowError
from ckptflow.models import Action
from ckptflow.policies.cadence import decide
from ckptflow.runners.facts import collect_facts, node_mtbf_s
from ckptflow.tasks.common import alerter, fingerprints, node_runner, node_slot, open_fleet, retry_if_retryable
from ckptflow.tasks.common import tier as fleet_tier


@task(name="checkpoint-node-batch", retries=1, retry_condition_fn=retry_if_retryable)
def checkpoint_batch(fleet_file: str, node: str, workloads: list[str], force: bool = False) -> list[dict]:
    """Decide per workload with its fleet policy and checkpoint (leave running) those due.

    One failure does not stop the rest. One task per node batch, not per workload: a task
    run costs ~20 KB of server DB and ~10 ms, which a fleet tick over thousands of
    workloads cannot afford. ``force`` checkpoints every selected workload (manual run).
    """
    log = get_run_logger()
    fleet = open_fleet(fleet_file)
    with node_runner(fleet, node) as runner:
        node_cfg = fleet.node(node)
        tier = fleet_tier(fleet)
        fingerprints(fleet, tier).put_node_fingerprint(node, runner.node_fp)  # keeps what invalidate reads fresh
        alerts = alerter(fleet, tier)
        gone_alerts = {k for k, a in alerts.open_alerts().items() if a.get("kind") == "worker_gone"}
        out = []
        for name in workloads:
            w = fleet.workload(name)
            rule = fleet.rule_for(w)
            facts = collect_facts(w, runner.store, mtbf_s=node_mtbf_s(node_cfg.mtbf_hours, node_cfg.failures),
                                  maintenance=[(mw.start.timestamp(), mw.end.timestamp())
                                               for mw in node_cfg.maintenance])
            d = decide(facts, rule.policy if rule else "cost-based", rule.params if rule else {})
            row = {"workload": name, "node": node, "decision": d.action.value, "reason": d.reason}
            if facts.gone:
                log.error("%s: %s", name, d.reason)
                newest = next(runner.store.valid(name), None)
                alerts.send("worker_gone", workload=name, key=facts.gone, node=node, reason=facts.gone,
                            checkpoint=newest.id if newest else None, flow_run_id=flow_run.get_id())
                out.append({**row, "ok": False, "checkpoint": None, "error": facts.gone,
                            "error_type": "WorkloadNotFound"})
                continue
            if name in gone_alerts:  # restarted by someone else: the worker-gone alert is over
                alerts.resolve(name, kinds={"worker_gone"}, node=node, how="seen running again",
                               flow_run_id=flow_run.get_id())
            if not (force or (d.due and d.action in (Action.protect, Action.checkpoint_now))):
                log.info("%s: %s (%s)", name, d.action.value, d.reason)
                out.append({**row, "ok": True, "checkpoint": None})
                continue
            if force:
                row["reason"] = f"forced (policy said {d.action.value}: {d.reason})"
            try:
                with node_slot(node):
                    m = runner.checkpoint(w, leave_running=True)
            except CkptflowError as e:
                log.error("checkpoint of %s failed: %s", name, e)
                out.append({**row, "ok": False, "error": str(e).splitlines()[0], "error_type": type(e).__name__})
                continue
            log.info("checkpoint %s of %s: %.1f MiB, dump %.2f s", m.id, name, m.bytes / 2**20, m.timings["dump"])
            pushed = {}
            if tier is not None:
                try:
                    pushed = tier.push(runner.store, m)
                except CkptflowError as e:  # the local copy stands; the next heartbeat pushes again
                    log.error("upload of %s to S3 failed: %s", m.id, e)
                    pushed = {"upload_error": str(e).splitlines()[0]}
            out.append({**row, "ok": True, "checkpoint": m.id, "bytes": m.bytes, **pushed,
                        **{f"{k}_s": v for k, v in m.timings.items()}})
    return out


@task(name="restore-workload", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_if_retryable)
def restore_workload(fleet_file: str, workload: str, node: str | None = None) -> dict:
    """Restore a lost workload on ``node`` (default: its own) from its newest valid checkpoint,
    read from the nearest copy: this node's store, else the S3 tier (older ones if corrupt)."""
    fleet = open_fleet(fleet_file)
    w = fleet.workload(workload)
    if node is not None and node != w.node:
        fleet.node(node)
        w = w.model_copy(update={"node": node})
    with node_slot(w.node), node_runner(fleet, w.node) as runner:
        res = runner.restore(w, tier=fleet_tier(fleet))
    return {"workload": workload, "node": w.node, "checkpoint": res.manifest.id, "pid": res.pid,
            "timings": res.timings, "bytes": res.manifest.bytes, "downloaded_bytes": res.downloaded_bytes,
            "copies": [f"{c.tier.value}:{c.location}" for c in res.manifest.copies], "skipped": res.skipped,
            "created": res.manifest.created.strftime("%Y-%m-%d %H:%M:%S UTC"), "files": len(res.manifest.files),
            "sessions": len(res.manifest.probe.get("sessions") or {})}
