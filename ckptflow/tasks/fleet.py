"""Fleet-level steps over the stores, the tier and the fleet state: fingerprints,
invalidation, retention, alerts, placements, templates, and the heartbeat's node groups."""

from __future__ import annotations

from collections import defaultdict

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from ckptflow.alerts import AlertKind
from ckptflow.errors import CkptflowError
from ckptflow.fleet import FleetScope, Node, PolicyChoice
from ckptflow.models import CheckpointKind, CheckpointState, Workload
from ckptflow.policies.compat import stale
from ckptflow.results import CheckpointRow, Invalidated, MoveRow
from ckptflow.runners.fingerprint import node_fingerprint, workload_fingerprint
from ckptflow.runners.gpu import get_backend
from ckptflow.runners.runtime import runtime_for
from ckptflow.store import open_fleet_state, open_store
from ckptflow.tasks import events
from ckptflow.tasks.common import alerter, fingerprints, tier, transient
from ckptflow.tasks.common import run_logger as get_run_logger  # tolerant: also outside a run
from ckptflow.tasks.node import checkpoint_batch


def _retryable(e: Exception) -> bool:
    """What ``tasks.common.retry_if_retryable`` retries, for an exception in hand."""
    return e.retryable if isinstance(e, CkptflowError) else transient(e)


@task(name="checkpoint-nodes", cache_policy=NO_CACHE)  # a heartbeat is never a cached result: no input hashing
def checkpoint_nodes(scope: FleetScope, batches: list[tuple[Node, list[PolicyChoice]]],
                     force: bool = False) -> list[CheckpointRow]:
    """The heartbeat of a group of nodes: each node's batch as ``tasks.node.checkpoint_batch``
    decides and checkpoints it, one node after another.

    A task run costs the client and the Prefect server ~10-20 ms of CPU each (its state
    transitions, events and rows): one per node is most of a 1,000-node tick, so the heartbeat
    runs a few of these instead. What one node task run did stays per node: a node whose batch
    raises a retryable error is tried once more (what retry_if_retryable retries), and a
    node that fails does not keep the group's later nodes from their heartbeat; the first failure
    is raised once all have run.
    """
    out: list[CheckpointRow] = []
    failure: Exception | None = None
    for node, batch in batches:
        for attempt in (1, 2):
            try:
                out += checkpoint_batch(scope, node, batch, force)
                break
            except Exception as e:  # noqa: BLE001 - kept and raised after the other nodes ran
                if attempt == 1 and _retryable(e):
                    get_run_logger().warning("heartbeat of node %s failed (%s); retrying it once", node.name, e)
                    continue
                get_run_logger().error("heartbeat of node %s failed: %s", node.name, e)
                failure = failure or e
                break
    if failure is not None:
        raise failure
    return out


@task(name="report-node-fingerprint")
def report_node_fingerprint(scope: FleetScope, node: str | None) -> dict:
    """Record this node's fingerprint in the fleet state, where the invalidate flow reads it."""
    if node is None:
        get_run_logger().warning("this machine is no node of fleet %s; set CKPTFLOW_NODE", scope.fleet)
        return {}
    fp = node_fingerprint(gpu_backend=scope.gpu_backend(node))  # the GPU fields its own backend reads
    fingerprints(scope).put_node_fingerprint(node, fp)
    return {"node": node, **fp.model_dump(exclude={"notes"})}


