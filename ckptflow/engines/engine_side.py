"""The engine side of ckptflow's two-tier protocol (docs/engines/protocol.md), once for every
demo worker: the request bodies parsed, the answers shaped, the parked state kept, the routes
declared. The ckptflow side is engines/adapter.py.

A worker subclasses ``EngineSide``, names itself (``ENGINE``) and gives either the array hooks
(``session_state``, ``adopt_sessions``, ``weight_arrays``, ``release_weights``,
``adopt_weights``: the numpy and torch workers; chunks are cut and checked here, by
engines/chunkfiles.py) or the four calls over parsed requests itself (``export_sessions``,
``import_sessions``, ``prepare_template``, ``resume_template``: the vLLM-shaped engine, whose
bytes move between VMM ranges and pinned memory).

Routes are declared, not guessed (they were found by ``hasattr``): ``routes(w)`` is the
worker's own table (``GET_ROUTES``, ``POST_ROUTES``) plus the protocol's when
``SPEAKS_PROTOCOL``; a declared route whose method is missing fails at start.

Example:
    >>> req = ExportRequest.parse({"dir": "/tmp/x", "known": {"a": ["d1"]}, "sessions": ["a"]}, 1024)
    >>> req.wants("a"), req.wants("b"), req.known["a"], req.chunk_bytes
    (True, False, {'d1'}, 1024)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

PROTOCOL = 1
ENGINE_PATH = "/v1/ckptflow/engine"
PROTOCOL_POST = {"/v1/ckptflow/sessions/export": "sessions_export",
                 "/v1/ckptflow/sessions/import": "sessions_import",
                 "/v1/ckptflow/template/prepare": "template_prepare",
                 "/v1/ckptflow/template/resume": "template_resume",
                 "/v1/ckptflow/template/warm": "template_warm"}


@contextmanager
def sessions_between_turns(locks: dict[str, threading.Lock], wait_s: float) -> Iterator[None]:
    """Hold every session's turn lock (in name order, so two holders cannot deadlock) for a
    turn-boundary export, or none: a session whose turn does not end within ``wait_s`` in all
    fails the export with TimeoutError naming it (HTTP 400, one line), instead of holding the
    export, and every export behind it, for a turn of unknown length. The turn-end loop weighs
    it again at its next turn end.

        >>> a, b = threading.Lock(), threading.Lock()
        >>> with sessions_between_turns({"b": b, "a": a}, 0.1):
        ...     a.locked() and b.locked()
        True
        >>> _ = b.acquire()          # "b" is in a turn
        >>> with sessions_between_turns({"a": a, "b": b}, 0.05):
        ...     pass
        Traceback (most recent call last):
        TimeoutError: session b is in a turn (still after 0.05 s): a turn export waits for none; it is weighed again at its next turn end
        >>> a.locked()               # what it took, it gave back
        False
    """
    taken: list[threading.Lock] = []
    end = time.monotonic() + wait_s
    try:
        for sid in sorted(locks):
            if not locks[sid].acquire(timeout=max(0.0, end - time.monotonic())):
                raise TimeoutError(f"session {sid} is in a turn (still after {wait_s:g} s): a turn export waits "
                                   f"for none; it is weighed again at its next turn end")
            taken.append(locks[sid])
        yield
    finally:
        for lk in reversed(taken):
            lk.release()


@dataclass(frozen=True)
class ExportRequest:
    """``sessions/export``: where to write, which chunks the runner holds per session, which
    sessions. ``turn``: the named sessions are between two turns; an engine that can holds only
    them while it copies their state out, and serves the others on (an engine that cannot holds
    itself as for any export, and its answer does not say ``"turn": true``).

    Raises:
        ValueError: ``turn`` without ``sessions`` (a turn boundary is one session's, not the engine's).
    """

    dir: Path
    known: dict[str, set[str]]
    only: frozenset[str] | None
    chunk_bytes: int
    turn: bool = False

    @classmethod
    def parse(cls, body: dict, default_chunk: int) -> ExportRequest:
        only = body.get("sessions")
        turn = bool(body.get("turn", False))
        if turn and only is None:
            raise ValueError('a turn-boundary export names its sessions ("sessions": [ids])')
        return cls(dir=Path(body["dir"]), known={sid: set(ds) for sid, ds in (body.get("known") or {}).items()},
                   only=None if only is None else frozenset(only),
                   chunk_bytes=int(body.get("chunk_bytes", default_chunk)), turn=turn)

    def wants(self, sid: str) -> bool:
        return self.only is None or sid in self.only


@dataclass(frozen=True)
class ImportRequest:
    """``sessions/import``: the records an export answered, chunks under ``dir``."""

    dir: Path
    sessions: dict[str, dict]

    @classmethod
    def parse(cls, body: dict) -> ImportRequest:
        return cls(dir=Path(body["dir"]), sessions=dict(body["sessions"]))


@dataclass(frozen=True)
class PrepareRequest:
    """``template/prepare``: where the weights go, which chunks the runner holds, whether to park."""

    dir: Path
    known: set[str]
    release: bool
    chunk_bytes: int

    @classmethod
    def parse(cls, body: dict, default_chunk: int) -> PrepareRequest:
        return cls(dir=Path(body["dir"]), known=set(body.get("known") or []), release=bool(body.get("release", True)),
                   chunk_bytes=int(body.get("chunk_bytes", default_chunk)))


@dataclass(frozen=True)
class ResumeRequest:
    """``template/resume``: the weights' records a prepare answered, chunks under ``dir``; and
    optionally ``sessions``, the records ``sessions/import`` takes, brought in by the same call
    (the engine answers ``imported`` and ``digests`` as the import does; an engine that answers
    without them did not take them, and the runner imports them with ``sessions/import``)."""

    dir: Path
    tensors: list[dict]
    sessions: dict[str, dict] | None = None

    @classmethod
    def parse(cls, body: dict) -> ResumeRequest:
        recs = body.get("sessions")
        return cls(dir=Path(body["dir"]), tensors=list(body["tensors"]),
                   sessions=None if recs is None else dict(recs))


# One session's state for the shared export: the record's own fields (tokens, digest, and what the
# engine needs back at import) and its tensors, token-major so that growth changes only the tail.
SessionState = tuple[dict, list[tuple[str, Any]]]


class SessionLost(ValueError):
    """A turn of a session lost in a restore: answered 410 Gone with the reason."""


class EngineSide:
    """The protocol's engine side; see the module docstring for what a worker provides."""

    ENGINE: ClassVar[str] = ""
    SPEAKS_PROTOCOL: ClassVar[bool] = True
    SESSION_CHUNK: ClassVar[int] = 64 << 10
    WEIGHT_CHUNK: ClassVar[int] = 1 << 20
    IO_THREADS: ClassVar[int] = 1       # hashing and file writes release the GIL
    GET_ROUTES: ClassVar[dict[str, str]] = {}
    POST_ROUTES: ClassVar[dict[str, str]] = {}

    model_name: str
    parked: bool
    parked_with: dict | None = None     # while parked: where the weights went (the prepare's dir and records)

    # --- what every worker says about itself ------------------------------------------------
    def template_key(self) -> str:
        """What a template of this engine holds (model config, weights), as a short digest."""
        raise NotImplementedError

    def session_lengths(self) -> dict[str, int]:
        raise NotImplementedError

    def engine_extra(self) -> dict:
        """Fields the engine adds to its ``/v1/ckptflow/engine`` answer (sizes, start timings)."""
        return {}

    def engine_info(self) -> dict:
        return {"protocol": PROTOCOL, "engine": self.ENGINE, "model": self.model_name,
                "template_key": self.template_key(), "parked": self.parked,
                **({"parked_with": self.parked_with} if self.parked else {}),
                "sessions": self.session_lengths(), **self.engine_extra(),
                **({"lost": sorted(self.lost_sessions)} if getattr(self, "lost_sessions", None) else {})}

    def park(self, out_dir: Path, tensors: list[dict]) -> None:
        self.parked_with = {"dir": str(out_dir), "tensors": tensors}  # whoever unparks us needs it

    # --- the HTTP calls: bodies in, answers out ---------------------------------------------
    def sessions_export(self, body: dict) -> dict:
        return self.export_sessions(ExportRequest.parse(body, self.SESSION_CHUNK))

    def sessions_import(self, body: dict) -> dict:
        out = self.import_sessions(ImportRequest.parse(body))
        self.mark_lost(body.get("lost"))
        return out

    def template_prepare(self, body: dict) -> dict:
        return self.prepare_template(PrepareRequest.parse(body, self.WEIGHT_CHUNK))

    def template_resume(self, body: dict) -> dict:
        out = self.resume_template(ResumeRequest.parse(body))
        self.mark_lost(body.get("lost"))
        return out

    # --- sessions a restore knew of but could not bring back ---------------------------------
    def mark_lost(self, ids: list[str] | None) -> None:
        """``lost`` of an import or resume: sessions the checkpoint listed without their KV, added
        to those not yet answered (a call without ``lost``, an unpark, leaves them)."""
        if ids:
            self.lost_sessions = (getattr(self, "lost_sessions", set()) | set(ids)) - set(self.session_lengths())

    def check_lost(self, sid: str | None) -> None:
        """Refuse, once, a turn of a session lost in a restore: its client resends the history
        (the same id then starts afresh) instead of talking to a session that forgot it.

        Raises:
            SessionLost: ``sid`` is one of them.
        """
        lost = getattr(self, "lost_sessions", None)
        if sid is not None and lost and sid in lost:
            lost.discard(sid)
            raise SessionLost(f"session {sid} was lost in a restore (its KV was not checkpointed): "
                              "send its whole history again to start it afresh")

    def template_warm(self, body: dict) -> dict:
        """``template/warm``: a parked engine that will be resumed soon (a standby) takes what it
        can ahead of the resume without holding device memory; {} when there is nothing to take."""
        return self.warm_template()

    def warm_template(self) -> dict:
        return {}

    # --- shared implementation over arrays (numpy, or torch copied to the host) ----------------
    def session_state(self, req: ExportRequest) -> tuple[dict[str, SessionState], float | None]:
        """The sessions ``req`` wants, and the seconds the engine was held to take them (None:
        the export holds the engine throughout, nothing to report)."""
        raise NotImplementedError

    def adopt_sessions(self, staged: dict[str, tuple[dict[str, Any], dict]]) -> dict[str, str]:
        """Install sessions from their checked tensors (name -> array) and records; their digests."""
        raise NotImplementedError

    def weight_arrays(self) -> dict[str, Any]:
        """The large static tensors a template leaves out (name -> host array)."""
        raise NotImplementedError

    def release_weights(self) -> None:
        """Drop weights and sessions: what is dumped next is the initialised engine alone."""
        raise NotImplementedError

    def adopt_weights(self, weights: dict[str, Any]) -> None:
        """Weights back from their checked arrays (name -> array); serving again."""
        raise NotImplementedError

    def export_sessions(self, req: ExportRequest) -> dict:
        """Each session's chunks into ``req.dir``, skipping those the runner lists as known for it."""
        from ckptflow.engines.chunkfiles import export_tensor

        states, held = self.session_state(req)
        res = {}
        for sid, (fields, parts) in states.items():
            seen, tensors, written = req.known.get(sid, set()), [], 0
            for name, a in parts:
                rec, n = export_tensor(name, a, req.dir, req.chunk_bytes, seen, threads=self.IO_THREADS)
                tensors.append(rec)
                written += n
            res[sid] = {**fields, "tensors": tensors, "written_bytes": written,
                        "total_bytes": sum(t["nbytes"] for t in tensors)}
        return {"sessions": res, **({"held_s": round(held, 4)} if held is not None else {})}

    def import_sessions(self, req: ImportRequest) -> dict:
        """Every chunk of every session is checked before any session changes: all or nothing."""
        from ckptflow.engines.chunkfiles import import_tensor

        staged = {sid: ({r["name"]: import_tensor(r, req.dir, threads=self.IO_THREADS) for r in rec["tensors"]}, rec)
                  for sid, rec in req.sessions.items()}
        return {"imported": sorted(staged), "digests": self.adopt_sessions(staged)}

    def prepare_template(self, req: PrepareRequest) -> dict:
        """Weights out as chunks (those not known), then, unless ``release`` is false, parked."""
        from ckptflow.engines.chunkfiles import export_tensor

        tensors, written = [], 0
        for name, a in self.weight_arrays().items():
            rec, n = export_tensor(name, a, req.dir, req.chunk_bytes, req.known, threads=self.IO_THREADS)
            tensors.append(rec)
            written += n
        if req.release:
            self.release_weights()
            self.park(req.dir, tensors)
        return {"tensors": tensors, "written_bytes": written, "total_bytes": sum(t["nbytes"] for t in tensors)}

    def resume_template(self, req: ResumeRequest) -> dict:
        """Weights back, and ``req.sessions`` with them when given: every chunk of both is checked
        before anything changes (a torn one fails the call, named, and the engine stays parked)."""
        from ckptflow.engines.chunkfiles import import_tensor

        t0 = time.perf_counter()
        ws = {r["name"]: import_tensor(r, req.dir, threads=self.IO_THREADS) for r in req.tensors}
        staged = None if req.sessions is None else \
            {sid: ({r["name"]: import_tensor(r, req.dir, threads=self.IO_THREADS) for r in rec["tensors"]}, rec)
             for sid, rec in req.sessions.items()}
        self.adopt_weights(ws)
        self.parked_with = None
        out = {"loaded_bytes": sum(a.nbytes for a in ws.values())}
        if staged is not None:
            out |= {"imported": sorted(staged), "digests": self.adopt_sessions(staged)}
            out["loaded_bytes"] += sum(a.nbytes for arrays, _ in staged.values() for a in arrays.values())
        return out | {"seconds": round(time.perf_counter() - t0, 4)}


def routes(w: object) -> tuple[dict[str, Callable], dict[str, Callable]]:
    """The worker's own GET and POST tables (``GET_ROUTES``, ``POST_ROUTES``: path -> method
    name) plus the protocol's when it speaks it. GET handlers take no argument, POST handlers
    the JSON body.

    Raises:
        AttributeError: a declared route's method is missing (at start, not at the first call).
    """
    g, p = dict(getattr(w, "GET_ROUTES", {})), dict(getattr(w, "POST_ROUTES", {}))
    if isinstance(w, EngineSide) and w.SPEAKS_PROTOCOL:
        g[ENGINE_PATH] = "engine_info"
        p.update(PROTOCOL_POST)
    return ({path: getattr(w, name) for path, name in g.items()},
            {path: getattr(w, name) for path, name in p.items()})
