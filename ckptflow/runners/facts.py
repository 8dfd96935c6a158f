"""The facts the cadence policy reads about one workload, gathered from the engine and the store.

Plain values in (the node's MTBF and maintenance windows), a ``WorkloadFacts`` out; the policy
decides from it without any I/O of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import datetime

from ckptflow.errors import CheckpointNotFound, UndeclaredProcess, WorkloadNotFound
from ckptflow.models import CheckpointState, Workload
from ckptflow.policies.cadence import WorkloadFacts
from ckptflow.policies.multigpu import tp_problems
from ckptflow.runners import process
from ckptflow.runners.engine import read_load
from ckptflow.runners.gpu import GpuBackend, backend_for, get_backend, holds_device_state
from ckptflow.runners.runtime import runtime_for
from ckptflow.store.local import LocalStore


def node_mtbf_s(mtbf_hours: float | None, failures: Sequence[datetime]) -> float | None:
    """The node's mean time between failures: declared, else from its recorded failures, else
    None (the policy's own default applies)."""
    if mtbf_hours:
        return mtbf_hours * 3600
    if len(failures) >= 2:
        ts = sorted(f.timestamp() for f in failures)
        return (ts[-1] - ts[0]) / (len(ts) - 1)
    return None


def tp_unsupported(w: Workload, pids: list[int] | None = None, gpu: GpuBackend | None = None) -> str | None:
    """Why a tensor-parallel worker's ranks, as started, cannot be checkpointed (None: they can).
    ``pids``: its device processes, else found by ``gpu`` (the node's backend, default cuda)."""
    if w.tensor_parallel <= 1:
        return None
    if pids is None:
        try:
            pids = backend_for(w, gpu or get_backend()).processes(runtime_for(w).resolve(w).pid)
        except (WorkloadNotFound, UndeclaredProcess):
            return None  # not running: nothing to decide about yet
    if not pids:
        return None  # no device state: no ranks to check
    problems = tp_problems(w.tensor_parallel, [process.environ(p) for p in pids])
    return "; ".join(problems) or None


def collect_facts(w: Workload, store: LocalStore, *, mtbf_s: float | None = None,
                  maintenance: Sequence[tuple[float, float]] = (), now: float | None = None,
                  gpu: GpuBackend | None = None) -> WorkloadFacts:
    """Everything the cadence policy may know about ``w`` right now: its engine's metrics, its
    checkpoints in ``store``, and the node's ``mtbf_s`` and ``maintenance`` windows (epoch s).
    ``gpu``: the node's GPU backend (default cuda), which finds a TP worker's ranks."""
    now = time.time() if now is None else now
    pid = None
    try:
        pid = runtime_for(w).resolve(w).pid  # a process, a container, a pod: whatever it runs under
        gone = None
    except (WorkloadNotFound, UndeclaredProcess) as e:  # no metrics either: without this it read as "nothing new"
        gone = e.message
    load = read_load(w)
    live = 0.0
    if load is not None:
        live = load.used_tokens if load.used_tokens is not None else load.kv_cache_usage * (w.kv_capacity_tokens or 0)
    newest = store.list(w.name)
    # The newest heartbeat's checkpoint: the turn-end loop's (every few seconds, a session's
    # export alone) would read as "just checkpointed" and no heartbeat would ever be due.
    m = next((c for c in store.valid(w.name) if not (c.probe.export and c.probe.export.at_turn_end)), None)
    since_s = since_tokens = restarted = None
    growth = 0.0
    if m is not None:
        since_s = max(0.0, now - m.created.timestamp())
        at_ckpt = m.probe.tokens_total
        since_tokens = (load.tokens_total - at_ckpt) if (load is not None and at_ckpt is not None) else live
        if m.pid and pid and m.pid != pid and runtime_for(w).keeps_pid:
            # The restore keeps the dumped PID; another PID is a worker started anew (or a standby
            # that took over), whose counter may even have passed the checkpoint's: "nothing new"
            # would leave it unprotected.
            restarted = f"the newest checkpoint {m.id} is of PID {m.pid}; the worker now runs as PID {pid}"
        if since_tokens < 0 or restarted:
            # The counter went back, or counts another process: a restarted worker, or one restored
            # from an older copy. None of what it did since it (re)started is in the newest checkpoint.
            since_tokens = load.tokens_total if load is not None else live
        growth = since_tokens / since_s if since_s > 0 else 0.0
    footprint = w.gpu_footprint_gib or (m.bytes / 2**30 if m else 0.0)
    pause = None
    two_tier: dict = {}
    if m is not None and m.kind == "sessions":  # what a two-tier heartbeat and restore cost this workload
        pause = m.timings.get("pause")
        two_tier = _template_sessions_sizes(store, m)
    elif m is not None:
        pause = sum(v for k, v in m.timings.items() if k in ("lock", "cuda_checkpoint", "dump", "cuda_restore"))
    return WorkloadFacts(checkpoint_mode=str(w.checkpoint), **two_tier,
        name=w.name, traffic=w.traffic.value, footprint_gib=footprint, measured_pause_s=pause,
        live_tokens=live, growth_tokens_s=growth, tokens_since_ckpt=since_tokens, seconds_since_ckpt=since_s,
        restarted=restarted,
        newest_invalidated=bool(newest) and newest[0].state == CheckpointState.invalidated,
        mean_request_s=load.mean_request_s if load else None, now=now, maintenance=list(maintenance),
        # The workload's own, not the node's: every node has a GPU backend object, GPU or not.
        unsupported=tp_unsupported(w, gpu=gpu), gone=gone, device="gpu" if holds_device_state(w) else "cpu",
        **({"mtbf_s": mtbf_s} if mtbf_s else {}))


def _template_sessions_sizes(store: LocalStore, m) -> dict:
    """Weights a restore streams (from the template) and KV bytes per token (from the sessions'
    records); {} where the checkpoint does not say."""
    out: dict = {}
    try:
        recs = json.loads((store.images_dir(m) / "sessions.json").read_text())["sessions"]
        tokens = sum(r.get("tokens", 0) for r in recs.values())
        if tokens:
            out["kv_bytes_per_token"] = sum(r.get("total_bytes", 0) for r in recs.values()) / tokens
        if m.probe.template is None:
            return out
        tmpl = store.get(m.probe.template.workload, m.probe.template.id)
        if tmpl.probe.weights and tmpl.probe.weights.bytes:
            out["weights_gib"] = tmpl.probe.weights.bytes / 2**30
    except (OSError, KeyError, ValueError, CheckpointNotFound):
        pass
    return out
