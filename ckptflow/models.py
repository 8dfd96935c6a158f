"""Pydantic models shared by every layer: workloads, fingerprints, manifests, decisions.

Example:
    >>> w = Workload(name="chat-a", node="local", find=ProcessFinder(pid_file="w.pid"))
    >>> w.name, w.engine.value, w.traffic.value
    ('chat-a', 'other', 'mixed')
    >>> m = Manifest(id="20261129T081500Z-1a2b3c4d", workload="chat-a", node="local")
    >>> m.kind.value, m.state.value, m.state.restorable
    ('heartbeat', 'complete', True)
    >>> [f"{c.tier.value}:{c.location}" for c in m.with_copy(CopyTier.s3, "s3://ckpt/prefix").copies]
    ['s3:s3://ckpt/prefix']

Names end up in paths and object keys, so a hostile one is refused:

    >>> try:
    ...     Workload(name="../../etc", node="local", find=ProcessFinder(pid_file="w.pid"))
    ... except ValueError as e:                          # pydantic.ValidationError
    ...     print(e.errors()[0]["loc"], e.errors()[0]["msg"].split(":")[0])
    ('name',) Value error, '../../etc' is not a valid name
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from enum import Enum, StrEnum
from typing import Annotated, Any

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, SerializeAsAny, ValidationError,
                      ValidationInfo, field_serializer, field_validator, model_validator)

from ckptflow.container_models import ContainerSpec, PortMap
from ckptflow.modes import DEFAULT_MODE, ModeParams
from ckptflow.registry import CHECKPOINT_MODES, ENGINES, WORKLOAD_RUNTIMES

# Names end up in paths and object keys: keep them to a safe alphabet so that a workload
# called "../../etc" can never address anything outside its own directory.
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
CKPT_ID_RE = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}$")


def check_name(value: str) -> str:
    if not _NAME_RE.match(value) or ".." in value:
        raise ValueError(
            f"{value!r} is not a valid name: use 1-63 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, and no '..'"
        )
    return value


def check_ckpt_id(value: str) -> str:
    if not CKPT_ID_RE.match(value):
        raise ValueError(f"{value!r} is not a checkpoint id (expected like 20261129T081500Z-1a2b3c4d)")
    return value


def did_you_mean(name: str, known: list[str]) -> str:
    """``"; did you mean 'X'?"`` for the closest of ``known`` (a misspelt key), or "" when none is close.

        >>> did_you_mean("min_intervl_s", ["min_interval_s", "max_interval_s"]), did_you_mean("zzz", ["keep"])
        ("; did you mean 'min_interval_s'?", '')
    """
    import difflib

    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


Name = Annotated[str, AfterValidator(check_name)]
CheckpointId = Annotated[str, AfterValidator(check_ckpt_id)]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Engine(str, Enum):
    """The built-in engines' names, for comparisons; a workload's ``engine`` is any registered
    adapter's name (EngineName)."""

    vllm = "vllm"
    sglang = "sglang"
    llamacpp = "llamacpp"
    other = "other"


class EngineName(str):
    """A registered engine adapter's name (registry.ENGINES, filled by engines/adapter.py). ``.value`` as the Engine enum
    this field was: the fleet file's ``engine:`` picks an adapter, and a new one is registered
    without touching this file."""

    @property
    def value(self) -> str:
        return str.__str__(self)


def _known_engine(v: object) -> EngineName:
    return EngineName(ENGINES.check(str(getattr(v, "value", v))))


EngineField = Annotated[str, BeforeValidator(lambda v: getattr(v, "value", v)), AfterValidator(_known_engine)]


class TrafficClass(str, Enum):
    """What the workload serves: decides whether checkpoints can pay off at all."""

    short_requests = "short_requests"
    long_sessions = "long_sessions"
    mixed = "mixed"


