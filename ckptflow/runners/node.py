"""One node-level step each: checkpoint a declared workload into the store, restore it back.

This is what the Prefect tasks call. It ties the process finder, the CRIU runner (and, for
GPU workers, the node's GPU backend: runners/gpu), the engine's hooks and the store together,
records phase timings, and leaves nothing half-done: a failed dump discards its bytes, a failed
restore never marks anything.

Example:
    >>> node = NodeRunner(LocalStore(".ckptflow/store"))          # doctest: +SKIP
    >>> m = node.checkpoint(workload)                               # heartbeat, leave running
    >>> r = node.restore(workload)                                   # latest valid checkpoint
"""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ckptflow.errors import (CheckpointNotFound, ChecksumMismatch, CkptflowError, ConfigError, CriuError,
                             EngineProtocolError,
                             IncompatibleCheckpoint, NotEnoughGpuMemory, RestoreFailed, RunnerUnavailable,
                             StorageUnavailable, UndeclaredProcess, UnsupportedWorkload, WorkloadNotFound,
                             WorkloadRunning)
from ckptflow.models import CheckpointKind, CheckpointState, Fingerprint, Manifest, ManifestProbe, Workload
from ckptflow.policies.compat import diff
from ckptflow.policies.multigpu import FIX as TP_FIX
from ckptflow.policies.tiers import LocalCopy, restore_order
from ckptflow.poll import PollTimeout, poll
from ckptflow.results import Skipped
from ckptflow.runners import devshm, engine, process
from ckptflow.runners.criu import CriuRunner, SandboxCopy, copy_pids, image_isolated, refuse_uncarriable
from ckptflow.runners.digests import compare_sessions
from ckptflow.runners.engine import probe, read_load
from ckptflow.runners.facts import tp_unsupported
from ckptflow.runners.fingerprint import node_fingerprint
from ckptflow.runners.gpu import GpuBackend, backend_for, get_backend, restore_needs
from ckptflow.runners.runtime import runtime_for
from ckptflow.store.local import LocalStore

if TYPE_CHECKING:
    from ckptflow.runners.cuda import CudaRunner
    from ckptflow.runners.runtime import WorkloadRuntime

log = logging.getLogger("ckptflow")
# The timing keys of the device steps, whatever the backend: manifests, bench results and the
# cadence facts (runners/facts.py) read these names.
DEVICE_CHECKPOINT, DEVICE_RESTORE = "cuda_checkpoint", "cuda_restore"
# Restores of one checkpoint that may fail before it is passed over: one more than a retry of a
# flaky node, few enough that recover does not loop on an image that cannot come back.
MAX_FAILED_RESTORES = 3


@dataclass
class RestoreResult:
    manifest: Manifest
    pid: int
    timings: dict[str, float]
    skipped: list[Skipped] = field(default_factory=list)  # corrupt checkpoints passed over
    downloaded_bytes: int = 0                           # pulled from the S3 tier (0: read in place)


@dataclass
class Dumped:
    """What one dump of a worker took: its image's root PID, phase timings, and its device
    footprint (all devices, per device UUID, and the PIDs whose device state was taken)."""

    pid: int
    timings: dict[str, float]
    footprint: int = 0
    gpu_pids: list[int] = field(default_factory=list)
    per_gpu: dict[str, int] = field(default_factory=dict)


