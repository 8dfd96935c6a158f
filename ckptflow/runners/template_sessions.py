"""The template + sessions checkpoint mode (``checkpoint: template-sessions``): the initialised
engine as a shared *template*, each workload's *sessions* exported by the engine itself, bytes
in proportion to what changed.

- Template: CRIU (+ CUDA on a GPU) of the engine with its weights and sessions released; the
  weights leave as content-addressed chunks through the engine's prepare hook and stream back
  after the restore. One per (engine template key, engine version, model revision): stored as
  the checkpoints of the pseudo-workload ``template-<key>``, shared by every workload of that
  model on nodes with the same fingerprint.
- Sessions: the engine writes each session's state as chunks, only those whose digest the
  previous session checkpoint of that workload does not hold; the manifest (``kind:
  sessions``) names its template and is written last.
- Restore: the template's image, then the weights, then the workload's sessions; a session
  checkpoint bound to a template that is gone, invalidated or of another model revision is
  refused before any CRIU call.

Example:
    >>> tt = TemplateSessionsRunner(NodeRunner(LocalStore(".ckptflow/store")))   # doctest: +SKIP
    >>> m = tt.heartbeat(workload)        # first call captures the template too
    >>> r = tt.restore(workload)          # after the worker died
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from pathlib import Path

from ckptflow.engines.adapter import gpu_checkable
from ckptflow.errors import (CheckpointNotFound, CkptflowError, EngineProtocolError, IncompatibleCheckpoint,
                             RestoreFailed, StorageUnavailable, UnsupportedWorkload)
from ckptflow.models import (CheckpointKind, CheckpointState, EngineProbe, Manifest, ManifestProbe, SessionExport,
                             TemplateBinding, TemplateSource, WeightChunks, Workload)
from ckptflow.policies.sessions import MIN_TOKENS, ExportContext, SessionDecision, decide_sessions, session_facts
from ckptflow.poll import NotYet, PollTimeout, poll
from ckptflow.runners import engine, process
from ckptflow.runners.digests import compare_sessions
from ckptflow.runners.fingerprint import workload_fingerprint
from ckptflow.runners.modes import ModeRunner, Restored
from ckptflow.runners.node import NodeRunner, write_pid_file
from ckptflow.store.chunks import REFS_FILE, ChunkStore

if TYPE_CHECKING:
    from ckptflow.runners.criu import SandboxCopy
    from ckptflow.runners.digests import VerifyResult

log = logging.getLogger("ckptflow")
SESSIONS_FILE = "sessions.json"
WEIGHTS_FILE = "weights.json"
TEMPLATE_PREFIX = "template-"


@dataclass
class Standby:
    """A parked copy of a template (``TemplateSessionsRunner.standby``), waiting to be promoted."""

    copy: "SandboxCopy"
    netns: str
    template: Manifest
    base: str                               # where it answers inside ``netns``
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class TemplateSessionsResult:
    manifest: Manifest                      # the workload's session checkpoint used
    template: Manifest
    pid: int
    timings: dict[str, float] = field(default_factory=dict)


# A heartbeat waits this long for the workload's lock: the turn-end loop holds it for one
# session's export (a tenth of a second per GiB), which must not cost a heartbeat its tick.
HEARTBEAT_LOCK_WAIT_S = 10.0


def _digests(recs: dict) -> dict[str, list[str]]:
    return {sid: [d for t in r["tensors"] for d in t["chunks"]] for sid, r in recs.items()}


class TemplateSessionsRunner:
    """Template + session checkpoints of one node's workloads (engines that speak the protocol)."""

    def __init__(self, node: NodeRunner, min_session_tokens: int = MIN_TOKENS):
        self.node = node
        self.store = node.store
        self.chunks = ChunkStore(node.store.root)
        self.min_session_tokens = min_session_tokens

    # --- names ------------------------------------------------------------------------------
    @staticmethod
    def template_name(w: Workload, info: dict) -> str:
        import hashlib

        key = f"{info['template_key']}|{w.engine_version}|{w.model_revision}"
        return TEMPLATE_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:16]

    def template_for(self, name: str, source: str | None = None) -> Manifest | None:
        """The newest valid template under ``name`` (taken from workload ``source``, if given).

        A template comes back with the PID and address of the worker it was taken from, so a
        workload recovers in place from its own; any template of the same key serves replicas
        of any workload of the model in namespaces (``start_replica``), and the weights' chunks
        are shared by all of them."""
        for m in self.store.list(name):
            if m.state.restorable and (source is None or _source_of(m) == source):
                return m
        return None

    def _sessions_of(self, w: Workload) -> list[Manifest]:
        return [m for m in self.store.list(w.name) if m.kind == "sessions"]

    def _records(self, m: Manifest) -> dict:
        return json.loads((self.store.images_dir(m) / SESSIONS_FILE).read_text())

    # --- session tier -----------------------------------------------------------------------
    def heartbeat(self, w: Workload, context: ExportContext | None = None, turn: bool = False) -> Manifest:
        """A session checkpoint of ``w``; captures the template first when none is valid.
        ``context``: weigh each grown session's export (policies/sessions.py); None exports all.
        ``turn``: the sessions to export are between two turns (the caller knows: it saw their
        turns end); the engine is asked for a turn-boundary export, holding only those sessions
        while it copies them out and serving the others on (an engine that cannot holds itself,
        as for any export). Ignored when the template is captured (that holds the engine anyway).

        Raises:
            EngineProtocolError: the engine refused (nothing written, the worker serves on).
            CriuError: the template dump failed (the worker gets its weights and sessions back).
        """
        with self.store.lock(w.name, wait_s=HEARTBEAT_LOCK_WAIT_S):
            info = engine.engine_info(w)
            if info.get("parked"):  # a capture whose runner died after the engine released its weights
                prev = next((m for m in self._sessions_of(w) if m.state.restorable), None)
                self._unpark_interrupted(w, self._records(prev)["sessions"] if prev else {})
                info = engine.engine_info(w)
            name = self.template_name(w, info)
            tmpl = self.template_for(name, source=w.name)
            if tmpl is not None:
                try:
                    self.node.gate(w, tmpl)
                except IncompatibleCheckpoint as e:  # this node changed since: capture anew
                    log.info("workload %s: template %s no longer fits: %s", w.name, tmpl.id, e.message)
                    tmpl = None
            if tmpl is None:  # the capture exported every session: its checkpoint is this heartbeat's
                return self._capture_template(w, name)
            return self._checkpoint_sessions(w, tmpl, held=info["sessions"], context=context, turn=turn,
                                             pending_lost=info.get("lost"))

    def turn_end_checkpoint(self, w: Workload, held: dict[str, int], at_turn_end: set[str],
                            context: ExportContext, supersedes: Manifest | None = None) -> Manifest | None:
        """A session checkpoint of the sessions in ``at_turn_end`` that the turn-end rule exports
        (``context.at_turn_end``), in the engine's turn mode; the rest kept as last checkpointed.
        None: none exported, or no template yet (the heartbeat takes it; runners/turns.py).
        ``supersedes``: the previous turn-end checkpoint, deleted once this one is committed (a
        loop that exports every few seconds must not pile up checkpoints; the heartbeat's stay
        for retention).

        Raises:
            EngineProtocolError: the engine refused (nothing written, the worker serves on).
        """
        with self.store.lock(w.name):
            info = engine.engine_info(w)
            if info.get("parked"):
                return None
            tmpl = self.template_for(self.template_name(w, info), source=w.name)
            newest = next((m for m in self._sessions_of(w) if m.state.restorable), None)
            # Only over the template the newest sessions are bound to, and one that still fits this
            # node: a new template (engine or model bumped, node changed) is the heartbeat's to take,
            # and a checkpoint over the old one would be the newest and refused at restore.
            if tmpl is None or newest is None or _bound_to(newest) != tmpl.id:
                return None
            try:
                self.node.gate(w, tmpl)
            except IncompatibleCheckpoint:
                return None
            m = self._checkpoint_sessions(w, tmpl, held=held, context=context, turn=True, at_turn_end=at_turn_end,
                                          pending_lost=info.get("lost"))
            if m is not None and supersedes is not None and supersedes.id != m.id:
                self.store.delete(supersedes)
            return m

    def _checkpoint_sessions(self, w: Workload, tmpl: Manifest, recs: dict | None = None,
                             moved: int | None = None, export_s: float | None = None,
                             held: dict[str, int] | None = None, context: ExportContext | None = None,
                             turn: bool = False, at_turn_end: set[str] | None = None,
                             pending_lost: list[str] | None = None) -> Manifest | None:
        """The session checkpoint of ``w`` over ``tmpl``: ``held`` (session -> tokens, as the
        engine reported them) decides what to export, or ``recs`` were exported already.
        ``turn``: ask for a turn-boundary export (``"turn": true``, see ``heartbeat``). Timings:
        ``export`` (the call), ``held`` (what the engine says it held: the whole worker, or for
        a turn export the exported sessions alone, ``turn`` = 1 then), ``adopt``, ``pause``
        (``held`` when the engine said, else the whole call). ``at_turn_end``: only these sessions
        are between turns (``turn_end_checkpoint``); the others are kept as last checkpointed, and
        nothing is committed (None) when none of these is exported. Each exported record keeps
        ``exported_at``, the time its state was taken (the turn-end rule's ``since_s``)."""
        prev = next((m for m in self._sessions_of(w)
                     if m.state.restorable and _bound_to(m) == tmpl.id), None)
        prev_doc = self._records(prev) if prev else {}
        old = prev_doc.get("sessions", {})
        t: dict[str, float] = {}
        if recs is not None:
            held = {k: r["tokens"] for k, r in recs.items()}
        taken_at = time.time()
        facts = session_facts(held, old, taken_at)
        # not at a turn end: in a turn (kept as checkpointed), unless unchanged since (said so)
        busy = [] if at_turn_end is None else [f for f in facts
                                               if f.id not in at_turn_end and f.tokens != f.tokens_at_ckpt]
        decisions = decide_sessions([f for f in facts if f not in busy], min_tokens=self.min_session_tokens,
                                    context=context)
        decisions += [SessionDecision(id=f.id, protect=f.id in old, export=False, listed=f.id not in old,
                                      reason="kept as last checkpointed: not at a turn end this look" if f.id in old else
                                      "in its first turn: listed until its turn end weighs it") for f in busy]
        keep = {d.id: old[d.id] for d in decisions if d.protect and not d.export}
        export = [d.id for d in decisions if d.export]
        # ... and those a restore told the engine were lost and no client has come back for yet:
        # another restore must answer them the same
        listed = sorted({d.id for d in decisions if d.listed} | (set(pending_lost or ()) - set(held)))
        if at_turn_end is not None and not export and set(listed) <= set(prev_doc.get("listed", [])):
            return None
        self.chunks.touch([d for ds in _digests(old).values() for d in ds])  # relied on: young for GC
        if recs is None:
            recs = {}
            if export:
                with self.chunks.staging() as stage:
                    t0 = time.perf_counter()
                    body = {"dir": str(stage), "sessions": export,
                            "known": {k: v for k, v in _digests(old).items() if k in export}}
                    if turn:  # only when asked: an engine that predates the field never sees it
                        body["turn"] = True
                    answer = engine.call(w, "/v1/ckptflow/sessions/export", body)
                    recs = answer["sessions"]
                    if "held_s" in answer:  # the engine says how long it held the worker (copy out)
                        t["held"] = float(answer["held_s"])
                    if answer.get("turn"):  # ... and that it held only the exported sessions
                        t["turn"] = 1.0
                    t["export"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    _, moved = self.chunks.adopt(stage)
                    t["adopt"] = time.perf_counter() - t0
            else:
                moved, t["export"] = 0, 0.0
        else:
            t["export"] = export_s or 0.0
            recs = {k: r for k, r in recs.items() if k in export}
        for r in recs.values():
            r.setdefault("exported_at", taken_at)
        recs = keep | recs
        # Each session's digest is in its record; no golden request or probe here (a restore
        # compares what the engine imports with the records).
        load = engine.read_load(w)  # its token counter: what the cadence policy compares the next tick with
        pending = self.store.begin(w.name, node=w.node)
        try:
            for r in recs.values():
                r.pop("written_bytes", None)
            (pending.images_dir / SESSIONS_FILE).write_text(json.dumps(
                {"template": tmpl.id, "template_workload": tmpl.workload, "sessions": recs, "listed": listed}))
            named = sorted({d for ds in _digests(recs).values() for d in ds})
            (pending.images_dir / REFS_FILE).write_text(json.dumps(named))
            # No manifest without its bytes; each chunk was hashed when adopted (scrubs: verify flow).
            self.chunks.present(named)
        except BaseException:
            self.store.abort(pending)
            raise
        total = sum(r["total_bytes"] for r in recs.values())
        changed = sorted(sid for sid, ds in _digests(recs).items() if ds != _digests(old).get(sid))
        probe = ManifestProbe(tokens_total=load.tokens_total if load is not None else None,
                              template=TemplateBinding(id=tmpl.id, workload=tmpl.workload),
                              export=SessionExport(total_bytes=total, moved_bytes=moved or 0, changed=changed,
                                                   decisions={d.id: d.reason for d in decisions},
                                                   at_turn_end=at_turn_end is not None))
        return self.store.commit(
            pending, kind="sessions", parent=prev.id if prev else None, pid=tmpl.pid,
            fingerprint=workload_fingerprint(w, self.node.node_fp),
            timings={k: round(v, 4) for k, v in t.items()} | {"pause": round(t.get("held", t["export"]), 4)},
            probe=probe)

    # --- template tier ----------------------------------------------------------------------
    def _capture_template(self, w: Workload, name: str) -> Manifest:
        """Park the engine (sessions out as chunks, weights out as chunks, both released), dump
        it, and give it its weights and sessions back; returns the session checkpoint over the
        new template. Sessions already bound to an older template of this workload are
        invalidated with the reason."""
        proc = process.resolve(w)
        t: dict[str, float] = {}
        with self.chunks.staging() as stage:
            t0 = time.perf_counter()
            recs = engine.call(w, "/v1/ckptflow/sessions/export", {"dir": str(stage), "known": {}})["sessions"]
            moved = self.chunks.adopt(stage)[1]
            t["export"] = time.perf_counter() - t0
        known = [d for m in self.store.list(name) if m.probe.weights for d in m.probe.weights.chunks]
        self.chunks.touch(known)  # the engine skips these: they must outlive a collect meanwhile
        with self.chunks.staging() as stage:
            t0 = time.perf_counter()
            try:
                weights = engine.call(w, "/v1/ckptflow/template/prepare", {"dir": str(stage), "known": known})
            except CkptflowError:  # the engine may have released its weights before the call failed
                self._unpark_interrupted(w, recs)
                raise
            t["prepare"] = time.perf_counter() - t0
            for k, v in (weights.get("phases") or {}).items():
                t[f"prepare_{k}"] = v
            pending = None
            try:
                self.chunks.adopt(stage)
                pending = self.store.begin(name, node=w.node)
                dumped = self.node.dump(w, proc, pending.images_dir, leave_running=True)
                t.update(dumped.timings)
                (pending.images_dir / WEIGHTS_FILE).write_text(json.dumps(weights["tensors"]))
                digests = [d for r in weights["tensors"] for d in r["chunks"]]
                (pending.images_dir / REFS_FILE).write_text(json.dumps(sorted(set(digests))))
            except BaseException:
                if pending is not None:
                    self.store.abort(pending)
                self._unpark(w, weights["tensors"], recs)  # never leave the worker without its state
                raise
        t0 = time.perf_counter()
        self._unpark(w, weights["tensors"], recs)
        t["unpark"] = time.perf_counter() - t0
        tmpl = self.store.commit(pending, kind=CheckpointKind.engine_template, pid=dumped.pid, gpu_footprint_bytes=dumped.footprint,
                                 gpu_pids=dumped.gpu_pids, gpu_footprints=dumped.per_gpu,
                                 fingerprint=workload_fingerprint(w, self.node.node_fp),
                                 timings={k: round(v, 4) for k, v in t.items()},
                                 probe=ManifestProbe(
                                     source=TemplateSource(workload=w.name, base_url=engine.base_url(w)),
                                     weights=WeightChunks(bytes=weights["total_bytes"], chunks=digests)))
        for m in self._sessions_of(w):  # bound to a template this workload no longer uses
            if m.state.restorable and _bound_to(m) != tmpl.id:
                self.store.set_state(m, CheckpointState.invalidated, f"its template {_bound_to(m)} "
                                     f"was replaced by {tmpl.id}")
        return self._checkpoint_sessions(w, tmpl, recs, moved, t["export"])

    def _unpark(self, w: Workload, tensors: list[dict], recs: dict) -> None:
        self._load(w, tensors, recs, {})

    def _unpark_interrupted(self, w: Workload, recs: dict) -> None:
        """Give a parked engine its weights back from where it says it wrote them (adopted into
        the store first), then the sessions ``recs``: those just exported, or after a runner
        died, the workload's newest session checkpoint (the sessions roll back to it, as after
        a crash).

        Raises:
            EngineProtocolError: the engine is parked and cannot be given its weights back.
        """
        try:
            info = engine.engine_info(w)
        except CkptflowError:
            return  # gone or not answering: nothing to give back to
        if not info.get("parked"):
            return
        with_ = info.get("parked_with") or {}
        log.warning("workload %s: the engine was left parked by an interrupted template capture; "
                    "giving it its weights back from %s", w.name, with_.get("dir"))
        try:
            src = Path(with_["dir"])
            if src.is_dir() and src.parent == self.chunks.root / ".staging":
                self.chunks.adopt(src)
            self.chunks.present([d for r in with_["tensors"] for d in r["chunks"]])
            self._load(w, with_["tensors"], recs, {})
        except (KeyError, TypeError, CkptflowError) as e:
            raise EngineProtocolError(f"workload {w.name}: the engine is parked (weights released by an "
                                      f"interrupted template capture) and cannot be given them back: "
                                      f"{getattr(e, 'message', e)}",
                                      fix="restart the worker (cold start); it holds no sessions now") from None

    # --- shared tier --------------------------------------------------------------------------
    def push(self, m: Manifest, tier) -> dict:
        """Copy session checkpoint ``m`` to the shared ``tier`` (store.tier.CheckpointTier),
        its template first when the tier lacks it; each with the chunks it names (weights once
        per model, then only changed session chunks: the tier skips chunks it holds)."""
        tmpl = self.store.get(m.probe.template.workload, m.probe.template.id)
        out: dict = {}
        if tmpl.id not in tier.ids(tmpl.workload):
            out["template_uploaded_bytes"] = tier.push(self.store, tmpl)["uploaded_bytes"]
        return tier.push(self.store, m) | out

    def fetch(self, w: Workload, tier) -> Manifest | None:
        """Pull ``w``'s newest restorable session checkpoint from ``tier`` (and its template)
        into this node's store when it is newer than any here: what a restore on another node
        needs. Returns the pulled session manifest, or None when this node has the newest."""
        here = next((m for m in self._sessions_of(w) if m.state.restorable), None)
        for cid in tier.ids(w.name):  # newest first
            if here is not None and here.id >= cid:
                return None
            rm = tier.manifest(w.name, cid)
            if rm.kind != "sessions" or not rm.state.restorable:
                continue
            tier.pull(self.store, rm.probe.template.workload, rm.probe.template.id, w.node)
            return tier.pull(self.store, w.name, cid, w.node, remote=rm)[0]
        return None

    # --- restore ----------------------------------------------------------------------------
    def restore(self, w: Workload, tier=None) -> TemplateSessionsResult:
        """Template image, then weights, then ``w``'s newest session checkpoint (pulled first
        from ``tier``, the shared tier, when it holds a newer one than this node).

        Raises:
            WorkloadRunning: the worker runs (NodeRunner.refuse_if_running, which first clears what
                an interrupted restore left).
            IncompatibleCheckpoint: the session checkpoint's template is gone, invalidated or of
                another fingerprint or model revision (before any CRIU call; final).
            CheckpointNotFound: ``w`` has no session checkpoint.
            ChecksumMismatch: a chunk is missing or torn (before any CRIU call).
        """
        with self.store.lock(w.name):
            self.node.refuse_if_running(w)  # also clears what an interrupted restore left
            t: dict[str, float] = {}
            if tier is not None:
                t0 = time.perf_counter()
                try:
                    self.fetch(w, tier)
                except StorageUnavailable as e:  # this node's own copies may still do
                    log.warning("workload %s: shared tier unreachable, restoring from this node: %s", w.name, e)
                t["fetch"] = time.perf_counter() - t0
            m, tmpl = self._newest(w)
            t0 = time.perf_counter()
            recs, weights, listed = self._checked_records(m, tmpl)
            t["chunks_checked"] = time.perf_counter() - t0
            self.node.gate_gpu_memory(w, tmpl)  # each GPU against its share; a template that recorded none is refused
            pid = self.node.restore_verified(w, tmpl, t)
            t.update(self.node.resume_devices(w, pid, tmpl, None))
            if w.find.pid_file:
                write_pid_file(Path(w.find.pid_file), pid)
            try:
                got = self._load(w, weights, recs, t, lost=listed)
            except CkptflowError:
                # A template without its weights or sessions must not pass for the workload.
                for p in process.tree(pid):
                    os.kill(p, signal.SIGKILL)
                raise
            t["health"] = engine.wait_healthy(w)
            _check_sessions(w, recs, got, f"restored from template {tmpl.id} + sessions {m.id}")
            engine.answers_real_work(w, pid, f"restored from template {tmpl.id} + sessions {m.id}")
            # Counted where status and the exporter read restores, as a whole-process restore is.
            m = self.store.set_state(m, m.state, m.state_reason,
                                     restores=m.probe.restores.adding(round(sum(t.values()), 4)))
            return TemplateSessionsResult(manifest=m, template=tmpl, pid=pid,
                                          timings={k: round(v, 4) for k, v in t.items()})

    def start_replica(self, w: Workload, netns: str, timeout_s: float = 60,
                      template_source: str | None = None) -> tuple["SandboxCopy", dict]:
        """A copy of ``w``'s template, in its own PID namespace and network namespace ``netns``,
        given the weights and then ``w``'s newest sessions: any workload of the model can start
        from the one template. The copy answers on the template source's address inside
        ``netns``; stopping it (``SandboxCopy.stop``) and deleting ``netns`` is the caller's.

        Raises:
            UnsupportedWorkload: a GPU template that cannot be restored beside its source (the
                driver restores device state only into the PID that took it, unless the worker was
                started isolated: NodeRunner.copy_unsupported).
            IncompatibleCheckpoint, CheckpointNotFound, ChecksumMismatch: as ``restore``.
        """
        sb = self.standby(w, netns, timeout_s, template_source)
        try:
            promoted = self.promote(w, sb)
        except BaseException:
            sb.copy.stop()
            raise
        return sb.copy, sb.timings | promoted.timings | {"template": sb.template.id, "sessions": promoted.manifest.id,
                                                          "base_url": sb.base}

    def standby(self, w: Workload, netns: str, timeout_s: float = 60,
                template_source: str | None = None) -> "Standby":
        """``w``'s template restored ahead of need and parked: a copy in its own PID namespace and
        network namespace ``netns`` (another node's, in a fleet), its CUDA context and graphs back,
        no weights and no sessions on it. A failover is then only ``promote``: weights and sessions
        streamed in (one call, ``_load``), no CRIU and no device restore. Stopping it is the caller's.

        Example:
            >>> sb = tt.standby(workload, new_netns("standby"))     # doctest: +SKIP
            >>> tt.promote(workload, sb).timings                     # after the worker died

        Raises:
            UnsupportedWorkload, IncompatibleCheckpoint, CheckpointNotFound: as ``start_replica``.
            NotEnoughGpuMemory: no room for the template's device footprint beside the worker.
        """
        m, tmpl = self._newest(w)
        if template_source and template_source != _source_of(tmpl):
            other = self.template_for(tmpl.workload, source=template_source)  # same key: same engine and weights
            if other is None:
                raise CheckpointNotFound(f"no valid template of {tmpl.workload} taken from {template_source}",
                                         fix="run a two-tier heartbeat of that workload first")
            self.node.gate(w, other)
            tmpl = other
        t: dict[str, float] = {}
        copy = self.node.restore_copy(w, tmpl, netns, t)
        base = (tmpl.probe.source.base_url if tmpl.probe.source else None) or engine.base_url(w)
        try:
            def answers() -> dict:  # the copy's server may take a moment to accept in its namespace
                try:
                    return engine.call(w, "/v1/ckptflow/engine", base=base, netns=netns, timeout_s=5)
                except EngineProtocolError as e:
                    if not e.retryable:
                        raise
                    raise NotYet(e.message) from None

            t0 = time.perf_counter()
            try:
                poll(answers, timeout_s, 0.02, what=f"the copy's engine at {base} in {netns}")
            except PollTimeout as e:
                raise EngineProtocolError(f"workload {w.name}: {e}", retryable=True) from None
            t["answers"] = round(time.perf_counter() - t0, 4)
            t0 = time.perf_counter()
            try:   # optional: what the engine can take before the failover (demo: pinned slots)
                engine.call(w, "/v1/ckptflow/template/warm", {}, base=base, netns=netns, timeout_s=30)
                t["warm"] = round(time.perf_counter() - t0, 4)
            except EngineProtocolError as e:
                log.debug("workload %s: standby not warmed: %s", w.name, e.message)
        except BaseException:
            copy.stop()
            raise
        return Standby(copy=copy, netns=netns, template=tmpl, base=base, timings=t)

    def promote(self, w: Workload, sb: "Standby") -> TemplateSessionsResult:
        """Give standby ``sb`` the weights and ``w``'s newest sessions: it then serves ``w`` at
        ``sb.base`` in ``sb.netns``. Session chunks are hashed on the host only when their
        records carry no GPU fingerprints; otherwise the engine checks every block on the GPU as
        it imports them (a torn chunk fails the import), as it does for the weights. On failure
        the standby is left for the caller to stop: it may hold half of the state.

        Raises:
            IncompatibleCheckpoint: the newest session checkpoint is bound to another template than
                the standby's (take a new standby, or restore).
            CheckpointNotFound, ChecksumMismatch, EngineProtocolError: as ``restore``.
        """
        m = next((m for m in self._sessions_of(w) if m.state.restorable), None)
        if m is None:
            raise CheckpointNotFound(f"workload {w.name} has no session checkpoint in {self.store.root}",
                                     fix="run a two-tier heartbeat first, or cold start the worker")
        # Any valid template of the same key will do (same engine, weights and revision: what
        # start_replica's template_source relies on), but not one invalidated since the standby.
        try:
            now = self.store.get(sb.template.workload, sb.template.id)
        except CheckpointNotFound:
            now = None
        if now is None or not now.state.restorable or not m.probe.template \
                or m.probe.template.workload != sb.template.workload:
            why = f"{now.state.value}: {now.state_reason}" if now is not None and not now.state.restorable else \
                (m.probe.template.workload if m.probe.template else None)
            raise IncompatibleCheckpoint({"template": (sb.template.id, why)}, checkpoint=m.id)
        self.node.gate(w, now)
        t: dict[str, float] = {}
        t0 = time.perf_counter()
        recs, weights, listed = self._checked_records(m, sb.template, hash_sessions=None)
        t["chunks_checked"] = time.perf_counter() - t0
        got = self._load(w, weights, recs, t, lost=listed, base=sb.base, netns=sb.netns)
        _check_sessions(w, recs, got, f"a standby of template {sb.template.id} given sessions {m.id}")
        return TemplateSessionsResult(manifest=m, template=sb.template, pid=sb.copy.pid,
                                      timings={k: round(v, 4) for k, v in t.items()})

    def _checked_records(self, m: Manifest, tmpl: Manifest, hash_sessions: bool | None = True
                         ) -> tuple[dict, list[dict], list[str]]:
        """(session records of ``m``, weight records of ``tmpl``, the sessions ``m`` lists without
        their KV), every chunk they name here.
        Session chunks are hashed now, in parallel (one thread took 4.5 s for 5 GiB on the
        H200); the weights (GiBs) only checked for presence and size: the engine checks their
        bytes as it loads them (hashing them here too cost 7.8 s of 12.8 s for 8 GiB on the H200).
        ``hash_sessions=None``: hash the session chunks unless every record is one the engine
        checks on the GPU as it imports it (``engines.adapter.gpu_checkable``).

        Raises:
            ChecksumMismatch: a chunk is missing, or a session chunk is torn.
        """
        doc = self._records(m)
        recs = doc["sessions"]
        weights = json.loads((self.store.images_dir(tmpl) / WEIGHTS_FILE).read_text())
        for r in weights:
            self.chunks.present(r["chunks"], r.get("nbytes"))
        digests = [d for ds in _digests(recs).values() for d in ds]
        if hash_sessions is None:
            hash_sessions = not all(r.get("tensors") and all(gpu_checkable(t) for t in r["tensors"])
                                    for r in recs.values())
        if hash_sessions:
            self.chunks.verify(digests)
        else:  # the engine hashes them on the GPU as they land
            self.chunks.present(digests)
        return recs, weights, doc.get("listed", [])

    def _load(self, w: Workload, weights: list[dict], recs: dict, t: dict, lost: list[str] | None = None,
              **where) -> dict[str, str]:
        """Weights and sessions into a restored template; the digests the engine imported.
        ``lost``: sessions the checkpoint lists without their KV: the engine answers their next
        turn 'lost' (HTTP 410) instead of starting them afresh.

        One call: ``template/resume`` carries the sessions too, and an engine that takes them
        streams weights and session chunks in one pass and answers ``imported`` and ``digests``
        (timings ``load``, and the engine's phases as ``load_*``). An engine that answers without
        them (one that predates the field ignores it) gets the sessions by ``sessions/import``
        after (timings ``weights``, ``weights_*``, ``sessions``). Either way a torn chunk fails the
        call that carried it, named by the engine.

        Raises:
            EngineProtocolError: the engine refused either call (its reason names the chunk).
        """
        root = str(self.chunks.root)
        t0 = time.perf_counter()
        if lost:
            log.warning("workload %s: %d session(s) listed without their KV, answered 'lost' after this restore: %s",
                        w.name, len(lost), ", ".join(lost[:8]))
        extra = {"lost": list(lost)} if lost else {}
        done = engine.call(w, "/v1/ckptflow/template/resume",
                           {"dir": root, "tensors": weights, "sessions": recs, **extra}, **where)
        took = time.perf_counter() - t0
        one_pass = "imported" in done and "digests" in done
        part = "load" if one_pass else "weights"
        t[part] = took
        for k, v in (done.get("phases") or {}).items():  # the engine's own split (map, stream, ...)
            t[f"{part}_{k}"] = v
        if one_pass:
            return done["digests"]
        t0 = time.perf_counter()
        got = engine.call(w, "/v1/ckptflow/sessions/import", {"dir": root, "sessions": recs, **extra}, **where)
        t["sessions"] = time.perf_counter() - t0
        return got.get("digests", {})

    def _newest(self, w: Workload) -> tuple[Manifest, Manifest]:
        """``w``'s newest valid session checkpoint and its template (gated: see _template_of)."""
        m = next((m for m in self._sessions_of(w) if m.state.restorable), None)
        if m is None:
            raise CheckpointNotFound(f"workload {w.name} has no session checkpoint in {self.store.root}",
                                     fix="run a two-tier heartbeat first, or cold start the worker")
        return m, self._template_of(w, m)

    def _template_of(self, w: Workload, m: Manifest) -> Manifest:
        tid, tname = (m.probe.template.id, m.probe.template.workload) if m.probe.template else (None, None)
        try:
            tmpl = self.store.get(tname, tid)
        except (CheckpointNotFound, TypeError, ValueError):
            raise IncompatibleCheckpoint({"template": (tid, None)}, checkpoint=m.id) from None
        if not tmpl.state.restorable:
            raise IncompatibleCheckpoint({"template": (tid, f"{tmpl.state.value}: {tmpl.state_reason}")},
                                         checkpoint=m.id)
        self.node.gate(w, tmpl)  # another model revision, engine version or node: refused here
        return tmpl


def _bound_to(m: Manifest) -> str | None:
    """The id of the template session checkpoint ``m`` was taken over (None: none recorded)."""
    return m.probe.template.id if m.probe.template else None


def _source_of(tmpl: Manifest) -> str | None:
    """The workload template ``tmpl`` was captured from (None: none recorded)."""
    return tmpl.probe.source.workload if tmpl.probe.source else None


def _check_sessions(w: Workload, recs: dict, got: dict[str, str], what: str) -> None:
    """Every protected session holds the state its export recorded (unchanged ones as of their
    own last export; every session is protected: policies.sessions).

    Raises:
        RestoreFailed: naming the sessions that differ.
    """
    want = {k: r["digest"] for k, r in recs.items() if "digest" in r}
    # Sessions the engine holds beyond the records (a template's own) are not the checkpoint's.
    c = compare_sessions(EngineProbe.model_construct(sessions=want),
                         EngineProbe.model_construct(sessions={k: v for k, v in got.items() if k in want}))
    if not c.equal:
        raise RestoreFailed(f"workload {w.name}: {what}, but sessions differ from their export: "
                            f"{c.named()}", fix="mark the checkpoint bad and run verify")


class TemplateSessionsMode(ModeRunner):
    """``template-sessions`` (ckptflow.modes; old name two-tier): through ``TemplateSessionsRunner``."""

    def runner(self) -> TemplateSessionsRunner:
        """The two-tier runner with this mode's parameters (the turn-end loop drives it directly)."""
        n = getattr(self.params, "min_session_tokens", None)
        return TemplateSessionsRunner(self.node, MIN_TOKENS if n is None else n)

    def checkpoint(self, w: Workload, context=None) -> Manifest:
        return self.runner().heartbeat(w, context)

    def restore(self, w: Workload, tier=None) -> Restored:
        tt = self.runner().restore(w, tier=tier)
        export = tt.manifest.probe.export
        return Restored(tt.manifest, tt.pid, tt.timings, export.total_bytes if export else 0, template=tt.template)

    def push(self, m: Manifest, tier) -> dict:
        return self.runner().push(m, tier)

    def verify(self, w: Workload, m: Manifest):
        return verify_template_sessions(self.node, w, m)


def verify_template_sessions(node: NodeRunner, w: Workload, m: Manifest) -> "VerifyResult":
    """A two-tier checkpoint, verified the way a whole one is (runners/verify.py): a copy of the
    workload's template given its sessions ``m``, in its own PID and network namespaces beside the
    live original; every imported session must hold the state that was exported. GPU workloads:
    skipped (GPU_SANDBOX)."""
    from ckptflow.models import VerifyOutcome
    from ckptflow.runners.digests import VerifyResult
    from ckptflow.runners.verify import GPU_SANDBOX, del_netns, new_netns

    if not node.gpu_for(w).restores_beside:
        return VerifyResult(state=VerifyOutcome.skipped, reason=GPU_SANDBOX)
    ns = new_netns("cktv")
    copy = None
    try:
        t0 = time.perf_counter()
        copy, info = TemplateSessionsRunner(node).start_replica(w, ns)
        timings = {k: v for k, v in info.items() if isinstance(v, float)} | {"total": time.perf_counter() - t0}
        if info["sessions"] != m.id:
            return VerifyResult(state=VerifyOutcome.skipped, reason=f"a newer session checkpoint {info['sessions']} exists")
        return VerifyResult(state=VerifyOutcome.verified, reason=f"template {info['template']} + sessions {m.id}: every "
                            "session came back as exported", timings=timings)
    except CkptflowError as e:
        return VerifyResult(state=VerifyOutcome.verify_failed, reason=e.message.splitlines()[0])
    finally:
        if copy is not None:
            copy.stop()
        del_netns(ns)
