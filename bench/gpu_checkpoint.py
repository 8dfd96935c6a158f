"""GPU worker checkpoint on an H200: ckptflow's path against the by-hand sequence of the notes.

Usage (on the GPU node, as root, CRIU >= 4.2 reachable via CKPTFLOW_CRIU or PATH):
    python3 bench/gpu_checkpoint.py --sizes 8,20,50 [--images /dev/shm] [--thp always]

Per footprint size (GiB of GPU memory held by the torch demo worker):
- fill_gib_s: memcpy of 4 GiB into freshly allocated pages (the physical limit for bringing
  an image back into a new process);
- cold_start_s: start a worker (import torch, model, CUDA graph, allocate the footprint) and
  re-prefill its long session;
- manual_pause_s / manual_restore_s: the notes' by-hand sequence (driver API + plain criu),
  on a worker started with the node's default THP setting;
- pause_s / restore_to_ready_s: ckptflow's NodeRunner heartbeat and restore (checksums,
  memory gate, CRIU, CUDA restore, unlock, health, session probe) on a worker started with
  ``--thp`` (the node setting ckptflow recommends);
- bitexact: after ckptflow's restore the session KV and ballast digests equal those before
  the checkpoint, and the next tokens equal the reference computed before it (/v1/peek).
Appends the run to bench/results/gpu_checkpoint.json (every run kept, with date and command) and to
bench/RESULTS.md.
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
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import BENCH, append_results, md_table, record_run, runs_of  # noqa: E402

from ckptflow.demo import launch  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.runners.criu import CriuRunner  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PORT = 18501
LONG_TURNS = ["You are a coding agent. Read the repository and keep notes. " * 12,
              "Tool output: " + "src/module.py: def f(x): return x * 2\n" * 20,
              "Now plan the refactor in detail. " * 15]


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def set_thp(mode: str | None) -> str:
    try:
        current = THP.read_text().split("[")[1].split("]")[0]
        if mode:
            THP.write_text(mode)
        return mode or current
    except OSError as e:
        return f"unknown ({e})"


def fill_rate(gib: int = 4, thp: str | None = None) -> float:
    if thp:
        set_thp(thp)
    src = np.ones(gib << 30, dtype=np.uint8)
    dst = np.empty_like(src)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return gib / (time.perf_counter() - t0)


def start(size: float, name: str, thp: str | None, tmp: Path):
    mode = set_thp(thp)
    pid_file = tmp / f"{name}.pid"
    t0 = time.perf_counter()
    proc = launch.start_gpu_worker(PORT, pid_file, ballast_gib=max(0.0, size - 0.75))
    for turn in LONG_TURNS:  # the long session a cold start has to prefill again
        launch.complete(PORT, turn, 64, "agent")
    cold = time.perf_counter() - t0
    w = launch.gpu_workload(name, PORT, pid_file, footprint_gib=size)
    return proc, w, cold, mode


def state(port: int) -> dict:
    base = f"http://127.0.0.1:{port}"
    return {"sessions": launch.session_digests(port), "ballast": launch.http_json(f"{base}/v1/ballast/digest", timeout_s=300)}


def peek(port: int) -> list[int]:
    return launch.http_json(f"http://127.0.0.1:{port}/v1/peek",
                            {"prompt": "continue", "max_tokens": 64, "session_id": "agent"})["tokens"]


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def manual(w, images: Path, criu: CriuRunner) -> tuple[float, float, bool]:
    """The by-hand sequence of notes/gpu.md: heartbeat pause, then a restore after a kill."""
    from cuda.bindings import driver as d

    d.cuInit(0)
    pid = int(Path(w.find.pid_file).read_text())
    before = state(PORT)
    crit = [criu.criu_bin, "-L", str(criu.plugin_dir), "-v2"]
    t0 = time.perf_counter()
    a = d.CUcheckpointLockArgs()
    a.timeoutMs = 10000
    assert int(d.cuCheckpointProcessLock(pid, a)[0]) == 0
    assert int(d.cuCheckpointProcessCheckpoint(pid, None)[0]) == 0
    subprocess.run([*crit, "dump", "-t", str(pid), "-D", str(images), "--leave-running", "-o", "dump.log"], check=True)
    assert int(d.cuCheckpointProcessRestore(pid, None)[0]) == 0
    assert int(d.cuCheckpointProcessUnlock(pid, None)[0]) == 0
    pause = time.perf_counter() - t0
    kill(pid)
    criu.wait_pid_free(pid)
    t0 = time.perf_counter()
    subprocess.run([*crit, "restore", "-D", str(images), "-d", "-o", "restore.log"], check=True)
    assert int(d.cuCheckpointProcessRestore(pid, None)[0]) == 0
    assert int(d.cuCheckpointProcessUnlock(pid, None)[0]) == 0
    restore = time.perf_counter() - t0
    launch.wait_healthy(w.health_url, 60)
    ok = state(PORT) == before
    kill(pid)
    criu.wait_pid_free(pid)
    return pause, restore, ok


def run_size(size: float, images_root: Path, thp: str | None, tmp: Path, fills: dict) -> dict:
    fill = fills.get(thp or "node", fills["node"])
    row: dict = {"footprint_gib": size, "fill_gib_s": round(fill, 3), "fill_by_thp": fills}
    criu = CriuRunner()
    # 1. by-hand baseline on the node's default THP setting
    proc, w, cold, mode = start(size, f"manual-{size:g}", "madvise" if thp else None, tmp)
    row["cold_start_s"] = round(cold, 2)
    row["manual_thp"] = mode
    img = images_root / f"manual-{size:g}"
    img.mkdir(parents=True)
    log(f"{size} GiB: cold start {cold:.1f} s; by-hand sequence")
    mp, mr, mok = manual(w, img, criu)
    proc.wait()
    shutil.rmtree(img)
    row.update(manual_pause_s=round(mp, 2), manual_restore_s=round(mr, 2), manual_state_equal=mok)
    log(f"{size} GiB: by-hand pause {mp:.1f} s, restore {mr:.1f} s, state equal {mok}")
    # 2. ckptflow
    proc, w, cold2, mode = start(size, f"ckptflow-{size:g}", thp, tmp)
    row["thp"] = mode
    row["cold_start_2_s"] = round(cold2, 2)
    before, want = state(PORT), peek(PORT)
    node = NodeRunner(LocalStore(images_root / "store"), criu=criu)
    m = node.checkpoint(w)
    row["pause_s"] = m.timings["pause"]
    row["heartbeat_phases"] = m.timings
    row["image_gib"] = round(m.bytes / 2**30, 2)
    row["gpu_footprint_gib"] = round(m.gpu_footprint_bytes / 2**30, 2)
    row["serving_after_heartbeat"] = state(PORT) == before
    log(f"{size} GiB: ckptflow heartbeat {m.timings}")
    kill(m.pid)
    proc.wait()
    criu.wait_pid_free(m.pid)
    t0 = time.perf_counter()
    res = node.restore(w)
    row["restore_to_ready_s"] = round(time.perf_counter() - t0, 2)
    row["restore_phases"] = res.timings
    after = state(PORT)
    got = launch.complete(PORT, "continue", 64, "agent")
    row["bitexact"] = after == before and got == want
    row["restore_gib_s"] = round(m.bytes / 2**30 / row["restore_to_ready_s"], 3)
    row["restore_vs_fill"] = round(row["restore_gib_s"] / fill, 3)
    row["pause_vs_manual"] = round(row["pause_s"] / row["manual_pause_s"], 3)
    log(f"{size} GiB: ckptflow restore {res.timings} -> ready {row['restore_to_ready_s']} s, bitexact {row['bitexact']}")
    kill(res.pid)
    criu.wait_pid_free(res.pid)
    node.store.delete(m)
    criu.close()
    return row


def gpu_name() -> tuple[str, str]:
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)), pynvml.nvmlSystemGetDriverVersion()


def save(earlier: list[dict], rows: list[dict], images_on: str) -> None:
    """This run, with the sizes done so far, as the newest run after ``earlier``: called after
    every size, so a run cut short still leaves its rows, and it stays one run."""
    out = BENCH / "results" / "gpu_checkpoint.json"
    out.write_text(json.dumps({"runs": earlier}, indent=1) + "\n")
    gpu, driver = gpu_name()
    record_run("gpu_checkpoint", {"gpu": gpu, "driver": driver, "images_on": images_on, "rows": rows})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8,20,50")
    ap.add_argument("--images", default="/dev/shm", help="where images go (tmpfs in the notes)")
    ap.add_argument("--thp", default="always", help="THP mode for ckptflow's worker; '' keeps the node's")
    a = ap.parse_args()
    original = set_thp(None)
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-gpu-"))
    images_root = Path(tempfile.mkdtemp(prefix="ckptflow-img-", dir=a.images))
    # Fill rate under each THP mode the run uses: restore is compared with the same mode.
    fills = {"node": round(fill_rate(), 3)}
    if a.thp:
        fills[a.thp] = round(fill_rate(thp=a.thp), 3)
        set_thp(original)
    log(f"fresh-page fill rate {fills} GiB/s; THP was {original}")
    rows, earlier = [], runs_of("gpu_checkpoint")
    try:
        for s in a.sizes.split(","):
            rows.append(run_size(float(s), images_root, a.thp or None, tmp, fills))
            save(earlier, rows, a.images)  # after every size: a run cut short still leaves its rows
    finally:
        if original in ("always", "madvise", "never"):
            set_thp(original)
        shutil.rmtree(images_root, ignore_errors=True)
    gpu, driver = gpu_name()
    headers = ["footprint GiB", "image GiB", "pause s", "by-hand pause s", "pause / by-hand", "restore-to-ready s",
               "by-hand restore s", "restore GiB/s", "fill GiB/s", "restore / fill", "cold start s", "bit-exact"]
    table = md_table(headers, [[r["footprint_gib"], r["image_gib"], r["pause_s"], r["manual_pause_s"],
                                r["pause_vs_manual"], r["restore_to_ready_s"], r["manual_restore_s"],
                                r["restore_gib_s"], r["fill_gib_s"], r["restore_vs_fill"], r["cold_start_s"],
                                r["bitexact"]] for r in rows])
    phases = "\n".join(f"- {r['footprint_gib']:g} GiB: heartbeat {r['heartbeat_phases']}; restore {r['restore_phases']}; "
                       f"THP ckptflow={r['thp']} by-hand={r['manual_thp']}" for r in rows)
    print(table)
    print(phases)
    append_results(f"GPU checkpoint on {gpu}, driver {driver} (bench/gpu_checkpoint.py)", table,
                   f"Images on {a.images}. Phases (s):\n{phases}")
    return 0 if all(r["bitexact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
