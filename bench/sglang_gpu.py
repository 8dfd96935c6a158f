"""SGLang 0.5.17 on the H200: cold start and whole-process checkpoint/restore through ckptflow.

Model: the seeded random Llama-3-8B-shaped bf16 model of bench/vllm_gpu.py (~15 GiB, written by
it, token-id prompts, no tokenizer), served by ``sglang.launch_server --skip-tokenizer-init`` with
the triton attention backend and torch sampling (flashinfer is not carried: scripts/carry-sglang.sh).

Rows:
  a  cold start to first token (empty triton/inductor caches), with SGLang's own phases parsed
     from its log (weights, KV cache, CUDA graphs).
  b  the same engine, whole process through ckptflow's NodeRunner (engine: sglang): CUDA lock +
     checkpoint of the tree's GPU processes, CRIU dump (the tree exits), CRIU restore, CUDA
     restore, unlock; the next 32 tokens of a long session equal the engine's before the kill, and
     SGLang's own counters (the response's ``meta_info.cached_tokens``, ``sglang:cached_tokens_total``)
     show the session's prefix came from the restored radix cache.
  c  two tiers through the protocol SGLang serves with ckptflow's plugin (engines/sglang_protocol.py,
     flags and environment from engines/sglang.protocol_args): TemplateSessionsRunner's heartbeat
     (template = the engine with its memory released + CUDA checkpoint + CRIU dump; the session =
     HiCache's file pages), SIGKILL, the page directory emptied, restore; the next 32 tokens equal
     the engine's before the kill, and ``cached_tokens`` shows the prefix came from the restored pages.

Each run also writes what the CPU tests replay (SGLang does not serve on CPU from registry
packages): the live /metrics text, /server_info, a /generate answer and the process tree, to
$OUT/sglang-recorded/.

Usage on the GPU node (root; SGLang, its deps and CRIU carried by scripts/carry-sglang.sh):
    eval "$(scripts/carry-sglang.sh env)"; python3 bench/sglang_gpu.py --rows a,b
Here, after the device call:  python3 bench/sglang_gpu.py --append-results FETCHED.json
(appends it as a run to bench/results/sglang_gpu.json, every run kept, and to bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vllm_gpu as V  # noqa: E402  (the model, HTTP, log watch, engine start/kill and runner helpers)
from _common import append_device_run, logs_to_out, machine, md_table  # noqa: E402

from ckptflow.engines.sglang import CMDLINE, VERSION as SGLANG_VERSION  # noqa: E402

GiB = V.GiB
HOME = V.HOME
STATE = HOME / "sglang_gpu_state.json"
OUT = V.OUT


class Engine(V.Engine):
    def __init__(self, name: str, run: Path, model: Path, port: int, mem_fraction: float, cache_root: Path,
                 extra: list[str] = ()):
        super().__init__(name, run, model, port, 0, cache_root)
        from ckptflow.engines.sglang import server_args

        self.args = [*server_args(str(model), port, python=sys.executable, mem_fraction=mem_fraction), *extra]
        self.env = {k: v for k, v in self.env.items() if not k.startswith("VLLM_")}
        self.env.update(SGLANG_CACHE_ROOT=str(cache_root / "sglang"))


def wait_health(eng: Engine, timeout: float) -> float:
    try:
        return V.wait_health(eng.url, timeout, eng.proc)
    except RuntimeError:
        raise RuntimeError(f"SGLang exited with {eng.proc.returncode} before /health answered") from None


def generate(url: str, prompt: list[int], max_tokens: int, session: str | None = None) -> dict:
    """SGLang's native /generate with token ids, greedy: {"output_ids", "meta_info"}. ``session``:
    a turn of that session (ckptflow's plugin lists its pages when it ends)."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                                       "ignore_eos": True}}
    st, raw = V.http("POST", url + "/generate", body, headers={"X-Ckptflow-Session": session} if session else None)
    if st != 200:
        raise RuntimeError(f"POST /generate -> HTTP {st}: {raw[:500]!r}")
    return json.loads(raw)


def metrics(url: str) -> dict[str, float]:
    st, raw = V.http("GET", url + "/metrics", timeout=10)
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(raw.decode(errors="replace")):
        for s in fam.samples:
            if s.name.startswith("sglang:"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def phases(w: V.LogWatch) -> dict:
    """SGLang's own start-up lines -> seconds (durations SGLang reports, and when each line appeared)."""
    out: dict = {}

    def at(key: str, pattern: str, group: int | None = 1, conv=float):
        hit = w.first(pattern)
        if hit:
            out[key.removesuffix("_s").removesuffix("_gib") + "_at_s"] = round(hit[0], 2)
            if group is not None:
                out[key] = conv(hit[1].group(group))
    at("server_args", r"server_args=ServerArgs", None)
    at("torch_distributed_s", r"Init torch distributed ends\. elapsed=([0-9.]+) s")
    at("weights_load_s", r"Load weight end\. elapsed=([0-9.]+) s")
    at("weights_gib", r"Load weight end\..*mem usage=([0-9.]+) GB")
    at("kv_cache_tokens", r"KV Cache is allocated\..*#tokens: ([0-9]+)", conv=int)
    at("prefill_graph_capture_s", r"Capture target prefill CUDA graph end\. elapsed=([0-9.]+) s")
    at("decode_graph_capture_s", r"Capture target decode CUDA graph end\. elapsed=([0-9.]+) s")
    at("ready", r"The server is fired up and ready to roll", None)
    return out


def phases_of_log(path: Path) -> dict:
    """phases() of a finished log, timed by SGLang's own line stamps from its first line."""
    from datetime import datetime

    w = V.LogWatch(path, 0.0)
    t0 = None
    for line in path.read_text(errors="replace").splitlines():
        m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\]", line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            t0 = t if t0 is None else t0
            w.lines.append((t - t0, line))
    return phases(w)


def record(name: str, data: bytes | str) -> None:
    """A live answer, kept for the CPU tests (tests/fixtures/sglang/); not under gpu_regress.py."""
    if OUT and os.environ.get("CKPTFLOW_BENCH_RECORD") != "0":
        d = OUT / "sglang-recorded"
        d.mkdir(exist_ok=True)
        (d / name).write_bytes(data.encode() if isinstance(data, str) else data)


def workload(name: str, eng: Engine, model: dict):
    from ckptflow.engines.sglang import ADAPTER
    from ckptflow.models import ProcessFinder, Workload

    # engine: sglang brings its CRIU options (models.SGLANG_CRIU); the golden request is served after
    # the restore before it counts (runners/engine.answers_real_work).
    # tcp_established: torch.distributed's TCPStore connects the scheduler to itself over TCP.
    return Workload(name=name, node="h200", engine="sglang", engine_version=SGLANG_VERSION,
                    model_id=model["model_id"], model_revision=model["revision"], gpu=True,
                    health_url=eng.url + "/health", tcp_established=True, golden=ADAPTER.golden_request(eng.url),
                    find=ProcessFinder(pid_file=str(eng.pid_file), cmdline_must_contain=CMDLINE))


def tree_info(pid: int) -> list[dict]:
    from ckptflow.runners.process import tree

    out = []
    for p in tree(pid):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            comm = Path(f"/proc/{p}/comm").read_text().strip()
            fds = os.listdir(f"/proc/{p}/fd")
            socks = sum(1 for f in fds if os.readlink(f"/proc/{p}/fd/{f}").startswith("socket:"))
        except OSError:
            continue
        out.append({"pid": p, "comm": comm, "cmdline": cmd[:300], "fds": len(fds), "sockets": socks})
    return out


def row_ab(a, model: dict, work: Path, res: dict) -> None:
    cache = work / "cache-a"
    shutil.rmtree(cache, ignore_errors=True)
    eng = Engine("s1", work, Path(model["path"]), a.port, a.mem_fraction, cache)
    ra: dict = {"row": "a", "what": "cold start to first token (empty triton/inductor caches; weights in page cache)",
                "mem_fraction_static": a.mem_fraction, "args": eng.args[3:]}
    res["rows"]["a"] = ra
    t0 = eng.start()
    try:
        wait_health(eng, a.start_timeout)
        ra["health_s"] = round(time.perf_counter() - t0, 2)
        first = generate(eng.url, [128000, 9906, 1917, 0, 1], 1)
        ra["cold_start_s"] = round(time.perf_counter() - t0, 2)
        ra["first_token_id"] = first["output_ids"]
        ra.update(phases(eng.watch))
        ra["gpu_used_gib"] = V.gpu_used_gib()
        ra["next_tokens_equal"] = None
        ra["next_tokens_equal_note"] = "no restore in this row"
        V.log("row a", json.dumps(ra))
    except Exception as e:
        ra["error"] = f"{type(e).__name__}: {e}"
        ra["log_tail"] = eng.tail(6000)
        V.log("row a failed", ra["error"], ra["log_tail"][-3000:])
        eng.kill()
        return
    finally:
        save(res)
    if "b" not in a.rows:
        eng.kill()
        return
    rb: dict = {"row": "b", "what": "whole process (NodeRunner: CUDA lock+checkpoint of the tree's GPU processes, "
                "CRIU dump; CRIU restore, CUDA restore, unlock)", "mem_fraction_static": a.mem_fraction}
    res["rows"]["b"] = rb
    node = None
    try:
        session, user = V.prompts()
        turn = generate(eng.url, session, V.TURN_TOKENS)["output_ids"]
        nxt = session + turn + user
        t1 = time.perf_counter()
        first_run = generate(eng.url, nxt, V.TURN_TOKENS)
        rb["next_turn_s"] = round(time.perf_counter() - t1, 3)
        before = generate(eng.url, nxt, V.TURN_TOKENS)      # the state the checkpoint will hold: nxt cached
        record("generate.json", json.dumps({"request": {"input_ids_len": len(nxt), "max_new_tokens": V.TURN_TOKENS},
                                                 "response": before}, indent=1))
        rb["recompute_vs_cached_equal"] = first_run["output_ids"] == before["output_ids"]
        rb["cached_tokens_before_kill"] = before["meta_info"].get("cached_tokens")
        before_ids = before["output_ids"]
        rb["distinct_tokens"] = len(set(before_ids))
        st, raw = V.http("GET", eng.url + "/metrics", timeout=10)
        record("metrics.txt", raw)
        for path in ("/server_info", "/model_info", "/health"):
            st, body = V.http("GET", eng.url + path, timeout=10)
            record(path.strip("/") + ".json", json.dumps({"status": st, "body": body.decode(errors="replace")}))
        m0 = metrics(eng.url)
        rb["gpu_used_gib"] = V.gpu_used_gib()
        rb["host_mem_gib"] = V.mem_total_gib()
        rb["tree"] = tree_info(eng.pid)
        record("tree.json", json.dumps(rb["tree"], indent=1))
        node = V.node_runner(a.store / "store-b")
        w = workload("sglang-b", eng, model)
        from ckptflow.runners import xcomp
        from ckptflow.runners.cuda import cuda_pids
        from ckptflow.runners.process import tree

        rb["tree_pids"] = len(tree(eng.pid))
        rb["cuda_pids"] = len(cuda_pids(eng.pid))
        rb["cpu_amx"] = xcomp.cpu_has_amx()
        rb["amx_enabled_pids"] = [p for p in tree(eng.pid) if xcomp.uses_amx(p)]
        V.log("row b: checkpoint", json.dumps({k: rb[k] for k in ("tree_pids", "cuda_pids", "cpu_amx", "amx_enabled_pids")}))
        t1 = time.perf_counter()
        m = V.checkpoint(node, w, leave_running=False)
        V.log("row b: restore")
        rb["checkpoint_wall_s"] = round(time.perf_counter() - t1, 2)
        rb["pause_s"] = m.timings.get("pause")
        rb["checkpoint_phases"] = m.timings
        rb["footprint_gib"] = round(m.gpu_footprint_bytes / GiB, 2)
        rb["image_gib"] = round(m.bytes / GiB, 2)
        rb["criu_flags"] = V.criu_flags(node, m)
        node.criu.wait_pid_free(m.pid)
        t1 = time.perf_counter()
        r = node.restore(w, manifest=m)
        rb["restore_to_ready_s"] = round(time.perf_counter() - t1, 2)
        rb["restore_phases"] = r.timings
        t2 = time.perf_counter()
        after = generate(eng.url, nxt, V.TURN_TOKENS)
        rb["restore_to_first_token_s"] = round(time.perf_counter() - t1, 2)
        rb["next_turn_after_restore_s"] = round(time.perf_counter() - t2, 3)
        m1 = metrics(eng.url)
        rb["cached_tokens_after_restore"] = after["meta_info"].get("cached_tokens")
        rb["cached_tokens_total_delta"] = m1.get("sglang:cached_tokens_total", 0) - m0.get("sglang:cached_tokens_total", 0)
        rb["prompt_tokens_next_turn"] = len(nxt)
        rb["next_tokens"] = before_ids
        rb["next_tokens_equal"] = after["output_ids"] == before_ids
        if not rb["next_tokens_equal"]:
            rb["next_tokens_after"] = after["output_ids"]
        node.store.delete(m)
        V.log("row b", json.dumps({k: v for k, v in rb.items() if k not in ("next_tokens", "tree")}))
    except Exception as e:
        rb["error"] = f"{type(e).__name__}: {e}"
        rb["traceback"] = traceback.format_exc()[-3000:]
        rb["log_tail"] = eng.tail(6000)
        rb.setdefault("next_tokens_equal", None)
        V.log("row b failed", rb["traceback"], rb["log_tail"][-2000:])
    finally:
        save(res)
        eng.kill()
        if node is not None:
            node.close()
        shutil.rmtree(a.store / "store-b", ignore_errors=True)


def weights(url: str) -> dict:
    """A few weights' first values (SGLang's /get_weights_by_name, loopback): did a reload change them?"""
    out = {}
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                 "model.layers.31.mlp.down_proj.weight", "lm_head.weight"):
        st, raw = V.http("POST", url + "/get_weights_by_name", {"name": name, "truncate_size": 4}, timeout=60)
        out[name] = raw.decode(errors="replace")[:400] if st == 200 else f"HTTP {st}"
    return out


