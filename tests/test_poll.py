"""The one bounded wait (ckptflow.poll), and the engine HTTP built on it (runners/engine.py over
httpx): what each call raises upward, against a scripted local HTTP server."""

import doctest
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import ckptflow.poll
from ckptflow.errors import EngineProtocolError, RestoreFailed, WorkloadBusy
from ckptflow.models import GoldenRequest, ProcessFinder, Workload
from ckptflow.poll import NotYet, PollTimeout, poll
from ckptflow.runners import engine


# --- poll ----------------------------------------------------------------------------------------
def test_returns_the_first_answer_and_counts_none_and_false_as_not_yet():
    answers = iter([None, False, 0.0, "late"])
    calls = []

    def check():
        calls.append(1)
        return next(answers)

    assert poll(check, timeout_s=5, interval_s=0, what="x") == 0.0   # 0.0 is an answer (an elapsed time)
    assert len(calls) == 3


def test_timeout_names_what_and_the_last_reason():
    reasons = iter(["connection refused", "HTTP 503"])

    def check():
        raise NotYet(next(reasons, "HTTP 503"))

    t0 = time.monotonic()
    with pytest.raises(PollTimeout) as e:
        poll(check, timeout_s=0.2, interval_s=0.02, what="/health to answer 200")
    took = time.monotonic() - t0
    assert isinstance(e.value, TimeoutError) and e.value.last == "HTTP 503" and e.value.timeout_s == 0.2
    assert str(e.value) == "timed out after 0.2 s waiting for /health to answer 200 (last: HTTP 503)"
    assert 0.2 <= took < 1.0   # gives up at the deadline, not an interval (or more) after it


def test_other_exceptions_end_the_wait_at_once_unless_listed():
    calls = []

    def exited():
        calls.append(1)
        raise RuntimeError("worker exited with 1")

    with pytest.raises(RuntimeError, match="worker exited"):
        poll(exited, timeout_s=5, interval_s=0, what="x")
    assert len(calls) == 1

    side_effect = iter([OSError("refused"), OSError("reset"), "up"])

    def flaky():
        v = next(side_effect)
        if isinstance(v, Exception):
            raise v
        return v

    assert poll(flaky, timeout_s=5, interval_s=0, what="x", retry_on=(OSError,)) == "up"
    with pytest.raises(PollTimeout, match=r"\(last: refused\)"):
        poll(lambda: (_ for _ in ()).throw(OSError("refused")), timeout_s=0.05, interval_s=0.01, what="x",
             retry_on=(OSError,))


def test_a_zero_timeout_still_asks_once():
    assert poll(lambda: True, timeout_s=0, what="x") is True
    with pytest.raises(PollTimeout, match="timed out after 0 s waiting for y$"):
        poll(lambda: None, timeout_s=0, what="y")


def test_module_examples_run():
    res = doctest.testmod(ckptflow.poll, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted >= 3


# --- the engine's HTTP, on httpx ---------------------------------------------------------------
class Scripted:
    """A local HTTP/1.1 server (keep-alive capable) answering from a script: {path: [(status,
    body), ...]}, the last answer of a path repeating. Records each request."""

    def __init__(self, script: dict[str, list[tuple[int, object]]]):
        self.script, self.requests = script, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                outer.requests.append((self.command, self.path, body))
                answers = outer.script.get(self.path, [(404, {"error": "no such path"})])
                status, payload = answers.pop(0) if len(answers) > 1 else answers[0]
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.srv.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def established(self) -> str:
        return subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{self.port} )"],
                              capture_output=True, text=True).stdout.strip()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def scripted():
    made = []

    def make(script):
        s = Scripted(script)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _workload(url: str, **kw) -> Workload:
    return Workload(name="w", node="n", find=ProcessFinder(pid_file="/nonexistent.pid"), health_url=f"{url}/health",
                    **kw)


def test_wait_url_waits_through_503_and_names_the_last_answer_when_it_gives_up(scripted):
    srv = scripted({"/health": [(503, {}), (503, {}), (200, {"ok": True})]})
    assert 0 < engine.wait_url(f"{srv.url}/health", timeout_s=10) < 5
    assert [r[1] for r in srv.requests] == ["/health"] * 3
    down = scripted({"/health": [(503, {})]})
    with pytest.raises(TimeoutError, match=r"waiting for .*/health to answer 200 \(last: HTTP 503\)"):
        engine.wait_url(f"{down.url}/health", timeout_s=0.3)
    with pytest.raises(RestoreFailed, match="workload w: not healthy after restore: .*HTTP 503"):
        engine.wait_healthy(_workload(down.url), timeout_s=0.3)


