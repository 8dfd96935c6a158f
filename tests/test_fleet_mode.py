"""Fleet mode on one machine: a real Prefect server on 127.0.0.1 with PostgreSQL as its
database, one process work pool and worker per node (node-a, node-b), each worker with its own
PREFECT_HOME (nodes share no disk: step results travel through the fleet's S3Bucket results
block), SeaweedFS as S3, deployments from `ckptflow deploy`.

migrate, drain and recover-node run as deployments; their node steps run on each node's
worker, and the long session continues exactly on node-b. The workers poll every second, as
the units `ckptflow deploy` renders do (PREFECT_WORKER_QUERY_SECONDS).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import free_port
from postgres import Postgres
from prefect_server import start_prefect_server
from ckptflow.models import TrafficClass

pytestmark = [pytest.mark.criu, pytest.mark.slow]
ROOT = Path(__file__).parent.parent


def _default_sigint():
    # A worker started from a script inherits SIGINT ignored and then ignores SIGTERM too.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def prefect_fleet(tmp_path_factory, s3):
    tmp = tmp_path_factory.mktemp("fleet")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_WORKER_QUERY_SECONDS": "1",
           "PREFECT_LOGGING_LEVEL": "INFO", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
    logs = open(tmp / "server.log", "w")
    pg = Postgres(free_port()).start()
    procs = []
    try:
        procs.append(start_prefect_server({**env, "PREFECT_API_DATABASE_CONNECTION_URL": pg.url}, port, logs))
        for pool in ("node-a", "node-b"):
            subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "work-pool", "create", pool,
                            "--type", "process"], env=env, check=True, capture_output=True)
            wl = open(tmp / f"worker-{pool}.log", "w")
            home = tmp / f"home-{pool}"   # its own local result storage: nothing shared by disk
            procs.append(subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool],
                                          env={**env, "PREFECT_HOME": str(home)}, cwd=ROOT, stdout=wl,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=_default_sigint))
        yield {"env": env, "tmp": tmp, "pg": pg}
    finally:
        for p in reversed(procs):  # workers before the server
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)
        pg.stop()


def _fleet(tmp, s3, workloads, bucket, **extra):
    f = tmp / f"fleet-{bucket}.yaml"
    f.write_text(yaml.safe_dump({**extra,
        "fleet": bucket, "storage": {"kind": "s3", "path": str(tmp / "store" / "{node}"),
                                     "bucket": s3.bucket(bucket), "endpoint_url": s3.endpoint},
        "nodes": [{"name": "node-a", "work_pool": "node-a"}, {"name": "node-b", "work_pool": "node-b"}],
        "workloads": [w.model_dump(mode="json", exclude_none=True) | {"node": "node-a"} for w in workloads]}))
    return f


_RUN = r"""
import json, sys
from prefect.deployments import run_deployment
fr = run_deployment(name=sys.argv[1], parameters=json.loads(sys.argv[2]), timeout=300)
out = {"state": fr.state.name, "result": fr.state.result(raise_on_failure=False)
       if fr.state.is_completed() else str(fr.state.message)}
if not fr.state.is_completed():  # a failed fleet flow's report is its artifact
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    with get_client(sync_client=True) as c:
        out["artifacts"] = [a.data for a in c.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))]
