"""The fleet file: ``deployments/<fleet>.yaml``, validated by pydantic.

Example (``deployments/local.yaml``)::

    fleet: local
    storage: {kind: local, path: ../.ckptflow/store}      # relative paths: to this file's directory
    nodes:
      - {name: local, work_pool: local, gpu_class: cpu, mtbf_hours: 6000}
    workloads:
      - name: demo-chat
        node: local
        find: {pid_file: ../.ckptflow/run/demo-chat.pid, cmdline_must_contain: ckptflow.demo.worker}
        engine: vllm
        traffic: long_sessions
    policies:
      - {match: {traffic: long_sessions}, policy: cost-based, params: {min_interval_s: 60}}

Errors name the file, the YAML path (``workloads[3].metrics_url``), its line, and what was
expected; every problem of the file in one report. A misspelt policy parameter, say::

    ConfigError: deployments/local.yaml: policies[0].params.min_intervl_s (line 35): policy cost-based
    has no parameter 'min_intervl_s' (its parameters: min_interval_s, max_interval_s, short_request_s,
    burst_factor, maintenance_lead_s); did you mean 'min_interval_s'?

A relative path in the file (``storage.path``, ``find.pid_file``, a container's ``rootfs`` and
mount sources) is relative to the file's directory, wherever the command runs; load_fleet
returns them absolute.
"""

from __future__ import annotations

import os

from datetime import datetime
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, Literal

from functools import lru_cache

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator, model_validator

from ckptflow.container_models import url_problem
from ckptflow.errors import ConfigError
from ckptflow.models import EngineField, Name, TrafficClass, Workload, did_you_mean
from ckptflow.policies.cadence import PolicyParams
from ckptflow.policies.retention import Retention
from ckptflow.registry import CADENCE_POLICIES, ENGINES, GPU_BACKENDS, STORAGE_KINDS


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~10x faster on a 1,000-workload file


class StorageKind(str, Enum):
    """The built-in ``storage.kind`` names; a kind registered with ``ckptflow.store.register_tier``
    (docs/extending/storage-tier.md) is accepted too, as a member made on first use."""

    local = "local"
    s3 = "s3"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str) and value in STORAGE_KINDS.loaded():
            member = str.__new__(cls, value)
            member._name_, member._value_ = value, value
            return member
        return None


class Storage(BaseModel):
    """Where checkpoint images and manifests live."""

    model_config = ConfigDict(extra="forbid")

    kind: StorageKind = Field(StorageKind.local, description="local directory, S3-compatible bucket, or a tier "
                              "kind registered with ckptflow.store.register_tier")
    path: str = Field(".ckptflow/store", description="Root directory for kind=local; a relative one is "
                      "relative to the fleet file's directory.", examples=["../.ckptflow/store",
                                                                          "/var/lib/ckptflow/{node}"])
    bucket: str | None = Field(None, description="Bucket for kind=s3.", examples=["ckpt-prod"])
    prefix: str = Field("ckptflow", description="Key prefix inside the bucket.")
    endpoint_url: str | None = Field(None, description="S3 endpoint (omit for AWS).",
                                     examples=["http://127.0.0.1:8333"])
    region: str | None = Field(None, description="S3 region.")
    server_side_encryption: str | None = Field("AES256", description="SSE mode passed to S3; null to disable.")
    encryption_key_env: str | None = Field(
        None, description="Env var holding a base64 32-byte key: chunks are then encrypted on the node "
        "(AES-256-GCM) before upload.", examples=["CKPTFLOW_CHUNK_KEY"])
    encryption_key_block: str | None = Field(
        None, description="Prefect Secret block holding that key instead of an env var.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Settings of a registered tier kind that the fields above do not "
        "cover; its opener reads (and checks) them.", examples=[{"project": "ml-prod"}])

    @field_validator("kind", mode="before")
    @classmethod
    def _registered_kind(cls, v: Any) -> Any:
        # The enum's own message would name only the built-in kinds.
        if isinstance(v, str) and v not in STORAGE_KINDS:
            raise ValueError(f"{STORAGE_KINDS.unknown(v)}; a new kind is registered with ckptflow.store.register_tier "
                             "(docs/extending/storage-tier.md)")
        return v

    @model_validator(mode="after")
    def _bucket_for_s3(self) -> "Storage":
        if self.kind == StorageKind.s3 and not self.bucket:
            raise ValueError("storage.kind is s3 but no bucket is given")
        return self


class MaintenanceWindow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start: datetime = Field(..., description="Start, ISO 8601 with time zone.", examples=["2026-12-01T02:00:00Z"])
    end: datetime = Field(..., description="End, ISO 8601 with time zone.")
    announced: datetime | None = Field(None, description="When the window was announced.")

    @model_validator(mode="after")
    def _ordered(self) -> "MaintenanceWindow":
        if self.end <= self.start:
            raise ValueError(f"end {self.end.isoformat()} is not after start {self.start.isoformat()}")
        if self.start.tzinfo is None or self.end.tzinfo is None:
            raise ValueError("start and end need a time zone, e.g. 2026-12-01T02:00:00Z")
        return self


