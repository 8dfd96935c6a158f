"""One node-level step each: checkpoint a declared workload into the store, restore it back.

This is what the Prefect tasks call. It ties the process finder, the CRIU runner (and, for
GPU workers, the CUDA runner) and the store together, records phase timings, and leaves
nothing half-done: a failed dump discards its bytes, a failed restore never marks anything.

Example:
    >>> node = NodeRunner(LocalStore(".ckptflow/store"))          # doctest: +SKIP
    >>> m = node.checkpoint(workload)                               # heartbeat, leave running
    >>> r = node.restore(workload)                                   # latest valid checkpoint
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator
from pathlib import Path

import logging

from ckptflow.errors import (CheckpointNotFound, ChecksumMismatch, CkptflowError, CudaCheckpointError,
                             IncompatibleCheckpoint, RestoreFailed, StorageUnavailable, UndeclaredProcess,
                             UnsupportedWorkload, WorkloadBusy, WorkloadNotFound, WorkloadRunning)
from ckptflow.fleet import Node
from ckptflow.models import CheckpointState, Fingerprint, Manifest, Workload
from ckptflow.policies.cadence import WorkloadFacts
from ckptflow.policies.compat import diff
from ckptflow.runners.fingerprint import node_fingerprint, workload_fingerprint
from ckptflow.policies.load import WorkloadLoad, parse_metrics
from ckptflow.policies.multigpu import FIX as TP_FIX, tp_problems
from ckptflow.policies.tiers import LocalCopy, restore_order
from ckptflow.runners import process
from ckptflow.runners.criu import CriuRunner
from ckptflow.store.local import LocalStore

if TYPE_CHECKING:
    from ckptflow.runners.cuda import CudaRunner

HEALTH_TIMEOUT_S = 60
PREPARE_TIMEOUT_S = 60  # a quiesce waits for the request in flight (a long generation) to finish
log = logging.getLogger("ckptflow")


def _get_json(url: str, timeout_s: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def probe(w: Workload) -> dict:
    """What the worker says about its own state: session digests and the golden answer's digest."""
    out: dict = {}
    if w.probe_url:
        try:
            out["sessions"] = _get_json(w.probe_url)["sessions"]
        except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
            out["error"] = f"probe failed: {e}"
    if w.golden:
        try:
            req = urllib.request.Request(w.golden.url, data=json.dumps(w.golden.body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                out["golden"] = golden_digest(json.loads(r.read()), w.golden.field)
        except (urllib.error.URLError, OSError, KeyError, ValueError, IndexError) as e:
            out["golden_error"] = f"golden request failed: {e}"
    return out


def golden_digest(answer: dict, field: str) -> str:
    """sha256 of the answer's field at a dotted path (``choices.0.text``)."""
    import hashlib

    v: object = answer
    for part in field.split("."):
        v = v[int(part)] if isinstance(v, list) else v[part]  # type: ignore[index]
    return hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()


def cold_start(w: Workload) -> tuple[int, float]:
    """Start the worker from scratch with its declared start_command; wait until healthy.

    Raises:
        RestoreFailed: no start_command is declared, or the worker never became healthy.
    """
    import subprocess

    if not w.start_command:
        raise RestoreFailed(f"workload {w.name}: no checkpoint can be restored and no start_command is declared",
                            fix="declare start_command in the fleet file, or start the worker by hand")
    t0 = time.perf_counter()
    p = subprocess.Popen(w.start_command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    wait_healthy(w, timeout_s=600)
    pid = int(Path(w.find.pid_file).read_text()) if w.find.pid_file else p.pid
    return pid, time.perf_counter() - t0


def read_load(w: Workload) -> WorkloadLoad | None:
    """The engine's /metrics as a WorkloadLoad, or None when there is none or it cannot be read."""
    if not w.metrics_url:
        return None
    try:
        with urllib.request.urlopen(w.metrics_url, timeout=5) as r:
            text = r.read().decode()
        return parse_metrics(w.engine.value if w.engine.value != "other" else "vllm", text)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def tp_unsupported(w: Workload, pids: list[int] | None = None) -> str | None:
    """Why a tensor-parallel worker's ranks, as started, cannot be checkpointed (None: they can)."""
    if w.tensor_parallel <= 1:
        return None
    from ckptflow.runners.cuda import cuda_pids

    if pids is None:
        try:
            pids = cuda_pids(process.resolve(w).pid)
        except (WorkloadNotFound, UndeclaredProcess):
            return None  # not running: nothing to decide about yet
    problems = tp_problems(w.tensor_parallel, [process.environ(p) for p in pids])
    return "; ".join(problems) or None


def collect_facts(w: Workload, node: Node, store: LocalStore, now: float | None = None) -> WorkloadFacts:
    """Everything the cadence policy may know about ``w`` right now (metrics, store, fleet file)."""
    now = time.time() if now is None else now
    try:
        process.resolve(w)
        gone = None
    except (WorkloadNotFound, UndeclaredProcess) as e:  # no metrics either: without this it read as "nothing new"
        gone = e.message
    load = read_load(w)
    live = 0.0
    if load is not None:
        live = load.used_tokens if load.used_tokens is not None else load.kv_cache_usage * (w.kv_capacity_tokens or 0)
    newest = store.list(w.name)
    try:
        m = store.latest_valid(w.name)
    except CheckpointNotFound:
        m = None
    since_s = since_tokens = None
    growth = 0.0
    if m is not None:
        since_s = max(0.0, now - m.created.timestamp())
        at_ckpt = m.probe.get("tokens_total")
        since_tokens = (load.tokens_total - at_ckpt) if (load is not None and at_ckpt is not None) else live
        growth = since_tokens / since_s if since_s > 0 else 0.0
    if node.mtbf_hours:
        mtbf = node.mtbf_hours * 3600
    elif len(node.failures) >= 2:
        ts = sorted(f.timestamp() for f in node.failures)
        mtbf = (ts[-1] - ts[0]) / (len(ts) - 1)
    else:
        mtbf = 6000 * 3600.0
    footprint = w.gpu_footprint_gib or (m.bytes / 2**30 if m else 0.0)
    pause = None
    if m is not None:
        pause = sum(v for k, v in m.timings.items() if k in ("lock", "cuda_checkpoint", "dump", "cuda_restore"))
    return WorkloadFacts(
        name=w.name, traffic=w.traffic.value, footprint_gib=footprint, measured_pause_s=pause, mtbf_s=mtbf,
        live_tokens=live, growth_tokens_s=growth, tokens_since_ckpt=since_tokens, seconds_since_ckpt=since_s,
        newest_invalidated=bool(newest) and newest[0].state == CheckpointState.invalidated,
        mean_request_s=load.mean_request_s if load else None, now=now,
        maintenance=[(mw.start.timestamp(), mw.end.timestamp()) for mw in node.maintenance],
        unsupported=tp_unsupported(w) if w.gpu else None, gone=gone)


def wait_url(url: str, timeout_s: float, proc=None) -> float:
    """Poll ``url`` until it answers 200; return the seconds it took.

    Raises:
        TimeoutError: no 200 within ``timeout_s`` (with the last error).
        RuntimeError: ``proc`` (a Popen) exited first.
    """
    t0 = time.perf_counter()
    last = ""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode} before {url} answered")
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s ({last})")
        time.sleep(0.05)


def wait_healthy(w: Workload, timeout_s: float = HEALTH_TIMEOUT_S) -> float:
    if not w.health_url:
        return 0.0
    try:
        return wait_url(w.health_url, timeout_s)
    except TimeoutError as e:
        raise RestoreFailed(f"workload {w.name}: not healthy after restore: {e}",
                            fix="see the restore log; the checkpoint may be broken (run verify)") from None


@dataclass
class RestoreResult:
    manifest: Manifest
    pid: int
    timings: dict[str, float]
    skipped: list[dict] = field(default_factory=list)  # corrupt checkpoints passed over
    downloaded_bytes: int = 0                           # pulled from the S3 tier (0: read in place)


class NodeRunner:
    """Checkpoint and restore declared workloads of this node."""

    def __init__(self, store: LocalStore, criu: CriuRunner | None = None, cuda: "CudaRunner | None" = None,
                 node_fp: Fingerprint | None = None):
        self.store = store
        self._own_criu = criu is None  # a runner passed in belongs to the caller, who closes it
        self.criu = criu or CriuRunner()
        self._cuda = cuda
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
            self._node_fp = node_fingerprint(self.criu.criu_bin)
        return self._node_fp

    def gate(self, w: Workload, m: Manifest, overrides: frozenset[str] = frozenset()) -> None:
        """Refuse a checkpoint taken on another fingerprint, before any CRIU or CUDA call.

        Raises:
            IncompatibleCheckpoint: naming every differing field as old -> new (final).
        """
        groups = ("host", "gpu", "workload") if w.gpu else ("host", "workload")
        c = diff(m.fingerprint, workload_fingerprint(w, self.node_fp), overrides, groups)
        if c.skipped:
            log.warning("checkpoint %s of %s: fingerprint lacks %s; not checked", m.id, w.name, ", ".join(c.skipped))
        for f, (a, b) in c.overridden.items():
            log.warning("OVERRIDE: restoring %s of %s although %s differs: %r -> %r", m.id, w.name, f, a, b)
        if not c.ok:
            raise IncompatibleCheckpoint(c.differences, checkpoint=m.id)

    @property
    def cuda(self) -> "CudaRunner":
        if self._cuda is None:  # imports the driver bindings only when a GPU worker is handled
            from ckptflow.runners.cuda import CudaRunner

            self._cuda = CudaRunner()
        return self._cuda

    def _dump_gpu(self, w: Workload, proc, images_dir: Path, leave_running: bool) -> tuple[int, dict, int, list[int]]:
        """lock -> checkpoint -> CRIU dump [-> restore -> unlock]; unlock on any failure."""
        from ckptflow.runners.cuda import cuda_pids, process_gpu_bytes

        t: dict[str, float] = {}
        pids = cuda_pids(proc.pid)
        why = tp_unsupported(w, pids)
        if why:  # before the prepare hook and any lock: nothing touched
            raise UnsupportedWorkload(f"workload {w.name} (tensor_parallel: {w.tensor_parallel}) cannot be "
                                      f"checkpointed: {why}", fix=TP_FIX)
        quiesced = self._prepare(w, t, tp=len(pids) > 1)
        footprints = {pid: process_gpu_bytes([pid]) for pid in pids}
        t0 = time.perf_counter()
        try:
            procs = self.cuda.lock(pids, footprints)
        except CudaCheckpointError as e:  # the lock undid itself; say what each rank was doing
            ranks = _rank_states(quiesced.get("ranks_url"))
            _resume(w)
            raise CudaCheckpointError(f"{e}" + (f"\n  ranks: {ranks}" if ranks else ""), fix=e.fix) from e
        t["lock"] = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            self.cuda.checkpoint(procs)
            t["cuda_checkpoint"] = time.perf_counter() - t0
            res = self.criu.dump(w, images_dir, leave_running=leave_running, proc=proc)
            t["dump"] = res.seconds
            if leave_running:
                t0 = time.perf_counter()
                self.cuda.restore(procs, footprint_bytes=sum(footprints.values()))
                t["cuda_restore"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                self.cuda.unlock(procs)
                t["unlock"] = time.perf_counter() - t0
                _resume(w)
        except BaseException as e:
            if process.pid_alive(proc.pid):
                stuck = self.cuda.unlock_all(procs)
                _resume(w)
                if stuck:
                    raise CudaCheckpointError(f"{e}\n  and the worker could not be unlocked: {'; '.join(stuck)}",
                                              fix="see the stuck state above; the worker may need a restart") from e
            raise
        t["pause"] = sum(v for k, v in t.items() if k != "prepare")  # prepare runs while serving
        return res.pid, {k: round(v, 4) for k, v in t.items()}, sum(footprints.values()), pids

    @staticmethod
    def _prepare(w: Workload, t: dict, tp: bool) -> dict:
        """POST the engine's prepare hook. For one GPU process it only frees cached memory and may
        fail harmlessly; a tensor-parallel group must be quiesced (no collective in flight on
        any rank) or its lock cannot succeed, so there a failure stops the checkpoint here."""
        if not w.prepare_url:
            return {}
        t0 = time.perf_counter()
        try:
            req = urllib.request.Request(w.prepare_url, data=b"{}", headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=PREPARE_TIMEOUT_S) as r:
                answer = json.loads(r.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError) as e:
            if tp:
                raise WorkloadBusy(f"workload {w.name}: its ranks could not be quiesced before the CUDA lock: "
                                   f"{_http_reason(e)}", fix="retry later; the worker keeps serving") from e
            answer = {}  # an optimisation only: the checkpoint is correct without it
        t["prepare"] = time.perf_counter() - t0
        return answer if isinstance(answer, dict) else {}

    def checkpoint(self, w: Workload, *, leave_running: bool = True, kind: str | None = None) -> Manifest:
        """Dump ``w`` into the store and commit its manifest.

        Raises:
            WorkloadNotFound / UndeclaredProcess: nothing declared to dump.
            CriuError: the dump failed (bytes discarded; the worker keeps running on heartbeat).
            StorageFull: the volume filled up (bytes discarded).
        """
        with self.store.lock(w.name):
            return self._checkpoint(w, leave_running, kind)

    def _checkpoint(self, w: Workload, leave_running: bool, kind: str | None = None) -> Manifest:
        proc = process.resolve(w)
        state = probe(w)
        load = read_load(w)
        if load is not None:
            state["tokens_total"] = load.tokens_total
        pending = self.store.begin(w.name, node=w.node)
        footprint, gpu_pids = 0, []
        try:
            if w.gpu:
                pid, timings, footprint, gpu_pids = self._dump_gpu(w, proc, pending.images_dir, leave_running)
            else:
                res = self.criu.dump(w, pending.images_dir, leave_running=leave_running, proc=proc)
                pid, timings = res.pid, {"dump": round(res.seconds, 4), "pause": round(res.seconds, 4)}
        except BaseException:
            self.store.abort(pending)
            raise
        kind = kind or ("heartbeat" if leave_running else "migrate")
        return self.store.commit(pending, timings=timings, probe=state, kind=kind, pid=pid,
                                 gpu_footprint_bytes=footprint, gpu_pids=gpu_pids,
                                 fingerprint=workload_fingerprint(w, self.node_fp))

    def _restore_gpu(self, w: Workload, pid: int, m: Manifest, gpu_pairs: list[tuple[str, str]] | None) -> dict:
        """CUDA restore (optionally remapping GPU UUIDs) and unlock of a CRIU-restored worker."""
        from ckptflow.runners.cuda import CudaProcess, ProcessState, cuda_pids

        # CRIU gives every process its PID back; after a CUDA checkpoint they hold no GPU
        # files, so the ranks are known only from the manifest.
        procs = [CudaProcess(p, state=ProcessState.CHECKPOINTED) for p in (m.gpu_pids or cuda_pids(pid))]
        t0 = time.perf_counter()
        self.cuda.restore(procs, footprint_bytes=m.gpu_footprint_bytes, gpu_pairs=gpu_pairs)
        t1 = time.perf_counter()
        self.cuda.unlock(procs)
        t2 = time.perf_counter()
        # The image was taken while the engine was quiesced: the restored copy is held too.
        _resume(w)
        return {"cuda_restore": round(t1 - t0, 4), "unlock": round(t2 - t1, 4),
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
        with self.store.lock(w.name):
            return self._restore(w, manifest, fallback, gpu_pairs, overrides, tier)

    def _candidates(self, w: Workload, tier, skipped: list[dict],
                    overrides: frozenset[str]) -> Iterator[tuple[Manifest, dict, int]]:
        """(manifest, timings, downloaded bytes) of each checkpoint to try, nearest valid copy first; a bucket copy
        is gated on its fingerprint before a byte is downloaded."""
        remote: list[str] = []
        if tier is not None:
            try:
                remote = tier.list(w.name)
            except StorageUnavailable as e:  # the node's own copies can still bring it back
                log.warning("workload %s: S3 tier unreachable, trying this node's copies only: %s", w.name, e)
        local = [LocalCopy(m.id, m.state.value) for m in self.store.list(w.name)]
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
                skipped.append({"id": c.checkpoint, "reason": f"s3 copy: {str(e).splitlines()[0]}"})
                continue
            yield m, {"download": round(time.perf_counter() - t0, 4)}, pulled["downloaded_bytes"]

    def _restore(self, w: Workload, manifest: Manifest | None, fallback: bool,
                 gpu_pairs: list[tuple[str, str]] | None, overrides: frozenset[str], tier=None) -> RestoreResult:
        try:
            live = process.resolve(w)
        except (WorkloadNotFound, UndeclaredProcess):  # gone, or its stale pid file names another program
            live = None
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
        skipped: list[dict] = []
        candidates = iter([(manifest, {}, 0)]) if manifest else self._candidates(w, tier, skipped, overrides)
        tried = 0
        for m, timings, downloaded in candidates:
            tried += 1
            self.gate(w, m, overrides)
            if w.gpu and m.gpu_footprint_bytes:
                from ckptflow.runners.cuda import gate_gpu_memory

                gate_gpu_memory(m.gpu_footprint_bytes)  # before CRIU: refuse early, nothing touched
            try:
                pid = self._restore_verified(w, m, timings)
            except ChecksumMismatch as e:
                self.store.set_state(m, CheckpointState.verify_failed, f"checksum: {e}")
                skipped.append({"id": m.id, "reason": str(e).splitlines()[0]})
                if not fallback:
                    raise
                continue
            if w.gpu:
                timings.update(self._restore_gpu(w, pid, m, gpu_pairs))
            if w.find.pid_file:
                _write_pid_file(Path(w.find.pid_file), pid)
            timings["health"] = round(wait_healthy(w), 4)
            self._check_state(w, m)
            total = round(sum(v for k, v in timings.items() if k != "restore_and_checksum"), 4)
            m = self.store.set_state(m, m.state, m.state_reason, restores=[*m.probe.get("restores", []), total])
            return RestoreResult(manifest=m, pid=pid, timings=timings, skipped=skipped, downloaded_bytes=downloaded)
        if not tried and not skipped:
            raise CheckpointNotFound(f"workload {w.name} has no valid checkpoint in {self.store.root}"
                                     + (f" or {tier.location}" if tier is not None else ""),
                                     fix="run a heartbeat first, or cold start the worker")
        raise ChecksumMismatch(f"workload {w.name}: every valid checkpoint failed its checksums: "
                               + "; ".join(s["reason"] for s in skipped),
                               fix="cold start the worker; the store volume may be failing")

    def _restore_verified(self, w: Workload, m: Manifest, timings: dict[str, float]) -> int:
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
        want = m.probe.get("sessions")
        if not want:
            return
        got = probe(w).get("sessions")
        if got != want:
            bad = sorted(k for k in set(want) | set(got or {}) if (got or {}).get(k) != want.get(k))
            raise RestoreFailed(f"workload {w.name}: restored from {m.id} but sessions differ from the "
                                f"checkpoint: {', '.join(bad[:5])}", fix="mark the checkpoint bad and run verify")


def _http_reason(e: Exception) -> str:
    if isinstance(e, urllib.error.HTTPError):
        try:
            return f"HTTP {e.code}: {json.loads(e.read()).get('error', '')}"
        except (ValueError, OSError, AttributeError):
            return f"HTTP {e.code}"
    return str(e)


def _resume(w: Workload) -> None:
    """Let a quiesced engine serve again (best effort: its own hold timeout is the backstop)."""
    if not w.resume_url:
        return
    try:
        req = urllib.request.Request(w.resume_url, data=b"{}", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
    except (urllib.error.URLError, OSError) as e:
        log.warning("workload %s: resume failed (%s); it serves again when its hold times out", w.name, e)


def _rank_states(url: str | None) -> str:
    """What each rank says it is doing (the engine's own view), for a lock that timed out."""
    if not url:
        return ""
    try:
        return "; ".join(r.get("describe", str(r)) for r in _get_json(url, timeout_s=5).get("ranks", []))
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"(rank states unavailable: {e})"


def _write_pid_file(path: Path, pid: int) -> None:
    try:
        if path.read_text().strip() == str(pid):
            return
    except FileNotFoundError:
        pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(pid))
    os.replace(tmp, path)

