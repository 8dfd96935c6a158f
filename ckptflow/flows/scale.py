"""scale-up and scale-down: replicas of a workload started from its template (the initialised
checkpoint) in their own PID and network namespaces, and stopped again."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from ckptflow.flows.steps import run_step
from ckptflow.policies.cadence import CostModel
from ckptflow.render import render
from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.fleet import find_template
from ckptflow.tasks.move import need_shared_tier


@flow(name="scale-up", log_prints=True, persist_result=True)
def scale_up(fleet_file: str, workload: str, target_node: str, via_deployments: bool = True) -> dict:
    """Add a replica of ``workload`` on ``target_node`` from its initialised checkpoint (the
    template taken before traffic): warm weights and graphs, none of the original's sessions,
    in its own PID and network namespace so it coexists with the original. Takes the template
    first when there is none. Records its start time against the cold start it replaces.
    """
    fleet = open_fleet(fleet_file)
    w = fleet.workload(workload)
    need_shared_tier(fleet.scope())  # the template goes through it, even to the same node
    ckpt = find_template(fleet.scope(), workload) or run_step(
        node=w.node, action="take_template", fleet_file=fleet_file, workload=workload,
        via_deployments=via_deployments)["checkpoint"]
    res = run_step(node=target_node, action="scale_up_in", fleet_file=fleet_file, workload=workload, checkpoint=ckpt,
                   via_deployments=via_deployments)
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
    return run_step(node=node, action="scale_down", fleet_file=fleet_file, workload=workload,
                    via_deployments=via_deployments, replica=replica)
