"""The fleet file: ``deployments/<fleet>.yaml``, validated by pydantic.

Example (``deployments/local.yaml``)::

    fleet: local
    storage: {kind: local, path: .ckptflow/store}
    nodes:
      - {name: local, work_pool: local, gpu_class: cpu, mtbf_hours: 6000}
    workloads:
      - name: demo-chat
        node: local
        find: {pid_file: .ckptflow/run/demo-chat.pid, cmdline_must_contain: ckptflow.demo.worker}
        engine: vllm
        traffic: long_sessions
    policies:
      - {match: {traffic: long_sessions}, policy: cost-based, params: {min_interval_s: 60}}

Errors name the file, the YAML path (``workloads[3].metrics_url``), its line, and what was
expected:

    >>> load_fleet(Path("deployments/broken.yaml"))   # doctest: +SKIP
    ConfigError: deployments/broken.yaml: workloads[0].node (line 12): node 'gpu-9' is not declared in nodes
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from functools import lru_cache

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ckptflow.errors import ConfigError
from ckptflow.models import Engine, Name, TrafficClass, Workload
from ckptflow.policies.retention import Retention


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~10x faster on a 1,000-workload file


class StorageKind(str, Enum):
    local = "local"
    s3 = "s3"


class Storage(BaseModel):
    """Where checkpoint images and manifests live."""

    model_config = ConfigDict(extra="forbid")

    kind: StorageKind = Field(StorageKind.local, description="local directory or S3-compatible bucket")
    path: str = Field(".ckptflow/store", description="Root directory for kind=local (relative to the "
                      "fleet file's working directory).")
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
    mtbf_hours: float | None = Field(None, gt=0, description="Mean time between failures of the node.")
    failures: list[datetime] = Field(default_factory=list,
                                     description="Observed failure times (MTBF is estimated from them).")
    maintenance: list[MaintenanceWindow] = Field(default_factory=list)


class PolicyMatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    labels: dict[str, str] = Field(default_factory=dict, description="All must equal the workload's labels.")
    engine: Engine | None = None
    traffic: TrafficClass | None = None

    def matches(self, w: Workload) -> bool:
        return ((self.engine is None or w.engine == self.engine)
                and (self.traffic is None or w.traffic == self.traffic)
                and all(w.labels.get(k) == v for k, v in self.labels.items()))


class PolicyRule(BaseModel):
    """First matching rule wins; the policy is chosen by name (see ckptflow.policies)."""

    model_config = ConfigDict(extra="forbid")

    match: PolicyMatch = Field(default_factory=PolicyMatch)
    policy: str = Field(..., description="Registered policy name.", examples=["cost-based", "never", "fixed"])
    params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the policy.")


class Schedule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    interval_s: int | None = Field(None, gt=0, description="Run every N seconds.")
    cron: str | None = Field(None, description="Cron expression (UTC).", examples=["*/5 * * * *"])

    @model_validator(mode="after")
    def _one(self) -> "Schedule":
        if (self.interval_s is None) == (self.cron is None):
            raise ValueError("give exactly one of interval_s or cron")
        return self


class Slack(BaseModel):
    model_config = ConfigDict(extra="forbid")

    webhook_url_env: str | None = Field(None, description="Env var holding an incoming-webhook URL.")
    token_env: str | None = Field(None, description="Env var holding a bot token.")
    secret_block: str | None = Field(None, description="Prefect Secret block holding the webhook URL or token.")
    channel: str | None = Field(None, description="Channel for bot-token posting.", examples=["#gpu-oncall"])
    base_url: str | None = Field(None, description="Slack API base URL (tests point it at a local server).")


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

    @model_validator(mode="after")
    def _references(self) -> "Fleet":
        nodes = [n.name for n in self.nodes]
        _unique(nodes, "nodes")
        _unique([w.name for w in self.workloads], "workloads")
        from ckptflow.policies.cadence import POLICIES

        for i, r in enumerate(self.policies):
            if r.policy not in POLICIES:
                raise _PathError(("policies", i, "policy"),
                                 f"unknown policy {r.policy!r} (known: {', '.join(sorted(POLICIES))})")
        for i, w in enumerate(self.workloads):
            if w.node not in nodes:
                raise _PathError(("workloads", i, "node"),
                                 f"node {w.node!r} is not declared in nodes (declared: {', '.join(nodes)})")
        return self

    def workload(self, name: str) -> Workload:
        for w in self.workloads:
            if w.name == name:
                return w
        raise ConfigError(f"fleet {self.fleet}: no workload named {name!r} "
                          f"(declared: {', '.join(w.name for w in self.workloads) or 'none'})")

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"fleet {self.fleet}: no node named {name!r}")

    def rule_for(self, w: Workload) -> PolicyRule | None:
        return next((r for r in self.policies if r.match.matches(w)), None)


class _PathError(ValueError):
    def __init__(self, path: tuple, msg: str):
        self.path = path
        super().__init__(msg)


def _unique(names: list[str], where: str) -> None:
    seen = set()
    for i, n in enumerate(names):
        if n in seen:
            raise _PathError((where, i, "name"), f"duplicate name {n!r}")
        seen.add(n)


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


def load_fleet(path: Path | str) -> Fleet:
    """Read and validate a fleet file.

    Raises:
        ConfigError: naming the file, each bad field's YAML path and line, and what was expected.
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{path}: fleet file not found",
                          fix="pass a file from deployments/, e.g. deployments/local.yaml") from None
    # Every node-batch task of a tick reads the same file: parse it once per version of it.
    return _load(str(path.resolve()), st.st_mtime_ns, st.st_size, str(path)).model_copy(deep=True)


@lru_cache(maxsize=16)
def _load(resolved: str, mtime_ns: int, size: int, shown: str) -> Fleet:
    path = Path(shown)
    text = Path(resolved).read_text()
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level (fleet:, nodes:, workloads:, ...)")
    try:
        return Fleet.model_validate(data)
    except ValidationError as e:
        root = yaml.compose(text, Loader=_Loader)  # line numbers, only when there is an error
        lines = []
        for err in e.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            msg = err["msg"]
            ctx_err = (err.get("ctx") or {}).get("error")
            if isinstance(ctx_err, _PathError):
                loc, msg = loc + ctx_err.path, str(ctx_err)
            msg = msg.removeprefix("Value error, ")
            line = _line_of(root, loc)
            where = f"{format_path(loc)}" + (f" (line {line})" if line else "")
            lines.append(f"{path}: {where}: {msg}")
        raise ConfigError("\n".join(lines), fix="see deployments/example-h200-fleet.yaml for every field") from None