class ProcessFinder(BaseModel):
    """How the node runner finds a workload's process. Exactly one way must be given.

    The runner only ever acts on a PID found this way and checks it again right before a
    dump, so it cannot be pointed at an arbitrary process.
    """

    model_config = ConfigDict(extra="forbid")

    pid_file: str | None = Field(None, description="Path of a file holding the worker's PID; a relative one is "
                                 "relative to the fleet file's directory.", examples=["/run/vllm/chat-a.pid"])
    systemd_unit: str | None = Field(None, description="systemd unit whose MainPID is the worker.",
                                     examples=["vllm@chat-a.service"])
    cmdline_match: str | None = Field(
        None, description="Regular expression matched against the full command line; exactly "
        "one process may match.", examples=[r"vllm serve .* --port 8001"])
    cmdline_must_contain: str | None = Field(
        None, description="Extra guard: the process's command line must contain this text "
        "(checked for pid_file and systemd_unit too).", examples=["vllm"])

    @model_validator(mode="after")
    def _exactly_one(self) -> "ProcessFinder":
        given = [k for k in ("pid_file", "systemd_unit", "cmdline_match") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give exactly one of pid_file, systemd_unit, cmdline_match "
                             f"(got {given or 'none'})")
        if self.cmdline_match:
            import re

            try:   # every heartbeat compiles it: a broken one failed each of them instead of the load
                re.compile(self.cmdline_match)
            except re.error as e:
                raise ValueError(f"cmdline_match {self.cmdline_match!r} is not a regular expression ({e}); "
                                 "escape a literal ( or . with \\") from None
        return self


