"""Prefect events (#36 item 2): each flow step an operator acts on emits an event about the workload,
its node and fleet related, read back here from a real (test-harness) Prefect server's event API;
the automations docs/events.md offers validate as Prefect's own automation models."""

import os
import re
import signal
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from conftest import tear_pages, write_fleet
from ckptflow.store.local import LocalStore

pytestmark = pytest.mark.criu
ROOT = Path(__file__).parent.parent


def _events(workload: str, since: datetime, want: set[str], timeout_s: float = 30.0) -> dict[str, list]:
    """Events about ``workload`` since ``since``, by name, once every name in ``want`` arrived (the
    server persists events a moment after they are sent)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventOccurredFilter, EventResourceFilter

    deadline = time.time() + timeout_s
    while True:
        f = EventFilter(occurred=EventOccurredFilter(since=since, until=datetime.now(timezone.utc) + timedelta(minutes=1)),
                        resource=EventResourceFilter(id=[f"ckptflow.workload.{workload}"]))
        with get_client(sync_client=True) as c:
            page = c.read_events(f, limit=50)  # the server takes at most 50 a page
        got: dict[str, list] = {}
        for e in page.events:
            got.setdefault(e.event, []).append(e)
        if want <= set(got) or time.time() > deadline:
            return got
        time.sleep(0.5)


def _related(e) -> dict[str, str]:
    return {r.role: r.id for r in e.related if r.role in ("node", "fleet")}


def test_checkpoint_restore_and_failed_restore_are_events_with_workload_and_node(tmp_path, prefect_harness,
                                                                                 demo_worker):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    w = demo_worker("evchat")
    store = LocalStore(tmp_path / "store")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    w.complete("a long agent transcript " * 30, 16, "agent")
    first = heartbeat(str(fleet))[0]
    assert first["ok"] and first["checkpoint"]
    again = heartbeat(str(fleet))[0]                      # nothing new: the policy skips
    assert again["checkpoint"] is None
    os.kill(w.pid, signal.SIGKILL)
    recover(str(fleet), "evchat")

    got = _events("evchat", since, {"ckptflow.checkpoint.committed", "ckptflow.checkpoint.skipped",
                                    "ckptflow.restore.succeeded"})
    [c] = got["ckptflow.checkpoint.committed"]
    assert c.resource.id == "ckptflow.workload.evchat" and c.resource.name == "evchat"
    assert _related(c) == {"node": "ckptflow.node.local", "fleet": "ckptflow.fleet.test"}
    assert c.payload["checkpoint"] == first["checkpoint"] and c.payload["bytes"] == first["bytes"]
    assert c.payload["decision"] == first["decision"] and c.payload["reason"] == first["reason"]
    assert any(r.role == "flow-run" for r in c.related)       # Prefect relates the run that emitted it
    [s] = got["ckptflow.checkpoint.skipped"]
    assert s.payload["reason"] == again["reason"]
    [r] = got["ckptflow.restore.succeeded"]
    assert r.payload["checkpoint"] == first["checkpoint"] and "restored from checkpoint" in r.payload["how"]

    # The only checkpoint torn: the restore fails (recover then cold-starts), and says why in its event.
    m = store.get("evchat", first["checkpoint"])
    tear_pages(store.root / "evchat" / m.id / "images")
    os.kill(w.pid, signal.SIGKILL)
    assert recover(str(fleet), "evchat")["cold_start"]
    [fail] = _events("evchat", since, {"ckptflow.restore.failed"})["ckptflow.restore.failed"]
    assert _related(fail)["node"] == "ckptflow.node.local" and fail.payload["checkpoint"] == m.id
    assert "failed its checksums" in fail.payload["reason"] and "cold start" in fail.payload["fallback"]


def test_the_automations_the_docs_offer_are_prefect_automations():
    from prefect.events.schemas.automations import AutomationCore

    text = (ROOT / "docs" / "events.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    automations = [yaml.safe_load(b) for b in blocks if "trigger:" in b]
    assert len(automations) >= 2
    for a in automations:
        core = AutomationCore.model_validate(a)
        assert core.trigger.expect and all(e.startswith("ckptflow.") or e.startswith("maintenance.")
                                           for e in core.trigger.expect)
    names = {e for a in automations for e in a["trigger"]["expect"]}
    assert "ckptflow.restore.failed" in names
