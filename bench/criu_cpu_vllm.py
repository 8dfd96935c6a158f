"""How long a whole-process heartbeat freezes a CPU vLLM, and where the time goes (issue #36,
finding 6: 7.75-8.85 s for a 2.4 GB image).

Usage (as root, after ./scripts/setup.sh; ~3 min on 2 cores):
    .venv/bin/python bench/criu_cpu_vllm.py [--dumps 3] [--warm-gib 0] [--busy]

One vLLM (the tests' seeded tiny Llama, CPU build, ckptflow's CPU_ENV) declared as a workload;
``--dumps`` heartbeats through NodeRunner.checkpoint (the path a fleet heartbeat takes) while a
poller asks ``/health`` every 20 ms. Per heartbeat: CRIU's whole run (``dump``), the pause the
heartbeat reports (CRIU's frozen time, from its stats-dump), its memdump and memwrite parts, the
pages written, the image, and the longest /health gap the poller saw (what a client felt).
``--warm-gib N`` first writes and deletes N GiB in /dev/shm: on a VM, pages the guest never
touched cost ~10x a reused one the first time, and a first heartbeat after boot pays that.
``--busy`` runs a generating client beside the dumps.

``--two-tier``: the same engine serving ckptflow's protocol (its middleware and KV connector) as
``checkpoint: template-sessions``, heartbeated through TemplateSessionsRunner: the first heartbeat
captures the template (a CRIU dump of the paused engine, once per version) and exports the session;
each later one follows a turn that grew the session and exports only its new blocks. Per heartbeat:
its pause (how long the engine was held), the bytes it moved and the longest /health gap. Whole
process, the freeze follows the footprint (no dirty tracking for CRIU's pre-dump on this kernel or
the GPU nodes'); two tiers, it follows what changed.

Appends to bench/results/criu_cpu_vllm.json and bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import append_results, md_table, record_run  # noqa: E402

PORT = 18311
GiB = 2**30


def _warm(gib: int) -> float:
    """Write and delete ``gib`` GiB in /dev/shm, so the dumps reuse pages the guest has touched."""
    t0 = time.perf_counter()
    block = b"\1" * (64 << 20)
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="ckptflow-warm-") as f:
        for _ in range(gib * 16):
            f.write(block)
        f.flush()
    return round(time.perf_counter() - t0, 2)


def _poll(url: str, stop: threading.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        try:
            urllib.request.urlopen(url + "/health", timeout=60).read()
        except OSError:
            pass
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        time.sleep(0.02)


def _generate(url: str, stop: threading.Event, done: list[int]) -> None:
    from ckptflow.engines import vllm

    rnd = random.Random(7)
    while not stop.is_set():
        try:
            vllm.complete(url, [rnd.randrange(3, 4000) for _ in range(300)], 64)
            done[0] += 1
        except Exception:  # noqa: BLE001 - a refused or cut request is counted, not fatal
            done[1] += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dumps", type=int, default=3)
    ap.add_argument("--warm-gib", type=int, default=0, help="GiB written and freed in /dev/shm before the engine starts")
    ap.add_argument("--busy", action="store_true", help="a generating client beside the dumps")
    ap.add_argument("--dir", default="/var/tmp", help="the store's directory (images written there)")
    ap.add_argument("--two-tier", action="store_true",
                    help="checkpoint: template-sessions (template once, then the session's new blocks)")
    a = ap.parse_args()
    if a.dumps < 1:
        ap.error(f"--dumps {a.dumps}: give at least 1")

    from ckptflow.engines import vllm
    from ckptflow.runners.criu import dump_stats
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.template_sessions import TemplateSessionsRunner
    from ckptflow.store.local import LocalStore

    inst = vllm.find_install()
    if inst is None:
        raise SystemExit("criu_cpu_vllm: no vLLM install: run ./scripts/setup.sh")
    root = Path(tempfile.mkdtemp(prefix="ckptflow-bench-vllm-", dir=a.dir))
    warm_s = _warm(a.warm_gib) if a.warm_gib else None
    rows = []
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        stack.enter_context(vllm.io_uring_off())   # start_server would leave it at 2 on this machine
        model = vllm.build_model(inst, root / "model")
        t0 = time.perf_counter()
        srv = vllm.start_server(inst, model.path, port=PORT, run_dir=root / "run", name="live", protocol=a.two_tier)
        stack.callback(vllm.kill_tree, srv.pid)
        start_s = round(time.perf_counter() - t0, 1)
        w = vllm.workload("bench-vllm", srv, model=model, inst=inst,
                          checkpoint="template-sessions" if a.two_tier else "process")
        rnd = random.Random(1)
        session = [rnd.randrange(3, 4000) for _ in range(1500)]
        session += vllm.complete(srv.url, session, 16, session="s1" if a.two_tier else None)["token_ids"]
        with NodeRunner(LocalStore(root / "store")) as node:
            runner = TemplateSessionsRunner(node) if a.two_tier else node
            for i in range(a.dumps):
                if a.two_tier and i:   # a turn between heartbeats: the session grows by ~2 blocks
                    session += [rnd.randrange(3, 4000) for _ in range(256)]
                    session += vllm.complete(srv.url, session, 16, session="s1")["token_ids"]
                stop, gaps, done = threading.Event(), [], [0, 0]
                threads = [threading.Thread(target=_poll, args=(srv.url, stop, gaps), daemon=True)]
                if a.busy:
                    threads.append(threading.Thread(target=_generate, args=(srv.url, stop, done), daemon=True))
                for t in threads:
                    t.start()
                time.sleep(1.5)
                t0 = time.perf_counter()
                m = runner.heartbeat(w) if a.two_tier else node.checkpoint(w)
                wall_s = round(time.perf_counter() - t0, 3)
                time.sleep(1.5)
                stop.set()
                for t in threads:
                    t.join(timeout=120)
                row = {"dump": i + 1, "pause_s": m.timings["pause"], "longest_health_gap_s": round(max(gaps), 3),
                       "requests_done": done[0]}
                if a.two_tier:
                    row.update(what="session", heartbeat_s=wall_s, template_timings=None, template_gib=None,
                               template_frozen_s=None,
                               session_tokens=runner._records(m)["sessions"]["s1"]["tokens"],
                               moved_mib=round(m.probe.export.moved_bytes / 2**20, 2))
                    if i == 0:   # the engine was held for the template's capture, not for the session
                        tmpl = node.store.get(m.probe.template.workload, m.probe.template.id)
                        frozen = (dump_stats(node.store.images_dir(tmpl)) or {}).get("frozen_time")
                        row.update(what="template + session", template_timings=tmpl.timings,
                                   pause_s=round(row["pause_s"] + tmpl.timings.get("pause", 0.0), 4),
                                   template_gib=round(tmpl.bytes / GiB, 3),
                                   template_frozen_s=round(frozen / 1e6, 3) if frozen else None)
                else:
                    st = dump_stats(node.store.images_dir(m)) or {}
                    row.update(dump_s=m.timings["dump"], memdump_s=round(st.get("memdump_time", 0) / 1e6, 3),
                               memwrite_s=round(st.get("memwrite_time", 0) / 1e6, 3),
                               pages_written=st.get("pages_written"), image_gib=round(m.bytes / GiB, 3))
                    node.store.delete(m)
                rows.append(row)
                print(rows[-1], flush=True)
    record_run("criu_cpu_vllm", {"images_on": a.dir, "warm_gib": a.warm_gib, "warm_s": warm_s, "busy": a.busy,
                                 "checkpoint": "template-sessions" if a.two_tier else "process",
                                 "engine_start_s": start_s, "vllm": inst.version, "rows": rows})
    client = "a generating client beside" if a.busy else "idle engine"
    if a.two_tier:
        table = md_table(["heartbeat", "what", "pause s", "heartbeat s", "template frozen s", "template GiB",
                          "session tokens", "moved MiB", "longest /health gap s", "client requests"],
                         [[r["dump"], r["what"], r["pause_s"], r["heartbeat_s"],
                           "—" if r["template_frozen_s"] is None else r["template_frozen_s"],
                           "—" if r["template_gib"] is None else r["template_gib"], r["session_tokens"], r["moved_mib"], r["longest_health_gap_s"],
                           r["requests_done"] if a.busy else "—"] for r in rows])
        print(table)
        append_results("A CPU vLLM's two-tier heartbeats (bench/criu_cpu_vllm.py --two-tier)", table,
                       f"vLLM {inst.version} CPU serving ckptflow's protocol, the tests' tiny Llama, "
                       f"VLLM_CPU_KVCACHE_SPACE=1, checkpoint: template-sessions; store on {a.dir}; "
                       f"a 256-token turn before each later heartbeat; {client}; engine start {start_s} s.")
        return
    table = md_table(["heartbeat", "CRIU run s", "pause (frozen) s", "memdump s", "memwrite s", "pages written",
                      "image GiB", "longest /health gap s", "client requests"],
                     [[r["dump"], r["dump_s"], r["pause_s"], r["memdump_s"], r["memwrite_s"], r["pages_written"],
                       r["image_gib"], r["longest_health_gap_s"], r["requests_done"] if a.busy else "—"] for r in rows])
    print(table)
    append_results("A CPU vLLM's heartbeat freeze (bench/criu_cpu_vllm.py)", table,
                   f"vLLM {inst.version} CPU, the tests' tiny Llama, VLLM_CPU_KVCACHE_SPACE=1; images on {a.dir}; "
                   f"{a.warm_gib} GiB of /dev/shm written and freed first; "
                   f"{client}; engine start {start_s} s.")


if __name__ == "__main__":
    main()
