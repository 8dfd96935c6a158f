"""Downtime of a fleet-mode migrate of the CPU demo worker, as a client polling it sees it.

Usage (as root, after ./scripts/setup.sh):   .venv/bin/python bench/migrate_downtime.py [--runs 3] [--db postgres]

Starts a real Prefect server on 127.0.0.1 (SQLite in a temporary PREFECT_HOME), SeaweedFS as the
fleet's S3, and two node workers (node-a, node-b) as separate `prefect worker start` processes,
each with its own PREFECT_HOME (nodes share no disk) and the environment `ckptflow deploy`
renders into the nodes' systemd units (PREFECT_WORKER_QUERY_SECONDS, CKPTFLOW_NODE). Deploys the
fleet with `ckptflow deploy`, starts the CPU demo worker on node-a, and then, ``--runs`` times,
moves it to the other node with the real CLI, `prefect deployment run migrate/<fleet>`, while a
client asks GET /health every 50 ms. Downtime = last answer before the move to first answer
after it. Phases: dump, upload, download and restore from the steps' own timings; the Prefect
hand-off is the rest. The tasks' wall-clock stamps (pushed, label set, checkpoint known to the
target, restored) and the flow-run timestamps (from the API) place each step against the
client's last answer. The worker's session must come back byte for byte (its digest).
The Prefect server runs on PostgreSQL, as a production server does (``--db sqlite``: SQLite, as
the rows before 2026-12-01 05:00 did; there every server write waits on its one write lock,
measured ~2 s per write while a move's steps record their states).

Target: downtime <= 5 s (#25 item 2; before: ~15 s, ~9 s of it waiting for the next node's
worker). Appends to bench/RESULTS.md and bench/results/migrate_downtime.json (every run kept,
with the load average: the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from _common import append_results, md_table, record_run  # noqa: E402
from postgres import Postgres  # noqa: E402
from prefect_server import start_prefect_server  # noqa: E402
from seaweed import SeaweedS3  # noqa: E402

TARGET_S = 5.0
POLL_S = 0.05
# A dump fails when it freezes the worker with a poll's connection accepted or still in the
# listen queue (CRIU: "Connected TCP socket", "In-flight connection"; measured: 2 of 8 dumps
# with a 20 ms poll). The worker runs on; the move is tried again, and the failure is kept.
ATTEMPTS = 4
FLEET = "mig-downtime"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Poller(threading.Thread):
    """Asks the worker's health URL every POLL_S; keeps the wall-clock time of every answer.
    A request that hangs (in flight across the dump) is dropped after 1 s and asked again."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.answers, self.errors, self.stop = url, [], [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            t = time.time()
            try:
                with urllib.request.urlopen(self.url, timeout=1) as r:
                    if r.status == 200:
                        self.answers.append(time.time())
            except OSError as e:  # what the client saw while the worker was away
                reason = getattr(e, "reason", e)
                self.errors.append((t, type(reason).__name__))
            time.sleep(POLL_S)

    def errors_between(self, a: float, b: float) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for t, k in list(self.errors):
            if a <= t <= b:
                kinds[k] = kinds.get(k, 0) + 1
        return kinds

    def gap(self, after: float, until: float) -> tuple[float, float]:
        """The longest silence between two answers that overlaps [after, until]: (last before, first after)."""
        a = list(self.answers)
        best = (0.0, 0.0)
        for x, y in zip(a, a[1:]):
            if y >= after and x <= until and y - x > best[1] - best[0]:
                best = (x, y)
        return best


class MoveFailed(RuntimeError):
    """The migrate flow run failed (the bench checks the worker still answers, then tries again)."""


