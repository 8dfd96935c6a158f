"""Which sessions a two-tier heartbeat protects, and which it moves: one decision per session.

The workload's cadence policy (cadence.py) decides *when* a heartbeat runs; this decides *what*
goes into it. Every session is protected, short ones too: a session left out of the checkpoint
is gone after a restore, and its client's next turn would silently start a fresh one (the
engine cannot tell a lost session from a new one), which no retry-cost saving is worth — a short
session's chunks are small. A session that changed since its last checkpoint is exported or
waits, as of its last turn boundary (between turns its KV does not change); one that did not
change is kept as it was checkpointed (no bytes move). Pure: facts in, decisions with a one-line
reason out.

Export now, or wait (``decide_export``, given the worker's ``ExportContext``): exporting the
``n`` tokens a session gained pauses the engine ``p`` s per GiB of them (two-tier-h200: 0.036
s/GiB) and writes them, ``b`` GPU-s per GiB (``CostModel.bytes_s_per_gib``: node disk and network,
the shared tier; 1.14 by default, 70 % of the re-prefill of a GiB of KV at 64 KiB/token); waiting risks re-prefilling them (n / prefill rate) if an interruption comes while the
session lives, with probability min(1, R / M): R its expected remaining life (its age, a session
that has lived a while tends to live as long again, and at least ``session_mean_s``), M the
node's MTBF; an announced maintenance or a drain makes it 1. The heartbeat's fixed part of the
pause is the cadence policy's to weigh (it is paid once, whatever the sessions), not a
session's. The simulator (ckptflow/sim.py) calls the same function for every session at every
heartbeat it replays.

At a session's turn end (``ExportContext.at_turn_end``: runners/turns.py, between heartbeats) an
export holds that session alone while the engine serves on, so each session is weighed on its
own, new ones too: a new session whose KV does not pay (a healthy node) is *listed* instead,
named in the checkpoint without its KV, and a restore tells the engine it is lost, which answers
its client's next turn with that (HTTP 410), never a silent fresh start.

Example:
    >>> ds = decide_sessions([SessionFacts(id="chat", tokens=4000, tokens_at_ckpt=3500),
    ...                       SessionFacts(id="q", tokens=20),
    ...                       SessionFacts(id="idle", tokens=900, tokens_at_ckpt=900)])
    >>> [(d.id, d.protect, d.export) for d in ds]
    [('chat', True, True), ('q', True, True), ('idle', True, False)]
    >>> ds[0].reason, ds[1].reason
    ('grew by 500 tokens since its last checkpoint (4000 held)', 'new session (20 tokens)')

With the worker's costs and MTBF, a grown session waits on a healthy node, and on a preemptible
one too, where the 3.7 GiB it would write cost more than the chance an interruption needs them
(it would move there if bytes were free); it is exported before maintenance:
    >>> grown = [SessionFacts(id="agent", tokens=90_000, tokens_at_ckpt=30_000, age_s=1800)]
    >>> ctx = ExportContext(mtbf_s=6000 * 3600, kv_bytes_per_token=65536)
    >>> decide_sessions(grown, context=ctx)[0].reason
    'waits: 60000 new tokens would pause 0.132 s + 4.166 s for 3.66 GiB written > 6.0 s re-prefill x 0.02% chance an interruption hits it (remaining ~1.0 h, M=6000 h)'
    >>> preemptible = ctx.model_copy(update={"mtbf_s": 24 * 3600})
    >>> free = CostModel(shared_tier_usd_per_gib=0.0, node_usd_per_gib=0.0)    # bytes unpriced
    >>> [decide_sessions(grown, context=c)[0].export for c in (preemptible, preemptible.model_copy(update={"cost": free}))]
    [False, True]
    >>> decide_sessions(grown, context=ctx.model_copy(update={"interruption_ahead": True}))[0].reason
    'export: 60000 new tokens pause 0.132 s + 4.166 s for 3.66 GiB written < 6.0 s re-prefill x 100.00% chance an interruption hits it (interruption announced)'
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from ckptflow.models import Action, Decision
from ckptflow.policies.cadence import CostModel, WorkloadFacts

# Sessions shorter than this are left out of a checkpoint. 0: none is. A positive value loses
# those sessions in a restore without their clients being told (they restart fresh), so it is
# for an engine that answers a lost session with an error, not the default.
MIN_TOKENS = 0

# The simulator's reference trace: lognormal sessions, median 30 min, p99 8 h, mean 1.0 h
# (its expected remaining life at any age up to 8 h is 1.0-3.3 h, so the floor is the mean).
SESSION_MEAN_S = 3600.0


class SessionFacts(BaseModel):
    """One session as the engine reports it, and as its last checkpoint holds it."""

    id: str = Field(..., description="The engine's session id.", examples=["chat-17"])
    tokens: int = Field(..., ge=0, description="Tokens the session holds now (its KV length).")
    tokens_at_ckpt: int | None = Field(None, ge=0, description="Tokens its last checkpoint holds "
                                       "(None: never checkpointed).")
    since_s: float | None = Field(None, ge=0, description="Seconds since its last export, where known (at a "
                                  "turn end: how long its new KV has been at risk).")
    age_s: float | None = Field(None, ge=0, description="Seconds since the session started, where known "
                                "(None: its expected remaining life is ExportContext.session_mean_s).")


class ExportContext(BaseModel):
    """What a heartbeat knows about its worker when it weighs each session's export."""

    model_config = ConfigDict(frozen=True)

    mtbf_s: float = Field(..., gt=0, description="The node's MTBF as the cadence policy estimates it (seconds).")
    interruption_ahead: bool = Field(False, description="An announced maintenance window or a drain is next: "
                                     "every changed session is exported.")
    kv_bytes_per_token: float | None = Field(None, gt=0, description="KV bytes per token (None: the cost "
                                             "model's).")
    session_mean_s: float = Field(SESSION_MEAN_S, gt=0, description="Expected remaining life of a session of "
                                  "unknown or small age (seconds).")
    cost: CostModel = Field(default_factory=CostModel, description="Pause per GiB moved and re-prefill rate.")
    device: str = Field("gpu", description="'cpu' for a CPU-only worker: its KV re-prefills at the CPU rate.")
    at_turn_end: bool = Field(False, description="The session is between turns: its export holds that session "
                              "only while the engine serves on, and pays CostModel.turn_export_s (its own fixed "
                              "part included); else it goes into a heartbeat that holds the engine.")


