"""The engine adapter contract (ckptflow/engines/adapter.py), one suite for every adapter.

The pure parts (registration, metrics mapping read from a recorded /metrics text, health and
golden request shapes, a refusal without the protocol) run for every registered adapter and a
toy one written here. The live parts (health, metrics, golden, sessions out and back, template
park and adopt, all through runners/engine.py) run against engines served in this process: the
numpy demo worker (demo/worker.py, its own handler) and the toy engine below, whose protocol
side is engines/engine_side.py's. llama.cpp and vLLM run live in their own suites (test_llamacpp.py,
test_vllm.py); here only their pure parts. docs/extending/engine-adapter.md walks through the toy.
"""

from __future__ import annotations

import doctest
import hashlib
import importlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import yaml

from ckptflow.engines.engine_side import EngineSide, ExportRequest, routes
from ckptflow.engines.adapter import ADAPTERS, EngineAdapter, get_adapter, known_engines, register
from ckptflow.errors import ConfigError, EngineProtocolError
from ckptflow.fleet import load_fleet
from ckptflow.models import GoldenRequest, ProcessFinder, Workload
from ckptflow.policies.load import Combine, Metric, WorkloadLoad
from ckptflow.runners import engine

DATA = Path(__file__).parent / "data"


# --- the toy engine: an HTTP server in a thread, with its own metric names and health path ------
class ToyEngine(EngineSide):
    """Sessions are token lists; the "weights" one array; the next token a hash of both."""

    ENGINE = "toy"
    SESSION_CHUNK = WEIGHT_CHUNK = 4096
    POST_ROUTES = {"/generate": "generate"}

    def __init__(self) -> None:
        self.model_name = "toy-1"
        self.weights: np.ndarray | None = np.arange(10_000, dtype=np.float32)
        self.sessions: dict[str, np.ndarray] = {}
        self.parked = False
        self.prompt_tokens = self.generated = 0

    def generate(self, body: dict) -> dict:
        if self.parked:
            raise ValueError("parked for a template checkpoint")
        prompt = [ord(c) for c in body["prompt"]]
        sid = body.get("session")
        held = self.sessions.get(sid, np.zeros(0, dtype=np.int64)) if sid else np.zeros(0, dtype=np.int64)
        toks = list(held) + prompt
        out = []
        for _ in range(int(body.get("n", 4))):
            h = hashlib.sha256(self.weights[:64].tobytes() + np.asarray(toks, dtype=np.int64).tobytes()).digest()
            toks.append(h[0])
            out.append(h[0])
        if sid:
            self.sessions[sid] = np.asarray(toks, dtype=np.int64)
        self.prompt_tokens += len(prompt)
        self.generated += len(out)
        return {"tokens": out}

    def metrics_text(self) -> str:
        held = sum(len(t) for t in self.sessions.values())
        return ("# TYPE toy_running gauge\ntoy_running 0\n"
                f"# TYPE toy_tokens_held gauge\ntoy_tokens_held {held}\n"
                f"# TYPE toy_prompt_tokens_total counter\ntoy_prompt_tokens_total {self.prompt_tokens}\n"
                f"# TYPE toy_generated_tokens_total counter\ntoy_generated_tokens_total {self.generated}\n")

    # the protocol: this engine's arrays; chunks, checks and answers are engines/engine_side.py's
    def template_key(self) -> str:
        return "toy-" + str(self.weights.shape if self.weights is not None else "parked")

    def session_lengths(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.sessions.items()}

    def _digest(self, toks: np.ndarray) -> str:
        return hashlib.sha256(toks.tobytes()).hexdigest()

    def session_state(self, req: ExportRequest):
        return {sid: ({"tokens": len(t), "digest": self._digest(t)}, [("tokens", t)])
                for sid, t in self.sessions.items() if req.wants(sid)}, None

    def adopt_sessions(self, staged):
        self.sessions.update({sid: t["tokens"] for sid, (t, _) in staged.items()})
        return {sid: self._digest(t["tokens"]) for sid, (t, _) in staged.items()}

    def weight_arrays(self):
        return {"weights": self.weights}

    def release_weights(self) -> None:
        self.weights, self.parked = None, True
        self.sessions.clear()

    def adopt_weights(self, weights) -> None:
        self.weights, self.parked = weights["weights"], False


