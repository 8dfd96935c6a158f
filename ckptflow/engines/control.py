"""What the engine-side protocol modules (vLLM's middleware, SGLang's plugin) answer before any
call reaches the engine: who may call control endpoints, and the error body. Runs inside the
engine's API server process: standard library and starlette only."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str | None) -> bool:
    """Whether an ASGI client address is this machine's loopback.

        >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("10.0.0.5"), is_loopback(None)
        (True, True, False, False)
    """
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def error_response(code: int, msg: str):
    """The protocol's error answer: ``{"error": msg}`` with the status ``code``."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": msg}, status_code=code)
