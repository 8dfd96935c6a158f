"""Invalidate: after any version change, retire checkpoints that can no longer restore."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact

from ckptflow.tasks.fleet import alert_invalidations, apply_retention, invalidate_stale, report_node_fingerprint


@flow(name="invalidate", log_prints=True)
def invalidate(fleet_file: str, node: str | None = None) -> dict:
    """Report this node's fingerprint, invalidate stale checkpoints, alert once, apply retention.

    Schedule it (fleet file ``schedules.invalidate``) on every node: each run refreshes its
    node's fingerprint; a driver, CUDA, kernel, CRIU, engine or model change then retires
    exactly the checkpoints no eligible node can restore.

    Example:
        >>> invalidate("deployments/local.yaml")   # doctest: +SKIP
    """
    report_node_fingerprint(fleet_file, node)
    rows = invalidate_stale(fleet_file, node)
    create_table_artifact(key="invalidate", table=rows or [{"note": "every checkpoint still restorable"}],
                          description="Checkpoints invalidated by this run, with the reason")
    alerts = alert_invalidations(fleet_file, rows) if rows else 0
    deleted = apply_retention(fleet_file, node)
    return {"invalidated": rows, "alerts": alerts, "deleted": deleted}
