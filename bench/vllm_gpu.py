"""vLLM 0.26.0 on the H200: cold start, whole-process checkpoint/restore, and two tiers (issue #21).

Model: a seeded random Llama-3-8B-shaped bf16 model (hidden 4096, 32 layers, 32 heads / 8 KV
heads, intermediate 14336, vocab 128256; ~15 GiB) written here from torch tensors (config.json +
safetensors shards), served with ``--skip-tokenizer-init`` and token-id prompts at temperature 0
with ``return_token_ids``.

Rows:
  a  cold start to first token (empty vLLM / inductor / triton caches), with vLLM's own phases
     parsed from its log (imports, engine process, weights, torch.compile, KV cache, CUDA graphs).
  b  the same engine, whole process through ckptflow's NodeRunner (engine: vllm): CUDA lock +
     checkpoint of every GPU-holding process of the tree, CRIU dump (the tree exits), CRIU restore,
     CUDA restore, unlock; the next 32 tokens of a long session equal the engine's before the kill.
  c  two tiers: a second engine with --enable-sleep-mode and a KV connector; a long session's
     turn is exported by the connector into ckptflow's store; template = ``POST /sleep?level=2``
     then CUDA checkpoint + CRIU dump; restore = CRIU restore + CUDA restore (NodeRunner), then
     ``/wake_up?tags=weights``, ``/collective_rpc reload_weights``, ``/wake_up?tags=kv_cache``,
     the session's blocks imported; next 32 tokens equal. Target: restore-to-ready <= 0.1 x (a).
  p  two tiers driven by TemplateSessionsRunner through the protocol vLLM serves (its middleware,
     ckptflow's connector and worker extension): heartbeat, SIGKILL, the node's KV files removed,
     recover; next 32 tokens equal, the session's tokens external prefix-cache hits.
  s  standby failover (issue #31 item 6): the engine started isolated (its own PID and mount
     namespaces); its template restored beside it by TemplateSessionsRunner.standby and parked
     (asleep: ~1.3 GiB of CUDA context and graphs on the GPU, no weights, no KV); the session grows,
     a heartbeat; SIGKILL; ``promote``. Targets: kill -> ready <= 1.5 s, the next turn's first token
     <= 0.5 s with the session from the store (external prefix hits), next 32 tokens equal.
  t  a turn-end export's cost to a decoding client (issue #31 item 6): a batch-1 client streams
     tokens (its own process) while ``TurnWatch.poll`` (``ckptflow turns``) exports other
     sessions at their turn ends; the client's inter-token gaps during the exports against those
     outside. Target: <= 5 ms lost per export (the time the gaps during it took beyond the mean
     gap outside, as bench/gpu_turn_export.py counts it for the bench engine).
  a_warm  row a's engine started again with the compile caches kept (after row a, or whatever the
     rows before left in work/cache-a).

Row c's session tier: ckptflow's CkptflowConnector through bench/vllm_kv_bench.py (two fixes it
needed on the H200), then vLLM's ExampleConnector if that fails (``--connector`` picks one).

Usage on the GPU node (root; vLLM, its deps and CRIU carried by scripts/carry-vllm.sh):
    eval "$(scripts/carry-vllm.sh env)"; python3 bench/vllm_gpu.py --rows a,b,c
    python3 bench/vllm_gpu.py --rows s,t,a_warm   # standby, turn-end export cost, warm-cache start
    python3 bench/vllm_gpu.py --rows c            # merges into the rows of this machine ($HOME state)
    python3 bench/vllm_gpu.py --rows c --resume-from bench/results/vllm_gpu.json   # on a fresh machine
Here, after fetching the device's $OUT/vllm_gpu.json:  python3 bench/vllm_gpu.py --append-results FETCHED.json
(appends it as a run to bench/results/vllm_gpu.json, every run kept, and to bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from _common import append_device_run, logs_to_out, machine, md_table  # noqa: E402

GiB = 2**30
VLLM_VERSION = "0.26.0"
CMDLINE = "vllm.entrypoints.openai.api_server"
HOME = Path(os.environ.get("HOME", "/root"))
STATE = HOME / "vllm_gpu_state.json"          # rows of earlier calls on this (warm) machine
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
SHAPE = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=14336, vocab_size=128256)
SESSION_TOKENS = 4000     # a long session's transcript (a multiple of the block size)
TURN_TOKENS = 32          # the answer of the session's turn and of the next turn
NEXT_USER_TOKENS = 48     # the user's part of the next turn


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


# --- the model ----------------------------------------------------------------------------------
def write_model(out: Path, seed: int = 1234) -> dict:
    """Llama-3-8B-shaped random bf16 weights, generated on the GPU, written as safetensors shards."""
    import hashlib

    import torch

    if (out / "ckptflow-model.json").exists():
        return json.loads((out / "ckptflow-model.json").read_text())
    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    h, L, nh, kvh, inter, vocab = (SHAPE[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "intermediate_size", "vocab_size"))
    hd = h // nh
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE, "head_dim": hd,
           "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}))
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(L):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (nh * hd, h)), (p + "self_attn.k_proj.weight", (kvh * hd, h)),
                   (p + "self_attn.v_proj.weight", (kvh * hd, h)), (p + "self_attn.o_proj.weight", (h, nh * hd)),
                   (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                   (p + "mlp.down_proj.weight", (h, inter))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    g = torch.Generator(device="cuda").manual_seed(seed)
    shard_bytes = 4 * GiB
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        n = 2 * int(torch.Size(shape).numel())
        if size + n > shard_bytes and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    weight_map, total, digest = {}, 0, hashlib.sha256()
    for si, items in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, shape in items:
            n = 2 * int(torch.Size(shape).numel())
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        header["__metadata__"] = {"format": "pt"}
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(out / fname, "wb") as f:
            f.write(len(hb).to_bytes(8, "little") + hb)
            for name, shape in items:
                if name.endswith("norm.weight"):
                    t = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
                else:
                    t = (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16)
                a = t.view(torch.int16).cpu().numpy()
                digest.update(a[:64].tobytes() if a.ndim == 1 else a[0, :64].tobytes())
                f.write(memoryview(a).cast("B"))
                total += a.nbytes
        log(f"model: wrote {fname}")
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                 "weight_map": weight_map}))
    info = {"path": str(out), "model_id": f"ckptflow/random-llama3-8b-shape-{seed}", "revision": digest.hexdigest()[:16],
            "bytes": total, "gib": round(total / GiB, 2), "write_s": round(time.perf_counter() - t0, 1), "seed": seed,
            "shape": SHAPE}
    (out / "ckptflow-model.json").write_text(json.dumps(info))
    return info


# --- HTTP (urllib: one connection per request, closed; no keep-alive socket for CRIU to meet) --
def http(method: str, url: str, body: dict | None = None, timeout: float = 300,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def complete(url: str, prompt: list[int], max_tokens: int, session: str | None = None) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if session:
        body["kv_transfer_params"] = {"ckptflow_session": session}
    st, raw = http("POST", url + "/v1/completions", body)
    if st != 200:
        raise RuntimeError(f"POST /v1/completions -> HTTP {st}: {raw[:500]!r}")
    return list(json.loads(raw)["choices"][0]["token_ids"])


def metrics(url: str) -> dict[str, float]:
    st, raw = http("GET", url + "/metrics", timeout=10)
    out: dict[str, float] = {}
    for line in raw.decode(errors="replace").splitlines():
        m = re.match(r"^(vllm:[a-z_]+?)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def stream(url: str, prompt: list[int], max_tokens: int, timeout: float = 300) -> tuple[list[int], list[float], bool]:
    """A streamed greedy completion: its token ids, the time (``time.monotonic``: one clock for every
    process of the node) each event that carried tokens arrived, and whether the events carried their
    token ids (without them each event counts as one token and the ids are [])."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    ids: list[int] = []
    times: list[float] = []
    with_ids = True
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            now = time.monotonic()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            choices = json.loads(data).get("choices") or []
            if not choices:
                continue
            if "token_ids" in choices[0] and choices[0]["token_ids"] is not None:
                if not choices[0]["token_ids"]:
                    continue
                ids += choices[0]["token_ids"]
            else:
                with_ids = False
            times.append(now)
    return (ids if with_ids else []), times, with_ids


def in_netns(netns: str, fn, *args):
    """``fn(*args)`` in a thread that entered network namespace ``netns`` (a socket belongs to the
    namespace of the thread that opens it): a standby copy answers on its source's address there."""
    box: dict = {}

    def run() -> None:
        try:
            fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if hasattr(os, "setns"):   # Python >= 3.12
                    os.setns(fd, 0x40000000)   # CLONE_NEWNET
                else:
                    import ctypes

                    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {netns}")
            finally:
                os.close(fd)
            box["ok"] = fn(*args)
        except BaseException as e:  # raised again here, in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=f"in-{netns}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["ok"]


