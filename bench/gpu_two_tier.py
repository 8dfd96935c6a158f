"""Two tiers on the H200: the same GPU worker checkpointed whole (CUDA + CRIU, today's path)
and in two tiers (template without its weights + sessions by their changes), killed and
restored both ways; bit-exact against the state and the next tokens recorded before the kill.

Usage (on the GPU node, as root; CRIU from the bundle, see bench/on_device.sh):
    bench/on_device.sh python3 bench/gpu_two_tier.py --weights-gib 8 [--sessions 4 --tokens 1500]

The worker (ckptflow/demo/gpu_worker.py) holds ``--weights-gib`` of seeded device memory that
stands in for weights (the large static tensor the template leaves out), a small model with a
captured CUDA graph and a KV pool (stays resident, zeroed in the template). Row fields follow
issue #13; `cold_start_s` = start + re-prefill of every session. Writes
bench/results/gpu_two_tier.json and appends to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import BENCH, append_results, md_table  # noqa: E402

from ckptflow.demo import launch  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.runners.twotier import TwoTierRunner  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

PORT = 18651


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def state() -> tuple[dict, list[int]]:
    peek = launch.http_json(f"http://127.0.0.1:{PORT}/v1/peek", {"prompt": "next", "max_tokens": 32,
                                                                 "session_id": "s0"})["tokens"]
    return launch.session_digests(PORT), peek


def kill(pid: int, node: NodeRunner) -> None:
    os.kill(pid, signal.SIGKILL)
    node.criu.wait_pid_free(pid)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-gib", type=float, default=8)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--images", default="/dev/shm")
    a = ap.parse_args()
    os.environ.setdefault("CKPTFLOW_CRIU_NETWORK_LOCK", "skip")
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-2t-", dir=a.images))
    pid_file = tmp / "w.pid"
    row: dict = {"weights_gib": a.weights_gib, "sessions": a.sessions, "tokens_per_session": a.tokens}
    t0 = time.perf_counter()
    proc = launch.start_gpu_worker(PORT, pid_file, ballast_gib=a.weights_gib)
    for i in range(a.sessions):
        launch.complete(PORT, ("session %d: " % i) + "x" * a.tokens, 16, f"s{i}")
    row["cold_start_s"] = round(time.perf_counter() - t0, 2)
    w = launch.gpu_workload("tt", PORT, pid_file, footprint_gib=a.weights_gib + 2)
    store = LocalStore(tmp / "store")
    node = NodeRunner(store)
    try:
        # --- today's path: the whole process ------------------------------------------------
        before = state()
        m = node.checkpoint(w)
        row.update(transparent_pause_s=m.timings["pause"], transparent_image_gib=round(m.bytes / 2**30, 2))
        kill(m.pid, node)
        t0 = time.perf_counter()
        node.restore(w)
        row["transparent_restore_s"] = round(time.perf_counter() - t0, 2)
        row["transparent_bitexact"] = state() == before
        log("transparent", row)
        node.store.delete(m)

        # --- two tiers ----------------------------------------------------------------------
        tt = TwoTierRunner(node)
        m1 = tt.heartbeat(w)
        tmpl = store.get(m1.probe["template_workload"], m1.probe["template"])
        row.update(template_capture=tmpl.timings, template_image_gib=round(tmpl.bytes / 2**30, 2),
                   template_gpu_gib=round(tmpl.gpu_footprint_bytes / 2**30, 2),
                   live_kv_gib=round(m1.probe["session_bytes"] / 2**30, 3))
        launch.complete(PORT, "one more turn " * 20, 64, "s0")            # one session changes
        m2 = tt.heartbeat(w)
        recs = json.loads((store.images_dir(m2) / "sessions.json").read_text())["sessions"]
        old = json.loads((store.images_dir(m1) / "sessions.json").read_text())["sessions"]
        new = {d for t in recs["s0"]["tensors"] for d in t["chunks"]} - {d for t in old["s0"]["tensors"]
                                                                        for d in t["chunks"]}
        row.update(session_pause_s=m2.timings["pause"], session_export_s=m2.timings["export"],
                   session_bytes=m2.probe["moved_bytes"], changed_chunk_bytes=tt.chunks.size(sorted(new)),
                   changed_sessions=m2.probe["changed_sessions"])
        before = state()
        kill(int(pid_file.read_text()), node)
        t0 = time.perf_counter()
        r = tt.restore(w)
        row["restore_to_ready_s"] = round(time.perf_counter() - t0, 2)
        row["restore_phases"] = r.timings
        row["template_restore_s"] = round(r.timings.get("restore", 0) + r.timings.get("cuda_restore", 0), 2)
        row["stream_s"] = round(r.timings.get("weights", 0) + r.timings.get("sessions", 0), 2)
        moved = a.weights_gib + row["live_kv_gib"]
        row["stream_gib_s"] = round(moved / row["stream_s"], 2) if row["stream_s"] else None
        row["bitexact"] = state() == before
        log("two-tier", row)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass
        node.close()
    import pynvml

    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    (BENCH / "results" / "gpu_two_tier.json").write_text(json.dumps({"gpu": gpu, "rows": [row]}, indent=1) + "\n")
    table = md_table(["weights GiB", "live KV GiB", "transparent restore s", "transparent pause s",
                      "template restore s", "stream s (GiB/s)", "restore-to-ready s", "session pause s",
                      "session bytes (changed chunks)", "cold start s", "bit-exact (transparent / two-tier)"],
                     [[a.weights_gib, row["live_kv_gib"], row["transparent_restore_s"], row["transparent_pause_s"],
                       row["template_restore_s"], f"{row['stream_s']} ({row['stream_gib_s']})",
                       row["restore_to_ready_s"], row["session_pause_s"],
                       f"{row['session_bytes']} ({row['changed_chunk_bytes']})", row["cold_start_s"],
                       f"{row['transparent_bitexact']} / {row['bitexact']}"]])
    print(table)
    append_results(f"Two tiers vs the whole process on {gpu} (bench/gpu_two_tier.py)", table,
                   f"Template capture phases {row['template_capture']}; template image {row['template_image_gib']} GiB, "
                   f"GPU state in it {row['template_gpu_gib']} GiB; restore phases {row['restore_phases']}. "
                   "Stream = weights file -> host (8 threads, sha256 checked) -> GPU, plus session import.")
    return 0 if row["bitexact"] and row["transparent_bitexact"] else 1


if __name__ == "__main__":
    sys.exit(main())
