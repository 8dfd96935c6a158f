"""Restore verification in a sandbox, Slack alerts with real request bodies, recover fallbacks."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SlackCapture, tear_pages, write_fleet
from ckptflow.models import CheckpointState, EngineProbe
from ckptflow.store.fleetstate import LocalFleetState
from ckptflow.store.local import LocalStore

pytestmark = pytest.mark.criu


def _demo_workers(tmp_path):
    """This test's demo workers and their sandbox copies (same command line: the pid file under
    ``tmp_path``), not those of other test runs sharing the machine."""
    out = subprocess.run(["pgrep", "-f", f"ckptflow.demo.worker .*{tmp_path}/"], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _netns():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_verify_beside_live_original(tmp_path, prefect_harness, demo_worker, slack):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.verify import verify

    w = demo_worker("chat")
    w.complete("a session to keep " * 20, 16, "s1")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
    ckpt = heartbeat(str(fleet))[0]["checkpoint"]
    digests, pid, workers = w.digests(), w.pid, _demo_workers(tmp_path)
    rows = verify(str(fleet))
    assert rows[0]["state"] == "verified", rows
    assert rows[0]["reason"] == "golden digest and 1 session digest(s) equal"
    m = LocalStore(tmp_path / "store").get("chat", ckpt)
    assert m.state == CheckpointState.verified and "restore" in m.probe.verify_timings
    # The original is untouched, the sandbox is gone.
    assert w.pid == pid and w.proc.poll() is None and w.digests() == digests
    assert _demo_workers(tmp_path) == workers == {pid}
    assert "ckv-" not in _netns()
    assert slack.requests == []


def test_golden_differs_marks_failed_and_alerts_exactly_once(tmp_path, prefect_harness, demo_worker, slack):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.verify import verify

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
    store = LocalStore(tmp_path / "store")
    ckpt = heartbeat(str(fleet))[0]["checkpoint"]
    m = store.get("chat", ckpt)
    # As if the worker had answered differently at checkpoint time than its restored copy does.
    store.set_state(m, m.state, None, golden="0" * 64)
    rows = verify(str(fleet))
    assert rows[0]["state"] == "verify_failed"
    assert rows[0]["reason"].startswith("golden output digest differs")
    m = store.get("chat", ckpt)
    assert m.state == CheckpointState.verify_failed and "golden output digest differs" in m.state_reason
    assert len(slack.requests) == 1
    body = slack.requests[0]["body"]
    assert body["text"].startswith(":warning: Verification of chat checkpoint " + ckpt)
    blocks = body["blocks"]
    assert blocks[0] == {"type": "header", "text": {"type": "plain_text",
                                                    "text": "Checkpoint verification failed: chat"}}
    fields = [f["text"] for f in blocks[1]["fields"]]
    assert fields == ["*Workload*\nchat", "*Node*\nlocal", f"*Checkpoint*\n{ckpt}", "*State*\nverify_failed"]
    assert blocks[2]["text"]["text"].startswith("*Reason*\ngolden output digest differs")
    assert blocks[-1]["elements"][0]["url"].startswith("http://127.0.0.1:4200/runs/flow-run/")
    # Nothing left to verify, and the same failure state never alerts twice.
    verify(str(fleet))
    from ckptflow.alerts import Alerter
    from ckptflow.fleet import load_fleet

    f = load_fleet(fleet)
    Alerter(f.slack, state_dir=Path(f.storage.path)).send(
        "verify_failed", workload="chat", key=ckpt, node="local", checkpoint=ckpt, reason="again", log_tail="",
        ui=None, flow_run_id=None)
    assert len(slack.requests) == 1


@pytest.mark.fault
def test_slack_outage_never_fails_the_flow(tmp_path, prefect_harness, demo_worker, monkeypatch, caplog):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.verify import verify

    down = SlackCapture(status=500)
    monkeypatch.setenv("CKPTFLOW_TEST_SLACK_WEBHOOK", down.url)
    try:
        w = demo_worker("chat")
        fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
        store = LocalStore(tmp_path / "store")
        ckpt = heartbeat(str(fleet))[0]["checkpoint"]
        store.set_state(store.get("chat", ckpt), CheckpointState.complete, None, golden="1" * 64)
        with caplog.at_level("ERROR", logger="ckptflow"):
            rows = verify(str(fleet))
        assert rows[0]["state"] == "verify_failed"
        assert len(down.requests) == 1 and "slack webhook answered 500" in caplog.text
    finally:
        down.close()


def _corrupt(store, workload, ckpt):
    tear_pages(store.root / workload / ckpt / "images", offset=100)


def test_recover_corrupt_newest_falls_back_and_alerts_once(tmp_path, prefect_harness, demo_worker, slack):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
    store = LocalStore(tmp_path / "store")
    old = heartbeat(str(fleet))[0]["checkpoint"]
    new = heartbeat(str(fleet), force=True)[0]["checkpoint"]
    _corrupt(store, "chat", new)
    os.kill(w.pid, signal.SIGKILL)
    res = recover(str(fleet), "chat")
    assert res["checkpoint"] == old and not res["cold_start"]
    # One message: the worker is back (from the older checkpoint), and what was passed over.
    assert len(slack.requests) == 1
    body = slack.requests[0]["body"]
    assert body["text"] == f":white_check_mark: chat recovered on local: restored from older checkpoint {old} " \
                           "(newer ones failed their checks)"
    fields = [f["text"] for f in body["blocks"][1]["fields"]]
    assert f"*Checkpoint*\n{old}" in fields
    passed = [b["text"]["text"] for b in body["blocks"] if b.get("text", {}).get("text", "").startswith("*Passed")]
    assert passed and passed[0].startswith(f"*Passed over*\n{new}: ")


def test_recover_with_no_good_checkpoint_cold_starts_and_alerts_once(tmp_path, prefect_harness, demo_worker, slack):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
    store = LocalStore(tmp_path / "store")
    only = heartbeat(str(fleet))[0]["checkpoint"]
    _corrupt(store, "chat", only)
    old_pid = w.pid
    os.kill(old_pid, signal.SIGKILL)
    w.proc.wait()
    res = recover(str(fleet), "chat")
    assert res["cold_start"] is True and res["pid"] != old_pid
    assert w.complete("fresh", 4) is not None  # a cold-started worker serves, with no sessions
    assert w.digests() == {}
    assert len(slack.requests) == 1
    fields = [f["text"] for f in slack.requests[0]["body"]["blocks"][1]["fields"]]
    assert any(f.startswith("*Fallback*\ncold start") for f in fields)
    assert slack.requests[0]["body"]["blocks"][0]["text"]["text"] == "Restore failed, cold started: chat"
    assert store.get("chat", only).state == CheckpointState.verify_failed


def test_recover_with_no_checkpoint_at_all_says_cold_started_not_restore_failed(tmp_path, prefect_harness,
                                                                              demo_worker, slack):
    """Nothing was there to restore: the alert's title says the worker was cold started (its sessions
    lost), not that a restore failed (a new-user trial read "Restore failed" and looked for one)."""
    from ckptflow.flows.recover import recover

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
    os.kill(w.pid, signal.SIGKILL)
    w.proc.wait()
    assert recover(str(fleet), "chat")["cold_start"] is True
    body = slack.requests[0]["body"]
    assert body["blocks"][0]["text"]["text"] == "Cold started, no checkpoint to restore: chat"
    assert body["text"].startswith(":rotating_light: Cold started, no checkpoint to restore: chat on local: ")
    fields = [f["text"] for f in body["blocks"][1]["fields"]]
    assert "*Checkpoint*\nnone tried" in fields


def test_status_and_exporter_report_the_store(tmp_path, prefect_harness, demo_worker):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover
    from ckptflow.flows.verify import verify
    from ckptflow.fleet import load_fleet
    from ckptflow.report import StoreCollector

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    heartbeat(str(fleet))
    verify(str(fleet))
    os.kill(w.pid, signal.SIGKILL)
    recover(str(fleet), "chat")
    reg = CollectorRegistry()
    reg.register(StoreCollector(load_fleet(fleet)))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}
    assert samples[("ckptflow_last_verification_ok", (("workload", "chat"),))] == 1.0
    assert samples[("ckptflow_checkpoints", (("state", "verified"), ("workload", "chat")))] == 1.0
    assert samples[("ckptflow_restore_duration_seconds_count", (("workload", "chat"),))] == 1.0
    assert 0 <= samples[("ckptflow_checkpoint_age_seconds", (("node", "local"), ("workload", "chat")))] < 120
    assert samples[("ckptflow_bytes_stored", (("workload", "chat"),))] > 1 << 20
    out = subprocess.run([sys.executable, "-m", "ckptflow", "status", str(fleet)], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "250"}, timeout=60)
    assert out.returncode == 0 and "chat" in out.stdout and "verified" in out.stdout and "1 (last" in out.stdout


def test_artifacts_readable_from_the_prefect_api_and_exporter_serves(tmp_path, prefect_harness, demo_worker):
    import time
    import urllib.request

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prometheus_client.parser import text_string_to_metric_families

    from conftest import free_port
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    ckpt = heartbeat(str(fleet))[0]["checkpoint"]
    os.kill(w.pid, signal.SIGKILL)
    recover(str(fleet), "chat")
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["restore-chat", "heartbeat-test"])))
    # Other tests leave artifacts under the same keys: find this run's by its checkpoint id.
    report = [a for a in arts if a.key == "restore-chat" and f"from checkpoint `{ckpt}`" in a.data]
    table = [a for a in arts if a.key == "heartbeat-test" and ckpt in str(a.data)]
    assert len(report) == 1 and report[0].type == "markdown" and "| restore |" in report[0].data
    assert len(table) == 1 and table[0].type == "table"

    port = free_port()
    exp = subprocess.Popen([sys.executable, "-m", "ckptflow", "exporter", str(fleet), "--port", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while True:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                break
            except OSError:
                assert time.time() < deadline, "exporter never answered"
                time.sleep(0.2)
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"ckptflow_checkpoint_age_seconds", "ckptflow_checkpoints", "ckptflow_bytes_stored",
                "ckptflow_restore_duration_seconds"} <= names
    finally:
        exp.kill()


# --- alert lifecycle: open -> (repeat only on a new reason) -> resolved -------------------------
def _texts(slack):
    return [r["body"]["text"] for r in slack.requests]


def test_dead_worker_alert_opens_once_and_recover_resolves_it(tmp_path, prefect_harness, demo_worker, slack):
    from ckptflow.flows.heartbeat import HeartbeatFailed, heartbeat
    from ckptflow.flows.recover import recover

    w = demo_worker("chat")
    w.complete("a long session " * 20, 16, "s")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
    ckpt = heartbeat(str(fleet))[0]["checkpoint"]
    os.kill(w.pid, signal.SIGKILL)
    w.proc.wait()
    # The worker is gone: not "skip (nothing new since the last checkpoint)", but a failure and an alert.
    for _ in range(2):
        with pytest.raises(HeartbeatFailed, match="^workload chat: no live process") as e:
            heartbeat(str(fleet))
        [row] = e.value.rows
        assert row["ok"] is False and row["reason"].startswith("worker gone: workload chat: no live process")
        assert row["checkpoint"] is None
    assert _texts(slack) == [f":skull: Worker chat on local is gone: {row['error']}"]  # once, not per heartbeat
    fields = [f["text"] for f in slack.requests[0]["body"]["blocks"][1]["fields"]]
    assert f"*Newest valid checkpoint*\n{ckpt}" in fields
    assert LocalFleetState(tmp_path / "store").get_alert("chat")["kind"] == "worker_gone"

    recover(str(fleet), "chat")
    assert _texts(slack)[1] == f":white_check_mark: chat recovered on local: restored from checkpoint {ckpt}"
    resolves = [b["text"]["text"] for b in slack.requests[1]["body"]["blocks"]
                if b.get("text", {}).get("text", "").startswith("*Resolves*")]
    assert resolves == [f"*Resolves*\n{row['error']}"]
    assert LocalFleetState(tmp_path / "store").get_alert("chat") is None
    heartbeat(str(fleet))                     # running again: nothing to say
    assert len(slack.requests) == 2
    # The same failure again is a new incident, not a repeat: it alerts.
    os.kill(w.pid, signal.SIGKILL)
    with pytest.raises(HeartbeatFailed):
        heartbeat(str(fleet))
    assert len(slack.requests) == 3 and _texts(slack)[2].startswith(":skull: Worker chat on local is gone")


def test_worker_restarted_by_hand_resolves_the_gone_alert(tmp_path, prefect_harness, demo_worker, slack):
    from ckptflow.demo import launch
    from ckptflow.flows.heartbeat import HeartbeatFailed, heartbeat

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
    heartbeat(str(fleet))
    w.stop()
    with pytest.raises(HeartbeatFailed):
        heartbeat(str(fleet))
    w.proc = launch.start_worker(w.port, w.pid_file)          # an operator starts it again
    heartbeat(str(fleet))
    assert [t.split(":")[1] for t in _texts(slack)] == ["skull", "white_check_mark"]
    assert _texts(slack)[1] == ":white_check_mark: chat recovered on local: seen running again"


def test_recover_refused_on_a_running_worker_alerts_nobody(tmp_path, prefect_harness, demo_worker, slack):
    from ckptflow.errors import WorkloadRunning
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    w = demo_worker("chat")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
    heartbeat(str(fleet))
    with pytest.raises(WorkloadRunning):
        recover(str(fleet), "chat")
    assert slack.requests == []


def test_slack_texts_are_cut_to_the_limit_with_a_pointer_to_the_flow_run(tmp_path, slack):
    from ckptflow.alerts import Alerter
    from ckptflow.fleet import Slack

    a = Alerter(Slack(webhook_url_env="CKPTFLOW_TEST_SLACK_WEBHOOK"), state_dir=tmp_path,
                prefect_ui_url="http://127.0.0.1:4200")
    reason = "every valid checkpoint failed its checksums: " + "; ".join(f"ckpt-{i}: sha256 differs" for i in range(400))
    assert a.send("restore_failed", workload="chat", key=reason, node="n" * 2500, checkpoint=None, reason=reason,
                  fallback=None, log_tail="criu log line\n" * 400, flow_run_id="1234-abcd")
    rows = [{"reason": f"driver changed on node {i}: 580.{i} -> 590.{i}"} for i in range(300)]
    assert a.send("invalidated", workload="api", key="k", node="n", rows=rows, flow_run_id="1234-abcd")
    assert len(slack.requests) == 2
    pointer = "_(truncated: the full text is in <http://127.0.0.1:4200/runs/flow-run/1234-abcd|the flow run>)_"
    cut = 0
    for req in slack.requests:
        for b in req["body"]["blocks"]:
            texts = ([b["text"]["text"]] if b["type"] == "section" and "text" in b else []) + \
                    [f["text"] for f in b.get("fields", [])]
            for t in texts:
                assert len(t) <= 3000
                if pointer in t:
                    assert t.endswith(pointer), t[-200:]
                    cut += 1
            if b["type"] == "section" and "fields" in b:
                assert all(len(f["text"]) <= 2000 for f in b["fields"])
    assert cut >= 3  # the reason, the node field, the invalidation reasons
    log_block = [b["text"]["text"] for b in slack.requests[0]["body"]["blocks"]
                 if b.get("text", {}).get("text", "").startswith("*CRIU log tail*")]
    assert log_block and log_block[0].count("```") == 2


def test_alert_state_lives_in_the_bucket_for_every_node(tmp_path, s3, slack):
    from ckptflow.alerts import Alerter
    from ckptflow.fleet import Slack
    from ckptflow.store.fleetstate import S3FleetState

    cfg = Slack(webhook_url_env="CKPTFLOW_TEST_SLACK_WEBHOOK")
    bucket = s3.bucket("alerts-shared")
    node_a = Alerter(cfg, state=S3FleetState(bucket, endpoint_url=s3.endpoint))
    node_b = Alerter(cfg, state=S3FleetState(bucket, endpoint_url=s3.endpoint))
    ctx = dict(node="node-a", checkpoint=None, fallback=None, log_tail="", flow_run_id=None)
    assert node_a.send("restore_failed", workload="chat", key="disk", reason="disk", **ctx)
    assert not node_b.send("restore_failed", workload="chat", key="disk", reason="disk", **ctx)   # same reason
    assert node_b.open_alerts()["chat"]["kind"] == "restore_failed"
    assert node_b.send("restore_failed", workload="chat", key="pid", reason="pid busy", **ctx)  # a new reason
    assert node_a.resolve("chat", node="node-b", how="restored from checkpoint x", checkpoint="x")
    assert not node_b.resolve("chat", node="node-b", how="again", checkpoint="x")                # closed already
    assert node_a.open_alerts() == {}
    assert [t.split(":")[1] for t in _texts(slack)] == ["rotating_light", "rotating_light", "white_check_mark"]
    assert not list(tmp_path.rglob(".alerts*"))


def test_a_gone_worker_is_recovered_in_the_same_heartbeat_when_its_rule_says_so(tmp_path, prefect_harness,
                                                                                 demo_worker, slack):
    import yaml

    from ckptflow.flows.heartbeat import heartbeat

    w, ref = demo_worker("chat"), demo_worker("ref")
    for x in (w, ref):
        x.complete("a long session " * 20, 16, "s")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
    data = yaml.safe_load(fleet.read_text())
    data["policies"] = [{"match": {}, "policy": "cost-based", "on_worker_gone": "recover"}]
    fleet.write_text(yaml.safe_dump(data))
    ckpt = heartbeat(str(fleet))[0]["checkpoint"]
    os.kill(w.pid, signal.SIGKILL)
    w.proc.wait()
    [row] = heartbeat(str(fleet))                         # no HeartbeatFailed: it came back
    assert row["ok"] and row["recovered"] == ckpt and row["reason"].endswith("; recovered")
    assert w.complete("and next", 16, "s") == ref.complete("and next", 16, "s")
    texts = _texts(slack)
    assert texts[0].startswith(":skull: Worker chat on local is gone")
    assert texts[1] == f":white_check_mark: chat recovered on local: restored from checkpoint {ckpt}"


# --- outcomes are VerifyOutcome members, decided from what the sandbox copy answered --------------
def _probe_workload(url="http://127.0.0.1:9"):
    from ckptflow.models import GoldenRequest, ProcessFinder, Workload

    return Workload(name="w", node="n", find=ProcessFinder(pid_file="/nonexistent.pid"), health_url=f"{url}/health",
                    probe_url=f"{url}/digests",
                    golden=GoldenRequest(url=f"{url}/golden", body={"prompt": "p"}, field="tokens"))


def test_each_outcome_is_a_verify_outcome():
    from ckptflow.models import Manifest, ManifestProbe, VerifyOutcome
    from ckptflow.runners.engine import golden_digest
    from ckptflow.runners.verify import _compare

    w, answer = _probe_workload(), {"tokens": [1, 2, 3]}
    m = Manifest(id="20261129T081500Z-1a2b3c4d", workload="w", node="n",
                 probe={"golden": golden_digest(answer, "tokens"), "sessions": {"s": "d1"}})
    healthy = {"health_s": 0.1, "golden_answer": answer, "sessions": {"s": "d1"}}
    cases = [
        (healthy, m, VerifyOutcome.verified, "golden digest and 1 session digest(s) equal"),
        ({**healthy, "sessions": {"s": "d2"}}, m, VerifyOutcome.verify_failed, "session state differs from the "
                                                                                "checkpoint: s"),
        ({**healthy, "golden_answer": {"tokens": [9]}}, m, VerifyOutcome.verify_failed, "golden output digest differs"),
        ({"error": "not healthy within 1 s: HTTP 503"}, m, VerifyOutcome.verify_failed, "sandbox copy not healthy"),
        (healthy, m.model_copy(update={"probe": ManifestProbe()}), VerifyOutcome.skipped,
         "the checkpoint recorded no golden"),
        # The probe failed at checkpoint time: the sessions were never compared, so not proven.
        (healthy, m.model_copy(update={"probe": ManifestProbe(golden=m.probe.golden, error="probe failed: HTTP 500")}),
         VerifyOutcome.unverified, "healthy, but sessions not compared: probe failed: HTTP 500 (golden digest equal)"),
    ]
    for got, manifest, outcome, reason in cases:
        res = _compare(w, manifest, got, {})
        assert res.state is outcome and res.reason.startswith(reason), (res, reason)
    # Nothing declared to compare: healthy is not verified.
    bare = w.model_copy(update={"golden": None, "probe_url": None})
    res = _compare(bare, m, {"health_s": 0.1}, {})
    assert res.state is VerifyOutcome.unverified and res.reason.startswith("healthy only: no golden request or probe")


def test_a_copy_that_never_gets_healthy_is_reported_with_the_last_error():
    from ckptflow.runners.verify import del_netns, new_netns, probe_in_netns

    ns = new_netns("ckvt")
    try:
        t0 = time.monotonic()
        got = probe_in_netns(ns, _probe_workload(), timeout_s=0.5)   # nothing listens in the fresh namespace
    finally:
        del_netns(ns)
    assert got["error"].startswith("not healthy within 0.5 s: ") and "refused" in got["error"], got
    assert time.monotonic() - t0 < 20


@pytest.mark.fault
def test_a_probe_error_at_checkpoint_time_refuses_the_checkpoint(tmp_path, monkeypatch):
    # Stored as "error", it used to switch the session check after a restore off without a word.
    from ckptflow.errors import EngineProtocolError
    from ckptflow.runners import node as node_mod
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    class NoCriu:
        def __getattr__(self, name):
            raise AssertionError(f"CRIU {name} called")

    monkeypatch.setattr(node_mod.process, "resolve", lambda w: type("P", (), {"pid": 4242})())
    monkeypatch.setattr(node_mod, "probe", lambda w: EngineProbe(error="probe failed: HTTP 500"))
    store = LocalStore(tmp_path / "store")
    w = _probe_workload()
    with pytest.raises(EngineProtocolError, match=r"workload w: probe failed: HTTP 500 .*not checkpointing") as e:
        NodeRunner(store, criu=NoCriu()).checkpoint(w)
    assert e.value.retryable and "probe_url" in e.value.fix
    assert store.list("w") == []
