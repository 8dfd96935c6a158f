"""Slack alerts (slack-sdk), one per workload per change of failure state; never fatal.

Configured from the fleet file's ``slack:`` section: an incoming webhook URL or a bot token
(+ channel), read from the environment variable it names or a Prefect Secret block. Block Kit
bodies come from jinja2 templates in templates/slack/.

Example:
    >>> Alerter(fleet.slack, state_dir=Path(".ckptflow/store")).send(
    ...     "restore_failed", workload="chat", node="n1", checkpoint="...", reason="...")  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from ckptflow.render import render

log = logging.getLogger("ckptflow")

KINDS = {"restore_failed", "verify_failed", "invalidated", "recovered"}


class Alerter:
    """Send alerts without storms: an alert whose (kind, workload, key) equals the last one
    sent for that workload is suppressed until the workload's failure state changes."""

    def __init__(self, slack=None, state_dir: Path | None = None, secret: str | None = None,
                 prefect_ui_url: str | None = None):
        self.cfg = slack
        self.secret = secret
        self.ui = prefect_ui_url
        self.state_file = (Path(state_dir) / ".alerts.json") if state_dir else None

    def _state(self) -> dict:
        if self.state_file and self.state_file.exists():
            return json.loads(self.state_file.read_text())
        return {}

    def _save(self, st: dict) -> None:
        if self.state_file:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(st))
            os.replace(tmp, self.state_file)

    def clear(self, workload: str) -> None:
        """The workload is healthy again: its next failure alerts anew."""
        st = self._state()
        if st.pop(workload, None) is not None:
            self._save(st)

    def send(self, kind: str, *, workload: str, key: str = "", **ctx) -> bool:
        """Render and post one alert; True if posted. Slack errors are logged, never raised."""
        if kind not in KINDS:
            raise ValueError(f"unknown alert kind {kind!r}")
        st = self._state()
        token = hashlib.sha256(f"{kind}|{key}".encode()).hexdigest()[:16]
        if st.get(workload) == token:
            log.info("alert %s for %s suppressed (already sent for this state)", kind, workload)
            return False
        body = json.loads(render(f"slack/{kind}.json.j2", workload=workload, ui=self.ui, **ctx))
        posted = self._post(body)
        if posted:
            st[workload] = token
            self._save(st)
        return posted

    def _post(self, body: dict) -> bool:
        cfg = self.cfg
        if cfg is None:
            log.warning("alert (no slack configured): %s", body.get("text"))
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


def _secret_from(cfg) -> str | None:
    if not getattr(cfg, "secret_block", None):
        return None
    try:
        from prefect.blocks.system import Secret

        return Secret.load(cfg.secret_block).get()
    except Exception as e:
        log.error("cannot read Prefect Secret block %r: %s", cfg.secret_block, e)
        return None
