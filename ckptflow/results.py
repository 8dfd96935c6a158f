"""What ckptflow's steps and flows return: the rows and results that cross a task, a node step's
flow run (its persisted result comes back through ``run_deployment``), recover's sequence, a
report template or the CLI.

Each is a ``TypedDict``: a plain dict at run time, so Prefect's result serializer, the table
artifacts, the jinja2 reports, the Slack templates, the CLI and the benches read it as they
always did; its keys are declared here, once, so a type checker sees a caller read a key no step
writes, and ``tests/test_results.py`` fails when a step stops writing one. A step builds its
result through the model's constructor (``CheckpointRow(workload=..., ...)``), which names
every key it writes.

A heartbeat row carries each phase's seconds as ``<phase>_s`` (``pause_s``, ``dump_s``, ...:
the manifest's timings, whose names depend on the mode and the GPU backend); only ``pause_s``,
which events and reports read, is declared.

Example:
    >>> row = CheckpointRow(workload="chat-a", node="local", decision="skip", reason="no sessions", ok=True,
    ...                     checkpoint=None)
    >>> row["ok"], row["checkpoint"]
    (True, None)
    >>> sorted(CheckpointRow.__required_keys__)
    ['decision', 'node', 'ok', 'reason', 'workload']
"""

# No ``from __future__ import annotations``: Python 3.11's TypedDict sees NotRequired only in
# annotations it evaluates.
from enum import StrEnum
from typing import Any, Literal, NotRequired, TypedDict


class Skipped(TypedDict):
    """A checkpoint a restore passed over: its id and why (a corrupt copy, a failed check)."""

    id: str
    reason: str


class Pushed(TypedDict, total=False):
    """What a push to the shared tier counted (``CheckpointTier.push``)."""

    uploaded_bytes: int
    skipped_bytes: int
    chunks: int
    seconds: float
    template_uploaded_bytes: int        # two tiers: the template pushed with its first sessions


class CheckpointRow(TypedDict):
    """One workload's outcome in a heartbeat (``tasks.node.checkpoint_batch``): the table
    artifact's row, the event's payload, the CLI's table line.

    ``ok``: nothing failed (a skip is ok). ``gone``: the worker was not running (its facts said
    so, or it vanished before the dump); the heartbeat's recover-if-gone rule decides on it.
    """

    workload: str
    node: str
    decision: str                       # the Action's value, or "forced" (heartbeat --force)
    reason: str
    ok: bool
    checkpoint: NotRequired[str | None]  # the committed one; None: nothing taken
    error: NotRequired[str]             # the failure's first line
    error_type: NotRequired[str]        # its exception class's name, for the report and the event
    gone: NotRequired[bool]
    bytes: NotRequired[int]             # what a restore reads (report.checkpoint_bytes)
    pause_s: NotRequired[float]
    uploaded_bytes: NotRequired[int]    # the shared tier's counts (Pushed), when there is one
    skipped_bytes: NotRequired[int]
    chunks: NotRequired[int]
    seconds: NotRequired[float]
    template_uploaded_bytes: NotRequired[int]
    upload_error: NotRequired[str]      # the push failed; the local copy stands
    recovered: NotRequired[str | None]  # on_worker_gone: recover brought it back, from this checkpoint
    recover_error: NotRequired[str]     # ... or tried and failed


class RestoreSummary(TypedDict):
    """One restore, the same shape for every checkpoint mode (``runners.modes.Restored.summary``)."""

    checkpoint: str
    pid: int
    timings: dict[str, float]
    bytes: int
    downloaded_bytes: int
    copies: list[str]                   # "tier:location" of each copy
    skipped: list[Skipped]
    created: str                        # "%Y-%m-%d %H:%M:%S UTC"
    files: int                          # image files (0: its bytes are chunks)
    sessions: int
    template: NotRequired[str]          # the template restored under it (two tiers)


class WorkloadRestored(RestoreSummary):
    """The restore step's result (``recovery.restore_workload``): where, and the summary."""

    workload: str
    node: str


class ColdStarted(TypedDict):
    """The cold-start step's result (``recovery.cold_start_row``)."""

    workload: str
    pid: int
    cold_start_s: float


class Recovered(TypedDict):
    """What recover returns (the flow, ``recover_here``, the CLI's line): a restore's
    ``WorkloadRestored`` keys, or a cold start's ``ColdStarted`` ones, and ``cold_start`` saying which."""

    workload: str
    node: str
    pid: int
    cold_start: bool
    checkpoint: NotRequired[str]        # restored: the checkpoint
    cold_start_s: NotRequired[float]    # cold started: how long
    timings: NotRequired[dict[str, float]]
    bytes: NotRequired[int]
    downloaded_bytes: NotRequired[int]
    copies: NotRequired[list[str]]
    skipped: NotRequired[list[Skipped]]
    created: NotRequired[str]
    files: NotRequired[int]
    sessions: NotRequired[int]
    template: NotRequired[str]


class MigratedOut(TypedDict):
    """migrate_out's result: the checkpoint it took and pushed (the worker exited), with the
    tier's counts. ``at``: wall-clock times (``pushed``, ``published``) the bench lines up."""

    checkpoint: str
    bytes: int
    timings: dict[str, float]
    at: dict[str, float]
    uploaded_bytes: NotRequired[int]
    skipped_bytes: NotRequired[int]
    chunks: NotRequired[int]
    seconds: NotRequired[float]


