"""Run one node-level step where it must run: on the node's worker, or here."""

from __future__ import annotations

from prefect.deployments import run_deployment
from prefect.exceptions import MissingResult
from prefect.runtime import flow_run

from ckptflow.errors import CkptflowError


class StepFailed(RuntimeError):
    """A node step failed with an error that is not a ckptflow error (or none came back).
    ``error_type``: the name of the step's own exception class, when Prefect kept it (so a
    ``KeyError`` in a node step is still named as one in the fleet flow's report)."""

    def __init__(self, message: str, error_type: str | None = None):
        self.error_type = error_type
        super().__init__(message)


def run_step(node: str, action: str, fleet_file: str, workload: str, checkpoint: str | None = None,
             via_deployments: bool = True, replica: str | None = None) -> dict:
    """Run node-step ``action`` on ``node``: through its deployment ``node-step/<node>`` (its
    work pool's worker), or in this process.

    A failed step raises the step's own typed error when Prefect kept it (so a caller can
    still tell "no checkpoint" from "restore broke"), else StepFailed naming the flow run.
    """
    params = {"fleet_file": fleet_file, "action": action, "workload": workload, "node": node,
              "checkpoint": checkpoint, **({"replica": replica} if replica else {})}
    if not via_deployments:
        from ckptflow.flows.node_step import node_step

        return node_step(**params)
    fr = run_deployment(name=f"node-step/{node}", parameters=params, timeout=1800,
                        idempotency_key=f"{flow_run.get_id()}-{action}-{workload}-{node}")
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
