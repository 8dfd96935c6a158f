"""One heartbeat tick over 1,000 declared workloads on 50 nodes, against a real Prefect server.

Usage (after ./scripts/setup.sh):   .venv/bin/python bench/fleet_tick.py [--nodes 50 --per-node 20]

Starts `prefect server start` on 127.0.0.1 (SQLite in a temporary PREFECT_HOME), writes a
fleet file whose workloads all decide `skip` (no-op checkpoints: short-request traffic), and
times the heartbeat flow, which runs one task per node batch. Every pid file names one live
`sleep` process, so each workload is found running (a missing process is a "worker gone"
alert and a failed heartbeat). Target: <= 10 s on the 2-core machine, also for
`--nodes 250 --per-node 20`. Appends the run to bench/results/fleet_tick.json (every run kept, with
its date and command) and to bench/RESULTS.md.
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

import yaml

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "helpers"))
from _common import append_results, md_table, record_run  # noqa: E402
from prefect_server import start_prefect_server  # noqa: E402

PORT = 4299
RUN = r"""
import json, sys, time
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from ckptflow.flows.heartbeat import heartbeat
with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
    heartbeat(sys.argv[1])                       # warm-up: imports, first API round trips
    t0 = time.perf_counter()
    rows = heartbeat(sys.argv[1])
    dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "rows": len(rows), "checkpoints": sum(1 for r in rows if r.get("checkpoint"))}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--per-node", type=int, default=20)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-tick-"))
    live = subprocess.Popen(["sleep", "3600"])  # the process every workload's pid file names
    nodes = [{"name": f"node-{i:02d}", "work_pool": f"node-{i:02d}", "gpu_class": "H200"} for i in range(a.nodes)]
    workloads = [{"name": f"w-{i:02d}-{j:02d}", "node": f"node-{i:02d}", "traffic": "short_requests",
                  "find": {"pid_file": str(tmp / f"w-{i}-{j}.pid")}} for i in range(a.nodes) for j in range(a.per_node)]
    for w in workloads:
        Path(w["find"]["pid_file"]).write_text(str(live.pid))
    fleet = tmp / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"fleet": "tick", "storage": {"kind": "local", "path": str(tmp / "store")},
                                     "nodes": nodes, "workloads": workloads}))
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    env.pop("PREFECT_API_URL", None)
    try:
        server = start_prefect_server(env, PORT)
        try:
            out = subprocess.run([sys.executable, "-c", RUN, str(fleet)], capture_output=True, text=True,
                                 timeout=600, env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{PORT}/api"})
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-3000:])
            res = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    finally:
        live.kill()
        live.wait()
        shutil.rmtree(tmp, ignore_errors=True)  # a node's tmp must not collect ticks
    res.update(nodes=a.nodes, workloads=len(workloads), target_s=10, met=res["seconds"] <= 10)
    record_run("fleet_tick", res)  # every run kept: the spread on a shared 2-core machine is large
    table = md_table(["nodes", "workloads", "task runs (node batches)", "checkpoints", "seconds", "target"],
                     [[a.nodes, len(workloads), a.nodes, res["checkpoints"], round(res["seconds"], 2), "<= 10 s"]])
    print(table)
    append_results("Heartbeat tick against a real Prefect server (bench/fleet_tick.py)", table,
                   "Prefect 3.9.1 server on SQLite, 127.0.0.1; every workload decides skip (no-op checkpoints); "
                   "second of two ticks timed (the first pays imports).")
    return 0 if res["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
