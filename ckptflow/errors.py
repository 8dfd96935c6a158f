"""Typed errors shared by every layer.

Each error says whether a retry can help (``retryable``). Tasks and flows decide from this
attribute alone: a final error is never retried (an incompatible restore retried in a loop
only burns a node), a retryable one goes through Prefect's retries.
"""

from __future__ import annotations


class CkptflowError(Exception):
    """Base of every ckptflow error. ``fix`` says what the operator should do."""

    retryable: bool = False
    # The node lacks what a restore needs (see CriuError): not the checkpoint's fault.
    node_condition: bool = False

    def __init__(self, message: str, *, fix: str | None = None):
        self.fix = fix
        super().__init__(message if not fix else f"{message}\n  fix: {fix}")

    @property
    def message(self) -> str:
        """What went wrong, without the fix (which ``str()`` appends)."""
        text = str(self.args[0]) if self.args else ""
        return text.removesuffix(f"\n  fix: {self.fix}") if self.fix else text

    def __reduce__(self):
        # A node step's error reaches the fleet flow pickled (Prefect's result storage). The
        # default reduce calls cls(*args), which breaks for subclasses whose __init__ takes other
        # arguments (CriuError, IncompatibleCheckpoint): the fleet flow then got a generic
        # failure and lost the type, the CRIU log tail and the typed fallback. Rebuild without
        # __init__ instead: the message as formatted, every attribute as it was.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, state: dict) -> CkptflowError:
    e = cls.__new__(cls, *args)
    e.__dict__.update(state)
    return e


# --- configuration and declared workloads -------------------------------------------------
class ConfigError(CkptflowError):
    """A fleet file or parameter is wrong; the message names the file and field path."""


class WorkloadNotFound(CkptflowError):
    """The declared workload has no running process (pid file stale, no cmdline match)."""


class WorkloadBusy(CkptflowError):
    """Another checkpoint or restore of this workload is running on this node right now."""


class UndeclaredProcess(CkptflowError):
    """A PID does not belong to a declared workload; the runner refuses to touch it."""


class NotDrained(CkptflowError):
    """A drain moved not every workload off its node; each still runs there. The node is not
    marked drained: maintenance must not start on it."""


class NotRecovered(CkptflowError):
    """A recover-node brought not every workload of the lost node back: the run fails so that a
    green recovery always means every workload serves again."""


class HeartbeatFailed(CkptflowError):
    """Some checkpoints of a heartbeat failed; ``rows`` holds every workload's outcome (the failed
    ones too). A ckptflow error like the rest: its rows and fix survive the pickling of a
    deployment's result, and a caller that handles ckptflow errors handles it."""

    def __init__(self, message: str, rows: list | None = None, fix: str | None = None):
        super().__init__(message, fix=fix)
        self.rows = rows or []


# --- runners ------------------------------------------------------------------------------
class RunnerUnavailable(CkptflowError):
    """A node mechanism (CRIU, CUDA driver) is missing or unusable on this machine."""


class CriuError(CkptflowError):
    """CRIU failed. Carries the command line and the tail of CRIU's log."""

    def __init__(self, message: str, *, cmd: list[str], log_tail: str = "",
                 returncode: int | None = None, fix: str | None = None, node_condition: bool = False):
        self.cmd = cmd
        # The node lacks what the image needs (its working directory, a PID): the checkpoint is
        # not at fault and an older one would meet the same, so it is not counted against it.
        self.node_condition = node_condition
        self.log_tail = log_tail
        self.returncode = returncode
        detail = f"{message} (exit {returncode})\n  command: {' '.join(cmd)}"
        if log_tail:
            detail += "\n  criu log tail:\n    " + "\n    ".join(log_tail.splitlines()[-15:])
        super().__init__(detail, fix=fix)


class CriuTimeout(CriuError):
    """A CRIU call ran past its timeout and was killed."""

    retryable = True


class RestoreFailed(CkptflowError):
    """A restore did not produce a healthy process."""


class WorkloadRunning(RestoreFailed):
    """Recover was asked for a worker that is running: refused, and nothing is wrong with it."""


class PidBusy(RestoreFailed):
    """The PID the image needs is still taken (old process not reaped, or reused)."""

    retryable = True


class IncompatibleCheckpoint(CkptflowError):
    """The checkpoint was taken on a different fingerprint. Final: never retried."""

    def __init__(self, differences: dict[str, tuple[object, object]], *, checkpoint: str = ""):
        self.differences = differences
        self.checkpoint = checkpoint or None
        lines = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in differences.items())
        super().__init__(
            f"checkpoint {checkpoint} is incompatible with this node: {lines}",
            fix="restore onto a node with the same fingerprint, or cold start the workload",
        )


class NotEnoughGpuMemory(CkptflowError):
    """Free GPU memory is below footprint + margin; a restore would break the worker."""


class UnsupportedWorkload(CkptflowError):
    """The worker, as it was started, cannot be checkpointed (e.g. a tensor-parallel worker whose
    NCCL uses P2P/SHM/NVLS transports). Restarting it differently is the fix; retrying is not."""


class GpuCheckpointError(CkptflowError):
    """A GPU backend's lock, checkpoint, restore or unlock failed (runners/gpu); names each PID."""


class CudaCheckpointError(GpuCheckpointError):
    """A CUDA driver checkpoint call failed; carries the PID, the call and the driver state."""


class EngineProtocolError(CkptflowError):
    """The engine refused or failed a two-tier protocol call (export, import, template). A refusal
    is final; an engine that did not answer (busy, restarting) may be retried."""

    def __init__(self, message: str, *, fix: str | None = None, retryable: bool = False):
        self.retryable = retryable
        super().__init__(message, fix=fix)


# --- store --------------------------------------------------------------------------------
class StoreError(CkptflowError):
    """The checkpoint store failed."""


class StorageUnavailable(StoreError):
    """The store cannot be reached right now (retryable)."""

    retryable = True


class StorageFull(StoreError):
    """No space left while writing a checkpoint; the partial checkpoint was discarded."""


class CheckpointNotFound(StoreError):
    """No such checkpoint (or no valid checkpoint for the workload)."""


class ChecksumMismatch(StoreError):
    """Bytes on storage differ from the manifest: the checkpoint is corrupt."""
