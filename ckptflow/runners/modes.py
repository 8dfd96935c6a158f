"""What a checkpoint mode does on a node: the runner side of ckptflow.modes.

A task asks ``mode_runner(node, w)`` for the runner of ``w``'s mode (its ``checkpoint:`` in the
fleet file) and calls the same four methods whatever the mode; only the mode's runner knows
whether a heartbeat is a whole-process image or a template plus sessions:

| method | what it does |
|--------|--------------|
| ``checkpoint(w)`` | a heartbeat: the worker serves on; the committed manifest |
| ``restore(w, tier)`` | ``w`` back on this node from its newest valid checkpoint; a ``Restored`` |
| ``push(m, tier)`` | ``m`` (and whatever it names) to the shared tier; the tier's counts |
| ``verify(w, m)`` | a sandbox copy of ``m`` compared with the checkpoint; a ``VerifyResult`` |

Example:
    >>> with NodeRunner(LocalStore(".ckptflow/store")) as node:        # doctest: +SKIP
    ...     mode = mode_runner(node, workload)                          # ProcessMode or TemplateSessionsMode
    ...     m = mode.checkpoint(workload)
    ...     mode.restore(workload).summary()["checkpoint"] == m.id
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptflow.modes import ModeParams, get_mode, mode_of_kind
from ckptflow.models import Manifest, Workload
from ckptflow.results import RestoreSummary, Skipped

if TYPE_CHECKING:
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.verify import VerifyResult


@dataclass
class Restored:
    """One restore, the same shape for every mode (what a restore task reports)."""

    manifest: Manifest                  # the checkpoint restored (a two-tier restore: its sessions)
    pid: int
    timings: dict[str, float]
    bytes: int                          # bytes the checkpoint holds
    downloaded_bytes: int = 0           # pulled from the shared tier
    copies: list[str] = field(default_factory=list)     # "tier:location" of each copy of it
    skipped: list[Skipped] = field(default_factory=list)  # corrupt checkpoints passed over
    files: int = 0                      # image files (0: its bytes are chunks)
    template: Manifest | None = None    # the template it was restored over, for a mode that has one

    def summary(self) -> RestoreSummary:
        out = RestoreSummary(checkpoint=self.manifest.id, pid=self.pid, timings=self.timings, bytes=self.bytes,
                             downloaded_bytes=self.downloaded_bytes, copies=self.copies, skipped=self.skipped,
                             created=self.manifest.created.strftime("%Y-%m-%d %H:%M:%S UTC"), files=self.files,
                             sessions=len(self.manifest.probe.sessions or {}))
        if self.template is not None:
            out["template"] = self.template.id
        return out


class ModeRunner(ABC):
    """A checkpoint mode on one node. ``params``: the workload's ``checkpoint_params`` as the
    mode's own model."""

    def __init__(self, node: "NodeRunner", params: ModeParams | None = None):
        self.node = node
        self.params = params

    @abstractmethod
    def checkpoint(self, w: Workload, context=None) -> Manifest:
        """A heartbeat of ``w`` (it keeps serving): the committed manifest. ``context``: what the
        cadence decision saw (policies.sessions.ExportContext), for modes that weigh sessions.

        Raises:
            CkptflowError: nothing committed; the worker serves on.
        """

    @abstractmethod
    def restore(self, w: Workload, tier=None) -> Restored:
        """``w`` back on this node from its newest valid checkpoint (pulled from ``tier`` when newer there).

        Raises:
            WorkloadRunning, CheckpointNotFound, IncompatibleCheckpoint, RestoreFailed: as NodeRunner.restore.
        """

    def push(self, m: Manifest, tier) -> dict:
        """``m`` to the shared tier; what the tier counted (uploaded bytes, ...)."""
        return tier.push(self.node.store, m)

    @abstractmethod
    def verify(self, w: Workload, m: Manifest) -> "VerifyResult":
        """Prove ``m`` restores, beside the running original; never raises for a bad checkpoint."""


class ProcessMode(ModeRunner):
    """``process``: the whole worker, CRIU plus the node's GPU backend (runners/node.py)."""

    def checkpoint(self, w: Workload, context=None) -> Manifest:
        return self.node.checkpoint(w, leave_running=True)

    def restore(self, w: Workload, tier=None) -> Restored:
        res = self.node.restore(w, tier=tier)
        return Restored(res.manifest, res.pid, res.timings, res.manifest.bytes, res.downloaded_bytes,
                        [f"{c.tier.value}:{c.location}" for c in res.manifest.copies], res.skipped,
                        len(res.manifest.files))

    def verify(self, w: Workload, m: Manifest) -> "VerifyResult":
        from ckptflow.runners.verify import verify_checkpoint

        return verify_checkpoint(self.node, w, m)


def mode_runner(node: "NodeRunner", w: Workload, mode: str | None = None) -> ModeRunner:
    """The runner of ``w``'s checkpoint mode (or of ``mode``), with ``w``'s parameters.

    Raises:
        KeyError: an unregistered mode (the workload model refuses one first).
    """
    spec = get_mode(mode or w.checkpoint)
    return spec.load()(node, spec.parse(w.checkpoint_params if spec.name == w.checkpoint else None))


def manifest_runner(node: "NodeRunner", w: Workload, m: Manifest) -> ModeRunner:
    """The runner of the mode that wrote ``m`` (by its kind): what verifies or pushes it, whatever
    ``w`` declares now."""
    return mode_runner(node, w, mode_of_kind(m.kind.value if hasattr(m.kind, "value") else m.kind).name)
