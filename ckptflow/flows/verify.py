"""Verify: prove, on a schedule, that checkpoints restore — before the day they are needed."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from ckptflow.models import TrafficClass
from ckptflow.results import Verified
from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.verify import verify_workload


@flow(name="verify", log_prints=True)
def verify(fleet_file: str, workloads: list[str] | None = None, node: str | None = None) -> list[Verified]:
    """Restore each protected workload's newest unverified checkpoint in a sandbox beside the
    original, compare its golden answer and session state, mark it verified or verify_failed.
    ``node``: the workloads running on that node *now* (placements followed, so a workload
    verified after a migrate is verified where it runs), which is what node deployments pass.

    Example:
        >>> verify("deployments/local.yaml")   # doctest: +SKIP
    """
    fleet = open_fleet(fleet_file)  # once per run: each task gets its workload, not the file
    scope = fleet.scope()
    rows = [verify_workload(scope, w) for w in fleet.workloads
            if (workloads is None or w.name in workloads) and (node is None or w.node == node)
            and w.traffic != TrafficClass.short_requests]
    log = get_run_logger()
    for r in rows:  # the verdicts in the run's log too, not only in the artifact
        log.info("verify %s: %s (%s)", r["workload"], r["state"], r["reason"])
    if not rows:
        log.info("nothing to verify" + (f" on {node}" if node else ""))
    create_table_artifact(key="verify", table=rows or [{"note": "nothing to verify"}],
                          description="Sandbox verification of the newest checkpoints")
    return rows
