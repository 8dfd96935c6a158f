"""Checkpoint cadence per workload: skip, protect(interval), checkpoint_now, drain.

A fleet file picks a policy per workload by name, first matching rule wins, and gives it
parameters; each policy's parameters are a pydantic model, so a misspelt key is an error
that names its line instead of a default silently used::

    policies:
      - match: {traffic: long_sessions}
        policy: cost-based                 # CostBasedParams
        params: {min_interval_s: 300, max_interval_s: 86400}
      - match: {labels: {tier: batch}}
        policy: never                      # NeverParams: no parameters
      - match: {}
        policy: fixed                      # FixedParams
        params: {interval_s: 1800}

Policies are registered by name (``@register("fixed", FixedParams)``) in ``POLICIES``, which
the fleet loader checks rules against.

Pure: facts in, a Decision out (with a one-line reason that shows the numbers).

The cost model, in GPU-seconds of one worker:
- a checkpoint pauses the worker for C seconds (measured pause, else footprint x 1.3 s/GiB,
  the H200 heartbeat pause of bench/gpu_checkpoint.py in bench/RESULTS.md);
- a failure costs a restore R plus re-prefilling every KV token not in the checkpoint
  (at ``prefill_tokens_s``); with no checkpoint at all, a cold start instead of R.
If the KV at risk grows at g GPU-s per second (new tokens / prefill rate), the loss since
the last checkpoint grows like g*t, so Young's interval becomes sqrt(2 C M / g) and Daly's
higher-order form applies to C' = C/g. A checkpoint pays off only when its pause costs less
than the re-prefill it saves: C/tau + lambda*min(g*tau/2, A) < lambda*A, A = live KV in
GPU-s. Short-request traffic never pays: what is at risk is a retry of a few seconds.

Example:
    >>> facts = WorkloadFacts(name="chat", traffic="long_sessions", footprint_gib=20, mtbf_s=24 * 3600,
    ...                       live_tokens=2e7, growth_tokens_s=2000, tokens_since_ckpt=1e6,
    ...                       seconds_since_ckpt=600.0)
    >>> d = decide(facts)
    >>> d.action.value, round(d.interval_s), d.due
    ('protect', 4653, False)
    >>> d.reason
    'Daly interval 1.3 h saves 43.8 GPU-s/h (C=26s, M=24.0 h, KV at risk 2000 GPU-s growing 720/h)'
    >>> decide(facts, "cost-based", {"max_interval_s": 1800}).interval_s
    1800.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckptflow.models import Action, Decision

INF = math.inf


class CostModel(BaseModel):
    """Measured and assumed costs; defaults from the H200 measurements in bench/RESULTS.md."""

    pause_s_per_gib: float = Field(1.3, gt=0, description="Heartbeat pause per GiB of GPU footprint.")
    restore_gib_s: float = Field(1.25, gt=0, description="Restore throughput (CRIU + CUDA), GiB/s.")
    restore_fixed_s: float = Field(5.0, ge=0, description="Fixed part of a restore (health, probes).")
    cold_start_s: float = Field(600.0, gt=0, description="Cold start of a worker: weights, graphs.")
    prefill_tokens_s: float = Field(10_000.0, gt=0, description="Re-prefill rate of lost KV.")

    def pause_s(self, footprint_gib: float, measured: float | None = None) -> float:
        return measured if measured is not None and measured > 0 else footprint_gib * self.pause_s_per_gib

    def restore_s(self, footprint_gib: float) -> float:
        return footprint_gib / self.restore_gib_s + self.restore_fixed_s


@dataclass(slots=True)
class WorkloadFacts:
    """What can be observed about one workload at one tick (seconds, tokens, epoch times)."""

    name: str
    traffic: str = "mixed"                     # TrafficClass value
    footprint_gib: float = 0.0
    measured_pause_s: float | None = None
    mtbf_s: float = 6000 * 3600.0
    live_tokens: float = 0.0                   # KV tokens held now (sessions alive)
    growth_tokens_s: float = 0.0               # rate at which new KV tokens appear
    tokens_since_ckpt: float | None = None     # new KV since the newest valid checkpoint
    seconds_since_ckpt: float | None = None    # None: no valid checkpoint
    newest_invalidated: bool = False
    mean_request_s: float | None = None
    now: float = 0.0
    maintenance: list[tuple[float, float]] = field(default_factory=list)
    unsupported: str | None = None             # why the worker, as started, cannot be checkpointed
    gone: str | None = None                    # why its process cannot be found: the worker is lost


def young_interval(c: float, m: float) -> float:
    """Young (1974): sqrt(2 C M)."""
    return math.sqrt(2 * c * m)


def daly_interval(c: float, m: float) -> float:
    """Daly (2006) higher-order optimum; for C >= 2M the continuous value 8M/9.

    Non-decreasing in both C and M (the C >= 2M branch meets the formula at C = 2M), so a
    larger checkpoint cost or a more reliable node never shortens the interval.
    """
    if c <= 0:
        return 0.0
    if c >= 2 * m:
        return 8 * m / 9
    return math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c


def _fmt(s: float) -> str:
    if s == INF:
        return "never"
    for unit, n in (("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}"
    return f"{s:.0f} s"


def _maintenance(f: WorkloadFacts, lead_s: float) -> tuple[str, float] | None:
    for start, end in f.maintenance:
        if start <= f.now < end:
            return "in", end
        if 0 <= start - f.now <= lead_s:
            return "ahead", start
    return None


def _is_short(f: WorkloadFacts, short_request_s: float) -> bool:
    if f.traffic == "short_requests":
        return True
    return (f.traffic == "mixed" and f.mean_request_s is not None and f.mean_request_s < short_request_s
            and f.live_tokens <= 0)


def cost_based_interval(f: WorkloadFacts, cost: CostModel, min_s: float = 0.0, max_s: float = INF
                        ) -> tuple[float, str]:
    """Interval for one workload (INF = not worth checkpointing) and the reason with numbers."""
    c = cost.pause_s(f.footprint_gib, f.measured_pause_s)
    g = f.growth_tokens_s / cost.prefill_tokens_s
    a = f.live_tokens / cost.prefill_tokens_s
    lam = 1.0 / f.mtbf_s
    if g <= 0 or a <= 0:
        return INF, f"no KV growing (live {f.live_tokens:.0f} tokens, +{f.growth_tokens_s:.0f}/s)"
    # Whether checkpoints pay off is judged at the optimum; the rule's bounds then only move
    # the interval (an operator's max_interval_s must not turn protection off).
    opt = daly_interval(c / g, f.mtbf_s)
    with_ckpt = c / opt + lam * min(g * opt / 2, a) if opt > 0 else INF
    tau = min(max(opt, min_s), max_s)
    without = lam * a
    numbers = (f"C={c:.0f}s, M={_fmt(f.mtbf_s)}, KV at risk {a:.0f} GPU-s growing {g * 3600:.0f}/h")
    if with_ckpt >= without:
        return INF, (f"checkpoints cost more than they save: {with_ckpt * 3600:.1f} vs "
                     f"{without * 3600:.1f} GPU-s/h ({numbers})")
    return tau, f"Daly interval {_fmt(tau)} saves {(without - with_ckpt) * 3600:.1f} GPU-s/h ({numbers})"


class PolicyParams(BaseModel):
    """Parameters of one policy (a rule's ``params:``). Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CostBasedParams(PolicyParams):
    """``cost-based``: Daly's interval for the KV growth rate, only where it pays (see above)."""

    min_interval_s: float = Field(60.0, ge=0, description="Never protect more often than this.", examples=[300])
    max_interval_s: float = Field(7 * 86400.0, ge=0, description="Protect at least this often once checkpoints "
                                  "pay off at all (it never turns protection on).", examples=[86400])
    short_request_s: float = Field(60.0, ge=0, description="Mixed traffic whose mean request is shorter than "
                                   "this and holds no KV is treated as short requests (skip).")
    burst_factor: float = Field(3.0, ge=0, description="Checkpoint now when the new KV since the last checkpoint "
                                "exceeds this many intervals' worth (or pauses' worth).")
    maintenance_lead_s: float | None = Field(None, ge=0, description="How long before a maintenance window to "
                                             "checkpoint or drain; default max(900 s, 3 x the pause).")

    @model_validator(mode="after")
    def _ordered(self) -> "CostBasedParams":
        if self.min_interval_s > self.max_interval_s:
            raise ValueError(f"min_interval_s {self.min_interval_s:g} is above max_interval_s {self.max_interval_s:g}")
        return self


class FixedParams(PolicyParams):
    """``fixed``: protect at one interval, whatever the costs."""

    interval_s: float = Field(3600.0, ge=0, description="Checkpoint interval.", examples=[1800])


class NeverParams(PolicyParams):
    """``never``: no checkpoints (no parameters)."""


P = TypeVar("P", bound=PolicyParams)
DecideFn = Callable[[WorkloadFacts, Any, CostModel], Decision]


@dataclass(frozen=True, slots=True)
class Policy:
    """A registered policy: its name in fleet files, its parameters' model, its decision."""

    name: str
    params: type[PolicyParams]
    decide: DecideFn
    defaults: PolicyParams          # what a rule without ``params:`` gets

    def parse(self, params: Mapping[str, Any] | PolicyParams | None) -> PolicyParams:
        """``params`` as this policy's model.

        Raises:
            pydantic.ValidationError: an unknown key, or a value of the wrong type or range.
        """
        if params is None:
            return self.defaults
        if isinstance(params, self.params):
            return params
        if isinstance(params, PolicyParams):
            params = params.model_dump(exclude_unset=True)
        return self.params.model_validate(params)


POLICIES: dict[str, Policy] = {}


def register(name: str, params: type[P]) -> Callable[[DecideFn], DecideFn]:
    """Register a decision function under ``name`` with its parameters' model."""
    def add(fn: DecideFn) -> DecideFn:
        POLICIES[name] = Policy(name, params, fn, params())
        return fn
    return add


def get_policy(name: str) -> Policy:
    """The registered policy called ``name``.

    Raises:
        KeyError: no policy of that name (the fleet file loader checks names first).
    """
    try:
        return POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


@register("cost-based", CostBasedParams)
def decide_cost_based(f: WorkloadFacts, params: CostBasedParams, cost: CostModel) -> Decision:
    min_s = params.min_interval_s
    max_s = params.max_interval_s
    short_request_s = params.short_request_s
    burst_factor = params.burst_factor
    c = cost.pause_s(f.footprint_gib, f.measured_pause_s)
    lead_s = params.maintenance_lead_s if params.maintenance_lead_s is not None else max(900.0, 3 * c)
    at_risk_tokens = f.live_tokens if f.tokens_since_ckpt is None else f.tokens_since_ckpt
    at_risk_s = at_risk_tokens / cost.prefill_tokens_s
    short = _is_short(f, short_request_s)

    m = _maintenance(f, lead_s)
    if m and m[0] == "in":
        return Decision(workload=f.name, action=Action.drain, reason=f"node in maintenance until t={m[1]:.0f}")
    if m:
        mins = (m[1] - f.now) / 60
        if not short and at_risk_s > c and (f.seconds_since_ckpt is None or f.seconds_since_ckpt > f.now - m[1] + lead_s):
            return Decision(workload=f.name, action=Action.checkpoint_now, due=True,
                            reason=f"maintenance in {mins:.0f} min: {at_risk_s:.0f} s of re-prefill at risk "
                                   f"> {c:.0f} s pause")
        why = ("short requests finish" if short else
               f"at risk {at_risk_s:.0f} s <= pause {c:.0f} s or already checkpointed")
        return Decision(workload=f.name, action=Action.drain, reason=f"maintenance in {mins:.0f} min: drain ({why})")
    if short:
        retry = f.mean_request_s if f.mean_request_s is not None else short_request_s / 2
        return Decision(workload=f.name, action=Action.skip,
                        reason=f"short requests (mean {retry:.0f} s): a retry costs less than a {c:.0f} s pause")
    if f.seconds_since_ckpt is None:
        return Decision(workload=f.name, action=Action.checkpoint_now, due=True,
                        reason=f"no valid checkpoint: a failure would cost a {cost.cold_start_s:.0f} s cold start "
                               f"instead of a {cost.restore_s(f.footprint_gib):.0f} s restore")
    if f.tokens_since_ckpt is not None and f.tokens_since_ckpt <= 0:
        return Decision(workload=f.name, action=Action.skip,
                        reason=f"nothing new since the last checkpoint {_fmt(f.seconds_since_ckpt)} ago")
    tau, why = cost_based_interval(f, cost, min_s, max_s)
    if f.newest_invalidated and at_risk_s > 0 and tau != INF:
        return Decision(workload=f.name, action=Action.checkpoint_now, interval_s=tau, due=True,
                        reason=f"newest checkpoint invalidated; {at_risk_s:.0f} s of KV unprotected")
    if tau == INF:
        return Decision(workload=f.name, action=Action.skip, reason=why)
    g = f.growth_tokens_s / cost.prefill_tokens_s
    if f.tokens_since_ckpt is not None and at_risk_s > burst_factor * max(g * tau, c):
        return Decision(workload=f.name, action=Action.checkpoint_now, interval_s=tau, due=True,
                        reason=f"burst: {at_risk_s:.0f} s of new KV since the last checkpoint "
                               f"> {burst_factor:g} x {max(g * tau, c):.0f} s")
    due = f.seconds_since_ckpt is None or f.seconds_since_ckpt >= tau
    return Decision(workload=f.name, action=Action.protect, interval_s=tau, due=due, reason=why)


@register("fixed", FixedParams)
def decide_fixed(f: WorkloadFacts, params: FixedParams, cost: CostModel) -> Decision:
    tau = params.interval_s
    due = f.seconds_since_ckpt is None or f.seconds_since_ckpt >= tau
    return Decision(workload=f.name, action=Action.protect, interval_s=tau, due=due,
                    reason=f"fixed interval {_fmt(tau)}")


@register("never", NeverParams)
def decide_never(f: WorkloadFacts, params: NeverParams, cost: CostModel) -> Decision:
    return Decision(workload=f.name, action=Action.skip, reason="policy never")


def decide(f: WorkloadFacts, policy: str = "cost-based", params: Mapping[str, Any] | PolicyParams | None = None,
           cost: CostModel | None = None) -> Decision:
    """Decide for one workload with a named policy.

    ``params`` is the policy's model, or a mapping validated into it (None: its defaults).

    Example:
        >>> decide(WorkloadFacts(name="api", seconds_since_ckpt=100.0), "fixed", {"interval_s": 60}).reason
        'fixed interval 1.0 min'
        >>> try:
        ...     decide(WorkloadFacts(name="api"), "fixed", {"intervall_s": 60})
        ... except ValueError as e:                      # pydantic.ValidationError
        ...     print(e.errors()[0]["loc"], e.errors()[0]["msg"])
        ('intervall_s',) Extra inputs are not permitted

    Raises:
        KeyError: the policy name is not registered (the fleet file loader checks names first).
        pydantic.ValidationError: ``params`` has an unknown key or a bad value.
    """
    chosen = get_policy(policy)
    params = chosen.parse(params)
    if f.gone:  # whatever the policy: nothing runs to checkpoint, and what ran is lost until recovered
        return Decision(workload=f.name, action=Action.skip, reason=f"worker gone: {f.gone}")
    if f.unsupported:  # whatever the policy: a checkpoint it cannot take is no protection
        return Decision(workload=f.name, action=Action.skip, reason=f"cannot be checkpointed: {f.unsupported}")
    return chosen.decide(f, params, cost or _DEFAULT_COST)


_DEFAULT_COST = CostModel()
