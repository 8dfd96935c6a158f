"""`ckptflow recover` from the kill to a serving worker, and what the command adds to the restore.

Issue #36, finding 5: with no Prefect server configured, every command started a temporary one
(recover 12.2-14.6 s for a 0.27 s restore, measured by the trial). Without a server recover now
runs in its own process without Prefect (ckptflow.recovery.recover_here). Target: the command's
overhead (its wall time minus the restore's own time, as the restore records it) <= 1 s.

Usage (as root, after ./scripts/setup.sh):
    .venv/bin/python bench/cli_recover.py [--repeat 5]

Per run: the CPU demo worker holds a session, is checkpointed (NodeRunner), SIGKILLed; then
`ckptflow recover FLEET WORKLOAD` is timed to its exit, the restore's own seconds are read from
the checkpoint's restore history, and the session's next turn must equal the one the worker gave
before the kill. Appends the run to bench/results/cli_recover.json and a table to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from _common import append_results, md_table, record_run  # noqa: E402

from ckptflow.demo import launch  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

PORT = 18302
TARGET_S = 1.0


def one(root: Path, i: int) -> dict:
    import yaml

    pid_file, store_dir = root / f"w{i}.pid", root / f"store{i}"
    proc = launch.start_worker(PORT, pid_file, timeout_s=120)
    w = launch.demo_workload("chat", PORT, pid_file)
    fleet = root / f"fleet{i}.yaml"
    fleet.write_text(yaml.safe_dump({"fleet": "bench", "storage": {"kind": "local", "path": str(store_dir)},
                                     "nodes": [{"name": "local", "work_pool": "local"}],
                                     "workloads": [w.model_dump(mode="json", exclude_none=True)]}))
    try:
        launch.complete(PORT, "a long session " * 30, 16, "s")
        with NodeRunner(LocalStore(store_dir)) as node:
            m = node.checkpoint(w)
        want = launch.complete(PORT, "and then", 16, "s")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}   # no server configured
        t0 = time.perf_counter()
        r = subprocess.run([str(ROOT / ".venv" / "bin" / "ckptflow"), "recover", str(fleet), "chat"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"ckptflow recover failed: {r.stderr[-2000:]}")
        restore_s = LocalStore(store_dir).get("chat", m.id).probe.restores.seconds[-1]
        got = launch.complete(PORT, "and then", 16, "s")
        return {"wall_s": round(wall, 3), "restore_s": round(restore_s, 3), "overhead_s": round(wall - restore_s, 3),
                "next_tokens_equal": got == want, "temporary_server": "temporary server" in r.stdout + r.stderr}
    finally:
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptflow-cli-recover-") as d:
        runs = [one(Path(d), i) for i in range(a.repeat)]
    med = {k: round(statistics.median(r[k] for r in runs), 3) for k in ("wall_s", "restore_s", "overhead_s")}
    ok = all(r["next_tokens_equal"] and not r["temporary_server"] for r in runs)
    row = {"path": "no Prefect server configured: recover in its own process", "runs": runs, **med,
           "max_overhead_s": max(r["overhead_s"] for r in runs), "target_s": TARGET_S,
           "target_met": max(r["overhead_s"] for r in runs) <= TARGET_S, "all_ok": ok}
    record_run("cli_recover", {"rows": [row]})
    table = md_table(["path", "runs", "wall s (median)", "restore s (median)", "overhead s (median / max)",
                      f"target <= {TARGET_S} s", "next turn equal, no temporary server"],
                     [[row["path"], len(runs), med["wall_s"], med["restore_s"],
                       f"{med['overhead_s']} / {row['max_overhead_s']}", row["target_met"], ok]])
    append_results("`ckptflow recover` without a Prefect server (bench/cli_recover.py)", table,
                   "Before (issue #36's trial): 12.2-14.6 s for a 0.27 s restore, a temporary Prefect server started "
                   "first.")
    print(table)


if __name__ == "__main__":
    main()
