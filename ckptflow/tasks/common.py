"""What every task shares: opening the fleet, its stores and its fleet state, and the retry rule.

A flow resolves the fleet once per run (``open_fleet``) and hands its tasks plain values: the
fleet's ``FleetScope`` (storage, Slack, retention), the node and the workloads a task acts on
(``placed``: a workload where a step brings it), never the fleet file's path. The
helpers below take that scope, or the whole ``Fleet``: they read only its scope fields.
"""

from __future__ import annotations

import errno
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ckptflow.alerts import Alerter
from ckptflow.errors import CkptflowError
from ckptflow.fleet import Fleet, FleetScope, load_fleet
from ckptflow.models import Workload
from ckptflow.runners.node import NodeRunner
from ckptflow.settings import settings
from ckptflow.store import open_fleet_state, open_store, open_tier


def open_fleet(fleet_file: str) -> Fleet:
    """The fleet file, with each workload on the node a migrate or a recover elsewhere last
    moved it to (the placements in the fleet state), not the node the file declares."""
    fleet = load_fleet(Path(fleet_file))
    nodes = {n.name for n in fleet.nodes}
    moved = {w: n for w, n in open_fleet_state(fleet.storage).placements().items() if n in nodes}
    for w in fleet.workloads:
        if w.name in moved:
            w.node = moved[w.name]
    return fleet


def placed(fleet: Fleet, workload: str, node: str | None = None) -> Workload:
    """``workload`` as ``open_fleet`` placed it, moved to ``node`` when a step brings it there
    (a restore or a move onto another node): the one value a node step's task acts on.

    Raises:
        ConfigError: no such workload, or ``node`` is no node of the fleet.
    """
    w = fleet.workload(workload)
    if node is not None and node != w.node:
        fleet.node(node)
        w = w.model_copy(update={"node": node})
    return w


def run_logger():
    """Prefect's run logger inside a flow or task run; ckptflow's own logger outside one (a task
    body a command runs in its own process, without a Prefect server: cli heartbeat, recover)."""
    import logging

    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("ckptflow")


def node_runner(fleet: Fleet | FleetScope, node: str | None = None) -> NodeRunner:
    """The node runner of ``node``: its local store and the GPU backend it declares
    (``nodes[].gpu_backend``; ``cuda`` when it declares none, or for no node)."""
    return NodeRunner(open_store(fleet.storage, node), gpu=fleet.gpu_backend(node))


@contextmanager
def node_slot(node: str) -> Iterator[None]:
    """One checkpoint or restore per node at a time, fleet-wide: a Prefect global concurrency
    limit ``ckptflow-node-<node>`` of 1 (created by `ckptflow deploy`; strict, so a missing
    limit fails loudly instead of letting steps race). Deployments set CKPTFLOW_NODE_LIMITS=1
    (``settings().node_limits``); local runs (demo, tests in one process) go without it."""
    if not settings().node_limits:
        yield
        return
    from prefect.concurrency.sync import concurrency

    with concurrency(f"ckptflow-node-{node}", occupy=1, strict=True):
        yield


def this_node(fleet: Fleet) -> str | None:
    """Which fleet node this process runs on: $CKPTFLOW_NODE, the only node, or the hostname."""
    name = settings().node
    if name:
        fleet.node(name)
        return name
    if len(fleet.nodes) == 1:
        return fleet.nodes[0].name
    host = socket.gethostname().split(".")[0].lower()
    return host if any(n.name == host for n in fleet.nodes) else None


def tier(fleet: Fleet | FleetScope):
    """The fleet's shared checkpoint tier (store.open_tier: None when each node has its own
    store only), its chunk key read from a Prefect Secret block when the fleet file names one."""
    key = None
    if fleet.storage.encryption_key_block:
        import base64

        from prefect.blocks.system import Secret

        key = base64.b64decode(Secret.load(fleet.storage.encryption_key_block).get())
    return open_tier(fleet.storage, key)


def fingerprints(fleet: Fleet | FleetScope, opened=None):
    """The fleet state (store.open_fleet_state), where nodes report their fingerprints and
    invalidate reads them all. ``opened``: the fleet's tier, if the caller opened it already
    (an S3 fleet state shares its connection)."""
    return open_fleet_state(fleet.storage, opened)


def alerter(fleet: Fleet | FleetScope, opened=None) -> Alerter:
    """The fleet's alerter; open alerts live in the fleet state, where every node sees them.
    ``opened``: as for ``fingerprints``."""
    return Alerter(fleet.slack, state=open_fleet_state(fleet.storage, opened), prefect_ui_url=fleet.prefect_ui_url)


# I/O failures that can pass on their own (a peer restarting, a busy device, a dropped
# connection). Anything else outside ckptflow's own errors is a bug or a wrong input: a
# TypeError or KeyError retried only runs the same broken code again and hides it for longer.
_TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.EIO, errno.ETIMEDOUT,
                               errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE,
                               errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN})


def transient(e: BaseException) -> bool:
    """Whether ``e`` is transient I/O that a retry can outlast (not a ckptflow error).

    Example:
        >>> transient(ConnectionResetError()), transient(TimeoutError()), transient(KeyError("x"))
        (True, True, False)
    """
    import httpx

    if isinstance(e, (ConnectionError, TimeoutError, httpx.TransportError)):
        return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS


def retry_if_retryable(task, task_run, state) -> bool:
    """Prefect retry_condition_fn: retry only ckptflow errors that say a retry can help, and
    transient I/O (``transient``); never a final ckptflow error, never a programming error.

    An incompatible checkpoint or a corrupt image never gets better by retrying it.
    """
    try:
        state.result()
    except CkptflowError as e:
        return e.retryable
    except Exception as e:
        return transient(e)
    return False
