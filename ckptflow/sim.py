"""What-if simulator: a seeded fleet trace replayed under several checkpoint policies.

Pure (numpy, no I/O). The reference trace and cost model are documented in
bench/RESULTS.md; change them only with a reason written there.

Example:
    >>> out = simulate(seed=0)
    >>> sorted(out["policies"])[:3]
    ['ckptflow', 'clairvoyant', 'fixed-14400']
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptflow.models import Action
from ckptflow.policies.cadence import CostBasedParams, CostModel, WorkloadFacts, decide, get_policy, young_interval

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


# --- cost of one checkpoint schedule -----------------------------------------------------
def schedule_cost(tr: Trace, w: Workload, ckpts: np.ndarray, *, template: bool = True,
                  drains_short: bool = False) -> dict:
    cfg, cost = tr.cfg, tr.cfg.cost
    C = cost.pause_s(w.footprint)
    lost = 0.0
    for t, maint in tr.events(w):
        i = np.searchsorted(ckpts, t, "right")
        tc = float(ckpts[i - 1]) if i else None
        lost += cost.restore_s(w.footprint) if template else cost.cold_start_s
        lost += at_risk_tokens(cfg, w, t, tc) / cost.prefill_tokens_s
        if w.short and not (maint and drains_short):
            lost += sum(cfg.request_s) / 2  # in-flight requests retried
    pause = len(ckpts) * C
    return {"lost_gpu_s": lost, "pause_gpu_s": pause, "bytes": len(ckpts) * w.footprint * 2**30,
            "checkpoints": len(ckpts), "cost": lost + pause}


def fixed_schedule(tr: Trace, tau: float, phase: float) -> np.ndarray:
    if not math.isfinite(tau):
        return np.zeros(0)
    return np.arange(phase * tau, tr.cfg.days * DAY, tau)


def _add(total: dict, part: dict) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


HINDSIGHT_GRID = [math.inf, 900, 1800, 3600, 2 * 3600, 4 * 3600, 8 * 3600, 12 * 3600, DAY, 2 * DAY, 4 * DAY, 7 * DAY]
FIXED_INTERVALS = [900, 3600, 4 * 3600, DAY, 7 * DAY]


def ckptflow_schedule(tr: Trace, w: Workload, params: Mapping[str, Any] | CostBasedParams, tick_s: float = 300,
                      decide_every: int = 12) -> np.ndarray:
    """Replay the online policy: it sees only what it could observe at each tick."""
    cfg = tr.cfg
    params = get_policy("cost-based").parse(params)  # validated once, not at every decision
    T = cfg.days * DAY
    declared = tr.node_mtbf_s[w.node]
    fails = tr.failures[w.node]
    ws, we = tr.windows[w.node]
    announced = ws - cfg.maintenance_notice_h * HOUR
    ckpts: list[float] = []
    traffic = "short_requests" if w.short else "long_sessions"
    tau, k = math.inf, 0
    for t in np.arange(tick_s, T, tick_s):
        t = float(t)
        near_window = announced <= t and ws - 3 * HOUR <= t < we
        if k % decide_every and not near_window:
            k += 1
            if math.isfinite(tau) and (not ckpts or t - ckpts[-1] >= tau):
                ckpts.append(t)
            continue
        k += 1
        seen = int(np.searchsorted(fails, t))
        mtbf_est = (declared + t) / (1 + seen)  # gamma posterior: declared MTBF as one prior failure
        tc = ckpts[-1] if ckpts else None
        live, growth = live_tokens(cfg, w, t)
        # Before its first heartbeat a worker has its initialised checkpoint (t=0, no KV).
        f = WorkloadFacts(name="w", traffic=traffic, footprint_gib=w.footprint, mtbf_s=mtbf_est,
                          live_tokens=live, growth_tokens_s=growth,
                          tokens_since_ckpt=at_risk_tokens(cfg, w, t, tc),
                          seconds_since_ckpt=t - (tc or 0.0), now=t,
                          maintenance=[(ws, we)] if t >= announced else [])
        d = decide(f, "cost-based", params, cfg.cost)
        tau = d.interval_s if d.action == Action.protect and d.interval_s else math.inf
        if d.due and d.action in (Action.protect, Action.checkpoint_now):
            ckpts.append(t)
    return np.array(ckpts)


def simulate(seed: int = 0, cfg: TraceConfig | None = None,
             params: Mapping[str, Any] | CostBasedParams | None = None, with_curve: bool = False) -> dict:
    """Replay one seeded trace under every policy; return per-policy totals.

    Raises:
        pydantic.ValidationError: ``params`` are not valid cost-based parameters.
    """
    tr = make_trace(seed, cfg)
    cfg = tr.cfg
    params = get_policy("cost-based").parse(params or {"min_interval_s": 300, "max_interval_s": 7 * DAY})
    r = np.random.default_rng(seed + 10_000)
    phases = r.random(len(tr.workloads))
    pol: dict[str, dict] = {}

    def run(name: str, sched, **kw) -> None:
        tot: dict = {}
        for i, w in enumerate(tr.workloads):
            _add(tot, schedule_cost(tr, w, sched(i, w), **kw))
        pol[name] = tot

    run("never", lambda i, w: np.zeros(0), template=False)
    for tau in FIXED_INTERVALS:
        run(f"fixed-{tau:.0f}", lambda i, w, tau=tau: fixed_schedule(tr, tau, phases[i]))
    mean_c = float(np.mean([cfg.cost.pause_s(w.footprint) for w in tr.workloads]))
    mean_m = float(1 / np.mean(1 / tr.node_mtbf_s))
    tau_yd = young_interval(mean_c, mean_m)
    run("young-daly", lambda i, w: fixed_schedule(tr, tau_yd, phases[i]))

    hind: dict = {}
    for i, w in enumerate(tr.workloads):
        best = min((schedule_cost(tr, w, fixed_schedule(tr, tau, phases[i])) for tau in HINDSIGHT_GRID),
                   key=lambda c: c["cost"])
        _add(hind, best)
    pol["hindsight"] = hind

    clair: dict = {}
    for w in tr.workloads:
        ck: list[float] = []
        C = cfg.cost.pause_s(w.footprint)
        for t, _ in tr.events(w):
            risk = at_risk_tokens(cfg, w, t, ck[-1] if ck else None) / cfg.cost.prefill_tokens_s
            if risk > C:
                ck.append(t - 1e-3)
        _add(clair, schedule_cost(tr, w, np.array(ck), drains_short=True))
    pol["clairvoyant"] = clair

    run("ckptflow", lambda i, w: ckptflow_schedule(tr, w, params), drains_short=True)

    out = {"seed": seed, "failure_dist": cfg.failure_dist, "workloads": len(tr.workloads),
           "young_daly_interval_s": tau_yd,
           "node_failures": int(sum(len(f) for f in tr.failures)),
           "policies": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in pol.items()}}
    if with_curve:
        curve = []
        for tau in sorted(set(HINDSIGHT_GRID[1:] + FIXED_INTERVALS)):
            tot: dict = {}
            for i, w in enumerate(tr.workloads):
                _add(tot, schedule_cost(tr, w, fixed_schedule(tr, tau, phases[i])))
            curve.append((tau, tot["cost"]))
        out["fixed_curve"] = curve
    return out
