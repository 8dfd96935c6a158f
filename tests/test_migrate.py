"""migrate and drain through S3 (SeaweedFS): in-process, and through a real Prefect server with
one process work pool and worker per node."""


import logging

import pytest
import yaml

from conftest import write_fleet
from ckptflow.models import TrafficClass

pytestmark = pytest.mark.criu


def _two_node_fleet(tmp_path, s3, workloads, bucket):
    f = write_fleet(tmp_path / "fleet.yaml", workloads, tmp_path / "store" / "{node}")
    data = yaml.safe_load(f.read_text())
    data["nodes"] = [{"name": "node-a", "work_pool": "node-a", "gpu_class": "cpu"},
                     {"name": "node-b", "work_pool": "node-b", "gpu_class": "cpu"}]
    for w in data["workloads"]:
        w["node"] = "node-a"
    data["storage"].update(kind="s3", bucket=s3.bucket(bucket), endpoint_url=s3.endpoint)
    f.write_text(yaml.safe_dump(data))
    return str(f)


@pytest.fixture
def run_log():
    """What the flows logged to their run (Prefect's flow-run logger does not propagate to caplog)."""
    from prefect.logging import configuration

    if not configuration.PROCESS_LOGGING_CONFIG:  # the first flow run would set it up, dropping our handler
        configuration.setup_logging()
    lines: list[str] = []
    h = logging.Handler()
    h.emit = lambda r: lines.append(r.getMessage())
    logger = logging.getLogger("prefect.flow_runs")
    logger.addHandler(h)
    yield lambda: "\n".join(lines)
    logger.removeHandler(h)


def test_migrate_in_process_session_continues(tmp_path, prefect_harness, demo_worker, s3, run_log):
    from ckptflow.flows.migrate import migrate

    w, ref = demo_worker("chat"), demo_worker("ref")
    fleet = _two_node_fleet(tmp_path, s3, [w.workload], "ckpt-mig")
    for x in (w, ref):
        x.complete("an agent session to move " * 30, 16, "s")
    old_pid = w.pid
    res = migrate(fleet, "chat", "node-b", via_deployments=False)
    assert res["source"] == "node-a" and res["target"] == "node-b" and res["pid"] == old_pid
    assert res["out"]["uploaded_bytes"] > 0 and res["in"]["downloaded_bytes"] == res["out"]["bytes"]
    assert w.digests() == ref.digests()
    assert w.complete("next", 24, "s") == ref.complete("next", 24, "s")
    # The run's log says what moved (the fleet-mode trial found it only in the artifact).
    assert f"moved chat: node-a -> node-b, PID {old_pid}, checkpoint {res['checkpoint']}" in run_log()
    # Heartbeats follow the workload to node-b; node-a has nothing left to checkpoint.
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.tasks.common import open_fleet

    assert open_fleet(fleet).workload("chat").node == "node-b"
    assert heartbeat(fleet, node="node-a") == []
    rows = heartbeat(fleet, node="node-b", force=True)
    assert [(r["workload"], r["node"], r["ok"]) for r in rows] == [("chat", "node-b", True)]


def test_a_migrate_to_the_node_it_runs_on_is_refused_before_any_pause(tmp_path, prefect_harness, demo_worker, s3):
    # Fleet-mode trial: target_node=node-a for a worker on node-a checkpointed, stopped and
    # restored it ("moved", node-a -> node-a): an operator's typo paid a pause and a restore.
    from ckptflow.errors import ConfigError
    from ckptflow.flows.migrate import migrate
    from ckptflow.store import open_store
    from ckptflow.tasks.common import open_fleet

    w = demo_worker("chat")
    fleet = _two_node_fleet(tmp_path, s3, [w.workload], "ckpt-mig-same")
    w.complete("a session that stays " * 10, 8, "s")
    before = w.digests()
    with pytest.raises(ConfigError) as e:
        migrate(fleet, "chat", "node-a", via_deployments=False)
    assert "workload chat already runs on node-a" in str(e.value) and "others: node-b" in e.value.fix
    assert w.proc.poll() is None and w.digests() == before          # never stopped, nothing lost
    assert list(open_store(open_fleet(fleet).storage, "node-a").valid("chat")) == []  # and never checkpointed


def test_drain_moves_long_sessions_and_stops_short_ones(tmp_path, prefect_harness, demo_worker, s3, run_log):
    from ckptflow.flows.drain import drain

    long_w, short_w, ref = demo_worker("chat"), demo_worker("api"), demo_worker("ref")
    short_w.workload = short_w.workload.model_copy(update={"traffic": TrafficClass.short_requests})
    fleet = _two_node_fleet(tmp_path, s3, [long_w.workload, short_w.workload], "ckpt-drain")
    for x in (long_w, ref):
        x.complete("a long session " * 30, 16, "s")
    rows = {r["workload"]: r for r in drain(fleet, "node-a", via_deployments=False)}
    assert rows["chat"]["action"] == "migrated" and rows["chat"]["target"] == "node-b"
    assert "drain of node-a: chat migrated -> node-b; api stopped (short requests)" in run_log()
    assert rows["api"]["action"] == "stopped (short requests)"
    short_w.proc.wait(timeout=30)                         # it exited (raises if still running) ...
    with pytest.raises(OSError):                          # ... and nothing answers on its port
        short_w.complete("still there?", 4)
    assert long_w.complete("go on", 24, "s") == ref.complete("go on", 24, "s")
    assert (tmp_path / "store" / "node-a" / ".nodes" / "node-a.drained").exists()


