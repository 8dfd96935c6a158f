"""Heartbeat: checkpoint each selected workload of the fleet, leaving it running."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.utilities.annotations import quote

from ckptflow.errors import HeartbeatFailed
from ckptflow.fleet import OnWorkerGone, PolicyChoice
from ckptflow.flows.recover import recover
from ckptflow.results import CheckpointRow, Recovered
from ckptflow.tasks.common import open_fleet, run_logger
from ckptflow.tasks.fleet import checkpoint_nodes

# Task runs per tick at most: each node's batch still runs as tasks.node.checkpoint_batch decides it,
# a group of nodes per task run (a task run per node was most of a 1,000-node tick's time and of
# the Prefect server's work). Groups run in parallel, as many as a one-machine tick uses.
NODE_GROUPS = 16


def _group_name(group: list) -> str:
    first, last = group[0][0].name, group[-1][0].name
    return f"checkpoint-nodes-{first}" if first == last else f"checkpoint-nodes-{first}-to-{last}"


@flow(name="heartbeat", log_prints=True)
def heartbeat(fleet_file: str, node: str | None = None, workloads: list[str] | None = None,
              force: bool = False) -> list[CheckpointRow]:
    """Decide and checkpoint the fleet's workloads (optionally one node's, or named ones).

    Each node's workloads are one batch, and a task run takes a group of batches (at most
    ``NODE_GROUPS`` task runs); each workload's fleet policy decides whether it is due.
    ``force=True`` checkpoints every selected workload regardless (a manual run).

    Example:
        >>> heartbeat("deployments/local.yaml")   # doctest: +SKIP
    """
    fleet = open_fleet(fleet_file)  # once per run: tasks get plain values, not the file to read again
    choices, batches = _select(fleet, node, workloads)
    scope = fleet.scope()
    # quote(): Prefect would otherwise walk every field of every workload to find upstream futures
    size = -(-len(batches) // NODE_GROUPS) if batches else 1
    groups = [batches[i:i + size] for i in range(0, len(batches), size)]
    futures = [checkpoint_nodes.with_options(task_run_name=_group_name(g)).submit(scope, quote(g), force)
               for g in groups]
    results = [r for f in futures for r in f.result()]
    _recover_gone(results, choices, lambda name: recover(fleet_file, name))
    create_table_artifact(key=f"heartbeat-{fleet.fleet}", table=results or [{"note": "nothing selected"}],
                          description=f"Heartbeat of fleet {fleet.fleet}")
    return _outcome(results, fleet_file)


def heartbeat_here(fleet_file: str, node: str | None = None, workloads: list[str] | None = None,
                   force: bool = False) -> list[CheckpointRow]:
    """``heartbeat`` in this process, without a flow run: what ``ckptflow heartbeat`` runs when
    no Prefect server is configured (a temporary one took ~12 s to start first, for a pause of a
    tenth of a second). The same node batches, one after another; no artifact, no events."""
    from ckptflow.recovery import recover_here

    fleet = open_fleet(fleet_file)
    choices, batches = _select(fleet, node, workloads)
    results = checkpoint_nodes.fn(fleet.scope(), batches, force) if batches else []
    _recover_gone(results, choices, lambda name: recover_here(fleet_file, name))
    return _outcome(results, fleet_file)


def _select(fleet, node: str | None, workloads: list[str] | None) -> tuple[dict[str, PolicyChoice], list]:
    """The selected workloads' policy choices by name, and (node, its batch) per node."""
    wanted = None if workloads is None else set(workloads)
    by_node: dict[str, list[PolicyChoice]] = defaultdict(list)
    for w in fleet.workloads:
        if (node is None or w.node == node) and (wanted is None or w.name in wanted):
            by_node[w.node].append(fleet.policy_choice(w))
    nodes = {n.name: n for n in fleet.nodes}
    choices = {c.workload.name: c for batch in by_node.values() for c in batch}
    return choices, [(nodes[n], batch) for n, batch in sorted(by_node.items())]


def _recover_gone(results: list[CheckpointRow], choices: dict[str, PolicyChoice],
                  recover_one: Callable[[str], Recovered]) -> None:
    for r in results:  # the worker is gone and its rule says recover: bring it back in this run
        if r.get("gone") and choices[r["workload"]].on_worker_gone == OnWorkerGone.recover:
            try:
                res = recover_one(r["workload"])
                # recovered: None when it was cold started
                r.update(ok=True, recovered=res.get("checkpoint"), reason=f"{r['reason']}; recovered")
            except Exception as e:  # recover alerted with its own reason; the row says it failed
                r["recover_error"] = str(e).splitlines()[0]


def _outcome(results: list[CheckpointRow], fleet_file: str) -> list[CheckpointRow]:
    failed = [r for r in results if not r["ok"]]
    if not failed:
        return results
    gone = [r["workload"] for r in failed if r.get("gone")]
    run_logger().error("%d of %d workloads not checkpointed%s", len(failed), len(results),
                       f" ({len(gone)} of them not running)" if gone else "")
    fix = None
    if gone:  # the worker is not running: what brings it back (nothing failed to checkpoint)
        fix = (f"start it again, or `ckptflow recover {fleet_file} {gone[0]}` (or the deployment recover/<fleet>, "
               f"workload={gone[0]}) restores its newest checkpoint; `on_worker_gone: recover` in its policy rule "
               "makes the heartbeat do that")
    # The error names its workload already ("workload chat: ..."): not "chat: workload chat: ...".
    raise HeartbeatFailed("; ".join(r["error"] if r["error"].startswith(f"workload {r['workload']}")
                                    else f"{r['workload']}: {r['error']}" for r in failed), results, fix)
