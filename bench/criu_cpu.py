"""CRIU dump and restore throughput of a CPU worker holding 256 MiB, 1 GiB and 4 GiB.

Usage (as root, after ./scripts/setup.sh):
    .venv/bin/python bench/criu_cpu.py [--sizes 256,1024,4096] [--dir /var/tmp] [--repeat 2]

Per size: heartbeat dump (--leave-running), dump with exit, restore (detached, PID reused),
image bytes, and the ballast digest checked equal after restore. Appends the run to
bench/results/criu_cpu.json (every run kept) and a table to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import append_results, md_table, record_run  # noqa: E402

from ckptflow.demo import launch  # noqa: E402
from ckptflow.runners.criu import CriuRunner  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

PORT = 18301


def run_size(mib: int, root: Path, repeat: int) -> dict:
    criu = CriuRunner()
    store = LocalStore(root / f"store-{mib}")
    pid_file = root / f"w{mib}.pid"
    proc = launch.start_worker(PORT, pid_file, ballast_mib=mib, timeout_s=120)
    w = launch.demo_workload(f"bench-{mib}", PORT, pid_file)
    url = f"http://127.0.0.1:{PORT}/v1/ballast/digest"
    want = launch.http_json(url, timeout_s=120)["digest"]
    hb, dumps, restores, sizes, ok = [], [], [], [], True
    try:
        for _ in range(repeat):
            p = store.begin(w.name, node="bench")
            hb.append(criu.dump(w, p.images_dir, leave_running=True).seconds)
            shutil.rmtree(p.dir)
            p = store.begin(w.name, node="bench")
            res = criu.dump(w, p.images_dir, leave_running=False)
            dumps.append(res.seconds)
            m = store.commit(p, pid=res.pid)
            sizes.append(m.bytes)
            criu.wait_pid_free(res.pid)  # init's reaping delay is not CRIU's restore time
            t0 = time.perf_counter()
            criu.restore(store.images_dir(m), old_pid=res.pid)
            restores.append(time.perf_counter() - t0)
            ok &= launch.http_json(url, timeout_s=120)["digest"] == want
            store.delete(m)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass
        criu.close()
    gib = statistics.median(sizes) / 2**30
    med = statistics.median
    return {"ballast_mib": mib, "image_gib": round(gib, 3), "heartbeat_dump_s": round(med(hb), 3),
            "dump_s": round(med(dumps), 3), "restore_s": round(med(restores), 3),
            "dump_gib_s": round(gib / med(dumps), 2), "restore_gib_s": round(gib / med(restores), 2),
            "memory_equal_after_restore": ok, "repeat": repeat}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument("--dir", default="/var/tmp", help="where images are written (a disk, not tmpfs)")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckptflow-bench-", dir=a.dir))
    try:
        rows = [run_size(int(s), root, a.repeat) for s in a.sizes.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record_run("criu_cpu", {"images_on": a.dir, "rows": rows})  # every run kept, with date and command
    headers = ["worker holds", "image GiB", "heartbeat dump s", "dump (exit) s", "restore s",
               "dump GiB/s", "restore GiB/s", "memory equal"]
    table = md_table(headers, [[f"{r['ballast_mib']} MiB", r["image_gib"], r["heartbeat_dump_s"], r["dump_s"],
                                r["restore_s"], r["dump_gib_s"], r["restore_gib_s"],
                                r["memory_equal_after_restore"]] for r in rows])
    print(table)
    append_results("CRIU on a CPU worker (bench/criu_cpu.py)", table,
                   f"Images on {a.dir}; median of {a.repeat} runs; restore = `criu restore -d` until it returns.")


if __name__ == "__main__":
    main()