class GoldenRequest(BaseModel):
    """A deterministic request whose answer proves a restored worker computes like the original."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(..., description="POST target.", examples=["http://127.0.0.1:8000/v1/completions"])
    body: dict[str, Any] = Field(..., description="JSON body; make it deterministic (temperature 0).",
                                 examples=[{"prompt": "The capital of France is", "max_tokens": 8,
                                            "temperature": 0}])
    field: str = Field("choices.0.text", description="Dotted path of the part of the answer to compare.")


class CriuOptions(BaseModel):
    """What CRIU must be told for engines whose process tree holds more than private memory and
    sockets. ``engine: vllm`` and ``engine: sglang`` turn all but ``amx_unused`` on unless the fleet
    file says otherwise (docs/engines/vllm.md says why each one is needed)."""

    model_config = ConfigDict(extra="forbid")

    link_remap: bool = Field(
        False, description="CRIU --link-remap: files open under a name that was since replaced, such as "
        "glibc's named semaphores in /dev/shm (vLLM's multiprocessing).")
    ext_unix_sk: bool = Field(
        False, description="CRIU --ext-unix-sk: UNIX sockets whose peer is outside the tree (vLLM's ZMQ IPC).")
    file_locks: bool = Field(False, description="CRIU --file-locks: POSIX/flock locks held by the tree.")
    devshm: bool = Field(
        False, description="Carry the /dev/shm files the tree maps (vLLM's shared-memory rings, its "
        "semaphore) in the image, as they were at the dump, and put them back before a restore: "
        "another node has none, and after a SIGKILL the node's copies are newer than the image.")
    amx_unused: bool = Field(
        False, description="On a CPU with AMX: the tree may hold the kernel's AMX permission but never runs AMX "
        "instructions, so it is checkpointed anyway. torch asks for the permission whenever it probes the CPU "
        "(vLLM's CPU worker always does), and a worker served in float32, or with ONEDNN_MAX_CPU_ISA capped "
        "below AMX, never uses it. CRIU carries no AMX state: a restored process that ran AMX would die of "
        "SIGILL, which is why a tree holding the permission is refused without this (runners/xcomp.py).")


VLLM_CRIU = CriuOptions(link_remap=True, ext_unix_sk=True, file_locks=True, devshm=True)
# SGLang's tree (API server, resource tracker, scheduler, detokenizer; ZMQ IPC, multiprocessing's
# semaphore) was checkpointed and restored on the H200 with vLLM's options: docs/engines/sglang.md.
SGLANG_CRIU = VLLM_CRIU.model_copy()


class CheckpointMode(StrEnum):
    """The built-in checkpoint modes' names (every mode, built-in or not, is registered in
    registry.CHECKPOINT_MODES with ckptflow.modes.register_mode; ``Workload.checkpoint`` holds the name)."""

    process = "process"     # the whole worker: CUDA checkpoint + CRIU (any engine)
    template_sessions = "template-sessions"  # template + sessions through the engine protocol (docs/engines/protocol.md)


class Workload(BaseModel):
    """A declared serving worker on one node."""

    model_config = ConfigDict(extra="forbid")

    name: Name = Field(..., description="Unique workload name (also its directory in the store).",
                       examples=["chat-a"])
    node: Name = Field(..., description="Node the workload runs on.", examples=["gpu-node-01"])
    find: ProcessFinder | None = Field(None, description="How to find the worker's process (or give container).")
    container: ContainerSpec | None = Field(
        None, description="The worker runs in this container: checkpointed and restored through its runtime "
        "(runners/runtime/podman.py, or pod.py with container.kubernetes) instead of a process found by find.",
        examples=[{"name": "chat-c"}])
    runtime: str | None = Field(
        None, description="Workload runtime, by registered name (registry.WORKLOAD_RUNTIMES, runners/runtime/): what "
        "finds, dumps, restores, verifies, stops and cold starts the worker. Default: the one its declaration names: "
        "process for find, podman for container, pod for container.kubernetes.", examples=["podman"])
    engine: EngineField = Field(EngineName("other"), description="Serving engine: a registered engine adapter's "
                                "name (engines/adapter.py), which says how its metrics, golden request, sessions "
                                "and template are handled.", examples=["vllm", "llamacpp", "demo"])
    engine_version: str | None = Field(None, description="Declared engine version.",
                                       examples=["0.11.0"])
    model_id: str | None = Field(None, description="Model id.", examples=["meta-llama/Llama-3.1-8B"])
    model_revision: str | None = Field(None, description="Model revision or weights hash.")
    health_url: str | None = Field(None, description="GET returns 200 when ready.",
                                   examples=["http://127.0.0.1:8001/health"])
    metrics_url: str | None = Field(None, description="Prometheus /metrics URL.",
                                    examples=["http://127.0.0.1:8001/metrics"])
    gpu: bool = Field(False, description="Whether the worker holds GPU memory (CUDA checkpoint).")
    gpu_footprint_gib: float | None = Field(None, ge=0, description="Expected GPU memory footprint.")
    tensor_parallel: int = Field(
        1, ge=1, le=64, description="GPU processes (ranks) of one worker. Above 1, all ranks are checkpointed "
        "and restored together, and every rank must run with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "
        "NCCL_NVLS_ENABLE=0 USE_LIBUV=0 (policies.multigpu); the policy refuses it otherwise.")
    traffic: TrafficClass = Field(TrafficClass.mixed, description="Declared traffic class.")
    kv_capacity_tokens: int | None = Field(
        None, gt=0, description="Tokens the KV cache holds at 100 % usage (turns vLLM's usage ratio "
        "into tokens; SGLang reports used tokens itself).")
    probe_url: str | None = Field(
        None, description="GET returns {\"sessions\": {id: digest}}: read right before a dump and "
        "compared after a restore (the demo worker serves it; engines need a plugin).",
        examples=["http://127.0.0.1:18001/v1/sessions/digests"])
    golden: GoldenRequest | None = Field(None, description="Golden request for restore verification.")
    start_command: list[str] | None = Field(
        None, description="Cold start of the worker when no checkpoint can be restored (run detached).",
        examples=[["systemctl", "start", "vllm@chat-a"]])
    prepare_url: str | None = Field(
        None, description="POSTed right before a GPU checkpoint so the engine can release cached "
        "but free allocator memory (e.g. torch.cuda.empty_cache()); the checkpoint then copies "
        "and dumps only memory in use.", examples=["http://127.0.0.1:18001/v1/ckptflow/prepare"])
    resume_url: str | None = Field(
        None, description="POSTed after a GPU checkpoint's unlock (and after a restore's): an engine "
        "whose prepare quiesces it (tensor-parallel ranks idle on the CPU, new work held) serves "
        "again. Without it, the engine's own hold timeout applies.",
        examples=["http://127.0.0.1:18001/v1/ckptflow/resume"])
    checkpoint: str = Field(
        DEFAULT_MODE, description="Checkpoint mode, by registered name (ckptflow.modes): process: the whole worker "
        "(CRIU + the node's GPU backend), any engine; template-sessions (old name: two-tier): a template of "
        "the initialised engine plus the sessions it exports, bytes in proportion to what changed (the engine "
        "must speak ckptflow's protocol).",
        examples=["template-sessions"])
    checkpoint_params: SerializeAsAny[ModeParams] = Field(
        default_factory=ModeParams, validate_default=True, description="Parameters of the checkpoint mode, checked against its model "
        "(ProcessParams, TemplateSessionsParams).", examples=[{"min_session_tokens": 64}])
    tcp_established: bool = Field(
        False, description="Checkpoint established TCP connections too (CRIU --tcp-established). Left out, "
        "engine: vllm with tensor_parallel > 1 turns it on: its ranks are connected over loopback TCP.")
    criu: CriuOptions = Field(default_factory=CriuOptions,
                              description="CRIU options the engine's tree needs (engine: vllm sets them all).",
                              examples=[{"link_remap": True, "devshm": True}])
    labels: dict[str, str] = Field(default_factory=dict, description="Free labels for policy rules.")

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, v: str | None) -> str | None:
        return None if v is None else WORKLOAD_RUNTIMES.check(v)

    @field_validator("checkpoint")
    @classmethod
    def _known_mode(cls, v: str, info: ValidationInfo) -> str:
        v = CHECKPOINT_MODES.check(v)  # an old name (two-tier) reads as the mode it names now
        why = CHECKPOINT_MODES.lookup(v).refuse(info.data)  # the fields declared above checkpoint are validated already
        if why:
            raise ValueError(why)
        return v

    @field_validator("checkpoint_params", mode="before")
    @classmethod
    def _typed_mode_params(cls, v: Any, info: ValidationInfo) -> ModeParams:
        spec = CHECKPOINT_MODES.get(info.data.get("checkpoint", ""))
        if spec is None:
            return ModeParams()  # the unknown mode is the error reported
        try:
            return spec.parse(v)
        except ValidationError as e:
            err = e.errors()[0]
            if err["type"] == "extra_forbidden":
                known = ", ".join(spec.params.model_fields) or "none"
                raise ValueError(f"checkpoint mode {spec.name} has no parameter {err['loc'][-1]!r} "
                                 f"(its parameters: {known})"
                                 + did_you_mean(str(err["loc"][-1]), list(spec.params.model_fields))) from None
            where = ".".join(map(str, err["loc"]))
            raise ValueError(f"{where}: {err['msg']}" if where else err["msg"]) from None

    @model_validator(mode="after")
    def _engine_criu_defaults(self) -> "Workload":
        defaults = {Engine.vllm: VLLM_CRIU, Engine.sglang: SGLANG_CRIU}.get(self.engine)
        if defaults is not None:
            # A criu: block overrides the engine's options one by one (docs/engines/vllm.md): one
            # that replaced them all made `criu: {amx_unused: true}` drop --link-remap, and the
            # dump failed on vLLM's semaphore (found by running the how-to as written).
            given = self.criu.model_fields_set if "criu" in self.model_fields_set else set()
            self.criu = defaults.model_copy(update={k: getattr(self.criu, k) for k in given})
        if self.engine == Engine.vllm and self.tensor_parallel > 1 and "tcp_established" not in self.model_fields_set:
            # vLLM's ranks are a mesh of TCP connections over loopback (torch.distributed's gloo
            # group: 5 between the two ranks of a CPU TP=2 vLLM 0.32, measured), and CRIU refuses a
            # tree holding one without --tcp-established ("Connected TCP socket"): every heartbeat
            # of such a workload failed until it was declared. Both ends are in the tree, so they
            # are dumped and restored together. An explicit tcp_established: false stays.
            self.tcp_established = True
        return self

    @model_validator(mode="after")
    def _find_or_container(self) -> "Workload":
        if (self.find is None) == (self.container is None):
            raise ValueError("give exactly one of find (a process) or container (a container workload)")
        if self.container is not None and self.gpu:  # other modes refuse containers themselves (ckptflow.modes)
            raise ValueError("a container workload is checkpointed whole and on CPU only for now: "
                             "drop checkpoint: template-sessions and gpu: true, or run it as a process")
        return self

    @model_validator(mode="after")
    def _runtime_fits_declaration(self) -> "Workload":
        if self.runtime is None:
            return self
        needs = getattr(WORKLOAD_RUNTIMES.get(self.runtime), "declares", "find")
        has = ("find" if self.find is not None else
               "container.kubernetes" if self.container.kubernetes is not None else "container")
        if needs != has:
            raise ValueError(f"runtime {self.runtime} runs a workload declared with {needs}, and this one gives "
                             f"{has}: declare {needs}, or leave runtime out (what you declare picks it)")
        return self


class CheckpointState(str, Enum):
    complete = "complete"
    verified = "verified"
    verify_failed = "verify_failed"
    invalidated = "invalidated"

    @property
    def restorable(self) -> bool:
        return self in (CheckpointState.complete, CheckpointState.verified)


class CheckpointKind(StrEnum):
    """What a checkpoint holds. Manifests on disk and in S3 carry these exact strings (older ones
    say ``template`` for either kind of template: ``Manifest`` reads which one it is)."""

    heartbeat = "heartbeat"   # the whole worker, left running
    migrate = "migrate"       # the whole worker, which exited (it moves to another node)
    scale_template = "scale_template"    # the whole worker, initialised before traffic: scale-up replicas start from it
    engine_template = "engine_template"  # template-sessions: the engine with weights and sessions released
    sessions = "sessions"     # template-sessions: a workload's session KV over an engine template
    session = "session"       # one llama.cpp slot saved by the server (engines.llamacpp)


class VerifyOutcome(StrEnum):
    """How a sandbox verification of one checkpoint ended."""

    verified = "verified"             # the copy answered like the original: the checkpoint is proven
    verify_failed = "verify_failed"   # it restored but answered otherwise, or did not restore
    skipped = "skipped"               # not run (a GPU checkpoint's copy cannot be restored beside it)
    unverified = "unverified"         # it restored and was healthy, but nothing compared its state: not proven


class CopyTier(str, Enum):
    """Where a copy of a checkpoint is: a node's store, or a shared tier named by its
    ``storage.kind`` (``s3``, or a kind registered with ``store.register_tier``: such a name,
    e.g. ``CopyTier("gcs")``, is a member made on first use, so manifests of every tier read
    back the same way)."""

    node = "node"    # the local store of one node (tmpfs or local disk): a restore there reads it in place
    s3 = "s3"        # the fleet's bucket: any node can pull it

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str) and _NAME_RE.match(value) and ".." not in value:
            member = str.__new__(cls, value)
            member._name_, member._value_ = value, value
            return member
        return None


class CheckpointCopy(BaseModel):
    """One place that holds a checkpoint's bytes."""

    tier: CopyTier
    location: str = Field(..., description="Node name for tier node; s3://bucket/prefix for tier s3 (a "
                          "registered tier: its location).")
    at: datetime = Field(default_factory=lambda: utcnow(), description="When the copy was complete.")