class Node(BaseModel):
    """A GPU node with its own Prefect process work pool."""

    model_config = ConfigDict(extra="forbid")

    name: Name = Field(..., description="Node name.", examples=["gpu-node-01"])
    work_pool: str = Field(..., min_length=1, description="Prefect work pool of this node's worker.")
    gpu_class: str = Field("cpu", description="GPU model class for placement (same class restores).",
                           examples=["H200-141GB"])
    gpus: int = Field(0, ge=0, description="GPUs on the node.")
    gpu_memory_gib: float = Field(0, ge=0, description="Memory per GPU.")
    gpu_backend: str = Field("cuda", description="GPU backend that checkpoints the node's GPU workers, by registered "
                             "name (runners/gpu: cuda).", examples=["cuda"])
    mtbf_hours: float | None = Field(None, gt=0, description="Mean time between failures of the node.")
    failures: list[datetime] = Field(default_factory=list,
                                     description="Observed failure times (MTBF is estimated from them).")
    maintenance: list[MaintenanceWindow] = Field(default_factory=list)

    @field_validator("gpu_backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        # The registry imports no driver (each backend loads its own at its first step).
        return GPU_BACKENDS.check(v)


class PolicyMatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    labels: dict[str, str] = Field(default_factory=dict, description="All must equal the workload's labels.")
    engine: EngineField | None = None
    traffic: TrafficClass | None = None

    def matches(self, w: Workload) -> bool:
        return ((self.engine is None or w.engine == self.engine)
                and (self.traffic is None or w.traffic == self.traffic)
                and all(w.labels.get(k) == v for k, v in self.labels.items()))


class OnWorkerGone(StrEnum):
    alert = "alert"       # say so and alert; an operator (or a recover deployment) brings it back
    recover = "recover"   # also restore it from its newest valid checkpoint, in the same heartbeat run


class PolicyRule(BaseModel):
    """First matching rule wins; the policy is chosen by name (see ckptflow.policies).

    ``params`` are validated against the named policy's own model (``CADENCE_POLICIES.get(name).params``):
    an unknown key or a bad value is reported at ``policies[i].params.<key>`` with its line.
    """

    model_config = ConfigDict(extra="forbid")

    match: PolicyMatch = Field(default_factory=PolicyMatch)
    policy: str = Field(..., description="Registered policy name.", examples=["cost-based", "never", "fixed"])
    params: SerializeAsAny[PolicyParams] = Field(
        default_factory=PolicyParams, description="Parameters of the policy, checked against its model "
        "(CostBasedParams, FixedParams, NeverParams).", examples=[{"min_interval_s": 300}])
    on_worker_gone: OnWorkerGone = Field(
        OnWorkerGone.alert, description="When a heartbeat finds the worker's process gone: alert only, or "
        "alert and recover it from its newest valid checkpoint in the same heartbeat run.",
        examples=["recover"])

    @model_validator(mode="before")
    @classmethod
    def _typed_params(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("policy"), str):
            return data  # the schema reports a missing or non-string policy
        chosen = CADENCE_POLICIES.get(data["policy"])
        if chosen is None:
            raise _PathErrors([(("policy",), CADENCE_POLICIES.unknown(data["policy"]))])
        try:
            params = chosen.parse(data.get("params", {}))
        except ValidationError as e:
            raise _PathErrors([(("params", *err["loc"]), _param_problem(chosen, err)) for err in e.errors()]) from None
        return {**data, "params": params}


def _param_problem(chosen, err: dict) -> str:
    if err["type"] == "extra_forbidden":
        known = ", ".join(chosen.params.model_fields) or "none"
        return (f"policy {chosen.name} has no parameter {err['loc'][-1]!r} (its parameters: {known})"
                + did_you_mean(str(err["loc"][-1]), list(chosen.params.model_fields)))
    return err["msg"].removeprefix("Value error, ")


class Schedule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    interval_s: int | None = Field(None, gt=0, description="Run every N seconds.")
    cron: str | None = Field(None, description="Cron expression (UTC).", examples=["*/5 * * * *"])

    @model_validator(mode="after")
    def _one(self) -> "Schedule":
        if (self.interval_s is None) == (self.cron is None):
            raise ValueError("give exactly one of interval_s or cron")
        # Prefect checks the expression only when `ckptflow deploy` creates the schedule: a field
        # missing there failed the deploy, long after the file was written.
        if self.cron is not None and not self.cron.startswith("@") and len(self.cron.split()) not in (5, 6):
            raise ValueError(f"cron {self.cron!r} has {len(self.cron.split())} fields; a cron expression has 5 "
                             "(minute hour day-of-month month day-of-week), e.g. '*/5 * * * *'")
        return self


class Slack(BaseModel):
    model_config = ConfigDict(extra="forbid")

    webhook_url_env: str | None = Field(None, description="Env var holding an incoming-webhook URL.")
    token_env: str | None = Field(None, description="Env var holding a bot token.")
    secret_block: str | None = Field(None, description="Prefect Secret block holding the webhook URL or token.")
    channel: str | None = Field(None, description="Channel for bot-token posting.", examples=["#gpu-oncall"])
    base_url: str | None = Field(None, description="Slack API base URL (tests point it at a local server).")


# Prefect's default worker poll, 10 s, was most of a migrate's downtime: the target's step
# waited for its worker's next poll. 1 s costs one small query per node per second on the server.
WORKER_QUERY_S = 1.0


def _declared(name: str, names: list[str], most: int = 8) -> str:
    """What an unknown name could have been, in one line: every declared name while they are few,
    else the closest ones and how many there are (a fleet of 64 workloads is not one line).

        >>> _declared("vllm-n1-g0", [f"vllm-n{n:02d}-g{g}" for n in range(1, 9) for g in range(8)])
        'declared: 64, closest: vllm-n01-g0, vllm-n08-g0, vllm-n07-g0'
        >>> _declared("x", ["a", "b"]), _declared("x", [])
        ('declared: a, b', 'declared: none')
    """
    if len(names) <= most:
        return f"declared: {', '.join(names) or 'none'}"
    import difflib

    close = difflib.get_close_matches(name, names, n=3, cutoff=0.0)
    return f"declared: {len(names)}, closest: {', '.join(close)}"


class Fleet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fleet: Name = Field(..., description="Fleet name.")
    storage: Storage = Field(default_factory=Storage)
    nodes: list[Node] = Field(..., min_length=1)
    workloads: list[Workload] = Field(default_factory=list)
    policies: list[PolicyRule] = Field(default_factory=list)
    schedules: dict[Literal["heartbeat", "invalidate", "verify", "recover", "prune"], Schedule] = Field(
        default_factory=dict)
    slack: Slack | None = None
    retention: Retention = Field(default_factory=Retention, description="Which checkpoints to keep.")
    prefect_ui_url: str | None = Field(None, description="Base URL of the Prefect UI, for links in alerts.")
    control_pool: str | None = Field(
        None, min_length=1, description="Work pool of the fleet-level flows (migrate, drain, recover, "
        "recover-node). Default: the first node's pool. Give it a worker off the GPU nodes, so "
        "recover-node still runs when any node is lost.", examples=["ckptflow-control"])
    worker_query_seconds: float = Field(
        WORKER_QUERY_S, gt=0, le=60, description="How often each node's Prefect worker asks the server for flow "
        "runs: PREFECT_WORKER_QUERY_SECONDS in the units and DaemonSets `ckptflow deploy` renders "
        "(`--worker-query-seconds` overrides it). A fleet flow's node step waits up to this long to start.",
        examples=[1.0, 5])

    @model_validator(mode="after")
    def _references(self) -> "Fleet":
        problems = cross_field_problems(self.model_dump(include=_CROSS_FIELDS))
        if problems:
            raise _PathErrors(problems)
        return self

    def workload(self, name: str) -> Workload:
        for w in self.workloads:
            if w.name == name:
                return w
        raise ConfigError(f"fleet {self.fleet}: no workload named {name!r} "
                          f"({_declared(name, [w.name for w in self.workloads])})",
                          fix="name a declared workload, or declare it under workloads: in the fleet file")

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"fleet {self.fleet}: no node named {name!r} "
                          f"({_declared(name, [n.name for n in self.nodes])})",
                          fix="name a declared node, or declare it under nodes: in the fleet file")

    def gpu_backend(self, node: str | None) -> str | None:
        """The GPU backend ``node`` declares (``nodes[].gpu_backend``); None for no node or an
        undeclared one (the runner then takes the default, ``cuda``)."""
        return next((n.gpu_backend for n in self.nodes if n.name == node), None)

    def rule_for(self, w: Workload) -> PolicyRule | None:
        return next((r for r in self.policies if r.match.matches(w)), None)

    def policy_choice(self, w: Workload) -> "PolicyChoice":
        """``w`` with the policy its first matching rule names (cost-based with its defaults when
        no rule matches)."""
        rule = self.rule_for(w)
        if rule is None:
            return PolicyChoice(workload=w, policy=DEFAULT_POLICY,
                                params=CADENCE_POLICIES.lookup(DEFAULT_POLICY).defaults)
        return PolicyChoice(workload=w, policy=rule.policy, params=rule.params, on_worker_gone=rule.on_worker_gone)

    def scope(self) -> "FleetScope":
        """The fleet-wide part a node step needs, without the node and workload lists."""
        return FleetScope(fleet=self.fleet, storage=self.storage, slack=self.slack, retention=self.retention,
                          prefect_ui_url=self.prefect_ui_url,
                          gpu_backends={n.name: n.gpu_backend for n in self.nodes})


