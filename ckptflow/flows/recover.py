"""Recover: bring back a lost workload from its latest valid checkpoint, and prove it."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from ckptflow.render import render
from ckptflow.store import open_store
from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.node import restore_workload


@flow(name="recover", log_prints=True)
def recover(fleet_file: str, workload: str) -> dict:
    """Restore ``workload`` on its node, check health and its session state, leave a report.

    Example:
        >>> recover("deployments/local.yaml", "demo-chat")   # doctest: +SKIP
    """
    fleet = open_fleet(fleet_file)
    w = fleet.workload(workload)
    try:
        res = restore_workload(fleet_file, workload)
    except Exception as e:
        create_markdown_artifact(key=f"restore-{workload}",
                                 markdown=render("restore_report.md.j2", workload=workload, node=w.node,
                                                 result=None, error=str(e).splitlines()[0], skipped=[]))
        raise
    manifest = open_store(fleet.storage).get(workload, res["checkpoint"])
    view = {"manifest": manifest, "pid": res["pid"], "timings": res["timings"]}
    create_markdown_artifact(key=f"restore-{workload}",
                             markdown=render("restore_report.md.j2", workload=workload, node=w.node,
                                             result=view, error=None, skipped=res["skipped"]))
    return res