def test_wait_url_stops_as_soon_as_the_worker_exits(scripted):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="worker exited with 3 before"):
        engine.wait_url("http://127.0.0.1:9/health", timeout_s=30, proc=proc)   # port 9: nothing listens
    assert time.monotonic() - t0 < 5


def test_protocol_calls_keep_their_error_types_and_reasons(scripted):
    srv = scripted({"/v1/ckptflow/engine": [(200, {"protocol": engine.PROTOCOL, "engine": "demo"})],
                    "/v1/ckptflow/sessions/export": [(409, {"error": "a request is in flight"})],
                    "/v1/ckptflow/sessions/import": [(500, b"not json at all")]})
    w = _workload(srv.url)
    assert engine.engine_info(w)["engine"] == "demo"
    with pytest.raises(EngineProtocolError, match=r"/v1/ckptflow/sessions/export refused: HTTP 409: a request is "
                                                  r"in flight") as e:
        engine.call(w, "/v1/ckptflow/sessions/export", {"dir": "/x"})
    assert e.value.retryable is False                               # a refusal is final
    assert srv.requests[-1] == ("POST", "/v1/ckptflow/sessions/export", b'{"dir": "/x"}')
    with pytest.raises(EngineProtocolError, match="refused: HTTP 500: not json at all"):
        engine.call(w, "/v1/ckptflow/sessions/import", {})
    with pytest.raises(EngineProtocolError, match="does not serve /v1/ckptflow/template/prepare"):
        engine.call(w, "/v1/ckptflow/template/prepare", {})
    gone = _workload("http://127.0.0.1:9")
    with pytest.raises(EngineProtocolError, match="/v1/ckptflow/engine failed: ") as e:
        engine.engine_info(gone)
    assert e.value.retryable is True                                # not answering may pass


def test_quiesce_probe_resume_and_metrics(scripted, caplog):
    srv = scripted({"/prepare": [(409, {"error": "rank 1 is in an all-reduce"})],
                    "/digests": [(200, {"sessions": {"s": "abc"}})],
                    "/golden": [(200, {"choices": [{"tokens": [1, 2]}]})],
                    "/resume": [(500, {"error": "boom"})],
                    "/metrics": [(200, b"vllm:num_requests_running 2\n")]})
    w = _workload(srv.url, engine="vllm", prepare_url=f"{srv.url}/prepare", resume_url=f"{srv.url}/resume",
                  probe_url=f"{srv.url}/digests", metrics_url=f"{srv.url}/metrics",
                  golden=GoldenRequest(url=f"{srv.url}/golden", body={"prompt": "p"}, field="choices.0.tokens"))
    with pytest.raises(WorkloadBusy, match="could not be quiesced before the CUDA lock: HTTP 409: rank 1 is in"):
        engine.quiesce(w, tp=True)
    assert engine.quiesce(w, tp=False)[0] == {}                     # one GPU process: an optimisation only
    got = engine.probe(w)
    assert got.model_dump(exclude_none=True) == {
        "sessions": {"s": "abc"}, "golden": engine.golden_digest({"choices": [{"tokens": [1, 2]}]}, "choices.0.tokens")}
    assert ("POST", "/golden", b'{"prompt": "p"}') in srv.requests
    with caplog.at_level("WARNING", logger="ckptflow"):
        engine.resume(w)                                            # best effort: logged, not raised
    assert "resume failed (HTTP 500: boom)" in caplog.text
    assert engine.read_load(w).running == 2
    assert engine.read_load(w.model_copy(update={"engine": "other"})) is None   # not parsed as vLLM's
    down = _workload("http://127.0.0.1:9", probe_url="http://127.0.0.1:9/digests", metrics_url="http://127.0.0.1:9/m")
    assert engine.probe(down).error.startswith("probe failed: ") and engine.read_load(down) is None


def test_no_connection_to_the_worker_stays_open_after_a_call(scripted):
    """An idle keep-alive connection would be one more established socket in the worker's dump."""
    srv = scripted({"/health": [(200, {})], "/v1/ckptflow/engine": [(200, {"protocol": engine.PROTOCOL})]})
    engine.wait_url(f"{srv.url}/health", timeout_s=5)
    engine.engine_info(_workload(srv.url))
    time.sleep(0.2)
    assert srv.established() == ""
