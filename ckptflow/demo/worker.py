"""CPU demo worker: an OpenAI-style HTTP server over TinyTransformer, with vLLM's metrics.

Run:  python -m ckptflow.demo.worker --port 18001 --pid-file /tmp/w.pid

API (127.0.0.1 only):
    POST /v1/completions        {"prompt": str, "max_tokens": int, "session_id": str?}
    GET  /health                200 {"status": "ok"}
    GET  /metrics               Prometheus text with vLLM's metric names
    GET  /v1/sessions           {"sessions": {id: n_tokens}}
    GET  /v1/sessions/digests   {"sessions": {id: digest}} in one request (the runner's probe)
    GET  /v1/sessions/{id}/digest  {"digest": sha256 of the session's KV, tokens and RNG}
    GET  /v1/ballast/digest     sha256 of the ballast memory (stands in for weights/KV bytes)

Two-tier protocol (docs/engines/protocol.md):
    GET  /v1/ckptflow/engine            protocol version, engine, model and template key
    POST /v1/ckptflow/sessions/export   sessions' state as content-addressed chunks (new ones only)
    POST /v1/ckptflow/sessions/import   sessions back from chunks (every chunk checked)
    POST /v1/ckptflow/template/prepare  weights out as chunks; weights and sessions released
    POST /v1/ckptflow/template/resume   weights back from chunks; serving again

Single-threaded on purpose: requests are served one at a time, so the state a checkpoint
captures is always between two requests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ckptflow.demo.model import ModelConfig, Session, TinyTransformer, decode, encode
from ckptflow.engines.engine_side import PROTOCOL, EngineSide, ExportRequest, SessionLost, SessionState, routes

KV_CAPACITY_TOKENS = 65536  # what "100 % KV cache usage" means for the demo
SESSION_CHUNK = 64 << 10   # small sessions here; the GPU engines use 8 MiB
WEIGHT_CHUNK = 1 << 20


class Metrics:
    """vLLM's metric names, so the policy reads the demo workers like a real engine."""

    def __init__(self, model_name: str):
        reg = self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests running.", labels, registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting.", labels, registry=reg)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100 %.", labels, registry=reg)
        self.prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=reg)
        self.gen = Counter("vllm:generation_tokens", "Generation tokens processed.", labels, registry=reg)
        self.ok = Counter("vllm:request_success", "Finished requests.", labels, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, registry=reg,
                             buckets=(0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
        self.sessions = Gauge("ckptflow_demo:sessions_open", "Long sessions with a KV cache.",
                              labels, registry=reg)
        for m in (self.running, self.waiting, self.kv, self.sessions):
            m.labels(model_name).set(0)

    def observe(self, n_prompt: int, n_gen: int, seconds: float, cached_tokens: int, capacity: int,
                n_sessions: int) -> None:
        name = self.model_name
        self.prompt.labels(name).inc(n_prompt)
        self.gen.labels(name).inc(n_gen)
        self.ok.labels(name).inc()
        self.e2e.labels(name).observe(seconds)
        self.kv.labels(name).set(min(1.0, cached_tokens / capacity))
        self.sessions.labels(name).set(n_sessions)


def parse_completion(body: dict) -> tuple[str, int, str | None]:
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise ValueError("prompt must be a string")
    max_tokens = int(body.get("max_tokens", 16))
    if not 0 <= max_tokens <= 4096:
        raise ValueError("max_tokens must be between 0 and 4096")
    sid = body.get("session_id")
    if sid is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", str(sid)):
        raise ValueError("session_id must be 1-64 characters of [A-Za-z0-9._-]")
    return prompt, max_tokens, sid


def completion_response(model_name: str, sid: str | None, toks: list[int], n_prompt: int) -> dict:
    return {"object": "text_completion", "model": model_name, "session_id": sid,
            "choices": [{"index": 0, "text": decode(toks), "tokens": toks, "finish_reason": "length"}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(toks)}}


class Worker(EngineSide):
    """The numpy worker. The HTTP handler needs: metrics, complete(), session_lengths(),
    session_digests(), ballast_digest(); the protocol's engine side is engines/engine_side.py's,
    over this worker's arrays."""

    ENGINE = "ckptflow-demo"
    SESSION_CHUNK = SESSION_CHUNK
    WEIGHT_CHUNK = WEIGHT_CHUNK

    def __init__(self, seed: int, ballast_mib: int, model_name: str):
        self.model = TinyTransformer(ModelConfig(seed=seed))
        self.model_name = model_name
        self.sessions: dict = {}
        # Ballast stands in for weights and KV blocks: real, touched, non-zero pages.
        n = ballast_mib * (1 << 20) // 8
        self.ballast = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(seed)
        self.ballast_bytes = self.ballast.nbytes
        self.parked, self.parked_with = False, None
        self.metrics = Metrics(model_name)

    def complete(self, body: dict) -> dict:
        prompt, max_tokens, sid = parse_completion(body)
        self.check_lost(sid)
        if self.parked:
            raise ValueError("engine is parked for a template checkpoint (weights released); retry shortly")
        t0 = time.perf_counter()
        self.metrics.running.labels(self.model_name).set(1)
        try:
            if sid is None:
                # Stateless request: a throwaway session seeded from the prompt (deterministic).
                s = self.model.new_session("oneshot:" + hashlib.sha256(prompt.encode()).hexdigest())
            else:
                s = self.sessions.get(sid) or self.sessions.setdefault(sid, self.model.new_session(sid))
            toks = self.model.generate(s, encode(prompt), max_tokens)
        finally:
            self.metrics.running.labels(self.model_name).set(0)
        n_prompt = len(encode(prompt))
        self.metrics.observe(n_prompt, len(toks), time.perf_counter() - t0,
                             sum(len(x.tokens) for x in self.sessions.values()), KV_CAPACITY_TOKENS,
                             len(self.sessions))
        return completion_response(self.model_name, sid, toks, n_prompt)

    def session_lengths(self) -> dict[str, int]:
        return {k: len(s.tokens) for k, s in self.sessions.items()}

    def session_digests(self) -> dict[str, str]:
        return {k: s.digest() for k, s in self.sessions.items()}

    def ballast_digest(self) -> dict:
        if self.ballast is None:
            raise ValueError("engine is parked for a template checkpoint (weights released)")
        return {"digest": hashlib.sha256(self.ballast.tobytes()).hexdigest(), "bytes": int(self.ballast.nbytes)}

    # --- two-tier protocol: this worker's arrays (the rest is engines/engine_side.py) ----------------
    def _weights(self) -> dict[str, np.ndarray]:
        m = self.model
        out = {"emb": m.emb, "pos": m.pos, "out": m.out, "ballast": self.ballast}
        for i, L in enumerate(m.layers):
            out.update({f"layers.{i}.{k}": v for k, v in L.items()})
        return out

    def _set_weights(self, ws: dict[str, np.ndarray | None]) -> None:
        m = self.model
        m.emb, m.pos, m.out, self.ballast = ws["emb"], ws["pos"], ws["out"], ws["ballast"]
        for i, L in enumerate(m.layers):
            for k in list(L):
                L[k] = ws[f"layers.{i}.{k}"]

    def template_key(self) -> str:
        cfg = self.model.cfg
        return hashlib.sha256(json.dumps([cfg.__dict__, self.model_name, int(self.ballast_bytes)],
                                         sort_keys=True).encode()).hexdigest()[:16]

    def session_state(self, req: ExportRequest) -> tuple[dict[str, SessionState], None]:
        """Each session's tokens, KV (token-major, so growth changes only the tail) and RNG."""
        out = {}
        for sid, s in self.sessions.items():
            if not req.wants(sid):
                continue
            parts = [("tokens", np.asarray(s.tokens, dtype=np.int64))]
            for i in range(len(s.k)):
                parts += [(f"k{i}", s.k[i].transpose(1, 0, 2)), (f"v{i}", s.v[i].transpose(1, 0, 2))]
            out[sid] = ({"tokens": len(s.tokens), "digest": s.digest(), "rng": s.rng.bit_generator.state}, parts)
        return out, None  # single-threaded: the whole export holds the worker

    def adopt_sessions(self, staged: dict[str, tuple[dict[str, np.ndarray], dict]]) -> dict[str, str]:
        rebuilt = {}
        for sid, (t, rec) in staged.items():
            s = Session(id=sid, tokens=[int(x) for x in t["tokens"]])
            n_layers = sum(1 for k in t if k.startswith("k"))
            s.k = [np.ascontiguousarray(t[f"k{i}"].transpose(1, 0, 2)) for i in range(n_layers)]
            s.v = [np.ascontiguousarray(t[f"v{i}"].transpose(1, 0, 2)) for i in range(n_layers)]
            s.rng = np.random.default_rng()
            s.rng.bit_generator.state = rec["rng"]
            rebuilt[sid] = s
        self.sessions.update(rebuilt)
        return {k: s.digest() for k, s in rebuilt.items()}

    def weight_arrays(self) -> dict[str, np.ndarray]:
        return self._weights()

    def release_weights(self) -> None:
        import gc

        self._set_weights({k: None for k in self._weights()})
        self.sessions.clear()
        self.parked = True
        gc.collect()

    def adopt_weights(self, weights: dict[str, np.ndarray]) -> None:
        self._set_weights(weights)
        self.parked = False


def make_handler(w):
    own_get, own_post = routes(w)  # the worker's declared routes and, if it speaks it, the protocol's
    get = {"/v1/sessions": lambda: {"sessions": w.session_lengths()},
           "/v1/sessions/digests": lambda: {"sessions": w.session_digests()},
           "/v1/ballast/digest": w.ballast_digest, **own_get}
    post = {"/v1/completions": w.complete, **own_post}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # stdio is /dev/null under the runner anyway
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj) -> None:
            self._send(code, json.dumps(obj).encode())

        def do_GET(self):
            path = self.path.split("?")[0]
            if path == "/health":
                return self._json(200, {"status": "ok", "pid": os.getpid()})
            if path == "/metrics":
                return self._send(200, generate_latest(w.metrics.registry), "text/plain; version=0.0.4")
            if path in get:
                return self._json(200, get[path]())
            m = re.fullmatch(r"/v1/sessions/([A-Za-z0-9._-]{1,64})/digest", path)
            if m:
                digests = w.session_digests()
                if m.group(1) not in digests:
                    return self._json(404, {"error": f"no session {m.group(1)}"})
                return self._json(200, {"session_id": m.group(1), "digest": digests[m.group(1)],
                                        "tokens": w.session_lengths()[m.group(1)]})
            return self._json(404, {"error": "not found"})

        def do_POST(self):
            fn = post.get(self.path.split("?")[0])
            if fn is None:
                return self._json(404, {"error": "not found"})
            try:
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"{}")
                return self._json(200, fn(body))
            except SessionLost as e:
                return self._json(410, {"error": str(e)})
            except (ValueError, TypeError, TimeoutError, KeyError, OSError) as e:
                return self._json(400, {"error": str(e)})

    return Handler