def from_session_pages(url: str, kv: Path, sid: str, prompt: list[int]) -> dict:
    """``prompt``'s answer with its prefix fetched from ``sid``'s listed pages only: the radix
    cache flushed, every other page file removed (what a restore leaves in HiCache's directory)."""
    from ckptflow.engines.sglang_protocol import SESSIONS_DIR

    time.sleep(2)   # HiCache writes pages behind the answers
    keep = {b + ".bin" for b in json.loads((kv / SESSIONS_DIR / f"{sid}.json").read_text())["blocks"]}
    st, raw = V.http("POST", url + "/flush_cache", {})
    if st != 200:
        raise RuntimeError(f"POST /flush_cache -> {st}: {raw[:300]!r}")
    for f in kv.glob("*.bin"):
        if f.name not in keep:
            f.unlink()
    return generate(url, prompt, V.TURN_TOKENS)


def row_c(a, model: dict, work: Path, res: dict) -> None:
    """Two tiers driven by ckptflow's own runner through the protocol SGLang serves with ckptflow's
    plugin (entry point sglang.srt.plugins): heartbeat (template capture + session export), SIGKILL,
    HiCache's page directory emptied, recover; no bench code between the runner and the engine."""
    from ckptflow.engines.sglang import protocol_args
    from ckptflow.engines.sglang_protocol import write_entry_point
    from ckptflow.engines.vllm import kill_tree
    from ckptflow.runners.process import pid_alive, tree
    from ckptflow.runners.template_sessions import TemplateSessionsRunner

    rc: dict = {"row": "c", "what": "template + sessions through the protocol SGLang serves (ckptflow's plugin: "
                "HiCache file pages, release/resume_memory_occupation + update_weights_from_disk), driven by "
                "TemplateSessionsRunner", "mem_fraction_static": a.mem_fraction}
    res["rows"]["c"] = rc
    kv = work / "kv-c"
    shutil.rmtree(kv, ignore_errors=True)
    kv.mkdir(mode=0o700, parents=True)
    ep = work / "plugin-entry-point"
    shutil.rmtree(ep, ignore_errors=True)
    write_entry_point(ep)   # ckptflow runs from this checkout, not installed: its entry point for SGLang
    flags, env = protocol_args(kv)
    repo = Path(__file__).resolve().parents[1]
    eng = Engine("s3", work, Path(model["path"]), a.port + 2, a.mem_fraction, work / "cache-a", extra=flags)
    eng.env.update(env, PYTHONPATH=":".join(p for p in (os.environ.get("PYTHONPATH", ""), str(repo), str(ep)) if p))
    rc["args"] = eng.args[3:]
    node = None
    try:
        t0 = eng.start()
        wait_health(eng, a.start_timeout)
        generate(eng.url, [128000, 9906, 1917, 0, 1], 1)
        rc["start_to_first_token_s"] = round(time.perf_counter() - t0, 2)
        rc["start_phases"] = phases(eng.watch)
        st, raw = V.http("GET", eng.url + "/v1/ckptflow/engine", timeout=10)
        rc["engine_info"] = {"status": st, "body": raw.decode(errors="replace")[:800]}
        if st != 200:
            raise RuntimeError(f"ckptflow's plugin is not serving: GET /v1/ckptflow/engine -> {st} {raw[:300]!r}")
        session, user = V.prompts()
        sid = "s-long"
        turn = generate(eng.url, session, V.TURN_TOKENS, session=sid)["output_ids"]
        nxt = session + turn + user
        gpu = generate(eng.url, nxt, V.TURN_TOKENS)          # the prefix in the radix cache, as SGLang cached it
        rc["cached_tokens_radix"] = gpu["meta_info"].get("cached_tokens")
        if a.check_weights:
            rc["weights_before"] = weights(eng.url)
        # The reference: the next turn as a restore serves it, its prefix fetched from the session's
        # pages on file and nothing more (SGLang also caches the page of the answer's last token,
        # which a session leaves out: its KV may not be computed when the turn ends), the rest
        # prefilled. On this random-weights model another split of cached and prefilled tokens gives
        # other tokens (row b: recompute_vs_cached_equal false), so it is compared like with like.
        ref = from_session_pages(eng.url, kv, sid, nxt)
        rc["cached_tokens_reference"] = ref["meta_info"].get("cached_tokens")
        rc["radix_vs_session_pages_equal"] = gpu["output_ids"] == ref["output_ids"]
        rc["distinct_tokens"] = len(set(ref["output_ids"]))
        node = V.node_runner(a.store / "store-c")
        w = workload("sglang-c", eng, model).model_copy(update={"checkpoint": "template-sessions"})
        tt = TemplateSessionsRunner(node)
        m = V.capture_template(tt, w, rc, sid)
        again = from_session_pages(eng.url, kv, sid, nxt)   # served on after the capture (weights back from disk)
        rc["served_after_capture_equal"] = again["output_ids"] == ref["output_ids"]
        rc["tokens_after_capture"] = again["output_ids"]
        if a.check_weights:
            rc["weights_after_capture"] = weights(eng.url)
            rc["weights_after_capture_equal"] = rc["weights_after_capture"] == rc["weights_before"]
        rc["cached_tokens_after_capture"] = again["meta_info"].get("cached_tokens")
        t1 = time.perf_counter()
        m2 = tt.heartbeat(w)                                 # a session heartbeat alone
        rc["session_heartbeat_s"] = round(time.perf_counter() - t1, 3)
        rc["session_heartbeat_pause_s"] = m2.timings.get("pause")
        pids = tree(eng.pid)
        kill_tree(eng.pid)
        deadline = time.time() + 60
        while any(pid_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.05)
        shutil.rmtree(kv)                                    # only the store holds the session now
        kv.mkdir(mode=0o700)
        t1 = time.perf_counter()
        r = tt.restore(w)
        rc["restore_to_ready_s"] = round(time.perf_counter() - t1, 2)
        rc["restore_phases"] = r.timings
        m0 = metrics(eng.url)
        t2 = time.perf_counter()
        after = generate(eng.url, nxt, V.TURN_TOKENS)
        rc["next_turn_after_restore_s"] = round(time.perf_counter() - t2, 3)
        rc["restore_to_first_token_s"] = round(time.perf_counter() - t1, 2)
        m1 = metrics(eng.url)
        rc["cached_tokens_after_restore"] = after["meta_info"].get("cached_tokens")
        rc["cached_tokens_total_delta"] = m1.get("sglang:cached_tokens_total", 0) - m0.get("sglang:cached_tokens_total", 0)
        rc["prompt_tokens_next_turn"] = len(nxt)
        rc["next_tokens"] = ref["output_ids"]
        rc["next_tokens_equal"] = after["output_ids"] == ref["output_ids"]
        rc["after_restore_equal_after_capture"] = after["output_ids"] == again["output_ids"]
        if a.check_weights:
            rc["weights_after_restore_equal"] = weights(eng.url) == rc["weights_before"]
        if not rc["next_tokens_equal"]:
            rc["next_tokens_after"] = after["output_ids"]
        V.log("row c", json.dumps({k: v for k, v in rc.items() if k != "next_tokens"}))
    except Exception as e:
        rc["error"] = f"{type(e).__name__}: {e}"
        rc["traceback"] = traceback.format_exc()[-3000:]
        rc["log_tail"] = "\n".join(l for l in eng.tail(200000).splitlines() if "rror" in l or "ckptflow" in l)[-6000:]
        rc.setdefault("next_tokens_equal", None)
        V.log("row c failed", rc["traceback"], rc["log_tail"][-2500:])
    finally:
        eng.kill()
        if node is not None:
            node.close()
        save(res)
        shutil.rmtree(a.store / "store-c", ignore_errors=True)