def stream_client(url: str, out: Path, tokens: int = 512) -> None:
    """Row t's decoding client, a process of its own (the runner's export in the bench process takes
    no GIL from it): batch-1 streamed requests of one short prompt until ``out``.stop exists; each
    request's token ids and event times into ``out``; ``out``.started once the first one ended."""
    stop, started = out.with_name(out.name + ".stop"), out.with_name(out.name + ".started")
    reqs: list[dict] = []
    try:
        while not stop.exists():
            ids, times, with_ids = stream(url, FIRST_PROMPT, tokens)
            reqs.append({"ids": ids, "times": times, "with_ids": with_ids})
            started.touch()
        out.write_text(json.dumps({"requests": reqs}))
    except Exception as e:
        out.write_text(json.dumps({"requests": reqs, "error": f"{type(e).__name__}: {e}"}))


def gap_stats(requests: list[dict], spans: list[tuple[float, float]], since: float, until: float) -> dict:
    """Row t: the decoding client's gaps between token events (ms) from ``since`` to ``until``, those
    that overlap an export span and the others, and what the exports added."""
    inside: list[float] = []
    outside: list[float] = []
    shares: list[float] = []   # of each gap in ``inside``: the part of it within an export
    for r in requests:
        t = r["times"]
        for t0, t1 in zip(t, t[1:]):
            if since <= t0 and t1 <= until:
                # two tokens of one event (a 0 ms gap) count by where they fell, with no share to weigh
                share = (sum(max(0.0, min(t1, e1) - max(t0, e0)) for e0, e1 in spans) / (t1 - t0) if t1 > t0
                         else 0.0)
                if share or any(e0 < t0 < e1 for e0, e1 in spans):
                    inside.append(1000 * (t1 - t0))
                    shares.append(share)
                else:
                    outside.append(1000 * (t1 - t0))

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        if not xs:
            return {"n": 0}
        return {"n": len(xs), "p50_ms": round(xs[len(xs) // 2], 3), "mean_ms": round(sum(xs) / len(xs), 3),
                "p99_ms": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 3), "max_ms": round(xs[-1], 3)}

    base, during = stats(outside), stats(inside)
    out = {"gaps_outside_exports": base, "gaps_during_exports": during}
    if base["n"] and during["n"]:
        out["gap_increase_ms"] = round(during["mean_ms"] - base["mean_ms"], 3)        # the decode slowed by
        out["max_gap_increase_ms"] = round(during["max_ms"] - base["p50_ms"], 3)      # the longest stall
        out["base_max_gap_increase_ms"] = round(base["max_ms"] - base["p50_ms"], 3)   # the same without exports
        out["p99_gap_increase_ms"] = round(during["p99_ms"] - base["p99_ms"], 3)
        # What an export cost the client, as bench/gpu_turn_export.py counts it for the bench engine:
        # the time its gaps during the export took beyond gaps outside any export. Against the mean
        # outside, not the median: gaps vary by themselves (stalls of 30-40 ms came without any
        # export, H100 2026-12-07), and against the median that variance alone read as ~64 ms lost.
        # Each gap counts by the share of it inside an export: a whole gap that merely touches one
        # would favour long gaps at the span's edges.
        mu, n_exp = base["mean_ms"], max(1, len(spans))
        out["lost_ms_per_export"] = round(sum(f * (g - mu) for g, f in zip(inside, shares)) / n_exp, 2)
        var = lambda xs, m: sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)  # noqa: E731
        # Two standard errors of that sum, taking the gaps as independent; stalls cluster, so the
        # true noise is larger: a verdict needs the figure clear of it.
        se = (var(outside, mu) / len(outside) + var(inside, during["mean_ms"]) / len(inside)) ** 0.5
        out["lost_ms_per_export_noise"] = round(2 * se * len(inside) / n_exp, 2)
        lost, noise = out["lost_ms_per_export"], out["lost_ms_per_export_noise"]
        out["target_met"] = lost + noise <= 5
        out["target_verdict"] = "met" if lost + noise <= 5 else "not met" if lost - noise > 5 else "inconclusive"
    return out


def wait_health(url: str, timeout: float, proc: subprocess.Popen | None = None) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            if http("GET", url + "/health", timeout=2)[0] == 200:
                return time.perf_counter() - t0
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} before /health answered")
        time.sleep(0.05)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout:.0f} s")


# --- the engine's log, line by line with the time each line appeared -----------------------------
class LogWatch(threading.Thread):
    def __init__(self, path: Path, t0: float):
        super().__init__(daemon=True)
        self.path, self.t0, self.lines, self.stop = path, t0, [], False
        self.offset = path.stat().st_size if path.exists() else 0

    def run(self) -> None:
        while not self.path.exists() and not self.stop:
            time.sleep(0.02)
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            buf = b""
            while not self.stop:
                chunk = f.read()
                if not chunk:
                    time.sleep(0.02)
                    continue
                now = time.perf_counter() - self.t0
                buf += chunk
                *done, buf = buf.split(b"\n")
                self.lines += [(now, d.decode(errors="replace")) for d in done]

    def first(self, pattern: str) -> tuple[float, re.Match] | None:
        rx = re.compile(pattern)
        for t, line in list(self.lines):
            m = rx.search(line)
            if m:
                return t, m
        return None

    def all(self, pattern: str) -> list[tuple[float, re.Match]]:
        rx = re.compile(pattern)
        return [(t, m) for t, line in list(self.lines) for m in [rx.search(line)] if m]


def phases(w: LogWatch) -> dict:
    """vLLM's own startup lines -> phase seconds (durations vLLM reports, and when each line appeared)."""
    out: dict = {}
    first_line = next((t for t, line in w.lines if re.search(r"(INFO|WARNING|DEBUG|ERROR) \d\d-\d\d ", line)), None)
    out["api_server_imports_s"] = round(first_line, 2) if first_line is not None else None

    def at(key: str, pattern: str, group: int | None = 1, conv=float):
        hit = w.first(pattern)
        if hit:
            out[re.sub(r"_(s|gib)$", "", key) + "_at_s"] = round(hit[0], 2)
            if group is not None:
                out[key] = conv(hit[1].group(group))
    at("api_config_done", r"Resolved architecture", None)
    at("engine_core_init", r"Initializing a V1 LLM engine", None)
    at("engine_load_start", r"Starting to load model|Loading model from scratch", None)
    at("weights_load_s", r"Loading weights took ([0-9.]+) seconds")
    at("model_load_s", r"Model loading took [0-9.]+ GiB(?: memory)? and ([0-9.]+) seconds")
    at("model_gib", r"Model loading took ([0-9.]+) GiB")
    out.pop("model_at_s", None)
    at("dynamo_transform_s", r"Dynamo bytecode transform time: ([0-9.]+) s")
    at("torch_compile_s", r"torch.compile took ([0-9.]+) s in total")
    out["inductor_graph_compiles"] = len(w.all(r"Compiling a graph for compile range"))
    out["compiled_graphs_loaded_from_cache"] = bool(w.first(r"Directly load the compiled graph"))
    at("kv_cache_gib", r"Available KV cache memory: ([0-9.]+) GiB")
    at("graph_capture_s", r"Graph capturing finished in ([0-9.]+) secs")
    at("graph_capture_gib", r"Graph capturing finished in [0-9.]+ secs, took ([0-9.]+) GiB")
    at("init_engine_s", r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+)")
    at("server_start", r"Starting vLLM server on", None)
    return out