class FileEntry(BaseModel):
    path: str = Field(..., description="Path relative to the checkpoint's image directory.")
    size: int = Field(..., ge=0, description="Size in bytes.")
    sha256: str = Field(..., description="Hex sha256 of the file's bytes; for a chunked file, the "
                        "sha256 of its chunk digests joined in order.")
    chunk_size: int | None = Field(None, description="Set when the file is hashed in chunks of this size "
                                   "(so large images are checked in parallel).")
    chunks: list[str] | None = Field(None, description="Hex sha256 of each chunk, in order.")


class Fingerprint(BaseModel):
    """Everything a restore depends on. Missing values are None (with a reason in ``notes``)."""

    model_config = ConfigDict(extra="allow")

    arch: str | None = None
    kernel: str | None = None
    glibc: str | None = None
    criu: str | None = None
    python: str | None = None
    cpu_features: list[str] | None = Field(
        None, description="The CPU's instruction-set features a restored process may be using (/proc/cpuinfo "
        "flags: SSE/AVX/AVX-512 families, AMX, ...), sorted. A restore needs all of them on the target CPU.",
        examples=[["amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512f"]])
    gpu_model: str | None = None
    gpu_count: int | None = None
    gpu_uuids: list[str] | None = None
    driver: str | None = None
    cuda_driver: str | None = None
    engine: str | None = None
    engine_version: str | None = None
    model_id: str | None = None
    model_revision: str | None = None
    ckptflow: str | None = None
    notes: dict[str, str] = Field(default_factory=dict,
                                  description="Why a field is unknown, e.g. no NVML.")