print(json.dumps(out, default=str))
"""


def _reap_in_background(*workers):
    """The node steps run in other processes; as the workers' parent, reap them when they exit
    (what a supervisor does), or their PIDs stay taken as zombies."""
    import threading

    for w in workers:
        threading.Thread(target=w.proc.wait, daemon=True).start()


def _deploy_and_run(prefect_fleet, fleet_file, deployment, params, expect="Completed"):
    env = prefect_fleet["env"]
    # node-a and node-b are this machine: the loopback API URL is right for their workers.
    out = subprocess.run([sys.executable, "-m", "ckptflow", "deploy", str(fleet_file), "--all-nodes-here"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-c", _RUN, deployment, json.dumps(params)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    logs = "".join(p.read_text()[-2000:] for p in prefect_fleet["tmp"].glob("worker-*.log"))
    assert res["state"] == expect, f"{res}\n{logs}"
    return res["result"] if expect == "Completed" else res


def test_migrate_deployment_moves_a_long_session_to_node_b(prefect_fleet, demo_worker, s3):
    w, ref = demo_worker("chat"), demo_worker("ref")
    for x in (w, ref):
        x.complete("an agent session that must survive the move " * 25, 16, "s")
    _reap_in_background(w)
    fleet = _fleet(prefect_fleet["tmp"], s3, [w.workload], "fleet-mig")
    res = _deploy_and_run(prefect_fleet, fleet, "migrate/fleet-mig",
                          {"workload": "chat", "target_node": "node-b"})
    assert res["source"] == "node-a" and res["target"] == "node-b"
    assert res["in"]["downloaded_bytes"] == res["out"]["bytes"]          # it came through S3
    assert (prefect_fleet["tmp"] / "store" / "node-b" / "chat" / res["checkpoint"] / "manifest.json").exists()
    assert w.digests() == ref.digests()
    assert w.complete("and now?", 32, "s") == ref.complete("and now?", 32, "s")
    # The server kept it all in PostgreSQL; the steps' results went through the bucket.
    pg = prefect_fleet["pg"]
    assert int(pg.sql("select count(*) from deployment where name = 'fleet-mig'")) == 7
    assert int(pg.sql("select count(*) from flow_run where state_type = 'COMPLETED'")) >= 3
    keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket="fleet-mig", Prefix="ckptflow/prefect-results/")
            .get("Contents", [])]
    assert keys, "no flow result in the fleet's S3 results block"
    # node-b's step ran before node-a's checkpoint began (flows.steps.move): its worker's poll and
    # its process start were not downtime; the checkpoint went from one step to the other.
    ran_first = pg.sql("select (select min(start_time) from flow_run where idempotency_key like "
                       "'%-migrate_in-chat-node-b') < (select min(start_time) from task_run where name like "
                       "'migrate-out%')")
    assert ran_first == "t", ran_first
    assert pg.sql("select parameters->>'checkpoint_from' from flow_run where idempotency_key like "
                  "'%-migrate_in-chat-node-b'").endswith("-migrate_out-chat-node-a")


def test_drain_deployment_empties_node_a(prefect_fleet, demo_worker, s3):
    long_w, short_w, ref = demo_worker("chat"), demo_worker("api"), demo_worker("ref")
    short_w.workload = short_w.workload.model_copy(update={"traffic": TrafficClass.short_requests})
    for x in (long_w, ref):
        x.complete("a long session " * 30, 16, "s")
    _reap_in_background(long_w, short_w)
    fleet = _fleet(prefect_fleet["tmp"], s3, [long_w.workload, short_w.workload], "fleet-drain")
    rows = {r["workload"]: r for r in _deploy_and_run(prefect_fleet, fleet, "drain/fleet-drain", {"node": "node-a"})}
    assert rows["chat"]["action"] == "migrated" and rows["chat"]["target"] == "node-b"
    assert rows["api"]["action"] == "stopped (short requests)"
    with pytest.raises(OSError):                          # stopped: nothing answers on its port
        short_w.complete("still there?", 4)
    assert long_w.complete("go on", 24, "s") == ref.complete("go on", 24, "s")


def test_recover_node_deployment_brings_node_a_workloads_back_on_node_b(prefect_fleet, demo_worker, s3):
    import shutil

    w, ref, old = demo_worker("chat"), demo_worker("ref"), demo_worker("old")
    for x in (w, ref):
        x.complete("a session on a node that is about to fail " * 20, 16, "s")
    _reap_in_background(w, old)
    # The control flows run off node-a (the lost node): here on node-b's pool.
    # A second workload of node-a never had a checkpoint nor a start command: it cannot come back,
    # and the reason travels from node-b's step to the fleet flow as the typed error it was.
    # Its own URLs: a fleet file where two workloads share one is refused at load.
    port = free_port()
    ghost = w.workload.model_copy(update={"name": "ghost", "start_command": None, "find": w.workload.find.model_copy(
        update={"pid_file": str(prefect_fleet["tmp"] / "ghost.pid")}), **{
        k: f"http://127.0.0.1:{port}/{k}" for k in ("health_url", "metrics_url", "probe_url") if getattr(w.workload, k)},
        **({"golden": w.workload.golden.model_copy(update={"url": f"http://127.0.0.1:{port}/golden"})}
           if w.workload.golden else {})})
    # A third one has a checkpoint of an engine version it no longer runs: IncompatibleCheckpoint
    # (which takes no plain message) must reach the fleet flow typed, with the differing field.
    stale = old.workload.model_copy(update={"start_command": None})
    fleet = _fleet(prefect_fleet["tmp"], s3, [w.workload, ghost, stale], "fleet-lost", control_pool="node-b")
    out = subprocess.run([sys.executable, "-m", "ckptflow", "heartbeat", str(fleet), "--force", "--workload", "chat",
                          "--workload", "old"],
                         env=prefect_fleet["env"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    os.kill(w.pid, signal.SIGKILL)                                     # node-a: process and disk gone
    os.kill(old.pid, signal.SIGKILL)
    shutil.rmtree(prefect_fleet["tmp"] / "store" / "node-a")
    fleet = _fleet(prefect_fleet["tmp"], s3, [w.workload, ghost, stale.model_copy(update={"engine_version": "v2"})],
                   "fleet-lost", control_pool="node-b")
    # Two of three did not come back: the run fails (a green recovery means all serve again),
    # its message names them, and its report has every row.
    res = _deploy_and_run(prefect_fleet, fleet, "recover-node/fleet-lost", {"node": "node-a"}, expect="Failed")
    assert "NotRecovered" in res["result"] and "2 of 3 workload(s) did not come back: ghost (" in res["result"], res
    [report] = [a for a in res["artifacts"] if "Recovery of lost node node-a" in a]
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:5]] for ln in report.splitlines()
            if ln.startswith("| ") and not ln.startswith("| workload")}
    assert rows["chat"][0].startswith("restored ") and rows["chat"][1] == "node-b"
    assert rows["ghost"][:2] == ["FAILED", "node-b"] and rows["ghost"][2].startswith("workload ghost has no valid checkpoint")
    assert rows["old"][:2] == ["FAILED", "node-b"] and rows["old"][2].startswith("checkpoint ")
    assert "is incompatible with this node: engine_version: 'demo' -> 'v2'" in rows["old"][2], rows
    assert w.digests() == ref.digests()
    assert w.complete("still there?", 24, "s") == ref.complete("still there?", 24, "s")
