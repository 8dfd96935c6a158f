"""ckptflow's engine protocol (docs/engines/protocol.md) served by SGLang itself, as a general
plugin of its server (SGLang's entry-point group ``sglang.srt.plugins``), over the KV pages its
hierarchical cache writes to file storage.

How SGLang loads it: ckptflow's package declares the entry point
``ckptflow = ckptflow.engines.sglang_protocol:plugin``; SGLang calls every general plugin early in
each of its processes. Run from a checkout instead of an installed package, ``python -m
ckptflow.engines.sglang_protocol --entry-point DIR`` writes the entry point's metadata into DIR
(then put DIR on SGLang's PYTHONPATH). Start SGLang with::

    SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=/var/lib/ckptflow/kv/chat-s \\
    python -m sglang.launch_server ... --enable-memory-saver --page-size 64 \\
      --enable-hierarchical-cache --hicache-storage-backend file --hicache-size 2 \\
      --hicache-write-policy write_through --hicache-storage-prefetch-policy wait_complete

(``engines/sglang.protocol_args`` returns these.) Why these parts:
- **Sessions are HiCache's pages.** With write-through and file storage, SGLang writes every page
  of KV a request leaves in its radix cache to ``<dir>/<key>_<model>_<rank>_<ranks>.bin``, the key
  a sha256 chained over the page's token ids; a request whose prefix is on file loads it from
  there (its ``cached_tokens`` count it) instead of prefilling. A session's export is then naming
  those files by the sha256 of their bytes and copying the new ones: the engine is not held. A
  session is listed when a ``/generate`` request carrying the header ``X-Ckptflow-Session: NAME``
  finishes (a turn end): its pages are computed from the request's tokens and its answer's.
- **The template is the engine with its memory released.** ``template/prepare`` answers new
  generation requests 503, waits for the ones in flight, and calls SGLang's own
  ``release_memory_occupation`` (weights, KV pool and CUDA graph memory unmapped by
  torch_memory_saver: the virtual addresses stay, the GPU memory goes, the radix cache is
  flushed). ``template/resume`` maps it back (``resume_memory_occupation``) and reads the weights
  from the model directory (``update_weights_from_disk``). Without ``--enable-memory-saver`` the
  template keeps its weights in its image.

The native page hash: SGLang computes its page keys with a C++ extension it builds on first use
(torch's cpp_extension: a compiler and OpenSSL's headers); where that build fails, the plugin
hashes in Python, the same sha256 chain (``page_keys``), through SGLang's hook registry.

Control calls answer only clients on loopback (the runner's): an inference client that reaches
the serving port from another host gets 403, for ckptflow's calls and SGLang's control endpoints
alike. Runs inside SGLang's processes: standard library, starlette and SGLang only.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import multiprocessing
import os
import re
import sys
import time
from array import array
from pathlib import Path
from typing import Any

from ckptflow.engines.kv_files import BlockFiles
from ckptflow.engines.control import error_response as _error
from ckptflow.engines.control import answer_first

log = logging.getLogger(__name__)

PROTOCOL = 1
PREFIX = "/v1/ckptflow/"
SESSION_HEADER = "x-ckptflow-session"
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT = "ckptflow = ckptflow.engines.sglang_protocol:plugin"
# SGLang's control endpoints (memory, weights, cache, pause, profiling): never for inference clients.
SGLANG_CONTROL = ("/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk",
                  "/update_weights_from_tensor", "/update_weights_from_distributed", "/update_weights_from_ipc",
                  "/update_weight_version", "/init_weights_update_group", "/destroy_weights_update_group",
                  "/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance",
                  "/get_weights_by_name", "/weights_checker", "/load_lora_adapter", "/unload_lora_adapter",
                  "/flush_cache", "/clear_hicache_storage_backend", "/hicache/", "/pause_generation",
                  "/continue_generation", "/abort_request", "/start_profile", "/stop_profile",
                  "/start_expert_distribution_record", "/stop_expert_distribution_record",
                  "/dump_expert_distribution_record", "/set_internal_state", "/configure_logging",
                  "/set_trace_level", "/freeze_gc", "/slow_down")
# Whatever runs the model: answered 503 while the engine is parked (its weights are released).
GENERATION = ("/generate", "/encode", "/classify", "/v1/completions", "/v1/chat/completions", "/v1/responses",
              "/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/messages", "/invocations", "/api/chat",
              "/api/generate", "/vertex_generate")
# SGLang's /health generates a token: while parked the process is alive, and is answered here.
HEALTH = ("/health", "/health_generate")
SESSIONS_DIR = "ckptflow-sessions"   # inside HiCache's directory (its clear() removes files, not directories)
DRAIN_TIMEOUT_S = 300.0
PAGE_WAIT_S = 10.0                   # HiCache writes a turn's pages behind the answer


class _State:
    def __init__(self) -> None:
        self.tm: Any = None            # SGLang's TokenizerManager (this API server's)
        self.args: Any = None          # its ServerArgs
        self.parked = False
        self.released = False
        self.lost: set[str] = set()
        self.digests: dict[str, str] = {}
        self.py_hash = False


STATE = _State()


# --- the page keys (SGLang's sha256 chain, mem_cache/cpp_utils/hash_binding.cpp) ------------------
def page_keys(tokens: list[int], page_size: int, prior: bytes | None = None, partial: bool = False) -> list[str]:
    """The chained key of each page of ``tokens``: sha256(previous page's digest ‖ the page's token
    ids as little-endian uint32). SGLang stores only full pages; ``partial`` also keys the last one.

        >>> page_keys([1, 2, 3, 4, 5], 2)[0] == hashlib.sha256(array("I", [1, 2]).tobytes()).hexdigest()
        True
        >>> len(page_keys([1, 2, 3, 4, 5], 2)), len(page_keys([1, 2, 3, 4, 5], 2, partial=True))
        (2, 3)
    """
    keys, end = [], len(tokens) if partial else len(tokens) // page_size * page_size
    for start in range(0, end, page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(array("I", tokens[start:start + page_size]).tobytes())
        prior = h.digest()
        keys.append(h.hexdigest())
    return keys


def _hash_fallback(original, token_ids, prior_digest=None, page_size=None):
    """AROUND SGLang's native page hash: the same digests in Python where its extension cannot be built."""
    if not STATE.py_hash:
        try:
            return original(token_ids, prior_digest, page_size)
        except RuntimeError as e:
            if "native hash" not in str(e) or sys.byteorder != "little":
                raise
            STATE.py_hash = True
            log.warning("ckptflow: SGLang's native page hash could not be built (%s); hashing pages in Python", e)
    from sglang.srt.mem_cache.cpp_utils.native_hash import _native_hash_input

    raw, n, width, bigram = _native_hash_input(token_ids)
    if bigram or width != 1:
        return original(token_ids, prior_digest, page_size)
    toks = list(raw[:n])
    if page_size is None:
        h = hashlib.sha256((prior_digest or b"") + array("I", toks).tobytes())
        return h.hexdigest()
    return page_keys(toks, page_size, prior_digest, partial=True)


