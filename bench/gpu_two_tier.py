"""Two tiers on the H200, on a vLLM-shaped engine (ckptflow/demo/llm_worker.py): bf16 weights
from a safetensors file, a paged KV pool, CUDA graphs for batch 1/2/4/8, long sessions.

Rows (issue #13):
  A  a worker whose whole footprint fits twice in host memory (``--a-kv-gib`` pool + weights),
     checkpointed both ways: whole process (CUDA + CRIU) and two tiers;
  B  the same engine reserving 90 % of free GPU memory for its pool (vLLM's default): the
     whole-process path cannot run (the footprint must fit in host memory twice), so only
     two tiers.
  S  failover onto a standby (issue #25 item 1): the engine started isolated (``ckptflow
     run-isolated``: its own PID and mount namespaces, as a container), its template restored
     ahead of need beside it in namespaces of its own and parked (CUDA context and graphs back,
     no weights, no sessions); after the kill, restore-to-ready is ``promote`` only: the weights'
     stream and the session import, checked on the GPU. SB: the same with row B's pool.
     Since issue #25 item 1 ("stream >= 0.85 of the limit in every row") the standby takes
     weights and sessions in one call (template/resume with the sessions: one stream_in work list,
     weights first); SI / SBI: rows S / SB with that list interleaved (``--stream-order`` sets
     the order of the other rows). ``stream_s`` is the wall time of the engine calls that moved
     the bytes: ``load`` (one pass), or ``weights`` + ``sessions`` (an engine that took two).
Each row: cold start (process start, weights read, pool, graphs, re-prefill of every session),
template capture, a session heartbeat after one session grew by ``--changed-tokens``, a kill,
restore-to-ready, bit-exact check (session state digests and the next 32 tokens vs before the kill).

Usage (GPU node, root; CRIU from the bundle):
    bench/on_device.sh python3 bench/gpu_two_tier.py [--rows A,B --layers 43 --sessions 4 --tokens 1500]
Appends the run to bench/results/gpu_two_tier.json (every run kept, with date and command; a
--faults-only run holds only ``faults``) and to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
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

from ckptflow.demo import launch  # noqa: E402
from ckptflow.models import ProcessFinder  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.runners.template_sessions import TemplateSessionsRunner  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

PORT = 18651
GiB = 2**30

_LIMIT = """
import json, os, sys, time, torch
from ckptflow.demo.llm_worker import SLOT, HostBuf, read_header, stream_in
path = sys.argv[1]
header, off = read_header(path)
n = max(h["data_offsets"][1] for k, h in header.items() if k != "__metadata__")
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
p = HostBuf()
fd = os.open(path, os.O_RDONLY)
items = [(fd, off + o, o, min(SLOT, n - o), None) for o in range(0, n, SLOT)]
import ckptflow.demo.llm_worker as L
best = 0
for piece, ring in ((64 << 20, 2), (8 << 20, 3)):  # the notes' 64 MiB buffers, and the engine's slots
    L.PIECE, L.RING = piece, ring
    p.free()
    stream_in(items, dst, p)
    t0 = time.perf_counter(); stream_in(items, dst, p); torch.cuda.synchronize()
    best = max(best, n / 2**30 / (time.perf_counter() - t0))
