"""What slows a decoding thread while another thread of the same process moves a session's KV out
(issue #25 item 3: a turn export costs the engine's other sessions 0.0215 s per 1 GiB, 0.0026 s per
0.5 GiB, bench/gpu_turn_export.py; a host-only control in another process cost nothing).

No engine: one thread "decodes" the way ckptflow/demo/llm_worker.py does at batch 1 (per step a
small table sent from a Python list, a matrix-vector product reading ``--weights-gib`` of HBM, the
argmax read back with ``int()``), while another thread, every ``--every`` s, does one kind of
export work. A window's loss per export = (sum of its step times - steps x the base windows' mean
step) / exports. Kinds of export work:

  none            base window (first, middle and last; their spread is the noise)
  d2h N           N GiB device -> pinned host, one copy on a side stream, then stream.synchronize()
  d2h-pieces N    the same in 16 MiB copies, at most two in flight (llm_worker's turn export before this bench)
  d2h-poll N      one copy, waited for by polling an event (no CUDA synchronize call)
  d2d N           N GiB device -> device on a side stream (HBM traffic, no PCIe)
  host N / host2  sha256 and a tmpfs file per 11 MiB block of a pinned buffer on 14 (2) threads of this
                  process (an export's host part), no GPU work
  (--set fixes)
  d2h-1fl@P N     N GiB in P-byte copies, one in flight (the copy engine's queue empties between them)
  host-proc N     the host part in a child process with no CUDA, from the pinned buffer shared with it
                  (a /dev/shm file, mapped, registered with cudaHostRegister)

Each kind runs against two decoders: ``pageable`` (as llm_worker: ``torch.tensor(list, device=)``
and ``int(argmax)``, synchronous copies through the driver's pageable path) and ``pinned`` (the
same bytes through pinned buffers, non_blocking copies, one event wait per step).

Usage (GPU node):
    bench/on_device.sh python3 bench/gpu_copy_interference.py
Appends to bench/results/gpu_copy_interference.json and bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import append_results, md_table, record_run  # noqa: E402

GiB = 2**30
BLOCK = 43 * 2 * 16 * 4096 * 2          # llm_worker's KV block at 43 layers: 11 MiB
PIECE = 16 << 20


CHILD = """
import hashlib, mmap, os, shutil, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
mm = mmap.mmap(os.open(sys.argv[1], os.O_RDWR), 0)
root = Path(sys.argv[2])
ex = ThreadPoolExecutor(14)
for line in sys.stdin:
    n, block = map(int, line.split())
    d = root / "child"
    d.mkdir()
    def one(j):
        view = memoryview(mm)[j * block:(j + 1) * block]
        h = hashlib.sha256(view).hexdigest()
        with open(d / f"{h}-{j}", "wb") as f:
            f.write(view)
    list(ex.map(one, range(n)))
    shutil.rmtree(d)
    print(n, flush=True)