# --- starting and stopping vLLM ------------------------------------------------------------------
class Engine:
    def __init__(self, name: str, run: Path, model: Path, port: int, gpu_util: float, cache_root: Path,
                 extra: list[str] = (), env: dict | None = None, isolated: bool = False):
        """``isolated``: started as ``ckptflow run-isolated`` starts a worker (PID 1 of its own PID and
        mount namespaces, runners/isolate.py), whose template the CUDA driver restores as a copy
        beside it (row s's standby)."""
        self.name, self.run, self.port, self.isolated = name, run, port, isolated
        self.url = f"http://127.0.0.1:{port}"
        self.pid_file, self.log_file = run / f"{name}.pid", run / f"{name}.log"
        self.args = [sys.executable, "-m", CMDLINE, "--model", str(model), "--served-model-name", "m",
                     "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16",
                     "--max-model-len", "8192", "--enable-prefix-caching", "--seed", "0",
                     "--gpu-memory-utilization", str(gpu_util), *extra]
        self.env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "VLLM_CACHE_ROOT": str(cache_root / "vllm"),
                    "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor"), "TRITON_CACHE_DIR": str(cache_root / "triton"),
                    "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NCCL_NVLS_ENABLE": "0",
                    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.watch: LogWatch | None = None

    def start(self) -> float:
        self.pid_file.unlink(missing_ok=True)
        t0 = time.perf_counter()
        self.watch = LogWatch(self.log_file, t0)
        self.watch.start()
        if self.isolated:
            from ckptflow.runners.isolate import isolated_argv

            cmd = isolated_argv(["env", *(f"{k}={v}" for k, v in sorted(self.env.items())), *self.args],
                                self.pid_file, self.log_file)
        else:
            cmd = start_command(self.args, self.env, self.pid_file, self.log_file)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, close_fds=True)
        p = self.proc
        threading.Thread(target=p.wait, daemon=True).start()  # reap it when CRIU's dump ends it
        return t0

    @property
    def pid(self) -> int:
        return int(self.pid_file.read_text())

    def tail(self, n: int = 2500) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        from ckptflow.runners.process import tree

        try:
            pids = tree(self.pid)
        except (OSError, ValueError):
            pids = []
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        t0 = time.time()
        while any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids) and time.time() - t0 < 30:
            time.sleep(0.1)
        time.sleep(2.5)  # init reaps orphans late on these VMs (notes/criu.md)
        if self.watch:
            self.watch.stop = True


FIRST_PROMPT = [128000, 9906, 1917, 0, 1]   # the one-token request that says an engine serves


def serve(eng: Engine, a) -> dict:
    """Start ``eng``; wait for /health and its first token. Seconds to each from the start, the
    token, and vLLM's own phases from its log."""
    t0 = eng.start()
    wait_health(eng.url, a.start_timeout, eng.proc)
    health = round(time.perf_counter() - t0, 2)
    first = complete(eng.url, FIRST_PROMPT, 1)
    return {"health_s": health, "first_token_s": round(time.perf_counter() - t0, 2), "first_token_id": first,
            "phases": phases(eng.watch)}


def start_command(args: list[str], env: dict[str, str], pid_file: Path, log_file: Path) -> list[str]:
    """As ckptflow.engines.vllm.start_command: the shell writes its PID and execs the server, whose
    output is appended (>>: CRIU's restore then hands the tree the same file, whatever its size)."""
    import shlex

    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return ["/bin/sh", "-c", f"echo $$ > {shlex.quote(str(pid_file))} && exec env {exports} {shlex.join(args)} "
                             f"</dev/null >>{shlex.quote(str(log_file))} 2>&1"]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _gpu_memory():
    """GPU 0's memory info (NVML: ``total``, ``used``, ``free`` bytes)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        pynvml.nvmlShutdown()


def gpu_used_gib() -> float:
    return round(_gpu_memory().used / GiB, 2)


def gpu_util_for(reserve_gib: float) -> float:
    """vLLM's --gpu-memory-utilization that reserves ``reserve_gib`` on this card: a fraction fixed
    for the H200 (0.18 of 140 GiB) left an H100 (80 GiB) less than the 15 GiB of weights, and every
    vLLM row failed at start ("No available memory for the cache blocks", 2026-12-07)."""
    return round(min(0.9, reserve_gib / (_gpu_memory().total / GiB)), 3)


def mem_total_gib() -> float:
    kb = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1])
    return round(kb / 2**20, 1)


# --- ckptflow's runner, for vLLM -------------------------------------------------------------------
ADAPTATIONS: list[str] = []


def node_runner(store_root: Path):
    """NodeRunner with the CRIU flags vLLM needs: from Workload.criu (engine: vllm) when ckptflow has
    it, else from a subclass here; and only processes the driver knows as CUDA processes locked."""
    import ckptflow.runners.cuda as C
    from ckptflow.models import Workload
    from ckptflow.runners.criu import CriuRunner
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    criu = None
    if "criu" not in Workload.model_fields:
        class VllmCriu(CriuRunner):
            def _common(self, images_dir, log, tcp_established):
                return [*super()._common(images_dir, log, tcp_established), "--link-remap", "--ext-unix-sk",
                        "--file-locks"]
        criu = VllmCriu()
        ADAPTATIONS.append("Workload has no `criu` field: --link-remap --ext-unix-sk --file-locks added by a "
                           "CriuRunner subclass in the bench")
    node = NodeRunner(LocalStore(store_root), criu=criu)
    if not getattr(C.cuda_pids, "_bench", False):
        orig = C.cuda_pids

        def cuda_pids(root_pid: int) -> list[int]:
            pids = orig(root_pid)
            good = [p for p in pids if node.cuda.backend.get_state(p)[0] == 0]
            if good and good != pids:
                ADAPTATIONS.append(f"cuda_pids: {sorted(set(pids) - set(good))} hold /dev/nvidia* but no CUDA "
                                   f"context (cuCheckpointProcessGetState fails); only {good} locked")
            return good or pids
        cuda_pids._bench = True
        C.cuda_pids = cuda_pids
    return node


def workload(name: str, eng: Engine, model: dict):
    from ckptflow.models import ProcessFinder, Workload

    # No metrics_url: the runner's /metrics read keeps an HTTP keep-alive connection open, and
    # CRIU then needs --tcp-established (and a network lock) for it.
    # tcp_established: torch.distributed's TCPStore connects the engine process to itself over TCP.
    return Workload(name=name, node="h200", engine="vllm", engine_version=VLLM_VERSION, model_id=model["model_id"],
                    model_revision=model["revision"], gpu=True, health_url=eng.url + "/health", tcp_established=True,
                    find=ProcessFinder(pid_file=str(eng.pid_file), cmdline_must_contain=CMDLINE))


def checkpoint(node, w, **kw):
    """node.checkpoint; if CRIU's network lock (nftables) fails on this kernel, again with
    --network-lock skip (every TCP peer of the tree is inside the frozen tree)."""
    from ckptflow.errors import CriuError

    try:
        return node.checkpoint(w, **kw)
    except CriuError as e:
        text = str(e)
        if node.criu.network_lock == "skip" or not re.search(r"nft|network.lock|lock network|iptables", text, re.I):
            raise
        ADAPTATIONS.append(f"CRIU --network-lock {node.criu.network_lock} failed here; used --network-lock skip: "
                           + " | ".join(l for l in text.splitlines() if "Error" in l)[:400])
        node.criu.network_lock = "skip"
        return node.checkpoint(w, **kw)


def criu_flags(node, m) -> list[str]:
    try:
        return json.loads((node.store.images_dir(m) / "ckptflow-criu.json").read_text()).get("flags", [])
    except (OSError, ValueError):
        return []


def prompts(seed: int = 7) -> tuple[list[int], list[int]]:
    import random

    r = random.Random(seed)
    session = [r.randrange(1000, 120000) for _ in range(SESSION_TOKENS)]
    user = [r.randrange(1000, 120000) for _ in range(NEXT_USER_TOKENS)]
    return session, user


# --- rows ------------------------------------------------------------------------------------------
def cold_start(eng: Engine, a, row: dict) -> None:
    """Row a's figures of one start of ``eng`` (``serve``) into ``row``."""
    st = serve(eng, a)
    row.update(health_s=st["health_s"], cold_start_s=st["first_token_s"], first_token_id=st["first_token_id"],
               **st["phases"])
    row["gpu_used_gib"] = gpu_used_gib()


