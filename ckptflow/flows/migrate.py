"""migrate: move one workload to another node, through the shared tier, with the source kept
restorable. drain (flows/drain.py) moves every workload off a node with it."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from ckptflow.errors import ConfigError
from ckptflow.flows.steps import move, run_step, wait_step
from ckptflow.render import render
from ckptflow.results import Migrated
from ckptflow.tasks import events
from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.fleet import record_placement
from ckptflow.tasks.move import need_shared_tier


@flow(name="migrate", log_prints=True, persist_result=True)
def migrate(fleet_file: str, workload: str, target_node: str, via_deployments: bool = True) -> Migrated:
    """Move ``workload`` to ``target_node``: checkpoint on the source (the worker exits), push
    to S3, pull and restore on the target. If anything fails after the source exited, the
    checkpoint is restored on the source again. A report artifact either way.

    Start it from the Prefect UI (deployment ``migrate/<fleet>``) with the workload and target.
    """
    fleet = open_fleet(fleet_file)
    w = fleet.workload(workload)
    fleet.node(target_node)
    if target_node == w.node:  # a typo here would cost the worker a checkpoint's pause and a restore
        others = ", ".join(n.name for n in fleet.nodes if n.name != w.node) or "none declared"
        raise ConfigError(f"workload {workload} already runs on {target_node}: nothing to move",
                          fix=f"name another node as target_node (others: {others})")
    need_shared_tier(fleet.scope())  # before any step: from a step, its error stayed on its node
    source = w.node
    # Two nodes, each running one step at a time (concurrency 1): the target's step starts first,
    # so the worker is down for the move only (flows.steps.move).
    if via_deployments:
        out, inn_run = move(source=source, target=target_node, fleet_file=fleet_file, workload=workload)
    else:
        out = run_step(node=source, action="migrate_out", fleet_file=fleet_file, workload=workload,
                       via_deployments=via_deployments)
    try:
        inn = (wait_step(inn_run, action="migrate_in", workload=workload, node=target_node) if via_deployments else
               run_step(node=target_node, action="migrate_in", fleet_file=fleet_file, workload=workload,
                        checkpoint=out["checkpoint"], via_deployments=via_deployments))
    except Exception as e:
        get_run_logger().error("move of %s to %s failed (%s); restoring on %s", workload, target_node, e, source)
        back = run_step(node=source, action="restore_local", fleet_file=fleet_file, workload=workload,
                        checkpoint=out["checkpoint"], via_deployments=via_deployments)
        create_markdown_artifact(key=f"migrate-{workload}", markdown=render(
            "migrate_report.md.j2", workload=workload, source=source, target=target_node, out=out, inn=None,
            back=back, error=str(e).splitlines()[0]))
        raise
    record_placement(fleet.scope(), workload, target_node, out["checkpoint"])  # heartbeats follow it there
    # The run's log says the outcome, as a heartbeat's does (the fleet-mode trial found only the artifact).
    get_run_logger().info("moved %s: %s -> %s, PID %s, checkpoint %s", workload, source, target_node,
                          inn["pid"], out["checkpoint"])
    events.emit("workload.migrated", workload=workload, node=target_node, fleet=fleet.fleet, checkpoint=out["checkpoint"],
                source=source, target=target_node)
    create_markdown_artifact(key=f"migrate-{workload}", markdown=render(
        "migrate_report.md.j2", workload=workload, source=source, target=target_node, out=out, inn=inn,
        back=None, error=None))
    return {"workload": workload, "source": source, "target": target_node, "checkpoint": out["checkpoint"],
            "pid": inn["pid"], "out": out, "in": inn}


# Deployments made before drain and scale-up/-down had modules of their own name them here
# (ckptflow/flows/migrate.py:drain); they load until the fleet is deployed again.
_MOVED = {"drain": "ckptflow.flows.drain", "scale_up": "ckptflow.flows.scale", "scale_down": "ckptflow.flows.scale"}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
