"""Why a CUDA-checkpointed copy restored beside its original (criu-ns: own PID namespace) is
unknown to the driver: ask the driver about the copy from every vantage point and record what
each answers (issue #13 item 1: "find what differs ... or name exactly why not").

Usage (GPU node, root; CRIU + criu-ns from the bundle):
    bench/on_device.sh python3 bench/gpu_pidns_probe.py
Appends the run to bench/results/gpu_pidns.json (every run kept) and to bench/RESULTS.md.

Vantage points, for the copy whose host PID is H and in-namespace PID is P:
  host            cuCheckpointProcessGetState(H) from this process (the runner's view)
  pidns           from a process inside the copy's PID namespace, asking about P
  pidns+net+mnt   the same, also inside its network and mount namespaces
and a second copy restored in a PID namespace only (no network namespace), original killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import append_results, md_table, record_run  # noqa: E402

from ckptflow.demo import launch  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.runners.verify import del_netns, new_netns  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

PORT = 18671
_ASK = """
import json, sys
from cuda.bindings import driver as d
d.cuInit(0)
pid = int(sys.argv[1])
out = {}
err, st = d.cuCheckpointProcessGetState(pid)
out["state"] = [d.cuGetErrorName(err)[1].decode(), None if st is None else int(st)]
if int(err) == 0 and sys.argv[2] == "restore":
    out["restore"] = d.cuGetErrorName(d.cuCheckpointProcessRestore(pid, None)[0])[1].decode()
    out["unlock"] = d.cuGetErrorName(d.cuCheckpointProcessUnlock(pid, None)[0])[1].decode()
print(json.dumps(out))
"""


def ask(pid: int, enter: list[str], restore: bool = False) -> dict:
    cmd = [*enter, sys.executable, "-c", _ASK, str(pid), "restore" if restore else "state"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": (r.stderr.strip() or r.stdout.strip())[-300:]}


def ns_pid(host_pid: int) -> int:
    """The PID the process has inside its own (innermost) PID namespace."""
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return host_pid


def main() -> int:
    os.environ.setdefault("CKPTFLOW_CRIU_NETWORK_LOCK", "skip")
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-pidns-", dir="/dev/shm"))
    pid_file = tmp / "w.pid"
    proc = launch.start_gpu_worker(PORT, pid_file, ballast_gib=1)
    launch.complete(PORT, "hello " * 50, 8, "s0")
    w = launch.gpu_workload("pidns", PORT, pid_file, footprint_gib=3)
    node = NodeRunner(LocalStore(tmp / "store"))
    rows, out = [], {}
    try:
        m = node.checkpoint(w)                     # CUDA checkpoint + CRIU dump, original serves on
        images = node.store.images_dir(m)
        own = int(pid_file.read_text())
        out["original"] = {"host_pid": own, "state": ask(own, [])}
        ns = new_netns("ckptflow-probe")
        try:
            copy = node.criu.restore_beside(images, netns=ns)
            try:
                h, p = copy.pid, ns_pid(copy.pid)
                out["copy_netns"] = {"host_pid": h, "ns_pid": p, "nspid_line": [
                    ln for ln in Path(f"/proc/{h}/status").read_text().splitlines() if ln.startswith("NSpid")]}
                for name, enter, pid in (("host", [], h),
                                         ("pidns", ["nsenter", "-t", str(h), "-p"], p),
                                         ("pidns+net+mnt", ["nsenter", "-t", str(h), "-p", "-n", "-m"], p),
                                         ("pidns+net+mnt, host pid", ["nsenter", "-t", str(h), "-p", "-n", "-m"], h)):
                    got = ask(pid, enter, restore=True)
                    out["copy_netns"][name] = got
                    rows.append(["copy in PID + net namespace", name, pid, json.dumps(got)])
            finally:
                copy.stop()
        finally:
            del_netns(ns)
        os.kill(own, signal.SIGKILL)               # second variant: the original gone, no net namespace
        node.criu.wait_pid_free(own)
        copy = node.criu.restore_beside(images, netns=None)
        try:
            h, p = copy.pid, ns_pid(copy.pid)
            out["copy_pidns_only"] = {"host_pid": h, "ns_pid": p}
            for name, enter, pid in (("host", [], h), ("pidns", ["nsenter", "-t", str(h), "-p"], p)):
                got = ask(pid, enter, restore=True)
                out["copy_pidns_only"][name] = got
                rows.append(["copy in PID namespace only (original killed)", name, pid, json.dumps(got)])
            time.sleep(0.5)
            try:
                out["copy_pidns_only"]["health"] = launch.http_json(f"http://127.0.0.1:{PORT}/health", timeout_s=5)
            except Exception as e:  # noqa: BLE001 - recorded, this is a probe
                out["copy_pidns_only"]["health"] = str(e)[:200]
        finally:
            copy.stop()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.close()
    print(json.dumps(out, indent=1))
    record_run("gpu_pidns", out)  # every run kept, with date and command
    table = md_table(["copy", "asked from", "PID asked about", "driver answers"], rows)
    print(table)
    append_results("A CUDA-checkpointed copy in its own PID namespace, asked from each vantage point "
                   "(bench/gpu_pidns_probe.py)", table,
                   f"original: {json.dumps(out.get('original'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