class EngineProbe(BaseModel):
    """What a worker says about its own state right before a dump (``runners.engine.probe``):
    session digests from its ``probe_url`` and the golden answer's digest. A restore or a sandbox
    copy is compared with it (``runners.digests``).

    Example:
        >>> EngineProbe(sessions={"s1": "9f2c"}, golden="3a31").sessions
        {'s1': '9f2c'}
    """

    golden: str | None = Field(None, description="sha256 of the golden request's answer field (GoldenRequest).")
    golden_error: str | None = Field(None, description="Why the golden request failed, when it did.",
                                     examples=["golden request failed: HTTP 500"])
    sessions: dict[str, str | int] | None = Field(
        None, description="Session id -> digest, as the worker's probe_url answered; None when it was not read. "
        "An engine-native session checkpoint of vLLM records the tokens each session holds instead.",
        examples=[{"s1": "9f2c5e..."}])
    error: str | None = Field(None, description="Why the probe_url could not be read (a checkpoint is refused "
                              "then, so a stored one predates that refusal).", examples=["probe failed: HTTP 500"])


class RemoteChunks(BaseModel):
    """The chunk map of one checkpoint in a chunked object-store tier (store/objects.py): how a
    pull rebuilds the image files from content-addressed chunks."""

    model_config = ConfigDict(extra="forbid")

    chunk_size: int = Field(..., gt=0, description="Bytes per chunk of the image files (the last one shorter).")
    chunks: dict[str, list[str]] = Field(
        default_factory=dict, description="Image file path -> sha256 of each of its chunks, in order.",
        examples=[{"pages-1.img": ["5e0b...", "a1c9..."]}])
    outside_chunks: list[str] = Field(
        default_factory=list, description="Chunks named outside the images (a two-tier checkpoint's weights or "
        "session KV, refs.json), pulled into the node's chunk store.")


