"""heartbeat and recover as Prefect flows against a real (test-harness) Prefect server."""

import os
import signal

import pytest

from conftest import tear_pages, write_fleet
from ckptflow.models import CheckpointMode, CheckpointState
from ckptflow.store.local import LocalStore

pytestmark = pytest.mark.criu


def test_heartbeat_then_recover_restores_session(tmp_path, prefect_harness, demo_worker):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    w, ref = demo_worker("chat"), demo_worker("ref")
    store = LocalStore(tmp_path / "store")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    for x in (w, ref):
        x.complete("a long agent transcript " * 30, 16, "agent")

    results = heartbeat(str(fleet))
    assert [r["ok"] for r in results] == [True]
    m = store.latest_valid("chat")
    assert m.id == results[0]["checkpoint"] and m.probe.sessions == w.digests()
    assert w.proc.poll() is None  # heartbeat leaves the worker running

    os.kill(w.pid, signal.SIGKILL)
    res = recover(str(fleet), "chat")
    assert res["checkpoint"] == m.id and res["pid"] == m.pid
    assert w.digests() == ref.digests()
    assert w.complete("next step", 32, "agent") == ref.complete("next step", 32, "agent")


def test_recover_falls_back_past_a_corrupt_checkpoint(tmp_path, prefect_harness, demo_worker):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    w = demo_worker("chat")
    store = LocalStore(tmp_path / "store")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    w.complete("first", 8, "s")
    old = heartbeat(str(fleet))[0]["checkpoint"]
    digests_at_old = w.digests()
    w.complete("second", 8, "s")
    new = heartbeat(str(fleet), force=True)[0]["checkpoint"]
    tear_pages(store.root / "chat" / new / "images")

    os.kill(w.pid, signal.SIGKILL)
    res = recover(str(fleet), "chat")
    assert res["checkpoint"] == old
    assert [s["id"] for s in res["skipped"]] == [new]
    assert store.get("chat", new).state == CheckpointState.verify_failed
    assert "sha256" in store.get("chat", new).state_reason
    assert w.digests() == digests_at_old


@pytest.mark.fault
def test_heartbeat_reports_a_gone_workload(tmp_path, prefect_harness, demo_worker):
    from ckptflow.flows.heartbeat import HeartbeatFailed, heartbeat

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    w.stop()
    with pytest.raises(HeartbeatFailed, match="^workload chat: no live process") as e:
        heartbeat(str(fleet))
    # What brings it back, in the error a deployment run's state shows (fleet-mode trial: no fix line).
    assert e.value.fix.startswith(f"start it again, or `ckptflow recover {fleet} chat`")
    assert str(e.value).endswith(f"\n  fix: {e.value.fix}")
    assert LocalStore(tmp_path / "store").list("chat") == []


def test_recover_refuses_to_restore_over_a_running_worker(tmp_path, prefect_harness, demo_worker):
    from ckptflow.errors import RestoreFailed
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    heartbeat(str(fleet))
    with pytest.raises(RestoreFailed, match="is running"):
        recover(str(fleet), "chat")
    assert w.proc.poll() is None


def _criu_tmp_dirs() -> set:
    import tempfile
    from pathlib import Path

    return set(Path(tempfile.gettempdir()).glob(f"ckptflow-criu-{os.getpid()}-*"))  # ours: other CRIU users share /tmp


def test_heartbeat_and_recover_leave_no_criu_temp_dir(tmp_path, prefect_harness, demo_worker):
    from ckptflow.errors import RestoreFailed
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    w.complete("hello", 8, "s")
    before = _criu_tmp_dirs()
    heartbeat(str(fleet), force=True)                    # a dump
    with pytest.raises(RestoreFailed):                    # a refused restore (an error path)
        recover(str(fleet), "chat")
    os.kill(w.pid, signal.SIGKILL)
    recover(str(fleet), "chat")                           # a restore
    assert _criu_tmp_dirs() <= before


def test_two_tier_workload_through_heartbeat_and_recover_flows(tmp_path, prefect_harness, demo_worker):
    """checkpoint: template-sessions in the fleet file: the heartbeat flow takes a template and a session
    checkpoint, the next one moves only what changed, and recover brings the worker back from
    template + sessions, continuing exactly like an uninterrupted reference."""
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover
    from ckptflow.flows.verify import verify

    w, ref = demo_worker("tt", ballast_mib=16), demo_worker("ref", ballast_mib=16)
    # engine: demo, the protocol's server (a vLLM does not serve it: refused at load); vLLM's CRIU options stay
    w.workload = w.workload.model_copy(update={"checkpoint": CheckpointMode.template_sessions, "engine": "demo"})
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    store = LocalStore(tmp_path / "store")
    for x in (w, ref):
        x.complete("a long agent transcript " * 30, 16, "agent")
    first = heartbeat(str(fleet), force=True)[0]
    m1 = store.get("tt", first["checkpoint"])
    assert first["ok"] and m1.kind == "sessions" and m1.probe.template.id
    for x in (w, ref):
        x.complete("one more step", 8, "agent")
    second = heartbeat(str(fleet), force=True)[0]
    m2 = store.get("tt", second["checkpoint"])
    assert m2.parent == m1.id and 0 < m2.probe.export.moved_bytes < m2.probe.export.total_bytes
    rows = verify(str(fleet))                                 # a copy beside the live worker, in namespaces
    assert [(r["checkpoint"], r["state"]) for r in rows] == [(m2.id, "verified")], rows
    assert store.get("tt", m2.id).state == CheckpointState.verified

    os.kill(w.pid, signal.SIGKILL)
    w.proc.wait()
    res = recover(str(fleet), "tt")
    assert res["checkpoint"] == m2.id and res["template"] == m1.probe.template.id
    assert w.digests() == ref.digests()
    assert w.complete("next step", 24, "agent") == ref.complete("next step", 24, "agent")
