"""migrate and drain: move work off a node, through S3, with the source kept restorable."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from ckptflow.models import TrafficClass
from ckptflow.render import render
from ckptflow.policies.cadence import CostModel
from ckptflow.flows.steps import move, run_step, spreader_off, wait_step
from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.fleet import find_template, mark_drained, record_placement


@flow(name="migrate", log_prints=True, persist_result=True)
def migrate(fleet_file: str, workload: str, target_node: str, via_deployments: bool = True) -> dict:
    """Move ``workload`` to ``target_node``: checkpoint on the source (the worker exits), push
    to S3, pull and restore on the target. If anything fails after the source exited, the
    checkpoint is restored on the source again. A report artifact either way.

    Start it from the Prefect UI (deployment ``migrate/<fleet>``) with the workload and target.
    """
    fleet = open_fleet(fleet_file)
    w = fleet.workload(workload)
    fleet.node(target_node)
    source = w.node
    paired = via_deployments and target_node != source  # one node's steps run one at a time (concurrency 1)
    if paired:  # the target's step starts first: the worker is down for the move only (flows.steps.move)
        out, inn_run = move(source, target_node, fleet_file, workload)
    else:
        out = run_step(source, "migrate_out", fleet_file, workload, None, via_deployments)
    try:
        inn = (wait_step(inn_run, "migrate_in", workload, target_node) if paired else
               run_step(target_node, "migrate_in", fleet_file, workload, out["checkpoint"], via_deployments))
    except Exception as e:
        get_run_logger().error("move of %s to %s failed (%s); restoring on %s", workload, target_node, e, source)
        back = run_step(source, "restore_local", fleet_file, workload, out["checkpoint"], via_deployments)
        create_markdown_artifact(key=f"migrate-{workload}", markdown=render(
            "migrate_report.md.j2", workload=workload, source=source, target=target_node, out=out, inn=None,
            back=back, error=str(e).splitlines()[0]))
        raise
    record_placement(fleet.scope(), workload, target_node, out["checkpoint"])  # heartbeats follow it there
    create_markdown_artifact(key=f"migrate-{workload}", markdown=render(
        "migrate_report.md.j2", workload=workload, source=source, target=target_node, out=out, inn=inn,
        back=None, error=None))
    return {"workload": workload, "source": source, "target": target_node, "checkpoint": out["checkpoint"],
            "pid": inn["pid"], "out": out, "in": inn}


@flow(name="drain", log_prints=True, persist_result=True)
def drain(fleet_file: str, node: str, via_deployments: bool = True) -> list[dict]:
    """Ahead of maintenance: move long-session workloads off ``node`` (placement picks the
    target), stop short-request ones once drained, report what went where, mark the node."""
    fleet = open_fleet(fleet_file)
    targets = spreader_off(fleet, node)
    rows = []
    for w in (x for x in fleet.workloads if x.node == node):
        if w.traffic == TrafficClass.short_requests:
            r = run_step(node, "stop", fleet_file, w.name, None, via_deployments)
            rows.append({"workload": w.name, "action": "stopped (short requests)", "target": "-", **r})
            continue
        p = targets.place(w.gpu_footprint_gib or 0)
        if p.node is None:
            rows.append({"workload": w.name, "action": "NOT MOVED", "target": "-", "reason": p.reason})
            continue
        try:
            res = migrate(fleet_file, w.name, p.node, via_deployments)
            targets.placed(p.node)
            rows.append({"workload": w.name, "action": "migrated", "target": p.node, "checkpoint": res["checkpoint"]})
        except Exception as e:
            rows.append({"workload": w.name, "action": "FAILED", "target": p.node, "reason": str(e).splitlines()[0]})
    mark_drained(fleet.scope(), node, rows)
    create_markdown_artifact(key=f"drain-{node}", markdown=render("drain_report.md.j2", node=node, rows=rows))
    return rows


@flow(name="scale-up", log_prints=True, persist_result=True)
def scale_up(fleet_file: str, workload: str, target_node: str, via_deployments: bool = True) -> dict:
    """Add a replica of ``workload`` on ``target_node`` from its initialised checkpoint (the
    template taken before traffic): warm weights and graphs, none of the original's sessions,
    in its own PID and network namespace so it coexists with the original. Takes the template
    first when there is none. Records its start time against the cold start it replaces.
    """
    fleet = open_fleet(fleet_file)
    w = fleet.workload(workload)
    ckpt = find_template(fleet.scope(), workload) or run_step(w.node, "take_template", fleet_file, workload, None,
                                                              via_deployments)["checkpoint"]
    res = run_step(target_node, "scale_up_in", fleet_file, workload, ckpt, via_deployments)
    cold = CostModel().cold_start_s
    create_markdown_artifact(key=f"scale-up-{workload}", markdown=render(
        "scale_up_report.md.j2", workload=workload, node=target_node, res=res, cold_start_s=cold))
    return {**res, "cold_start_assumed_s": cold}


@flow(name="scale-down", log_prints=True, persist_result=True)
def scale_down(fleet_file: str, workload: str, node: str, replica: str | None = None,
               via_deployments: bool = True) -> dict:
    """Stop a replica scale_up started on ``node`` (``replica``: its network namespace, as
    scale_up reported it), or all of ``workload``'s replicas there. The original is untouched."""
    open_fleet(fleet_file).node(node)
    return run_step(node, "scale_down", fleet_file, workload, None, via_deployments, replica=replica)
