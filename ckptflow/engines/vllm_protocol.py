"""ckptflow's engine protocol (docs/engines/protocol.md) served by vLLM itself, as ASGI middleware
of its OpenAI server, over the sessions ckptflow's KV connector writes (engines/vllm_connector.py).

Loaded by vLLM (it runs inside the API server process, so it imports only vLLM's own packages,
starlette and the standard library)::

    python -m vllm.entrypoints.openai.api_server ... --enable-prefix-caching \\
      --kv-transfer-config '{"kv_connector": "CkptflowConnector",
                             "kv_connector_module_path": "ckptflow.engines.vllm_connector",
                             "kv_role": "kv_both",
                             "kv_connector_extra_config": {"chunk_dir": "/var/lib/ckptflow/kv/chat-a"}}' \\
      --middleware ckptflow.engines.vllm_protocol.ckptflow_protocol \\
      --worker-extension-cls ckptflow.engines.vllm_worker.CkptflowWorkerExtension

Why middleware for the calls, and a worker extension only for the weights: a session's KV is
already on the node's disk, block by block, written by the connector while the engine served
(each block once); exporting a session is then naming those files and copying the new ones,
which the API server process can do without touching the engine. The weights live in the worker
processes, so only their copy out and back runs there (``collective_rpc``, each rank its own
shard). The engine calls it needs (pause, prefix-cache reset, sleep, wake, ``collective_rpc``)
are the engine client's own methods: vLLM's dev-mode endpoints (``VLLM_SERVER_DEV_MODE``) are
not needed, and are refused here to any client not on loopback.

What each call does:
- ``GET /v1/ckptflow/engine``: the sessions the connector has listed (a session is listed when
  a request carrying ``kv_transfer_params: {"ckptflow_session": NAME}`` finishes: a turn end),
  their tokens (full blocks), and the template key.
- ``sessions/export``: one record per session, its chunks the session's block files in order
  (a chunk's name is the sha256 of the file's bytes); only chunks the runner does not hold are
  written. Nothing is held: ``held_s`` 0, ``turn`` true.
- ``sessions/import``: every chunk checked against its name first, then the blocks written under
  their keys and the session listed again (all or nothing). The next turn of the session loads
  them as external prefix-cache hits instead of prefilling.
- ``template/prepare``: new requests wait, the one in flight finishes, the prefix cache is
  emptied (``pause_generation(mode="wait", clear_cache=True)``); with ``--enable-sleep-mode``
  (GPU) the engine then sleeps at level 2 (weights and KV released, its allocator keeps the
  addresses). With ckptflow's worker extension (``--worker-extension-cls``,
  engines/vllm_worker.py) each rank first writes its parameters as chunks (those the runner
  holds skipped); without it the weights are read back from the model directory after a
  restore (``reload_weights``). On CPU vLLM has no sleep mode, and the template keeps its
  weights in its image.
- ``template/resume``: wake when asleep (weights; the parameters streamed back from the
  template's chunks, every chunk checked, else ``reload_weights``; KV), imports the sessions
  given, then generation resumes.

Control calls answer only clients on loopback (the runner's own calls): an inference client
that reaches the serving port from another host gets 403, for ckptflow's calls and for vLLM's
dev-mode control endpoints alike.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request

from ckptflow.engines.control import error_response as _error
from ckptflow.engines.control import answer_first
from ckptflow.engines.kv_files import BlockFiles
from ckptflow.engines.vllm_layout import BLOCKS, SESSIONS
from ckptflow.engines.vllm_worker import EXTENSION

log = logging.getLogger(__name__)
PROTOCOL = 1
PREFIX = "/v1/ckptflow/"
# vLLM's control endpoints (dev mode, sleep mode, weight updates): never for inference clients.
VLLM_CONTROL = ("/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache",
                "/reset_mm_cache", "/reset_encoder_cache", "/pause", "/resume", "/is_paused",
                "/update_weights", "/init_weight_transfer_engine", "/scale_elastic_ep", "/server_info")
# Generation answers 503 while parked (instead of waiting in the paused scheduler for as long
# as the dump takes).
GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate", "/inference/")


class _State:
    """What the middleware knows across calls (one API server process: one engine)."""

    def __init__(self) -> None:
        self.parked = False
        self.asleep = False
        self.lost: set[str] = set()
        self.digests: dict[str, str] = {}      # block key -> sha256 of its file (a key's bytes never change)


STATE = _State()


async def ckptflow_protocol(request: Request, call_next):
    """vLLM ``--middleware``: the protocol's routes, the control guard, the parked state."""
    first = await answer_first(request, VLLM_CONTROL, GENERATION, _route, STATE.parked)
    if first is not None:
        return first
    path = request.url.path
    if STATE.lost and path.startswith(GENERATION):
        sid = await _session_of(request)
        if sid in STATE.lost:
            STATE.lost.discard(sid)
            return _error(410, f"session {sid} was lost in a restore (its KV was not checkpointed): send its "
                               "whole history again to start it afresh")
    return await call_next(request)