# --- SGLang's plugin entry ---------------------------------------------------------------------
def plugin() -> None:
    """SGLang general plugin: registered hooks only (SGLang applies them in each of its processes)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.mem_cache.cpp_utils.native_hash.get_native_hash", _hash_fallback,
                          HookType.AROUND)
    if multiprocessing.parent_process() is None:   # the API server (its scheduler and detokenizer are children)
        HookRegistry.register("sglang.srt.entrypoints.http_server._setup_and_run_http_server", _install,
                              HookType.BEFORE)


def _install(server_args, tokenizer_manager, *args, **kwargs) -> None:
    """Before SGLang's HTTP server starts: keep its tokenizer manager, put the middleware on its app."""
    from sglang.srt.entrypoints.http_server import app
    from starlette.middleware.base import BaseHTTPMiddleware

    STATE.tm, STATE.args = tokenizer_manager, server_args
    app.add_middleware(BaseHTTPMiddleware, dispatch=ckptflow_protocol)
    log.info("ckptflow: engine protocol %d served on %s (HiCache pages in %s)", PROTOCOL, PREFIX, _kv_dir())


def write_entry_point(dest: Path) -> Path:
    """The entry point's metadata for a ckptflow run from a checkout (on PYTHONPATH, not installed)."""
    d = dest / "ckptflow_sglang_plugin-0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: ckptflow-sglang-plugin\nVersion: 0\n")
    (d / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT}\n")
    return d


