"""What ckptflow needs from a serving engine, in one interface, and the registry that the fleet
file's ``engine:`` value picks from.

An engine adapter says, for one engine: where its health answers, how its ``/metrics`` families
map onto WorkloadLoad, the golden request it answers deterministically, and how its sessions and
template leave and come back (ckptflow's two-tier protocol, docs/engines/protocol.md, or a
refusal naming what the engine offers instead). Adapters are registered by name, like cadence
policies; a fleet file naming an engine with no adapter is refused when it loads, naming the
known ones. docs/extending/engine-adapter.md walks through adding one.

Node-level like runners/: no Prefect here. The names live in ``registry.ENGINES`` (models.py
validates engine names there); the built-in adapters are imported on the registry's first lookup.

Example:
    >>> from ckptflow.engines.adapter import ConfigError, get_adapter, known_engines
    >>> known_engines()
    ['demo', 'llamacpp', 'other', 'sglang', 'vllm']
    >>> get_adapter("llamacpp").parse_metrics("llamacpp:requests_processing 2\\n").running
    2.0
    >>> try:
    ...     get_adapter("tgi")
    ... except ConfigError as e:
    ...     print(str(e).splitlines()[0])
    unknown engine 'tgi' (known: demo, llamacpp, other, sglang, vllm)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ckptflow.engines.protocol_http import EXPORT_TIMEOUT_S
from ckptflow.engines.protocol_http import call as _protocol_call
from ckptflow.errors import ConfigError, EngineProtocolError
from ckptflow.registry import ENGINES

# A chunk record whose bytes the engine checks on the GPU after the copy carries fingerprints of
# this scheme, one per chunk, and their key's seed (engines/gpuhash.py computes them). A record
# without it, or of another scheme (the key was once drawn from torch's host generator: same
# seed, other words), is checked by sha256: by the runner before a promotion, by the engine as
# the bytes come in.
GPU_FINGERPRINT_SCHEME = "nh128-splitmix64-v1"


def gpu_checkable(rec: dict) -> bool:
    """Whether a chunk record's bytes are checked on the GPU after the copy (see above)."""
    fps, chunks = rec.get("fingerprints"), rec.get("chunks") or []
    return (rec.get("fingerprint_scheme") == GPU_FINGERPRINT_SCHEME and "fingerprint_key" in rec
            and isinstance(fps, list) and len(fps) == len(chunks) and len(chunks) > 0)

if TYPE_CHECKING:
    from ckptflow.models import GoldenRequest, Workload
    from ckptflow.policies.load import Metric, WorkloadLoad

# The protocol's calls (docs/engines/protocol.md): the engine side is ckptflow/engines/engine_side.py.
INFO = "/v1/ckptflow/engine"
SESSIONS_EXPORT = "/v1/ckptflow/sessions/export"
SESSIONS_IMPORT = "/v1/ckptflow/sessions/import"
TEMPLATE_PREPARE = "/v1/ckptflow/template/prepare"
TEMPLATE_RESUME = "/v1/ckptflow/template/resume"


