"""Invalidate: after any version change, retire checkpoints that can no longer restore."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.utilities.annotations import quote

from ckptflow.results import InvalidateResult
from ckptflow.tasks.common import open_fleet, this_node
from ckptflow.tasks.fleet import (alert_invalidations, apply_retention, collect_template_sessions, invalidate_stale,
                                  report_node_fingerprint)


@flow(name="invalidate", log_prints=True)
def invalidate(fleet_file: str, node: str | None = None) -> InvalidateResult:
    """Report this node's fingerprint, invalidate stale checkpoints, alert once, apply retention,
    drop the two-tier templates nothing needs and the chunks no checkpoint names any more.

    Schedule it (fleet file ``schedules.invalidate``) on every node: each run refreshes its
    node's fingerprint; a driver, CUDA, kernel, CRIU, engine or model change then retires
    exactly the checkpoints no eligible node can restore.

    Example:
        >>> invalidate("deployments/local.yaml")   # doctest: +SKIP
    """
    fleet = open_fleet(fleet_file)  # once per run: the tasks get plain values
    scope, node = fleet.scope(), node or this_node(fleet)
    report_node_fingerprint(scope, node)
    rows = invalidate_stale(scope, node, quote(fleet.workloads), fleet.nodes)
    create_table_artifact(key="invalidate", table=rows or [{"note": "every checkpoint still restorable"}],
                          description="Checkpoints invalidated by this run, with the reason")
    placed = {w.name: w.node for w in fleet.workloads}
    alerts = alert_invalidations(scope, rows, {r["workload"]: placed[r["workload"]] for r in rows}) if rows else 0
    deleted = apply_retention(scope, node, [w.name for w in fleet.workloads])
    collected = collect_template_sessions(scope, node)  # templates no one needs, chunks nothing names
    return InvalidateResult(invalidated=rows, alerts=alerts, deleted=deleted, template_sessions=collected)
