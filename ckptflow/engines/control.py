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


PREFIX = "/v1/ckptflow/"


async def answer_first(request, control: tuple[str, ...], generation: tuple[str, ...], route, parked: bool):
    """What the protocol answers before the engine does: a control call from off the machine
    (403), one of ckptflow's calls (``route(request, call)``'s JSON, or the error naming what was
    wrong), a generation request while the engine is parked (503). None: the engine's to answer."""
    from starlette.responses import JSONResponse

    path = request.url.path
    if (path.startswith(PREFIX) or path.startswith(control)) and not is_loopback(
            request.client.host if request.client else None):
        return error_response(403, f"{path} answers only on loopback (ckptflow's node runner); inference clients "
                                   "cannot reach control calls")
    if path.startswith(PREFIX):
        try:
            return JSONResponse(await route(request, path[len(PREFIX):]))
        except KeyError as e:
            return (error_response(404, f"no ckptflow call {path}") if e.args == (path,)
                    else error_response(400, f"missing field {e}"))
        except (ValueError, OSError) as e:
            return error_response(400, str(e))
    if parked and path.startswith(generation):
        return error_response(503, "the engine is parked for a template checkpoint; retry in a few seconds")
    return None