DEFAULT_POLICY = "cost-based"  # for a workload no rule matches


class FleetScope(BaseModel):
    """Where a fleet's checkpoints live and where its alerts go: what a task needs of the fleet
    besides its own node and workloads. A flow resolves the fleet file once (placements
    included) and passes tasks this small value instead of the file's path."""

    model_config = ConfigDict(frozen=True)

    fleet: Name = Field(..., description="Fleet name.")
    storage: Storage = Field(default_factory=Storage)
    slack: Slack | None = None
    retention: Retention = Field(default_factory=Retention)
    prefect_ui_url: str | None = None
    gpu_backends: dict[str, str] = Field(
        default_factory=dict, description="Node -> the GPU backend it declares (nodes[].gpu_backend): the node "
        "runner a task builds for a node uses it.", examples=[{"gpu-node-01": "cuda"}])

    def gpu_backend(self, node: str | None) -> str | None:
        """As ``Fleet.gpu_backend``: None for no node or one this scope does not list."""
        return self.gpu_backends.get(node) if node else None


class PolicyChoice(BaseModel):
    """One workload, on the node it runs on now, with the policy its fleet rule chose."""

    model_config = ConfigDict(frozen=True)

    workload: Workload
    policy: str = Field(DEFAULT_POLICY, description="Registered policy name.")
    params: SerializeAsAny[PolicyParams] = Field(default_factory=PolicyParams)
    on_worker_gone: OnWorkerGone = Field(OnWorkerGone.alert, description="See PolicyRule.on_worker_gone.")


