"""The HTTP exchange of ckptflow's engine protocol (docs/engines/protocol.md): one client per
process, one call as data, and a call made inside a restored copy's network namespace.

Below the adapters (engines/adapter.py speaks the protocol through ``call``) and the runners
(runners/engine.py re-exports ``http``, ``base_url`` and wraps ``call``). No Prefect here.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import TYPE_CHECKING

import httpx

from ckptflow.errors import EngineProtocolError

if TYPE_CHECKING:
    from ckptflow.models import Workload

EXPORT_TIMEOUT_S = 600  # a template's weights, or a long session, written on a slow volume
JSON_HEADERS = {"Content-Type": "application/json"}


@functools.cache
def http() -> httpx.Client:
    """The process's one HTTP client for engine calls. It keeps no connection open between
    calls (no keep-alive pool): an idle connection to a worker would be one more established
    socket in its dump. Shared because building a client costs ~20 ms (its TLS context), more
    than a local call itself (~1 ms); httpx clients are thread-safe. Redirects are followed, as
    urllib did."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), follow_redirects=True)


def base_url(w: Workload) -> str:
    if not w.health_url:
        raise EngineProtocolError(f"workload {w.name}: no health_url, so no engine endpoint to talk to",
                                  fix="declare health_url (the engine's base URL is taken from it)")
    return w.health_url.rsplit("/", 1)[0]


def _request(url: str, body: dict | None, timeout_s: float, client: httpx.Client | None = None) -> dict:
    """One HTTP exchange as data: {"ok": answer} | {"code", "error"} | {"unreachable"}."""
    try:
        r = (client or http()).request("GET" if body is None else "POST", url, headers=JSON_HEADERS, timeout=timeout_s,
                           content=None if body is None else json.dumps(body).encode())
        if r.is_error:
            return {"code": r.status_code, "error": r.text}
        return {"ok": json.loads(r.content or b"{}")}
    except (httpx.HTTPError, ValueError) as e:
        return {"unreachable": str(e) or type(e).__name__}


# A copy restored beside its original listens on the same address inside its own network
# namespace. A thread of ours enters that namespace (setns is per thread for network
# namespaces) and makes the exchange there with a client of its own: sockets are created in the
# namespace of the thread that opens them. An interpreter started by `ip netns exec` for each
# call cost ~0.2 s, a standby's whole promotion budget (runners/template_sessions.py).
_CLONE_NEWNET = 0x40000000


def _enter_netns(netns: str) -> None:
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):   # Python >= 3.12
            os.setns(fd, _CLONE_NEWNET)
            return
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


def request_in_netns(netns: str, url: str, body: dict | None, timeout_s: float) -> dict:
    box: dict = {}

    def run() -> None:
        try:
            _enter_netns(netns)
        except OSError as e:
            box["got"] = {"unreachable": f"cannot enter network namespace {netns}: {e}"}
            return
        with httpx.Client(follow_redirects=True) as client:
            box["got"] = _request(url, body, timeout_s, client)

    t = threading.Thread(target=run, name=f"ckptflow-netns-{netns}", daemon=True)
    t.start()
    t.join()
    return box.get("got") or {"unreachable": f"call in {netns} crashed"}


def call(w: Workload, path: str, body: dict | None = None, timeout_s: float = EXPORT_TIMEOUT_S, *,
         base: str | None = None, netns: str | None = None, missing_fix: str | None = None) -> dict:
    """One protocol call: GET without ``body``, POST with it; the engine's JSON answer.
    ``base`` overrides the engine's address (a template copy answers on its source's);
    ``netns`` makes the call inside that network namespace; ``missing_fix``: the fix named when
    the engine does not serve ``path`` (its adapter's ``protocol_missing_fix``).

    Raises:
        EngineProtocolError: the engine refused (its own reason), or does not speak the protocol.
    """
    url = (base or base_url(w)) + path
    got = request_in_netns(netns, url, body, timeout_s) if netns else _request(url, body, timeout_s)
    if "ok" in got:
        return got["ok"]
    if got.get("code") == 404:
        raise EngineProtocolError(f"workload {w.name}: the engine does not serve {path}",
                                  fix=missing_fix)
    if "code" in got:
        try:
            reason = json.loads(got["error"]).get("error", got["error"])
        except (ValueError, AttributeError):
            reason = got["error"]
        raise EngineProtocolError(f"workload {w.name}: {path} refused: HTTP {got['code']}: {reason}")
    where = f" in {netns}" if netns else ""
    raise EngineProtocolError(f"workload {w.name}: {path} failed{where}: {got.get('unreachable')}", retryable=True)