def export_context(f: WorkloadFacts, d: Decision, cost: CostModel | None = None) -> ExportContext:
    """The context a two-tier heartbeat weighs its sessions in, from the facts and the decision
    that ran it: the live heartbeat (tasks/node.py) and the simulator build it here, alike."""
    ahead = d.action == Action.checkpoint_now and d.reason.startswith("maintenance in")
    return ExportContext(mtbf_s=f.mtbf_s, interruption_ahead=ahead, kv_bytes_per_token=f.kv_bytes_per_token,
                         device=f.device, **({"cost": cost} if cost is not None else {}))


class SessionDecision(BaseModel):
    id: str
    protect: bool = Field(..., description="Whether the checkpoint holds this session at all.")
    export: bool = Field(..., description="Whether its state moves now (else: kept as last checkpointed).")
    listed: bool = Field(False, description="Not held, but named in the checkpoint: a restore tells the engine "
                         "it is lost, and the engine answers its next turn so (never a silent fresh start).")
    reason: str


def _hours(s: float) -> str:
    return f"{s / 3600:.0f} h" if s >= 36_000 else f"{s / 3600:.1f} h"


def _hit(age_s: float | None, ctx: ExportContext) -> tuple[float, str]:
    """Chance an interruption comes while the session lives, and why."""
    if ctx.interruption_ahead:
        return 1.0, "interruption announced"
    remaining = max(age_s or 0.0, ctx.session_mean_s)
    return min(1.0, remaining / ctx.mtbf_s), f"remaining ~{_hours(remaining)}, M={_hours(ctx.mtbf_s)}"