class NodeRunner:
    """Checkpoint and restore declared workloads of this node."""

    def __init__(self, store: LocalStore, criu: CriuRunner | None = None, cuda: "CudaRunner | None" = None,
                 node_fp: Fingerprint | None = None, gpu: GpuBackend | str | None = None):
        """``gpu``: this node's GPU backend, or its registered name (default ``cuda``, the fleet
        file's ``gpu_backend:`` of the node); ``cuda``: a CudaRunner for the cuda backend (tests
        pass a simulated driver)."""
        self.store = store
        self._own_criu = criu is None  # a runner passed in belongs to the caller, who closes it
        self.criu = criu or CriuRunner()
        if cuda is not None:
            from ckptflow.runners.gpu.cuda import CudaBackend

            gpu = CudaBackend(runner=cuda)
        self.gpu = gpu if isinstance(gpu, GpuBackend) else get_backend(gpu)
        self._node_fp = node_fp

    def __enter__(self) -> "NodeRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove what this runner's CRIU calls left in its temporary directory (logs, pid files)."""
        if self._own_criu:
            self.criu.close()

    @property
    def node_fp(self) -> Fingerprint:
        if self._node_fp is None:
            self._node_fp = node_fingerprint(self.criu.criu_bin, self.gpu.name)
        return self._node_fp

    def runtime_for(self, w: Workload) -> "WorkloadRuntime":
        """The runtime ``w`` runs under (runners/runtime: its ``runtime:``, else what it declares), on this node."""
        return runtime_for(w, self)

    def gate(self, w: Workload, m: Manifest, overrides: frozenset[str] = frozenset()) -> None:
        """Refuse a checkpoint taken on another fingerprint, before any CRIU, CUDA or runtime call:
        the host, the GPU backend's groups and the workload, plus the workload runtime's own (a
        container's runtime versions).

        Raises:
            IncompatibleCheckpoint: naming every differing field as old -> new (final).
        """
        rt = self.runtime_for(w)
        groups = ("host", *self.gpu_for(w).gated, "workload", *rt.gated)
        c = diff(m.fingerprint, rt.fingerprint(w), overrides, groups)
        if c.skipped:
            log.warning("checkpoint %s of %s: neither it nor this node records %s; not checked", m.id, w.name,
                        ", ".join(c.skipped))
        for f, (a, b) in c.overridden.items():
            log.warning("OVERRIDE: restoring %s of %s although %s differs: %r -> %r", m.id, w.name, f, a, b)
        if not c.ok:
            raise IncompatibleCheckpoint(c.differences, checkpoint=m.id)

    def gpu_for(self, w: Workload) -> GpuBackend:
        """The backend that handles ``w``'s device state: this node's, or NO_GPU for a CPU worker."""
        return backend_for(w, self.gpu)

    def restore_needs(self, m: Manifest, gpu_pairs: list[tuple[str, str]] | None = None) -> dict[str, int]:
        """Bytes a restore of ``m`` needs on each of this node's GPUs (by UUID); {} for a checkpoint
        that recorded its footprint as one total only (older manifests)."""
        if not m.gpu_footprints:
            return {}
        return restore_needs(m.gpu_footprints, gpu_pairs, m.fingerprint.gpu_uuids if m.fingerprint else None,
                             self.node_fp.gpu_uuids)

    def gate_gpu_memory(self, w: Workload, m: Manifest, gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        """Refuse a GPU restore that would not fit, before any CRIU or CUDA call: each target GPU
        against what the checkpoint held on it (every rank of a TP worker on its own GPU). A CPU
        workload has nothing to fit.

        Raises:
            NotEnoughGpuMemory: a GPU has too little free memory, or the checkpoint recorded no GPU
                footprint at all (nothing to check it against: refused, not waved through).
            RunnerUnavailable: NVML cannot be read here.
        """
        self.gpu_for(w).gate_restore(w.name, m.id, self.restore_needs(m, gpu_pairs), m.gpu_footprint_bytes)

    @property
    def cuda(self) -> "CudaRunner":
        """The CUDA runner of a node whose backend is ``cuda`` (its driver state, for tests and benches)."""
        return self.gpu.runner  # type: ignore[attr-defined]

    def dump(self, w: Workload, proc, images_dir: Path, leave_running: bool) -> Dumped:
        """CRIU dump of ``w``'s tree, with its device state when it holds any: lock -> checkpoint ->
        CRIU dump [-> restore -> unlock]; every device restored and unlocked on any failure.

        Raises:
            UnsupportedWorkload: a tensor-parallel worker whose ranks cannot be checkpointed (nothing touched).
            RunnerUnavailable: the backend cannot say what device memory the worker holds (before any
                lock): without it no restore of this checkpoint could be gated.
            CriuError: the dump failed.
        """
        gpu = self.gpu_for(w)
        pids = gpu.processes(proc.pid)
        if not pids:  # no device state: CRIU alone
            res = self.criu.dump(w, images_dir, leave_running=leave_running, proc=proc)
            # A heartbeat holds the worker only while CRIU has it frozen; a dump that stops it
            # (migrate, drain) holds it until a restore, so there the whole run counts.
            held = res.frozen_s if leave_running and res.frozen_s is not None else res.seconds
            t = {"dump": round(res.seconds, 4), "pause": round(held, 4)}
            if res.frozen_s is not None:
                t["frozen"] = round(res.frozen_s, 4)
            return Dumped(res.pid, t)
        t: dict[str, float] = {}
        refuse_uncarriable(w, process.tree(proc.pid))  # before the prepare hook and any lock
        why = tp_unsupported(w, pids)
        if why:  # before the prepare hook and any lock: nothing touched
            raise UnsupportedWorkload(f"workload {w.name} (tensor_parallel: {w.tensor_parallel}) cannot be "
                                      f"checkpointed: {why}", fix=TP_FIX)
        quiesced, took = engine.quiesce(w, tp=len(pids) > 1)
        if took is not None:
            t["prepare"] = took
        url = quiesced.get("ranks_url")
        try:
            usage = gpu.usage(pids)
            blind = unseen_namespaces(pids, usage)
            if blind:  # a footprint read as 0 would let any restore of this checkpoint through the gate
                raise RunnerUnavailable(
                    f"workload {w.name}: {gpu.usage_source} attributes no GPU memory to any of PID(s) "
                    f"{', '.join(map(str, blind))} (of {', '.join(map(str, pids))}), so a restore could not be "
                    "checked against free GPU memory; not checkpointing",
                    fix="run ckptflow's worker in the worker's PID namespace (hostPID for a pod), where NVML's PIDs "
                    "are the worker's")
            # A PID with a device context and no memory the driver attributes (vLLM's API server,
            # measured on the H200: NVML lists only EngineCore) holds nothing to count: 0.
            footprints = {pid: sum(usage.get(pid, {}).values()) for pid in pids}
            per_gpu: dict[str, int] = {}
            for per in usage.values():
                for uuid, n in per.items():
                    per_gpu[uuid] = per_gpu.get(uuid, 0) + n
        except BaseException:
            engine.resume(w)  # quiesced above: it serves again
            raise
        t0 = time.perf_counter()
        try:
            # Any failure inside: restore + unlock every rank, then re-raise (GpuBackend.locked).
            with gpu.locked(pids, usage, explain=lambda: engine.rank_states(url)) as procs:
                t["lock"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                gpu.checkpoint(procs)
                t[DEVICE_CHECKPOINT] = time.perf_counter() - t0
                res = self.criu.dump(w, images_dir, leave_running=leave_running, proc=proc, refused=True)
                t["dump"] = res.seconds
                if leave_running:
                    t0 = time.perf_counter()
                    gpu.restore(procs, need_by_device=per_gpu)  # each GPU against its own share
                    t[DEVICE_RESTORE] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    gpu.unlock(procs)
                    t["unlock"] = time.perf_counter() - t0
        finally:
            engine.resume(w)  # a quiesced engine serves again, whatever happened
        t["pause"] = sum(v for k, v in t.items() if k != "prepare")  # prepare runs while serving
        return Dumped(res.pid, {k: round(v, 4) for k, v in t.items()}, sum(footprints.values()), pids, per_gpu)

    _dump_gpu = dump  # the name the CUDA path's tests call

    def checkpoint(self, w: Workload, *, leave_running: bool = True, kind: str | None = None) -> Manifest:
        """Dump ``w`` into the store and commit its manifest, through its workload runtime
        (runners/runtime: a process by CRIU, a container by its runtime, a pod by its kubelet).

        Raises:
            WorkloadNotFound / UndeclaredProcess: nothing declared to dump.
            CriuError: the dump failed (bytes discarded; the worker keeps running on heartbeat).
            StorageFull: the volume filled up (bytes discarded).
        """
        with self.store.lock(w.name):
            return self._checkpoint(w, leave_running, kind)

    def _checkpoint(self, w: Workload, leave_running: bool, kind: str | None = None) -> Manifest:
        rt = self.runtime_for(w)
        try:
            proc = rt.resolve(w)
        except WorkloadNotFound:
            rt.clear_leftovers(w)
            raise
        rt.refuse(w, proc)
        state = rt.record(w, proc, probe_for_checkpoint(w, probe))
        pending = self.store.begin(w.name, node=w.node)
        try:
            d = rt.dump(w, proc, pending.images_dir, leave_running)
        except CriuError as e:
            self.store.abort(pending)
            raise rt.dump_failed(w, proc, e) or e
        except BaseException:
            self.store.abort(pending)
            raise
        kind = kind or ("heartbeat" if leave_running else "migrate")
        m = self.store.commit(pending, timings=d.timings, probe=state, kind=kind, pid=d.pid,
                              gpu_footprint_bytes=d.footprint, gpu_pids=d.gpu_pids, gpu_footprints=d.per_gpu,
                              fingerprint=rt.fingerprint(w))
        rt.dumped(w, leave_running)
        return m

    def copy_unsupported(self, w: Workload, m: Manifest) -> str | None:
        """Why ``m`` cannot be restored as a copy beside its running original here, or None. A
        copy with device state needs a backend that restores it beside the original, or one that
        measured it for a worker born in its own namespaces (``ckptflow run-isolated``) and an
        image of such a worker."""
        gpu = self.gpu_for(w)
        if not m.gpu_pids or gpu.restores_beside:
            return None
        if gpu.restores_isolated_copy and image_isolated(self.store.images_dir(m)):
            return None
        return ("the driver restores device state only into the PID that took it, so a copy beside the "
                "original needs a worker started in its own namespaces"
                + (" (`ckptflow run-isolated`)" if gpu.restores_isolated_copy else
                   f" on a backend that supports it ({gpu.name} does not)"))

    def restore_copy(self, w: Workload, m: Manifest, netns: str, timings: dict[str, float] | None = None,
                     gate: bool = True) -> SandboxCopy:
        """A copy of ``m`` beside the running original, in its own PID namespace and in network
        namespace ``netns``; its device state, if any, restored and unlocked by the copy's own
        host PIDs (an isolated image keeps each process's PID inside its namespace, which maps
        the original's GPU PIDs to the copy's). Stopping it is the caller's (``copy.stop()``).
        ``gate``: check device memory for a second footprint first (False: the caller did).

        Raises:
            UnsupportedWorkload: see ``copy_unsupported`` (nothing restored).
            NotEnoughGpuMemory: no room for a second device footprint beside the original's.
            CriuError: the CRIU restore failed.
            GpuCheckpointError: the device restore failed (the copy is stopped).
        """
        why = self.copy_unsupported(w, m)
        if why:
            raise UnsupportedWorkload(f"workload {w.name}: {why}", fix="restore in place (recover) instead")
        t = timings if timings is not None else {}
        gpu = self.gpu_for(w)
        device = bool(m.gpu_pids) and not gpu.restores_beside
        if device and gate:
            self.gate_gpu_memory(w, m)
        images = self.store.images_dir(m)
        t0 = time.perf_counter()
        copy = self.criu.restore_beside(images, netns=netns, tcp_established=w.tcp_established)
        t["restore"] = round(time.perf_counter() - t0, 4)
        if device:
            t0 = time.perf_counter()
            try:
                procs = gpu.checkpointed(copy_pids(images, copy.pid, m.gpu_pids))
                gpu.restore(procs, footprint_bytes=m.gpu_footprint_bytes, need_by_device=self.restore_needs(m))
                gpu.unlock(procs)
            except BaseException:
                copy.stop()   # a copy whose device state is half back must not live on
                raise
            t["device_restore"] = round(time.perf_counter() - t0, 4)
        return copy

    def resume_devices(self, w: Workload, pid: int, m: Manifest, gpu_pairs: list[tuple[str, str]] | None) -> dict:
        """After CRIU restored ``m`` as ``pid``: its device state back (optionally onto other GPUs,
        ``gpu_pairs`` old -> new UUID), unlocked, and the engine let go. Timings; {} for a worker
        without device state."""
        gpu = self.gpu_for(w)
        procs = gpu.checkpointed(m.gpu_pids or gpu.processes(pid))
        if not procs:
            return {}
        t0 = time.perf_counter()
        gpu.restore(procs, footprint_bytes=m.gpu_footprint_bytes, device_map=gpu_pairs,
                    need_by_device=self.restore_needs(m, gpu_pairs))
        t1 = time.perf_counter()
        gpu.unlock(procs)
        t2 = time.perf_counter()
        # The image was taken while the engine was quiesced: the restored copy is held too.
        engine.resume(w)
        return {DEVICE_RESTORE: round(t1 - t0, 4), "unlock": round(t2 - t1, 4),
                "resume": round(time.perf_counter() - t2, 4)}

    def restore(self, w: Workload, *, manifest: Manifest | None = None, fallback: bool = True,
                gpu_pairs: list[tuple[str, str]] | None = None,
                overrides: frozenset[str] = frozenset(), tier=None) -> RestoreResult:
        """Restore ``w`` on ``w.node`` from ``manifest`` (default: its newest valid checkpoint,
        read from the nearest copy: this node's store, else pulled from ``tier``, the S3 tier).

        A checkpoint whose bytes fail their checksums is marked ``verify_failed`` and, with
        ``fallback``, the next candidate is tried (the bucket's copy of the same checkpoint,
        then older ones; see policies.tiers).

        Raises:
            RestoreFailed: the workload is still running (nothing to recover), or the restored
                process is unhealthy or its state differs from the checkpoint's.
            CheckpointNotFound: no valid checkpoint is left.
        """
        self._trying: str | None = None
        with self.store.lock(w.name):
            try:
                return self._restore(w, manifest, fallback, gpu_pairs, overrides, tier)
            except CkptflowError as e:  # the alert and the report name the checkpoint that was tried
                if getattr(e, "checkpoint", None) is None:
                    e.checkpoint = self._trying
                raise

    def _candidates(self, w: Workload, tier, skipped: list[Skipped],
                    overrides: frozenset[str]) -> Iterator[tuple[Manifest, dict, int]]:
        """(manifest, timings, downloaded bytes) of each checkpoint to try, nearest valid copy first; a bucket copy
        is gated on its fingerprint before a byte is downloaded."""
        remote: list[str] = []
        if tier is not None:
            try:
                remote = tier.ids(w.name)
            except StorageUnavailable as e:  # the node's own copies can still bring it back
                log.warning("workload %s: S3 tier unreachable, trying this node's copies only: %s", w.name, e)
        # Session checkpoints hold no process image: the two-tier runner restores those.
        local = [LocalCopy(m.id, m.state.value) for m in self.store.list(w.name)
                 if m.kind not in (CheckpointKind.sessions, CheckpointKind.session)]
        for c in restore_order(local, remote):
            if c.tier == "node":
                yield self.store.get(w.name, c.checkpoint), {}, 0
                continue
            rm = tier.manifest(w.name, c.checkpoint)
            if not rm.state.restorable:  # e.g. invalidated in the bucket after a version change
                continue
            self.gate(w, rm, overrides)
            t0 = time.perf_counter()
            try:
                m, pulled = tier.pull(self.store, w.name, c.checkpoint, w.node, remote=rm)
            except (ChecksumMismatch, StorageUnavailable) as e:
                skipped.append(Skipped(id=c.checkpoint, reason=f"s3 copy: {str(e).splitlines()[0]}"))
                continue
            yield m, {"download": round(time.perf_counter() - t0, 4)}, pulled["downloaded_bytes"]

    def refuse_if_running(self, w: Workload) -> None:
        """Before a restore in place (the workload lock held): refuse while ``w`` runs, after clearing
        what an interrupted restore left (the soak found both): its CRIU still restoring the worker
        is let finish (killed after 60 s), and a worker left stopped (a restore keeps it stopped until
        its checksums pass) is killed and its PIDs awaited, so the restore can take them again.

        Raises:
            WorkloadRunning: the worker runs (nothing to recover).
        """
        try:
            live = process.resolve(w)
        except (WorkloadNotFound, UndeclaredProcess):  # gone, or its stale pid file names another program
            live = None
        criu = process.restoring_criu(live.pid) if live is not None else None
        if criu is not None:  # a restore whose runner died: let its CRIU finish (the copy is then left stopped)
            log.warning("workload %s: PID %d is still being restored by CRIU (PID %d) of an interrupted "
                        "restore; waiting for it", w.name, live.pid, criu)
            try:
                poll(lambda: process.restoring_criu(live.pid) is None, 60, 0.05, what=f"CRIU {criu} to finish")
            except PollTimeout:
                os.kill(criu, signal.SIGKILL)
        if live is not None and process.pid_stopped(live.pid):
            # Restores leave the process stopped until its checksums pass. Holding the workload
            # lock, a stopped declared worker can only be what an interrupted restore left behind.
            log.warning("workload %s: PID %d is stopped, left by an interrupted restore; killing it", w.name, live.pid)
            left = process.tree(live.pid)
            for p in left:
                os.kill(p, signal.SIGKILL)
            for p in left:
                self.criu.wait_pid_free(p)
            live = None
        if live is not None:
            raise WorkloadRunning(f"workload {w.name} is running (PID {live.pid}); refusing to restore over it",
                                fix="stop it first, or use a sandbox restore (verify) to test a checkpoint")

    def _restore(self, w: Workload, manifest: Manifest | None, fallback: bool,
                 gpu_pairs: list[tuple[str, str]] | None, overrides: frozenset[str], tier=None) -> RestoreResult:
        rt = self.runtime_for(w)
        rt.clear(w)
        skipped: list[Skipped] = []
        candidates = iter([(manifest, {}, 0)]) if manifest else self._candidates(w, tier, skipped, overrides)
        tried = 0
        for m, timings, downloaded in candidates:
            tried += 1
            self._trying = m.id
            self.gate(w, m, overrides)
            rt.preflight(w, m, gpu_pairs)  # before the restore: refuse early, nothing touched
            try:
                pid = rt.restore(w, m, timings)
            except ChecksumMismatch as e:
                self.store.set_state(m, CheckpointState.verify_failed, f"checksum: {e}")
                skipped.append(Skipped(id=m.id, reason=str(e).splitlines()[0]))
                if not fallback:
                    raise
                continue
            except CkptflowError as e:
                self._failed_restore(w, m, e)
                raise
            try:
                rt.resumed(w, pid, m, gpu_pairs, timings)
                timings["health"] = round(engine.wait_healthy(w), 4)
                self._check_state(w, m)
                rt.serving(w, pid, m, timings)
            except CkptflowError as e:
                self._failed_restore(w, m, e)
                raise
            total = round(sum(v for k, v in timings.items() if k != "restore_and_checksum"), 4)
            m = self.store.set_state(m, m.state, m.state_reason, restores=m.probe.restores.adding(total))
            return RestoreResult(manifest=m, pid=pid, timings=timings, skipped=skipped, downloaded_bytes=downloaded)
        if not tried and not skipped:
            raise CheckpointNotFound(f"workload {w.name} has no valid checkpoint in {self.store.root}"
                                     + (f" or {tier.location}" if tier is not None else ""),
                                     fix=f"run a heartbeat first, or cold start the {rt.what}")
        err = ChecksumMismatch(f"workload {w.name}: every valid checkpoint failed its checksums: "
                               + "; ".join(s["reason"] for s in skipped),
                               fix=f"cold start the {rt.what}; the store volume may be failing")
        err.checkpoint = ", ".join(dict.fromkeys(s["id"] for s in skipped))
        raise err

    def remove_devshm_leftovers(self, w: Workload, newest: int = 3) -> list[str]:
        """The worker is gone: remove the /dev/shm files its newest checkpoints carry that no
        live process uses (a restore puts them back from the image; a cold start makes new
        ones). Returns the names removed (issue #36, finding 11)."""
        removed: list[str] = []
        for m in self.store.list(w.name)[:newest]:
            images = self.store.images_dir(m)
            if m.kind == CheckpointKind.sessions and m.probe.template:  # the template's image holds them
                try:
                    images = self.store.images_dir(self.store.get(m.probe.template.workload, m.probe.template.id))
                except CheckpointNotFound:
                    continue
            removed += devshm.remove_orphans(images)
        if removed:
            log.info("workload %s is gone: removed what it left in /dev/shm: %s", w.name, ", ".join(removed[:8]))
        return removed

    def _failed_restore(self, w: Workload, m: Manifest, e: CkptflowError) -> None:
        """Count a failed restore on its checkpoint; at MAX_FAILED_RESTORES it is marked
        verify_failed, so the next recover falls back to an older one (or says none is left)
        instead of trying the same image in a loop. A failure that is not the checkpoint's (a
        retryable one, the worker running, no room on the GPU, the node's own tools or a cluster
        out of reach, a wrong declaration, a node that lacks the worker's directory) is not counted:
        three of those would have the last good checkpoint marked failed, and retention then delete it."""
        if e.retryable or e.node_condition or isinstance(
                e, (WorkloadRunning, NotEnoughGpuMemory, RunnerUnavailable, ConfigError)):
            return
        why = (e.message if hasattr(e, "message") else str(e)).splitlines()[0][:300]
        try:
            cur = self.store.get(m.workload, m.id)
        except CheckpointNotFound:
            return
        history = cur.probe.restores.failing(why)
        state, reason = cur.state, cur.state_reason
        if len(history.failures) >= MAX_FAILED_RESTORES and state.restorable:
            state = CheckpointState.verify_failed
            reason = (f"{len(history.failures)} restores from it failed (the last: {why}); not tried again: "
                      "`ckptflow verify` it, or recover from an older checkpoint")
            log.warning("workload %s: checkpoint %s marked verify_failed: %s", w.name, m.id, reason)
        self.store.set_state(cur, state, reason, restores=history)

    def restore_verified(self, w: Workload, m: Manifest, timings: dict[str, float]) -> int:
        """CRIU restore (left stopped) while the image checksums are verified in parallel; the
        process runs (SIGCONT) only once every byte matched, and is killed unrun otherwise.

        Overlapping the two hides the checksum phase behind the restore (measured on the H200:
        5.6 s of checksums next to 20.6 s of CRIU restore at 50 GiB).
        """
        images = self.store.images_dir(m)

        def verify() -> float:
            t0 = time.perf_counter()
            self.store.verify_bytes(m)
            return time.perf_counter() - t0

        with ThreadPoolExecutor(max_workers=1) as ex:
            check = ex.submit(verify)
            t0 = time.perf_counter()
            try:
                pid = self.criu.restore(images, old_pid=m.pid or 0, tcp_established=w.tcp_established,
                                        leave_stopped=True)
            except CkptflowError:
                check.result()  # a corrupt image explains a failed restore: report that first
                raise
            timings["restore"] = round(time.perf_counter() - t0, 4)
            try:
                timings["checksum"] = round(check.result(), 4)
            except BaseException:
                restored = process.tree(pid)
                for p in restored:
                    os.kill(p, signal.SIGKILL)  # never ran a single instruction
                for p in restored:
                    self.criu.wait_pid_free(p)
                raise
        timings["restore_and_checksum"] = round(time.perf_counter() - t0, 4)
        # CRIU left every process of the tree stopped, not just the root (a TP worker's other
        # ranks too; a rank left stopped would hang its CUDA restore and every collective).
        for p in process.tree(pid):
            os.kill(p, signal.SIGCONT)
        return pid

    def _check_state(self, w: Workload, m: Manifest) -> None:
        """The restored worker's session digests against the checkpoint's (runners.digests).

        Raises:
            RestoreFailed: naming the sessions that differ.
        """
        if m.probe.sessions is None:
            if w.probe_url:  # a checkpoint taken before probe errors were refused
                log.warning("workload %s: restored from %s WITHOUT a session check: the checkpoint holds no session "
                            "digests (%s)", w.name, m.id, m.probe.error or "probe not read at checkpoint time")
            return
        if not m.probe.sessions:  # it held none: nothing to ask the worker
            return
        c = compare_sessions(m.probe, engine.probe(w), copy="the restored worker")
        if not c.equal:
            raise RestoreFailed(f"workload {w.name}: restored from {m.id} but sessions differ from the "
                                f"checkpoint: {c.named()}", fix="mark the checkpoint bad and run verify")


def unseen_namespaces(pids: list[int], usage: dict[int, dict[str, int]]) -> list[int]:
    """The device PIDs of every PID namespace of which the driver attributes memory to none.

    What the footprint gate must know is whether the recorded footprint covers the device memory
    the tree holds. A driver that sees a namespace's PIDs sees all of them, so a PID of a seen
    namespace without memory holds none (a context only); a namespace none of whose PIDs is seen
    is one the driver's PIDs do not name (a container without hostPID): unknown, not 0.

    Example:
        >>> import os
        >>> me = os.getpid()
        >>> unseen_namespaces([me, me], {me: {"GPU-0": 1}})
        []
        >>> unseen_namespaces([me], {}) == [me]
        True
    """
    by_ns: dict[str, list[int]] = {}
    for p in pids:
        try:
            ns = os.readlink(f"/proc/{p}/ns/pid")
        except OSError:
            ns = "?"  # gone or unreadable: grouped together, judged like any namespace
        by_ns.setdefault(ns, []).append(p)
    return [p for group in by_ns.values() if not any(sum(usage.get(q, {}).values()) for q in group) for p in group]


def probe_for_checkpoint(w: Workload, read=probe) -> ManifestProbe:
    """What a whole-worker checkpoint records before its dump: the engine's probe (``read``, the
    caller's ``engine.probe``) and its token counter.

    Raises:
        EngineProtocolError: the probe_url could not be read (retryable): stored, the error would
            switch the restore's session check off unseen.
    """
    state = read(w)
    if state.error:
        raise EngineProtocolError(
            f"workload {w.name}: {state.error} ({w.probe_url}); not checkpointing: a restore of it could "
            "not be checked against the sessions it held", retryable=True,
            fix="check the worker's probe endpoint (probe_url); the next heartbeat tries again")
    load = read_load(w)
    return ManifestProbe.model_validate(state.model_dump(exclude_defaults=True)
                                        | ({"tokens_total": load.tokens_total} if load is not None else {}))


def write_pid_file(path: Path, pid: int) -> None:
    try:
        if path.read_text().strip() == str(pid):
            return
    except FileNotFoundError:
        pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(pid))
    os.replace(tmp, path)