# --- the middleware ------------------------------------------------------------------------------
async def ckptflow_protocol(request, call_next):
    """The protocol's routes, the control guard, the parked state, the session listing."""
    first = await answer_first(request, SGLANG_CONTROL, GENERATION, _route, STATE.parked)
    if first is not None:
        return first
    path = request.url.path
    if STATE.parked and path in HEALTH:
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "parked", "detail": "parked for a template checkpoint"})
    sid = request.headers.get(SESSION_HEADER)
    if sid and STATE.lost and sid in STATE.lost and path.startswith(GENERATION):
        STATE.lost.discard(sid)
        return _error(410, f"session {sid} was lost in a restore (its KV was not checkpointed): send its "
                           "whole history again to start it afresh")
    if not (sid and path == "/generate"):
        return await call_next(request)
    return await _generate_listed(request, call_next, sid)


async def _generate_listed(request, call_next, sid: str):
    """A session's turn: served as usual, then listed with its pages (a turn end)."""
    from starlette.responses import Response

    try:
        req = json.loads(await request.body() or b"{}")
        prompt = req.get("input_ids")
    except (ValueError, AttributeError):
        req, prompt = {}, None
    if isinstance(req, dict) and req.get("stream"):
        # Streamed tokens stay streamed: such a turn is not listed (its pages are on file all the same).
        return await call_next(request)
    resp = await call_next(request)
    body = b"".join([chunk async for chunk in resp.body_iterator])
    if resp.status_code == 200 and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        try:
            out = json.loads(body)
            if isinstance(out, dict) and isinstance(out.get("output_ids"), list):
                await asyncio.to_thread(list_session, sid, prompt, out["output_ids"])
        except (ValueError, OSError) as e:
            log.warning("ckptflow: session %s not listed: %s", sid, e)
    headers = {k: v for k, v in resp.headers.items() if k.lower() != "content-length"}
    return Response(body, status_code=resp.status_code, headers=headers, media_type=resp.media_type)


async def _route(request, call: str) -> dict:
    if request.method == "GET" and call == "engine":
        return await asyncio.to_thread(_info)
    if request.method != "POST":
        raise KeyError(request.url.path)
    body = await request.json()
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    if call == "sessions/export":
        return await asyncio.to_thread(_files().export, body)
    if call == "sessions/import":
        return await asyncio.to_thread(_import, body)
    if call == "template/prepare":
        return await _prepare()
    if call == "template/resume":
        return await _resume(body)
    raise KeyError(request.url.path)


# --- where things are ---------------------------------------------------------------------------
def _args() -> Any:
    if STATE.args is None:
        raise ValueError("SGLang's server is not set up yet (ckptflow's plugin keeps its arguments when it starts)")
    return STATE.args


def _kv_dir() -> Path:
    args = STATE.args
    if args is not None and (not getattr(args, "enable_hierarchical_cache", False)
                             or getattr(args, "hicache_storage_backend", None) != "file"):
        raise ValueError("this SGLang runs without HiCache file storage: add --enable-hierarchical-cache "
                         "--hicache-storage-backend file and SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR "
                         "(docs/engines/sglang.md)")
    d = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
    if not d:
        raise ValueError("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR is not set: ckptflow needs the directory "
                         "HiCache writes its pages to (docs/engines/sglang.md)")
    return Path(d)


def _suffixes() -> list[str]:
    """HiCache's file-name suffix of each tensor-parallel rank's part of a page (HiCacheFile)."""
    a = _args()
    model = "-".join(str(a.served_model_name or "").split("/"))
    tp = int(getattr(a, "tp_size", 1) or 1)
    return [f"_{model}_{r}_{tp}" for r in range(tp)]


_PAGE_FILE = re.compile(r"[0-9a-f]{64}_[^/\\]{1,180}")


def _page_file(kv_dir: Path, name: str) -> Path:
    if not _PAGE_FILE.fullmatch(name) or name.startswith("."):
        raise ValueError(f"not a HiCache page name: {name!r}")
    return kv_dir / f"{name}.bin"


def _files() -> BlockFiles:
    kv = _kv_dir()
    return BlockFiles(kv / SESSIONS_DIR, lambda name: _page_file(kv, name), STATE.digests, wait_s=PAGE_WAIT_S,
                      make_dirs=(kv, kv / SESSIONS_DIR),
                      listed_when=f"a /generate request with the header {SESSION_HEADER} finishes")


