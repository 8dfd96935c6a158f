"""The HTTP side of a worker, as ckptflow sees it: its state (probe, golden answer, metrics),
its health, and the hooks around a checkpoint (quiesce before the lock, resume after).

Example:
    >>> from ckptflow.runners.engine import golden_digest
    >>> golden_digest({"choices": [{"tokens": [1, 2]}]}, "choices.0.tokens")[:12]
    '3a316d6d3226'
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import httpx

from ckptflow.engines.adapter import EXPORT_TIMEOUT_S, get_adapter
from ckptflow.engines.protocol_http import JSON_HEADERS as _JSON
from ckptflow.engines.protocol_http import base_url, http
from ckptflow.engines.protocol_http import call as protocol_call
from ckptflow.errors import EngineProtocolError, RestoreFailed, WorkloadBusy
from ckptflow.poll import NotYet, poll

if TYPE_CHECKING:
    from ckptflow.models import EngineProbe, Workload
    from ckptflow.policies.load import WorkloadLoad

HEALTH_TIMEOUT_S = 60
PREPARE_TIMEOUT_S = 60  # a quiesce waits for the request in flight (a long generation) to finish
log = logging.getLogger("ckptflow")


def _get_json(url: str, timeout_s: float = 10) -> dict:
    r = http().get(url, timeout=timeout_s)
    r.raise_for_status()
    return r.json()


def _post(url: str, body: bytes, timeout_s: float) -> httpx.Response:
    r = http().post(url, content=body, headers=_JSON, timeout=timeout_s)
    r.raise_for_status()
    return r


def probe(w: Workload) -> EngineProbe:
    """What the worker says about its own state: session digests and the golden answer's digest
    (what a checkpoint's manifest records, ``models.ManifestProbe``)."""
    from ckptflow.models import EngineProbe

    out = EngineProbe()
    if w.probe_url:
        try:
            out.sessions = _get_json(w.probe_url)["sessions"]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            out.error = f"probe failed: {http_reason(e)}"
    if w.golden:
        try:
            answer = _post(w.golden.url, json.dumps(w.golden.body).encode(), timeout_s=60).json()
            out.golden = golden_digest(answer, w.golden.field)
        except (httpx.HTTPError, KeyError, ValueError, IndexError) as e:
            out.golden_error = f"golden request failed: {http_reason(e)}"
    return out


def answers_real_work(w: Workload, pid: int, what: str) -> None:
    """A restored worker is done when it has served real work, not when ``/health`` answers: its
    golden request (which runs the model) must come back with its field. A worker that cannot is
    stopped (its tree killed: it holds the port a cold start needs) and the restore fails.
    Without a golden request there is nothing to run; ``/health`` and the probe are all.

    Measured (issue #36): a CPU vLLM restored on an AMX machine answered ``/health`` and died of
    SIGILL on its first completion; ckptflow had reported it recovered.

    Raises:
        RestoreFailed: the golden request failed or its answer lacks the field.
    """
    if w.golden is None:
        return
    try:
        answer = _post(w.golden.url, json.dumps(w.golden.body).encode(), timeout_s=HEALTH_TIMEOUT_S).json()
        golden_digest(answer, w.golden.field)
        return
    except (httpx.HTTPError, KeyError, ValueError, IndexError, TypeError) as e:
        reason = http_reason(e) if isinstance(e, httpx.HTTPError) else f"no {w.golden.field} in its answer ({e})"
    import signal

    from ckptflow.runners import process

    for p in process.tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise RestoreFailed(f"workload {w.name}: {what} and healthy, but it could not serve its golden request "
                        f"({reason}); the restored worker was stopped",
                        fix="cold start the worker and run verify on this checkpoint (`ckptflow verify`)")


def golden_digest(answer: dict, field: str) -> str:
    """sha256 of the answer's field at a dotted path (``choices.0.text``)."""
    import hashlib

    v: object = answer
    for part in field.split("."):
        v = v[int(part)] if isinstance(v, list) else v[part]  # type: ignore[index]
    return hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()


def read_load(w: Workload) -> WorkloadLoad | None:
    """The engine's /metrics as a WorkloadLoad, read with its adapter's mapping; None when there
    is none, the adapter has no mapping (``engine: other``: the fleet loader refuses a metrics_url
    there) or it cannot be read."""
    adapter = get_adapter(w.engine)
    if not w.metrics_url or not adapter.metrics:
        return None
    try:
        r = http().get(w.metrics_url, timeout=5)
        r.raise_for_status()
        return adapter.parse_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        return None


def wait_url(url: str, timeout_s: float, proc=None) -> float:
    """Poll ``url`` until it answers 200; return the seconds it took.

    Raises:
        TimeoutError: no 200 within ``timeout_s`` (a PollTimeout, with the last error).
        RuntimeError: ``proc`` (a Popen) exited first.
    """
    t0 = time.perf_counter()

    def answered() -> bool:
        try:
            status = http().get(url, timeout=2).status_code
        except httpx.HTTPError as e:
            status, why = None, http_reason(e)
        else:
            why = f"HTTP {status}"
        if status == 200:
            return True
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode} before {url} answered")
        raise NotYet(why)

    poll(answered, timeout_s, 0.05, what=f"{url} to answer 200")
    return time.perf_counter() - t0


