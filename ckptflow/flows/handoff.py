"""The hand-off between the two steps of a move, through their flow runs' labels and states.

A paired migrate_out labels its run with the checkpoint once it is in the store
(``publish_checkpoint``); the target labels its own run ready (``mark_ready``) and a source waits
for that before it checkpoints (``wait_ready``). Used by the node step (flows/node_step.py) and by
the fleet flows that start and wait on steps (flows/steps.py re-exports every name).
"""

from __future__ import annotations

import time

from prefect.runtime import flow_run

POLL_S = 0.2           # how often a waiting flow asks the server about the step it waits for
STEP_TIMEOUT_S = 1800  # longest wait for a node step to end (a large GPU dump, a busy node)
READY_TIMEOUT_S = 600  # longest a source waits for its target's step to start before it gives up (worker untouched)
# A paired migrate_out labels its flow run with the checkpoint once it is in S3: the target
# reads one label instead of waiting for the source's flow to end and loading its result from
# the results block (measured under load: ~3 s of the hand-off).
CHECKPOINT_LABEL = "ckptflow.checkpoint"
# And the target labels its own run once its migrate_in task has opened the tier and the runner
# and waits (tasks.move.migrate_in): "Running" comes seconds earlier, before its imports and
# caches, and a dump then waited on them.
READY_LABEL = "ckptflow.ready"
# How often a ready target asks for the checkpoint label. Faster than POLL_S: the worker is
# down while it waits, and the wait spans only the source's dump and upload (reads, a few
# dozen per move).
CHECKPOINT_POLL_S = 0.05


class StepFailed(RuntimeError):
    """A node step failed with an error that is not a ckptflow error (or none came back).
    ``error_type``: the name of the step's own exception class, when Prefect kept it (so a
    ``KeyError`` in a node step is still named as one in the fleet flow's report)."""

    def __init__(self, message: str, error_type: str | None = None):
        self.error_type = error_type
        super().__init__(message)


def wait_run(run_id, done, timeout_s: float, what: str, ready=lambda fr: False):
    """Poll flow run ``run_id`` until ``done(state)`` or ``ready(flow_run)``; the flow run."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as c:
        while True:
            fr = c.read_flow_run(run_id)
            if ready(fr) or (fr.state is not None and done(fr.state)):
                return fr
            if time.monotonic() > deadline:
                raise StepFailed(f"{what}: flow run {run_id} still {fr.state.name if fr.state else 'without a state'} "
                                 f"after {timeout_s:.0f} s")
            time.sleep(POLL_S)


def mark_ready() -> None:
    """Label this flow run (a paired migrate_in) ready: its task opened the tier and the runner,
    and waits for its checkpoint."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        c.update_flow_run_labels(flow_run.get_id(), {READY_LABEL: "1"})


def wait_ready(run_id: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until flow run ``run_id`` (the target's step) is ready (``mark_ready``): a source
    step waits for it before it checkpoints, so the worker is down only for the move itself.

    Raises:
        StepFailed: the run ended first, or was not ready within ``timeout_s``.
    """
    fr = wait_run(run_id, lambda s: s.is_final(), timeout_s, "the target's step never got ready: nothing was "
               "checkpointed", ready=lambda fr: bool((fr.labels or {}).get(READY_LABEL)))
    if not (fr.labels or {}).get(READY_LABEL):
        raise StepFailed(f"the target's step (flow run {run_id}) ended {fr.state.name} before it was ready"
                         f"{state_reason(fr.state)}: nothing was checkpointed, the worker still runs here")


def publish_checkpoint(checkpoint: str) -> None:
    """Label this flow run (a paired migrate_out) with ``checkpoint``, pushed and complete in S3.
    Called inside the migrate_out task (its ``publish``), so the target need not wait for the
    task to end."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        c.update_flow_run_labels(flow_run.get_id(), {CHECKPOINT_LABEL: checkpoint})


def checkpoint_of(key: str, timeout_s: float = STEP_TIMEOUT_S) -> str:
    """The checkpoint of the step with idempotency key ``key`` (a migrate_out): its label
    (``publish_checkpoint``) as soon as it is set, else its result once it ends.

    Raises:
        StepFailed: it failed (nothing to restore) or did not end within ``timeout_s``.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterIdempotencyKey

    deadline = time.monotonic() + timeout_s
    flt = FlowRunFilter(idempotency_key=FlowRunFilterIdempotencyKey(any_=[key]))
    with get_client(sync_client=True) as c:
        while True:
            runs = c.read_flow_runs(flow_run_filter=flt, limit=1)
            if runs and (runs[0].labels or {}).get(CHECKPOINT_LABEL):
                return str(runs[0].labels[CHECKPOINT_LABEL])
            if runs and runs[0].state is not None and runs[0].state.is_final():
                break
            if time.monotonic() > deadline:
                raise StepFailed(f"the checkpoint step {key} did not end within {timeout_s:.0f} s")
            time.sleep(CHECKPOINT_POLL_S)
    fr = runs[0]
    if not fr.state.is_completed():
        raise StepFailed(f"the checkpoint step (flow run {fr.id}) ended {fr.state.name}{state_reason(fr.state)}: "
                         "nothing to restore")
    return fr.state.result()["checkpoint"]


def state_reason(state) -> str:
    """`` (<the step's own error line>)`` from a step's final state message, or "".

    A paired step's error stays on its node (its result storage may be that node's disk); the
    server keeps its state message, whose first line is the error itself. Without it the fleet
    flow said only "ended Failed" and the cause was in the other node's worker log.
    """
    line = ((state.message or "").splitlines() or [""])[0] if state is not None else ""
    line = line.removeprefix("Flow run encountered an exception:").strip()
    return f" ({line})" if line else ""