def toy_handler(w: ToyEngine):
    get, post = routes(w)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/ready":
                return self._send(200, b"{}")
            if self.path == "/metrics":
                return self._send(200, w.metrics_text().encode())
            fn = get.get(self.path)
            return self._send(200, json.dumps(fn()).encode()) if fn else self._send(404, b'{"error": "not found"}')

        def do_POST(self):
            fn = post.get(self.path)
            if fn is None:
                return self._send(404, b'{"error": "not found"}')
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                return self._send(200, json.dumps(fn(body)).encode())
            except (ValueError, KeyError) as e:
                return self._send(400, json.dumps({"error": str(e)}).encode())

    return Handler


class ToyAdapter(EngineAdapter):
    """What ckptflow needs to know about the toy engine: the whole adapter."""

    name = "toy"
    summary = "the toy engine of tests/test_engine_adapter_contract.py"
    metrics = {"running": Metric(("toy_running",), Combine.sum),
               "used_tokens": Metric(("toy_tokens_held",), Combine.sum),
               "prompt_tokens_total": Metric(("toy_prompt_tokens",), Combine.sum),
               "generation_tokens_total": Metric(("toy_generated_tokens",), Combine.sum)}
    health_path = "/ready"

    def golden_request(self, base: str, **kw) -> GoldenRequest:
        return GoldenRequest(url=base + "/generate", body={"prompt": "golden", "n": 8}, field="tokens")


@pytest.fixture
def toy_registered():
    register(ToyAdapter)
    try:
        yield ADAPTERS["toy"]
    finally:
        del ADAPTERS["toy"]  # other suites see the built-in engines only


# --- what each adapter's pure parts are checked against -------------------------------------------
def _demo_metrics() -> str:
    from prometheus_client import generate_latest

    from ckptflow.demo.worker import Metrics

    m = Metrics("m")  # the exposition the demo workers serve, made by their own code
    m.observe(5, 7, 0.5, 16384, 65536, 1)
    return generate_latest(m.registry).decode()


# engine -> (recorded /metrics text, some fields it must read, a recorded answer to its golden request)
RECORDED = {
    "vllm": (lambda: (DATA / "vllm_metrics.txt").read_text(),
             {"running": 12, "waiting": 3, "kv_cache_usage": 0.4375, "mean_request_s": 90.0},
             {"choices": [{"token_ids": [5, 6, 7]}]}),
    "llamacpp": (lambda: (DATA / "llamacpp_metrics.txt").read_text(),
                 {"running": 1, "waiting": 2, "used_tokens": 409, "prompt_tokens_total": 313},
                 {"content": "x", "tokens": [5, 6, 7]}),
    # Recorded from a live SGLang 0.5.17 on the H200 (bench/sglang_gpu.py).
    "sglang": (lambda: (DATA / "sglang" / "metrics.txt").read_text(),
               {"running": 1, "kv_cache_usage": 0.04, "used_tokens": 4087, "prompt_tokens_total": 12168},
               json.loads((DATA / "sglang" / "generate.json").read_text())["response"]),
    "demo": (_demo_metrics, {"prompt_tokens_total": 5, "generation_tokens_total": 7, "kv_cache_usage": 0.25,
                             "mean_request_s": 0.5},
             {"choices": [{"tokens": [1, 2], "text": "ab"}]}),
    "toy": (lambda: ToyEngine().metrics_text().replace("toy_running 0", "toy_running 3"), {"running": 3},
            {"tokens": [9, 9]}),
    "other": (None, {}, None),
}
ENGINES = sorted(RECORDED)
LOAD_FIELDS = set(WorkloadLoad.model_fields) | {"request_duration"}


def test_every_registered_engine_is_under_contract():
    assert set(known_engines()) | {"toy"} == set(ENGINES)


