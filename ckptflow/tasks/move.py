"""Moving a workload between nodes: out through the shared tier, in on the target, or back on
the source.

The node-step flow resolves the fleet file once (``tasks.common.open_fleet``, placements
included) and hands each task typed values: the fleet's ``FleetScope`` (storage, alerts), the
``Workload`` as placed now (``tasks.common.placed``: moved to the target node where the step
runs there) and node names. No task here reads the fleet file.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from prefect import get_run_logger, task

from ckptflow.errors import ConfigError, RestoreFailed, WorkloadNotFound
from ckptflow.fleet import FleetScope
from ckptflow.models import CheckpointKind, Workload
from ckptflow.results import MigratedIn, MigratedOut, ReplicaStarted, ReplicasStopped, RestoredLocal, Stopped, Template
from ckptflow.runners import process
from ckptflow.store import has_shared_tier
from ckptflow.tasks.common import node_runner, node_slot
from ckptflow.tasks.common import tier as fleet_tier


def need_shared_tier(scope: FleetScope) -> None:
    """Refuse a move between nodes (migrate, drain, scale-up) on a fleet without a shared tier.
    The fleet flows call it before any node step runs: from inside a step the error stayed in
    the target node's worker log, and the fleet flow said only that the step failed.

    Raises:
        ConfigError: ``storage.kind`` has no shared tier (``local``), or is not registered.
    """
    if not has_shared_tier(scope.storage):
        raise ConfigError(f"fleet {scope.fleet}: moving workloads between nodes needs a shared tier, and "
                          f"storage.kind {scope.storage.kind.value} has none",
                          fix="set storage: {kind: s3, bucket: ..., endpoint_url: ...} (or another registered "
                              "kind) in the fleet file")


def _tier(scope: FleetScope):
    need_shared_tier(scope)
    return fleet_tier(scope)


@task(name="migrate-out")
def migrate_out(scope: FleetScope, w: Workload, publish: Callable[[str], None] | None = None) -> MigratedOut:
    """Checkpoint ``w`` on the node it runs on (the worker exits) and push it to the shared tier.

    ``publish``: told the checkpoint's id as soon as the tier holds all of it, inside this task
    (a paired move's target waits for it: flows.steps.publish_checkpoint). If it fails, the
    target reads the id from this step's result when the step ends, seconds later.
    """
    tier = _tier(scope)
    with node_runner(scope, w.node) as runner, ThreadPoolExecutor(1) as ex:
        with node_slot(w.node):
            m = runner.checkpoint(w, leave_running=False)
            # The upload starts here: the slot's release, a call to the Prefect server while
            # the worker is down, overlaps it instead of coming first (the push needs no slot).
            push = ex.submit(tier.push, runner.store, m)
        pushed = push.result()
    at = {"pushed": time.time()}  # wall clock: the bench lines these up with its client's answers
    if publish is not None:
        try:
            publish(m.id)
            at["published"] = time.time()
        except Exception as e:
            get_run_logger().warning("could not publish checkpoint %s to the target (%s); it reads it from "
                                     "this step's result", m.id, e)
    return MigratedOut(checkpoint=m.id, bytes=m.bytes, timings=m.timings, at=at, **pushed)


@task(name="migrate-in")
def migrate_in(scope: FleetScope, w: Workload, checkpoint: str | None,
               checkpoint_from: Callable[[], str] | None = None, ready: Callable[[], None] | None = None) -> MigratedIn:
    """Pull ``checkpoint`` into the store of ``w.node`` (the target) and restore it there.

    In a paired move (flows.steps.move) this task starts before the source checkpoints: it
    opens the tier and the runner and reads this node's fingerprint (the restore's gate needs
    it) first, then calls ``ready()`` (the source may dump now) and ``checkpoint_from()``,
    which waits for the checkpoint's id. The worker is down from there on only for the
    download and the restore: this node's C/R slot is taken while the download runs.
    """
    tier = _tier(scope)
    with node_runner(scope, w.node) as runner, ThreadPoolExecutor(1) as ex:
        if checkpoint_from is not None:
            runner.node_fp  # noqa: B018  (CRIU, podman and runc versions: subprocesses, read once)
            if ready is not None:
                ready()
            checkpoint = checkpoint_from()
        if checkpoint is None:
            raise ValueError("migrate_in needs a checkpoint or checkpoint_from")
        at = {"checkpoint_known": time.time()}
        pull = ex.submit(tier.pull, runner.store, w.name, checkpoint, w.node)
        with node_slot(w.node):  # held from before the download ends until the restore ends
            m, pulled = pull.result()
            res = runner.restore(w, manifest=m, fallback=False)
            at["restored"] = time.time()  # healthy: before the slot's release
    return MigratedIn(checkpoint=m.id, pid=res.pid, timings=res.timings, at=at, **pulled)


@task(name="restore-local")
def restore_local(scope: FleetScope, w: Workload, node: str, checkpoint: str) -> RestoredLocal:
    """Restore ``checkpoint`` of ``w`` from the store of ``node`` (the fallback after a failed move)."""
    with node_runner(scope, node) as runner, node_slot(node):
        res = runner.restore(w, manifest=runner.store.get(w.name, checkpoint), fallback=False)
    return RestoredLocal(checkpoint=checkpoint, pid=res.pid, timings=res.timings)


@task(name="stop-workload")
def stop_workload(w: Workload, grace_s: float = 30) -> Stopped:
    """Stop a declared worker through its runtime (runners/runtime): SIGTERM a process and wait
    for it to exit (SIGKILL after ``grace_s``), ``podman stop`` a container, delete a pod."""
    from ckptflow.runners.runtime import runtime_for

    return runtime_for(w).stop(w, grace_s)


@task(name="take-template")
def take_template(scope: FleetScope, w: Workload) -> Template:
    """The initialised checkpoint: taken once the worker is ready, before it takes traffic;
    replicas start from it with warm weights and graphs (scale_up)."""
    with node_runner(scope, w.node) as runner:
        with node_slot(w.node):
            m = runner.checkpoint(w, leave_running=True, kind=CheckpointKind.scale_template)
        pushed = _tier(scope).push(runner.store, m)
    return Template(checkpoint=m.id, bytes=m.bytes, **pushed)


@task(name="scale-up-in")
def scale_up_in(scope: FleetScope, w: Workload, checkpoint: str) -> ReplicaStarted:
    """Start a replica from the template in its own PID and network namespace on ``w.node``
    (this node)."""
    from ckptflow.runners.engine import golden_digest
    from ckptflow.runners.verify import del_netns, new_netns, probe_in_netns

    from ckptflow.runners.runtime import runtime_for

    workload, node = w.name, w.node
    runtime_for(w).refuse_replica(w)  # a container's: not built yet
    t0 = time.perf_counter()
    with node_runner(scope, node) as runner:
        m, pulled = _tier(scope).pull(runner.store, workload, checkpoint, node)
        runner.gate(w, m)
        runner.store.verify_bytes(m)
        ns = new_netns(f"ckr-{workload[:6]}")
        copy = runner.criu.restore_beside(runner.store.images_dir(m), netns=ns,
                                           tcp_established=w.tcp_established)
    got = probe_in_netns(ns, w)
    if "error" in got:
        copy.stop()
        del_netns(ns)
        raise RestoreFailed(f"replica of {workload} on {node} never became healthy: {got['error']}")
    runner.store.put_replica(workload, {"netns": ns, "pid": copy.pid, "init_pid": copy.init_pid,
                                        "init_start": process.start_time(copy.init_pid),
                                        "checkpoint": m.id, "started": time.time()})
    return ReplicaStarted(checkpoint=m.id, pid=copy.pid, init_pid=copy.init_pid, netns=ns,
                          start_s=round(time.perf_counter() - t0, 3), downloaded_bytes=pulled["downloaded_bytes"],
                          sessions=got.get("sessions"),
                          golden=golden_digest(got["golden_answer"], w.golden.field) if w.golden else None)


@task(name="scale-down-in")
def scale_down_in(scope: FleetScope, workload: str, node: str, replica: str | None = None) -> ReplicasStopped:
    """Stop one replica (by its network namespace name) or every replica of ``workload`` that
    scale_up started on this node: kill its PID namespace's init, delete its namespace."""
    from ckptflow.runners.criu import SandboxCopy
    from ckptflow.runners.verify import del_netns

    store = node_runner(scope, node).store
    known = store.replicas(workload)
    chosen = [r for r in known if replica is None or r["netns"] == replica]
    if replica is not None and not chosen:
        raise WorkloadNotFound(f"no replica {replica} of {workload} on {node}; replicas there: "
                               f"{', '.join(r['netns'] for r in known) or 'none'}",
                               fix="pass one of those, or no replica to stop them all")
    for r in chosen:
        # A PID recorded here may be reused after a reboot; only signal what is still ours.
        if r.get("init_start") is not None and process.start_time(r["init_pid"]) == r["init_start"]:
            SandboxCopy(pid=r["pid"], init_pid=r["init_pid"], netns=r["netns"]).stop()
        del_netns(r["netns"])
        store.drop_replica(workload, r["netns"])
    return ReplicasStopped(stopped=[r["netns"] for r in chosen], node=node)