def _pause(changed_tokens: float, ctx: ExportContext) -> float:
    cost = ctx.cost
    if ctx.at_turn_end:
        return cost.turn_export_s(changed_tokens, ctx.kv_bytes_per_token)
    return cost.session_pause_s_per_gib * cost.kv_gib(changed_tokens, ctx.kv_bytes_per_token)


def _bytes_s(changed_tokens: float, ctx: ExportContext) -> float:
    """What writing the exported KV costs (``CostModel.bytes_s_per_gib``), beside the pause."""
    return ctx.cost.kv_bytes_s(changed_tokens, ctx.kv_bytes_per_token, ctx.device)


def _cost(changed_tokens: float, ctx: ExportContext) -> float:
    """An export's whole cost: its pause and its bytes."""
    return _pause(changed_tokens, ctx) + _bytes_s(changed_tokens, ctx)


def _per_token(ctx: ExportContext) -> float:
    """A token's share of an export's cost, pause and bytes (the fixed part aside)."""
    return _cost(1.0, ctx) - _cost(0.0, ctx)


def _costs(changed_tokens: float, ctx: ExportContext) -> str:
    """The export's cost as the reasons say it: 'pause 0.132 s', and its bytes where they are priced."""
    pause, written = _pause(changed_tokens, ctx), _bytes_s(changed_tokens, ctx)
    if not written:
        return f"pause {pause:.3f} s"
    gib = ctx.cost.kv_gib(changed_tokens, ctx.kv_bytes_per_token)
    return f"pause {pause:.3f} s + {written:.3f} s for {gib:.2f} GiB written"


def young_product_s2(ctx: ExportContext) -> float:
    """Re-prefill at risk (s) x seconds since the export past which a turn-end export pays:
    2 x the export's fixed part x M, Young's interval for one session."""
    return 2 * _pause(0.0, ctx) * ctx.mtbf_s


def decide_export(changed_tokens: float, age_s: float | None, ctx: ExportContext,
                  since_s: float | None = None) -> tuple[bool, str]:
    """Export a session's ``changed_tokens`` now, or wait (see the module's rule); plain floats in,
    as the simulator asks this for every session at every heartbeat or turn end it replays.

    At a turn end (``ctx.at_turn_end``) the session comes back a turn later with another chance,
    so waiting risks its new KV only until then, not for its whole life: it pays to export at all
    when a token's share of the pause is below its expected re-prefill (hit / prefill rate), and
    then when the re-prefill at risk x the seconds since its last export (``since_s``) reach
    2 x the export's fixed part x M, Young's interval for the session (``since_s`` None: the
    one-shot rule above)."""
    cost = _cost(changed_tokens, ctx)
    saved = changed_tokens / ctx.cost.prefill_rate(ctx.device)
    hit, why = _hit(age_s, ctx)
    numbers = f"{saved:.1f} s re-prefill x {hit:.2%} chance an interruption hits it ({why})"
    if ctx.at_turn_end and since_s is not None and not ctx.interruption_ahead:
        if hit / ctx.cost.prefill_rate(ctx.device) <= _per_token(ctx):
            paid = "pause" if not _bytes_s(1.0, ctx) else "pause and bytes"
            return False, f"waits: {changed_tokens:.0f} new tokens never pay their {paid} ({_costs(changed_tokens, ctx)}; {numbers})"
        young = young_product_s2(ctx)
        turn = (f"{saved:.2f} s re-prefill at risk x {since_s:.0f} s since its export "
                f"{'>=' if saved * since_s >= young else '<'} 2 x {_pause(0.0, ctx):.4f} s x M={_hours(ctx.mtbf_s)}")
        return (True, f"export at turn end: {turn}") if saved * since_s >= young else (False, f"waits a turn: {turn}")
    if saved * hit > cost:
        return True, f"export: {changed_tokens:.0f} new tokens {_costs(changed_tokens, ctx)} < {numbers}"
    return False, f"waits: {changed_tokens:.0f} new tokens would {_costs(changed_tokens, ctx)} > {numbers}"