"""


class Decoder:
    def __init__(self, w: torch.Tensor, mode: str):
        self.w, self.mode, self.dev = w, mode, w.device
        self.v = torch.randn(w.shape[1], device=self.dev, dtype=w.dtype)
        self.table = list(range(256))
        self.idx = torch.zeros(256, dtype=torch.long, device=self.dev)
        self.h_table = torch.tensor(self.table, dtype=torch.long).pin_memory()
        self.h_out = torch.zeros(1, dtype=torch.long).pin_memory()
        self.ev = torch.cuda.Event()

    def step(self) -> int:
        if self.mode == "pageable":
            self.idx.copy_(torch.tensor(self.table, device=self.dev))
        else:
            self.idx.copy_(self.h_table, non_blocking=True)
        y = self.w @ self.v
        y[:256] += self.idx.to(y.dtype) * 0
        top = torch.argmax(y)
        if self.mode == "pageable":
            return int(top)
        self.h_out.copy_(top.view(1), non_blocking=True)
        self.ev.record()
        self.ev.synchronize()
        return int(self.h_out[0])


def run_window(dec: Decoder, work, seconds: float, every: float) -> dict:
    stop = threading.Event()
    steps: list[float] = []

    def decode():
        t = time.perf_counter()
        while not stop.is_set():
            dec.step()
            now = time.perf_counter()
            steps.append(now - t)
            t = now

    th = threading.Thread(target=decode)
    th.start()
    time.sleep(0.5)
    n0 = len(steps)
    end = time.perf_counter() + seconds
    took = []
    while time.perf_counter() < end:
        tick = time.perf_counter()
        if work is not None:
            t0 = time.perf_counter()
            work()
            took.append(time.perf_counter() - t0)
        time.sleep(max(0.0, tick + every - time.perf_counter()))
    n1 = len(steps)
    stop.set()
    th.join()
    sel = steps[n0:n1]
    return {"steps": len(sel), "sum_s": sum(sel), "mean_ms": 1e3 * statistics.fmean(sel),
            "max_ms": 1e3 * max(sel), "exports": len(took),
            "work_ms": round(1e3 * statistics.fmean(took), 2) if took else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-gib", type=float, default=16)
    ap.add_argument("--window", type=float, default=5)
    ap.add_argument("--every", type=float, default=0.5)
    ap.add_argument("--tmp", default="/dev/shm")
    ap.add_argument("--set", choices=("first", "fixes"), default="fixes",
                    help="first: what stalls the decoder; fixes: copies one piece in flight, host work in another process")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    n = int(a.weights_gib * GiB / 2 / 4096)
    w = torch.randn(n, 4096, device=dev, dtype=torch.bfloat16)
    kv = torch.randint(0, 255, (2 * GiB,), dtype=torch.uint8, device=dev)   # a session's KV, up to 1 GiB used
    dst = torch.empty(2 * GiB, dtype=torch.uint8, device=dev)
    host = torch.empty(GiB + PIECE, dtype=torch.uint8).pin_memory()
    side = torch.cuda.Stream()
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-ci-", dir=a.tmp))

    def d2h(gib: float, piece: int | None = None, poll: bool = False, depth: int = 2):
        nb = int(gib * GiB)

        def go():
            with torch.cuda.stream(side):
                if piece is None:
                    host[:nb].copy_(kv[:nb], non_blocking=True)
                else:
                    fl: list[torch.cuda.Event] = []
                    for o in range(0, nb, piece):
                        if len(fl) >= depth:
                            fl.pop(0).synchronize()
                        host[o:o + min(piece, nb - o)].copy_(kv[o:o + min(piece, nb - o)], non_blocking=True)
                        e = torch.cuda.Event()
                        e.record(side)
                        fl.append(e)
                if poll:
                    e = torch.cuda.Event()
                    e.record(side)
                    while not e.query():
                        time.sleep(0.0005)
                else:
                    side.synchronize()
        return go

    def d2d(gib: float):
        nb = int(gib * GiB)

        def go():
            with torch.cuda.stream(side):
                dst[:nb].copy_(kv[:nb], non_blocking=True)
            side.synchronize()
        return go

    def hostwork(gib: float, threads: int):
        nblk = max(1, int(gib * GiB) // BLOCK)

        def go():
            d = tmp / "w"
            d.mkdir()

            def one(j: int):
                view = memoryview(host[j * BLOCK:(j + 1) * BLOCK].numpy())
                h = hashlib.sha256(view).hexdigest()
                with open(d / f"{h}-{j}", "wb") as f:
                    f.write(view)

            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(one, range(nblk)))
            shutil.rmtree(d)
        return go

    child = None
    if a.set == "first":
        kinds = [("none", None), ("d2h 1", d2h(1)), ("d2h 0.5", d2h(0.5)), ("d2h 0.25", d2h(0.25)),
                 ("d2h-pieces 1", d2h(1, PIECE)), ("d2h-poll 1", d2h(1, poll=True)), ("d2d 1", d2d(1)),
                 ("none", None), ("host 1", hostwork(1, 14)), ("host2 1", hostwork(1, 2)), ("none", None)]
    else:
        # The pinned buffer in a shared-memory file, registered with CUDA, so that a process with
        # no CUDA (and its own GIL) can hash and write what the copies put there.
        import mmap
        import os
        import subprocess

        shm = tmp / "stage"
        fd = os.open(shm, os.O_CREAT | os.O_RDWR)
        os.ftruncate(fd, GiB)
        mm = mmap.mmap(fd, GiB)
        shared = torch.frombuffer(mm, dtype=torch.uint8)
        rc = torch.cuda.cudart().cudaHostRegister(shared.data_ptr(), GiB, 0)
        assert int(rc) == 0 and shared.is_pinned(), (rc, shared.is_pinned())
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(shm), str(tmp)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, bufsize=1)

        def hostproc(gib: float):
            nblk = max(1, int(gib * GiB) // BLOCK)

            def go():
                child.stdin.write(f"{nblk} {BLOCK}\n")
                got = child.stdout.readline()
                assert got.strip().isdigit(), got
            return go

        def both(gib: float, piece: int):
            a_, b_ = d2h(gib, piece, depth=1), hostproc(gib)

            def go():
                a_()
                b_()
            return go

        kinds = [("none", None), ("d2h-1fl@16M 1", d2h(1, PIECE, depth=1)), ("d2h-1fl@4M 1", d2h(1, 4 << 20, depth=1)),
                 ("d2h-1fl@64M 1", d2h(1, 64 << 20, depth=1)), ("none", None), ("host-proc 1", hostproc(1)),
                 ("d2h-1fl@16M+host-proc 1", both(1, PIECE)), ("d2h-1fl@16M+host-proc 0.25", both(0.25, PIECE)),
                 ("none", None)]
    rows, res = [], {}
    try:
        for mode in ("pageable", "pinned"):
            dec = Decoder(w, mode)
            for _ in range(20):
                dec.step()
            torch.cuda.synchronize()
            wins = []
            for name, work in kinds:
                r = run_window(dec, work, a.window, a.every)
                r["kind"] = name
                wins.append(r)
                print(time.strftime("%H:%M:%S"), mode, name, r, file=sys.stderr, flush=True)
            base = [x for x in wins if x["kind"] == "none"]
            mean = sum(x["sum_s"] for x in base) / sum(x["steps"] for x in base)
            spread = max(x["mean_ms"] for x in base) - min(x["mean_ms"] for x in base)
            for x in wins:
                if x["exports"]:
                    x["lost_ms_per_export"] = round(1e3 * (x["sum_s"] - x["steps"] * mean) / x["exports"], 3)
                rows.append([mode, x["kind"], x["steps"], f"{x['mean_ms']:.3f}", f"{x['max_ms']:.2f}",
                             x.get("work_ms") or "—", x.get("lost_ms_per_export", "—")])
            res[mode] = {"base_step_ms": round(1e3 * mean, 4), "base_spread_ms": round(spread, 4),
                         "windows": wins}
    finally:
        if child is not None:
            child.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    gpu = torch.cuda.get_device_name(0)
    record_run("gpu_copy_interference", {"gpu": gpu, "torch": torch.__version__, "weights_gib": a.weights_gib,
                                         "window_s": a.window, "every_s": a.every, "set": a.set, **res})
    table = md_table(["decoder", "export work", "steps", "mean step ms", "max step ms", "work ms",
                      "lost ms / export"], rows)
    print(table)
    append_results(f"Export work beside a decoding thread, one process, {gpu} (bench/gpu_copy_interference.py)",
                   table, "Base step (ms) and spread per decoder: " +
                   ", ".join(f"{m} {v['base_step_ms']} ± {v['base_spread_ms']}" for m, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