@pytest.mark.parametrize("name", ENGINES)
def test_pure_parts(name, toy_registered):
    a = get_adapter(name)
    assert a.name == name and name in known_engines() and a.summary
    text, expected, answer = RECORDED[name]
    assert set(a.metrics) <= LOAD_FIELDS, f"{name}: mapping names a field WorkloadLoad does not have"
    if a.metrics:
        load = a.parse_metrics(text())
        assert {k: getattr(load, k) for k in expected} == pytest.approx(expected)
        with pytest.raises(ValueError):
            a.parse_metrics("this is { not prometheus")
    else:
        with pytest.raises(ValueError, match=f"engine '{name}' has no metrics mapping"):
            a.parse_metrics("x 1\n")
    base = "http://127.0.0.1:8123"
    assert a.health_url(base).startswith(base + "/")
    g = a.golden_request(base)
    if answer is None:
        assert g is None
    else:  # a request ckptflow can send and an answer whose field it can digest
        assert g.url.startswith(base + "/") and json.loads(json.dumps(g.body)) == g.body
        assert len(engine.golden_digest(answer, g.field)) == 64


@pytest.mark.parametrize("name", [n for n in ENGINES if n != "toy"])
def test_an_engine_without_the_protocol_refuses_without_calling_it(name):
    a = get_adapter(name)
    w = Workload(name="w", node="n", engine=name, find=ProcessFinder(pid_file="/nonexistent.pid"),
                 health_url="http://127.0.0.1:9/health")  # nothing listens: a call would be "unreachable"
    if a.protocol is not None:
        with pytest.raises(EngineProtocolError) as e:
            engine.export_sessions(w, "/tmp/x", {})
        assert e.value.retryable  # it did try: the protocol is this adapter's
        return
    for call in (lambda: engine.export_sessions(w, "/tmp/x", {}), lambda: engine.import_sessions(w, "/tmp/x", {}),
                 lambda: engine.template_prepare(w, "/tmp/x", []), lambda: engine.template_adopt(w, "/tmp/x", []),
                 lambda: engine.engine_info(w)):
        with pytest.raises(EngineProtocolError, match=f"engine {name} does not speak ckptflow's two-tier") as e:
            call()
        assert not e.value.retryable and e.value.fix


# --- live: the engine served in this process, ckptflow's side through runners/engine.py ---------
def _serve(handler):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture(params=["demo", "toy"])
def live(request, toy_registered):
    """(workload, a completion in a session) for an engine serving on a free port."""
    if request.param == "demo":
        from ckptflow.demo.worker import Worker, make_handler

        srv, base = _serve(make_handler(Worker(seed=7, ballast_mib=1, model_name="m")))

        def turn(sid: str, text: str) -> None:
            engine.http().post(base + "/v1/completions", json={"prompt": text, "max_tokens": 4, "session_id": sid},
                               timeout=30).raise_for_status()
    else:
        srv, base = _serve(toy_handler(ToyEngine()))

        def turn(sid: str, text: str) -> None:
            engine.http().post(base + "/generate", json={"prompt": text, "session": sid}, timeout=30).raise_for_status()
    a = get_adapter(request.param)
    w = Workload(name=f"live-{request.param}", node="n", engine=request.param, find=ProcessFinder(pid_file="/x.pid"),
                 health_url=a.health_url(base), metrics_url=base + "/metrics", golden=a.golden_request(base))
    try:
        yield w, turn
    finally:
        srv.shutdown()
        srv.server_close()


def test_live_contract(live, tmp_path):
    w, turn = live
    engine.wait_healthy(w, timeout_s=10)
    turn("a", "hello there")
    turn("b", "another session")
    load = engine.read_load(w)
    assert load is not None and load.tokens_total > 0 and load.running == 0
    first, again = engine.probe(w), engine.probe(w)
    assert first.golden == again.golden and first.golden_error is None               # deterministic

    info = engine.engine_info(w)
    assert info["sessions"].keys() == {"a", "b"} and info["parked"] is False and info["template_key"]
    stage = tmp_path / "s1"
    stage.mkdir()
    out = engine.export_sessions(w, str(stage), {})["sessions"]
    assert out.keys() == {"a", "b"} and all(r["written_bytes"] == r["total_bytes"] > 0 for r in out.values())
    known = {sid: [c for t in r["tensors"] for c in t["chunks"]] for sid, r in out.items()}
    again = engine.export_sessions(w, str(stage), known, sessions=["a"])["sessions"]
    assert again.keys() == {"a"} and again["a"]["written_bytes"] == 0                  # nothing changed, nothing written

    wdir = tmp_path / "w"
    wdir.mkdir()
    weights = engine.template_prepare(w, str(wdir), [])
    parked = engine.engine_info(w)
    assert parked["parked"] is True and parked["sessions"] == {}
    assert parked["parked_with"] == {"dir": str(wdir), "tensors": weights["tensors"]}
    assert engine.probe(w).golden_error                                           # no answers while parked
    assert engine.template_adopt(w, str(wdir), weights["tensors"])["loaded_bytes"] == weights["total_bytes"]
    got = engine.import_sessions(w, str(stage), out)
    assert got["imported"] == ["a", "b"] and got["digests"] == {sid: r["digest"] for sid, r in out.items()}
    assert engine.probe(w).golden == first.golden                                # the same engine again
    with pytest.raises(EngineProtocolError, match="refused: HTTP 400"):
        engine.import_sessions(w, str(tmp_path / "empty"), out)                         # chunks missing: refused