print(json.dumps({"gib_s": best}))
"""


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def stream_seconds(timings: dict) -> float:
    """Wall time of the engine calls that brought weights and sessions in: ``load`` (one call,
    both in one pass) or ``weights`` + ``sessions`` (template/resume, then sessions/import)."""
    return round(timings.get("load", 0) + timings.get("weights", 0) + timings.get("sessions", 0), 2)


def state() -> tuple[dict, list[int], str]:
    peek = launch.http_json(f"http://127.0.0.1:{PORT}/v1/peek", {"prompt": "next", "max_tokens": 32,
                                                                 "session_id": "s0"})["tokens"]
    # sha256 of the weights' and every session's KV bytes: "bit-exact" means these bytes, not a sum
    full = launch.http_json(f"http://127.0.0.1:{PORT}/v1/ballast/digest", timeout_s=300)["digest"]
    return launch.session_digests(PORT), peek, full


def kill(pid: int, node: NodeRunner) -> None:
    os.kill(pid, signal.SIGKILL)
    node.criu.wait_pid_free(pid)


def start(weights: Path, pid_file: Path, pool: list[str], isolated: bool = False) -> subprocess.Popen:
    from ckptflow.runners.isolate import isolated_argv

    pid_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "ckptflow.demo.llm_worker", "--port", str(PORT), "--weights", str(weights), *pool]
    argv = isolated_argv(argv, pid_file, pid_file.with_suffix(".log")) if isolated else \
        argv[:5] + ["--pid-file", str(pid_file)] + argv[5:]
    proc = subprocess.Popen(argv,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(pid_file.with_suffix(".log"), "w"),
                            start_new_session=True, close_fds=True)
    launch.wait_healthy(f"http://127.0.0.1:{PORT}/health", 900, proc=proc)
    return proc


def stop(proc: subprocess.Popen, pid_file: Path) -> None:
    """Kill the engine we started and whatever a restore put under its pid file."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def prompt(i: int, n: int) -> str:
    return (f"session {i}: " + "abcdefghijklmnopqrstuvwxyz " * (n // 27 + 1))[:n]


def run_row(name: str, a, weights: Path, tmp: Path, pool: list[str], transparent: bool, host_gib: float) -> dict:
    pid_file = tmp / f"{name}.pid"
    row: dict = {"row": name}
    launch.require_free_port(PORT)
    t0 = time.perf_counter()
    proc = start(weights, pid_file, pool)
    node_box: list[NodeRunner] = []
    try:
        return _row(name, a, row, t0, pid_file, tmp, transparent, host_gib, node_box)
    finally:
        stop(proc, pid_file)
        for node in node_box:
            node.close()
            import shutil

            shutil.rmtree(node.store.root, ignore_errors=True)
        time.sleep(2)


def _row(name, a, row, t0, pid_file, tmp, transparent, host_gib, node_box) -> dict:
    for i in range(a.sessions):
        launch.complete(PORT, prompt(i, a.tokens), 16, f"s{i}")
    row["cold_start_s"] = round(time.perf_counter() - t0, 2)
    info = launch.http_json(f"http://127.0.0.1:{PORT}/v1/ckptflow/engine")
    row.update({k: info[k] for k in ("weights_gib", "pool_gib", "load_s", "graph_s", "start_s") if k in info})
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    used = pynvml.nvmlDeviceGetMemoryInfo(h).used / GiB
    row["reserved_gib"] = round(used, 1)
    w = launch.demo_workload(f"tt-{name.lower()}", PORT, pid_file).model_copy(update={
        "gpu": True, "gpu_footprint_gib": used + 1, "model_id": "ckptflow-demo-llm",
        "prepare_url": f"http://127.0.0.1:{PORT}/v1/ckptflow/prepare",
        "find": ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="ckptflow.demo.llm_worker")})
    store = LocalStore(tmp / f"store-{name}")
    node = NodeRunner(store)
    node_box.append(node)
    if transparent:
        before = state()
        m = node.checkpoint(w)
        row.update(transparent_pause_s=m.timings["pause"], transparent_image_gib=round(m.bytes / GiB, 2))
        kill(m.pid, node)
        t0 = time.perf_counter()
        node.restore(w)
        row["transparent_restore_s"] = round(time.perf_counter() - t0, 2)
        row["transparent_bitexact"] = state() == before
        node.store.delete(m)
    else:
        row.update(transparent_pause_s=None, transparent_restore_s=None, transparent_bitexact=None,
                   transparent_null_reason=(
                       f"{used:.0f} GiB on the GPU: the CUDA checkpoint brings it into the worker's host "
                       f"memory and CRIU writes it again ({2 * used:.0f} GiB) on a {host_gib:.0f} GiB host"))
    log(name, "transparent", row)
    tt = TemplateSessionsRunner(node)
    m1 = tt.heartbeat(w)
    tmpl = store.get(m1.probe.template.workload, m1.probe.template.id)
    row.update(template_capture=tmpl.timings, template_image_gib=round(tmpl.bytes / GiB, 2),
               template_gpu_gib=round(tmpl.gpu_footprint_bytes / GiB, 2),
               live_kv_gib=round(m1.probe.export.total_bytes / GiB, 3))
    launch.complete(PORT, prompt(99, a.changed_tokens), 1, "s0")          # one session grows
    m2 = tt.heartbeat(w)
    recs = json.loads((store.images_dir(m2) / "sessions.json").read_text())["sessions"]
    old = json.loads((store.images_dir(m1) / "sessions.json").read_text())["sessions"]
    new = {d for t in recs["s0"]["tensors"] for d in t["chunks"]} - {d for t in old["s0"]["tensors"]
                                                                    for d in t["chunks"]}
    row.update(session_pause_s=m2.timings["pause"], session_export_s=m2.timings["export"],
               session_bytes=m2.probe.export.moved_bytes, changed_chunk_bytes=tt.chunks.size(sorted(new)),
               changed_gib=round(tt.chunks.size(sorted(new)) / GiB, 3),
               changed_sessions=m2.probe.export.changed, live_kv_gib=round(m2.probe.export.total_bytes / GiB, 3))
    before = state()
    kill(int(pid_file.read_text()), node)
    t0 = time.perf_counter()
    r = tt.restore(w)
    row["restore_to_ready_s"] = round(time.perf_counter() - t0, 2)
    row["restore_phases"] = r.timings
    row["template_restore_s"] = round(r.timings.get("restore_and_checksum", r.timings.get("restore", 0))
                                      + r.timings.get("cuda_restore", 0) + r.timings.get("unlock", 0), 2)
    row["stream_s"] = stream_seconds(r.timings)
    moved = row.get("weights_gib", 0) + row["live_kv_gib"]
    row["stream_gib_s"] = round(moved / row["stream_s"], 2) if row["stream_s"] else None
    # The engine's keyed GPU hash of every weight chunk, after the stream (engines/gpuhash.py)
    checked = r.timings.get("weights_checked") or r.timings.get("load_weights_checked")
    if checked:
        row["weights_hash_gib_s"] = round(row.get("weights_gib", 0) / checked, 1)
    row["bitexact"] = state() == before
    row["chunk_hash"] = launch.http_json(f"http://127.0.0.1:{PORT}/v1/ckptflow/engine").get("chunk_hash")
    log(name, "two-tier", row)
    return row


def _in_ns(base: str, netns: str, path: str, body: dict | None = None, timeout_s: float = 300) -> dict:
    from ckptflow.engines.protocol_http import request_in_netns

    got = request_in_netns(netns, base + path, body, timeout_s)
    if "ok" not in got:
        raise RuntimeError(f"{path} in {netns}: {got}")
    return got["ok"]


def run_standby(name: str, a, weights: Path, tmp: Path, pool: list[str]) -> dict:
    """Row S/SB: failover onto a standby template restored ahead of need (see the docstring)."""
    from ckptflow.runners.verify import del_netns, new_netns

    pid_file = tmp / f"{name}.pid"
    row: dict = {"row": name}
    launch.require_free_port(PORT)
    t0 = time.perf_counter()
    proc = start(weights, pid_file, pool, isolated=True)
    store = LocalStore(tmp / f"store-{name}")
    node = NodeRunner(store)
    ns, sb = None, None
    try:
        for i in range(a.sessions):
            launch.complete(PORT, prompt(i, a.tokens), 16, f"s{i}")
        row["cold_start_s"] = round(time.perf_counter() - t0, 2)
        info = launch.http_json(f"http://127.0.0.1:{PORT}/v1/ckptflow/engine")
        row.update({k: info[k] for k in ("weights_gib", "pool_gib") if k in info})
        import pynvml

        pynvml.nvmlInit()
        used = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / GiB
        row["reserved_gib"] = round(used, 1)
        w = launch.demo_workload(f"tt-{name.lower()}", PORT, pid_file).model_copy(update={
            "gpu": True, "gpu_footprint_gib": used + 1, "model_id": "ckptflow-demo-llm",
            "prepare_url": f"http://127.0.0.1:{PORT}/v1/ckptflow/prepare",
            "find": ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="ckptflow.demo.llm_worker")})
        tt = TemplateSessionsRunner(node)
        tt.heartbeat(w)
        ns = new_netns("ckstandby")
        t0 = time.perf_counter()
        sb = tt.standby(w, ns)
        row["standby_s"] = round(time.perf_counter() - t0, 2)
        row["standby_phases"] = sb.timings
        row["standby_gpu_gib"] = round(sb.template.gpu_footprint_bytes / GiB, 2)
        launch.complete(PORT, prompt(99, a.changed_tokens), 1, "s0")          # one session grows, after the standby
        m2 = tt.heartbeat(w)
        row.update(session_pause_s=m2.timings["pause"], live_kv_gib=round(m2.probe.export.total_bytes / GiB, 3))
        before = state()
        import threading

        h0, freed, stop_watch = pynvml.nvmlDeviceGetHandleByIndex(0), {}, threading.Event()
        victim = int(pid_file.read_text())

        def watch() -> None:  # on one GPU the killed original's teardown overlaps the promotion
            while not stop_watch.is_set():
                if victim not in {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h0)}:
                    freed["s"] = round(time.perf_counter() - t0, 3)
                    return
                time.sleep(0.005)

        row["original_seen_by_nvml"] = victim in {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h0)}
        os.kill(victim, signal.SIGKILL)
        t0 = time.perf_counter()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        node.criu.wait_pid_free(victim)
        r = tt.promote(w, sb)
        row["restore_to_ready_s"] = round(time.perf_counter() - t0, 2)
        watcher.join(timeout=30)
        stop_watch.set()
        row["original_gpu_memory_freed_s"] = freed.get("s")
        row["restore_phases"] = r.timings
        row["stream_s"] = stream_seconds(r.timings)
        moved = row.get("weights_gib", 0) + row["live_kv_gib"]
        row["stream_gib_s"] = round(moved / row["stream_s"], 2) if row["stream_s"] else None
        peek = _in_ns(sb.base, ns, "/v1/peek", {"prompt": "next", "max_tokens": 32, "session_id": "s0"})["tokens"]
        after = (_in_ns(sb.base, ns, "/v1/sessions/digests")["sessions"], peek,
                 _in_ns(sb.base, ns, "/v1/ballast/digest")["digest"])
        row["bitexact"] = after == before
        row["chunk_hash"] = _in_ns(sb.base, ns, "/v1/ckptflow/engine").get("chunk_hash")
        log(name, "standby", row)
        return row
    finally:
        if sb is not None:
            sb.copy.stop()
        if ns:
            del_netns(ns)
        stop(proc, pid_file)
        node.close()
        import shutil

        shutil.rmtree(store.root, ignore_errors=True)
        time.sleep(2)


