"""What-if simulator: a seeded fleet trace replayed under several checkpoint policies.

Pure (numpy, no I/O). The reference trace and cost model are documented in
bench/RESULTS.md; change them only with a reason written there.

Every worker of a trace is checkpointed one way (``TraceConfig.checkpoint_mode``), and a named
cost profile (``PROFILES``) fixes the mode with its calibration:

- ``process-h200``: the whole process (CUDA checkpoint + CRIU). A heartbeat pauses the worker
  1.3 s per GiB it holds; a restore reads the footprint at 1.25 GiB/s + 5 s. The calibration of
  the first simulator runs (bench/RESULTS.md, 2026-11-29), and the default.
- ``two-tier-h200``: a template of the initialised engine plus the session KV it exports
  (bench/results/gpu_two_tier.json). A heartbeat pauses 0.036 s + 0.036 s per GiB of KV that
  changed since the previous one; a restore is the template (2.85 s) plus weights and the
  checkpointed KV streamed at 20.9 GiB/s. KV bytes per token: ``kv_bytes_per_token``.
  ckptflow's heartbeats there weigh each session (policies/sessions.py ``decide_sessions``, the
  function the live two-tier heartbeat calls): a session's new KV is exported or waits, as of
  its last turn boundary; before an announced maintenance window the drain exports every
  changed session at the last turn boundary before it (``turn_s`` earlier).

Every policy's totals price the bytes it writes (``CostModel.bytes_s_per_gib``: node disk and
network, the shared tier, in GPU-seconds at the GPU-hour price): ``gpu_cost`` (lost + pause),
``bytes_cost`` and ``cost``, their sum, on which hindsight picks and the policies are ranked; the
policy weighs the same price (policies/cadence.py, policies/sessions.py), and clairvoyant takes a
checkpoint before an interruption only where the re-prefill it saves exceeds its pause and bytes.

Example:
    >>> out = simulate(seed=0, cfg=TraceConfig(days=4, nodes=4))
    >>> sorted(out["policies"])[:3]
    ['ckptflow', 'clairvoyant', 'fixed-14400']
    >>> out["checkpoint_mode"]
    'process'
    >>> tt = simulate(seed=0, cfg=profile_config("two-tier-h200", days=4, nodes=4))
    >>> tt["checkpoint_mode"], tt["policies"]["never"] == out["policies"]["never"]
    ('template-sessions', True)
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptflow.models import Action
from ckptflow.policies.cadence import CostBasedParams, CostModel, WorkloadFacts, decide, get_policy, young_interval
from ckptflow.policies.sessions import (ExportContext, SessionFacts, decide_sessions, export_context,
                                        new_session_threshold_tokens, turns_between_exports,
                                        young_product_s2)

DAY = 86400.0
HOUR = 3600.0


@dataclass
class TraceConfig:
    days: float = 30.0
    nodes: int = 64
    gpus_per_node: int = 8
    mtbf_h: float = 6000.0          # 16k-H100 cluster: 419 interruptions / 54 days / 2,048 nodes
    flaky_fraction: float = 0.10
    flaky_mtbf_h: float = 500.0
    preemptible_nodes: int = 3
    preemptible_mtbf_h: float = 24.0
    failure_dist: str = "exponential"   # or "weibull" (shape 0.7, same mean)
    weibull_shape: float = 0.7
    maintenance_hours: float = 4.0
    maintenance_notice_h: float = 24.0
    short_fraction: float = 0.5
    footprint_gib: tuple[float, float] = (20.0, 140.0)
    sessions_concurrent: tuple[int, int] = (4, 16)
    session_median_s: float = 1800.0
    session_p99_s: float = 8 * 3600.0
    session_max_s: float = 24 * 3600.0
    context_start_tokens: float = 4000.0
    context_growth_tokens_s: float = 40.0   # agent turns: tool output and replies
    context_cap_tokens: float = 128_000.0
    request_s: tuple[float, float] = (1.0, 30.0)
    cost: CostModel = field(default_factory=CostModel)
    checkpoint_mode: str = "process"        # CheckpointMode value of every worker: "process" or "template-sessions"
    # Two-tier only. KV bytes per token: the trace counts tokens (mean 0.87 M live per long-session
    # worker, ~10k per GiB of footprint), so 64 KiB/token keeps that KV (53 GiB on average) inside
    # the footprints (an 8B-class GQA model with fp8 KV; a 70B-class bf16 model's share per GPU at
    # TP 8 is 40 KiB). Weights: the part of the footprint a restore streams besides the KV.
    kv_bytes_per_token: float = 65_536.0
    weights_fraction: float = 0.5
    # Two-tier only: a drain stops admitting turns and exports each session once its turn in
    # flight ends, at most the longest request (request_s) before the window.
    turn_s: float = 30.0
    # Two-tier only: where ckptflow weighs each session's export, at each of its turn ends (every
    # turn_s) or at the cadence policy's heartbeats.
    session_exports: str = "turn"

    @property
    def template_sessions(self) -> bool:
        return self.checkpoint_mode == "template-sessions"


PROFILES: dict[str, dict[str, Any]] = {
    "process-h200": {"checkpoint_mode": "process"},
    "two-tier-h200": {"checkpoint_mode": "template-sessions"},
}
"""Named cost profiles: the TraceConfig fields each one sets (the costs themselves are CostModel's
fields, which hold both paths' calibrations)."""


def profile_config(name: str, **overrides: Any) -> TraceConfig:
    """The reference trace under the named cost profile (``overrides``: other TraceConfig fields).

    Raises:
        KeyError: no profile of that name.
    """
    try:
        base = PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown cost profile {name!r}; known: {', '.join(PROFILES)}") from None
    return TraceConfig(**{**base, **overrides})


@dataclass
class Workload:
    node: int
    short: bool
    footprint: float
    start: np.ndarray = field(default_factory=lambda: np.zeros(0))
    end: np.ndarray = field(default_factory=lambda: np.zeros(0))


@dataclass
class Trace:
    cfg: TraceConfig
    node_mtbf_s: np.ndarray
    failures: list[np.ndarray]              # per node
    windows: list[tuple[float, float]]      # per node (start, end)
    workloads: list[Workload]

    def events(self, w: Workload) -> list[tuple[float, bool]]:
        """(time, is_maintenance) of every interruption of the workload's node, in order."""
        ev = [(float(t), False) for t in self.failures[w.node]]
        ev.append((self.windows[w.node][0], True))
        return sorted(ev)


def make_trace(seed: int, cfg: TraceConfig | None = None) -> Trace:
    cfg = cfg or TraceConfig()
    r = np.random.default_rng(seed)
    T = cfg.days * DAY
    mtbf = np.full(cfg.nodes, cfg.mtbf_h * HOUR)
    idx = r.permutation(cfg.nodes)
    n_flaky = int(round(cfg.flaky_fraction * cfg.nodes))
    mtbf[idx[:n_flaky]] = cfg.flaky_mtbf_h * HOUR
    mtbf[idx[n_flaky:n_flaky + cfg.preemptible_nodes]] = cfg.preemptible_mtbf_h * HOUR
    failures = []
    for m in mtbf:
        times, t = [], 0.0
        while True:
            if cfg.failure_dist == "weibull":
                k = cfg.weibull_shape
                t += m / math.gamma(1 + 1 / k) * r.weibull(k)
            else:
                t += r.exponential(m)
            if t >= T:
                break
            times.append(t)
        failures.append(np.array(times))
    windows = []
    for _ in range(cfg.nodes):
        s = r.uniform(cfg.maintenance_notice_h * HOUR + DAY, T - DAY)
        windows.append((s, s + cfg.maintenance_hours * HOUR))
    sigma = math.log(cfg.session_p99_s / cfg.session_median_s) / 2.326
    mean_len = cfg.session_median_s * math.exp(sigma ** 2 / 2)
    workloads = []
    for n in range(cfg.nodes):
        for _ in range(cfg.gpus_per_node):
            short = bool(r.random() < cfg.short_fraction)
            w = Workload(node=n, short=short, footprint=float(r.uniform(*cfg.footprint_gib)))
            if not short:
                conc = r.integers(cfg.sessions_concurrent[0], cfg.sessions_concurrent[1] + 1)
                rate = conc / mean_len
                k = r.poisson(rate * (T + cfg.session_max_s))
                start = np.sort(r.uniform(-cfg.session_max_s, T, k))
                length = np.minimum(r.lognormal(math.log(cfg.session_median_s), sigma, k), cfg.session_max_s)
                w.start, w.end = start, start + length
            workloads.append(w)
    return Trace(cfg, mtbf, failures, windows, workloads)


# --- KV state of a long-session workload -------------------------------------------------
def _ctx(cfg: TraceConfig, start: np.ndarray, t: float) -> np.ndarray:
    return np.minimum(cfg.context_start_tokens + cfg.context_growth_tokens_s * (t - start), cfg.context_cap_tokens)


def _alive(w: Workload, t: float, max_len: float) -> tuple[np.ndarray, np.ndarray]:
    lo = np.searchsorted(w.start, t - max_len, "left")
    hi = np.searchsorted(w.start, t, "right")
    s, e = w.start[lo:hi], w.end[lo:hi]
    m = e > t
    return s[m], e[m]


def live_tokens(cfg: TraceConfig, w: Workload, t: float) -> tuple[float, float]:
    """(KV tokens held at t, their growth rate in tokens/s)."""
    if w.short:
        return 0.0, 0.0
    s, _ = _alive(w, t, cfg.session_max_s)
    ctx = _ctx(cfg, s, t)
    return float(ctx.sum()), float(cfg.context_growth_tokens_s * np.count_nonzero(ctx < cfg.context_cap_tokens))


def at_risk_tokens(cfg: TraceConfig, w: Workload, t: float, tc: float | None) -> float:
    """KV tokens at t that are not in a checkpoint taken at tc (all of them if tc is None)."""
    if w.short:
        return 0.0
    s, _ = _alive(w, t, cfg.session_max_s)
    ctx = _ctx(cfg, s, t)
    if tc is None:
        return float(ctx.sum())
    before = s <= tc
    return float(ctx.sum() - _ctx(cfg, s[before], tc).sum())


def moved_tokens(cfg: TraceConfig, w: Workload, ckpts: np.ndarray) -> float:
    """KV tokens a two-tier schedule moves in all: each heartbeat moves what changed since the
    previous one, which telescopes per session to its KV at its last heartbeat."""
    if w.short or not len(ckpts) or not len(w.start):
        return 0.0
    i = np.searchsorted(ckpts, w.end, "left") - 1      # the last heartbeat while the session lives
    ok = i >= 0
    t_last = ckpts[np.where(ok, i, 0)]
    ok &= t_last >= w.start
    return float(_ctx(cfg, w.start[ok], t_last[ok]).sum())


def heartbeat_cost(cfg: TraceConfig, w: Workload, ckpts: np.ndarray) -> tuple[float, float]:
    """(pause GPU-s, bytes written) of a schedule of heartbeats of one worker."""
    cost = cfg.cost
    if not cfg.template_sessions:
        return len(ckpts) * cost.pause_s(w.footprint), len(ckpts) * w.footprint * 2**30
    moved = moved_tokens(cfg, w, ckpts)
    return (len(ckpts) * cost.session_pause_fixed_s
            + cost.session_pause_s_per_gib * cost.kv_gib(moved, cfg.kv_bytes_per_token),
            moved * cfg.kv_bytes_per_token)


def pause_of(cfg: TraceConfig, w: Workload, changed_tokens: float) -> float:
    """Pause of one heartbeat of ``w`` that finds ``changed_tokens`` new KV tokens."""
    if not cfg.template_sessions:
        return cfg.cost.pause_s(w.footprint)
    return cfg.cost.session_pause_s(changed_tokens, cfg.kv_bytes_per_token)


def checkpoint_cost_of(cfg: TraceConfig, w: Workload, changed_tokens: float) -> float:
    """``pause_of`` plus the bytes that heartbeat writes (the footprint, or in two tiers the new
    KV), priced at ``CostModel.bytes_s_per_gib``."""
    written = w.footprint * 2**30 if not cfg.template_sessions else changed_tokens * cfg.kv_bytes_per_token
    return pause_of(cfg, w, changed_tokens) + cfg.cost.bytes_s(written)


def restore_of(cfg: TraceConfig, w: Workload, kept_tokens: float) -> float:
    """Restore of ``w`` from a checkpoint holding ``kept_tokens`` KV tokens that are still live."""
    if not cfg.template_sessions:
        return cfg.cost.restore_s(w.footprint)
    return cfg.cost.template_sessions_restore_s(cfg.weights_fraction * w.footprint, kept_tokens, cfg.kv_bytes_per_token)


# --- cost of one checkpoint schedule -----------------------------------------------------
@dataclass
class _Losses:
    """One worker's interruptions summed: restores (or cold starts), re-prefill, KV kept (GPU-s)."""

    lost: float = 0.0
    restart: float = 0.0
    reprefill: float = 0.0
    kept: float = 0.0

    def interruption(self, restart_s: float, risk_tokens: float, kept_tokens: float, rate: float) -> None:
        self.lost += restart_s + risk_tokens / rate
        self.restart += restart_s
        self.reprefill += risk_tokens / rate
        self.kept += kept_tokens / rate

    def totals(self, pause: float, written: float, checkpoints: int, cost: CostModel) -> dict:
        """``gpu_cost`` = lost + pause (GPU-seconds), ``bytes_cost`` = the bytes written priced in
        GPU-seconds (``CostModel.bytes_s_per_gib``), ``cost`` = their sum, what policies are judged on."""
        gpu, written_s = self.lost + pause, cost.bytes_s(written)
        return {"lost_gpu_s": self.lost, "pause_gpu_s": pause, "bytes": written,
                "checkpoints": checkpoints, "gpu_cost": gpu, "bytes_cost": written_s, "cost": gpu + written_s,
                "restart_gpu_s": self.restart, "reprefill_gpu_s": self.reprefill, "kv_kept_gpu_s": self.kept}


def schedule_cost(tr: Trace, w: Workload, ckpts: np.ndarray, *, template: bool = True,
                  drains_short: bool = False) -> dict:
    """Totals of one worker under one schedule. ``lost_gpu_s`` = ``restart_gpu_s`` (restores or
    cold starts) + ``reprefill_gpu_s`` (KV not in the newest checkpoint) + retries of short
    requests; ``kv_kept_gpu_s``: the re-prefill the checkpoints saved (KV restored instead)."""
    cfg, cost = tr.cfg, tr.cfg.cost
    out = _Losses()
    for t, maint in tr.events(w):
        i = np.searchsorted(ckpts, t, "right")
        tc = float(ckpts[i - 1]) if i else None
        risk = at_risk_tokens(cfg, w, t, tc)
        live = live_tokens(cfg, w, t)[0] if tc is not None else risk
        r = restore_of(cfg, w, live - risk) if template else cost.cold_start_s
        out.interruption(r, risk, live - risk, cost.prefill_tokens_s)
        if w.short and not (maint and drains_short):
            out.lost += sum(cfg.request_s) / 2  # in-flight requests retried
    pause, written = heartbeat_cost(cfg, w, ckpts)
    return out.totals(pause, written, len(ckpts), cost)


def node_class(cfg: TraceConfig, mtbf_s: float) -> str:
    """'preemptible', 'flaky' or 'healthy', by the node's MTBF in the trace."""
    if mtbf_s == cfg.preemptible_mtbf_h * HOUR:
        return "preemptible"
    return "flaky" if mtbf_s == cfg.flaky_mtbf_h * HOUR else "healthy"


def fixed_schedule(tr: Trace, tau: float, phase: float) -> np.ndarray:
    if not math.isfinite(tau):
        return np.zeros(0)
    return np.arange(phase * tau, tr.cfg.days * DAY, tau)


def _add(total: dict, part: dict) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


HINDSIGHT_GRID = [math.inf, 900, 1800, 3600, 2 * 3600, 4 * 3600, 8 * 3600, 12 * 3600, DAY, 2 * DAY, 4 * DAY, 7 * DAY]
FIXED_INTERVALS = [900, 3600, 4 * 3600, DAY, 7 * DAY]


def ckptflow_heartbeats(tr: Trace, w: Workload, params: Mapping[str, Any] | CostBasedParams, tick_s: float = 300,
                        decide_every: int = 12) -> list[tuple[float, ExportContext]]:
    """Replay the online policy: it sees only what it could observe at each tick. Returns each
    heartbeat with the context its sessions are weighed in (``export_context`` of the facts and
    decision behind it, as the live heartbeat builds it).

    Two tiers: the heartbeat before a maintenance window is the drain's, at the last turn
    boundary before the window (``turn_s``), rather than at the tick that decided it."""
    cfg = tr.cfg
    params = get_policy("cost-based").parse(params)  # validated once, not at every decision
    T = cfg.days * DAY
    declared = tr.node_mtbf_s[w.node]
    fails = tr.failures[w.node]
    ws, we = tr.windows[w.node]
    announced = ws - cfg.maintenance_notice_h * HOUR
    ckpts: list[float] = []
    out: list[tuple[float, ExportContext]] = []
    drained = False
    ctx = drain_ctx = ExportContext(mtbf_s=declared)
    traffic = "short_requests" if w.short else "long_sessions"
    tau, k = math.inf, 0
    for t in np.arange(tick_s, T, tick_s):
        t = float(t)
        if drained and t >= ws:  # the window's heartbeat is now in the past: the next ones follow it
            ckpts.append(ws - cfg.turn_s)
            out.append((ws - cfg.turn_s, drain_ctx))
            drained = False
        near_window = announced <= t and ws - 3 * HOUR <= t < we
        if k % decide_every and not near_window:
            k += 1
            if math.isfinite(tau) and (not ckpts or t - ckpts[-1] >= tau):
                ckpts.append(t)
                out.append((t, ctx))
            continue
        k += 1
        if drained and t < ws:
            continue  # the drain's heartbeat is booked; the node is about to go
        seen = int(np.searchsorted(fails, t))
        mtbf_est = (declared + t) / (1 + seen)  # gamma posterior: declared MTBF as one prior failure
        tc = ckpts[-1] if ckpts else None
        live, growth = live_tokens(cfg, w, t)
        # Before its first heartbeat a worker has its initialised checkpoint (t=0, no KV).
        f = WorkloadFacts(name="w", traffic=traffic, footprint_gib=w.footprint, mtbf_s=mtbf_est,
                          live_tokens=live, growth_tokens_s=growth,
                          tokens_since_ckpt=at_risk_tokens(cfg, w, t, tc),
                          seconds_since_ckpt=t - (tc or 0.0), now=t,
                          maintenance=[(ws, we)] if t >= announced else [],
                          checkpoint_mode=cfg.checkpoint_mode, weights_gib=cfg.weights_fraction * w.footprint,
                          kv_bytes_per_token=cfg.kv_bytes_per_token)
        d = decide(f, "cost-based", params, cfg.cost)
        ctx = export_context(f, d, cfg.cost)
        tau = d.interval_s if d.action == Action.protect and d.interval_s else math.inf
        if d.due and d.action in (Action.protect, Action.checkpoint_now):
            if cfg.template_sessions and d.action == Action.checkpoint_now and d.reason.startswith("maintenance in"):
                drained, drain_ctx = True, ctx  # taken by the drain, at the window's last turn boundary
            else:
                ckpts.append(t)
                out.append((t, ctx))
    if drained:
        out.append((ws - cfg.turn_s, drain_ctx))
    return out


def ckptflow_schedule(tr: Trace, w: Workload, params: Mapping[str, Any] | CostBasedParams, tick_s: float = 300,
                      decide_every: int = 12) -> np.ndarray:
    """The times of the online policy's heartbeats (``ckptflow_heartbeats``)."""
    return np.array([t for t, _ in ckptflow_heartbeats(tr, w, params, tick_s, decide_every)])


def session_exports(tr: Trace, w: Workload, heartbeats: list[tuple[float, ExportContext]]
                    ) -> tuple[list[list[float]], int]:
    """Which sessions each two-tier heartbeat exports, decided per session by
    ``policies.sessions.decide_sessions`` on the facts the live heartbeat has (tokens now, tokens
    in the session's last checkpoint, the node's MTBF estimate, an announced interruption; the
    engine reports no session ages, so none is given). Returns each session's export times and
    the number of heartbeats that exported anything (one that exports nothing pauses nothing)."""
    cfg = tr.cfg
    exports: list[list[float]] = [[] for _ in range(len(w.start))]
    at_ckpt = np.full(len(w.start), -1.0)
    n = 0
    for t, ctx in heartbeats:
        lo = np.searchsorted(w.start, t - cfg.session_max_s, "left")
        hi = np.searchsorted(w.start, t, "right")
        idx = lo + np.nonzero(w.end[lo:hi] > t)[0]
        if not len(idx):
            continue
        tokens = np.floor(_ctx(cfg, w.start[idx], t)).astype(int)
        facts = [SessionFacts(id=str(j), tokens=int(n_), tokens_at_ckpt=None if at_ckpt[j] < 0 else int(at_ckpt[j]))
                 for j, n_ in zip(idx, tokens)]
        moved = False
        for j, n_, d in zip(idx, tokens, decide_sessions(facts, context=ctx)):
            if d.export:
                exports[j].append(t)
                at_ckpt[j] = n_
                moved = True
        n += moved
    return exports, n


def session_schedule_cost(tr: Trace, w: Workload, exports: list[list[float]], heartbeats: int) -> dict:
    """``schedule_cost`` of a two-tier schedule whose heartbeats export some sessions only: a
    failure re-prefills each session's KV since its own last export; what moves in all is each
    session's KV at its last export (monotone contexts telescope); each heartbeat that exported
    anything pays the fixed part once. Short requests: drained before maintenance."""
    import bisect

    cfg, cost = tr.cfg, tr.cfg.cost
    out = _Losses()
    for t, maint in tr.events(w):
        lo = np.searchsorted(w.start, t - cfg.session_max_s, "left")
        hi = np.searchsorted(w.start, t, "right")
        idx = lo + np.nonzero(w.end[lo:hi] > t)[0]
        live = float(_ctx(cfg, w.start[idx], t).sum())
        done = 0.0
        for j in idx:
            i = bisect.bisect_right(exports[j], t)
            if i:
                done += float(_ctx(cfg, w.start[j:j + 1], exports[j][i - 1])[0])
        out.interruption(restore_of(cfg, w, done), live - done, done, cost.prefill_tokens_s)
    moved = sum(float(_ctx(cfg, w.start[j:j + 1], ex[-1])[0]) for j, ex in enumerate(exports) if ex)
    pause = heartbeats * cost.session_pause_fixed_s + cost.session_pause_s_per_gib * cost.kv_gib(
        moved, cfg.kv_bytes_per_token)
    return out.totals(pause, moved * cfg.kv_bytes_per_token, heartbeats, cost)


def turn_exports_cost(tr: Trace, w: Workload, tick_s: float = 300, decide_every: int = 12) -> dict:
    """Two tiers, sessions protected at their turn boundaries: a session's turns end every
    ``turn_s``; at each turn end ckptflow exports its new KV or lets it wait, by
    ``policies.sessions.decide_export`` with ``at_turn_end`` (the export holds that session only and
    costs ``CostModel.turn_export_s``), in the context of the newest decision tick (the node's MTBF
    estimate, as ``ckptflow_heartbeats``). A new session is exported at the first turn end where
    its KV pays (else it is only listed: lost to a failure, re-prefilled); the drain exports every
    changed session at its last turn end before an announced window, where the change pays its
    export's pause and bytes for certain (``decide_export`` with the interruption announced).

    Vectorised: within one context a growing session is exported every m-th turn end
    (``turns_between_exports``); once its context is capped, at the first turn end where its last
    change has been at risk long enough. tests/test_session_policy.py holds it to a turn-by-turn
    replay of ``decide_sessions``."""
    cfg, cost = tr.cfg, tr.cfg.cost
    T, d = cfg.turn_s, cfg.context_growth_tokens_s * cfg.turn_s
    c0, cap = cfg.context_start_tokens, cfg.context_cap_tokens
    k_cap = math.ceil((cap - c0) / d)           # the first turn end whose context is capped
    s, e = w.start, w.end
    n = len(s)
    last_k = np.full(n, -1, dtype=np.int64)     # turn index of each session's last export (-1: none)
    n_exp = np.zeros(n, dtype=np.int64)
    declared, fails = tr.node_mtbf_s[w.node], tr.failures[w.node]
    ws, _ = tr.windows[w.node]
    drain_t = ws - T
    every = tick_s * decide_every
    T_end = cfg.days * DAY
    marks = sorted({float(t) for t in np.arange(0.0, T_end, every)} | {float(t) for t in fails}
                   | {drain_t, ws, T_end})

    def tokens(k: np.ndarray) -> np.ndarray:
        return np.minimum(c0 + d * k, cap)

    out = _Losses()
    interrupted = {ws, *fails.tolist()}
    ctx = None
    for a, b in zip(marks[:-1], marks[1:]):
        if a % every == 0:
            seen = int(np.searchsorted(fails, a))
            ctx = ExportContext(mtbf_s=(declared + a) / (1 + seen), kv_bytes_per_token=cfg.kv_bytes_per_token,
                                cost=cost, at_turn_end=True)
            m = turns_between_exports(ctx, d, T)
            nstar = new_session_threshold_tokens(ctx)
            young = young_product_s2(ctx) * cost.prefill_tokens_s   # in tokens x seconds
        lo = np.searchsorted(s, a - cfg.session_max_s, "left")
        hi = np.searchsorted(s, b, "left")
        j = lo + np.nonzero(e[lo:hi] > a)[0]
        if len(j):
            ss, ee = s[j], e[j]
            k_lo = np.maximum(np.floor((a - ss) / T).astype(np.int64) + 1, 1)
            k_hi = np.minimum(np.floor((b - ss) / T).astype(np.int64), np.ceil((ee - ss) / T).astype(np.int64) - 1)
            has = k_lo <= k_hi
            lk, ne = last_k[j], n_exp[j]
            # a new session: exported at the first turn end where its KV pays (else listed only)
            k_new = np.maximum(k_lo, math.floor((nstar - c0) / d) + 1 if nstar < cap else k_hi.max(initial=0) + 1)
            new = has & (lk < 0) & (k_new <= k_hi)
            lk = np.where(new, k_new, lk)
            ne = ne + new
            if m is not None:
                top = np.minimum(k_hi, k_cap - 1)   # turn ends before the cap: the change grows d a turn
                first = np.maximum(lk + m, k_lo)       # overdue (m shrank with the MTBF): at the first turn end
                grow = has & (lk >= 0) & (first <= top)
                cnt = np.where(grow, (top - first) // m + 1, 0)
                lk = np.where(grow, first + (cnt - 1) * m, lk)
                ne = ne + cnt
                # capped: the change stops growing, the time it has been at risk does not
                rest = cap - tokens(np.maximum(lk, 0))
                wait = np.ceil(young / np.maximum(rest, 1e-9) / T).astype(np.int64)
                ke = np.maximum(np.maximum(k_cap, k_lo), lk + np.maximum(wait, 1))
                edge = has & (lk >= 0) & (lk < k_cap) & (rest > 0) & (ke <= k_hi)
                lk = np.where(edge, ke, lk)
                ne = ne + edge
            last_k[j], n_exp[j] = lk, ne
        if b == drain_t:  # the drain: every changed session whose change pays its export, at its last turn end
            j2 = np.nonzero((s < b) & (e > b))[0]
            kd = np.minimum(np.floor((b - s[j2]) / T).astype(np.int64), k_cap)
            changed = tokens(kd) - np.where(last_k[j2] >= 0, tokens(np.maximum(last_k[j2], 0)), 0.0)
            pays = new_session_threshold_tokens(ctx.model_copy(update={"interruption_ahead": True}))
            moved = (kd >= 1) & (changed > 0) & (changed > pays)
            last_k[j2] = np.where(moved, kd, last_k[j2])
            n_exp[j2] += moved
        if b in interrupted:
            j3 = np.nonzero((s < b) & (e > b))[0]
            live = float(_ctx(cfg, s[j3], b).sum())
            lk = last_k[j3]
            done = float(np.where(lk >= 0, tokens(np.maximum(lk, 0)), 0.0).sum())
            out.interruption(restore_of(cfg, w, done), live - done, done, cost.prefill_tokens_s)
    ok = last_k >= 0
    moved = float(tokens(last_k[ok]).sum())     # monotone contexts: each session's moves telescope
    exports = int(n_exp.sum())
    pause = exports * cost.turn_export_fixed_s + cost.turn_export_s_per_gib * cost.kv_gib(moved, cfg.kv_bytes_per_token)
    return out.totals(pause, moved * cfg.kv_bytes_per_token, exports, cost)


def ckptflow_cost(tr: Trace, w: Workload, params: Mapping[str, Any] | CostBasedParams,
                  session_exports_at: str | None = None) -> dict:
    """ckptflow's totals for one worker: whole-process heartbeats, or in two tiers sessions weighed
    one by one, at their turn boundaries (``TraceConfig.session_exports`` "turn") or at the
    cadence's heartbeats ("heartbeat")."""
    at = session_exports_at or tr.cfg.session_exports
    if tr.cfg.template_sessions and not w.short and at == "turn":
        return turn_exports_cost(tr, w)
    hb = ckptflow_heartbeats(tr, w, params)
    if not tr.cfg.template_sessions or w.short:
        return schedule_cost(tr, w, np.array([t for t, _ in hb]), drains_short=True)
    return session_schedule_cost(tr, w, *session_exports(tr, w, hb))


def never_explained(pol: Mapping[str, Mapping[str, float]], interruptions: int, cost: CostModel) -> str:
    """The one line that says why ``never`` and ``hindsight`` differ at 0 checkpoints: ``never`` has no
    checkpoint at all, where every other policy has the worker's initialised one (taken at start, not
    counted among its checkpoints) to restore instead of a cold start."""
    never, hind = pol["never"], pol["hindsight"]
    how = (", with none of its own either," if hind["checkpoints"] == 0 else
           f" (and its {hind['checkpoints']:,.0f} own)")
    return (f"never and hindsight differ at 0 checkpoints: never keeps no checkpoint at all, not even the "
            f"initialised one every other policy restores from (taken at start, not counted), so its "
            f"{interruptions:,} worker interruptions are {cost.cold_start_s:.0f} s cold starts "
            f"({never['restart_gpu_s'] / HOUR:,.1f} GPU-h); hindsight{how} restores them from it in "
            f"{hind['restart_gpu_s'] / HOUR:,.1f} GPU-h.")


def simulate(seed: int = 0, cfg: TraceConfig | None = None,
             params: Mapping[str, Any] | CostBasedParams | None = None, with_curve: bool = False,
             policies: Collection[str] | None = None) -> dict:
    """Replay one seeded trace under every policy (or only those named in ``policies``); return
    per-policy totals: ``gpu_cost`` (lost + pause, GPU-seconds), ``bytes_cost`` (the bytes written,
    priced in GPU-seconds at ``CostModel.bytes_s_per_gib``) and ``cost``, their sum, which the
    policies are ranked and judged on (hindsight picks each worker's interval by it too).

    Raises:
        pydantic.ValidationError: ``params`` are not valid cost-based parameters.
    """
    tr = make_trace(seed, cfg)
    cfg = tr.cfg
    params = get_policy("cost-based").parse(params or {"min_interval_s": 300, "max_interval_s": 7 * DAY})
    r = np.random.default_rng(seed + 10_000)
    phases = r.random(len(tr.workloads))
    pol: dict[str, dict] = {}

    def want(name: str) -> bool:
        return policies is None or name in policies

    def run(name: str, sched, **kw) -> None:
        if not want(name):
            return
        tot: dict = {}
        for i, w in enumerate(tr.workloads):
            _add(tot, schedule_cost(tr, w, sched(i, w), **kw))
        pol[name] = tot

    run("never", lambda i, w: np.zeros(0), template=False)
    for tau in FIXED_INTERVALS:
        run(f"fixed-{tau:.0f}", lambda i, w, tau=tau: fixed_schedule(tr, tau, phases[i]))
    # Young's C: the process pause; in two tiers the pause of moving a worker's KV held mid-trace;
    # each with the bytes it writes.
    mean_c = float(np.mean([checkpoint_cost_of(cfg, w, live_tokens(cfg, w, cfg.days * DAY / 2)[0])
                            for w in tr.workloads]))
    mean_m = float(1 / np.mean(1 / tr.node_mtbf_s))
    tau_yd = young_interval(mean_c, mean_m)
    run("young-daly", lambda i, w: fixed_schedule(tr, tau_yd, phases[i]))

    if want("hindsight"):
        hind: dict = {}
        for i, w in enumerate(tr.workloads):
            best = min((schedule_cost(tr, w, fixed_schedule(tr, tau, phases[i])) for tau in HINDSIGHT_GRID),
                       key=lambda c: c["cost"])
            _add(hind, best)
        pol["hindsight"] = hind

    if want("clairvoyant"):  # a checkpoint right before each interruption, where it pays (pause and bytes)
        clair: dict = {}
        for w in tr.workloads:
            ck: list[float] = []
            for t, _ in tr.events(w):
                tokens = at_risk_tokens(cfg, w, t, ck[-1] if ck else None)
                if tokens / cfg.cost.prefill_tokens_s > checkpoint_cost_of(cfg, w, tokens):
                    ck.append(t - 1e-3)
            _add(clair, schedule_cost(tr, w, np.array(ck), drains_short=True))
        pol["clairvoyant"] = clair

    # ckptflow, with where its checkpoints went: per node class and traffic.
    tot: dict = {}
    protects: dict[str, dict] = {}
    for w in (tr.workloads if want("ckptflow") else []):
        part = ckptflow_cost(tr, w, params)
        _add(tot, part)
        key = f"{node_class(cfg, tr.node_mtbf_s[w.node])}/{'short' if w.short else 'long'}"
        row = protects.setdefault(key, {"workloads": 0, "with_checkpoints": 0})
        row["workloads"] += 1
        row["with_checkpoints"] += int(part["checkpoints"] > 0)
        _add(row, {k: part[k] for k in ("checkpoints", "pause_gpu_s", "reprefill_gpu_s", "kv_kept_gpu_s",
                                        "bytes", "bytes_cost")})
    if want("ckptflow"):
        pol["ckptflow"] = tot
    if cfg.template_sessions and want("ckptflow-heartbeat"):  # the same sessions weighed at the cadence's heartbeats
        hb_tot: dict = {}
        for w in tr.workloads:
            _add(hb_tot, ckptflow_cost(tr, w, params, session_exports_at="heartbeat"))
        pol["ckptflow-heartbeat"] = hb_tot

    interruptions = sum(len(tr.events(w)) for w in tr.workloads)
    out = {"seed": seed, "failure_dist": cfg.failure_dist, "checkpoint_mode": cfg.checkpoint_mode,
           "kv_bytes_per_token": cfg.kv_bytes_per_token if cfg.template_sessions else None,
           "bytes_s_per_gib": round(cfg.cost.bytes_s_per_gib(), 4),
           "workloads": len(tr.workloads),
           "young_daly_interval_s": tau_yd,
           "node_failures": int(sum(len(f) for f in tr.failures)),
           "interruptions": interruptions,
           "policies": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in pol.items()},
           "ckptflow_by_class": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in sorted(protects.items())}}
    if want("never") and want("hindsight"):
        out["notes"] = {"never": never_explained(pol, interruptions, cfg.cost)}
    if with_curve:
        curve = []
        for tau in sorted(set(HINDSIGHT_GRID[1:] + FIXED_INTERVALS)):
            tot: dict = {}
            for i, w in enumerate(tr.workloads):
                _add(tot, schedule_cost(tr, w, fixed_schedule(tr, tau, phases[i])))
            curve.append((tau, tot["cost"]))
        out["fixed_curve"] = curve
    return out
