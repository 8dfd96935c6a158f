"""node-step: the one flow deployed per node; fleet flows start it there with run_deployment.

Actions (each a task on the node that holds the process or the images):
    migrate_out   checkpoint the workload with CRIU exit (the worker stops) and push it to S3
    migrate_in    pull a checkpoint from S3 into this node's store and restore it here
    restore_local restore a checkpoint from this node's own store (the fallback after a failed move)
    stop          stop a short-request worker (SIGTERM) once its requests have drained
    take_template take the initialised checkpoint of a ready worker (before traffic) and push it
    scale_up_in   start a replica from that template in its own PID and network namespace
    scale_down    stop a replica scale_up_in started (its PID namespace and network namespace)
    restore       restore the newest valid checkpoint from the nearest copy (recover, here or
                  on a new node after its own was lost)
    cold_start    start the worker from its start_command (no checkpoint could come back)
"""

from __future__ import annotations

from typing import Literal

from prefect import flow

from ckptflow.flows.steps import checkpoint_of, wait_running
from ckptflow.tasks.move import (migrate_in, migrate_out, restore_local, scale_down_in, scale_up_in, stop_workload,
                                 take_template)
from ckptflow.tasks.node import restore_workload
from ckptflow.tasks.verify import cold_start_workload

Step = Literal["migrate_out", "migrate_in", "restore_local", "stop", "take_template", "scale_up_in", "scale_down",
               "restore", "cold_start"]


@flow(name="node-step", persist_result=True, log_prints=True)
def node_step(fleet_file: str, action: Step, workload: str, node: str, checkpoint: str | None = None,
              replica: str | None = None, checkpoint_from: str | None = None,
              when_running: str | None = None) -> dict:
    """Run one node-level action for ``workload`` on ``node`` (this node).

    A move between nodes pairs two steps (flows.steps.move): ``when_running`` (on migrate_out)
    is the target step's flow run id, which must be running before this checkpoints;
    ``checkpoint_from`` (on migrate_in) is the idempotency key of the migrate_out step whose
    result names the checkpoint, waited for instead of taking ``checkpoint``.
    """
    if when_running:
        wait_running(when_running)
    if checkpoint_from:
        checkpoint = checkpoint_of(checkpoint_from)
    steps = {
        "migrate_out": lambda: migrate_out(fleet_file, workload),
        "migrate_in": lambda: migrate_in(fleet_file, workload, node, checkpoint),
        "restore_local": lambda: restore_local(fleet_file, workload, node, checkpoint),
        "stop": lambda: stop_workload(fleet_file, workload),
        "take_template": lambda: take_template(fleet_file, workload),
        "scale_up_in": lambda: scale_up_in(fleet_file, workload, node, checkpoint),
        "scale_down": lambda: scale_down_in(fleet_file, workload, node, replica),
        "restore": lambda: restore_workload(fleet_file, workload, node),
        "cold_start": lambda: cold_start_workload(fleet_file, workload),
    }
    return steps[action]()