async def _session_of(request: Request) -> str | None:
    try:
        body = json.loads(await request.body() or b"{}")
        return (body.get("kv_transfer_params") or {}).get("ckptflow_session")
    except (ValueError, AttributeError):
        return None


async def _route(request: Request, call: str) -> dict:
    app = request.app
    if request.method == "GET" and call == "engine":
        return await asyncio.to_thread(_info, app)
    if request.method != "POST":
        raise KeyError(request.url.path)
    body = await request.json()
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    if call == "sessions/export":
        return await asyncio.to_thread(_export, _chunk_dir(app), body)
    if call == "sessions/import":
        return await asyncio.to_thread(_import, _chunk_dir(app), body)
    if call == "template/prepare":
        return await _prepare(app, body)
    if call == "template/resume":
        return await _resume(app, body)
    raise KeyError(request.url.path)


# --- where things are ---------------------------------------------------------------------------
def _config(app) -> Any:
    return app.state.vllm_config


def _chunk_dir(app) -> Path:
    kv = _config(app).kv_transfer_config
    if kv is None or kv.kv_connector != "CkptflowConnector":
        raise ValueError("this vLLM runs without ckptflow's KV connector: add --kv-transfer-config with "
                         "kv_connector CkptflowConnector (docs/engines/vllm.md)")
    return Path(kv.get_from_extra_config("chunk_dir", "/tmp/ckptflow-kv"))


def _streams_weights(app) -> bool:
    """Whether ckptflow's worker extension is loaded (``--worker-extension-cls``): a template's
    weights then go out as chunks and come back from them; else ``reload_weights``."""
    ext = getattr(_config(app).parallel_config, "worker_extension_cls", "") or ""
    return ext == EXTENSION


def _template_key(app) -> str:
    """What a template of this engine holds: the model, its dtype and length, the KV layout."""
    import vllm

    cfg = _config(app)
    m, c = cfg.model_config, cfg.cache_config
    key = {"model": str(m.model), "dtype": str(m.dtype), "max_model_len": m.max_model_len,
           "block_size": c.block_size, "vllm": vllm.__version__,
           "tp": cfg.parallel_config.tensor_parallel_size}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _info(app) -> dict:
    cfg = _config(app)
    try:
        sessions = {sid: d["tokens"] for sid, d in _sessions(_chunk_dir(app)).items()}
    except ValueError:
        sessions = {}
    names = cfg.model_config.served_model_name
    return {"protocol": PROTOCOL, "engine": "vllm", "model": names if isinstance(names, str) else str(names),
            "template_key": _template_key(app), "parked": STATE.parked, "sessions": sessions,
            "lost": sorted(STATE.lost), "sleep_mode": bool(getattr(cfg.model_config, "enable_sleep_mode", False)),
            "weights": "chunks" if _streams_weights(app) else "reload_weights"}


# --- sessions -----------------------------------------------------------------------------------
def _block_file(chunk_dir: Path, key: str) -> Path:
    if len(key) != 64 or not all(ch in "0123456789abcdef" for ch in key):
        raise ValueError(f"not a block key: {key!r}")
    return chunk_dir / BLOCKS / f"{key}.safetensors"


def _files(chunk_dir: Path) -> BlockFiles:
    """The connector's blocks: written before their session is listed, so an export never waits."""
    return BlockFiles(chunk_dir / SESSIONS, lambda key: _block_file(chunk_dir, key), STATE.digests,
                      make_dirs=(chunk_dir / BLOCKS, chunk_dir / SESSIONS),
                      listed_when="a request carrying kv_transfer_params.ckptflow_session finishes")


def _sessions(chunk_dir: Path) -> dict[str, dict]:
    return _files(chunk_dir).sessions()


def _export(chunk_dir: Path, body: dict) -> dict:
    return _files(chunk_dir).export(body)


def _import(chunk_dir: Path, body: dict) -> dict:
    out = _files(chunk_dir).import_(body)
    STATE.lost |= set(body.get("lost") or ()) - set(out["imported"])
    return out