class _PathErrors(ValueError):
    """Every cross-field problem of a fleet, each with its YAML path, raised at once."""

    def __init__(self, problems: list[tuple[tuple, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{format_path(p)}: {m}" for p, m in problems))


# URL fields an engine client or the alerter will open: without a scheme and a host they only
# fail later, at the first heartbeat, as an unreadable "no KV growing" or a silent probe error.
_WORKLOAD_URLS = ("health_url", "metrics_url", "probe_url", "prepare_url", "resume_url")
_CROSS_FIELDS = {"nodes": {"__all__": {"name", "gpus", "gpu_class", "work_pool"}},
                 "workloads": {"__all__": {"name", "node", "golden", "find", "engine", "gpu", "tensor_parallel",
                                           "container", *_WORKLOAD_URLS}},
                 "storage": {"endpoint_url", "path", "encryption_key_env", "encryption_key_block"},
                 "slack": {"base_url", "webhook_url_env", "token_env", "secret_block", "channel"}, "prefect_ui_url": True}
# Fields that name one worker: two workloads declaring the same one would checkpoint, probe or
# restore each other's process (a loopback URL or a pid file is per node).
_ONE_WORKER = (("health_url",), ("metrics_url",), ("probe_url",), ("find", "pid_file"), ("find", "systemd_unit"),
               ("container", "name"), ("container", "kubernetes"))
STORAGE_PLACEHOLDERS = ("node",)  # what open_store fills into storage.path
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0")
EVERY_FIELD = "deployments/example-every-field.yaml"  # a fleet file that sets every field: what a config error points to


def _url_problem(value: object) -> str | None:
    return url_problem(value) if isinstance(value, str) else None  # a wrong type is the schema's error


def _workload_urls(w: dict) -> list[tuple[tuple, object]]:
    """(field path, value) of every URL a workload declares, its golden request's included."""
    urls: list[tuple[tuple, object]] = [((k,), w.get(k)) for k in _WORKLOAD_URLS]
    if isinstance(w.get("golden"), dict):
        urls.append((("golden", "url"), w["golden"].get("url")))
    return urls


def _loopback_port(url: object) -> int | None:
    """The port of a loopback URL (one server of its node), None for another host, no port or a bad
    URL (that one is reported as a bad URL)."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url) if isinstance(url, str) else None
        return u.port if u is not None and (u.hostname or "") in _LOOPBACK else None
    except ValueError:
        return None


def cross_field_problems(data: dict) -> list[tuple[tuple, str]]:
    """Problems no single field shows: duplicate names, unknown references, unusable URLs.

    Works on the raw parsed YAML as well as on a dumped Fleet, so that a file with schema errors
    still gets these reported in the same run; any shape it does not expect is skipped (the
    schema reports that).
    """
    def items(key: str) -> list[tuple[int, dict]]:
        v = data.get(key)
        return [(i, x) for i, x in enumerate(v) if isinstance(x, dict)] if isinstance(v, list) else []

    out: list[tuple[tuple, str]] = []
    nodes = [n.get("name") for _, n in items("nodes")]
    for where in ("nodes", "workloads"):
        seen: set = set()
        for i, x in items(where):
            name = x.get("name")
            if not isinstance(name, str):
                continue  # the schema names a missing or non-string name
            if name in seen:
                out.append(((where, i, "name"), f"duplicate name {name!r}"))
            seen.add(name)
    declared = ", ".join(str(n) for n in nodes if isinstance(n, str))
    for i, w in items("workloads"):
        node = w.get("node")
        if isinstance(node, str) and node not in nodes:
            out.append((("workloads", i, "node"), f"node {node!r} is not declared in nodes (declared: {declared})"))
        out += [(("workloads", i, *k), why) for k, v in _workload_urls(w) if (why := _url_problem(v))]
    out += _shared_worker_problems(items("workloads"))  # a checkpoint mode's own refusals: ckptflow.modes
    out += _port_problems(items("workloads"))
    out += _pool_problems(items("nodes"))
    out += _gpu_problems(items("nodes"), items("workloads"))
    out += _engine_problems(items("workloads"))
    out += _storage_key_problems(data.get("storage"))
    out += _slack_problems(data.get("slack"))
    storage = data.get("storage")
    if isinstance(storage, dict) and isinstance(storage.get("path"), str):
        import string

        try:
            names = [f for _, f, _, _ in string.Formatter().parse(storage["path"]) if f is not None]
        except ValueError as e:
            names, why = [], f"{storage['path']!r} has an unmatched brace ({e})"
            out.append((("storage", "path"), why))
        unknown = [f for f in names if f not in STORAGE_PLACEHOLDERS]
        if unknown:
            out.append((("storage", "path"), f"unknown placeholder {{{unknown[0]}}} in {storage['path']!r} (known: "
                        + ", ".join(f"{{{k}}}" for k in STORAGE_PLACEHOLDERS) + ")"))
    for loc, section, key in ((("storage", "endpoint_url"), data.get("storage"), "endpoint_url"),
                              (("slack", "base_url"), data.get("slack"), "base_url"),
                              (("prefect_ui_url",), data, "prefect_ui_url")):
        if isinstance(section, dict) and (why := _url_problem(section.get(key))):
            out.append((loc, why))
    return out


def _engine_problems(workloads: list[tuple[int, dict]]) -> list[tuple[tuple, str]]:
    """A metrics_url on an engine whose adapter has no metrics mapping: its load would be unreadable
    (ckptflow once parsed it as vLLM's). An unknown engine name is the schema's error."""
    out, known = [], ENGINES.known()  # the built-in adapters are registered from here on
    ADAPTERS = ENGINES.entries
    for i, w in workloads:
        adapter = ADAPTERS.get(str(getattr(w.get("engine"), "value", w.get("engine") or "other")))
        if adapter is not None and not adapter.metrics and w.get("metrics_url"):
            engine, mapped = adapter.name, ", ".join(n for n in known if ADAPTERS[n].metrics)
            out.append((("workloads", i, "metrics_url"), f"engine: {engine} has no metrics mapping, so its "
                        f"/metrics cannot be read: declare the engine ({mapped}) or drop metrics_url"))
    return out


def _port_problems(workloads: list[tuple[int, dict]]) -> list[tuple[tuple, str]]:
    """A container's published host port that another workload of its node also claims: published by
    another container, or the port another workload's loopback URL serves on. The restore would fail
    to publish it (``bind: address already in use``), or one worker's traffic would reach the other."""
    claims: dict[tuple, tuple[tuple, str]] = {}   # (node, port) -> (where, what claims it)
    out: list[tuple[tuple, str]] = []
    for i, w in workloads:
        node, name = w.get("node"), w.get("name")
        if not isinstance(node, str):
            continue
        for k, url in _workload_urls(w):
            if not (port := _loopback_port(url)):
                continue
            held = claims.setdefault((node, port), (("workloads", i, *k), f"the {'.'.join(k)} of workloads[{i}] "
                                                                          f"({name!r})"))
            # One loopback port of a node is one server: a golden request, probe or prepare call
            # to another workload's port would check or hold that worker instead of this one.
            if held[0][1] != i:
                out.append((("workloads", i, *k), f"{url!r} is on port {port} of node {node!r}, which is "
                            f"{held[1]}: it would reach that worker; point it at this workload's own port"))
    for i, w in workloads:
        c, node, name = w.get("container"), w.get("node"), w.get("name")
        ports = c.get("ports") if isinstance(c, dict) else None
        if not isinstance(ports, list) or not isinstance(node, str):
            continue
        published = {pm.get("host") for pm in ports if isinstance(pm, dict)}
        for k in _WORKLOAD_URLS:   # a container answers on its published ports only
            if (port := _loopback_port(w.get(k))) and port not in published:
                out.append((("workloads", i, k), f"{w[k]!r} is on host port {port}, which container "
                            f"{c.get('name')!r} does not publish (ports: "
                            f"{', '.join(str(p) for p in sorted(x for x in published if isinstance(x, int)))}): "
                            "its health check would time out; publish it, or point the URL at a published port"))
        for j, pm in enumerate(ports):
            port = pm.get("host") if isinstance(pm, dict) else None
            if not isinstance(port, int):
                continue
            where = ("workloads", i, "container", "ports", j, "host")
            held = claims.get((node, port))
            if held is not None and held[0][1] != i:
                out.append((where, f"host port {port} on node {node!r} is also {held[1]}: published here, "
                            "the restore could not bind it; give each workload its own port"))
            else:
                claims[(node, port)] = (where, f"published by workloads[{i}] ({name!r}).container.ports[{j}]")
    return out


def _pool_problems(nodes: list[tuple[int, dict]]) -> list[tuple[tuple, str]]:
    """Two nodes on one work pool. A node step runs on whichever worker of the pool polls first, so
    one node's heartbeat would look for its workloads on the other node: found gone there, alerted
    as lost, and with ``on_worker_gone: recover`` restored onto the wrong machine."""
    out: list[tuple[tuple, str]] = []
    seen: dict[str, tuple[int, str]] = {}
    for i, n in nodes:
        pool = n.get("work_pool")
        if not isinstance(pool, str) or not pool:
            continue  # the schema's
        if pool in seen:
            j, other = seen[pool]
            out.append((("nodes", i, "work_pool"), f"work pool {pool!r} is also the work_pool of nodes[{j}] ({other!r}): "
                        f"a node step for either could run on the other's worker; give node {n.get('name')!r} a pool "
                        "of its own (each node runs one worker on its own pool)"))
        else:
            seen[pool] = (i, str(n.get("name")))
    return out


def _storage_key_problems(storage: object) -> list[tuple[tuple, str]]:
    """Both places for the chunk key: the tasks would read the block and ignore the variable, so
    a node holding only the variable's key would write chunks another node cannot read."""
    if isinstance(storage, dict) and storage.get("encryption_key_env") and storage.get("encryption_key_block"):
        return [(("storage", "encryption_key_block"), f"both encryption_key_env ({storage['encryption_key_env']!r}) "
                 f"and encryption_key_block ({storage['encryption_key_block']!r}) are set; the chunk key comes from "
                 "one place: keep one of them")]
    return []


def _slack_problems(slack: object) -> list[tuple[tuple, str]]:
    """A slack block that can send nothing: every alert would be logged as unsent, and the on-call
    channel would never hear of a failed restore."""
    if not isinstance(slack, dict):
        return []
    if not any(slack.get(k) for k in ("webhook_url_env", "token_env", "secret_block")):
        return [(("slack",), "no webhook_url_env, token_env or secret_block is set, so no alert can be sent; set one "
                 "(e.g. webhook_url_env: CKPTFLOW_SLACK_WEBHOOK), or drop the slack block")]
    if slack.get("token_env") and not slack.get("webhook_url_env") and not slack.get("channel"):
        return [(("slack", "channel"), f"token_env ({slack['token_env']!r}) posts as a bot, which needs a channel; "
                 "set channel (e.g. '#gpu-oncall')")]
    return []


def _gpu_problems(nodes: list[tuple[int, dict]], workloads: list[tuple[int, dict]]) -> list[tuple[tuple, str]]:
    """A GPU workload on a node that declares no GPU (gpus: 0 and gpu_class: cpu, as written or by
    default): recover-node would place it on CPU nodes, and the memory gate would have no GPU to
    check. And tensor-parallel ranks that outnumber the GPUs its node declares: each rank holds a
    GPU of its own, and a restore would find none for the rest."""
    gpus = {n["name"]: n.get("gpus") for _, n in nodes if isinstance(n.get("name"), str)}  # others: the schema's
    cpu_only = {n["name"] for _, n in nodes if isinstance(n.get("name"), str)
                and not n.get("gpus") and n.get("gpu_class", "cpu") == "cpu"}
    out: list[tuple[tuple, str]] = []
    for i, w in workloads:
        node = w.get("node")
        if w.get("gpu") is True and node in cpu_only:
            out.append((("workloads", i, "gpu"), f"workloads[{i}] ({w.get('name')!r}) is gpu: true, but its node "
                        f"{node!r} declares no GPU (gpus: 0, gpu_class: cpu); declare the node's gpus and gpu_class "
                        "(e.g. gpus: 8, gpu_class: H200-141GB), place the workload on a GPU node, or drop gpu: true"))
            continue
        have, need = gpus.get(node) if isinstance(node, str) else None, w.get("tensor_parallel") or 1
        if w.get("gpu") and isinstance(have, int) and have > 0 and isinstance(need, int) and need > have:
            out.append((("workloads", i, "tensor_parallel"), f"tensor_parallel {need} needs {need} GPUs, but its node "
                        f"{w.get('node')!r} declares gpus: {have}; lower tensor_parallel or place it on a node with "
                        f"{need} GPUs"))
    return out


def _shared_worker_problems(workloads: list[tuple[int, dict]]) -> list[tuple[tuple, str]]:
    """A health, metrics or probe URL, pid file or systemd unit declared by two workloads. Loopback
    URLs, pid files and units are per node: the same one on two nodes is two workers."""
    from urllib.parse import urlsplit

    out: list[tuple[tuple, str]] = []
    seen: dict[tuple, tuple[int, str]] = {}
    for i, w in workloads:
        if not isinstance(w.get("node"), (str, type(None))):
            continue  # the schema reports the node; without one there is no per-node key
        for path in _ONE_WORKER:
            v: object = w
            for part in path:
                v = v.get(part) if isinstance(v, dict) else None
            if path == ("container", "kubernetes") and isinstance(v, dict):   # a pod's container, cluster-wide
                v = "/".join(str(v.get(k)) for k in ("namespace", "pod", "container"))
            if not isinstance(v, str) or not v:
                continue
            key: tuple = (path, v)
            if path == ("find", "pid_file"):   # ./x.pid, a/../x.pid and the absolute path are one file
                key = (path, w.get("node"), os.path.abspath(v))
            elif path[0] == "find" or path == ("container", "name"):   # a name is per node
                key = (path, w.get("node"), v)
            else:
                try:
                    if (urlsplit(v).hostname or "") in _LOOPBACK:
                        key = (path, w.get("node"), v.replace("localhost", "127.0.0.1", 1))
                except ValueError:
                    continue  # reported as a bad URL
            if key in seen:
                j, name = seen[key]
                out.append((("workloads", i, *path), f"{v!r} is also the {'.'.join(path)} of workloads[{j}] ({name!r}): "
                            "two workloads would act on one worker; give each workload its own"))
            else:
                seen[key] = (i, str(w.get("name")))
    return out


def format_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _line_of(root: yaml.Node | None, loc: tuple) -> int | None:
    """1-based line of the YAML node at ``loc`` (or of its nearest existing parent)."""
    node, line = root, (root.start_mark.line + 1 if root else None)
    for part in loc:
        nxt = None
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            nxt = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
            if nxt is None:
                break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        else:
            break
        node, line = nxt, nxt.start_mark.line + 1
    return line


def _located(path: Path, loc: tuple, line: int | None, msg: str, missing: bool) -> str:
    """One problem's line. A missing field has no line of its own: the line is where the mapping
    that lacks it starts (a top-level ``fleet:`` missing was reported at the first key's line, as if
    that key were wrong)."""
    if missing and line:
        where = "the top-level mapping" if len(loc) == 1 else "the mapping"
        return f"{path}: {format_path(loc)}: {msg} (add it to {where} at line {line})"
    return f"{path}: {format_path(loc)}" + (f" (line {line})" if line else "") + f": {msg}"


def load_fleet(path: Path | str) -> Fleet:
    """Read and validate a fleet file; its relative paths (``storage.path``, ``find.pid_file``,
    a container's ``rootfs``, ``mounts[].source``, ``kubelet_ca``, ``token_file``) come back
    absolute, relative to the file's directory: ``cd /tmp && ckptflow heartbeat /srv/f.yaml``
    finds the same worker as a run beside it.

    Raises:
        ConfigError: naming the file, each bad field's YAML path and line, and what was expected.
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        # deployments/ exists only in a checkout: a node installed from a wheel, or a Prefect
        # worker whose directory is not the project's, needs the path it was given explained.
        where = "" if path.is_absolute() else f" (a relative path is read from {Path.cwd()})"
        raise ConfigError(f"{path}: fleet file not found{where}",
                          fix="pass the fleet file's path; examples are deployments/*.yaml in ckptflow's "
                              "repository (deployments/local.yaml is the demo's)") from None
    if not path.is_file():  # a directory read as YAML fails in open() with a bare IsADirectoryError
        raise ConfigError(f"{path}: is a directory, not a fleet file",
                          fix=f"pass a fleet file, e.g. {path / 'local.yaml'}" if (path / "local.yaml").is_file()
                          else "pass a fleet file, e.g. deployments/local.yaml")
    resolved = path.resolve()
    # Every node-batch task of a tick reads the same file: parse it once per version of it.
    fleet = _load(str(resolved), st.st_mtime_ns, st.st_size, str(path)).model_copy(deep=True)
    return relative_to_file(fleet, resolved.parent)


def _under(base: Path, value: str | None) -> str | None:
    """``value`` as the fleet file means it: a relative path is relative to the file's directory
    (``base``), not to wherever the command runs.

        >>> _under(Path("/srv/fleet"), "../run/w.pid"), _under(Path("/srv/fleet"), "/run/w.pid")
        ('/srv/run/w.pid', '/run/w.pid')
    """
    if not value or os.path.isabs(value):
        return value
    return os.path.normpath(os.path.join(base, value))


def relative_to_file(fleet: Fleet, base: Path) -> Fleet:
    """A copy of ``fleet`` with every relative path made absolute under ``base`` (see load_fleet).
    ``start_command`` is left as written: it is a command, run in the worker's directory."""
    storage = fleet.storage.model_copy(update={"path": _under(base, fleet.storage.path)})  # {node} kept
    workloads = []
    for w in fleet.workloads:
        update: dict[str, Any] = {}
        if w.find is not None and w.find.pid_file:
            update["find"] = w.find.model_copy(update={"pid_file": _under(base, w.find.pid_file)})
        if w.container is not None:
            c = w.container
            # A bare name is a podman named volume, not a path: only what looks like a path moves.
            mounts = [m.model_copy(update={"source": _under(base, m.source)})
                      if "/" in m.source or m.source.startswith(".") else m for m in c.mounts]
            k8s = c.kubernetes and c.kubernetes.model_copy(update={
                "kubelet_ca": _under(base, c.kubernetes.kubelet_ca), "token_file": _under(base, c.kubernetes.token_file)})
            update["container"] = c.model_copy(update={"rootfs": _under(base, c.rootfs), "mounts": mounts,
                                                       "kubernetes": k8s})
        workloads.append(w.model_copy(update=update) if update else w)
    return fleet.model_copy(update={"storage": storage, "workloads": workloads})


@lru_cache(maxsize=16)
def _load(resolved: str, mtime_ns: int, size: int, shown: str) -> Fleet:
    path = Path(shown)
    text = Path(resolved).read_text()
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {_yaml_problem(e, text)}",
                          fix="fix the YAML at that line (indent with spaces, close brackets and quotes)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level (fleet:, nodes:, workloads:, ...)"
                          + (", the file is empty" if data is None else ""),
                          fix="start from deployments/local.yaml (deployments/example-every-field.yaml sets every field)")
    try:
        return Fleet.model_validate(data)
    except ValidationError as e:
        problems: list[tuple[tuple, str]] = []
        missing: set[tuple] = set()
        for err in e.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            ctx_err = (err.get("ctx") or {}).get("error")
            if isinstance(ctx_err, _PathErrors):
                problems += [(loc + p, m) for p, m in ctx_err.problems]
            elif err["type"] == "missing":
                missing.add(loc)
                problems.append((loc, err["msg"]))
            elif err["type"] == "extra_forbidden":  # pydantic's "Extra inputs are not permitted" says no more
                problems.append((loc, unknown_field(str(loc[-1]), _fields_at(loc[:-1]))))
            else:
                problems.append((loc, err["msg"].removeprefix("Value error, ")))
        # Schema errors stop pydantic before the cross-field checks: run them on the raw file,
        # so that one run reports every mistake.
        problems += [p for p in cross_field_problems(data) if p not in problems]
        root = yaml.compose(text, Loader=_Loader)  # line numbers, only when there is an error
        located = sorted(((_line_of(root, loc) or 0, loc, msg) for loc, msg in problems), key=lambda x: x[0])
        lines = [_located(path, loc, line, msg, loc in missing) for line, loc, msg in located]
        if len(lines) > 1:
            lines.insert(0, f"{path}: {len(lines)} problems")
        raise ConfigError("\n".join(lines), fix=f"see {EVERY_FIELD} for every field") from None


def unknown_field(name: str, known: list[str]) -> str:
    """A key no field has, with the one it most likely meant, else the ones there are.

        >>> unknown_field("pid_flie", ["pid_file", "systemd_unit"])
        "unknown field 'pid_flie'; did you mean 'pid_file'?"
        >>> unknown_field("zzz", ["keep", "max_age_h"])
        "unknown field 'zzz' (fields here: keep, max_age_h)"
    """
    return f"unknown field {name!r}" + (did_you_mean(name, known) or f" (fields here: {', '.join(known) or 'none'})")


def _fields_at(loc: tuple) -> list[str]:
    """The field names (and aliases) of the model at YAML path ``loc`` of a fleet file; [] where
    the path leads to no model."""
    import types
    import typing

    def unwrap(t: Any) -> Any:
        while True:
            origin = typing.get_origin(t)
            if origin is typing.Annotated:
                t = typing.get_args(t)[0]
            elif origin in (typing.Union, types.UnionType):
                args = [a for a in typing.get_args(t) if a is not type(None)]
                t = args[0] if len(args) == 1 else next((a for a in args if _is_model(a)), args[0])
            else:
                return t

    t: Any = Fleet
    for part in loc:
        t = unwrap(t)
        origin, args = typing.get_origin(t), typing.get_args(t)
        if origin is list and isinstance(part, int):
            t = args[0]
        elif origin is dict and args:
            t = args[1]
        elif _is_model(t) and isinstance(part, str) and part in t.model_fields:
            t = t.model_fields[part].annotation
        else:
            return []
    t = unwrap(t)
    if not _is_model(t):
        return []
    return [n for name, f in t.model_fields.items() for n in (name, f.alias) if n]


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _yaml_problem(e: yaml.YAMLError, text: str) -> str:
    """One line naming what is wrong and where; a tab in the indentation said plainly."""
    mark = getattr(e, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    if line is not None:
        indent = text.splitlines()[line - 1:line] or [""]
        if "\t" in indent[0][:len(indent[0]) - len(indent[0].lstrip(" \t"))] or "'\\t'" in str(e):
            return f"tabs are not allowed for indentation, line {line}"
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"not valid YAML, line {line}: {problem}" if line else f"not valid YAML: {problem}"


def node_deployment(fleet: str, node: str, flow: str | None = None) -> str:
    """The name of the deployment of a per-node flow (heartbeat, invalidate, verify, node-step)
    for ``node`` of fleet ``fleet``; with ``flow``, the ``<flow>/<name>`` that run_deployment and
    ``prefect deployment run`` take. ':' is in neither a fleet's nor a node's alphabet, so no two
    (fleet, node) pairs share a name (joined by '-', fleet gpu's node a-1 would be fleet gpu-a's 1).

    Example:
        >>> node_deployment("example-h200", "h200-01"), node_deployment("example-h200", "h200-01", "node-step")
        ('example-h200:h200-01', 'node-step/example-h200:h200-01')
    """
    name = f"{fleet}:{node}"
    return f"{flow}/{name}" if flow else name
