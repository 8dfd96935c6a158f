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

from functools import partial

from prefect import flow

from ckptflow.flows.handoff import checkpoint_of, mark_ready, publish_checkpoint, wait_ready
from ckptflow.results import Step, StepResult
from ckptflow.tasks.common import open_fleet, placed
from ckptflow.tasks.move import (migrate_in, migrate_out, restore_local, scale_down_in, scale_up_in, stop_workload,
                                 take_template)
from ckptflow.tasks.node import restore_workload
from ckptflow.tasks.verify import cold_start_placed

@flow(name="node-step", persist_result=True, log_prints=True)
def node_step(fleet_file: str, action: Step, workload: str, node: str, checkpoint: str | None = None,
              replica: str | None = None, checkpoint_from: str | None = None,
              when_ready: str | None = None) -> StepResult:
    """Run one node-level action for ``workload`` on ``node`` (this node).

    A move between nodes pairs two steps (flows.steps.move): ``when_ready`` (on migrate_out)
    is the target step's flow run id, which must be ready (its tier and runner open, waiting)
    before this checkpoints; ``checkpoint_from`` (on migrate_in) is the idempotency key of the migrate_out step whose
    result names the checkpoint, waited for instead of taking ``checkpoint``.
    """
    fleet = open_fleet(fleet_file)  # once: each task gets typed values, never the path
    scope = fleet.scope()
    if when_ready:
        wait_ready(when_ready)
    # A paired move: the source tells the target its checkpoint from inside migrate_out; the
    # target's migrate_in opens everything, says it is ready and waits for that id itself.
    out_pair = {"publish": publish_checkpoint} if when_ready else {}
    in_pair = ({"checkpoint_from": partial(checkpoint_of, checkpoint_from), "ready": mark_ready}
               if checkpoint_from else {})
    steps = {
        # The flow's own result carries theirs; persisting the task's too was one more S3 write
        # while the moved worker is down.
        "migrate_out": lambda: migrate_out.with_options(persist_result=False)(scope, placed(fleet, workload),
                                                                                **out_pair),
        "migrate_in": lambda: migrate_in.with_options(persist_result=False)(scope, placed(fleet, workload, node),
                                                                              checkpoint, **in_pair),
        "restore_local": lambda: restore_local(scope, placed(fleet, workload), node, checkpoint),
        "stop": lambda: stop_workload(placed(fleet, workload)),
        "take_template": lambda: take_template(scope, placed(fleet, workload)),
        "scale_up_in": lambda: scale_up_in(scope, placed(fleet, workload, node), checkpoint),
        "scale_down": lambda: scale_down_in(scope, workload, node, replica),
        "restore": lambda: restore_workload(scope, placed(fleet, workload, node)),
        "cold_start": lambda: cold_start_placed(placed(fleet, workload, node)),
    }
    return steps[action]()
