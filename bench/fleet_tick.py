"""Heartbeat ticks over many declared workloads on many nodes, against a real Prefect server.

Usage (after ./scripts/setup.sh):
    .venv/bin/python bench/fleet_tick.py --db postgres --nodes 250 --per-node 20 --runs 5
    .venv/bin/python bench/fleet_tick.py --db postgres --nodes 1000 --per-node 20 --runs 5
    .venv/bin/python bench/fleet_tick.py --db sqlite                     # 50 nodes x 20, one run
    .venv/bin/python bench/fleet_tick.py --db postgres --profile         # cProfile of one tick, nothing recorded

Starts `prefect server start` on 127.0.0.1 with its database on PostgreSQL (a private cluster,
the backing a production Prefect server uses; tests/helpers/postgres.py) or SQLite (a temporary
PREFECT_HOME), writes a fleet file whose workloads all decide `skip` (no-op checkpoints:
short-request traffic), and times the heartbeat flow, which runs each node's batch in a few task runs of node groups.
Every pid file names one live `sleep` process, so each workload is found running (a missing
process is a "worker gone" alert and a failed heartbeat).

One untimed warm-up tick pays imports and the first API round trips; then ``--runs`` ticks are
timed one after another against the same server (its database grows as a production one
does). Targets on the shared 2-core machine: 5,000 workloads / 250 nodes <= 10 s in every run,
20,000 / 1,000 <= 30 s. Each timed tick is its own row in bench/results/fleet_tick.json (every
run kept, with its date, command and the machine's load average before and after it: other
work on the machine moves these figures), and the table goes to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "helpers"))
from _common import append_results, md_table, record_run  # noqa: E402
from postgres import Postgres  # noqa: E402
from prefect_server import start_prefect_server  # noqa: E402

PORT, PG_PORT = 4299, 54399
RUN = r"""
import cProfile, io, json, os, pstats, sys, time
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from ckptflow.flows.heartbeat import NODE_GROUPS, heartbeat
fleet_file, runs, profile = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
    heartbeat(fleet_file)                       # warm-up: imports, first API round trips
    for _ in range(runs):
        print("tick", flush=True)               # the bench samples the server's CPU time here
        load0 = os.getloadavg()
        c0 = os.times()
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        rows = heartbeat(fleet_file)
        if prof:
            prof.disable()
        dt = time.perf_counter() - t0
        c1 = os.times()
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
            print(s.getvalue(), file=sys.stderr)
        print(json.dumps({"seconds": round(dt, 3), "rows": len(rows),
                          "checkpoints": sum(1 for r in rows if r.get("checkpoint")),
                          "task_runs": -(-n // -(-n // NODE_GROUPS)) if (n := len({r["node"] for r in rows})) else 0,
                          "client_cpu_s": round(c1.user + c1.system - c0.user - c0.system, 2),
                          "loadavg_before": [round(x, 2) for x in load0],
                          "loadavg_after": [round(x, 2) for x in os.getloadavg()]}), flush=True)
"""


def _cpu_s(root: int | None) -> float:
    """User + system CPU seconds of ``root`` and its descendants now (the server's uvicorn,
    postgres's backends), with those of descendants that exited and were reaped."""
    if root is None:
        return 0.0
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", choices=["postgres", "sqlite"], default="postgres",
                    help="the Prefect server's database (default: postgres, as in production)")
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--per-node", type=int, default=20)
    ap.add_argument("--runs", type=int, default=1, help="timed ticks, each kept as its own row")
    ap.add_argument("--target", type=float, default=None,
                    help="seconds a tick may take (default: 10 up to 5,000 workloads, 30 above)")
    ap.add_argument("--profile", action="store_true",
                    help="print a cProfile of each timed tick to stderr; records nothing")
    ap.add_argument("--no-record", action="store_true",
                    help="print the ticks only (trying a change); the README cites recorded runs only")
    a = ap.parse_args()
    n_workloads = a.nodes * a.per_node
    target = a.target if a.target is not None else (10.0 if n_workloads <= 5000 else 30.0)
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-tick-"))
    live = subprocess.Popen(["sleep", "3600"])  # the process every workload's pid file names
    nodes = [{"name": f"node-{i:04d}", "work_pool": f"node-{i:04d}", "gpu_class": "H200"} for i in range(a.nodes)]
    workloads = [{"name": f"w-{i:04d}-{j:02d}", "node": f"node-{i:04d}", "traffic": "short_requests",
                  "find": {"pid_file": str(tmp / f"w-{i}-{j}.pid")}} for i in range(a.nodes) for j in range(a.per_node)]
    for w in workloads:
        Path(w["find"]["pid_file"]).write_text(str(live.pid))
    fleet = tmp / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"fleet": "tick", "storage": {"kind": "local", "path": str(tmp / "store")},
                                     "nodes": nodes, "workloads": workloads}))
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    pg = None
    results: list[dict] = []
    try:
        if a.db == "postgres":
            pg = Postgres(PG_PORT).start()
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = pg.url
        server = start_prefect_server(env, PORT)
        try:
            proc = subprocess.Popen([sys.executable, "-c", RUN, str(fleet), str(a.runs), "1" if a.profile else "0"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE if not a.profile else None,
                                    text=True, env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{PORT}/api"})
            pg_root = int((pg.data / "postmaster.pid").read_text().split()[0]) if pg else None
            cpu0 = (0.0, 0.0)
            for line in proc.stdout:  # each tick is recorded as it ends: a later failure keeps it
                if line.strip() == "tick":
                    cpu0 = (_cpu_s(server.pid), _cpu_s(pg_root))
                    continue
                if not line.startswith("{"):
                    continue
                res = json.loads(line)
                res["server_cpu_s"] = round(_cpu_s(server.pid) - cpu0[0], 2)  # CPU time, not wall
                if pg_root:
                    res["postgres_cpu_s"] = round(_cpu_s(pg_root) - cpu0[1], 2)
                res.update(db=a.db, nodes=a.nodes, workloads=n_workloads, target_s=target,
                           met=res["seconds"] <= target)
                print(f"tick {len(results) + 1}/{a.runs}: {res['seconds']:.2f} s (load {res['loadavg_before'][0]:.2f}; "
                      f"CPU s: client {res['client_cpu_s']}, server {res['server_cpu_s']}, "
                      f"postgres {res.get('postgres_cpu_s', '-')})", flush=True)
                if not (a.profile or a.no_record):
                    record_run("fleet_tick", res)  # every run kept: the spread on a shared machine is large
                results.append(res)
            err = proc.stderr.read() if proc.stderr else ""
            if proc.wait(timeout=3600) != 0:
                raise RuntimeError(err[-3000:])
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    finally:
        if pg is not None:
            pg.stop()
        live.kill()
        live.wait()
        shutil.rmtree(tmp, ignore_errors=True)  # a node's tmp must not collect ticks
    table = md_table(["run", "db", "nodes", "workloads", "task runs (node groups)", "checkpoints", "seconds",
                      "CPU s client / server / postgres", "load avg (1 min) before", "target"],
                     [[i + 1, a.db, a.nodes, n_workloads, r["task_runs"], r["checkpoints"], round(r["seconds"], 2),
                       f"{r['client_cpu_s']} / {r['server_cpu_s']} / {r.get('postgres_cpu_s', '-')}",
                       r["loadavg_before"][0], f"<= {target:g} s"] for i, r in enumerate(results)])
    print(table)
    if not (a.profile or a.no_record):
        append_results("Heartbeat tick against a real Prefect server (bench/fleet_tick.py)", table,
                       f"Prefect server on {'PostgreSQL' if a.db == 'postgres' else 'SQLite'}, 127.0.0.1; every "
                       "workload decides skip (no-op checkpoints); one untimed warm-up tick, then each timed "
                       "tick against the same server.")
    return 0 if results and all(r["met"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
