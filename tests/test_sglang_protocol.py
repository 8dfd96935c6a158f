"""ckptflow's protocol plugin for SGLang (engines/sglang_protocol.py) without an SGLang (it does
not serve on CPU: docs/engines/sglang.md): the middleware installed on a FastAPI app the way the
plugin installs it on SGLang's (``add_middleware(BaseHTTPMiddleware, ...)``), a ``/generate``
that answers like SGLang's, and page files written where HiCache's file storage writes them."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse

from ckptflow.engines import sglang_protocol as P

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

PAGE = 4
OUT = [7, 8, 9]


@pytest.fixture()
def kv(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "hicache"
    d.mkdir()
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(d))
    monkeypatch.setattr(P, "STATE", P._State())
    monkeypatch.setattr(P, "PAGE_WAIT_S", 0.2)
    P.STATE.args = SimpleNamespace(served_model_name="m", tp_size=1, page_size=PAGE, enable_hierarchical_cache=True,
                                   hicache_storage_backend="file", model_path="/m", dtype="bfloat16",
                                   context_length=64, enable_memory_saver=False)
    return d


def _client(host: str = "127.0.0.1") -> TestClient:
    app = FastAPI()

    async def generate(request: Request):
        return JSONResponse({"output_ids": OUT, "meta_info": {"cached_tokens": 0}})

    app.add_api_route("/generate", generate, methods=["POST"])
    app.add_api_route("/flush_cache", generate, methods=["POST"])
    app.add_middleware(BaseHTTPMiddleware, dispatch=P.ckptflow_protocol)
    return TestClient(app, client=(host, 5000))


def _write_pages(kv: Path, names: list[str]) -> dict[str, bytes]:
    """What HiCache's file storage leaves behind: one file of raw KV bytes per page."""
    out = {}
    for i, n in enumerate(names):
        data = f"kv page {i} {n}".encode() * 8
        (kv / f"{n}.bin").write_bytes(data)
        out[n] = data
    return out


def test_a_turn_lists_its_session_with_sglangs_page_names_and_exports_only_new_pages(kv, tmp_path):
    c = _client()
    prompt = list(range(1, 11))                          # 10 tokens + 3 out: 12 with KV -> 3 full pages
    r = c.post("/generate", json={"input_ids": prompt, "sampling_params": {}}, headers={P.SESSION_HEADER: "s1"})
    assert r.status_code == 200 and r.json()["output_ids"] == OUT
    doc = json.loads((kv / P.SESSIONS_DIR / "s1.json").read_text())
    keys = P.page_keys(prompt + OUT[:-1], PAGE)
    assert doc["tokens"] == 12 and doc["blocks"] == [k + "_m_0_1" for k in keys] and len(keys) == 3
    assert c.get("/v1/ckptflow/engine").json()["sessions"] == {"s1": 12}
    pages = _write_pages(kv, doc["blocks"])
    out = tmp_path / "out"
    out.mkdir()
    rec = c.post("/v1/ckptflow/sessions/export", json={"dir": str(out), "known": {}}).json()["sessions"]["s1"]
    digests = [hashlib.sha256(pages[n]).hexdigest() for n in doc["blocks"]]
    assert rec["tensors"][0]["chunks"] == digests and rec["written_bytes"] == sum(map(len, pages.values()))
    assert all((out / d).read_bytes() == pages[n] for d, n in zip(digests, doc["blocks"]))
    again = c.post("/v1/ckptflow/sessions/export", json={"dir": str(tmp_path), "known": {"s1": digests}}).json()
    assert again["sessions"]["s1"]["written_bytes"] == 0 and again["held_s"] == 0.0


def test_an_export_ends_a_session_at_its_first_page_not_on_file(kv, tmp_path):
    c = _client()
    c.post("/generate", json={"input_ids": list(range(1, 11))}, headers={P.SESSION_HEADER: "s1"})
    names = json.loads((kv / P.SESSIONS_DIR / "s1.json").read_text())["blocks"]
    _write_pages(kv, [names[0], names[2]])               # page 1 not written (yet)
    rec = c.post("/v1/ckptflow/sessions/export", json={"dir": str(tmp_path), "known": {}}).json()["sessions"]["s1"]
    assert rec["blocks"] == names[:1] and rec["tokens"] == PAGE


def test_import_checks_every_chunk_then_writes_the_pages_under_sglangs_names(kv, tmp_path):
    c = _client()
    c.post("/generate", json={"input_ids": list(range(1, 11))}, headers={P.SESSION_HEADER: "s1"})
    names = json.loads((kv / P.SESSIONS_DIR / "s1.json").read_text())["blocks"]
    pages = _write_pages(kv, names)
    store = tmp_path / "store"
    store.mkdir()
    rec = c.post("/v1/ckptflow/sessions/export", json={"dir": str(store), "known": {}}).json()["sessions"]["s1"]
    for f in list(kv.glob("*.bin")) + list((kv / P.SESSIONS_DIR).glob("*")):
        f.unlink()                                       # a new node: nothing of the session on file
    torn = store / rec["tensors"][0]["chunks"][1]
    good = torn.read_bytes()
    torn.write_bytes(good[:-1] + b"x")
    r = c.post("/v1/ckptflow/sessions/import", json={"dir": str(store), "sessions": {"s1": rec}})
    assert r.status_code == 400 and r.json()["error"] == f"session s1: chunk {torn.name[:12]}… is torn"
    assert not list(kv.glob("*.bin"))                    # all or nothing
    torn.write_bytes(good)
    r = c.post("/v1/ckptflow/sessions/import", json={"dir": str(store), "sessions": {"s1": rec}})
    assert r.status_code == 200 and r.json()["imported"] == ["s1"]
    assert {n: (kv / f"{n}.bin").read_bytes() for n in names} == pages
    assert c.get("/v1/ckptflow/engine").json()["sessions"] == {"s1": 12}


