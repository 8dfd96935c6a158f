"""Fleet-level steps over the store: fingerprints, invalidation, retention, alerts."""

from __future__ import annotations

from collections import defaultdict

from prefect import get_run_logger, task
from prefect.runtime import flow_run

from ckptflow.models import CheckpointState
from ckptflow.policies.compat import stale
from ckptflow.runners.fingerprint import node_fingerprint, workload_fingerprint
from ckptflow.tasks.common import alerter, fingerprints, open_fleet, this_node, tier
from ckptflow.store import open_store


@task(name="report-node-fingerprint")
def report_node_fingerprint(fleet_file: str, node: str | None = None) -> dict:
    """Record this node's fingerprint in the store, where the invalidate flow reads it."""
    fleet = open_fleet(fleet_file)
    node = node or this_node(fleet)
    if node is None:
        get_run_logger().warning("this machine is no node of fleet %s; set CKPTFLOW_NODE", fleet.fleet)
        return {}
    fp = node_fingerprint()
    fingerprints(fleet).put_node_fingerprint(node, fp)
    return {"node": node, **fp.model_dump(exclude={"notes"})}


@task(name="invalidate-stale-checkpoints")
def invalidate_stale(fleet_file: str, node: str | None = None) -> list[dict]:
    """Mark every checkpoint no eligible node can restore as invalidated, with the reason: the
    copies in this node's store, and the bucket's copies of the workloads placed on this node."""
    fleet = open_fleet(fleet_file)
    node = node or this_node(fleet)
    store = open_store(fleet.storage, node)
    t = tier(fleet)
    reported = fingerprints(fleet, t).node_fingerprints()
    rows = []
    for w in fleet.workloads:
        cls = fleet.node(w.node).gpu_class
        eligible = {n.name: workload_fingerprint(w, reported[n.name])
                    for n in fleet.nodes if n.gpu_class == cls and n.name in reported}
        for m, why in stale(store.list(w.name), eligible, w.gpu):
            store.set_state(m, CheckpointState.invalidated, why)
            rows.append({"workload": w.name, "node": m.node, "checkpoint": m.id, "reason": why, "copy": "node"})
        if t is not None and w.node == node:
            for m, why in stale([t.manifest(w.name, i) for i in t.list(w.name)], eligible, w.gpu):
                t.set_state(m, CheckpointState.invalidated, why)
                rows.append({"workload": w.name, "node": m.node, "checkpoint": m.id, "reason": why, "copy": "s3"})
    return rows


@task(name="apply-retention")
def apply_retention(fleet_file: str, node: str | None = None) -> list[dict]:
    fleet = open_fleet(fleet_file)
    store = open_store(fleet.storage, node or this_node(fleet))
    return [{"workload": w.name, "deleted": ckpt, "why": why}
            for w in fleet.workloads for ckpt, why in store.apply_retention(w.name, fleet.retention)]


@task(name="alert-invalidations")
def alert_invalidations(fleet_file: str, rows: list[dict]) -> int:
    """One alert per workload whose set of invalidation reasons changed."""
    fleet = open_fleet(fleet_file)
    a = alerter(fleet)
    by_workload = defaultdict(list)
    for r in rows:
        by_workload[r["workload"]].append(r)
    sent = 0
    for name, rs in by_workload.items():
        key = "|".join(sorted({r["reason"] for r in rs}))
        sent += a.send("invalidated", workload=name, key=key, node=fleet.workload(name).node, rows=rs,
                       flow_run_id=flow_run.get_id())
    return sent


@task(name="prune-bucket")
def prune_bucket(fleet_file: str) -> dict:
    """Retention in the fleet's bucket, then the chunks no manifest references (store.s3.prune)."""
    fleet = open_fleet(fleet_file)
    t = tier(fleet)
    if t is None:
        return {"skipped": "storage.kind is local: nothing in a bucket to prune"}
    return t.prune(fleet.retention)