def new_session_threshold_tokens(ctx: ExportContext) -> float:
    """The KV a new session needs, at a turn end, before ``decide_export`` exports it (strictly
    above; inf: never; its one-shot rule, the rule being linear in the tokens).

        >>> free = CostModel(shared_tier_usd_per_gib=0.0, node_usd_per_gib=0.0)    # bytes unpriced
        >>> ctx = ExportContext(mtbf_s=24 * 3600, kv_bytes_per_token=65536, at_turn_end=True, cost=free)
        >>> [round(new_session_threshold_tokens(ctx.model_copy(update={"mtbf_s": m}))) for m in (86400, 6e6)]
        [398, 27667]
        >>> nofix = ctx.model_copy(update={"cost": free.model_copy(update={"turn_export_fixed_s": 0.0,
        ...                                                                "turn_export_s_per_gib": 0.03})})
        >>> new_session_threshold_tokens(nofix), new_session_threshold_tokens(nofix.model_copy(update={"mtbf_s": 6e6}))
        (0.0, inf)

    With the bytes priced (the default), a new session's KV does not pay at 24 h; before an
    announced window it does, once it holds more than a few dozen tokens:
        >>> priced = ctx.model_copy(update={"cost": CostModel()})
        >>> new_session_threshold_tokens(priced), round(new_session_threshold_tokens(
        ...     priced.model_copy(update={"interruption_ahead": True})))
        (inf, 54)
    """
    hit, _ = _hit(None, ctx)
    per_token = hit / ctx.cost.prefill_rate(ctx.device) - _per_token(ctx)
    return _pause(0.0, ctx) / per_token if per_token > 0 else math.inf


def turns_between_exports(ctx: ExportContext, tokens_per_turn: float, turn_s: float) -> int | None:
    """Every how many turn ends ``decide_export`` exports a session that gains ``tokens_per_turn``
    a turn (``ctx.at_turn_end``): the smallest m with m x tokens_per_turn / prefill rate x m x
    turn_s >= 2 x fixed x M, at least 1; None: never. The simulator replays millions of turn ends
    with it; tests/test_session_policy.py holds it to ``decide_export``.

        >>> free = CostModel(shared_tier_usd_per_gib=0.0, node_usd_per_gib=0.0)    # bytes unpriced
        >>> ctx = ExportContext(mtbf_s=24 * 3600, kv_bytes_per_token=65536, at_turn_end=True, cost=free)
        >>> m = turns_between_exports(ctx, 1200, 30)      # the H200's 0.00166 s fixed part
        >>> m, [decide_export(k * 1200, None, ctx, since_s=k * 30)[0] for k in (m - 1, m)]
        (9, [False, True])
        >>> turns_between_exports(ctx.model_copy(update={"cost": free.model_copy(update={"turn_export_fixed_s": 0.0})}),
        ...                       1200, 30)
        1
        >>> turns_between_exports(ctx.model_copy(update={"cost": CostModel()}), 1200, 30) is None   # bytes priced
        True
    """
    per_token = _per_token(ctx)
    hit, _ = _hit(None, ctx)
    rate = ctx.cost.prefill_rate(ctx.device)
    if not ctx.interruption_ahead and hit / rate <= per_token:
        return None
    if ctx.interruption_ahead:  # certain to be needed: the one-shot rule, once enough KV has built up
        gain = tokens_per_turn * (1 / rate - per_token)
        if gain <= 0:
            return None
        m = max(1, math.ceil(_pause(0.0, ctx) / gain))
        while not decide_export(m * tokens_per_turn, None, ctx)[0]:   # strict '>' at the edge
            m += 1
        return m
    young = young_product_s2(ctx)
    m = max(1, math.ceil(math.sqrt(young * rate / (tokens_per_turn * turn_s))))
    while m > 1 and (m - 1) * tokens_per_turn / rate * (m - 1) * turn_s >= young:   # float edges
        m -= 1
    while m * tokens_per_turn / rate * m * turn_s < young:
        m += 1
    return m