def run_faults(a, weights: Path, tmp: Path) -> dict:
    """Torn chunks on the real engine: a torn session chunk is refused before any CRIU call; a
    torn weight chunk is caught by the engine's GPU check and the half-restored copy killed;
    with the chunk repaired the same checkpoint restores bit-exact."""
    from ckptflow.errors import ChecksumMismatch, CkptflowError
    from ckptflow.runners import process

    pid_file = tmp / "F.pid"
    launch.require_free_port(PORT)
    proc = start(weights, pid_file, ["--kv-gib", "4"])
    node = NodeRunner(LocalStore(tmp / "store-F"))
    out: dict = {}
    try:
        for i in range(2):
            launch.complete(PORT, prompt(i, 300), 8, f"s{i}")
        w = launch.demo_workload("tt-f", PORT, pid_file).model_copy(update={
            "gpu": True, "gpu_footprint_gib": 12, "model_id": "ckptflow-demo-llm",
            "prepare_url": f"http://127.0.0.1:{PORT}/v1/ckptflow/prepare",
            "find": ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="ckptflow.demo.llm_worker")})
        tt = TemplateSessionsRunner(node)
        m = tt.heartbeat(w)
        before = state()
        kill(int(pid_file.read_text()), node)
        recs = json.loads((node.store.images_dir(m) / "sessions.json").read_text())["sessions"]
        tmpl = node.store.get(m.probe.template.workload, m.probe.template.id)
        wrec = json.loads((node.store.images_dir(tmpl) / "weights.json").read_text())

        def tear(digest: str) -> bytes:
            p = tt.chunks.path(digest)
            raw = p.read_bytes()
            p.chmod(0o600)
            p.write_bytes(raw[:1000] + bytes([raw[1000] ^ 0xFF]) + raw[1001:])
            return raw

        for case, digest in (("session", recs["s0"]["tensors"][0]["chunks"][0]), ("weights", wrec[0]["chunks"][3])):
            raw = tear(digest)
            try:
                tt.restore(w)
                out[case] = "NOT REFUSED"
            except ChecksumMismatch as e:
                out[case] = f"refused before CRIU: {e.message[:120]}"
            except CkptflowError as e:
                out[case] = f"failed after CRIU: {e.message[:160]}"
            try:
                out[case + "_left_running"] = process.resolve(w).pid
            except CkptflowError:
                out[case + "_left_running"] = None
            tt.chunks.path(digest).write_bytes(raw)
        tt.restore(w)
        out["repaired_bitexact"] = state() == before
        log("faults", out)
    finally:
        stop(proc, pid_file)
        node.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="A,B")
    ap.add_argument("--layers", type=int, default=43, help="43 layers = 16.1 GiB of bf16 weights")
    ap.add_argument("--a-kv-gib", type=float, default=20)
    ap.add_argument("--b-kv-fraction", type=float, default=0.9)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--changed-tokens", type=int, default=1490, help="1490 tokens x 43 layers = 1 GiB of KV")
    ap.add_argument("--images", default="/dev/shm")
    ap.add_argument("--faults-only", action="store_true", help="only the torn-chunk cases (small weights)")
    ap.add_argument("--no-transparent", action="store_true", help="row A without the whole-process path (it takes minutes)")
    ap.add_argument("--stream-order", default="weights-first", choices=("weights-first", "interleave"),
                    help="the one-pass resume's work list (rows SI/SBI: interleave)")
    a = ap.parse_args()
    os.environ.setdefault("CKPTFLOW_CRIU_NETWORK_LOCK", "skip")
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-2t-", dir=a.images))
    weights = tmp / "weights.safetensors"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ckptflow.demo.llm_worker", "--weights", str(weights), "--write-weights",
                    "--layers", str(a.layers)], check=True)
    log(f"weights written: {weights.stat().st_size / GiB:.1f} GiB in {time.perf_counter() - t0:.1f} s")
    limit = json.loads(subprocess.run([sys.executable, "-c", _LIMIT, str(weights)], check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1])["gib_s"]
    log(f"stream limit file -> GPU (no hashing): {limit:.1f} GiB/s")
    if a.faults_only:
        faults = run_faults(a, weights, tmp)
        record_run("gpu_two_tier", {"engine": "ckptflow.demo.llm_worker", "layers": a.layers, "faults": faults})
        ok = faults.get("repaired_bitexact") and not faults.get("session_left_running") \
            and not faults.get("weights_left_running") and faults["session"].startswith("refused before CRIU") \
            and "torn" in faults["weights"]
        print(json.dumps(faults, indent=1))
        append_results("Two tiers: torn chunks on the vLLM-shaped engine (bench/gpu_two_tier.py --faults-only)",
                       md_table(["case", "outcome", "left running"],
                                [[c, faults[c], faults[f"{c}_left_running"]] for c in ("session", "weights")]),
                       f"With the chunks repaired, the same checkpoint restores bit-exact: {faults['repaired_bitexact']}.")
        return 0 if ok else 1
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    rows, failed = [], []
    for name in a.rows.split(","):
        base = {"SI": "S", "SBI": "SB"}.get(name, name)
        order = "interleave" if name != base else a.stream_order
        pool = ["--kv-gib", str(a.a_kv_gib)] if base in ("A", "S") else ["--kv-fraction", str(a.b_kv_fraction)]
        pool += ["--stream-order", order]   # the engine's own (a restored copy keeps it)
        try:
            if base in ("S", "SB"):
                row = run_standby(name, a, weights, tmp, pool)
            else:
                row = run_row(name, a, weights, tmp, pool, transparent=(name == "A" and not a.no_transparent),
                              host_gib=host_gib)
        except Exception as e:  # the other rows still run and are kept; the run exits 1
            import traceback

            traceback.print_exc()
            failed.append({"row": name, "stream_order": order, "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        row["stream_order"] = order
        row["stream_limit_gib_s"] = round(limit, 1)
        row["stream_of_limit"] = round(row["stream_gib_s"] / limit, 2) if row.get("stream_gib_s") else None
        rows.append(row)
    import pynvml

    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    out = {"gpu": gpu, "engine": "ckptflow.demo.llm_worker", "layers": a.layers, "sessions": a.sessions,
           "tokens_per_session": a.tokens, "changed_tokens": a.changed_tokens, "rows": rows,
           **({"failed_rows": failed} if failed else {})}
    record_run("gpu_two_tier", out)

    def f(v):
        return "null" if v is None else v

    table = md_table(["row", "reserved GiB", "weights GiB", "live KV GiB", "changed GiB", "stream limit GiB/s",
                      "transparent restore s", "transparent pause s", "template restore s (standby, ahead of need)",
                      "stream s (GiB/s, of limit)", "restore-to-ready s", "session pause s",
                      "session bytes (changed chunks)", "cold start s", "GPU hash of weights GiB/s",
                      "bit-exact (transparent / two-tier)"],
                     [[r["row"], r["reserved_gib"], r.get("weights_gib"), r["live_kv_gib"], f(r.get("changed_gib")),
                       r["stream_limit_gib_s"], f(r.get("transparent_restore_s")), f(r.get("transparent_pause_s")),
                       r["template_restore_s"] if "template_restore_s" in r else f"({r['standby_s']})",
                       f"{r['stream_s']} ({r['stream_gib_s']}, {r['stream_of_limit']})", r["restore_to_ready_s"],
                       r["session_pause_s"], f"{f(r.get('session_bytes'))} ({f(r.get('changed_chunk_bytes'))})",
                       r["cold_start_s"], f(r.get("weights_hash_gib_s")),
                       f"{f(r.get('transparent_bitexact'))} / {r['bitexact']}"] for r in rows])
    print(table)
    append_results(f"Two tiers vs the whole process on {gpu}, vLLM-shaped engine (bench/gpu_two_tier.py)", table,
                   "; ".join(f"row {r['row']}: " + (
                       f"template capture {r['template_capture']}, template image {r['template_image_gib']} GiB "
                       f"(GPU state {r['template_gpu_gib']} GiB), " if "template_capture" in r else
                       f"standby (template restored ahead of need, parked; {r['standby_gpu_gib']} GiB on the GPU) "
                       f"{r['standby_phases']}, ") + f"restore phases {r['restore_phases']}"
                       + (f", transparent null: {r['transparent_null_reason']}" if r.get("transparent_null_reason") else "")
                       for r in rows) + "".join(f"; row {r['row']} FAILED: {r['error'][:300]}" for r in failed))
    ok = not failed and all(r["bitexact"] and r.get("transparent_bitexact") in (True, None) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