def _digests(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/sessions/digests", timeout=10) as r:
        return json.loads(r.read())["sessions"]


def _complete(port: int, prompt: str, n: int, sid: str) -> str:
    from ckptflow.demo import launch

    return launch.complete(port, prompt, n, sid)


def _child_runs(client, parent_id: str, source: str, target: str) -> dict[str, object]:
    """The node-step flow runs a migrate run started, by their idempotency keys (flows.steps.step_key)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterIdempotencyKey

    keys = {"migrate_out": f"{parent_id}-migrate_out-chat-{source}", "migrate_in": f"{parent_id}-migrate_in-chat-{target}"}
    runs = {fr.idempotency_key: fr for fr in client.read_flow_runs(flow_run_filter=FlowRunFilter(
        idempotency_key=FlowRunFilterIdempotencyKey(any_=list(keys.values()))))}
    return {a: runs.get(k) for a, k in keys.items()}


def _migrate_once(env, poller, port, target) -> dict:
    from prefect.client.orchestration import get_client

    load = os.getloadavg()
    t_trigger = time.time()
    out = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deployment", "run", f"migrate/{FLEET}",
                          "--param", "workload=chat", "--param", f"target_node={target}"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"prefect deployment run failed: {out.stdout}{out.stderr}")
    run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", out.stdout).group(1)
    with get_client(sync_client=True) as c:
        deadline = time.time() + 600
        while True:
            fr = c.read_flow_run(run_id)
            if fr.state and fr.state.is_final():
                break
            if time.time() > deadline:
                raise RuntimeError(f"migrate {run_id} still {fr.state.name} after 600 s")
            time.sleep(0.2)
        if not fr.state.is_completed():
            raise MoveFailed(f"migrate {run_id} ended {fr.state.name}: {(fr.state.message or '').splitlines()[0]}")
        res = fr.state.result()
        kids = _child_runs(c, run_id, res["source"], res["target"])
    t_done = time.time()
    deadline = time.time() + 30
    while not poller.answers or poller.answers[-1] < t_done:   # the worker answers again
        if time.time() > deadline:
            raise RuntimeError("the worker did not answer after the migrate completed")
        time.sleep(0.05)
    last, first = poller.gap(t_trigger, t_done)
    o, i = res["out"], res["in"]
    dump = o["timings"].get("pause", 0.0)
    upload = o.get("seconds", 0.0)
    download = i.get("seconds", 0.0)
    restore = i["timings"].get("restore_and_checksum", i["timings"].get("restore", 0.0)) + i["timings"].get("health", 0.0)
    down = first - last
    so, ti = kids["migrate_out"], kids["migrate_in"]

    def ts(x):
        return x.timestamp() if x else None

    def at(step: dict, key: str):  # the tasks' own wall-clock stamps (tasks.move), relative to the last answer
        t = (step.get("at") or {}).get(key)
        return round(t - last, 3) if t else None

    row = {"source": res["source"], "target": res["target"], "checkpoint": res["checkpoint"],
           "downtime_s": round(down, 3), "dump_s": round(dump, 3), "upload_s": round(upload, 3),
           "download_s": round(download, 3), "restore_s": round(restore, 3),
           "handoff_s": round(down - dump - upload - download - restore, 3),
           "checkpoint_timings": o["timings"], "restore_timings": i["timings"], "bytes": o.get("bytes"), "uploaded_bytes": o.get("uploaded_bytes"),
           "downloaded_bytes": i.get("downloaded_bytes"),
           # Flow-run timestamps relative to the last answer before the move (the dump's start).
           "target_step_running_s": round(ts(ti.start_time) - last, 3) if ti and ti.start_time else None,
           "source_step_started_s": round(ts(so.start_time) - last, 3) if so and so.start_time else None,
           "source_step_ended_s": round(ts(so.end_time) - last, 3) if so and so.end_time else None,
           "target_step_ended_s": round(ts(ti.end_time) - last, 3) if ti and ti.end_time else None,
           "pushed_s": at(o, "pushed"), "published_s": at(o, "published"),
           "checkpoint_known_s": at(i, "checkpoint_known"), "restored_s": at(i, "restored"),
           "client_errors": poller.errors_between(last, first),
           "first_answer_s": round(down, 3),
           "migrate_total_s": round(t_done - t_trigger, 3),
           "loadavg": [round(x, 2) for x in load], "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3, help="migrations, alternating node-a -> node-b -> node-a")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    ap.add_argument("--db", choices=["postgres", "sqlite"], default="postgres",
                    help="the Prefect server's database: PostgreSQL (default: what a production server and "
                         "tests/test_fleet_mode.py use; tests/helpers/postgres.py) or SQLite (rows before "
                         "2026-12-01 05:00 without a db field)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (CRIU)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-migdown-"))
    procs: list[subprocess.Popen] = []
    s3 = worker = pg = None
    rows: list[dict] = []
    failed: list[dict] = []
    try:
        (tmp / "s3").mkdir()
        s3 = SeaweedS3(tmp / "s3")
        port = _free_port()
        api = f"http://127.0.0.1:{port}/api"
        env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_API_URL": api, "PREFECT_LOGGING_LEVEL": "INFO", "DO_NOT_TRACK": "1"}
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        if a.db == "postgres":
            pg = Postgres(_free_port()).start()
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = pg.url
        os.environ.update({k: env[k] for k in ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED")})
        procs.append(start_prefect_server(env, port, open(tmp / "server.log", "w"), timeout_s=600))  # a shared machine

        from ckptflow.demo import launch

        wport = _free_port()
        pid_file = tmp / "chat.pid"
        worker = launch.start_worker(wport, pid_file)
        threading.Thread(target=worker.wait, daemon=True).start()  # reap it when the dump ends it
        w = launch.demo_workload("chat", wport, pid_file)
        fleet = tmp / "fleet.yaml"
        fleet.write_text(yaml.safe_dump({
            "fleet": FLEET, "storage": {"kind": "s3", "path": str(tmp / "store" / "{node}"),
                                        "bucket": s3.bucket(FLEET), "endpoint_url": s3.endpoint},
            "nodes": [{"name": "node-a", "work_pool": "node-a"}, {"name": "node-b", "work_pool": "node-b"}],
            "workloads": [w.model_dump(mode="json", exclude_none=True) | {"node": "node-a"}]}))
        out = subprocess.run([sys.executable, "-m", "ckptflow", "deploy", str(fleet), "--all-nodes-here"],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"ckptflow deploy failed: {out.stdout}{out.stderr}")
        for node in ("node-a", "node-b"):
            unit = tmp / f"{FLEET}.workers" / "systemd" / f"ckptflow-prefect-worker-{FLEET}-{node}.service"
            unit_env = dict(line.split("=", 1)[1].split("=", 1) for line in unit.read_text().splitlines()
                            if line.startswith("Environment="))
            wenv = {**env, "PREFECT_HOME": str(tmp / f"home-{node}"), "CKPTFLOW_NODE": node,
                    "PREFECT_WORKER_QUERY_SECONDS": unit_env["PREFECT_WORKER_QUERY_SECONDS"]}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "prefect", "--no-prompt", "worker", "start", "--pool", node, "--name", node,
                 "--type", "process"], env=wenv, cwd=ROOT, stdout=open(tmp / f"worker-{node}.log", "w"),
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)))
        query_s = unit_env["PREFECT_WORKER_QUERY_SECONDS"]
        _complete(wport, "a long agent session that must survive every move " * 10, 16, "s")
        before = _digests(wport)
        poller = Poller(f"http://127.0.0.1:{wport}/health")
        poller.start()
        time.sleep(2)
        src = "node-a"
        for n in range(a.runs):
            target = "node-b" if src == "node-a" else "node-a"
            for attempt in range(1, ATTEMPTS + 1):
                load = os.getloadavg()
                try:
                    row = _migrate_once(env, poller, wport, target)
                    break
                except MoveFailed as e:
                    seen = len(poller.answers)
                    time.sleep(1)
                    if len(poller.answers) == seen:
                        raise RuntimeError(f"{e}; and the worker no longer answers") from e
                    failed.append({"source": src, "target": target, "attempt": attempt, "failed": str(e),
                                   "loadavg": [round(x, 2) for x in load]})
                    print(json.dumps(failed[-1]), flush=True)
            else:
                raise RuntimeError(f"{ATTEMPTS} attempts to move the worker to {target} failed")
            row["attempt"] = attempt
            row["session_intact"] = _digests(wport) == before
            row["worker_query_s"] = float(query_s)
            row["db"] = a.db
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not row["session_intact"]:
                raise RuntimeError("the session did not come back intact")
            src = target
            time.sleep(3)
        poller.stop.set()
    finally:
        if worker is not None:
            try:
                pid = int(pid_file.read_text())
                if "ckptflow.demo.worker" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
        for p in reversed(procs):  # workers before the server
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if s3 is not None:
            s3.stop()
        if pg is not None:
            pg.stop()
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if not rows:
        return 1
    # Which hand-off the rows measured (before RESULTS.md is appended to, which would read as dirty).
    code = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    headers = ["move", "downtime s", "dump s", "upload s", "download s", "restore s", "hand-off s",
               "pushed at s", "label set at s", "target knew at s", "restored at s", "target step running at s",
               "migrate total s", "load (1 min)"]
    table = md_table(headers, [[f"{r['source']} → {r['target']}", r["downtime_s"], r["dump_s"], r["upload_s"],
                                r["download_s"], r["restore_s"], r["handoff_s"], r["pushed_s"], r["published_s"],
                                r["checkpoint_known_s"], r["restored_s"], r["target_step_running_s"],
                                r["migrate_total_s"], r["loadavg"][0]] for r in rows])
    print(table)
    worst = max(r["downtime_s"] for r in rows)
    notes = (f"Downtime: last answer before the move to first answer after it, by a client asking GET /health every "
             f"{POLL_S * 1000:.0f} ms. Node workers poll every {rows[0]['worker_query_s']:g} s (the rendered units). "
             f"Prefect server on {'PostgreSQL' if a.db == 'postgres' else 'SQLite'}. "
             "Hand-off = downtime − dump − upload − download − restore (the checkpoint label's write and the "
             "target's read of it, the C/R slots, the stores' bookkeeping). 'at s': relative to the last answer "
             "before the move (negative: before the dump): when migrate_out had pushed and labelled its flow "
             "run with the checkpoint, when the target's migrate_in knew it and had restored (the tasks' own "
             "clocks), when the target's step ran (flow-run timestamp). "
             f"Worst {worst:.2f} s against a target of {TARGET_S:g} s."
             + (f" {len(failed)} attempt(s) failed and were tried again (the dump froze the worker with a poll's "
                "connection open; the worker ran on): " + "; ".join(f["failed"][:160] for f in failed)
                if failed else ""))
    append_results("Fleet-mode migrate downtime (CPU demo worker, `prefect deployment run migrate/...`)", table, notes)
    for r in rows + failed:
        r["code"] = code
    for r in rows:
        record_run("migrate_downtime", {**r, "target_s": TARGET_S, "met": r["downtime_s"] <= TARGET_S})
    for r in failed:
        record_run("migrate_downtime", {**r, "target_s": TARGET_S, "met": False})
    return 0 if worst <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