def row_ab(a, model: dict, work: Path, res: dict) -> None:
    cache = work / "cache-a"
    shutil.rmtree(cache, ignore_errors=True)  # cold: no compiled graphs, kernels or autotune results
    eng = Engine("e1", work, Path(model["path"]), a.port, a.gpu_util, cache)
    ra: dict = {"row": "a", "what": "cold start to first token (empty vLLM/inductor/triton caches; weights in page cache)",
                "gpu_memory_utilization": a.gpu_util}
    res["rows"]["a"] = ra
    try:
        cold_start(eng, a, ra)
        ra["next_tokens_equal"] = None
        ra["next_tokens_equal_note"] = "no restore in this row"
        log("row a", json.dumps(ra))
    except Exception as e:
        ra["error"] = f"{type(e).__name__}: {e}"
        ra["log_tail"] = eng.tail()
        log("row a failed", ra["error"], ra["log_tail"][-1500:])
        eng.kill()
        return
    finally:
        save(res)
    if "b" not in a.rows:
        eng.kill()
        return
    rb: dict = {"row": "b", "what": "whole process (NodeRunner: CUDA lock+checkpoint of the tree's GPU processes, "
                "CRIU dump; CRIU restore, CUDA restore, unlock)", "gpu_memory_utilization": a.gpu_util}
    res["rows"]["b"] = rb
    node = None
    try:
        session, user = prompts()
        turn = complete(eng.url, session, TURN_TOKENS)
        nxt = session + turn + user
        t1 = time.perf_counter()
        first_run = complete(eng.url, nxt, TURN_TOKENS)
        rb["next_turn_s"] = round(time.perf_counter() - t1, 3)
        before = complete(eng.url, nxt, TURN_TOKENS)       # the state the checkpoint will hold: nxt cached
        rb["recompute_vs_cached_equal"] = first_run == before
        rb["distinct_tokens"] = len(set(before))
        m0 = metrics(eng.url)
        rb["gpu_used_gib"] = gpu_used_gib()
        rb["host_mem_gib"] = mem_total_gib()
        node = node_runner(a.store / "store-b")
        w = workload("vllm-b", eng, model)
        from ckptflow.runners.cuda import cuda_pids
        from ckptflow.runners.process import tree

        rb["tree_pids"] = len(tree(eng.pid))
        rb["cuda_pids"] = len(cuda_pids(eng.pid))
        # Issue #35: whether this host's CPU has AMX and whether any vLLM process enabled it (the
        # runner refuses a tree that did: CRIU cannot carry AMX state).
        from ckptflow.runners import xcomp

        rb["cpu_amx"] = xcomp.cpu_has_amx()
        rb["amx_enabled_pids"] = [p for p in tree(eng.pid) if xcomp.uses_amx(p)]
        log("row b: checkpoint", json.dumps({k: rb[k] for k in ("tree_pids", "cuda_pids", "cpu_amx", "amx_enabled_pids")}))
        t1 = time.perf_counter()
        m = checkpoint(node, w, leave_running=False)
        log("row b: restore")
        rb["checkpoint_wall_s"] = round(time.perf_counter() - t1, 2)
        rb["pause_s"] = m.timings.get("pause")
        rb["checkpoint_phases"] = m.timings
        rb["footprint_gib"] = round(m.gpu_footprint_bytes / GiB, 2)
        rb["image_gib"] = round(m.bytes / GiB, 2)
        rb["criu_flags"] = criu_flags(node, m)
        rb["footprint_x2_fits_host"] = 2 * m.gpu_footprint_bytes / GiB < rb["host_mem_gib"]
        node.criu.wait_pid_free(m.pid)
        t1 = time.perf_counter()
        r = node.restore(w, manifest=m)
        rb["restore_to_ready_s"] = round(time.perf_counter() - t1, 2)
        rb["restore_phases"] = r.timings
        t2 = time.perf_counter()
        after = complete(eng.url, nxt, TURN_TOKENS)
        rb["restore_to_first_token_s"] = round(time.perf_counter() - t1, 2)
        rb["next_turn_after_restore_s"] = round(time.perf_counter() - t2, 3)
        m1 = metrics(eng.url)
        rb["prefix_cache_hits_after_restore"] = m1.get("vllm:prefix_cache_hits_total", 0) - m0.get(
            "vllm:prefix_cache_hits_total", 0)
        rb["prompt_tokens_next_turn"] = len(nxt)
        rb["next_tokens"] = before
        rb["next_tokens_equal"] = after == before
        if after != before:
            rb["next_tokens_after"] = after
        node.store.delete(m)
        log("row b", json.dumps({k: v for k, v in rb.items() if k != "next_tokens"}))
    except Exception as e:
        rb["error"] = f"{type(e).__name__}: {e}"
        rb["traceback"] = traceback.format_exc()[-3000:]
        rb["log_tail"] = eng.tail()
        rb.setdefault("next_tokens_equal", None)
        log("row b failed", rb["traceback"])
    finally:
        save(res)
        eng.kill()
        if node is not None:
            node.close()
        shutil.rmtree(a.store / "store-b", ignore_errors=True)


def started(eng: Engine, a, row: dict) -> None:
    """A two-tier row's engine started (``serve``): its start-to-first-token and phases into ``row``."""
    st = serve(eng, a)
    row["start_to_first_token_s"] = st["first_token_s"]
    row["start_phases"] = st["phases"]


def connector_config(kind: str, chunk_dir: Path) -> dict:
    if kind in ("ckptflow", "ckptflow-bench"):
        from ckptflow.engines.vllm import kv_transfer_config

        cfg = kv_transfer_config(chunk_dir)
        if kind == "ckptflow-bench":  # bench/vllm_kv_bench.py: the same connector, two fixes
            cfg.update(kv_connector="BenchCkptflowConnector", kv_connector_module_path="vllm_kv_bench")
        return cfg
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(chunk_dir)}}


def row_c(a, model: dict, work: Path, res: dict) -> None:
    """Each connector in turn until one gives a complete row; failures are kept in the row."""
    kinds = {"auto": ["ckptflow-bench", "example"]}.get(a.connector, [a.connector])
    failures: list[dict] = []
    for kind in kinds:
        rc: dict = {"row": "c", "what": "two tiers: template (sleep level 2 + CUDA checkpoint + CRIU dump) + the "
                    "session's KV through a vLLM KV connector", "gpu_memory_utilization": a.gpu_util,
                    "connector": kind, "connector_failures": failures}
        res["rows"]["c"] = rc
        ok = attempt_c(a, model, work, res, rc, kind)
        save(res)
        if ok:
            return
        failures.append({k: rc.get(k) for k in ("connector", "kv_transfer_config", "error", "traceback", "log_tail")})
        rc["connector_failures"] = failures