def test_a_malformed_page_name_is_refused_before_anything_is_written(kv, tmp_path):
    c = _client()
    (tmp_path / ("ab" * 32)).write_bytes(b"x")
    rec = {"tokens": 4, "block_size": PAGE, "blocks": ["../../etc/passwd"],
           "tensors": [{"chunks": [hashlib.sha256(b"x").hexdigest()]}]}
    (tmp_path / hashlib.sha256(b"x").hexdigest()).write_bytes(b"x")
    r = c.post("/v1/ckptflow/sessions/import", json={"dir": str(tmp_path), "sessions": {"s": rec}})
    assert r.status_code == 400 and "not a HiCache page name" in r.json()["error"]


def test_control_calls_answer_only_loopback_and_generation_waits_out_a_parked_engine(kv):
    remote = _client("10.1.2.3")
    for path in ("/v1/ckptflow/engine", "/flush_cache"):
        r = remote.request("GET" if "engine" in path else "POST", path)
        assert r.status_code == 403 and "answers only on loopback" in r.json()["error"]
    assert remote.post("/generate", json={"input_ids": [1]}).status_code == 200
    P.STATE.parked = True
    r = _client().post("/generate", json={"input_ids": [1]})
    assert r.status_code == 503 and "parked" in r.json()["error"]


def test_a_parked_engine_answers_health_itself_and_hicache_control_is_loopback_only(kv):
    app_health = _client()
    app_health.app.add_api_route("/health", lambda: (_ for _ in ()).throw(AssertionError("generated while parked")))
    P.STATE.parked = True  # SGLang's /health generates a token, on released weights
    r = app_health.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "parked"
    r = _client("10.1.2.3").post("/hicache/storage-backend/clear")
    assert r.status_code == 403 and "answers only on loopback" in r.json()["error"]


class _Tm:
    """SGLang's TokenizerManager, as far as the template calls go: each call noted in order."""

    def __init__(self, idle: bool = True):
        self.calls: list[str] = []
        self.idle = idle
        self.rid_to_state: dict = {}
        self.served_model_name = "m"

    async def flush_cache(self, timeout_s: float = 0):
        self.calls.append("flush_cache")
        return SimpleNamespace(success=self.idle, message="" if self.idle else "scheduler busy: 1 running")

    async def release_memory_occupation(self, obj, request):
        self.calls.append("release")

    async def resume_memory_occupation(self, obj, request):
        self.calls.append("resume")

    async def update_weights_from_disk(self, obj, request):
        self.calls.append(f"update_weights_from_disk {obj.model_path}")
        self.served_model_name = obj.model_path   # what SGLang's update does to the name
        return True, "ok", 0


@pytest.fixture()
def io_struct(monkeypatch):
    import sys
    from types import ModuleType

    mod = ModuleType("sglang.srt.managers.io_struct")
    for name in ("ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput"):
        setattr(mod, name, lambda tags=None: SimpleNamespace(tags=tags))
    mod.UpdateWeightFromDiskReqInput = lambda model_path: SimpleNamespace(model_path=model_path)
    for parent in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, parent, ModuleType(parent))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", mod)


def test_the_template_is_released_only_once_sglang_says_it_is_idle_and_comes_back_under_its_name(kv, io_struct):
    P.STATE.args.enable_memory_saver = True
    P.STATE.tm = busy = _Tm(idle=False)
    r = _client().post("/v1/ckptflow/template/prepare", json={"dir": "/tmp", "known": []})
    assert r.status_code == 400 and "did not come idle to park: scheduler busy" in r.json()["error"]
    assert busy.calls == ["flush_cache"] and not P.STATE.parked and not P.STATE.released   # never released
    P.STATE.tm = tm = _Tm()
    r = _client().post("/v1/ckptflow/template/prepare", json={"dir": "/tmp", "known": []})
    assert r.status_code == 200 and tm.calls == ["flush_cache", "release"] and P.STATE.parked
    r = _client().post("/v1/ckptflow/template/resume", json={"dir": "/tmp", "tensors": []})
    assert r.status_code == 200 and tm.calls[2:] == ["resume", "update_weights_from_disk /m"]
    assert not P.STATE.parked and tm.served_model_name == "m"


def test_without_hicache_file_storage_the_engine_says_which_flags_to_add(kv):
    P.STATE.args.hicache_storage_backend = None
    r = _client().post("/v1/ckptflow/sessions/export", json={"dir": "/tmp", "known": {}})
    assert r.status_code == 400 and "--hicache-storage-backend file" in r.json()["error"]


def test_the_entry_point_sglang_discovers(tmp_path):
    from importlib.metadata import distributions

    P.write_entry_point(tmp_path)
    eps = [ep for d in distributions(path=[str(tmp_path)]) for ep in d.entry_points
           if ep.group == P.ENTRY_POINT_GROUP]
    assert [(ep.name, ep.value) for ep in eps] == [("ckptflow", "ckptflow.engines.sglang_protocol:plugin")]
    assert eps[0].load() is P.plugin
