"""The turn-end export, live, on the vLLM-shaped GPU engine (issue #25 item 3): ``TurnWatch``
(runners/turns.py) against ckptflow/demo/llm_worker.py on the H200, as `ckptflow turns` runs it.

Steps: the engine with a few sessions, a heartbeat (template + every session); the heartbeat's
context for a node failing daily (what the heartbeat keeps for the loop); one session grows and
the loop exports it at its turn end in the engine's turn mode (only that session held), its
decision the one ``decide_sessions`` gives on the same facts; with a healthy node's context a
new session is listed without its KV; kill, restore in place: every exported session bit-exact
(session digests and the next 32 tokens), the listed one answered 410 "lost", then started
afresh when its client sends its history again.

Usage (GPU node, root; CRIU from the bundle):
    bench/on_device.sh python3 bench/gpu_turns_live.py [--layers 8]
Appends the run to bench/results/gpu_turns_live.json and to bench/RESULTS.md; exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_two_tier as G  # noqa: E402
from _common import append_results, md_table, record_run  # noqa: E402

from ckptflow.demo import launch  # noqa: E402
from ckptflow.models import ProcessFinder  # noqa: E402
from ckptflow.policies.sessions import ExportContext, decide_sessions, session_facts  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.runners.template_sessions import TemplateSessionsRunner  # noqa: E402
from ckptflow.runners.turns import TurnWatch  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

H = 3600.0


def records(store, m) -> dict:
    return json.loads((store.images_dir(m) / "sessions.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--images", default="/dev/shm")
    a = ap.parse_args()
    os.environ.setdefault("CKPTFLOW_CRIU_NETWORK_LOCK", "skip")
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-turns-", dir=a.images))
    weights = tmp / "weights.safetensors"
    subprocess.run([sys.executable, "-m", "ckptflow.demo.llm_worker", "--weights", str(weights), "--write-weights",
                    "--layers", str(a.layers)], check=True)
    pid_file = tmp / "w.pid"
    proc = G.start(weights, pid_file, ["--kv-gib", "8"])
    node = NodeRunner(LocalStore(tmp / "store"))
    out: dict = {"layers": a.layers}
    try:
        for i in range(3):
            launch.complete(G.PORT, G.prompt(i, 1500), 16, f"s{i}")
        import pynvml

        pynvml.nvmlInit()
        used = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / G.GiB
        w = launch.demo_workload("turns", G.PORT, pid_file).model_copy(update={
            "gpu": True, "gpu_footprint_gib": used + 1, "model_id": "ckptflow-demo-llm",
            "prepare_url": f"http://127.0.0.1:{G.PORT}/v1/ckptflow/prepare",
            "find": ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="ckptflow.demo.llm_worker")})
        tt = TemplateSessionsRunner(node)
        m1 = tt.heartbeat(w)
        daily = ExportContext(mtbf_s=24 * H, kv_bytes_per_token=65536.0)
        node.store.put_export_context(w.name, daily.model_dump_json())
        watch = TurnWatch(tt, w, every_s=0.5)
        watch.poll()
        launch.complete(G.PORT, G.prompt(7, 800), 8, "s0")               # a turn of s0
        watch.poll()                                                        # it moved: in a turn
        time.sleep(2.0)
        m2 = watch.poll()                                                   # unchanged since: turn over
        r1, r2 = records(node.store, m1)["sessions"], records(node.store, m2)["sessions"] if m2 else {}
        held = {k: r["tokens"] for k, r in r2.items()}
        want = decide_sessions(session_facts(held, r1, r2["s0"]["exported_at"]),
                               context=daily.model_copy(update={"at_turn_end": True})) if m2 else []
        out["turn_export"] = {
            "checkpoint": bool(m2), "changed": m2.probe.export.changed if m2 else None,
            "decisions": m2.probe.export.decisions if m2 else None,
            "engine_turn_mode": bool(m2 and m2.timings.get("turn") == 1.0),
            "held_s": m2.timings.get("held") if m2 else None, "export_s": m2.timings.get("export") if m2 else None,
            "moved_bytes": m2.probe.export.moved_bytes if m2 else None,
            "decisions_equal_the_rule": bool(m2) and all(m2.probe.export.decisions[d.id] == d.reason for d in want)}
        before = G.state()                  # what a restore must bring back (the listed one comes back lost)
        # A healthy node's context: a new session is listed, not exported.
        node.store.put_export_context(w.name, daily.model_copy(update={"mtbf_s": 6000 * H}).model_dump_json())
        launch.complete(G.PORT, G.prompt(8, 600), 8, "new")
        watch.poll()                                                        # first seen: its turn may go on
        m3 = watch.poll()                                                   # its first turn end: weighed
        out["listed"] = {"checkpoint": bool(m3), "listed": records(node.store, m3).get("listed") if m3 else None,
                         "decision": m3.probe.export.decisions.get("new") if m3 else None}
        G.kill(int(pid_file.read_text()), node)
        t0 = time.perf_counter()
        r = tt.restore(w)
        out["restore"] = {"checkpoint_is_the_turn_ends": r.manifest.id == (m3 or m2).id,
                          "restore_to_ready_s": round(time.perf_counter() - t0, 2), "bitexact": G.state() == before}
        code, body = launch.complete_status(G.PORT, "go on", 8, "new")
        again, _ = launch.complete_status(G.PORT, G.prompt(8, 600), 8, "new")
        out["lost"] = {"status": code, "error": body.get("error"), "resent_status": again}
    finally:
        G.stop(proc, pid_file)
        node.close()
    ok = (out["turn_export"]["changed"] == ["s0"] and out["turn_export"]["engine_turn_mode"]
          and out["turn_export"]["decisions_equal_the_rule"] and out["listed"]["listed"] == ["new"]
          and out["restore"]["bitexact"] and out["lost"]["status"] == 410 and out["lost"]["resent_status"] == 200)
    out["ok"] = ok
    print(json.dumps(out, indent=1))
    record_run("gpu_turns_live", out)
    append_results("Turn-end exports live on the vLLM-shaped engine (bench/gpu_turns_live.py)",
                   md_table(["check", "result"], [
                       ["s0 exported at its turn end, engine held only it (turn mode)",
                        f"{out['turn_export']['changed']}, turn mode {out['turn_export']['engine_turn_mode']}, "
                        f"held {out['turn_export']['held_s']} s"],
                       ["decision = decide_sessions on the same facts", out["turn_export"]["decisions_equal_the_rule"]],
                       ["healthy node: new session listed", out["listed"]["listed"]],
                       ["restore in place: bit-exact", f"{out['restore']['bitexact']} "
                        f"({out['restore']['restore_to_ready_s']} s)"],
                       ["listed session's next turn", f"{out['lost']['status']}: {out['lost']['error']}"],
                       ["its history sent again", out["lost"]["resent_status"]]]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