def session_facts(held: dict[str, int], records: dict[str, dict], now: float) -> list[SessionFacts]:
    """The facts of each session the engine holds (``held``: id -> tokens), against the records of
    the workload's newest session checkpoint (``records``: id -> its record; ``tokens`` and, where
    recorded, ``exported_at``, the unix time its exported state was current). The live heartbeat
    and turn-end export build them here; the simulator's turn-by-turn replay does the same.

        >>> [f.since_s for f in session_facts({"a": 90, "b": 5}, {"a": {"tokens": 60, "exported_at": 100.0}}, 130.0)]
        [30.0, None]
    """
    out = []
    for sid, n in held.items():
        r = records.get(sid) or {}
        at = r.get("exported_at")
        out.append(SessionFacts(id=sid, tokens=n, tokens_at_ckpt=r.get("tokens"),
                                since_s=max(now - at, 0.0) if at is not None else None))
    return out


def decide_sessions(sessions: list[SessionFacts], *, min_tokens: int = MIN_TOKENS,
                    context: ExportContext | None = None) -> list[SessionDecision]:
    """One decision per session. Without a ``context`` (no costs to weigh) every changed session
    is exported; with one, a grown session is exported or waits by ``decide_export``. A new or
    rewritten session is always exported in a heartbeat: what its checkpoint would otherwise hold
    is nothing, or KV that is not its own; at a turn end a new one is weighed, and listed when it
    waits."""
    out = []
    for s in sessions:
        if s.tokens < min_tokens:
            out.append(SessionDecision(id=s.id, protect=False, export=False,
                                       reason=f"short ({s.tokens} tokens < min_tokens {min_tokens}): left out, "
                                              "lost in a restore"))
        elif s.tokens_at_ckpt is None and context is not None and context.at_turn_end:
            # At its turn end a new session is weighed like any new KV (all of it, once); one that
            # does not pay is listed, so a restore answers its client 'lost' instead of starting afresh.
            export, why = decide_export(s.tokens, s.age_s, context)
            out.append(SessionDecision(id=s.id, protect=export, export=export, listed=not export,
                                       reason=f"new session ({s.tokens} tokens): " + (
                                           why if export else f"listed without its KV, {why}")))
        elif s.tokens_at_ckpt is None:
            out.append(SessionDecision(id=s.id, protect=True, export=True,
                                       reason=f"new session ({s.tokens} tokens)"))
        elif s.tokens == s.tokens_at_ckpt:
            out.append(SessionDecision(id=s.id, protect=True, export=False,
                                       reason=f"unchanged since its last checkpoint ({s.tokens} tokens)"))
        elif s.tokens > s.tokens_at_ckpt:
            if context is None:
                out.append(SessionDecision(id=s.id, protect=True, export=True,
                                           reason=f"grew by {s.tokens - s.tokens_at_ckpt} tokens since its last "
                                                  f"checkpoint ({s.tokens} held)"))
            else:
                export, why = decide_export(s.tokens - s.tokens_at_ckpt, s.age_s, context, s.since_s)
                out.append(SessionDecision(id=s.id, protect=True, export=export, reason=why))
        else:
            out.append(SessionDecision(id=s.id, protect=True, export=True,
                                       reason=f"rewritten ({s.tokens} tokens, its checkpoint holds {s.tokens_at_ckpt})"))
    return out