def attempt_c(a, model: dict, work: Path, res: dict, rc: dict, kind: str) -> bool:
    cache = work / "cache-a"          # row a's caches (when row a ran on this machine)
    chunk_dir = work / f"kv-c-{kind}"
    eng = None
    node = None
    try:
        shutil.rmtree(chunk_dir, ignore_errors=True)
        chunk_dir.mkdir(mode=0o700, parents=True)
        cfg = connector_config(kind, chunk_dir)
        rc["kv_transfer_config"] = cfg
        eng = Engine("e2", work, Path(model["path"]), a.port + 1, a.gpu_util, cache,
                     ["--enable-sleep-mode", "--kv-transfer-config", json.dumps(cfg)],
                     env={"PYTHONPATH": os.environ.get("PYTHONPATH", "") + ":" + str(Path(__file__).parent)})
        started(eng, a, rc)
        if kind == "example":
            rc["session_tier_note"] = ("ckptflow's connector failed (connector_failures): vLLM's ExampleConnector "
                                       "(per-prompt safetensors under shared_storage_path) served as the session tier")
        session, user = prompts()
        sid = "s-long"
        turn = complete(eng.url, session, TURN_TOKENS, session=sid)
        nxt = session + turn + user
        ref1 = complete(eng.url, nxt, TURN_TOKENS)   # next turn, the session's KV from the engine's own cache
        ref2 = complete(eng.url, nxt, TURN_TOKENS)   # again, now with the next turn's own blocks cached
        rc["recompute_vs_cached_equal"] = ref1 == ref2
        # The restored engine computes what the live one computed: ckptflow's session holds the turn's
        # blocks (as ref1 had them); ExampleConnector holds the whole next-turn prompt (as ref2 had it).
        ref = ref2 if kind == "example" else ref1
        rc["distinct_tokens"] = len(set(ref))
        from ckptflow.store.local import LocalStore

        store = LocalStore(a.store / f"store-c-{kind}")
        t1 = time.perf_counter()
        if kind != "example":
            from ckptflow.engines.vllm import Server, restore_sessions, save_sessions

            srv = Server(url=eng.url, port=eng.port, pid_file=eng.pid_file, log_file=eng.log_file, chunk_dir=chunk_dir,
                         args=eng.args, env=eng.env)
            sm = save_sessions(srv, store, "vllm-c", [sid], node="h200")
            rc["session_export_s"] = round(time.perf_counter() - t1, 3)
            rc["session_blocks"] = getattr(sm.probe, "blocks", None)
            rc["session_tokens"] = (sm.probe.sessions or {}).get(sid)
            rc["session_bytes"] = sm.bytes
        else:
            saved = a.store / "example-saved"
            shutil.rmtree(saved, ignore_errors=True)
            shutil.copytree(chunk_dir, saved)
            rc["session_export_s"] = round(time.perf_counter() - t1, 3)
            rc["session_bytes"] = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
        # template: sleep level 2, then CUDA checkpoint + CRIU dump (the engine exits)
        t1 = time.perf_counter()
        st, raw = http("POST", eng.url + "/sleep?level=2")
        rc["sleep_s"] = round(time.perf_counter() - t1, 2)
        if st != 200:
            raise RuntimeError(f"POST /sleep?level=2 -> HTTP {st}: {raw[:300]!r}")
        rc["gpu_used_after_sleep_gib"] = gpu_used_gib()
        node = node_runner(a.store / f"store-c-tmpl-{kind}")
        w = workload("vllm-c", eng, model)
        t1 = time.perf_counter()
        m = checkpoint(node, w, leave_running=False, kind="scale_template")
        rc["template_capture_s"] = round(rc["sleep_s"] + time.perf_counter() - t1, 2)
        rc["template_pause_s"] = m.timings.get("pause")
        rc["template_phases"] = m.timings
        rc["template_image_gib"] = round(m.bytes / GiB, 2)
        rc["template_gpu_gib"] = round(m.gpu_footprint_bytes / GiB, 2)
        rc["criu_flags"] = criu_flags(node, m)
        node.criu.wait_pid_free(m.pid)
        # the session tier holds only what was exported: the engine's chunk directory is emptied
        shutil.rmtree(chunk_dir, ignore_errors=True)
        chunk_dir.mkdir(mode=0o700)
        if kind != "example":  # the connector made these at engine start; the restored engine expects them
            (chunk_dir / "blocks").mkdir(mode=0o700)
            (chunk_dir / "sessions").mkdir(mode=0o700)
        ph: dict = {}
        t1 = time.perf_counter()
        r = node.restore(w, manifest=m)
        ph.update(r.timings)
        ph["template_restore_s"] = round(time.perf_counter() - t1, 3)
        for key, method, path, body in (("wake_weights_s", "POST", "/wake_up?tags=weights", None),
                                        ("reload_weights_s", "POST", "/collective_rpc", {"method": "reload_weights"}),
                                        ("wake_kv_cache_s", "POST", "/wake_up?tags=kv_cache", None)):
            t2 = time.perf_counter()
            st, raw = http(method, eng.url + path, body)
            ph[key] = round(time.perf_counter() - t2, 3)
            if st != 200:
                raise RuntimeError(f"{method} {path} -> HTTP {st}: {raw[:300]!r}")
        t2 = time.perf_counter()
        if kind != "example":
            imp = restore_sessions(srv, store, sm)
            ph["blocks_imported"] = imp["blocks_imported"]
        else:
            shutil.rmtree(chunk_dir)
            shutil.copytree(saved, chunk_dir)
        ph["session_import_s"] = round(time.perf_counter() - t2, 3)
        rc["restore_to_ready_s"] = round(time.perf_counter() - t1, 2)
        rc["restore_phases"] = ph
        m0 = metrics(eng.url)
        t2 = time.perf_counter()
        after = complete(eng.url, nxt, TURN_TOKENS)
        rc["next_turn_after_restore_s"] = round(time.perf_counter() - t2, 3)
        rc["restore_to_first_token_s"] = round(time.perf_counter() - t1, 2)
        compare_next_turn(rc, m0, metrics(eng.url), nxt, ref, after, HITS + ("vllm:prompt_tokens_total",))
        cold = res["rows"].get("a", {}).get("cold_start_s")
        if cold:
            rc["cold_start_a_s"] = cold
            rc["ratio_to_cold_start"] = round(rc["restore_to_ready_s"] / cold, 3)
            rc["target_met"] = rc["restore_to_ready_s"] <= 0.1 * cold
        log("row c", json.dumps({k: v for k, v in rc.items() if k not in ("next_tokens", "connector_failures")}))
        return True
    except Exception:
        failed(rc, eng)
        return False
    finally:
        if eng is not None:
            eng.kill()
            shutil.copyfile(eng.log_file, work / f"e2-{kind}.log")
            eng.log_file.unlink(missing_ok=True)
        if node is not None:
            node.close()


def protocol_engine(a, model: dict, work: Path, name: str, port: int, chunk_dir: Path,
                    isolated: bool = False) -> Engine:
    """A vLLM that serves ckptflow's engine protocol (sleep mode, ckptflow's KV connector over an
    emptied ``chunk_dir``, the middleware and the worker extension), not started yet."""
    from ckptflow.engines.vllm import protocol_args

    shutil.rmtree(chunk_dir, ignore_errors=True)
    chunk_dir.mkdir(mode=0o700, parents=True)
    repo = Path(__file__).resolve().parents[1]
    return Engine(name, work, Path(model["path"]), port, a.gpu_util, work / "cache-a",
                  ["--enable-sleep-mode", *protocol_args(chunk_dir)],
                  env={"PYTHONPATH": os.environ.get("PYTHONPATH", "") + ":" + str(repo)}, isolated=isolated)


def long_session(url: str) -> tuple[str, list[int], list[int], list[int]]:
    """The long session's first turn (the connector lists it as ``s-long``); the next turn's prompt;
    the engine's answer to it (``ref``) and that answer again (``ref_cached``)."""
    session, user = prompts()
    sid = "s-long"
    turn = complete(url, session, TURN_TOKENS, session=sid)
    nxt = session + turn + user
    ref = complete(url, nxt, TURN_TOKENS)
    # The connector now holds the next turn's own prompt blocks too; an answer computed from
    # them is this one (bf16: cached and recomputed KV give other tokens on the H200).
    ref_cached = complete(url, nxt, TURN_TOKENS)
    return sid, nxt, ref, ref_cached


def capture_template(tt, w, row: dict, sid: str):
    """The first two-tier heartbeat of ``w`` (it captures the template); its figures into ``row``."""
    t1 = time.perf_counter()
    m = tt.heartbeat(w)
    row["heartbeat_with_capture_s"] = round(time.perf_counter() - t1, 2)
    tmpl = tt.store.get(m.probe.template.workload, m.probe.template.id)
    row["template_timings"] = tmpl.timings
    row["template_image_gib"] = round(tmpl.bytes / GiB, 2)
    row["template_gpu_gib"] = round((tmpl.gpu_footprint_bytes or 0) / GiB, 2)
    row["session_tokens"] = tt._records(m)["sessions"][sid]["tokens"]
    row["session_bytes"] = m.probe.export.total_bytes
    return m


def only_in_store(chunk_dir: Path) -> None:
    """The node's KV files gone (only the store holds the sessions), the connector's folders kept."""
    shutil.rmtree(chunk_dir)
    for d in (chunk_dir / "blocks", chunk_dir / "sessions"):
        d.mkdir(mode=0o700, parents=True)


HITS = ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")


def compare_next_turn(row: dict, m0: dict, m1: dict, nxt: list[int], ref: list[int], after: list[int],
                      counters: tuple[str, ...] = HITS) -> None:
    """The next turn after a restore against the engine's before it: each of ``counters`` over the
    turn (metrics ``m0`` before it, ``m1`` after), and whether its tokens equal ``ref``."""
    for k in counters:
        row[k.split(":")[1].replace("_total", "") + "_next_turn"] = m1.get(k, 0) - m0.get(k, 0)
    row["prompt_tokens_next_turn"] = len(nxt)
    row["next_tokens"] = ref
    row["next_tokens_equal"] = after == ref
    if after != ref:
        row["next_tokens_after"] = after


def row_p(a, model: dict, work: Path, res: dict) -> None:
    """Two tiers driven by ckptflow's own runner through the protocol vLLM serves (its middleware
    and ckptflow's connector): heartbeat (template capture + session export), SIGKILL, the node's
    KV files removed, recover; no bench code between the runner and the engine."""
    from ckptflow.engines.vllm import kill_tree
    from ckptflow.runners.process import pid_alive, tree
    from ckptflow.runners.template_sessions import TemplateSessionsRunner

    rp: dict = {"row": "p", "what": "template + sessions through the protocol vLLM serves (--middleware "
                "ckptflow.engines.vllm_protocol + ckptflow's KV connector), driven by TemplateSessionsRunner: "
                "template = pause + sleep level 2 + CUDA checkpoint + CRIU dump", "gpu_memory_utilization": a.gpu_util}
    res["rows"]["p"] = rp
    chunk_dir = work / "kv-p"
    eng = protocol_engine(a, model, work, "e3", a.port + 2, chunk_dir)
    node = None
    try:
        started(eng, a, rp)
        sid, nxt, ref, ref_cached = long_session(eng.url)
        rp["distinct_tokens"] = len(set(ref))
        node = node_runner(a.store / "store-p")
        w = workload("vllm-p", eng, model).model_copy(update={"checkpoint": "template-sessions"})
        tt = TemplateSessionsRunner(node)
        capture_template(tt, w, rp, sid)
        again = complete(eng.url, nxt, TURN_TOKENS)    # served on after the capture (weights back from disk)
        rp["served_after_capture_equal"] = again == ref_cached
        t1 = time.perf_counter()
        m2 = tt.heartbeat(w)                           # a session heartbeat alone
        rp["session_heartbeat_s"] = round(time.perf_counter() - t1, 3)
        rp["session_heartbeat_pause_s"] = m2.timings.get("pause")
        pids = tree(eng.pid)
        kill_tree(eng.pid)
        deadline = time.time() + 60
        while any(pid_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.05)
        only_in_store(chunk_dir)
        t1 = time.perf_counter()
        r = tt.restore(w)
        rp["restore_to_ready_s"] = round(time.perf_counter() - t1, 2)
        rp["restore_phases"] = r.timings
        m0 = metrics(eng.url)
        t2 = time.perf_counter()
        after = complete(eng.url, nxt, TURN_TOKENS)
        rp["next_turn_after_restore_s"] = round(time.perf_counter() - t2, 3)
        rp["restore_to_first_token_s"] = round(time.perf_counter() - t1, 2)
        compare_next_turn(rp, m0, metrics(eng.url), nxt, ref, after)
        log("row p", json.dumps({k: v for k, v in rp.items() if k != "next_tokens"}))
    except Exception:
        failed(rp, eng)
    finally:
        eng.kill()   # its log is work/e3.log already, which save() copies
        if node is not None:
            node.close()
        save(res)