def list_session(sid: str, prompt: list[int], output: list[int]) -> dict:
    """The session's pages as SGLang caches them when its request finishes: the prompt and every
    answer token but the last (whose KV is not computed yet), full pages only."""
    a = _args()
    page = int(a.page_size or 1)
    tokens = prompt + output[:-1]
    sfx = _suffixes()
    names = [k + s for k in page_keys(tokens, page) for s in sfx]
    doc = {"session": sid, "block_size": page, "tokens": len(tokens) // page * page, "blocks": names}
    if len(sfx) > 1:
        doc["files_per_block"] = len(sfx)
    _files().list_session(doc)
    return doc


def _template_key() -> str:
    """What a template of this engine holds: the model, its dtype and length, the KV layout."""
    a = _args()
    version = getattr(sys.modules.get("sglang"), "__version__", None)   # imported: this is SGLang's process
    key = {"model": str(a.model_path), "dtype": str(a.dtype), "context_length": a.context_length,
           "page_size": a.page_size, "sglang": version, "tp": a.tp_size,
           "memory_saver": bool(a.enable_memory_saver)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _info() -> dict:
    a = _args()
    try:
        sessions = {sid: d["tokens"] for sid, d in _files().sessions().items()}
    except ValueError:
        sessions = {}
    return {"protocol": PROTOCOL, "engine": "sglang", "model": str(a.served_model_name),
            "template_key": _template_key(), "parked": STATE.parked, "sessions": sessions,
            "lost": sorted(STATE.lost), "memory_saver": bool(a.enable_memory_saver)}


def _import(body: dict) -> dict:
    out = _files().import_(body)
    STATE.lost |= set(body.get("lost") or ()) - set(out["imported"])
    return out


# --- template -----------------------------------------------------------------------------------
async def _drain(tm, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Until no request is in flight (release_memory_occupation asserts an idle scheduler)."""
    deadline = time.monotonic() + timeout_s
    while getattr(tm, "rid_to_state", None):
        if time.monotonic() > deadline:
            raise ValueError(f"{len(tm.rid_to_state)} request(s) still in flight after {timeout_s:.0f} s; "
                             "not parking the engine")
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)   # the scheduler's side of the last answer


async def _prepare() -> dict:
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

    tm, a = STATE.tm, _args()
    t0 = time.perf_counter()
    STATE.parked = True
    try:
        await _drain(tm)
        phases = {"drain": round(time.perf_counter() - t0, 4)}
        t1 = time.perf_counter()
        # The scheduler's own wait for idle (its last batch, the overlap queue): the release asserts
        # it, and a failed assert there ends the whole server. A template holds no session either.
        r = await tm.flush_cache(timeout_s=DRAIN_TIMEOUT_S)
        if not getattr(r, "success", True):
            raise ValueError(f"SGLang did not come idle to park: {getattr(r, 'message', '') or 'flush_cache failed'}")
        phases["flush_cache"] = round(time.perf_counter() - t1, 4)
        if a.enable_memory_saver:
            t1 = time.perf_counter()
            await tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)
            STATE.released = True
            phases["release_memory"] = round(time.perf_counter() - t1, 4)
    except BaseException:
        STATE.parked = False
        raise
    return {"tensors": [], "written_bytes": 0, "total_bytes": 0, "phases": phases,
            "weights": "update_weights_from_disk" if STATE.released else "kept in the image (no memory saver)"}


async def _resume(body: dict) -> dict:
    tm, a = STATE.tm, _args()
    phases: dict[str, float] = {}
    if STATE.released:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput, UpdateWeightFromDiskReqInput

        t0 = time.perf_counter()
        await tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)
        phases["resume_memory"] = round(time.perf_counter() - t0, 4)
        t0 = time.perf_counter()
        ok, msg, *_ = await tm.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path=str(a.model_path)),
                                                        None)
        if not ok:
            raise ValueError(f"SGLang could not read its weights back from {a.model_path}: {msg}")
        tm.served_model_name = a.served_model_name   # the update renames the model to its path
        phases["update_weights_from_disk"] = round(time.perf_counter() - t0, 4)
        STATE.released = False
    out: dict[str, Any] = {"loaded_bytes": 0}
    if "sessions" in body:
        t0 = time.perf_counter()
        # A torn chunk fails the call and the engine stays parked (the runner kills it).
        out.update(await asyncio.to_thread(_import, body))
        phases["sessions"] = round(time.perf_counter() - t0, 4)
    STATE.parked = False
    out["phases"] = phases
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m ckptflow.engines.sglang_protocol",
                                description="ckptflow's SGLang plugin: write its entry point for a checkout run")
    p.add_argument("--entry-point", type=Path, required=True, metavar="DIR",
                   help="a directory to put on SGLang's PYTHONPATH (beside ckptflow's checkout)")
    a = p.parse_args(argv)
    print(write_entry_point(a.entry_point))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
