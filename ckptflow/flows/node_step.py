"""node-step: the one flow deployed per node; fleet flows start it there with run_deployment.

Actions (each a task on the node that holds the process or the images):
    migrate_out   checkpoint the workload with CRIU exit (the worker stops) and push it to S3
    migrate_in    pull a checkpoint from S3 into this node's store and restore it here
    restore_local restore a checkpoint from this node's own store (the fallback after a failed move)
    stop          stop a short-request worker (SIGTERM) once its requests have drained
    take_template take the initialised checkpoint of a ready worker (before traffic) and push it
    scale_up_in   start a replica from that template in its own PID and network namespace
"""

from __future__ import annotations

from typing import Literal

from prefect import flow

from ckptflow.tasks.move import migrate_in, migrate_out, restore_local, scale_up_in, stop_workload, take_template


@flow(name="node-step", persist_result=True, log_prints=True)
def node_step(fleet_file: str, action: Literal["migrate_out", "migrate_in", "restore_local", "stop",
                                              "take_template", "scale_up_in"],
              workload: str, node: str, checkpoint: str | None = None) -> dict:
    """Run one node-level action for ``workload`` on ``node`` (this node)."""
    if action == "migrate_out":
        return migrate_out(fleet_file, workload)
    if action == "migrate_in":
        return migrate_in(fleet_file, workload, node, checkpoint)
    if action == "restore_local":
        return restore_local(fleet_file, workload, node, checkpoint)
    if action == "take_template":
        return take_template(fleet_file, workload)
    if action == "scale_up_in":
        return scale_up_in(fleet_file, workload, node, checkpoint)
    return stop_workload(fleet_file, workload)