RESERVE_GIB = 25.3   # per engine: 0.18 of the H200's 140.4 GiB, where every earlier row ran
KV_BYTES_PER_TOKEN = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * \
    (SHAPE["hidden_size"] // SHAPE["num_attention_heads"]) * 2   # K and V, bf16: 128 KiB a token


PROMOTE_GUARD_S = 180   # promote took 1.6 s and the next turn 0.7 s in row p's restore (H200)


def row_s(a, model: dict, work: Path, res: dict) -> None:
    """Failover onto a parked standby (issue #31 item 6), as tests/test_vllm.py's standby test on CPU:
    the engine started isolated (PID 1 of its own PID and mount namespaces, as ``ckptflow
    run-isolated``); after the first heartbeat (template + session) TemplateSessionsRunner.standby
    restores the template beside it, in its own PID and network namespaces, and parks it there
    (asleep: CUDA context and graphs back, no weights, no KV on the GPU). The session then grows a
    turn and a heartbeat exports it; the node's KV files are removed, the engine is SIGKILLed, and
    ``promote`` gives the standby the weights and the session (one template/resume: no CRIU, no device
    restore). The next turn, streamed from the standby in its namespace: its first token, its 32
    tokens against the engine's before the kill, the session's tokens as external prefix-cache hits."""
    from ckptflow.runners import devshm
    from ckptflow.runners import engine as protocol
    from ckptflow.runners.process import pid_alive, tree
    from ckptflow.runners.template_sessions import TemplateSessionsRunner
    from ckptflow.runners.verify import del_netns, new_netns

    rs: dict = {"row": "s", "what": "standby failover: the template restored beside the live engine (isolated) by "
                "TemplateSessionsRunner.standby, parked asleep in its own namespaces; SIGKILL; promote (weights + "
                "session in one template/resume)", "gpu_memory_utilization": a.gpu_util}
    res["rows"]["s"] = rs
    chunk_dir = work / "kv-s"
    eng = protocol_engine(a, model, work, "e4", a.port + 3, chunk_dir, isolated=True)
    node = sb = ns = guard = None
    try:
        started(eng, a, rs)
        pids = tree(eng.pid)
        # an isolated image whose tree keeps /dev/shm files gets no copy beside it (runners/criu.py)
        rs["engine_dev_shm_files"] = sorted(devshm.files_of(pids))
        rs["engine_holds_dev_shm"] = devshm.needed(pids)
        rs["gpu_used_live_gib"] = gpu_used_gib()
        sid, nxt, _, _ = long_session(eng.url)
        node = node_runner(a.store / "store-s")
        w = workload("vllm-s", eng, model).model_copy(update={"checkpoint": "template-sessions"})
        tt = TemplateSessionsRunner(node)
        capture_template(tt, w, rs, sid)
        ns = new_netns("ckvs")
        t1 = time.perf_counter()
        sb = tt.standby(w, ns)
        rs["standby_s"] = round(time.perf_counter() - t1, 2)
        rs["standby_phases"] = sb.timings
        rs["standby_parked"] = protocol.call(w, "/v1/ckptflow/engine", base=sb.base, netns=ns).get("parked")
        rs["gpu_used_with_standby_gib"] = gpu_used_gib()
        _, user2 = prompts(seed=8)
        turn2 = complete(eng.url, nxt, TURN_TOKENS, session=sid)   # the session grows after the standby was taken
        nxt2 = nxt + turn2 + user2
        ref = complete(eng.url, nxt2, TURN_TOKENS)                  # the engine's answer to the turn after
        ref_cached = complete(eng.url, nxt2, TURN_TOKENS)           # again, its own blocks cached (diagnosis only)
        rs["distinct_tokens"] = len(set(ref))
        t1 = time.perf_counter()
        m2 = tt.heartbeat(w)
        rs["session_heartbeat_s"] = round(time.perf_counter() - t1, 3)
        rs["session_heartbeat_pause_s"] = m2.timings.get("pause")
        rs["session_tokens"] = tt._records(m2)["sessions"][sid]["tokens"]
        rs["session_bytes"] = m2.probe.export.total_bytes
        only_in_store(chunk_dir)
        victims = tree(eng.pid)
        exited: dict = {}

        def hung() -> None:   # a standby that hangs in promote must not take this call's other rows with it
            rs["guard_fired"] = f"promote and the next turn took over {PROMOTE_GUARD_S} s: the standby was killed"
            sb.copy.stop()

        guard = threading.Timer(PROMOTE_GUARD_S, hung)
        guard.daemon = True
        guard.start()
        t0 = time.perf_counter()
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

        def watch() -> None:  # on one GPU the killed engine's teardown overlaps the promotion
            while any(pid_alive(p) for p in victims) and time.perf_counter() - t0 < 60:
                time.sleep(0.005)
            exited["s"] = round(time.perf_counter() - t0, 3)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        r = tt.promote(w, sb)
        rs["kill_to_ready_s"] = round(time.perf_counter() - t0, 3)
        ready = time.monotonic()
        rs["promote_phases"] = r.timings
        m0 = in_netns(ns, metrics, sb.base)
        t2 = time.monotonic()
        after, times, with_ids = in_netns(ns, stream, sb.base, nxt2, TURN_TOKENS)
        rs["next_turn_after_restore_s"] = round(time.monotonic() - t2, 3)
        rs["next_turn_first_token_s"] = round(times[0] - t2, 3) if times else None
        rs["kill_to_first_token_s"] = round(rs["kill_to_ready_s"] + times[0] - ready, 3) if times else None
        m1 = in_netns(ns, metrics, sb.base)
        if not with_ids:   # the stream carried no token ids: the tokens from a plain request (its prompt cached now)
            rs["stream_without_token_ids"] = True
            after = in_netns(ns, complete, sb.base, nxt2, TURN_TOKENS)
        compare_next_turn(rs, m0, m1, nxt2, ref, after)
        rs["equal_to_cached_reference"] = after == ref_cached
        guard.cancel()
        watcher.join(timeout=60)
        rs["original_exited_s"] = exited.get("s")
        rs["kill_to_ready_target_met"] = rs["kill_to_ready_s"] <= 1.5
        rs["first_token_target_met"] = rs["next_turn_first_token_s"] is not None and rs["next_turn_first_token_s"] <= 0.5
        rs["session_from_store"] = rs["external_prefix_cache_hits_next_turn"] >= rs["session_tokens"]
        log("row s", json.dumps({k: v for k, v in rs.items() if k != "next_tokens"}))
    except Exception:
        failed(rs, eng)
    finally:
        if guard is not None:
            guard.cancel()
        if sb is not None:
            sb.copy.stop()
        if ns:
            del_netns(ns)
        eng.kill()
        if node is not None:
            node.close()
        save(res)


def row_t(a, model: dict, work: Path, res: dict) -> None:
    """A turn-end export's cost to a decoding client (issue #31 item 6; bench/gpu_turn_export.py for the
    bench engine): a batch-1 client streams tokens (its own process) while the runner exports other
    sessions at their turn ends, one at a time, the way ``ckptflow turns`` does (runners/turns.py
    ``TurnWatch.poll`` -> ``turn_end_checkpoint``, each a new 4,000-token session: all its blocks
    move). The client's gaps between tokens during each export against those outside."""
    from ckptflow.policies.cadence import CostModel
    from ckptflow.policies.sessions import ExportContext
    from ckptflow.runners import engine as protocol
    from ckptflow.runners.template_sessions import TemplateSessionsRunner
    from ckptflow.runners.turns import DEFAULT_MTBF_S, TurnWatch

    rt: dict = {"row": "t", "what": "turn-end exports (TurnWatch.poll -> turn_end_checkpoint) beside a batch-1 "
                "streamed decode: the client's inter-token gaps during the exports", "gpu_memory_utilization": a.gpu_util,
                "exports_planned": a.turn_exports, "every_s": a.turn_every, "base_s": a.turn_base}
    res["rows"]["t"] = rt
    eng = protocol_engine(a, model, work, "e5", a.port + 4, work / "kv-t")
    out = work / "t-client.json"
    flags = [out.with_name(out.name + x) for x in ("", ".stop", ".started")]
    node = client = None
    try:
        started(eng, a, rt)
        sid, _, _, _ = long_session(eng.url)
        node = node_runner(a.store / "store-t")
        w = workload("vllm-t", eng, model).model_copy(update={"checkpoint": "template-sessions"})
        tt = TemplateSessionsRunner(node)
        capture_template(tt, w, rt, sid)
        others = [f"s-t{i}" for i in range(a.turn_exports)]
        for i, other in enumerate(others):   # their first turns, before the client decodes
            complete(eng.url, prompts(seed=100 + i)[0], TURN_TOKENS, session=other)
        # An announced interruption and bytes unpriced: the turn-end rule exports every new session.
        ctx = ExportContext(mtbf_s=DEFAULT_MTBF_S, interruption_ahead=True, at_turn_end=True,
                            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                            cost=CostModel(shared_tier_usd_per_gib=0.0, node_usd_per_gib=0.0))
        tt.store.put_export_context(w.name, ctx.model_dump_json())
        watch = TurnWatch(tt, w)
        for f in flags:
            f.unlink(missing_ok=True)
        client = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--stream-client", eng.url, str(out)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=open(work / "t-client.log", "w"), start_new_session=True)
        deadline = time.monotonic() + 120
        while not flags[2].exists():
            if client.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the decoding client did not start streaming (exit {client.poll()}): "
                                   f"{(work / 't-client.log').read_text(errors='replace')[-1500:]}")
            time.sleep(0.05)
        since = time.monotonic()
        time.sleep(a.turn_base)
        exports: list[dict] = []
        for other in others:
            held = {k: int(v) for k, v in protocol.engine_info(w).get("sessions", {}).items()}
            watch.seen = held                                            # unchanged since the last look:
            watch.weighed = {k: n for k, n in held.items() if k != other}   # only `other` is at a turn end
            t0 = time.monotonic()
            m = watch.poll()
            t1 = time.monotonic()
            e = {"session": other, "start": t0, "end": t1, "wall_s": round(t1 - t0, 4), "exported": m is not None}
            if m is not None:
                e.update(timings=m.timings, moved_bytes=m.probe.export.moved_bytes,
                         decision=m.probe.export.decisions.get(other))
            exports.append(e)
            time.sleep(a.turn_every)
        time.sleep(a.turn_base)
        until = time.monotonic()
        flags[1].touch()
        client.wait(timeout=120)
        got = json.loads(out.read_text())
        if got.get("error"):
            raise RuntimeError(f"the decoding client failed: {got['error']}")
        reqs = got["requests"]
        rt.update(gap_stats(reqs, [(e["start"], e["end"]) for e in exports if e["exported"]], since, until))
        rt["exports"] = [{k: v for k, v in e.items() if k not in ("start", "end")} for e in exports]
        done = [e for e in exports if e["exported"]]
        rt["exported"] = len(done)
        if done:
            rt["export_wall_s_mean"] = round(sum(e["wall_s"] for e in done) / len(done), 4)
            rt["moved_gib_each"] = round(sum(e["moved_bytes"] for e in done) / len(done) / GiB, 3)
        rt["client_requests"] = len(reqs)
        rt["client_events_per_request"] = len(reqs[0]["times"]) if reqs else 0
        # None: the stream carried no token ids to compare
        rt["decode_tokens_equal"] = (all(r["ids"] == reqs[0]["ids"] for r in reqs)
                                     if reqs and all(r["with_ids"] for r in reqs) else None)
        rt["next_tokens_equal"] = rt["decode_tokens_equal"]
        rt["next_tokens_equal_note"] = ("no restore in this row: the client's tokens, each request the same prompt, "
                                        "equal through the exports")
        log("row t", json.dumps({k: v for k, v in rt.items() if k != "exports"}))
    except Exception:
        failed(rt, eng)
    finally:
        if client is not None and client.poll() is None:
            flags[1].touch()
            try:
                client.wait(timeout=15)
            except subprocess.TimeoutExpired:
                client.kill()
        eng.kill()
        if node is not None:
            node.close()
        save(res)


