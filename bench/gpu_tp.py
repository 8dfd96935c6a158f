"""Tensor-parallel worker checkpoint: all ranks locked, checkpointed, dumped and restored together.

Usage (on the GPU node, as root, CRIU >= 4.2 reachable via CKPTFLOW_CRIU or PATH):
    python3 bench/gpu_tp.py --configs gloo:2:4,nccl:1:4 [--images /dev/shm]

A config is BACKEND:WORLD_SIZE:BALLAST_GIB_PER_RANK[:swap]. ``swap`` restores onto swapped GPUs
(rank r's GPU i -> GPU (i+1) mod n) through the driver's UUID remapping, and checks in NVML that
each rank now runs on the other GPU. With one GPU, ``gloo:2`` puts both ranks on
the same device (NCCL refuses that): the all-ranks path — two CUDA processes in one tree,
established TCP between them, an all-reduce per layer — with gloo's collectives instead of
NCCL's. ``nccl:1`` is NCCL's dry run on one GPU. ``nccl:2`` needs two GPUs
(nvidia-h200-x2). Every rank runs with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0
USE_LIBUV=0 (policies.multigpu).

Per config: heartbeat (lock all -> checkpoint all -> CRIU dump of the tree -> restore all ->
unlock all; the worker serves on), then a kill of rank 0 (the other ranks die with it) and a
restore of the whole tree. ``bitexact``: session KV digests of every rank and the ballast equal
those before the checkpoint, and the next tokens equal the reference computed before it;
``allreduce_ok``: a collective across all ranks gives the right sum after the restore.
Also checks the refusal: a TP worker started without the NCCL settings is not touched.
Appends the run to bench/results/gpu_tp.json (every run kept, with date and command; a run holds
only the configs it ran) and to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
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
from ckptflow.errors import UnsupportedWorkload  # noqa: E402
from ckptflow.policies.multigpu import NCCL_REQUIRED  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.runners.criu import CriuRunner  # noqa: E402
from ckptflow.runners.cuda import cuda_pids  # noqa: E402
from ckptflow.runners.process import pid_alive  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

PORT = 18601
TURNS = ["You are a coding agent working across two GPUs. " * 10, "Tool output: " + "ok\n" * 40]


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def base(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def state(port: int) -> dict:
    return {"sessions": launch.session_digests(port),
            "ballast": launch.http_json(f"{base(port)}/v1/ballast/digest", timeout_s=300)}


def peek(port: int) -> list[int]:
    return launch.http_json(f"{base(port)}/v1/peek", {"prompt": "continue", "max_tokens": 48,
                                                      "session_id": "agent"})["tokens"]


def allreduce(port: int) -> bool:
    return bool(launch.http_json(f"{base(port)}/v1/allreduce", {})["ok"])


def start(name: str, backend: str, world: int, ballast: float, tmp: Path, nccl_env: bool):
    for k, v in NCCL_REQUIRED.items():
        if nccl_env:
            os.environ[k] = v
        else:
            os.environ.pop(k, None)
    pid_file = tmp / f"{name}.pid"
    t0 = time.perf_counter()
    try:
        proc = launch.start_tp_worker(PORT, pid_file, world_size=world, backend=backend, ballast_gib=ballast)
    except Exception:
        # The worker's stdio is /dev/null (CRIU-friendly); run it again in the open to see why.
        import subprocess

        try:
            got = subprocess.run([sys.executable, "-m", "ckptflow.demo.tp_worker", "--port", str(PORT + 1),
                                  "--world-size", str(world), "--backend", backend, "--ballast-gib", str(ballast)],
                                 capture_output=True, text=True, timeout=90)
            said = got.stdout + got.stderr
        except subprocess.TimeoutExpired as e:
            said = "(still running after 90 s) " + str(e.stdout or "") + str(e.stderr or "")
        log(f"worker failed to start; in the open it said:\n{said[-3000:]}")
        raise
    for turn in TURNS:
        launch.complete(PORT, turn, 48, "agent")
    cold = time.perf_counter() - t0
    w = launch.tp_workload(name, PORT, pid_file, world, footprint_gib=world * (ballast + 1))
    return proc, w, cold


def gpu_of(pids: list[int]) -> dict[int, int]:
    """PID -> index of the physical GPU it holds memory on (NVML)."""
    import pynvml

    out = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
            if p.pid in pids:
                out[p.pid] = i
    return out


def swap_pairs() -> list[tuple[str, str]]:
    import pynvml

    n = pynvml.nvmlDeviceGetCount()
    uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
    uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]
    return [(uuids[i], uuids[(i + 1) % n]) for i in range(n)]


def run_config(backend: str, world: int, ballast: float, images_root: Path, tmp: Path, swap: bool = False) -> dict:
    row: dict = {"config": f"{backend}:{world}:{ballast:g}" + (":swap" if swap else ""), "backend": backend,
                 "world_size": world, "ballast_gib_per_rank": ballast, "swapped_gpus": swap}
    # CRIU's logs stay where --criu-logs says (default: removed with the runner), for a failed restore.
    criu = CriuRunner(log_dir=os.environ.get("CKPTFLOW_BENCH_CRIU_LOGS") or None)
    proc, w, cold = start(f"tp-{backend}-{world}", backend, world, ballast, tmp, nccl_env=True)
    try:
        return _run(row, criu, proc, w, cold, images_root, swap)
    finally:  # whatever happened, no rank keeps holding the GPU for the next config
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # CRIU restores the process group with the tree
        except ProcessLookupError:
            pass
        criu.close()


def _run(row: dict, criu: CriuRunner, proc, w, cold: float, images_root: Path, swap: bool = False) -> dict:
    row["cold_start_s"] = round(cold, 2)
    pids = cuda_pids(int(Path(w.find.pid_file).read_text()))
    row["gpu_processes"] = len(pids)
    where = gpu_of(pids)
    row["rank_gpus_before"] = [where.get(p) for p in pids]
    before, want = state(PORT), peek(PORT)
    row["allreduce_before"] = allreduce(PORT)
    node = NodeRunner(LocalStore(images_root / "store"), criu=criu)
    m = node.checkpoint(w)
    row.update(pause_s=m.timings["pause"], heartbeat_phases=m.timings, image_gib=round(m.bytes / 2**30, 2),
               gpu_footprint_gib=round(m.gpu_footprint_bytes / 2**30, 2))
    row["serving_after_heartbeat"] = state(PORT) == before and peek(PORT) == want and allreduce(PORT)
    log(f"{row['config']}: heartbeat {m.timings}; serving after: {row['serving_after_heartbeat']}")
    os.kill(m.pid, signal.SIGKILL)  # rank 0; the others follow (PR_SET_PDEATHSIG)
    proc.wait()
    for p in pids:
        criu.wait_pid_free(p)
    pairs = swap_pairs() if swap else None
    row["gpu_pairs"] = pairs
    t0 = time.perf_counter()
    res = node.restore(w, gpu_pairs=pairs)
    row["restore_to_ready_s"] = round(time.perf_counter() - t0, 2)
    where = gpu_of(pids)
    row["rank_gpus_after"] = [where.get(p) for p in pids]
    if swap:
        n = len(pairs)
        row["moved_as_asked"] = all(a is not None and b == (a + 1) % n
                                    for a, b in zip(row["rank_gpus_before"], row["rank_gpus_after"]))
    row["restore_phases"] = res.timings
    row["restored_gpu_processes"] = len(cuda_pids(res.pid))
    after = state(PORT)
    row["allreduce_ok"] = allreduce(PORT)
    got = launch.complete(PORT, "continue", 48, "agent")
    row["bitexact"] = after == before and got == want
    log(f"{row['config']}: restore {res.timings} -> ready {row['restore_to_ready_s']} s, bitexact {row['bitexact']}, "
        f"allreduce {row['allreduce_ok']}")
    restored = cuda_pids(res.pid)
    os.kill(res.pid, signal.SIGKILL)
    for p in restored:
        criu.wait_pid_free(p)
    node.store.delete(m)
    return row


def refusal(images_root: Path, tmp: Path) -> dict:
    """A TP worker started without the NCCL settings: refused before any lock, serving on."""
    proc, w, _ = start("tp-unready", "gloo", 2, 0.5, tmp, nccl_env=False)
    node = NodeRunner(LocalStore(images_root / "refuse"))
    try:
        node.checkpoint(w)
        out = {"refused": False, "reason": "checkpoint went ahead"}
    except UnsupportedWorkload as e:
        out = {"refused": True, "reason": str(e).splitlines()[0]}
    out["serving_after"] = allreduce(PORT) and bool(launch.complete(PORT, "still there", 8, "agent"))
    out["no_checkpoint"] = node.store.list(w.name) == []
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log(f"refusal: {out}")
    return out


def failure_after_lock(images_root: Path, tmp: Path) -> dict:
    """CRIU fails after every rank was locked and CUDA-checkpointed: every rank must come back
    (CUDA restore + unlock) and serve on, with no checkpoint left behind."""
    real = shutil.which(os.environ.get("CKPTFLOW_CRIU", "criu"))
    fake = tmp / "criu-fails-dump"
    fake.write_text(f'#!/bin/sh\n[ "$1" = dump ] && {{ echo "Error (simulated): dump failed" >&2; exit 1; }}\n'
                    f'exec {real} "$@"\n')
    fake.chmod(0o755)
    proc, w, _ = start("tp-fail", "gloo", 2, 1, tmp, nccl_env=True)
    pids = cuda_pids(int(Path(w.find.pid_file).read_text()))
    before, want = state(PORT), peek(PORT)
    node = NodeRunner(LocalStore(images_root / "fail"), criu=CriuRunner(criu_bin=str(fake)))
    try:
        node.checkpoint(w)
        out = {"raised": None}
    except Exception as e:
        out = {"raised": type(e).__name__}
    from cuda.bindings import driver as d

    d.cuInit(0)
    out["rank_states"] = [str(d.cuCheckpointProcessGetState(p)[1]).split(".")[-1] for p in pids]
    out["serving_after"] = state(PORT) == before and peek(PORT) == want and allreduce(PORT)
    out["no_checkpoint"] = node.store.list(w.name) == []
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log(f"failure after lock: {out}")
    return out


def heartbeat_under_load(images_root: Path, tmp: Path, backend: str) -> dict:
    """A heartbeat arriving while a long generation runs: the quiesce waits for the request to
    finish (every rank idle on the CPU ring), the lock then succeeds, and the request's tokens
    equal the same request on an untouched worker."""
    import threading

    proc, w, _ = start(f"tp-busy-{backend}", backend, 2, 0.5, tmp, nccl_env=True)
    node = NodeRunner(LocalStore(images_root / "busy"))
    out: dict = {"backend": backend}
    try:
        want = launch.complete(PORT, "a long answer", 200, "ref")
        got: list = []
        th = threading.Thread(target=lambda: got.append(launch.complete(PORT, "a long answer", 200, "busy")))
        th.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        m = node.checkpoint(w)
        out.update(heartbeat_s=round(time.perf_counter() - t0, 2), prepare_s=m.timings.get("prepare"),
                   pause_s=m.timings["pause"])
        th.join(timeout=300)
        out["request_tokens_equal"] = bool(got) and got[0] == want
        out["serving_after"] = allreduce(PORT) and bool(launch.complete(PORT, "still there", 8, "agent"))
        out["ok"] = out["request_tokens_equal"] and out["serving_after"]
    except Exception as e:
        out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:800]}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log(f"heartbeat under load: {out}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="gloo:2:4,nccl:1:4")
    ap.add_argument("--images", default="/dev/shm")
    ap.add_argument("--busy-backend", default="", help="also heartbeat a TP=2 worker of this backend while "
                    "a long generation is in flight (the quiesce must wait for it, not fail the lock)")
    ap.add_argument("--watchdog-s", type=float, default=0, help="dump this script's stacks and exit after N s")
    a = ap.parse_args()
    if a.watchdog_s:
        import faulthandler

        faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-tp-"))
    images_root = Path(tempfile.mkdtemp(prefix="ckptflow-tpimg-", dir=a.images))
    os.environ.setdefault("CKPTFLOW_CRIU_NETWORK_LOCK", "skip")  # every TCP peer is inside the dumped tree
    import pynvml

    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    driver, n_gpus = pynvml.nvmlSystemGetDriverVersion(), pynvml.nvmlDeviceGetCount()
    rows, errors = [], {}
    try:
        for c in a.configs.split(","):
            backend, world, ballast, *flags = c.split(":")
            try:
                rows.append(run_config(backend, int(world), float(ballast), images_root, tmp, swap="swap" in flags))
            except Exception as e:  # keep going: one config's failure is a result too
                log(f"{c}: FAILED {type(e).__name__}: {e}")
                errors[c] = f"{type(e).__name__}: {str(e)[:1500]}"
        busy = heartbeat_under_load(images_root, tmp, a.busy_backend) if a.busy_backend else None
        ref = refusal(images_root, tmp)
        fail = failure_after_lock(images_root, tmp)
    finally:
        shutil.rmtree(images_root, ignore_errors=True)
    record_run("gpu_tp", {"gpu": gpu, "gpus": n_gpus, "driver": driver, "images_on": a.images,
                          "network_lock": os.environ["CKPTFLOW_CRIU_NETWORK_LOCK"], "rows": rows, "errors": errors,
                          "refusal": ref, "failure_after_lock": fail, "heartbeat_under_load": busy})
    headers = ["config", "GPU procs", "rank GPUs before → after", "image GiB", "pause s", "restore-to-ready s", "cold start s",
               "serving after heartbeat", "all-reduce after restore", "bit-exact"]
    table = md_table(headers, [[r["config"], r["gpu_processes"],
                                f"{r.get('rank_gpus_before')} → {r.get('rank_gpus_after')}", r["image_gib"], r["pause_s"], r["restore_to_ready_s"],
                                r["cold_start_s"], r["serving_after_heartbeat"], r["allreduce_ok"], r["bitexact"]]
                               for r in rows])
    notes = "\n".join([f"- {r['config']}: heartbeat {r['heartbeat_phases']}; restore {r['restore_phases']}" for r in rows]
                      + [f"- {c}: FAILED {e.splitlines()[0][:300]}" for c, e in errors.items()]
                      + [f"- refusal of a TP worker without NCCL settings: {ref}",
                         f"- CRIU dump failing after both ranks were locked and checkpointed: {fail}",
                         f"- heartbeat while a long generation is in flight: {busy}"])
    print(table)
    print(notes)
    append_results(f"Tensor-parallel checkpoint on {n_gpus}× {gpu}, driver {driver} (bench/gpu_tp.py)", table,
                   f"Images on {a.images}; CRIU network lock {os.environ['CKPTFLOW_CRIU_NETWORK_LOCK']}. "
                   f"Config = backend:ranks:ballast GiB per rank. Phases (s):\n{notes}")
    ok = (rows and all(r["bitexact"] and r["allreduce_ok"] and r.get("moved_as_asked", True) for r in rows)
          and not errors and ref["refused"] and (busy is None or busy["ok"])
          and fail["raised"] == "CriuError" and fail["serving_after"] and fail["no_checkpoint"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
