"""Prefect events for what an operator acts on: a checkpoint committed, skipped or failed, a restore
that succeeded or failed, a verify verdict, checkpoints invalidated, a node drained, a workload
migrated. Prefect automations trigger on them (docs/events.md has ones to paste: a page on a
failed restore, a drain when maintenance is announced).

Every event's resource is the workload, ``ckptflow.workload.<name>``; its node and its fleet are
related resources (roles ``node`` and ``fleet``), and Prefect relates the flow run and task run
that emitted it. The payload says what happened in the fields an automation's template reads
(``{{ event.payload.reason }}``).

    ckptflow.checkpoint.committed   checkpoint, kind, bytes, pause_s, decision, reason
    ckptflow.checkpoint.skipped     decision, reason (the policy's)
    ckptflow.checkpoint.failed      decision, error, error_type
    ckptflow.restore.succeeded      checkpoint, how
    ckptflow.restore.failed         checkpoint, cause, fix, fallback
    ckptflow.verify.verified / ckptflow.verify.verify_failed    checkpoint, reason
    ckptflow.checkpoint.invalidated checkpoint, reason, copy
    ckptflow.node.drained           (resource: the node) moved, left
    ckptflow.workload.migrated      checkpoint, source, target

Example:
    >>> resource_of("chat-7b")["prefect.resource.id"]
    'ckptflow.workload.chat-7b'
    >>> [r["prefect.resource.role"] for r in related_of("gpu-node-01", "h200")]
    ['node', 'fleet']
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.context import FlowRunContext
from prefect.events import emit_event
from prefect.settings import PREFECT_API_URL

from ckptflow.results import CheckpointRow

log = logging.getLogger("ckptflow")

PREFIX = "ckptflow"


def resource_of(workload: str) -> dict[str, str]:
    return {"prefect.resource.id": f"{PREFIX}.workload.{workload}", "prefect.resource.name": workload}


def node_resource(node: str) -> dict[str, str]:
    return {"prefect.resource.id": f"{PREFIX}.node.{node}", "prefect.resource.name": node}


def related_of(node: str | None, fleet: str | None) -> list[dict[str, str]]:
    out = []
    if node:
        out.append({**node_resource(node), "prefect.resource.role": "node"})
    if fleet:
        out.append({"prefect.resource.id": f"{PREFIX}.fleet.{fleet}", "prefect.resource.name": fleet,
                    "prefect.resource.role": "fleet"})
    return out


def emit(event: str, *, workload: str | None = None, node: str | None = None, fleet: str | None = None,
         **payload: Any) -> None:
    """Emit ``ckptflow.<event>`` about ``workload`` (or, without one, about ``node``).

    Never fails the step that reports: an event that cannot be sent (no Prefect server reachable)
    is a warning in the log, not a failed heartbeat or restore."""
    if FlowRunContext.get() is None and PREFECT_API_URL.value() is None:
        return  # a step run as a plain function, with no server configured: nobody to tell (and no
        # temporary server started just for this event)
    resource = resource_of(workload) if workload else node_resource(str(node))
    related = related_of(node if workload else None, fleet)
    try:
        emit_event(event=f"{PREFIX}.{event}", resource=resource, related=related,
                   payload={k: v for k, v in payload.items() if v is not None})
    except Exception as e:  # noqa: BLE001 - an event is a report; the step's own result stands
        log.warning("could not emit the Prefect event %s.%s for %s: %s", PREFIX, event, workload or node, e)


def checkpoint_row(row: CheckpointRow, fleet: str | None) -> None:
    """The event of one heartbeat row (tasks.node.checkpoint_batch)."""
    common = {"workload": row["workload"], "node": row["node"], "fleet": fleet, "decision": row["decision"]}
    if not row["ok"]:
        emit("checkpoint.failed", **common, error=row.get("error"), error_type=row.get("error_type"))
    elif row.get("checkpoint"):
        emit("checkpoint.committed", **common, checkpoint=row["checkpoint"], bytes=row.get("bytes"),
             pause_s=row.get("pause_s"), reason=row["reason"])
    else:
        emit("checkpoint.skipped", **common, reason=row["reason"])
