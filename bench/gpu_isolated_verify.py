"""Verify a GPU checkpoint beside its running original (issue #22): ckptflow's own
``verify_checkpoint`` on the CUDA backend, for a GPU demo worker started isolated (PID 1 of its
own PID and mount namespaces) and, for contrast, one started plainly.

Usage (on the GPU node, as root, CRIU >= 4.2 reachable via CKPTFLOW_CRIU or PATH, `ip` on PATH):
    python3 bench/gpu_isolated_verify.py [--ballast-gib 4] [--images /dev/shm]

Per layout: the checkpoint (pause), the verify outcome and reason, its phases (checksum, CRIU
restore of the copy, device restore + unlock by the copy's host PIDs, probe), whether the
original kept its state (session and ballast digests equal before and after), and a verify of
the same checkpoint with one session digest recorded wrong (must be verify_failed).
Appends the run to bench/results/gpu_isolated_verify.json and bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import append_results, md_table, record_run  # noqa: E402

from ckptflow.demo import launch  # noqa: E402
from ckptflow.models import CheckpointState  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.runners.verify import verify_checkpoint  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

PORTS = {"isolated": 18711, "plain": 18712}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def state(port: int) -> dict:
    return {"sessions": launch.session_digests(port),
            "ballast": launch.http_json(f"http://127.0.0.1:{port}/v1/ballast/digest", timeout_s=300)["digest"]}


def one(layout: str, ballast_gib: float, images: Path, tmp: Path) -> dict:
    port, pid_file = PORTS[layout], tmp / f"{layout}.pid"
    row: dict = {"layout": layout, "ballast_gib": ballast_gib}
    t0 = time.perf_counter()
    proc = launch.start_gpu_worker(port, pid_file, ballast_gib=ballast_gib, isolated=layout == "isolated")
    row["start_s"] = round(time.perf_counter() - t0, 3)
    w = launch.gpu_workload(f"iso-{layout}", port, pid_file, footprint_gib=ballast_gib + 1)
    try:
        launch.complete(port, "A long session that must survive: " * 20, 32, "s1")
        with NodeRunner(LocalStore(images / layout)) as node:
            m = node.checkpoint(w)
            row["pause_s"] = m.timings.get("pause")
            before = state(port)
            res = verify_checkpoint(node, w, m, timeout_s=300)
            row.update(outcome=str(res.state), reason=res.reason, phases=res.timings)
            row["original_unchanged"] = state(port) == before
            bad = node.store.set_state(m, CheckpointState.complete, sessions={"s1": "0" * 64})
            wrong = verify_checkpoint(node, w, bad, timeout_s=300)
            row["wrong_digest_outcome"], row["wrong_digest_reason"] = str(wrong.state), wrong.reason
            row["original_unchanged_after_both"] = state(port) == before
        log(layout, row)
        return row
    finally:
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ballast-gib", type=float, default=4.0)
    ap.add_argument("--images", type=Path, default=None, help="where the stores go (default: a temp dir)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.images) as d:
        rows = [one(layout, a.ballast_gib, Path(d), Path(d)) for layout in ("isolated", "plain")]
    ok = (rows[0]["outcome"] == "verified" and rows[0]["wrong_digest_outcome"] == "verify_failed"
          and rows[1]["outcome"] == "skipped" and all(r["original_unchanged_after_both"] for r in rows))
    run = record_run("gpu_isolated_verify", {"rows": rows, "ok": ok})
    table = md_table(["layout", "pause s", "verify", "phases s", "original unchanged", "wrong digest"],
                     [[r["layout"], r["pause_s"], r["outcome"], r["phases"], r["original_unchanged_after_both"],
                       r["wrong_digest_outcome"]] for r in rows])
    print(table)
    append_results("GPU verify beside the original (isolated vs plain worker)", table,
                   "Target: the isolated worker's copy verified with its device state restored by the copy's host "
                   f"PIDs, a wrong digest verify_failed, the plain worker skipped; met: {ok}. "
                   + "; ".join(f"{r['layout']}: {r['reason']}" for r in rows))
    print("run recorded:", run.get("date"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
