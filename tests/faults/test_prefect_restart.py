"""The Prefect server restarts while heartbeats run against it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import free_port, write_fleet
from prefect_server import start_prefect_server
from ckptflow.store.local import LocalStore

pytestmark = [pytest.mark.criu, pytest.mark.fault, pytest.mark.slow]

_LOOP = r"""
import json, sys, time
from ckptflow.flows.heartbeat import heartbeat
ok = failed = 0
t_end = time.time() + float(sys.argv[2])
while time.time() < t_end:
    try:
        heartbeat(sys.argv[1], force=True)
        ok += 1
    except BaseException as e:
        failed += 1
        time.sleep(0.5)
print(json.dumps({"ok": ok, "failed": failed}))
"""


def test_fault_prefect_server_restarted_mid_flow(tmp_path, demo_worker):
    w = demo_worker("chat")
    w.complete("state that must survive " * 10, 8, "s")
    digests = w.digests()
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    env.pop("PREFECT_API_URL", None)
    log = open(tmp_path / "server.log", "w")
    server = start_prefect_server(env, port, log)
    try:
        loop = subprocess.Popen([sys.executable, "-c", _LOOP, str(fleet), "40"], stdout=subprocess.PIPE, text=True,
                                env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"})
        time.sleep(8)
        os.killpg(server.pid, signal.SIGKILL)          # the server dies mid-flow...
        server.wait()
        time.sleep(3)
        server = start_prefect_server(env, port, log)  # ...and comes back on the same database
        out, _ = loop.communicate(timeout=240)
        res = json.loads(out.strip().splitlines()[-1])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    assert res["ok"] >= 2, res                           # heartbeats ran before and after
    store = LocalStore(tmp_path / "store")
    listed = store.list("chat")
    assert len(listed) >= res["ok"]
    for m in listed:                                     # nothing listed without its bytes
        store.verify_bytes(m)
    assert w.proc.poll() is None and w.digests() == digests   # the worker never noticed
