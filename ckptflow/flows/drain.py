"""drain: ahead of maintenance, move a node's long-session workloads elsewhere (each a migrate)
and stop its short-request ones once drained."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from ckptflow.errors import NotDrained
from ckptflow.flows.migrate import migrate
from ckptflow.flows.steps import run_step, spreader_off
from ckptflow.models import TrafficClass
from ckptflow.render import render
from ckptflow.results import MoveAction, MoveRow
from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.fleet import mark_drained
from ckptflow.tasks.move import need_shared_tier


@flow(name="drain", log_prints=True, persist_result=True)
def drain(fleet_file: str, node: str, via_deployments: bool = True) -> list[MoveRow]:
    """Ahead of maintenance: move long-session workloads off ``node`` (placement picks the
    target), then, only when every one moved, stop the short-request ones; report what went
    where and mark the node.

    Raises:
        ConfigError: a workload would move and the fleet has no shared tier (nothing was done).
        NotDrained: a workload did not move (the report has every row; the node is not marked).
    """
    fleet = open_fleet(fleet_file)
    targets = spreader_off(fleet, node)
    here = [x for x in fleet.workloads if x.node == node]
    if any(x.traffic != TrafficClass.short_requests for x in here):
        need_shared_tier(fleet.scope())  # before a short-request worker is stopped for nothing
    rows: list[MoveRow] = []
    for w in (x for x in here if x.traffic != TrafficClass.short_requests):
        p = targets.place(w.gpu_footprint_gib or 0)
        if p.node is None:
            rows.append(MoveRow(workload=w.name, action=MoveAction.not_moved, target="-", reason=p.reason))
            continue
        try:
            res = migrate(fleet_file, w.name, p.node, via_deployments)
            targets.placed(p.node)
            rows.append(MoveRow(workload=w.name, action=MoveAction.migrated, target=p.node,
                                checkpoint=res["checkpoint"]))
        except Exception as e:
            rows.append(MoveRow(workload=w.name, action=MoveAction.failed, target=p.node,
                                reason=str(e).splitlines()[0]))
    left = [r for r in rows if MoveAction.left_behind(r["action"])]
    for w in (x for x in here if x.traffic == TrafficClass.short_requests):
        if left:  # the node stays in service: its short-request workers keep serving
            rows.append(MoveRow(workload=w.name, action=MoveAction.kept, target="-"))
            continue
        r = run_step(node=node, action="stop", fleet_file=fleet_file, workload=w.name, via_deployments=via_deployments)
        rows.append(MoveRow(workload=w.name, action=MoveAction.stopped, target="-", **r))
    create_markdown_artifact(key=f"drain-{node}", markdown=render("drain_report.md.j2", node=node, rows=rows))
    get_run_logger().info("drain of %s: %s", node, "; ".join(
        f"{r['workload']} {MoveAction(r['action']).value}" + (f" -> {r['target']}" if r["target"] != "-" else "")
        + (f" ({r['reason']})" if r.get("reason") else "") for r in rows) or "no workloads on it")
    if left:  # a green drain is the go for maintenance: never with a worker still on the node
        raise NotDrained(f"drain of {node}: {len(left)} workload(s) did not move off it, so it is not marked "
                         "drained: " + "; ".join(f"{r['workload']} ({r['reason']})" for r in left),
                         fix=f"resolve each cause and run drain again; until it ends Completed those workloads are "
                             f"still on {node}: do not start its maintenance")
    mark_drained(fleet.scope(), node, rows)
    return rows