# --- template -----------------------------------------------------------------------------------
async def _prepare(app, body: dict) -> dict:
    client = app.state.engine_client
    t0 = time.perf_counter()
    STATE.parked = True
    tensors: list[dict] = []
    written = total = 0
    try:
        # The request in flight ends, new ones wait; the prefix cache is emptied (a template
        # holds no session), the connector's files stay.
        await client.pause_generation(mode="wait", clear_cache=True)
        phases = {"drain": round(time.perf_counter() - t0, 4)}
        if getattr(_config(app).model_config, "enable_sleep_mode", False):
            # Asleep already (a runner died mid-capture, or a call came twice): its weights are
            # gone, so none are written, and its resume reads them from the model directory.
            if _streams_weights(app) and not STATE.asleep:
                # Each rank writes its parameters as chunks (those the runner holds are skipped:
                # a template of the same weights writes nothing), before sleep discards them.
                t1 = time.perf_counter()
                out_dir = body.get("dir")
                if not isinstance(out_dir, str) or not out_dir:
                    raise ValueError("template/prepare needs dir: where the weights' chunks go")
                known = [k for k in body.get("known") or [] if isinstance(k, str)]
                try:
                    for rank in await client.collective_rpc("ckptflow_export_weights", args=(out_dir, known)):
                        tensors += rank["tensors"]
                        written += rank["written_bytes"]
                        total += rank["total_bytes"]
                except Exception as e:   # e.g. a parameter that is a view with gaps: the model directory will do
                    tensors, written, total = [], 0, 0
                    log.warning("ckptflow: the weights were not written as chunks (%s); the template's resume "
                                "reads them from the model directory (reload_weights)", e)
                phases["export_weights"] = round(time.perf_counter() - t1, 4)
            t1 = time.perf_counter()
            await client.sleep(level=2)
            STATE.asleep = True
            phases["sleep"] = round(time.perf_counter() - t1, 4)
    except BaseException:
        await _unpause(client)
        raise
    how = ("chunks" if tensors else "reload_weights") if STATE.asleep else "kept in the image (no sleep mode)"
    return {"tensors": tensors, "written_bytes": written, "total_bytes": total, "phases": phases, "weights": how}


async def _unpause(client) -> None:
    await client.resume_generation()
    STATE.parked = False


def _timed(fn, *args):
    """``fn(*args)`` and the seconds it took (the session import, timed where it runs)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, round(time.perf_counter() - t0, 4)


async def _resume(app, body: dict) -> dict:
    client = app.state.engine_client
    phases: dict[str, float] = {}
    # The sessions' blocks are files the connector reads at the next turn, not engine memory:
    # they are checked and written beside the weights' load (1.36 s after it, one after another,
    # on the H200), and the engine stays parked until both are done.
    sessions = None
    if "sessions" in body:
        sessions = asyncio.ensure_future(asyncio.to_thread(_timed, _import, _chunk_dir(app), body))
    try:
        if STATE.asleep:
            tensors = [r for r in body.get("tensors") or [] if isinstance(r, dict)]
            if tensors and _streams_weights(app):
                # The parameters' own bytes from the template's chunks, every chunk checked; a torn
                # one fails the call, named, and the engine stays parked (the runner kills it).
                load = ("load_weights", lambda: client.collective_rpc("ckptflow_import_weights",
                                                                       args=(str(body.get("dir") or ""), tensors)))
            else:   # a template taken without the extension: the model directory, as vLLM does
                load = ("reload_weights", lambda: client.collective_rpc("reload_weights"))
            for key, step in (("wake_weights", lambda: client.wake_up(["weights"])), load,
                              ("wake_kv_cache", lambda: client.wake_up(["kv_cache"]))):
                t0 = time.perf_counter()
                try:
                    await step()
                except Exception as e:   # a worker's error comes back as a plain Exception: say it (a torn chunk)
                    raise ValueError(f"template/resume: {key} failed: {e}") from e
                phases[key] = round(time.perf_counter() - t0, 4)
            STATE.asleep = False
    except BaseException:
        if sessions is not None:   # no thread left writing blocks behind a failed call
            await asyncio.gather(sessions, return_exceptions=True)
        raise
    out: dict[str, Any] = {"loaded_bytes": 0}
    if sessions is not None:
        # A torn chunk fails the call and the engine stays parked (the runner kills it).
        got, phases["sessions"] = await sessions
        out.update(got)
    if STATE.parked:
        await _unpause(client)
    out["phases"] = phases
    return out