def save(res: dict) -> None:
    res["adaptations"] = sorted(set(V.ADAPTATIONS))
    STATE.write_text(json.dumps(res, indent=1))
    if OUT:
        (OUT / "sglang_gpu.json").write_text(json.dumps(res, indent=1))
        work = Path(res.get("work", "/nonexistent"))
        logs_to_out(OUT, "sglang_gpu-logs.tar.gz", [work / n for n in ("s1.log", "s3.log")], 4 * 2**20)


def table(res: dict) -> str:
    rows = res["rows"]
    a, b, c = rows.get("a", {}), rows.get("b", {}), rows.get("c", {})
    hdr = ["row", "what", "cold start / pause s", "restore-to-ready s", "first token after restore s", "image GiB",
           "next_tokens_equal", "notes"]
    out = []
    if a:
        out.append(["a", "cold start to first token", a.get("cold_start_s", "—"), "—", "—", "—", "n/a",
                    a.get("error") or f"weights {a.get('weights_load_s')} s, CUDA graphs: prefill "
                                      f"{a.get('prefill_graph_capture_s')} s + decode {a.get('decode_graph_capture_s')} s"])
    if b:
        pause = round(b["pause_s"], 2) if isinstance(b.get("pause_s"), (int, float)) else "—"
        out.append(["b", "whole process (CUDA + CRIU)", pause, b.get("restore_to_ready_s", "—"),
                    b.get("restore_to_first_token_s", "—"), b.get("image_gib", "—"), b.get("next_tokens_equal"),
                    b.get("error") or f"footprint {b.get('footprint_gib')} GiB; cached tokens of the next turn after "
                                      f"the restore {b.get('cached_tokens_after_restore')} of "
                                      f"{b.get('prompt_tokens_next_turn')}"])
    if c:
        out.append(["c", "two tiers through the protocol SGLang serves (runner-driven)",
                    c.get("heartbeat_with_capture_s", "—"), c.get("restore_to_ready_s", "—"),
                    c.get("restore_to_first_token_s", "—"), c.get("template_image_gib", "—"), c.get("next_tokens_equal"),
                    c.get("error") or f"session {c.get('session_tokens')} tokens, {c.get('session_bytes')} B; cached "
                                      f"tokens of the next turn after the restore {c.get('cached_tokens_after_restore')} "
                                      f"of {c.get('prompt_tokens_next_turn')} (target restore-to-ready <= 13.7 s)"])
    return md_table(hdr, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="a,b")
    p.add_argument("--work", type=Path, default=HOME / "sglang-bench")
    p.add_argument("--model-dir", type=Path, default=HOME / "models" / "llama3-8b-shape")
    p.add_argument("--mem-fraction", type=float, default=0.2)
    p.add_argument("--port", type=int, default=18730)
    p.add_argument("--check-weights", action="store_true",
                   help="row c: read a few weights before the capture, after it and after the restore (they "
                        "equal; the copies SGLang makes for the answers then sit in the template's image, ~2 GiB)")
    p.add_argument("--start-timeout", type=float, default=420)
    p.add_argument("--store", type=Path, default=None, help="checkpoint store (default: /dev/shm if it has room)")
    p.add_argument("--append-results", type=Path, default=None,
                   help="here: a fetched device JSON into bench/results/sglang_gpu.json and RESULTS.md")
    p.add_argument("--phases-of", type=Path, default=None, help="print the start-up phases of an SGLang log")
    a = p.parse_args()
    if a.phases_of:
        print(json.dumps(phases_of_log(a.phases_of)))
        return
    if a.append_results:
        append_device_run("sglang_gpu", a.append_results, f"SGLang {SGLANG_VERSION} on {{gpu}}: cold start, whole "
                          "process, two tiers (bench/sglang_gpu.py)", "carry-sglang.sh", table)
        return
    a.rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = sorted(set(a.rows) - {"a", "b", "c"})
    if unknown:
        raise SystemExit(f"--rows: unknown row(s) {', '.join(unknown)}; this bench has a, b, c")
    a.work.mkdir(parents=True, exist_ok=True)
    res = json.loads(STATE.read_text()) if STATE.exists() else {"rows": {}}
    res.update(machine=machine(), work=str(a.work), sglang=SGLANG_VERSION,
               commands=[*res.get("commands", []), "python3 " + " ".join(sys.argv)])
    sysctl = Path("/proc/sys/kernel/io_uring_disabled")
    old = sysctl.read_text().strip()
    sysctl.write_text("2")   # uvloop/libuv then uses epoll: CRIU can dump it
    res["io_uring_disabled_was"] = old
    try:
        res["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
        t0 = time.perf_counter()
        # In a child: this process keeps no CUDA context of its own next to the engine it checkpoints.
        r = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_gpu.py")), "--write-model",
                            str(a.model_dir)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"writing the model failed: {r.stderr[-2000:]}")
        model = json.loads(r.stdout.strip().splitlines()[-1])
        res["model"] = model
        res["torch"] = model.get("torch")
        V.log(f"model ready in {time.perf_counter() - t0:.1f} s: {model['gib']} GiB")
        if a.store is None:
            free_shm = shutil.disk_usage("/dev/shm").free / GiB if Path("/dev/shm").exists() else 0
            a.store = Path("/dev/shm/ckptflow-sglang") if free_shm > 45 else a.work
        res["store"] = str(a.store)
        if {"a", "b"} & set(a.rows):
            row_ab(a, model, a.work, res)
        if "c" in a.rows:
            row_c(a, model, a.work, res)
    finally:
        sysctl.write_text(old)
        if a.store and str(a.store).startswith("/dev/shm/"):
            shutil.rmtree(a.store, ignore_errors=True)
        save(res)
    print(table(res))


if __name__ == "__main__":
    main()
