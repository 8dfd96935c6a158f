"""Node-level steps: checkpoint a batch of workloads, restore one workload."""

from __future__ import annotations

from prefect import get_run_logger, task

from ckptflow.errors import CkptflowError
from ckptflow.tasks.common import node_runner, open_fleet, retry_if_retryable


@task(name="checkpoint-node-batch", retries=1, retry_condition_fn=retry_if_retryable)
def checkpoint_batch(fleet_file: str, node: str, workloads: list[str]) -> list[dict]:
    """Checkpoint (leave running) each workload of one node; one failure does not stop the rest.

    One task per node batch, not per workload: a task run costs ~20 KB of server DB and
    ~10 ms, which a fleet tick over thousands of workloads cannot afford.
    """
    log = get_run_logger()
    fleet = open_fleet(fleet_file)
    runner = node_runner(fleet)
    out = []
    for name in workloads:
        w = fleet.workload(name)
        try:
            m = runner.checkpoint(w, leave_running=True)
        except CkptflowError as e:
            log.error("checkpoint of %s failed: %s", name, e)
            out.append({"workload": name, "node": node, "ok": False, "error": str(e).splitlines()[0],
                        "error_type": type(e).__name__})
            continue
        log.info("checkpoint %s of %s: %.1f MiB, dump %.2f s", m.id, name, m.bytes / 2**20, m.timings["dump"])
        out.append({"workload": name, "node": node, "ok": True, "checkpoint": m.id, "bytes": m.bytes,
                    **{f"{k}_s": v for k, v in m.timings.items()}})
    return out


@task(name="restore-workload", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_if_retryable)
def restore_workload(fleet_file: str, workload: str) -> dict:
    """Restore a lost workload from its newest valid checkpoint (older ones if it is corrupt)."""
    fleet = open_fleet(fleet_file)
    res = node_runner(fleet).restore(fleet.workload(workload))
    return {"workload": workload, "checkpoint": res.manifest.id, "pid": res.pid, "timings": res.timings,
            "bytes": res.manifest.bytes, "skipped": res.skipped}
