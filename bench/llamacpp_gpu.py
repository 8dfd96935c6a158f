"""llama.cpp's llama-server with every layer on the GPU (-ngl 99), checkpointed by the GPU path
(CUDA driver lock/checkpoint + CRIU), killed, restored; the next turn is compared token for
token with a reference server that was never interrupted.

Usage (on the GPU node, as root; no registry needed):
    bench/on_device.sh python3 bench/llamacpp_gpu.py --size 1b [--src .carry/llama-src.tar.xz]

``--src``: a llama.cpp tree (tar.xz of .ckptflow/llama.cpp/src-<version>, extracted here from
the hash-checked sdist) for nodes that cannot reach PyPI; the CUDA build then runs
scripts/install-llamacpp.sh --cuda on it. Appends the run to bench/results/llamacpp_gpu.json (every run kept) and to
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import append_results, md_table, record_run  # noqa: E402

from ckptflow.engines import llamacpp  # noqa: E402
from ckptflow.engines.llamacpp_model import build_model  # noqa: E402
from ckptflow.runners.node import NodeRunner  # noqa: E402
from ckptflow.store.local import LocalStore  # noqa: E402

SYSTEM = "You are a patient assistant in a very long conversation about checkpoints. " * 20
TURNS = ["What is CRIU?", "And why does a GPU worker need it?", "Say more about the KV cache."]


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


class Chat:
    """A conversation held as token ids (the server's cached prefix is exactly the last prompt
    plus what it generated)."""

    def __init__(self, srv, system: str):
        self.tokens = [1] + self.tok(srv, system)

    @staticmethod
    def tok(srv, text: str) -> list[int]:
        return llamacpp.http_json(srv.url + "/tokenize", {"content": text, "add_special": False})["tokens"]

    def turn(self, srv, user: str, n: int = 48) -> dict:
        prompt = self.tokens + self.tok(srv, f"\nUser: {user}\nAssistant:")
        out = llamacpp.http_json(srv.url + "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0,
                                                           "cache_prompt": True, "id_slot": 0, "return_tokens": True})
        self.tokens = prompt + out["tokens"]
        return out


def build(src: str | None) -> float:
    t0 = time.perf_counter()
    if llamacpp.find_install("cuda") is None:
        if src:
            dest = ROOT / ".ckptflow" / "llama.cpp"
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(src) as t:
                t.extractall(dest)
        env = {**os.environ, "CKPTFLOW_LLAMACPP_CMAKE_ARGS": os.environ.get(
            "CKPTFLOW_LLAMACPP_CMAKE_ARGS", "-G Ninja -DGGML_CUDA_FA=OFF")}
        subprocess.run([str(ROOT / "scripts" / "install-llamacpp.sh"), "--cuda"], check=True, env=env)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1b")
    ap.add_argument("--src", default=None)
    ap.add_argument("--images", default="/dev/shm")
    a = ap.parse_args()
    build_s = build(a.src)
    inst = llamacpp.require_install("cuda")
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-llama-", dir=a.images))
    t0 = time.perf_counter()
    spec = build_model(tmp / "model.gguf", size=a.size, seed=1234, gguf_py=inst.gguf_py, vocab=inst.vocab)
    row: dict = {"size": a.size, "model_gib": round((tmp / "model.gguf").stat().st_size / 2**30, 2),
                 "model_build_s": round(time.perf_counter() - t0, 1), "llama_build_s": round(build_s, 1)}
    kw = dict(parallel=2, gpu_layers=99, ctx=8192, threads=4)
    t0 = time.perf_counter()
    live = llamacpp.start_server(inst, tmp / "model.gguf", port=18711, run_dir=tmp / "run", name="live", **kw)
    row["cold_start_s"] = round(time.perf_counter() - t0, 2)
    ref = llamacpp.start_server(inst, tmp / "model.gguf", port=18712, run_dir=tmp / "run", name="ref", **kw)
    store = LocalStore(tmp / "store")
    try:
        c_live, c_ref = Chat(live, SYSTEM), Chat(ref, SYSTEM)
        for u in TURNS:
            assert c_live.turn(live, u)["tokens"] == c_ref.turn(ref, u)["tokens"], "servers disagree before"
        w = llamacpp.workload("chat", live, inst=inst, model_id=spec.model_id, model_revision=spec.revision,
                              golden_slot=1).model_copy(update={"gpu": True})
        with NodeRunner(store) as node:
            m = node.checkpoint(w)
            row.update(heartbeat=m.timings, image_gib=round(m.bytes / 2**30, 3),
                       gpu_footprint_gib=round(m.gpu_footprint_bytes / 2**30, 2))
            a1, b1 = c_live.turn(live, "Go on."), c_ref.turn(ref, "Go on.")
            row["serving_after_heartbeat"] = a1["tokens"] == b1["tokens"]
            log("heartbeat", m.timings, "serving on:", row["serving_after_heartbeat"])
            m = node.checkpoint(w)  # the checkpoint the restore comes back to: after "Go on."
            os.kill(live.pid, signal.SIGKILL)
            node.criu.wait_pid_free(m.pid)
            t0 = time.perf_counter()
            res = node.restore(w)
            row["restore_to_ready_s"] = round(time.perf_counter() - t0, 2)
            row["restore"] = res.timings
            a2, b2 = c_live.turn(live, "And then?"), c_ref.turn(ref, "And then?")
            row["bitexact"] = a2["tokens"] == b2["tokens"]
            row["prompt_n_after_restore"] = a2["timings"]["prompt_n"]
            row["prompt_n_reference"] = b2["timings"]["prompt_n"]
            log("restore", res.timings, "bit-exact:", row["bitexact"], "prompt_n", a2["timings"]["prompt_n"])
    finally:
        for s in (live, ref):
            try:
                os.kill(s.pid, signal.SIGKILL)
            except (ProcessLookupError, OSError, ValueError):
                pass
    import pynvml

    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    record_run("llamacpp_gpu", {"gpu": gpu, "driver": pynvml.nvmlSystemGetDriverVersion(), "rows": [row]})
    table = md_table(["model", "model GiB", "GPU GiB", "image GiB", "pause s", "restore-to-ready s", "cold start s",
                      "serving after heartbeat", "bit-exact", "prompt_n after restore"],
                     [[f"random llama {a.size} (f16)", row["model_gib"], row["gpu_footprint_gib"], row["image_gib"],
                       row["heartbeat"].get("pause"), row["restore_to_ready_s"], row["cold_start_s"],
                       row["serving_after_heartbeat"], row["bitexact"], row["prompt_n_after_restore"]]])
    print(table)
    append_results(f"llama.cpp llama-server, all layers on the GPU, on {gpu} (bench/llamacpp_gpu.py)", table,
                   f"CUDA build of llama.cpp {inst.version} ({row['llama_build_s']} s here; flags in the command's "
                   f"env); heartbeat phases {row['heartbeat']}; restore phases {row['restore']}. Cold start = "
                   "server start until /health answers (model file in page cache); the reference server was "
                   "never interrupted; prompt_n after restore counts the prompt tokens the restored server "
                   f"computed (the reference computed {row['prompt_n_reference']}).")
    return 0 if row["bitexact"] and row["serving_after_heartbeat"] else 1


if __name__ == "__main__":
    sys.exit(main())