def row_a_warm(a, model: dict, work: Path, res: dict) -> None:
    """Row a's engine started again with the compile caches kept (work/cache-a: vLLM's, inductor's,
    triton's), as a restart on a node that ran the engine before. Warm from row a when it ran in
    this call; else from whatever the rows before left there (``cache_files_before``)."""
    cache = work / "cache-a"
    rw: dict = {"row": "a_warm", "what": "cold start to first token with warm compile caches (work/cache-a kept); "
                "weights in page cache", "gpu_memory_utilization": a.gpu_util,
                "caches_from": "row a of this call" if "a" in a.rows else "the rows before in this call (or none)",
                "cache_files_before": sum(1 for f in cache.rglob("*") if f.is_file()) if cache.exists() else 0}
    res["rows"]["a_warm"] = rw
    eng = Engine("e1w", work, Path(model["path"]), a.port + 5, a.gpu_util, cache)
    try:
        cold_start(eng, a, rw)
        cold = res["rows"].get("a", {}).get("cold_start_s")
        if cold:
            rw["cold_start_a_s"] = cold
            rw["ratio_to_a"] = round(rw["cold_start_s"] / cold, 3)
        rw["next_tokens_equal"] = None
        rw["next_tokens_equal_note"] = "no restore in this row"
        log("row a_warm", json.dumps(rw))
    except Exception:
        failed(rw, eng)
    finally:
        eng.kill()
        save(res)


def failed(row: dict, eng: Engine | None) -> None:
    """In an ``except``: the row's error, traceback and the engine log's error lines, kept beside
    what the row measured before it failed."""
    e = sys.exc_info()[1]
    row["error"] = f"{type(e).__name__}: {e}"
    row["traceback"] = traceback.format_exc()[-3000:]
    row["log_tail"] = _errors(eng) if eng else ""
    row.setdefault("next_tokens_equal", None)
    log(f"row {row['row']}" + (f" ({row['connector']})" if row.get("connector") else "") + " failed",
        row["traceback"], row["log_tail"][-2500:])


def _errors(eng: Engine) -> str:
    """The engine log's error lines (the root cause sits above the API server's own traceback)."""
    try:
        lines = eng.log_file.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errs = [l for l in lines if "ERROR" in l or "Error" in l]
    return "\n".join(errs[:60])[-6000:]


# --- results --------------------------------------------------------------------------------------
def save(res: dict) -> None:
    res["adaptations"] = sorted(set(ADAPTATIONS))
    STATE.write_text(json.dumps(res, indent=1))
    if OUT:
        (OUT / "vllm_gpu.json").write_text(json.dumps(res, indent=1))
        work = Path(res.get("work", "/nonexistent"))
        logs_to_out(OUT, "vllm_gpu-logs.tar.gz", [work / n for n in (
            "e1.log", "e2-ckptflow-bench.log", "e2-example.log", "e3.log", "e4.log", "e5.log", "e1w.log",
            "t-client.log")], 2 * 2**20)