def base_args(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18001)
    p.add_argument("--pid-file")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--model-name", default="ckptflow-demo-tiny")
    return p


def serve(w, a: argparse.Namespace, threaded: bool = False) -> None:
    """Bind, write the pid file (atomically, once listening), serve one request at a time
    (``threaded``: a thread per request, for a worker that serialises its own model calls and
    must answer resume while a quiesce holds it)."""
    if threaded:
        from http.server import ThreadingHTTPServer

        server = ThreadingHTTPServer((a.host, a.port), make_handler(w))
        server.daemon_threads = True
    else:
        server = HTTPServer((a.host, a.port), make_handler(w))
    if a.pid_file:
        tmp = a.pid_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, a.pid_file)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


# Dies with its parent (PR_SET_PDEATHSIG), counts in memory while alive.
_HELPER = ("import ctypes, time\nctypes.CDLL('libc.so.6').prctl(1, 9)\nn = 0\n"
           "while True:\n    n += 1\n    time.sleep(0.05)\n")


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--ballast-mib", type=int, default=0)
    p.add_argument("--helper", action="store_true",
                   help="Also run a child process (stands in for a tokenizer or another rank): the "
                        "worker is then a process tree, checkpointed and restored whole.")
    a = p.parse_args(argv)
    if a.helper:
        import subprocess

        subprocess.Popen([sys.executable, "-c", _HELPER], stdin=subprocess.DEVNULL)
    serve(Worker(a.seed, a.ballast_mib, a.model_name), a)


if __name__ == "__main__":
    main()
