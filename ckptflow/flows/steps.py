"""Run one node-level step where it must run: on the node's worker, or here.

A fleet flow waits on node steps by polling the Prefect server every ``POLL_S``: Prefect's own
default (5 s) was time a moved worker stayed down. A move between two nodes (``move``) starts the
target's step first and lets the source checkpoint only once that step runs, so the target's
worker poll and its flow-run process start (seconds of Python imports) happen while the worker
still serves; the downtime is the dump, the transfer and the restore, plus a few polls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from prefect.deployments import run_deployment
from prefect.exceptions import MissingResult
from prefect.runtime import flow_run

from ckptflow.errors import CkptflowError, ConfigError
from ckptflow.flows.handoff import (CHECKPOINT_LABEL, CHECKPOINT_POLL_S, POLL_S, READY_LABEL, READY_TIMEOUT_S,  # noqa: F401
                                    STEP_TIMEOUT_S, StepFailed, checkpoint_of, mark_ready, publish_checkpoint,
                                    state_reason, wait_ready, wait_run)
from ckptflow.fleet import load_fleet, node_deployment
from ckptflow.results import MigratedOut, Step, StepParams, StepResult

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

def step_key(action: str, workload: str, node: str) -> str:
    """The idempotency key of this fleet flow run's ``action`` step: a retried fleet flow finds
    its step instead of starting a second one, and a paired step finds it by this key."""
    return f"{flow_run.get_id()}-{action}-{workload}-{node}"


def step_params(*, node: str, action: Step, fleet_file: str, workload: str, checkpoint: str | None = None,
                replica: str | None = None, when_ready: str | None = None,
                checkpoint_from: str | None = None) -> StepParams:
    """The node-step flow's parameters for ``run_deployment``; an option left None is left out
    (the flow's default), ``checkpoint`` is always sent."""
    params = StepParams(fleet_file=fleet_file, action=action, workload=workload, node=node, checkpoint=checkpoint)
    options = {"replica": replica, "when_ready": when_ready, "checkpoint_from": checkpoint_from}
    params.update({k: v for k, v in options.items() if v})  # type: ignore[typeddict-item]
    return params


def _deployment(fleet_file: str, node: str) -> str:
    """``node-step/<fleet>:<node>``: per-node deployments carry their fleet's name (deploy.py)."""
    return node_deployment(load_fleet(fleet_file).fleet, node, "node-step")


@contextmanager
def _named(fleet_file: str, node: str) -> Iterator[None]:
    """Prefect's ``ObjectNotFound: None`` for a deployment that does not exist, as one line that
    names it and how to make it (a fleet deployed before names carried the fleet, or not at all)."""
    from prefect.exceptions import ObjectNotFound

    try:
        yield
    except ObjectNotFound:
        raise ConfigError(f"no deployment {_deployment(fleet_file, node)} on the Prefect server",
                          fix=f"run `ckptflow deploy {fleet_file}` (per-node deployments are named <fleet>:<node>)") from None


def run_step(*, node: str, action: Step, fleet_file: str, workload: str, checkpoint: str | None = None,
             via_deployments: bool = True, replica: str | None = None, when_ready: str | None = None) -> StepResult:
    """Run node-step ``action`` on ``node``: through its deployment ``node-step/<fleet>:<node>`` (its
    work pool's worker), or in this process. ``checkpoint``: the one to restore or start from
    (migrate_in, restore_local, scale_up_in); ``replica``: the one to stop (scale_down);
    ``when_ready``: the flow run id of a step that must be ready before this one acts (``move``).
    The result is the action's own model (``ckptflow.results``: ``MigratedOut`` for migrate_out, ...).

    A failed step raises the step's own typed error when Prefect kept it (so a caller can
    still tell "no checkpoint" from "restore broke"), else StepFailed naming the flow run.
    """
    params = step_params(node=node, action=action, fleet_file=fleet_file, workload=workload, checkpoint=checkpoint,
                         replica=replica, when_ready=when_ready)
    if not via_deployments:
        from ckptflow.flows.node_step import node_step

        return node_step(**params)
    with _named(fleet_file, node):
        fr = run_deployment(name=_deployment(fleet_file, node), parameters=params, timeout=STEP_TIMEOUT_S,
                            poll_interval=POLL_S, idempotency_key=step_key(action, workload, node))
    return step_result(fr, action, workload, node)


def start_step(*, node: str, action: Step, fleet_file: str, workload: str, checkpoint_from: str) -> FlowRun:
    """Start node-step ``action`` on ``node`` without waiting for it; it takes its checkpoint
    from the result of the step whose idempotency key is ``checkpoint_from`` once that ends."""
    with _named(fleet_file, node):
        return run_deployment(name=_deployment(fleet_file, node), timeout=0,
                              idempotency_key=step_key(action, workload, node),
                              parameters=step_params(node=node, action=action, fleet_file=fleet_file, workload=workload,
                                                     checkpoint_from=checkpoint_from))


def wait_step(fr: FlowRun, *, action: Step, workload: str, node: str, timeout_s: float = STEP_TIMEOUT_S) -> StepResult:
    """Wait for a step ``start_step`` started; its result as ``run_step`` returns it."""
    return step_result(wait_run(fr.id, lambda s: s.is_final(), timeout_s, f"{action} of {workload} on {node}"),
                       action, workload, node)


def cancel_step(fr: FlowRun) -> None:
    """Cancel a started step that has not begun running (its pair failed); a running one ends
    itself when it sees its pair's failure."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as c:
        s = c.read_flow_run(fr.id).state
        if s is not None and not s.is_final() and not s.is_running():
            c.set_flow_run_state(fr.id, Cancelled(message="the step it waited for failed"), force=True)


def move(*, source: str, target: str, fleet_file: str, workload: str) -> tuple[MigratedOut, FlowRun]:
    """Checkpoint ``workload`` on ``source`` for ``target``, with the target's migrate_in step
    started first and ready (its tier and runner open, waiting) when the source dumps. Returns
    migrate_out's result and the target's flow run (``wait_step`` it). A failed migrate_out
    cancels or ends that run."""
    inn = start_step(node=target, action="migrate_in", fleet_file=fleet_file, workload=workload,
                     checkpoint_from=step_key("migrate_out", workload, source))
    try:
        out = run_step(node=source, action="migrate_out", fleet_file=fleet_file, workload=workload,
                       when_ready=str(inn.id))
    except BaseException:
        try:
            cancel_step(inn)
        except Exception:
            pass  # it ends itself once it sees migrate_out failed
        raise
    return out, inn


def step_result(fr: FlowRun, action: str, workload: str, node: str) -> StepResult:
    """A node step's result; its failure as the step's own typed error when Prefect kept it,
    else StepFailed naming the flow run."""
    if fr.state and fr.state.is_completed():
        return fr.state.result()
    where = (f"{action} of {workload} on {node}: flow run {fr.id} ended "
             f"{fr.state.name if fr.state else 'without a state'}")
    if fr.state and fr.state.is_failed():
        try:
            fr.state.result()
        except CkptflowError:
            raise
        except MissingResult:  # the step's exception was not kept: its state message says what failed
            pass
        except Exception as e:  # keep what failed: its type and first line, and the chain
            first = (str(e).splitlines() or [""])[0]
            raise StepFailed(f"{where}: {type(e).__name__}" + (f": {first}" if first else ""),
                             error_type=type(e).__name__) from e
    raise StepFailed(where + (f": {fr.state.message}" if fr.state and fr.state.message else ""))


def spreader_off(fleet, node: str, now: float | None = None):
    """Where the workloads of ``node`` may go: every other node of its GPU class that is not in
    (or about to enter) a maintenance window of its own (policies.placement)."""
    import time

    from ckptflow.policies.placement import NodeState, Spreader, in_maintenance

    now = time.time() if now is None else now
    src = fleet.node(node)
    return Spreader(src.gpu_class, [
        NodeState(n.name, n.gpu_class, free_gib=n.gpu_memory_gib or 1e9,
                  in_maintenance=in_maintenance([(w.start.timestamp(), w.end.timestamp()) for w in n.maintenance], now))
        for n in fleet.nodes if n.name != node])
