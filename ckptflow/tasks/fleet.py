"""Fleet-level steps over the store: fingerprints, invalidation, retention, alerts."""

from __future__ import annotations

from collections import defaultdict

from prefect import get_run_logger, task
from prefect.runtime import flow_run

from ckptflow.alerts import AlertKind
from ckptflow.fleet import FleetScope, Node
from ckptflow.models import CheckpointState, Workload
from ckptflow.policies.compat import stale
from ckptflow.runners.fingerprint import node_fingerprint, workload_fingerprint
from ckptflow.store import open_store
from ckptflow.tasks.common import alerter, fingerprints, tier


@task(name="report-node-fingerprint")
def report_node_fingerprint(scope: FleetScope, node: str | None) -> dict:
    """Record this node's fingerprint in the store, where the invalidate flow reads it."""
    if node is None:
        get_run_logger().warning("this machine is no node of fleet %s; set CKPTFLOW_NODE", scope.fleet)
        return {}
    fp = node_fingerprint()
    fingerprints(scope).put_node_fingerprint(node, fp)
    return {"node": node, **fp.model_dump(exclude={"notes"})}


@task(name="invalidate-stale-checkpoints")
def invalidate_stale(scope: FleetScope, node: str | None, workloads: list[Workload], nodes: list[Node]) -> list[dict]:
    """Mark every checkpoint no eligible node can restore as invalidated, with the reason: the
    copies in this node's store, and the bucket's copies of the workloads placed on this node.

    ``workloads`` on the nodes placements put them on and ``nodes`` come from the flow, which
    resolved the fleet once.
    """
    store = open_store(scope.storage, node)
    t = tier(scope)
    reported = fingerprints(scope, t).node_fingerprints()
    gpu_class = {n.name: n.gpu_class for n in nodes}
    by_class: dict[str, list[str]] = defaultdict(list)
    for n in nodes:
        if n.name in reported:
            by_class[n.gpu_class].append(n.name)
    rows = []
    for w in workloads:
        eligible = {n: workload_fingerprint(w, reported[n]) for n in by_class[gpu_class[w.node]]}
        for m, why in stale(store.list(w.name), eligible, w.gpu):
            store.set_state(m, CheckpointState.invalidated, why)
            rows.append({"workload": w.name, "node": m.node, "checkpoint": m.id, "reason": why, "copy": "node"})
        if t is not None and w.node == node:
            for m, why in stale([t.manifest(w.name, i) for i in t.list(w.name)], eligible, w.gpu):
                t.set_state(m, CheckpointState.invalidated, why)
                rows.append({"workload": w.name, "node": m.node, "checkpoint": m.id, "reason": why, "copy": "s3"})
    return rows


@task(name="apply-retention")
def apply_retention(scope: FleetScope, node: str | None, workloads: list[str]) -> list[dict]:
    store = open_store(scope.storage, node)
    return [{"workload": name, "deleted": ckpt, "why": why}
            for name in workloads for ckpt, why in store.apply_retention(name, scope.retention)]


@task(name="alert-invalidations")
def alert_invalidations(scope: FleetScope, rows: list[dict], placed: dict[str, str]) -> int:
    """One alert per workload whose set of invalidation reasons changed. ``placed``: each
    workload's node now."""
    a = alerter(scope)
    by_workload = defaultdict(list)
    for r in rows:
        by_workload[r["workload"]].append(r)
    sent = 0
    for name, rs in by_workload.items():
        key = "|".join(sorted({r["reason"] for r in rs}))
        sent += a.send(AlertKind.invalidated, workload=name, key=key, node=placed[name], rows=rs,
                       flow_run_id=flow_run.get_id())
    return sent


@task(name="prune-bucket")
def prune_bucket(scope: FleetScope) -> dict:
    """Retention in the fleet's bucket, then the chunks no manifest references (store.s3.prune)."""
    t = tier(scope)
    if t is None:
        return {"skipped": "storage.kind is local: nothing in a bucket to prune"}
    return t.prune(scope.retention)


@task(name="record-placement")
def record_placement(scope: FleetScope, workload: str, node: str, checkpoint: str | None) -> bool:
    """The workload now runs on ``node``: heartbeats and recover follow it there (S3 fleets; a
    local fleet has one node's store and no placements). Returns whether it was recorded."""
    t = tier(scope)
    if t is None:
        return False
    t.put_placement(workload, node, checkpoint or "cold-start")
    return True


@task(name="mark-node-drained")
def mark_drained(scope: FleetScope, node: str, rows: list[dict]) -> str:
    """Record on the node's store that ``node`` was drained, and what went where."""
    return str(open_store(scope.storage, node).mark_drained(node, {"flow_run": str(flow_run.get_id()), "rows": rows}))
