"""The keyed chunk hash on the GPU (engines/gpuhash.py, issue #23 item 1): the fused NH-128 kernel
against the torch reference on the same bytes (equal, or the run fails) and how fast each hashes
``--gib`` GiB in 64 MiB chunks, beside the file -> GPU stream it must keep up with (>= 20 GiB/s).

Usage (GPU node):
    python3 bench/gpu_hash.py [--gib 16]
Appends the run to bench/results/gpu_hash.json and bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import append_results, md_table, record_run  # noqa: E402

from ckptflow.engines.gpuhash import KeyedChunkHash, key_words  # noqa: E402

CHUNK = 64 << 20


def timed(fn, reps: int = 3) -> tuple[float, object]:
    out = fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=16.0)
    a = ap.parse_args()
    n = int(a.gib * 2**30) // 8 * 8 + 24 * 1024   # not a whole number of chunks: the last one is short
    g = torch.Generator(device="cuda").manual_seed(3)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
    fused = KeyedChunkHash(seed=42, max_bytes=CHUNK, device="cuda")
    ref = KeyedChunkHash.__new__(KeyedChunkHash)   # the same key, the reference path only
    ref.__dict__.update(seed=42, words=CHUNK // 8, device=fused.device, key32=None, impl="torch")
    ref.key = key_words(42, (2, 2, CHUNK // 8), "cuda")
    t0 = time.perf_counter()
    KeyedChunkHash(seed=43, max_bytes=CHUNK, device="cuda")
    torch.cuda.synchronize()
    t_key = time.perf_counter() - t0     # a new key (and the kernel's check), as after a restore
    t_fused, v_fused = timed(lambda: fused.chunks(data, CHUNK))
    t_ref, v_ref = timed(lambda: [ref.flat(data[o:o + CHUNK]) for o in range(0, n, CHUNK)], reps=1)
    swapped = data.clone()
    w = swapped.view(torch.int64)
    w[[7, 8]] = w[[8, 7]].clone()
    row = {"gpu": torch.cuda.get_device_name(), "gib": round(n / 2**30, 3), "chunks": len(v_fused),
           "impl": fused.impl, "equal_to_reference": v_fused == v_ref,
           "swap_detected": fused.chunks(swapped, CHUNK)[0] != v_fused[0],
           "new_key_s": round(t_key, 4), "fused_s": round(t_fused, 4), "fused_gib_s": round(n / 2**30 / t_fused, 1),
           "reference_s": round(t_ref, 4), "reference_gib_s": round(n / 2**30 / t_ref, 1)}
    print(row)
    record_run("gpu_hash", {"rows": [row]})
    table = md_table(list(row), [list(row.values())])
    print(table)
    append_results("Keyed chunk hash on the GPU: fused NH-128 kernel vs the torch reference (bench/gpu_hash.py)",
                   table, "Target: equal to the reference, and fast enough to keep the stream >= 20 GiB/s.")
    return 0 if row["equal_to_reference"] and row["swap_detected"] and row["impl"] == "fused" else 1


if __name__ == "__main__":
    sys.exit(main())
