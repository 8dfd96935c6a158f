"""Recover: bring back a lost workload from its newest valid checkpoint, and prove it; and
recover-node: do that for every workload of a node that is gone, on other nodes."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from ckptflow.alerts import failure
from ckptflow.errors import (CheckpointNotFound, ChecksumMismatch, IncompatibleCheckpoint, NotRecovered,
                             WorkloadRunning)
from ckptflow.flows.steps import run_step, spreader_off
from ckptflow.render import render
from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.fleet import record_placement
from ckptflow.tasks.verify import alert_recovered, alert_restore_failed

# No checkpoint can come back: these never get better by retrying, so fall back to a cold start.
_NO_CHECKPOINT = (CheckpointNotFound, ChecksumMismatch, IncompatibleCheckpoint)


@flow(name="recover", log_prints=True, persist_result=True)
def recover(fleet_file: str, workload: str, node: str | None = None, via_deployments: bool = False) -> dict:
    """Restore ``workload`` on ``node`` (default: the node it runs on), check health and its
    session state, leave a report.

    The restore reads the nearest valid copy: the node's own store, else the S3 tier. A
    corrupt newest checkpoint is passed over for the next valid one; with none left (or an
    incompatible one) the worker is cold started from its ``start_command`` and a restore-failed
    alert opens. A restore posts one "recovered" message, which closes the workload's open alert;
    a refusal because the worker is running posts nothing. Restored on another node, the
    workload's placement moves there.

    Example:
        >>> recover("deployments/local.yaml", "demo-chat")   # doctest: +SKIP
    """
    fleet = open_fleet(fleet_file)
    w = fleet.workload(workload)
    target = node or w.node
    fleet.node(target)
    try:
        res = run_step(target, "restore", fleet_file, workload, None, via_deployments)
    except _NO_CHECKPOINT as e:
        f = failure(e)
        can_start = w.start_command or (w.container is not None and w.container.image)  # a container: its image
        cold = run_step(target, "cold_start", fleet_file, workload, None, via_deployments) if can_start else None
        f["fallback"] = (f"cold start on {target} ({cold['cold_start_s']:.1f} s)" if cold else
                         f"none: {workload} declares no start_command")
        _report_failure(fleet, workload, w.node, target, f)
        if cold is None:
            raise
        _place(fleet, workload, w.node, target, None)
        return {"workload": workload, "node": target, "cold_start": True, **cold}
    except WorkloadRunning:  # nothing is wrong: no alert, the refusal says why
        raise
    except Exception as e:
        f = failure(e)
        f["fallback"] = "none: the restore broke, so no cold start was tried over what it left"
        _report_failure(fleet, workload, w.node, target, f)
        raise
    if any(s["id"] == res["checkpoint"] for s in res["skipped"]):  # a bad node copy, a good bucket one
        how = f"restored from the bucket copy of checkpoint {res['checkpoint']} (this node's copy failed its checks)"
    elif res["skipped"]:
        how = f"restored from older checkpoint {res['checkpoint']} (newer ones failed their checks)"
    else:
        how = f"restored from checkpoint {res['checkpoint']}"
    alert_recovered(fleet.scope(), workload, target, how, res["checkpoint"], res["skipped"])
    _place(fleet, workload, w.node, target, res["checkpoint"])
    create_markdown_artifact(key=f"restore-{workload}",
                             markdown=render("restore_report.md.j2", workload=workload, node=target,
                                             result=res, error=None, skipped=res["skipped"]))
    return {**res, "cold_start": False}


def _report_failure(fleet, workload: str, node: str, target: str, f: dict) -> None:
    """The restore-failed alert and the restore artifact, both naming the checkpoint tried, the
    fallback, the cause's first line and the fix (``alerts.failure`` of the error)."""
    alert_restore_failed(fleet.scope(), workload, node, f["reason"], f["checkpoint"], f["fallback"], f["log_tail"],
                         cause=f["cause"], fix=f["fix"])
    create_markdown_artifact(key=f"restore-{workload}", markdown=render(
        "restore_report.md.j2", workload=workload, node=target, result=None, skipped=[], error=f["reason"], failed=f))


def _place(fleet, workload: str, was: str, now: str, checkpoint: str | None) -> None:
    if now != was:
        record_placement(fleet.scope(), workload, now, checkpoint)  # heartbeats follow it there


@flow(name="recover-node", log_prints=True, persist_result=True)
def recover_node(fleet_file: str, node: str, via_deployments: bool = False) -> list[dict]:
    """``node`` is gone (hardware failure, reclaimed): bring each of its workloads back on
    another node of the same GPU class — from the S3 copy of its newest checkpoint, or a cold
    start where there is none — and report what came back where.

    Example:
        >>> recover_node("deployments/example-h200-fleet.yaml", "h200-07")   # doctest: +SKIP

    Raises:
        NotRecovered: a workload did not come back (after the report, which has every row).
    """
    fleet = open_fleet(fleet_file)
    targets = spreader_off(fleet, node)
    rows = []
    for w in (x for x in fleet.workloads if x.node == node):
        p = targets.place(w.gpu_footprint_gib or 0)
        if p.node is None:
            rows.append({"workload": w.name, "action": "NOT RECOVERED", "target": "-", "reason": p.reason})
            continue
        try:
            r = recover(fleet_file, w.name, node=p.node, via_deployments=via_deployments)
        except Exception as e:
            rows.append({"workload": w.name, "action": "FAILED", "target": p.node, "reason": str(e).splitlines()[0]})
            continue
        targets.placed(p.node)
        rows.append({"workload": w.name, "target": p.node,
                     "action": "cold started" if r["cold_start"] else f"restored {r['checkpoint']}",
                     "reason": p.reason})
    bad = [r for r in rows if r["action"] in ("FAILED", "NOT RECOVERED")]
    create_markdown_artifact(key=f"recover-node-{node}", markdown=render("drain_report.md.j2", node=node, rows=rows,
                                                                         title=f"Recovery of lost node {node}"))
    if bad:  # the report has every row; the run itself must not look green
        err = NotRecovered(f"recover-node {node}: {len(bad)} of {len(rows)} workload(s) did not come back: "
                           + "; ".join(f"{r['workload']} ({r['reason']})" for r in bad),
                           fix="resolve each cause (free a node of the same GPU class, or the error named) and "
                               "recover each of those workloads (the recover flow)")
        err.rows = rows  # the CLI prints them (in-process; the artifact holds them for the UI)
        raise err
    return rows
