"""Recover: bring back a lost workload from its newest valid checkpoint, and prove it; and
recover-node: do that for every workload of a node that is gone, on other nodes."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from ckptflow.errors import NotRecovered
from ckptflow.flows.steps import run_step, spreader_off
from ckptflow.recovery import recover_sequence
from ckptflow.render import render
from ckptflow.results import ColdStarted, Failure, MoveAction, MoveRow, Recovered, WorkloadRestored
from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.fleet import record_placement
from ckptflow.tasks.verify import alert_recovered, alert_restore_failed


@flow(name="recover", log_prints=True, persist_result=True)
def recover(fleet_file: str, workload: str, node: str | None = None, via_deployments: bool = False) -> Recovered:
    """Restore ``workload`` on ``node`` (default: the node it runs on), check health and its
    session state, leave a report.

    The restore reads the nearest valid copy: the node's own store, else the S3 tier. A
    corrupt newest checkpoint is passed over for the next valid one; with none left (or an
    incompatible one) the worker is cold started from its ``start_command`` and a restore-failed
    alert opens. A restore posts one "recovered" message, which closes the workload's open alert;
    a refusal because the worker is running posts nothing. Restored on another node, the
    workload's placement moves there. (``ckptflow.recovery`` holds the sequence; without a
    Prefect server the CLI runs it in its own process.)

    Example:
        >>> recover("deployments/local.yaml", "demo-chat")   # doctest: +SKIP
    """
    res = recover_sequence(open_fleet(fleet_file), workload, node, _Flow(fleet_file, workload, via_deployments))
    get_run_logger().info("recovered %s on %s, PID %s: %s", workload, res["node"], res["pid"],
                          f"cold started in {res.get('cold_start_s', 0):.1f} s" if res["cold_start"]
                          else f"restored checkpoint {res.get('checkpoint')}")
    return res


class _Flow:
    """The flow's way: node steps through their deployments (or node-step sub-flows), alerts and
    placement as task runs, the report as an artifact."""

    def __init__(self, fleet_file: str, workload: str, via_deployments: bool):
        self.fleet_file, self.workload, self.via_deployments = fleet_file, workload, via_deployments

    def step(self, node: str, action: str) -> WorkloadRestored | ColdStarted:
        return run_step(node=node, action=action, fleet_file=self.fleet_file, workload=self.workload,
                        via_deployments=self.via_deployments)

    def recovered(self, scope, workload, node, how, checkpoint, skipped):
        return alert_recovered(scope, workload, node, how, checkpoint, skipped)

    def failed(self, scope, workload, node, f: Failure):
        return alert_restore_failed(scope, workload, node, f["reason"], f["checkpoint"], f["fallback"], f["log_tail"],
                                    cause=f["cause"], fix=f["fix"])

    def place(self, scope, workload, node, checkpoint):
        return record_placement(scope, workload, node, checkpoint)

    def artifact(self, key: str, markdown: str) -> None:
        create_markdown_artifact(key=key, markdown=markdown)


@flow(name="recover-node", log_prints=True, persist_result=True)
def recover_node(fleet_file: str, node: str, via_deployments: bool = False) -> list[MoveRow]:
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
    rows: list[MoveRow] = []
    for w in (x for x in fleet.workloads if x.node == node):
        p = targets.place(w.gpu_footprint_gib or 0)
        if p.node is None:
            rows.append(MoveRow(workload=w.name, action=MoveAction.not_recovered, target="-", reason=p.reason))
            continue
        try:
            r = recover(fleet_file, w.name, node=p.node, via_deployments=via_deployments)
        except Exception as e:
            rows.append(MoveRow(workload=w.name, action=MoveAction.failed, target=p.node,
                                reason=str(e).splitlines()[0]))
            continue
        targets.placed(p.node)
        rows.append(MoveRow(workload=w.name, target=p.node,
                            action=MoveAction.cold_started if r["cold_start"] else f"restored {r['checkpoint']}",
                            reason=p.reason))
    bad = [r for r in rows if MoveAction.left_behind(r["action"])]
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