class TemplateBinding(BaseModel):
    """On a two-tier sessions checkpoint: the template its sessions were exported over. A restore
    needs that very template (gone or invalidated: the checkpoint is refused)."""

    model_config = ConfigDict(extra="forbid")

    id: CheckpointId = Field(..., description="The template checkpoint's id.", examples=["20261129T081500Z-1a2b3c4d"])
    workload: Name = Field(..., description="The pseudo-workload the template is stored under.",
                          examples=["template-0123456789abcdef"])


class TemplateSource(BaseModel):
    """On a two-tier template checkpoint: the worker it was captured from."""

    model_config = ConfigDict(extra="forbid")

    workload: Name = Field(..., description="The workload whose engine was captured (a workload recovers in "
                          "place from its own template).", examples=["chat-a"])
    base_url: str | None = Field(None, description="The engine's address in that worker: a replica of the "
                                 "template answers there, inside its own network namespace.",
                                 examples=["http://127.0.0.1:18001"])


class WeightChunks(BaseModel):
    """On a two-tier template checkpoint: the weights, which left the image as content-addressed
    chunks and stream back after a restore."""

    model_config = ConfigDict(extra="forbid")

    bytes: int = Field(0, ge=0, description="Total bytes of the weights.")
    chunks: list[str] = Field(default_factory=list, description="sha256 of each weight chunk, in order.")


class SessionExport(BaseModel):
    """On a two-tier sessions checkpoint: what the engine's session export held and wrote."""

    model_config = ConfigDict(extra="forbid")

    total_bytes: int = Field(0, ge=0, description="Bytes of every session the checkpoint holds (what a restore "
                             "imports).")
    moved_bytes: int = Field(0, ge=0, description="Bytes this checkpoint wrote (chunks no earlier one held).")
    changed: list[str] = Field(default_factory=list, description="Sessions whose chunks changed since the "
                               "previous session checkpoint.")
    decisions: dict[str, str] = Field(default_factory=dict, description="Session id -> why it was exported, "
                                      "kept as of its last export, or left out (policies.sessions).")
    at_turn_end: bool = Field(False, description="Taken by the turn-end loop (runners/turns.py), not a "
                              "heartbeat: the cadence policy measures its ticks from the newest heartbeat.")