class MigratedIn(TypedDict):
    """migrate_in's result: the checkpoint pulled and restored, and the pull's counts."""

    checkpoint: str
    pid: int
    timings: dict[str, float]
    at: dict[str, float]
    downloaded_bytes: int
    seconds: float


class RestoredLocal(TypedDict):
    """restore_local's result: the source's own copy restored after a failed move."""

    checkpoint: str
    pid: int
    timings: dict[str, float]


# The migrate flow's result; "in" is a keyword, so this one is declared in the functional form.
Migrated = TypedDict("Migrated", {"workload": str, "source": str, "target": str, "checkpoint": str, "pid": int,
                                  "out": MigratedOut, "in": MigratedIn})
Migrated.__doc__ = "What the migrate flow returns: where it went, and each side's step result."


class Template(TypedDict):
    """take_template's result: the initialised checkpoint, pushed."""

    checkpoint: str
    bytes: int
    uploaded_bytes: NotRequired[int]
    skipped_bytes: NotRequired[int]
    chunks: NotRequired[int]
    seconds: NotRequired[float]


class ReplicaStarted(TypedDict):
    """scale_up_in's result: the replica, in its own PID and network namespace."""

    checkpoint: str
    pid: int
    init_pid: int
    netns: str
    start_s: float
    downloaded_bytes: int
    sessions: Any                       # what the replica's health probe said of its sessions
    golden: str | None                  # the golden answer's digest, when the workload has one


class ReplicasStopped(TypedDict):
    """scale_down_in's result."""

    stopped: list[str]                  # network namespaces
    node: str


class Stopped(TypedDict):
    """A workload runtime's ``stop``: whether it stopped, and what (a PID, a container, a pod)."""

    stopped: bool
    reason: NotRequired[str]            # not stopped: why ("not running")
    pid: NotRequired[int]
    container: NotRequired[str]
    pod: NotRequired[str]


class Verified(TypedDict):
    """verify_workload's row: the verdict on the newest unverified checkpoint, and each phase's
    seconds as ``<phase>_s``."""

    workload: str
    state: str                          # a VerifyOutcome's value
    reason: str
    node: NotRequired[str]
    checkpoint: NotRequired[str]


class Invalidated(TypedDict):
    """One checkpoint the invalidate flow marked invalidated, and which copy."""

    workload: str
    node: str
    checkpoint: str
    reason: str
    copy: str                           # the CopyTier's value


class InvalidateResult(TypedDict):
    """What the invalidate flow returns: what it retired, the alerts it sent, what retention
    deleted (``workload``, ``deleted``, ``why`` per checkpoint) and the templates and chunks
    collected after it."""

    invalidated: list[Invalidated]
    alerts: int
    deleted: list[dict[str, str]]
    template_sessions: dict[str, Any]


class MoveAction(StrEnum):
    """What a drain or a recover-node did with one workload: its report's action column (a
    restore by recover-node says ``restored <checkpoint>``, a plain string)."""

    migrated = "migrated"
    stopped = "stopped (short requests)"
    kept = "kept (drain incomplete)"
    cold_started = "cold started"
    not_moved = "NOT MOVED"                 # no node had room for it
    not_recovered = "NOT RECOVERED"
    failed = "FAILED"

    @classmethod
    def left_behind(cls, action: "MoveAction | str") -> bool:
        """The workload is still where it was (or nowhere): the drain or recover-node fails.

            >>> MoveAction.left_behind(MoveAction.failed), MoveAction.left_behind("restored 20261129T081500Z-1a2b3c4d")
            (True, False)
        """
        return action in (cls.not_moved, cls.not_recovered, cls.failed)


class MoveRow(TypedDict):
    """One workload's line in a drain's or recover-node's report (and the drained marker, the
    CLI's table): where it went and what was done."""

    workload: str
    action: MoveAction | str
    target: str                         # "-": nowhere (not moved, or stopped where it was)
    reason: NotRequired[str]            # the placement's reason, or the failure's first line
    checkpoint: NotRequired[str]        # migrated: the checkpoint it moved with
    stopped: NotRequired[bool]          # stopped: the runtime's Stopped
    pid: NotRequired[int]
    container: NotRequired[str]
    pod: NotRequired[str]


class Failure(TypedDict):
    """What an alert and a report say about a failed step (``alerts.failure``); recover adds the
    ``fallback`` it took."""

    reason: str
    cause: str | None
    fix: str | None
    checkpoint: str | None
    log_tail: str
    fallback: NotRequired[str]


# The node-step flow's actions (flows/node_step.py says what each does).
Step = Literal["migrate_out", "migrate_in", "restore_local", "stop", "take_template", "scale_up_in", "scale_down",
               "restore", "cold_start"]

# The node-step actions' results, by action: what run_step returns.
StepResult = WorkloadRestored | ColdStarted | MigratedOut | MigratedIn | RestoredLocal | Stopped | Template | \
    ReplicaStarted | ReplicasStopped


class StepParams(TypedDict):
    """The node-step flow's parameters, as a fleet flow sends them through ``run_deployment``
    (``flows.steps.step_params``): the keys whose value is None are left out."""

    fleet_file: str
    action: Step
    workload: str
    node: str
    checkpoint: str | None
    replica: NotRequired[str]
    when_ready: NotRequired[str]
    checkpoint_from: NotRequired[str]
