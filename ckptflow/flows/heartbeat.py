"""Heartbeat: checkpoint each selected workload of the fleet, leaving it running."""

from __future__ import annotations

from collections import defaultdict

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.utilities.annotations import quote

from ckptflow.fleet import OnWorkerGone, PolicyChoice
from ckptflow.flows.recover import recover
from ckptflow.tasks.common import open_fleet
from ckptflow.tasks.fleet import checkpoint_nodes

# Task runs per tick at most: each node's batch still runs as checkpoint-node-batch decides it,
# a group of nodes per task run (a task run per node was most of a 1,000-node tick's time and of
# the Prefect server's work). Groups run in parallel, as many as a one-machine tick uses.
NODE_GROUPS = 16


def _group_name(group: list) -> str:
    first, last = group[0][0].name, group[-1][0].name
    return f"checkpoint-nodes-{first}" if first == last else f"checkpoint-nodes-{first}-to-{last}"


class HeartbeatFailed(RuntimeError):
    """Some checkpoints failed; ``rows`` holds every workload's outcome (the failed ones too)."""

    def __init__(self, message: str, rows: list[dict] | None = None):
        super().__init__(message)
        self.rows = rows or []


@flow(name="heartbeat", log_prints=True)
def heartbeat(fleet_file: str, node: str | None = None, workloads: list[str] | None = None,
              force: bool = False) -> list[dict]:
    """Decide and checkpoint the fleet's workloads (optionally one node's, or named ones).

    Each node's workloads are one batch, and a task run takes a group of batches (at most
    ``NODE_GROUPS`` task runs); each workload's fleet policy decides whether it is due.
    ``force=True`` checkpoints every selected workload regardless (a manual run).

    Example:
        >>> heartbeat("deployments/local.yaml")   # doctest: +SKIP
    """
    fleet = open_fleet(fleet_file)  # once per run: tasks get plain values, not the file to read again
    wanted = None if workloads is None else set(workloads)
    by_node: dict[str, list[PolicyChoice]] = defaultdict(list)
    for w in fleet.workloads:
        if (node is None or w.node == node) and (wanted is None or w.name in wanted):
            by_node[w.node].append(fleet.policy_choice(w))
    nodes, scope = {n.name: n for n in fleet.nodes}, fleet.scope()
    # quote(): Prefect would otherwise walk every field of every workload to find upstream futures
    batches = [(nodes[n], batch) for n, batch in sorted(by_node.items())]
    size = -(-len(batches) // NODE_GROUPS) if batches else 1
    groups = [batches[i:i + size] for i in range(0, len(batches), size)]
    futures = [checkpoint_nodes.with_options(task_run_name=_group_name(g)).submit(scope, quote(g), force)
               for g in groups]
    results = [r for f in futures for r in f.result()]
    choices = {c.workload.name: c for batch in by_node.values() for c in batch}
    for r in results:  # the worker is gone and its rule says recover: bring it back in this run
        if r.get("error_type") == "WorkloadNotFound" and choices[r["workload"]].on_worker_gone == OnWorkerGone.recover:
            try:
                res = recover(fleet_file, r["workload"])
                r.update(ok=True, recovered=res.get("checkpoint"), reason=f"{r['reason']}; recovered")
            except Exception as e:  # recover alerted with its own reason; the row says it failed
                r["recover_error"] = str(e).splitlines()[0]
    create_table_artifact(key=f"heartbeat-{fleet.fleet}", table=results or [{"note": "nothing selected"}],
                          description=f"Heartbeat of fleet {fleet.fleet}")
    failed = [r for r in results if not r["ok"]]
    if failed:
        get_run_logger().error("%d of %d checkpoints failed", len(failed), len(results))
        raise HeartbeatFailed("; ".join(f"{r['workload']}: {r['error']}" for r in failed), results)
    return results