class ContainerRecord(BaseModel):
    """On a container checkpoint: the container it was exported from (runners/container.py)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="The container's name (a restore in place keeps it).", examples=["chat-c"])
    id: str | None = Field(None, description="The runtime's container id.")
    image: str | None = Field(None, description="The image it ran.")
    pod: str | None = Field(None, description="namespace/pod/container, for a Kubernetes pod's container.")
    ports: list[PortMap] = Field(default_factory=list, description="Its published ports (a restore publishes "
                                 "them again unless the workload declares its own).")


class RestoreHistory(BaseModel):
    """Every restore from one checkpoint (status and the exporter's histogram read it)."""

    model_config = ConfigDict(extra="forbid")

    seconds: list[float] = Field(default_factory=list, description="How long each restore took, oldest first.",
                                 examples=[[3.2, 2.9]])
    failures: list[str] = Field(default_factory=list, description="Why each failed restore from it failed (one "
                                "line each, oldest first); at MAX_FAILED_RESTORES it is marked verify_failed.",
                                examples=[["CRIU restore failed: Can't open cwd"]])

    def adding(self, took_s: float) -> "RestoreHistory":
        """This history with one more restore."""
        return RestoreHistory(seconds=[*self.seconds, took_s], failures=list(self.failures))

    def failing(self, why: str) -> "RestoreHistory":
        """This history with one more failed restore."""
        return RestoreHistory(seconds=list(self.seconds), failures=[*self.failures, why])


# Probe keys of manifests written before the probe was typed (one flat dict): old key -> (new
# field, its field). Manifests in stores and buckets keep them until retention deletes them.
_FLAT_KEYS = {"template": ("template", "id"), "template_workload": ("template", "workload"),
              "template_source": ("source", "workload"), "base_url": ("source", "base_url"),
              "weights_bytes": ("weights", "bytes"), "weight_chunks": ("weights", "chunks"),
              "session_bytes": ("export", "total_bytes"), "moved_bytes": ("export", "moved_bytes"),
              "changed_sessions": ("export", "changed"), "session_decisions": ("export", "decisions")}
# The chunk map of a chunked tier was "<prefix>chunk_size" etc.; S3's prefix was "s3_", other
# chunked tiers' "objects_" (store/objects.py ChunkedTier.chunk_key).
_FLAT_CHUNK_TIERS = ("s3", "objects")
_FLAT_CHUNK_FIELDS = ("chunk_size", "chunks", "outside_chunks")


class ManifestProbe(EngineProbe):
    """What a checkpoint recorded besides its files: the engine's probe (session digests, golden
    digest), and what its checkpoint mode, its container and its tiers add.

    Manifests of older versions held one flat dict (``template``, ``template_workload``,
    ``s3_chunks``, ``restores`` as a list, ...): they load into this shape unchanged on disk.

    Example:
        >>> p = ManifestProbe.model_validate({"template": "20261129T081500Z-1a2b3c4d",
        ...                                   "template_workload": "template-0123", "restores": [2.5]})
        >>> p.template.id, p.template.workload, p.restores.seconds
        ('20261129T081500Z-1a2b3c4d', 'template-0123', [2.5])
    """

    # An engine adapter's session checkpoint records its own keys (llama.cpp: slot, n_saved,
    # n_written; vLLM: blocks; both: engine), and an adapter registered outside ckptflow adds its
    # own: they are kept as they are, readable as attributes, rather than refused at load.
    model_config = ConfigDict(extra="allow")

    tokens_total: float | None = Field(None, description="The engine's token counter at the checkpoint (the "
                                       "cadence policy measures growth since it).")
    template: TemplateBinding | None = Field(None, description="Two-tier sessions checkpoint: its template.")
    source: TemplateSource | None = Field(None, description="Two-tier template checkpoint: the worker it was "
                                          "captured from.")
    weights: WeightChunks | None = Field(None, description="Two-tier template checkpoint: its weight chunks.")
    export: SessionExport | None = Field(None, description="Two-tier sessions checkpoint: what the export held "
                                         "and wrote.")
    container: ContainerRecord | None = Field(None, description="Container checkpoint: the container exported.")
    chunk_maps: dict[str, RemoteChunks] = Field(
        default_factory=dict, description="A chunked tier's copy of the manifest: its chunk map, by the tier's "
        "chunk key (s3, objects). A pull drops it: the node's copy reads its files in place.")
    restores: RestoreHistory = Field(default_factory=RestoreHistory, description="Restores from this checkpoint.")
    verify_timings: dict[str, float] | None = Field(None, description="Phase -> seconds of its last sandbox "
                                                    "verification.")

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, data: Any) -> Any:
        """Map an older manifest's flat keys into this shape (see _FLAT_KEYS)."""
        if not isinstance(data, dict):
            return data
        d = dict(data)
        # "template" was the template's id; in the new shape it is the binding (a dict or model).
        flat = {k: d.pop(k) for k in list(d) if k in _FLAT_KEYS and (k != "template" or isinstance(d[k], str))}
        for key, value in flat.items():
            group, name = _FLAT_KEYS[key]
            if value is not None:
                have = d.get(group)
                d[group] = {**(have.model_dump() if isinstance(have, BaseModel) else have or {}), name: value}
        for tier in _FLAT_CHUNK_TIERS:
            found = {f: d.pop(f"{tier}_{f}") for f in _FLAT_CHUNK_FIELDS if f"{tier}_{f}" in d}
            if found:
                d["chunk_maps"] = {**(d.get("chunk_maps") or {}), tier: found}
        if isinstance(d.get("restores"), list):
            d["restores"] = {"seconds": d["restores"]}
        return d

    def updated(self, **fields: Any) -> "ManifestProbe":
        """A validated copy with ``fields`` replaced (old flat names are mapped as at load).

        Example:
            >>> ManifestProbe(golden="aa").updated(sessions={"s": "d"}).model_dump(exclude_defaults=True)
            {'golden': 'aa', 'sessions': {'s': 'd'}}
        """
        return type(self).model_validate({**self.model_dump(exclude_defaults=True), **fields})