class EngineAdapter:
    """One engine as ckptflow sees it. Subclass, set the class attributes, override what the
    engine does differently, and ``@register`` the class.

    The defaults speak ckptflow's two-tier protocol over HTTP on the engine's own address
    (engines/protocol_http.py ``call``); an engine without it sets ``protocol = None`` and its
    session/template calls are refused with ``no_protocol_fix``.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # WorkloadLoad field (or "request_duration", a histogram) -> its families, newest first.
    # Empty: the engine's /metrics cannot be read, and declaring a metrics_url is refused.
    metrics: ClassVar[Mapping[str, Metric]] = {}
    health_path: ClassVar[str] = "/health"
    protocol: ClassVar[int | None] = 1          # ckptflow protocol version served (None: none)
    no_protocol_fix: ClassVar[str] = "use checkpoint: process (the whole worker) for this engine"
    # An engine that could serve the protocol but answered 404: how to start it so that it does.
    protocol_missing_fix: ClassVar[str] = "use the whole-process checkpoint for engines without the protocol"

    # --- pure parts: no engine needed ------------------------------------------------------
    def parse_metrics(self, text: str) -> WorkloadLoad:
        """The engine's /metrics body as a WorkloadLoad (prometheus_client's parser).

        Raises:
            ValueError: the adapter has no mapping, or the text is not Prometheus exposition.
        """
        from ckptflow.policies.load import parse_mapped

        if not self.metrics:
            raise ValueError(f"engine {self.name!r} has no metrics mapping")
        return parse_mapped(self.metrics, text)

    def health_url(self, base: str) -> str:
        return base.rstrip("/") + self.health_path

    def golden_request(self, base: str, **kw: Any) -> GoldenRequest | None:
        """A request the engine answers the same way every time (greedy, no cache shared with
        a session), for comparing a restored worker with its original; None: no such request."""
        return None

    # --- the engine's own calls (runners/engine.py does the HTTP) ---------------------------
    def _call(self, w: Workload, path: str, body: dict | None, timeout_s: float = EXPORT_TIMEOUT_S,
              **where: Any) -> dict:
        if self.protocol is None:
            raise EngineProtocolError(f"workload {w.name}: engine {self.name} does not speak ckptflow's "
                                      f"two-tier protocol ({path})", fix=self.no_protocol_fix)
        return _protocol_call(w, path, body, timeout_s, missing_fix=self.protocol_missing_fix, **where)

    def info(self, w: Workload, **where: Any) -> dict:
        """``{"protocol", "engine", "model", "template_key", "parked", "sessions", ...}``."""
        return self._call(w, INFO, None, timeout_s=where.pop("timeout_s", 10), **where)

    def export_sessions(self, w: Workload, dir: str, known: Mapping[str, list[str]],
                        sessions: list[str] | None = None, **where: Any) -> dict:
        """The sessions' state as chunks into ``dir`` (those not ``known``); ``{"sessions": {sid: record}}``."""
        body: dict = {"dir": dir, "known": dict(known)}
        if sessions is not None:
            body["sessions"] = list(sessions)
        return self._call(w, SESSIONS_EXPORT, body, **where)

    def import_sessions(self, w: Workload, dir: str, records: Mapping[str, dict], **where: Any) -> dict:
        """Sessions back from their records (all or nothing); ``{"imported", "digests"}``."""
        return self._call(w, SESSIONS_IMPORT, {"dir": dir, "sessions": dict(records)}, **where)

    def template_prepare(self, w: Workload, dir: str, known: list[str], **where: Any) -> dict:
        """Weights out as chunks into ``dir``, then weights and sessions released (parked)."""
        return self._call(w, TEMPLATE_PREPARE, {"dir": dir, "known": list(known)}, **where)

    def template_adopt(self, w: Workload, dir: str, tensors: list[dict], **where: Any) -> dict:
        """Weights back from their records; the engine serves again (protocol: template/resume)."""
        return self._call(w, TEMPLATE_RESUME, {"dir": dir, "tensors": list(tensors)}, **where)


A = TypeVar("A", bound=type[EngineAdapter])
# The registry's own dict (registry.ENGINES, which models.py and fleet.py validate names against):
# each built-in module registers its adapter on import, and the registry imports them on its first
# lookup; a new built-in engine is one more name in registry.py.
ADAPTERS: dict[str, EngineAdapter] = ENGINES.entries


def register(cls: A) -> A:
    """Register an adapter class under its ``name`` (a later registration of a name replaces it)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: an engine adapter needs a name")
    ENGINES.add(cls.name, cls())
    return cls


def known_engines() -> list[str]:
    return ENGINES.known()


def get_adapter(name: object) -> EngineAdapter:
    """The adapter registered as ``name`` (an engine name or a Workload's ``engine``).

    Raises:
        ConfigError: no adapter of that name, naming the known ones.
    """
    key = str(getattr(name, "value", name))
    adapter = ENGINES.loaded().get(key)
    if adapter is None:
        raise ConfigError(ENGINES.unknown(key),
                          fix="declare one of the known engines, or register an adapter for it "
                              "(docs/extending/engine-adapter.md)")
    return adapter


def check_engine(name: str) -> str:
    """``name`` if an adapter is registered for it (models.py validates ``engine:`` with ``registry.ENGINES``).

    Raises:
        ValueError: one line naming the known engines.
    """
    return ENGINES.check(name)


@register
class OtherAdapter(EngineAdapter):
    """An engine ckptflow has no adapter for: checkpointed whole, or through the two-tier
    protocol if it serves it (a plugin; ``info`` says which version). Its /metrics is not read:
    ckptflow does not know its metric names (it used to parse them as vLLM's)."""

    name = "other"
    summary = "an engine without an adapter: health, golden request, the protocol if served; no metrics"
