"""Sessions exported as their turns end: a node-local loop beside the heartbeat (#25 item 3).

The heartbeat (a Prefect task, every few minutes) decides the workload's cadence and keeps the
context its sessions are weighed in (the node's MTBF estimate, an announced interruption:
``LocalStore.put_export_context``). Between heartbeats this loop polls the engine's sessions
every ``every_s`` seconds: a session whose token count did not move since the previous poll is
between turns, and one that grew since its last export is weighed there by
``policies.sessions.decide_export`` with ``at_turn_end`` (the function the simulator replays).
The ones that pay are exported in the engine's turn mode, which holds only them while the engine
serves on, and committed as a session checkpoint (pushed to the fleet's shared tier when it has
one); every other session is kept as last checkpointed. A new session is weighed at its first
turn end: exported where its KV pays, else listed, so that a restore answers its client "lost".
A session is weighed once per turn end (its tokens moved since it was last weighed); an idle one
costs a look, not the workload's lock.

Example:
    >>> watch = TurnWatch(TemplateSessionsRunner(node), fleet.workload("chat"))  # doctest: +SKIP
    >>> watch.run(duration_s=60)                                                   # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptflow.errors import CkptflowError
from ckptflow.models import Manifest, Workload
from ckptflow.policies.sessions import ExportContext
from ckptflow.runners import engine
from ckptflow.runners.template_sessions import TemplateSessionsRunner

log = logging.getLogger(__name__)

# Without a heartbeat's context yet: a node that fails about weekly (the cost model's worst
# healthy class is 500 h; a week errs towards exporting).
DEFAULT_MTBF_S = 7 * 24 * 3600.0


class TurnWatch:
    """Poll one two-tier workload's engine and export its sessions at their turn ends."""

    def __init__(self, runner: TemplateSessionsRunner, w: Workload, every_s: float = 2.0,
                 mtbf_s: float | None = None, tier=None, reload: Callable[[], Workload] | None = None):
        """``tier``: the fleet's shared tier (each checkpoint is pushed to it); ``reload``: the
        workload as the fleet file declares it now, read before each look (a bumped engine or
        model version changes its template's name)."""
        self.runner, self.w, self.every_s, self.tier, self.reload = runner, w, every_s, tier, reload
        self.mtbf_s = mtbf_s or DEFAULT_MTBF_S
        self.seen: dict[str, int] = {}
        self.weighed: dict[str, int] = {}   # tokens each session was last weighed at (one turn end)
        self.last: Manifest | None = None   # this loop's newest checkpoint: the next one replaces it

    def context(self) -> ExportContext:
        """The newest heartbeat's context, at a turn end; the declared MTBF before any."""
        raw = self.runner.store.export_context(self.w.name)
        ctx = ExportContext.model_validate_json(raw) if raw else ExportContext(mtbf_s=self.mtbf_s)
        return ctx.model_copy(update={"at_turn_end": True})

    def poll(self) -> Manifest | None:
        """One look at the engine: the checkpoint it committed, or None (nothing at a turn end
        that pays, or no template yet: the heartbeat takes templates)."""
        if self.reload is not None:
            self.w = self.reload()
        held = {k: int(v) for k, v in engine.engine_info(self.w).get("sessions", {}).items()}
        at_end = {sid for sid, n in held.items() if self.seen.get(sid) == n and self.weighed.get(sid) != n}
        self.seen = held
        if not at_end:
            return None
        m = self.runner.turn_end_checkpoint(self.w, held, at_end, self.context(), supersedes=self.last)
        self.weighed.update({sid: held[sid] for sid in at_end})
        if m is not None:
            self.last = m
            if self.tier is not None:  # a lost node's sessions come back from the tier, not its disk
                self.runner.push(m, self.tier)
        return m

    def run(self, stop: threading.Event | None = None, duration_s: float | None = None,
            on_checkpoint=None) -> int:
        """Poll until ``stop`` is set or ``duration_s`` passed; the number of checkpoints taken.
        An engine that does not answer is retried at the next poll (the heartbeat alerts)."""
        stop = stop or threading.Event()
        end = time.monotonic() + duration_s if duration_s is not None else None
        n = 0
        while not stop.is_set() and (end is None or time.monotonic() < end):
            try:
                m = self.poll()
            except (CkptflowError, OSError, ValueError) as e:
                # an engine between answers, a store busy or pruned under it: the next look tries again
                log.warning("turn-end export of %s: %s", self.w.name, str(e).splitlines()[0] if str(e) else e)
                m = None
            if m is not None:
                n += 1
                if on_checkpoint:
                    on_checkpoint(m)
            stop.wait(self.every_s)
        return n