def _probe(v: Any) -> Any:
    return v.model_dump(exclude_defaults=True) if isinstance(v, EngineProbe) and not isinstance(v, ManifestProbe) else v


class Manifest(BaseModel):
    """One checkpoint. Written last and atomically: no manifest, no checkpoint."""

    id: CheckpointId
    workload: Name
    node: Name
    created: datetime = Field(default_factory=utcnow)
    kind: CheckpointKind = Field(CheckpointKind.heartbeat, description="What the checkpoint holds: heartbeat "
                                 "(worker left running), migrate (worker exited), scale_template (a warm worker "
                                 "scale-up clones), engine_template (template-sessions' engine), sessions, session.")
    files: list[FileEntry] = Field(default_factory=list)
    bytes: int = Field(0, ge=0, description="Total image bytes.")
    timings: dict[str, float] = Field(default_factory=dict, description="Phase -> seconds.")
    gpu_footprint_bytes: int = Field(0, ge=0)
    gpu_footprints: dict[str, int] = Field(
        default_factory=dict, description="GPU memory the worker held on each GPU (UUID -> bytes, NVML): a "
        "restore checks each target GPU's free memory against its own share (a TP worker's ranks).",
        examples=[{"GPU-5f1c…": 21474836480}])
    gpu_pids: list[int] = Field(default_factory=list, description="PIDs of the processes whose GPU state "
                                "the CUDA checkpoint took (every rank of a TP worker); CRIU restores them "
                                "with the same PIDs, and the CUDA restore needs each one.")
    fingerprint: Fingerprint | None = None
    parent: CheckpointId | None = None
    state: CheckpointState = CheckpointState.complete
    state_reason: str | None = None
    probe: Annotated[ManifestProbe, BeforeValidator(_probe)] = Field(
        default_factory=ManifestProbe,
        description="What the worker reported right before the dump (session digests, golden output digest), "
                    "used to check a restore, and what the checkpoint's mode, container and tiers recorded.")
    pid: int | None = Field(None, description="PID of the dumped root process.")
    copies: list[CheckpointCopy] = Field(
        default_factory=list, description="Where the bytes are: the node that took it, the S3 tier once "
        "pushed, each node that pulled it. A restore reads the nearest valid one (policies.tiers).")

    @model_validator(mode="before")
    @classmethod
    def _old_template_kind(cls, data: Any) -> Any:
        """A manifest written before the two templates had their own kinds says ``template``:
        one whose probe names the worker it was captured from (a template source) is an engine
        template, any other a scale-up template.

        Example:
            >>> old = {"id": "20261129T081500Z-1a2b3c4d", "workload": "w", "node": "n", "kind": "template"}
            >>> Manifest.model_validate(old).kind.value
            'scale_template'
            >>> Manifest.model_validate({**old, "probe": {"template_source": "chat-a"}}).kind.value
            'engine_template'
        """
        if not isinstance(data, dict) or data.get("kind") != "template":
            return data
        probe = data.get("probe")
        if isinstance(probe, BaseModel):
            engine = getattr(probe, "source", None) is not None
        else:
            engine = isinstance(probe, dict) and any(probe.get(k) is not None for k in ("source", "template_source"))
        return {**data, "kind": CheckpointKind.engine_template if engine else CheckpointKind.scale_template}

    @field_serializer("probe")
    def _probe_as_written(self, probe: ManifestProbe, info: Any) -> dict[str, Any]:
        # Only what was recorded: a heartbeat's probe stays as short as its flat dict was.
        return probe.model_dump(mode=info.mode, exclude_defaults=True)

    def with_copy(self, tier: "CopyTier", location: str) -> "Manifest":
        """This manifest listing one more copy (a copy already listed is not repeated)."""
        if any(c.tier == tier and c.location == location for c in self.copies):
            return self
        return self.model_copy(update={"copies": [*self.copies, CheckpointCopy(tier=tier, location=location)]})


class Action(str, Enum):
    protect = "protect"              # checkpoint every interval_s
    skip = "skip"                    # no checkpoint: it would cost more than it saves
    checkpoint_now = "checkpoint_now"
    drain = "drain"                  # node in/entering maintenance: move or finish work


class Decision(BaseModel):
    """What a policy decided for one workload at one tick, with the numbers behind it."""

    workload: str
    action: Action
    interval_s: float | None = Field(None, description="For protect: the checkpoint interval.")
    due: bool = Field(False, description="Whether a checkpoint should be taken at this tick.")
    reason: str = Field(..., description="One line, with the numbers that decided it.")