def wait_healthy(w: Workload, timeout_s: float = HEALTH_TIMEOUT_S) -> float:
    if not w.health_url:
        return 0.0
    try:
        return wait_url(w.health_url, timeout_s)
    except TimeoutError as e:
        raise RestoreFailed(f"workload {w.name}: not healthy after restore: {e}",
                            fix="see the restore log; the checkpoint may be broken (run verify)") from None


def quiesce(w: Workload, tp: bool) -> tuple[dict, float | None]:
    """POST the engine's prepare hook; its answer and the seconds it took (None: no hook).

    For one GPU process it only frees cached memory and may fail harmlessly; a tensor-parallel
    group must be quiesced (no collective in flight on any rank) or its lock cannot succeed,
    so there a failure stops the checkpoint.

    Raises:
        WorkloadBusy: a TP engine could not be quiesced (retryable; it keeps serving).
    """
    if not w.prepare_url:
        return {}, None
    t0 = time.perf_counter()
    try:
        answer = json.loads(_post(w.prepare_url, b"{}", PREPARE_TIMEOUT_S).content or b"{}")
    except (httpx.HTTPError, ValueError) as e:
        if tp:
            raise WorkloadBusy(f"workload {w.name}: its ranks could not be quiesced before the CUDA lock: "
                               f"{http_reason(e)}", fix="retry later; the worker keeps serving") from e
        answer = {}  # an optimisation only: the checkpoint is correct without it
    return (answer if isinstance(answer, dict) else {}), time.perf_counter() - t0


def http_reason(e: Exception) -> str:
    """An HTTP failure in one line: ``HTTP 409: <the engine's error>``, or what the transport said."""
    if isinstance(e, httpx.HTTPStatusError):
        code = e.response.status_code
        try:
            return f"HTTP {code}: {e.response.json().get('error', '')}"
        except (ValueError, AttributeError):
            return f"HTTP {code}"
    return str(e) or type(e).__name__  # httpx's timeouts and resets may carry no text


def resume(w: Workload) -> None:
    """Let a quiesced engine serve again (best effort: its own hold timeout is the backstop)."""
    if not w.resume_url:
        return
    try:
        _post(w.resume_url, b"{}", timeout_s=10)
    except httpx.HTTPError as e:
        log.warning("workload %s: resume failed (%s); it serves again when its hold times out", w.name,
                    http_reason(e))


def rank_states(url: str | None) -> str:
    """What each rank says it is doing (the engine's own view), for a lock that timed out."""
    if not url:
        return ""
    try:
        return "; ".join(r.get("describe", str(r)) for r in _get_json(url, timeout_s=5).get("ranks", []))
    except (httpx.HTTPError, ValueError) as e:
        return f"(rank states unavailable: {http_reason(e)})"


# --- the two-tier protocol (docs/engines/protocol.md) -----------------------------------------
# The HTTP exchange is engines/protocol_http.py's; what each call sends, and whether the engine takes it at all,
# is its adapter's (engines/adapter.py): the orchestration calls the functions at the end of this file.
PROTOCOL = 1


def call(w: Workload, path: str, body: dict | None = None, timeout_s: float = EXPORT_TIMEOUT_S, *,
         base: str | None = None, netns: str | None = None) -> dict:
    """One protocol call (engines/protocol_http.py ``call``), with the fix the workload's adapter gives when
    the engine does not serve ``path``.

    Raises:
        EngineProtocolError: the engine refused (its own reason), or does not speak the protocol.
    """
    return protocol_call(w, path, body, timeout_s, base=base, netns=netns,
                         missing_fix=get_adapter(w.engine).protocol_missing_fix)


def engine_info(w: Workload, **where: Any) -> dict:
    """The engine's ``/v1/ckptflow/engine`` answer, its protocol version checked.

    Raises:
        EngineProtocolError: another protocol version, or an engine without the protocol.
    """
    info = get_adapter(w.engine).info(w, **where)
    if info.get("protocol") != PROTOCOL:
        raise EngineProtocolError(f"workload {w.name}: engine speaks protocol {info.get('protocol')!r}, "
                                  f"ckptflow speaks {PROTOCOL}", fix="upgrade the engine plugin or ckptflow")
    return info


def export_sessions(w: Workload, dir: str, known: dict[str, list[str]], sessions: list[str] | None = None,
                    **where: Any) -> dict:
    """The engine writes its sessions' chunks (those not ``known``) into ``dir``: ``{"sessions": {sid: record}}``.
    ``where``: ``base``/``netns``/``timeout_s`` as for ``call``.

    Raises:
        EngineProtocolError: refused, or the engine's adapter has no session export.
    """
    return get_adapter(w.engine).export_sessions(w, dir, known, sessions, **where)


def import_sessions(w: Workload, dir: str, records: dict[str, dict], **where: Any) -> dict:
    """Sessions back into the engine from their records (all or nothing): ``{"imported", "digests"}``."""
    return get_adapter(w.engine).import_sessions(w, dir, records, **where)


def template_prepare(w: Workload, dir: str, known: list[str], **where: Any) -> dict:
    """Weights out as chunks into ``dir``, then the engine parks: ``{"tensors", "written_bytes", ...}``."""
    return get_adapter(w.engine).template_prepare(w, dir, known, **where)


def template_adopt(w: Workload, dir: str, tensors: list[dict], **where: Any) -> dict:
    """Weights back from their records (protocol: template/resume); the engine serves again."""
    return get_adapter(w.engine).template_adopt(w, dir, tensors, **where)
