"""llama.cpp's llama-server on CPU: the size and times of a whole-process checkpoint, and of one
session exported through its slot API (the figures the README's Engines section quotes).

Usage (as root, after ./scripts/setup.sh, which builds llama-server):
    .venv/bin/python bench/llamacpp_cpu.py [--size tiny] [--turns 2]

Builds the project's seeded random-weight model (``--size``), starts llama-server with two
slots, holds a conversation in slot 0 (``--turns`` turns), then: a heartbeat checkpoint (CRIU,
the server serves on), the slot saved as a session, a SIGKILL and a restore of the checkpoint
(its image checked, its health awaited). Appends the run to bench/results/llamacpp_cpu.json
(every run kept, with its date and command) and to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import append_results, md_table, record_run  # noqa: E402

from ckptflow.engines import llamacpp  # noqa: E402
from ckptflow.engines.llamacpp_model import build_model  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

TURNS = ["What is CRIU?", "And why does a GPU worker need it?", "What does a template hold?",
         "And the sessions?"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny", choices=("tiny", "1b", "3b", "8b"))
    ap.add_argument("--turns", type=int, default=2)
    a = ap.parse_args()
    inst = llamacpp.require_install("cpu")
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-llama-bench-"))
    srv = None
    try:
        model = tmp / "model.gguf"
        spec = build_model(model, seed=1234, size=a.size, gguf_py=inst.gguf_py, vocab=inst.vocab)
        srv = llamacpp.start_server(inst, model, port=_port(), run_dir=tmp / "run", name="bench", parallel=2)
        w = llamacpp.workload("bench", srv, inst=inst, model_id=spec.model_id, model_revision=spec.revision,
                              golden_slot=1)
        prompt = "You are a patient assistant in a very long conversation about checkpoints. " * 6
        for user in TURNS[:a.turns]:
            prompt += f"\nUser: {user}\nAssistant:"
            prompt += llamacpp.complete(srv.url, prompt, 24)["content"]
        store = LocalStore(tmp / "store")
        with NodeRunner(store) as node:
            m = node.checkpoint(w)
            sm = llamacpp.save_session(srv, store, "bench", node="local", slot=0)
            os.kill(srv.pid, signal.SIGKILL)
            res = node.restore(w)
        res_s = res.timings.get("restore_and_checksum", res.timings.get("restore"))
        run = record_run("llamacpp_cpu", {
            "model": spec.model_id, "size": a.size, "model_bytes": model.stat().st_size, "turns": a.turns,
            "checkpoint_bytes": m.bytes, "dump_s": m.timings["dump"], "restore_s": res_s,
            "restore_timings": res.timings, "session_bytes": sm.bytes, "session_tokens": getattr(sm.probe, "n_saved", None),
            "slot_save_s": sm.timings.get("slot_save")})
        table = md_table(["model", "checkpoint", "dump", "restore (CRIU + checksums)", "session (tokens)",
                          "session bytes"],
                         [[f"{a.size} ({run['model_bytes'] / 2**20:.0f} MiB)", f"{m.bytes / 2**20:.1f} MiB",
                           f"{m.timings['dump']:.3f} s", f"{res_s:.3f} s", run["session_tokens"],
                           f"{sm.bytes / 2**10:.0f} KiB"]])
        print(table)
        append_results("llama-server on CPU: checkpoint and slot session (bench/llamacpp_cpu.py)", table,
                       "Heartbeat checkpoint while serving (CRIU --leave-running, --tcp-established); slot 0 saved "
                       "through /slots?action=save; SIGKILL, then restore from the checkpoint.")
        return 0
    finally:
        if srv is not None:
            try:
                os.kill(srv.pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
