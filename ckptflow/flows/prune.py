"""Prune: keep the fleet's bucket to its retention rule and free the chunks nothing uses."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.fleet import prune_bucket


@flow(name="prune", log_prints=True, persist_result=True)
def prune(fleet_file: str) -> dict:
    """Delete the bucket's manifests the fleet's ``retention`` names (never a workload's newest
    valid checkpoint), then every chunk no remaining manifest references. Waits for no one:
    while a heartbeat is uploading it skips this run, and uploads back off while it runs.

    Example:
        >>> prune("deployments/example-h200-fleet.yaml")   # doctest: +SKIP
    """
    res = prune_bucket(open_fleet(fleet_file).scope())
    if "skipped" in res:
        get_run_logger().warning("prune skipped: %s", res["skipped"])
        return res
    create_table_artifact(key="prune", table=res["manifests_deleted"] or [{"note": "no manifest past retention"}],
                          description=f"{res['chunks_deleted']} chunks, {res['bytes_freed'] / 2**20:.1f} MiB freed")
    return res
