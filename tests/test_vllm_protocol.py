"""ckptflow's protocol middleware for vLLM (engines/vllm_protocol.py) without a vLLM: installed
in an ASGI app the way vLLM's ``--middleware`` installs a function (``app.middleware("http")``),
driven over real HTTP requests by starlette's client, with a client address chosen per test.
The whole path through a real vLLM is in tests/test_vllm.py."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from ckptflow.engines import vllm_protocol
from ckptflow.engines.vllm_layout import BLOCKS, SESSIONS

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


class _Engine:
    """What the middleware calls on vLLM's engine client, recorded."""

    def __init__(self):
        self.calls = []

    async def pause_generation(self, mode, clear_cache):
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self):
        self.calls.append(("resume",))


def _app(chunk_dir: Path) -> tuple[FastAPI, _Engine]:
    app = FastAPI()   # vLLM's OpenAI server is a FastAPI app

    async def ok(request: Request):
        return JSONResponse({"served": request.url.path})

    for path, method in (("/v1/completions", "POST"), ("/sleep", "POST"), ("/health", "GET")):
        app.add_api_route(path, ok, methods=[method])
    app.middleware("http")(vllm_protocol.ckptflow_protocol)   # what vLLM does with --middleware
    kv = SimpleNamespace(kv_connector="CkptflowConnector", get_from_extra_config=lambda k, d: str(chunk_dir))
    app.state.vllm_config = SimpleNamespace(
        kv_transfer_config=kv, cache_config=SimpleNamespace(block_size=2),
        model_config=SimpleNamespace(model="/m", dtype="float32", max_model_len=64, served_model_name="m",
                                     enable_sleep_mode=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))
    app.state.engine_client = eng = _Engine()
    return app, eng


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    monkeypatch.setattr(vllm_protocol, "STATE", vllm_protocol._State())


def _session(chunk_dir: Path, sid: str, blocks: dict[str, bytes]) -> None:
    (chunk_dir / BLOCKS).mkdir(parents=True, exist_ok=True)
    (chunk_dir / SESSIONS).mkdir(parents=True, exist_ok=True)
    for key, data in blocks.items():
        (chunk_dir / BLOCKS / f"{key}.safetensors").write_bytes(data)
    (chunk_dir / SESSIONS / f"{sid}.json").write_text(json.dumps(
        {"session": sid, "block_size": 2, "tokens": 2 * len(blocks), "blocks": list(blocks)}))


def _key(i: int) -> str:
    return hashlib.sha256(bytes([i])).hexdigest()


def test_control_calls_answer_only_on_loopback_inference_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_protocol, "_template_key", lambda app: "k")
    app, _ = _app(tmp_path / "kv")
    remote = TestClient(app, client=("10.1.2.3", 40000))
    for method, path in (("GET", "/v1/ckptflow/engine"), ("POST", "/v1/ckptflow/sessions/export"),
                         ("POST", "/v1/ckptflow/template/prepare"), ("POST", "/sleep")):
        r = remote.request(method, path, json={})
        assert r.status_code == 403 and "answers only on loopback" in r.json()["error"], (path, r.text)
    assert remote.post("/v1/completions", json={}).json() == {"served": "/v1/completions"}
    local = TestClient(app, client=("127.0.0.1", 40000))
    assert local.get("/v1/ckptflow/engine").json()["protocol"] == 1
    assert local.post("/sleep").json() == {"served": "/sleep"}


def test_export_writes_only_unknown_chunks_and_import_refuses_a_torn_one_before_writing(tmp_path, monkeypatch):
    src, dst = tmp_path / "a", tmp_path / "b"
    _session(src, "s", {_key(1): b"one", _key(2): b"two"})
    app, _ = _app(src)
    c = TestClient(app, client=("127.0.0.1", 1))
    out = tmp_path / "out"
    out.mkdir()
    known = {"s": [hashlib.sha256(b"one").hexdigest()]}
    rec = c.post("/v1/ckptflow/sessions/export", json={"dir": str(out), "known": known}).json()["sessions"]["s"]
    assert rec["tensors"][0]["chunks"] == [hashlib.sha256(b).hexdigest() for b in (b"one", b"two")]
    assert sorted(p.name for p in out.iterdir()) == [hashlib.sha256(b"two").hexdigest()]
    assert rec["written_bytes"] == 3 and rec["total_bytes"] == 6 and rec["tokens"] == 4
    (out / known["s"][0]).write_bytes(b"one")                 # what the runner's store holds

    app2, _ = _app(dst)
    c2 = TestClient(app2, client=("127.0.0.1", 1))
    torn = out / hashlib.sha256(b"two").hexdigest()
    torn.write_bytes(b"twx")
    r = c2.post("/v1/ckptflow/sessions/import", json={"dir": str(out), "sessions": {"s": rec}})
    assert r.status_code == 400 and r.json()["error"] == f"session s: chunk {torn.name[:12]}… is torn"
    assert not (dst / BLOCKS).exists() or list((dst / BLOCKS).iterdir()) == []   # all or nothing
    torn.write_bytes(b"two")
    got = c2.post("/v1/ckptflow/sessions/import", json={"dir": str(out), "sessions": {"s": rec}}).json()
    assert got == {"imported": ["s"], "digests": {"s": rec["digest"]}}
    assert (dst / BLOCKS / f"{_key(2)}.safetensors").read_bytes() == b"two"
    monkeypatch.setattr(vllm_protocol, "_template_key", lambda app: "k")
    assert c2.get("/v1/ckptflow/engine").json()["sessions"] == {"s": 4}


def test_parked_engine_answers_generation_503_until_resume_and_lost_sessions_410_once(tmp_path):
    app, eng = _app(tmp_path / "kv")
    c = TestClient(app, client=("127.0.0.1", 1))
    assert c.post("/v1/ckptflow/template/prepare", json={"dir": str(tmp_path), "known": []}).json()["tensors"] == []
    assert eng.calls == [("pause", "wait", True)]
    r = c.post("/v1/completions", json={})
    assert r.status_code == 503 and "parked" in r.json()["error"]
    assert c.get("/health").status_code == 200
    c.post("/v1/ckptflow/template/resume", json={"dir": str(tmp_path), "tensors": [], "sessions": {},
                                                 "lost": ["gone"]})
    assert eng.calls[-1] == ("resume",)
    body = {"prompt": [1], "kv_transfer_params": {"ckptflow_session": "gone"}}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 410 and "session gone was lost in a restore" in r.json()["error"]
    assert c.post("/v1/completions", json=body).json() == {"served": "/v1/completions"}   # then afresh
