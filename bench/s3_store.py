"""S3 tier throughput against raw boto3 multipart on the same server, and heartbeat dedup.

Usage (after ./scripts/setup.sh; starts and stops its own SeaweedFS on 127.0.0.1):
    .venv/bin/python bench/s3_store.py [--mib 1024]

- upload_ratio / download_ratio: ckptflow push/pull throughput ÷ boto3's managed multipart
  transfer (64 MiB parts, 8 threads: the notes' best) of the same file to the same server;
- second_heartbeat_byte_ratio: bytes a second push of a real demo worker's checkpoint
  uploads ÷ its image size, when only the session's KV cache changed in between.
Appends the run to bench/results/s3_store.json (every run kept) and to bench/RESULTS.md.
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

ROOT = Path(__file__).parent.parent
ROUNDS = 3
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from _common import append_results, md_table, record_run  # noqa: E402
from seaweed import SeaweedS3  # noqa: E402

from ckptflow.demo import launch  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402
from ckptflow.store.s3 import S3Tier  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-s3bench-", dir="/var/tmp"))
    (tmp / "sw").mkdir()
    srv = SeaweedS3(tmp / "sw")
    try:
        from boto3.s3.transfer import TransferConfig

        bucket = srv.bucket("ckpt-bench")
        src, dst = LocalStore(tmp / "a"), LocalStore(tmp / "b")
        p = src.begin("bench", node="a")
        with open(p.images_dir / "pages-1.img", "wb") as f:
            for _ in range(a.mib // 64):
                f.write(os.urandom(64 << 20))
        m = src.commit(p)
        size = m.bytes
        cfg = TransferConfig(multipart_chunksize=64 << 20, max_concurrency=8)
        # Each timed transfer starts with no dirty pages left by the one before (else the
        # later ones pay for the earlier ones' writeback).
        os.sync()
        t0 = time.perf_counter()
        srv.client.upload_file(str(src.images_dir(m) / "pages-1.img"), bucket, "raw/pages-1.img", Config=cfg)
        raw_up = time.perf_counter() - t0
        tier = S3Tier(bucket, endpoint_url=srv.endpoint)
        os.sync()
        t0 = time.perf_counter()
        tier.push(src, m)
        up = time.perf_counter() - t0
        # Downloads alternate raw and ckptflow, ROUNDS times, each into a fresh file deleted
        # afterwards: on this VM a download slows down as earlier ones' data piles up, so a
        # single run in a fixed order favours whichever goes first. Median of each.
        raws, ours = [], []
        for i in range(ROUNDS):
            os.sync()
            t0 = time.perf_counter()
            srv.client.download_file(bucket, "raw/pages-1.img", str(tmp / "raw.img"), Config=cfg)
            raws.append(time.perf_counter() - t0)
            (tmp / "raw.img").unlink()
            os.sync()
            t0 = time.perf_counter()
            tier.pull(dst, "bench", m.id, "dst")
            ours.append(time.perf_counter() - t0)
            shutil.rmtree(dst.root / "bench")
        raw_down, down = statistics.median(raws), statistics.median(ours)

        # A real worker: two heartbeats, only the session's KV changed in between.
        pid_file = tmp / "w.pid"
        proc = launch.start_worker(18601, pid_file, ballast_mib=512)
        w = launch.demo_workload("dedup", 18601, pid_file)
        node = NodeRunner(LocalStore(tmp / "node"))
        launch.complete(18601, "a long agent session " * 50, 32, "s")
        first = tier.push(node.store, node.checkpoint(w))
        launch.complete(18601, "the next turn of the session", 32, "s")
        m2 = node.checkpoint(w)
        second = tier.push(node.store, m2)
        proc.kill()
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    gib = size / 2**30
    res = {"file_gib": round(gib, 3),
           "raw_upload_gib_s": round(gib / raw_up, 3), "ckptflow_upload_gib_s": round(gib / up, 3),
           "raw_download_gib_s": round(gib / raw_down, 3), "ckptflow_download_gib_s": round(gib / down, 3),
           "download_rounds_s": {"raw": [round(x, 3) for x in raws], "ckptflow": [round(x, 3) for x in ours]},
           "upload_ratio": round(raw_up / up, 3), "download_ratio": round(raw_down / down, 3),
           "first_heartbeat_uploaded_bytes": first["uploaded_bytes"],
           "second_heartbeat_uploaded_bytes": second["uploaded_bytes"], "second_heartbeat_image_bytes": m2.bytes,
           "second_heartbeat_byte_ratio": round(second["uploaded_bytes"] / m2.bytes, 4)}
    record_run("s3_store", res)  # every run kept, with date and command
    table = md_table(["file GiB", "raw up GiB/s", "ckptflow up GiB/s", "upload_ratio", "raw down GiB/s",
                      "ckptflow down GiB/s", "download_ratio", "second_heartbeat_byte_ratio"],
                     [[res["file_gib"], res["raw_upload_gib_s"], res["ckptflow_upload_gib_s"], res["upload_ratio"],
                       res["raw_download_gib_s"], res["ckptflow_download_gib_s"], res["download_ratio"],
                       res["second_heartbeat_byte_ratio"]]])
    print(table)
    append_results("S3 tier against raw boto3 multipart, SeaweedFS on 127.0.0.1 (bench/s3_store.py)", table,
                   "Raw: boto3 upload_file/download_file, 64 MiB parts, 8 threads. ckptflow: 8 MiB "
                   "content-addressed chunks, 16 threads, every chunk checked. Downloads: median of "
                   f"{ROUNDS} alternating rounds (s: {res['download_rounds_s']}). Dedup row: a 512 MiB demo "
                   "worker, one session turn between the two heartbeats.")


if __name__ == "__main__":
    main()
