"""Slack alerts (slack-sdk) with a lifecycle per workload; never fatal.

A workload has at most one open alert. ``send`` opens it (or, for a new reason, posts again);
the same reason again is suppressed; ``resolve`` posts one "recovered" message and closes it.
The open alert lives in the fleet state (store.fleetstate: the fleet's store root, or an S3
fleet's bucket), so whichever node runs the next step sees it.

Configured from the fleet file's ``slack:`` section: an incoming webhook URL or a bot token
(+ channel), read from the environment variable it names or a Prefect Secret block. Block Kit
bodies come from jinja2 templates in templates/slack/.

Example:
    >>> a = Alerter(fleet.slack, state=open_fleet_state(fleet.storage))             # doctest: +SKIP
    >>> a.send(AlertKind.worker_gone, workload="chat", key="no live process", node="n1", reason="...",
    ...        checkpoint=None, flow_run_id=None)                                     # posts, opens
    >>> a.resolve("chat", node="n1", how="restored from checkpoint ...", checkpoint="...")  # posts, closes
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from ckptflow.errors import CkptflowError
from ckptflow.render import render
from ckptflow.results import Failure

if TYPE_CHECKING:
    from ckptflow.store.fleetstate import FleetState

log = logging.getLogger("ckptflow")



class AlertKind(StrEnum):
    """What an open alert is about: one Slack template each (``templates/slack/<kind>.json.j2``).
    The open alert kept in the store records the value."""

    restore_failed = "restore_failed"   # recover could not bring the worker back from a checkpoint
    verify_failed = "verify_failed"     # a sandbox restore did not answer like the original
    invalidated = "invalidated"         # a version change retired checkpoints no node can restore
    worker_gone = "worker_gone"         # a heartbeat found no live process for the workload

def failure(e: BaseException) -> Failure:
    """What an alert and a report say about a failed step: ``reason`` (the error's first line),
    ``cause`` (the first error line of CRIU's log when there is one, else None: the reason is the
    cause), ``fix`` (ckptflow's own, else None), ``checkpoint`` (the one tried, if it said) and
    ``log_tail``.

    Example:
        >>> from ckptflow.errors import CriuError
        >>> e = CriuError("criu restore failed", cmd=["criu", "restore"], returncode=1, fix="restore it elsewhere",
        ...               log_tail="(00.01) inet: Restored\\n(00.02) Error (criu/files-reg.c:2175): File x has bad size")
        >>> f = failure(e)
        >>> f["reason"], f["cause"], f["fix"]
        ('criu restore failed (exit 1)', 'Error (criu/files-reg.c:2175): File x has bad size', 'restore it elsewhere')
    """
    text = e.message if isinstance(e, CkptflowError) else str(e)
    reason = (text.splitlines() or [type(e).__name__])[0] or type(e).__name__
    tail = getattr(e, "log_tail", "") or ""
    cause = next((line.split(") ", 1)[1].strip() if line.startswith("(") and ") " in line else line
                  for line in (x.strip() for x in tail.splitlines()) if "Error" in line), None)
    return Failure(reason=reason, cause=cause if cause and cause != reason else None,
                   fix=getattr(e, "fix", None), checkpoint=getattr(e, "checkpoint", None), log_tail=tail)


# Block Kit limits: Slack rejects the whole message when one text is longer.
SECTION_MAX = 3000
FIELD_MAX = 2000
HEADER_MAX = 150


class Alerter:
    """Post alerts without storms and close them when the workload is back.

    Args:
        slack: the fleet file's ``slack:`` section (None: alerts are only logged).
        state: where open alerts are kept: a ``store.fleetstate.FleetState`` (``get_alert``,
            ``put_alert``, ``drop_alert``, ``alerts``), e.g. ``store.open_fleet_state(storage)``;
            None keeps none (every alert posts).
        state_dir: shorthand for ``state=LocalFleetState(state_dir)``.
    """

    def __init__(self, slack=None, state: "FleetState | None" = None, secret: str | None = None,
                 prefect_ui_url: str | None = None, *, state_dir: Path | None = None):
        self.cfg = slack
        self.secret = secret
        self.ui = prefect_ui_url
        if state is None and state_dir is not None:
            from ckptflow.store.fleetstate import LocalFleetState

            state = LocalFleetState(Path(state_dir))
        self.state = state

    # --- state: a storage outage must not stop an alert, nor fail the step that sends it -----
    def _state(self, what: str, fn, *a):
        if self.state is None:
            return None
        try:
            return fn(*a)
        except (CkptflowError, OSError, ValueError) as e:
            log.error("alert state: cannot %s: %s", what, str(e).splitlines()[0])
            return None

    def open_alerts(self) -> dict[str, dict]:
        """workload -> its open alert (kind, reason, node, opened)."""
        return self._state("list alerts", lambda: self.state.alerts()) or {}

    def send(self, kind: AlertKind | str, *, workload: str, key: str = "", **ctx) -> bool:
        """Open the workload's alert, or post again when ``(kind, key)`` differs from the open
        one's; True if posted. Slack errors are logged, never raised.

        Raises:
            ValueError: ``kind`` is no AlertKind.
        """
        try:
            kind = AlertKind(kind)
        except ValueError:
            raise ValueError(f"unknown alert kind {kind!r} (known: {', '.join(AlertKind)})") from None
        cur = self._state("read alert", lambda: self.state.get_alert(workload))
        token = hashlib.sha256(f"{kind.value}|{key}".encode()).hexdigest()[:16]  # open alerts still match
        if cur and cur.get("token") == token:
            log.info("alert %s for %s suppressed (already open for this reason)", kind, workload)
            return False
        body = json.loads(render(f"slack/{kind.value}.json.j2", workload=workload, ui=self.ui, **ctx))
        if not self._post(body, ctx.get("flow_run_id")):
            return False
        self._state("save alert", lambda: self.state.put_alert(workload, {
            "kind": kind.value, "token": token, "reason": str(ctx.get("reason") or key)[:FIELD_MAX],
            "node": ctx.get("node"), "opened": cur["opened"] if cur else time.time(),
            "flow_run_id": str(ctx.get("flow_run_id") or "")}))
        return True

    def resolve(self, workload: str, *, kinds: set[AlertKind] | None = None, always: bool = False, node: str = "",
                how: str = "", checkpoint: str | None = None, skipped: list[dict] | None = None,
                flow_run_id=None) -> bool:
        """Post one "recovered" message closing the workload's open alert (only one of ``kinds``,
        when given); with ``always``, post it even when no alert is open. True if posted."""
        cur = self._state("read alert", lambda: self.state.get_alert(workload))
        if cur is not None and kinds is not None and cur.get("kind") not in kinds:
            cur = None
        if cur is None and not always:
            return False
        body = json.loads(render("slack/recovered.json.j2", workload=workload, node=node, how=how,
                                 checkpoint=checkpoint, resolves=cur, skipped=skipped or [], ui=self.ui,
                                 flow_run_id=flow_run_id))
        if not self._post(body, flow_run_id):
            return False  # the alert stays open: the next success posts the resolution
        if cur is not None:
            self._state("close alert", lambda: self.state.drop_alert(workload))
        return True

    def _post(self, body: dict, flow_run_id=None) -> bool:
        _fit(body, self.ui, flow_run_id)
        cfg = self.cfg
        if cfg is None:
            # Its header only: the step that alerts reports the reason itself (a row, its error), and
            # the whole text was that line once more in every heartbeat of a gone worker.
            header = next((b["text"]["text"] for b in body.get("blocks", []) if b.get("type") == "header"), None)
            log.warning("alert (no slack configured): %s", header or body.get("text"))
            return False
        secret = self.secret or _secret_from(cfg)
        try:
            if cfg.webhook_url_env or (secret and secret.startswith("http")):
                from slack_sdk.webhook import WebhookClient

                url = os.environ.get(cfg.webhook_url_env or "", "") or secret
                if not url:
                    log.error("slack: %s is not set; alert not sent", cfg.webhook_url_env)
                    return False
                resp = WebhookClient(url, timeout=10).send_dict(body)
                if resp.status_code != 200:
                    log.error("slack webhook answered %s: %s", resp.status_code, resp.body[:200])
                    return False
                return True
            from slack_sdk import WebClient

            token = os.environ.get(cfg.token_env or "", "") or secret
            if not token:
                log.error("slack: no webhook URL or token configured; alert not sent")
                return False
            kw = {"base_url": cfg.base_url} if cfg.base_url else {}
            WebClient(token=token, timeout=10, **kw).chat_postMessage(channel=cfg.channel, **body)
            return True
        except Exception as e:  # an outage of Slack must never fail a flow
            log.error("slack alert failed: %s", type(e).__name__ + ": " + str(e)[:200])
            return False


def _fit(body: dict, ui: str | None, flow_run_id) -> None:
    """Cut every block text to Slack's limit, pointing at the flow run for the rest."""
    url = f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui and flow_run_id else None
    more = render("slack/_truncated.j2", url=url, flow_run_id=flow_run_id).strip()
    for b in body.get("blocks") or []:
        t = b.get("text")
        if isinstance(t, dict) and isinstance(t.get("text"), str):
            if b.get("type") == "header":
                t["text"] = _cut(t["text"], HEADER_MAX, "…")
            else:
                t["text"] = _cut(t["text"], SECTION_MAX, "\n" + more)
        for f in b.get("fields") or []:
            if isinstance(f.get("text"), str):
                f["text"] = _cut(f["text"], FIELD_MAX, "\n" + more)


def _cut(text: str, limit: int, more: str) -> str:
    if len(text) <= limit:
        return text
    keep = text[:limit - len(more) - 3]
    if keep.count("```") % 2:  # a cut inside a code block: close it, or the pointer renders as code
        keep += "```"
    return keep + more


def _secret_from(cfg) -> str | None:
    if not getattr(cfg, "secret_block", None):
        return None
    try:
        from prefect.blocks.system import Secret

        return Secret.load(cfg.secret_block).get()
    except Exception as e:
        log.error("cannot read Prefect Secret block %r: %s", cfg.secret_block, e)
        return None
