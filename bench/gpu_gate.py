"""The GPU memory gate per GPU on two H200s (issue #23 item 2): a TP=2 worker's restore is
gated rank by rank against the GPU each rank goes back to, not its summed footprint against one.

Usage (nvidia-h200-x2, root, CRIU reachable via CKPTFLOW_CRIU or PATH):
    bench/on_device.sh python3 bench/gpu_gate.py [--ballast-gib 10]

One TP=2 worker (NCCL, ``--ballast-gib`` per rank) is checkpointed and killed; then, with a
blocker process holding memory on one GPU:
  short    GPU 1 left with less than rank 1's share: the restore is refused before any CRIU
           call, naming that GPU; nothing is left running.
  sum      GPU 0 left with room for rank 0's share but not for the sum of both ranks (what the
           old gate compared with one GPU's free memory): the restore goes ahead, every rank
           back on its own GPU, bit-exact (session and ballast digests, next tokens) and a
           collective across both ranks correct.
Appends the run to bench/results/gpu_gate.json and bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
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
from gpu_tp import PORT, allreduce, gpu_of, log, peek, start, state  # noqa: E402

from ckptflow.errors import CkptflowError  # noqa: E402
from ckptflow.runners.criu import CriuRunner  # noqa: E402
from ckptflow.runners.cuda import cuda_pids  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.runners.process import pid_alive  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

GiB = 2**30
_BLOCK = """
import sys, time, torch
torch.cuda.set_device(int(sys.argv[1]))
free = torch.cuda.mem_get_info()[0]
t = torch.empty(max(0, free - int(float(sys.argv[2]) * 2**30)), dtype=torch.uint8, device="cuda")
print("held", flush=True)
time.sleep(900)
"""


def free_gib() -> list[float]:
    import pynvml

    return [round(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free / GiB, 2)
            for i in range(pynvml.nvmlDeviceGetCount())]


def block(gpu: int, leave_gib: float) -> subprocess.Popen:
    """A process holding all of ``gpu``'s free memory but ``leave_gib`` (its own context included)."""
    p = subprocess.Popen([sys.executable, "-c", _BLOCK, str(gpu), str(leave_gib + 0.55)], stdout=subprocess.PIPE,
                         text=True)
    if p.stdout.readline().strip() != "held":
        raise RuntimeError("blocker failed to start")
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ballast-gib", type=float, default=10.0)
    ap.add_argument("--images", default="/dev/shm")
    a = ap.parse_args()
    import pynvml

    pynvml.nvmlInit()
    os.environ.setdefault("CKPTFLOW_CRIU_NETWORK_LOCK", "skip")
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-gate-", dir=a.images))
    criu = CriuRunner()
    proc, w, _ = start("tp-gate", "nccl", 2, a.ballast_gib, tmp, nccl_env=True)
    out: dict = {"gpus": pynvml.nvmlDeviceGetCount(), "ballast_gib_per_rank": a.ballast_gib}
    blocker = None
    node = NodeRunner(LocalStore(tmp / "store"), criu=criu)
    try:
        pids = cuda_pids(int(Path(w.find.pid_file).read_text()))
        out["rank_gpus"] = [gpu_of(pids).get(p) for p in pids]
        before, want = state(PORT), peek(PORT)
        m = node.checkpoint(w)
        need = {k: round(v / GiB, 2) for k, v in (m.gpu_footprints or {}).items()}
        out.update(per_gpu_footprint_gib=need, total_footprint_gib=round(m.gpu_footprint_bytes / GiB, 2))
        os.kill(m.pid, signal.SIGKILL)
        proc.wait()
        for p in pids:
            criu.wait_pid_free(p)
        share = max(need.values())
        # short: GPU 1 keeps less than a rank's share (+ the 1 GiB margin)
        blocker = block(1, share - 4)
        short = {"free_gib": free_gib()}
        try:
            node.restore(w, fallback=False)
            short.update(refused=False, reason="restored")
        except CkptflowError as e:
            short.update(refused=True, error=type(e).__name__, reason=str(e).splitlines()[0])
        short["left_running"] = pid_alive(m.pid) or any(pid_alive(p) for p in pids)
        out["short"] = short
        log("short", short)
        blocker.kill()
        blocker.wait()
        time.sleep(2)
        # sum: GPU 0 keeps room for rank 0 but not for both ranks together
        blocker = block(0, share + 3)
        s = {"free_gib": free_gib()}
        s["old_gate_would_refuse"] = min(s["free_gib"]) < out["total_footprint_gib"] + 1
        try:
            t0 = time.perf_counter()
            res = node.restore(w, fallback=False)
            s["restore_s"] = round(time.perf_counter() - t0, 2)
            s["rank_gpus_after"] = [gpu_of(cuda_pids(res.pid)).get(p) for p in cuda_pids(res.pid)]
            s["bitexact"] = state(PORT) == before and peek(PORT) == want
            s["allreduce_ok"] = allreduce(PORT)
            s["restored"] = True
            os.kill(res.pid, signal.SIGKILL)
        except CkptflowError as e:
            s.update(restored=False, error=type(e).__name__, reason=str(e).splitlines()[0])
        out["sum"] = s
        log("sum", s)
    finally:
        if blocker is not None:
            blocker.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        criu.close()
    ok = (out.get("short", {}).get("refused") and "GPU" in out["short"].get("reason", "")
          and not out["short"].get("left_running") and out.get("sum", {}).get("restored")
          and out["sum"].get("bitexact") and out["sum"].get("allreduce_ok") and out["sum"].get("old_gate_would_refuse"))
    out["ok"] = bool(ok)
    record_run("gpu_gate", out)
    sh, su = out.get("short", {}), out.get("sum", {})
    table = md_table(["case", "free GiB per GPU", "per-GPU footprint GiB", "outcome", "detail"],
                     [["short (GPU 1 < rank 1's share)", sh.get("free_gib"), out.get("per_gpu_footprint_gib"),
                       "refused" if sh.get("refused") else "NOT refused", sh.get("reason")],
                      ["sum (GPU 0 fits rank 0, not the sum)", su.get("free_gib"), out.get("total_footprint_gib"),
                       "restored" if su.get("restored") else "NOT restored",
                       f"bit-exact {su.get('bitexact')}, allreduce {su.get('allreduce_ok')}, "
                       f"old gate would refuse {su.get('old_gate_would_refuse')}" if su.get("restored") else su.get("reason")]])
    print(table)
    append_results("GPU memory gate per GPU, TP=2 on two GPUs (bench/gpu_gate.py)", table, f"ok: {out['ok']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