# --- registration: the fleet file picks the adapter ----------------------------------------------
FLEET = {"fleet": "t", "nodes": [{"name": "n1", "work_pool": "n1"}],
         "workloads": [{"name": "w1", "node": "n1", "find": {"pid_file": "/run/w1.pid"}, "engine": "toy",
                        "metrics_url": "http://127.0.0.1:8000/metrics"}],
         "policies": [{"match": {"engine": "toy"}, "policy": "never"}]}


def test_a_registered_engine_is_declared_by_name_and_an_unknown_one_refused(tmp_path, toy_registered):
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(FLEET, sort_keys=False))
    w = load_fleet(f).workload("w1")
    assert w.engine == "toy" and get_adapter(w.engine) is toy_registered
    del ADAPTERS["toy"]
    unknown = tmp_path / "unknown.yaml"  # another file: loads are cached per file version
    unknown.write_text(f.read_text())
    try:
        with pytest.raises(ConfigError) as e:
            load_fleet(unknown)
    finally:
        register(ToyAdapter)
    lines = [line for line in str(e.value).splitlines() if "unknown engine 'toy'" in line]
    assert lines and all("(known: demo, llamacpp, other, sglang, vllm)" in line for line in lines), str(e.value)


def test_routes_are_declared_not_guessed():
    class NoProtocol(ToyEngine):
        SPEAKS_PROTOCOL = False

    get, post = routes(ToyEngine())
    assert "/v1/ckptflow/engine" in get and "/v1/ckptflow/sessions/export" in post and "/generate" in post
    get, post = routes(NoProtocol())
    assert "/v1/ckptflow/engine" not in get and set(post) == {"/generate"}

    class Misdeclared(ToyEngine):
        POST_ROUTES = {"/v1/peek": "peek"}

    with pytest.raises(AttributeError, match="peek"):
        routes(Misdeclared())                                     # at start, not at the first call


@pytest.mark.parametrize("module", ["ckptflow.engines.adapter", "ckptflow.engines.engine_side"])
def test_docstring_examples_run(module):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for t in doctest.DocTestFinder().find(importlib.import_module(module)):
        runner.run(t, out=report.append)
    res = runner.summarize(verbose=False)
    assert res.failed == 0 and res.attempted > 0, "".join(report)


def test_a_turn_export_waits_for_a_turn_that_ends_and_names_one_that_does_not():
    """engines/engine_side.py sessions_between_turns, what llm_worker's turn export holds."""
    import threading
    import time

    from ckptflow.engines.engine_side import sessions_between_turns

    a, b = threading.Lock(), threading.Lock()
    b.acquire()
    threading.Timer(0.1, b.release).start()          # b's turn ends while the export waits
    t0 = time.monotonic()
    with sessions_between_turns({"a": a, "b": b}, 2.0):
        assert a.locked() and b.locked() and time.monotonic() - t0 < 1.5
    assert not a.locked() and not b.locked()
    b.acquire()                                      # a turn that outlasts the wait
    with pytest.raises(TimeoutError, match="session b is in a turn"):
        with sessions_between_turns({"a": a, "b": b}, 0.1):
            pass
    assert not a.locked()                            # nothing kept: the next look tries again