def test_drain_skips_a_target_whose_own_maintenance_window_is_about_to_open(tmp_path, prefect_harness,
                                                                            demo_worker, s3):
    from datetime import datetime, timedelta, timezone

    from ckptflow.flows.drain import drain

    w, ref = demo_worker("chat"), demo_worker("ref")
    fleet = _two_node_fleet(tmp_path, s3, [w.workload], "ckpt-drain-mw")
    data = yaml.safe_load(open(fleet).read())
    soon = datetime.now(timezone.utc) + timedelta(minutes=10)
    # node-b sorts first and is as empty as node-c, but its own window opens in 10 minutes.
    data["nodes"][1]["maintenance"] = [{"start": soon.isoformat(), "end": (soon + timedelta(hours=2)).isoformat()}]
    data["nodes"].append({"name": "node-c", "work_pool": "node-c", "gpu_class": "cpu"})
    open(fleet, "w").write(yaml.safe_dump(data))
    for x in (w, ref):
        x.complete("a long session " * 30, 16, "s")
    [row] = drain(fleet, "node-a", via_deployments=False)
    assert (row["action"], row["target"]) == ("migrated", "node-c"), row
    assert w.complete("go on", 24, "s") == ref.complete("go on", 24, "s")


def test_scale_up_starts_a_warm_replica_beside_the_original(tmp_path, prefect_harness, demo_worker, s3):
    import subprocess

    from ckptflow.demo.launch import http_json
    from ckptflow.flows.scale import scale_up
    from ckptflow.runners.criu import SandboxCopy

    w = demo_worker("chat")
    fleet = _two_node_fleet(tmp_path, s3, [w.workload], "ckpt-scale")
    res = scale_up(fleet, "chat", "node-b", via_deployments=False)      # takes the template first
    copy = SandboxCopy(pid=res["pid"], init_pid=res["init_pid"], netns=res["netns"])
    try:
        assert res["sessions"] == {} and res["pid"] != w.pid
        assert res["start_s"] < 60
        # The original serves on, untouched, while the replica runs in its own namespaces.
        w.complete("a session on the original", 8, "s")
        assert set(w.digests()) == {"s"}
        from ckptflow.runners.engine import golden_digest

        g = w.workload.golden
        assert res["golden"] == golden_digest(http_json(g.url, g.body), g.field)   # computes like the original
        again = scale_up(fleet, "chat", "node-b", via_deployments=False)  # reuses the template
        assert again["checkpoint"] == res["checkpoint"] and again["downloaded_bytes"] == 0
        from ckptflow.flows.scale import scale_down
        from ckptflow.runners.process import pid_alive

        down = scale_down(fleet, "chat", "node-b", replica=again["netns"], via_deployments=False)
        assert down["stopped"] == [again["netns"]]
        assert not pid_alive(again["pid"]) and not pid_alive(again["init_pid"])
        assert again["netns"] not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert pid_alive(res["pid"]) and pid_alive(w.pid)        # the other replica and the original serve on
        assert scale_down(fleet, "chat", "node-b", via_deployments=False)["stopped"] == [res["netns"]]
        assert not pid_alive(res["pid"]) and pid_alive(w.pid)
        with pytest.raises(Exception, match="no replica nope of chat on node-b"):
            scale_down(fleet, "chat", "node-b", replica="nope", via_deployments=False)
    finally:
        copy.stop()
        subprocess.run(["ip", "netns", "del", res["netns"]])


def test_a_two_tier_workload_of_a_lost_node_comes_back_on_another_from_s3(tmp_path, prefect_harness, demo_worker, s3):
    """The heartbeat flow pushes a two-tier checkpoint (template once, then changed chunks) and
    recover-node brings the workload back on node-b from the bucket, continuing exactly."""
    import os
    import shutil
    import signal

    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover_node
    from ckptflow.models import CheckpointMode

    w, ref = demo_worker("tt", ballast_mib=16), demo_worker("ref", ballast_mib=16)
    # engine: demo, the protocol's server (a vLLM does not serve it: refused at load); vLLM's CRIU options stay
    w.workload = w.workload.model_copy(update={"checkpoint": CheckpointMode.template_sessions, "engine": "demo"})
    fleet = _two_node_fleet(tmp_path, s3, [w.workload], "ckpt-2t-node")
    for x in (w, ref):
        x.complete("a long agent transcript " * 30, 16, "agent")
    first = heartbeat(fleet, force=True)[0]
    assert first["ok"] and first["template_uploaded_bytes"] > 16 << 20, first
    for x in (w, ref):
        x.complete("one more step", 8, "agent")
    second = heartbeat(fleet, force=True)[0]
    assert second["ok"] and "template_uploaded_bytes" not in second and 0 < second["uploaded_bytes"] < 16 << 20

    os.kill(w.pid, signal.SIGKILL)                            # node-a is gone, its store with it
    w.proc.wait()
    shutil.rmtree(tmp_path / "store" / "node-a")
    rows = recover_node(fleet, "node-a", via_deployments=False)
    assert [(r["workload"], r["target"], r["action"]) for r in rows] == \
        [("tt", "node-b", f"restored {second['checkpoint']}")], rows
    assert w.digests() == ref.digests()
    assert w.complete("next step", 24, "agent") == ref.complete("next step", 24, "agent")