@task(name="invalidate-stale-checkpoints")
def invalidate_stale(scope: FleetScope, node: str | None, workloads: list[Workload],
                     nodes: list[Node]) -> list[Invalidated]:
    """Mark every checkpoint no eligible node can restore as invalidated, with the reason: the
    copies in this node's store, and the shared tier's copies of the workloads placed on this node.

    ``workloads`` on the nodes placements put them on and ``nodes`` come from the flow, which
    resolved the fleet once.
    """
    store = open_store(scope.storage, node)
    t = tier(scope)
    reported = fingerprints(scope, t).node_fingerprints()
    gpu_class = {n.name: n.gpu_class for n in nodes}
    gated = {n.name: get_backend(n.gpu_backend).gated for n in nodes}  # the groups its node's backend gates
    by_class: dict[str, list[str]] = defaultdict(list)
    for n in nodes:
        if n.name in reported:
            by_class[n.gpu_class].append(n.name)
    rows: list[Invalidated] = []
    for w in workloads:
        eligible = {n: workload_fingerprint(w, reported[n]) for n in by_class[gpu_class[w.node]]}
        groups = gated[w.node]
        own = runtime_for(w).gated  # a container's runtime versions, say
        for m, why in stale(store.list(w.name), eligible, w.gpu, own, groups):
            store.set_state(m, CheckpointState.invalidated, why)
            rows.append(Invalidated(workload=w.name, node=m.node, checkpoint=m.id, reason=why,
                                    copy=store.copy_tier.value))
        if t is not None and w.node == node:
            for m, why in stale(t.manifests(w.name), eligible, w.gpu, own, groups):
                t.set_state(m, CheckpointState.invalidated, why)
                rows.append(Invalidated(workload=w.name, node=m.node, checkpoint=m.id, reason=why,
                                        copy=t.copy_tier.value))
    for r in rows:
        events.emit("checkpoint.invalidated", workload=r["workload"], node=r["node"], fleet=scope.fleet,
                    checkpoint=r["checkpoint"], reason=r["reason"], copy=r["copy"])
    return rows


@task(name="apply-retention")
def apply_retention(scope: FleetScope, node: str | None, workloads: list[str]) -> list[dict]:
    store = open_store(scope.storage, node)
    return [{"workload": name, "deleted": ckpt, "why": why}
            for name in workloads for ckpt, why in store.apply_retention(name, scope.retention)]


@task(name="collect-template-sessions")
def collect_template_sessions(scope: FleetScope, node: str | None) -> dict:
    """After retention on the node: the two-tier templates nothing needs any more, then the
    chunks no checkpoint left names."""
    store = open_store(scope.storage, node)
    return {"templates_deleted": store.retain_templates(scope.retention), **store.collect_chunks()}


@task(name="alert-invalidations")
def alert_invalidations(scope: FleetScope, rows: list[Invalidated], placed: dict[str, str]) -> int:
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
    """Retention in the fleet's shared tier, then the bytes no manifest references
    (``CheckpointTier.prune``; for S3 the chunks, never while a push runs)."""
    t = tier(scope)
    if t is None:
        return {"skipped": "storage.kind is local: no shared tier to prune (invalidate applies retention per node)"}
    return t.prune(scope.retention)


@task(name="find-template")
def find_template(scope: FleetScope, workload: str) -> str | None:
    """The newest initialised checkpoint (kind scale_template) of ``workload`` in the fleet's shared
    tier, which scale-up starts replicas from; None when there is none (or no shared tier)."""
    t = tier(scope)
    if t is None:
        return None
    return next((m.id for m in t.manifests(workload) if m.kind == CheckpointKind.scale_template), None)


@task(name="record-placement")
def record_placement(scope: FleetScope, workload: str, node: str, checkpoint: str | None) -> bool:
    """The workload now runs on ``node``: heartbeats and recover follow it there (the placement
    goes to the fleet state: the bucket of an S3 fleet, the store root of a local one).
    Returns True once recorded."""
    open_fleet_state(scope.storage).put_placement(workload, node, checkpoint or "cold-start")
    return True


@task(name="mark-node-drained")
def mark_drained(scope: FleetScope, node: str, rows: list[MoveRow]) -> str:
    """Record on the node's own store that ``node`` was drained, and what went where."""
    events.emit("node.drained", node=node, fleet=scope.fleet, moved=[r["workload"] for r in rows])
    return str(open_store(scope.storage, node).mark_drained(node, {"flow_run": str(flow_run.get_id()), "rows": rows}))