def table(res: dict) -> str:
    rows = res["rows"]
    a, b, c, pr = rows.get("a", {}), rows.get("b", {}), rows.get("c", {}), rows.get("p", {})
    hdr = ["row", "what", "cold start / pause s", "restore-to-ready s", "first token after restore s", "image GiB",
           "next_tokens_equal", "notes"]
    out = []
    if a:
        out.append(["a", "cold start to first token", a.get("cold_start_s", "—"), "—", "—", "—", "n/a",
                    a.get("error") or (f"API server imports {a.get('api_server_imports_s')} s, weights {a.get('weights_load_s')} s, "
                                       f"torch.compile {a.get('torch_compile_s')} s, graphs {a.get('graph_capture_s')} s, "
                                       f"init engine {a.get('init_engine_s')} s")])
    if b:
        pause = round(b["pause_s"], 2) if isinstance(b.get("pause_s"), (int, float)) else "—"
        out.append(["b", "whole process (CUDA + CRIU)", pause, b.get("restore_to_ready_s", "—"),
                    b.get("restore_to_first_token_s", "—"), b.get("image_gib", "—"), b.get("next_tokens_equal"),
                    b.get("error") or f"footprint {b.get('footprint_gib')} GiB; prefix hits after restore "
                                      f"{b.get('prefix_cache_hits_after_restore')}"])
    if c:
        out.append(["c", f"two tiers ({c.get('connector', '?')} connector)", c.get("template_capture_s", "—"),
                    c.get("restore_to_ready_s", "—"), c.get("restore_to_first_token_s", "—"),
                    c.get("template_image_gib", "—"), c.get("next_tokens_equal"),
                    c.get("error") or f"ratio to (a) {c.get('ratio_to_cold_start')} (target <= 0.1: "
                                      f"{c.get('target_met')}); external prefix hits "
                                      f"{c.get('external_prefix_cache_hits_next_turn')}"])
    if pr:
        out.append(["p", "two tiers through the protocol vLLM serves (runner-driven)",
                    pr.get("heartbeat_with_capture_s", "—"), pr.get("restore_to_ready_s", "—"),
                    pr.get("restore_to_first_token_s", "—"), pr.get("template_image_gib", "—"),
                    pr.get("next_tokens_equal"),
                    pr.get("error") or f"session heartbeat {pr.get('session_heartbeat_s')} s (pause "
                                       f"{pr.get('session_heartbeat_pause_s')} s); external prefix hits "
                                       f"{pr.get('external_prefix_cache_hits_next_turn')} of "
                                       f"{pr.get('session_tokens')} session tokens"])
    s, t, aw = rows.get("s", {}), rows.get("t", {}), rows.get("a_warm", {})
    if s:
        out.append(["s", "standby failover: parked template copy promoted after SIGKILL (runner-driven)",
                    s.get("standby_s", "—"), s.get("kill_to_ready_s", "—"), s.get("next_turn_first_token_s", "—"),
                    s.get("template_image_gib", "—"), s.get("next_tokens_equal"),
                    s.get("error") or f"standby ahead of need (column 3); kill -> ready <= 1.5 s: "
                                      f"{s.get('kill_to_ready_target_met')}; first token <= 0.5 s: "
                                      f"{s.get('first_token_target_met')}; standby parked on the GPU "
                                      f"{s.get('template_gpu_gib')} GiB; external prefix hits "
                                      f"{s.get('external_prefix_cache_hits_next_turn')} of {s.get('session_tokens')} "
                                      f"session tokens; promote {s.get('promote_phases')}"])
    if t:
        during, base = t.get("gaps_during_exports", {}), t.get("gaps_outside_exports", {})
        out.append(["t", "turn-end exports beside a batch-1 streamed decode (TurnWatch)", "—", "—", "—", "—",
                    t.get("next_tokens_equal"),
                    t.get("error") or f"{t.get('exported')} exports of {t.get('moved_gib_each')} GiB, "
                                      f"{t.get('export_wall_s_mean')} s each; gap p50 {base.get('p50_ms')} ms, "
                                      f"during exports mean +{t.get('gap_increase_ms')} ms, max +"
                                      f"{t.get('max_gap_increase_ms')} ms (without: +{t.get('base_max_gap_increase_ms')}"
                                      f" ms); lost per export {t.get('lost_ms_per_export')} ms "
                                      f"(± {t.get('lost_ms_per_export_noise')}; target <= 5 ms: {t.get('target_verdict')}); "
                                      f"p99 {base.get('p99_ms')} -> {during.get('p99_ms')} ms"])
    if aw:
        out.append(["a_warm", "cold start to first token, compile caches warm", aw.get("cold_start_s", "—"), "—", "—",
                    "—", "n/a",
                    aw.get("error") or f"caches from {aw.get('caches_from')}; compiled graphs loaded from cache "
                                       f"{aw.get('compiled_graphs_loaded_from_cache')}; torch.compile "
                                       f"{aw.get('torch_compile_s')} s, graphs {aw.get('graph_capture_s')} s, init "
                                       f"engine {aw.get('init_engine_s')} s; ratio to (a) {aw.get('ratio_to_a')}"])
    return md_table(hdr, out)


ROWS = ("a", "b", "c", "p", "s", "t", "a_warm")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="a,b,c", help=f"comma-separated, of {','.join(ROWS)}")
    p.add_argument("--work", type=Path, default=HOME / "vllm-bench")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--gpu-util", type=float, default=None,
                   help=f"vLLM's --gpu-memory-utilization (default: what reserves {RESERVE_GIB} GiB on this card)")
    p.add_argument("--port", type=int, default=18720)
    p.add_argument("--start-timeout", type=float, default=420)
    p.add_argument("--connector", choices=["auto", "ckptflow", "ckptflow-bench", "example"], default="auto")
    p.add_argument("--resume-from", type=Path, default=None,
                   help="results JSON whose rows this run adds to (of bench/results/vllm_gpu.json: its newest run)")
    p.add_argument("--store", type=Path, default=None, help="checkpoint store (default: /dev/shm if it has room)")
    p.add_argument("--append-results", type=Path, default=None,
                   help="here: a fetched device JSON into bench/results/vllm_gpu.json and RESULTS.md")
    p.add_argument("--turn-exports", type=int, default=6, help="row t: sessions exported at their turn ends")
    p.add_argument("--turn-every", type=float, default=1.0, help="row t: seconds between one export's end and the next")
    p.add_argument("--turn-base", type=float, default=3.0, help="row t: seconds of decode before the first export and "
                   "after the last")
    p.add_argument("--write-model", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--stream-client", nargs=2, metavar=("URL", "OUT"), default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.stream_client:   # row t's decoding client, started by row t
        stream_client(a.stream_client[0], Path(a.stream_client[1]))
        return
    if a.write_model:
        import torch

        info = write_model(a.write_model)
        info["torch"] = torch.__version__
        print(json.dumps(info))
        return
    if a.append_results:
        append_device_run("vllm_gpu", a.append_results, f"vLLM {VLLM_VERSION} on {{gpu}}: cold start, whole process, "
                          "two tiers (bench/vllm_gpu.py)", "carry-vllm.sh", table)
        return
    a.rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = sorted(set(a.rows) - set(ROWS))
    if unknown:
        p.error(f"--rows: no row {', '.join(unknown)} (rows: {', '.join(ROWS)})")
    a.work.mkdir(parents=True, exist_ok=True)
    if a.gpu_util is None:
        a.gpu_util = gpu_util_for(RESERVE_GIB)
    if STATE.exists():
        res = json.loads(STATE.read_text())
    elif a.resume_from and a.resume_from.exists():  # rows of an earlier machine (a fresh one has no $HOME state)
        res = json.loads(a.resume_from.read_text())
        if "runs" in res:  # bench/results/vllm_gpu.json keeps every run: resume from the newest
            res = {k: v for k, v in res["runs"][-1].items() if k not in ("date", "command", "note")}
    else:
        res = {"rows": {}}
    res.update(machine=machine(), work=str(a.work), vllm=VLLM_VERSION,
               commands=[*res.get("commands", []), "python3 " + " ".join(sys.argv)])
    old = Path("/proc/sys/kernel/io_uring_disabled").read_text().strip()
    Path("/proc/sys/kernel/io_uring_disabled").write_text("2")   # uvloop/libuv then uses epoll: CRIU can dump it
    res["io_uring_disabled_was"] = old
    try:
        res["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
        t0 = time.perf_counter()
        # In a child: this process keeps no CUDA context of its own next to the engines it checkpoints.
        r = subprocess.run([sys.executable, __file__, "--write-model", str(a.model_dir or (HOME / "models" / "llama3-8b-shape"))],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"writing the model failed: {r.stderr[-2000:]}")
        model = json.loads(r.stdout.strip().splitlines()[-1])
        res["model"] = model
        res["torch"] = model.get("torch")
        log(f"model ready in {time.perf_counter() - t0:.1f} s: {model['gib']} GiB")
        if a.store is None:
            free_shm = shutil.disk_usage("/dev/shm").free / GiB if Path("/dev/shm").exists() else 0
            a.store = Path("/dev/shm/ckptflow-vllm") if free_shm > 45 else a.work
        res["store"] = str(a.store)
        if "a" in a.rows or "b" in a.rows:
            row_ab(a, model, a.work, res)
        if "c" in a.rows:
            row_c(a, model, a.work, res)
        if "p" in a.rows:
            row_p(a, model, a.work, res)
        if "s" in a.rows:
            row_s(a, model, a.work, res)
        if "t" in a.rows:
            row_t(a, model, a.work, res)
        if "a_warm" in a.rows:   # last: the rows before leave the compile caches warm
            row_a_warm(a, model, a.work, res)
    finally:
        Path("/proc/sys/kernel/io_uring_disabled").write_text(old)
        if a.store and str(a.store).startswith("/dev/shm/"):
            shutil.rmtree(a.store, ignore_errors=True)
        save(res)
    print(table(res))


if __name__ == "__main__":
    main()
