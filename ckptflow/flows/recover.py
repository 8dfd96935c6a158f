"""Recover: bring back a lost workload from its latest valid checkpoint, and prove it."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from ckptflow.errors import CheckpointNotFound, ChecksumMismatch, IncompatibleCheckpoint
from ckptflow.render import render
from ckptflow.store import open_store
from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.node import restore_workload
from ckptflow.tasks.verify import alert_restore_failed, cold_start_workload

# No checkpoint can come back: these never get better by retrying, so fall back to a cold start.
_NO_CHECKPOINT = (CheckpointNotFound, ChecksumMismatch, IncompatibleCheckpoint)


@flow(name="recover", log_prints=True)
def recover(fleet_file: str, workload: str) -> dict:
    """Restore ``workload`` on its node, check health and its session state, leave a report.

    A corrupt newest checkpoint is passed over for the next valid one; with none left (or an
    incompatible one) the worker is cold started from its ``start_command``. Either way one
    Slack alert goes out.

    Example:
        >>> recover("deployments/local.yaml", "demo-chat")   # doctest: +SKIP
    """
    fleet = open_fleet(fleet_file)
    w = fleet.workload(workload)
    try:
        res = restore_workload(fleet_file, workload)
    except _NO_CHECKPOINT as e:
        reason = str(e).splitlines()[0]
        cold = cold_start_workload(fleet_file, workload) if w.start_command else None
        alert_restore_failed(fleet_file, workload, reason, None,
                             f"cold start ({cold['cold_start_s']:.1f} s)" if cold else None)
        create_markdown_artifact(key=f"restore-{workload}", markdown=render(
            "restore_report.md.j2", workload=workload, node=w.node, result=None, skipped=[],
            error=reason + (f" — cold started in {cold['cold_start_s']:.1f} s" if cold else "")))
        if cold is None:
            raise
        return {"workload": workload, "cold_start": True, **cold}
    except Exception as e:
        alert_restore_failed(fleet_file, workload, str(e).splitlines()[0], None, None,
                             getattr(e, "log_tail", ""))
        create_markdown_artifact(key=f"restore-{workload}", markdown=render(
            "restore_report.md.j2", workload=workload, node=w.node, result=None,
            error=str(e).splitlines()[0], skipped=[]))
        raise
    if res["skipped"]:
        alert_restore_failed(fleet_file, workload, "; ".join(s["reason"] for s in res["skipped"]),
                             res["skipped"][0]["id"], f"older checkpoint {res['checkpoint']}")
    manifest = open_store(fleet.storage, w.node).get(workload, res["checkpoint"])
    view = {"manifest": manifest, "pid": res["pid"], "timings": res["timings"]}
    create_markdown_artifact(key=f"restore-{workload}",
                             markdown=render("restore_report.md.j2", workload=workload, node=w.node,
                                             result=view, error=None, skipped=res["skipped"]))
    return {**res, "cold_start": False}
