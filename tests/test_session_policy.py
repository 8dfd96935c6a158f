"""Two-tier sessions protected at turn boundaries (#25 item 3): one per-session decision
(policies/sessions.py) that the simulator replays and the live heartbeat calls, fed the same
facts; its rule; and the simulator's per-session costs against the whole-worker ones."""

import math

import numpy as np
import pytest

from ckptflow.models import Action, Decision
from ckptflow.policies.cadence import CostModel, WorkloadFacts
from ckptflow.policies.sessions import (ExportContext, SessionFacts, decide_export, decide_sessions,
                                        export_context, session_facts, turns_between_exports)
from ckptflow.sim import (TraceConfig, Workload, ckptflow_heartbeats, make_trace, profile_config,
                          schedule_cost, session_exports, session_schedule_cost)

H = 3600.0
KV = 65_536.0
FREE = CostModel(shared_tier_usd_per_gib=0.0, node_usd_per_gib=0.0)   # bytes unpriced: the rule's pause and hit alone


def ctx(mtbf_h: float, ahead: bool = False, cost: CostModel = FREE) -> ExportContext:
    return ExportContext(mtbf_s=mtbf_h * H, interruption_ahead=ahead, kv_bytes_per_token=KV, cost=cost)


# --- the rule ----------------------------------------------------------------------------------
def test_new_kv_is_exported_where_an_interruption_is_likely_enough_to_pay_its_pause():
    # 1e5 tokens: 6.1 GiB at 64 KiB/token pause 0.22 s; re-prefill 10 s, hit with chance 1 h / M.
    assert decide_export(1e5, None, ctx(24))[0]                      # 10 s x 4.2 % = 0.42 s > 0.22 s
    assert not decide_export(1e5, None, ctx(500))[0]                 # 10 s x 0.2 % = 0.02 s
    assert not decide_export(1e5, None, ctx(6000))[0]
    # The break-even MTBF is 10 s x 1 h / 0.22 s = 45.5 h.
    assert decide_export(1e5, None, ctx(45))[0] and not decide_export(1e5, None, ctx(46))[0]
    # An announced interruption is certain: exported on any node.
    ok, why = decide_export(1e5, None, ctx(6000, ahead=True))
    assert ok and "interruption announced" in why and "100.00%" in why


def test_the_bytes_an_export_writes_are_weighed_with_its_pause():
    # 1e5 tokens at 64 KiB: 6.1 GiB written cost 6.9 GPU-s (CostModel.bytes_s_per_gib 1.14): above the
    # 10 s x 4.2 % re-prefill a preemptible node risks, below the 10 s an announced interruption does.
    priced = CostModel()
    ok, why = decide_export(1e5, None, ctx(24, cost=priced))
    assert not ok and why.startswith("waits: 100000 new tokens would pause 0.220 s + 6.943 s for 6.10 GiB written >")
    assert decide_export(1e5, None, ctx(24, ahead=True, cost=priced))[0]
    # At 128 KiB a token a GiB re-prefills in 0.82 GPU-s, less than writing it: not even an announced
    # interruption pays for moving it.
    big = ExportContext(mtbf_s=24 * H, interruption_ahead=True, kv_bytes_per_token=131_072, cost=priced)
    assert not decide_export(1e5, None, big)[0]
    # At a turn end: a preemptible node's new KV never pays its bytes; a CPU worker's bytes are not priced.
    turn = ctx(24, cost=priced).model_copy(update={"at_turn_end": True})
    assert turns_between_exports(turn, 1200, 30) is None
    assert decide_export(12_000, None, turn, since_s=300)[1].startswith("waits: 12000 new tokens never pay their "
                                                                          "pause and bytes (pause 0.002 s + 0.833 s")
    assert turns_between_exports(turn.model_copy(update={"cost": FREE}), 1200, 30) == 9
    assert decide_export(1e5, None, ctx(24, cost=priced).model_copy(update={"device": "cpu"}))[0]


def test_an_old_session_is_expected_to_live_longer():
    # 30 h old on a 500 h node: 10 s x 6 % > 0.22 s; the same KV of a young session waits.
    assert decide_export(1e5, 30 * H, ctx(500))[0] and not decide_export(1e5, 600, ctx(500))[0]


def test_new_and_rewritten_sessions_always_move_unchanged_ones_never():
    ds = decide_sessions([SessionFacts(id="new", tokens=50_000), SessionFacts(id="rw", tokens=10, tokens_at_ckpt=900),
                          SessionFacts(id="same", tokens=900, tokens_at_ckpt=900),
                          SessionFacts(id="grown", tokens=90_000, tokens_at_ckpt=30_000)], context=ctx(6000))
    assert [(d.id, d.protect, d.export) for d in ds] == [("new", True, True), ("rw", True, True),
                                                         ("same", True, False), ("grown", True, False)]
    assert ds[3].reason.startswith("waits: 60000 new tokens")
    # Without a context (a forced run, a template capture): every changed session moves.
    assert [d.export for d in decide_sessions([SessionFacts(id="grown", tokens=9, tokens_at_ckpt=3)])] == [True]


def test_the_context_comes_from_the_facts_and_the_decision_that_ran_the_heartbeat():
    f = WorkloadFacts(name="w", mtbf_s=30 * H, kv_bytes_per_token=KV, checkpoint_mode="template-sessions")
    c = export_context(f, Decision(workload="w", action=Action.checkpoint_now, reason="maintenance in 12 min: ..."))
    assert c.mtbf_s == 30 * H and c.interruption_ahead and c.kv_bytes_per_token == KV and c.device == "gpu"
    c = export_context(f, Decision(workload="w", action=Action.protect, reason="Daly interval ..."))
    assert not c.interruption_ahead
    cpu = WorkloadFacts(name="w", mtbf_s=30 * H, device="cpu")
    assert export_context(cpu, Decision(workload="w", action=Action.protect, reason="x")).device == "cpu"
    # On a CPU worker the same tokens are 50x more seconds to recompute: exported on a 500 h node
    # (500 s x 0.2 % = 1 s > 0.22 s), where a GPU worker's wait.
    assert decide_export(1e5, None, ExportContext(mtbf_s=500 * H, device="cpu", kv_bytes_per_token=KV))[0]


# --- the simulator decides what the live heartbeat decides -----------------------------------------
def _tiny_trace(cost: CostModel = FREE):
    cfg = profile_config("two-tier-h200", days=4, nodes=1, gpus_per_node=1, cost=cost)
    tr = make_trace(0, cfg)
    # Sessions (start, end): alive across both heartbeats, one starting between them, one ending.
    w = Workload(node=0, short=False, footprint=80.0, start=np.array([0.0, 1000.0, 2000.0, 5000.0]),
                 end=np.array([20_000.0, 4000.0, 30_000.0, 30_000.0]))
    tr.workloads = [w]
    return tr, w


@pytest.mark.parametrize("mtbf_h", [24.0, 45.0, 46.0, 500.0, 6000.0])
@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("priced", [False, True])
def test_simulator_and_live_heartbeat_decide_the_same_on_the_same_facts(mtbf_h, ahead, priced):
    tr, w = _tiny_trace(CostModel() if priced else FREE)
    cfg = tr.cfg
    f = WorkloadFacts(name="w", mtbf_s=mtbf_h * H, kv_bytes_per_token=cfg.kv_bytes_per_token,
                      checkpoint_mode="template-sessions")
    d = Decision(workload="w", action=Action.checkpoint_now if ahead else Action.protect,
                 reason="maintenance in 10 min: ..." if ahead else "Daly interval ...")
    c = export_context(f, d, cfg.cost)
    beats = [(3000.0, c), (6000.0, c), (9000.0, c)]
    exports, n = session_exports(tr, w, beats)
    # The live heartbeat at each of those times: the engine's held tokens, the records of the
    # workload's newest session checkpoint (TemplateSessionsRunner._checkpoint_sessions builds these).
    from ckptflow.sim import _ctx

    records: dict[str, int] = {}
    live_exports = [[] for _ in range(len(w.start))]
    for t, _ in beats:
        held = {str(j): int(np.floor(_ctx(cfg, w.start[j:j + 1], t)[0])) for j in range(len(w.start))
                if w.start[j] <= t < w.end[j]}
        ds = decide_sessions([SessionFacts(id=sid, tokens=k, tokens_at_ckpt=records.get(sid)) for sid, k in held.items()],
                             context=export_context(f, d, cfg.cost))
        for dd in ds:
            if dd.export:
                records[dd.id] = held[dd.id]
                live_exports[int(dd.id)].append(t)
    assert exports == live_exports
    assert n == sum(any(t in ex for ex in live_exports) for t, _ in beats)
    # Every session is in its first heartbeat; grown ones move again only where it pays.
    assert all(ex and ex[0] == min(t for t, _ in beats if t >= s) for ex, s in zip(exports, w.start))
    again = ahead or (mtbf_h <= 45 and not priced)     # its bytes priced, grown KV moves only before a window
    assert exports[3] == ([6000.0, 9000.0] if again else [6000.0])    # new at 6000 s, grown by 9000 s
    assert exports[1] == [3000.0]                                      # ended at 4000 s


# --- the simulator's per-session costs --------------------------------------------------------------
def test_per_session_costs_equal_the_whole_worker_ones_when_every_session_moves_every_time():
    cfg = profile_config("two-tier-h200", days=3, nodes=2)
    tr = make_trace(1, cfg)
    w = next(w for w in tr.workloads if not w.short and len(tr.events(w)) >= 1)
    hb = np.sort(np.random.default_rng(0).uniform(0, cfg.days * 86400, 50))
    exports = [[float(t) for t in hb if s <= t < e] for s, e in zip(w.start, w.end)]
    whole = schedule_cost(tr, w, hb)
    per = session_schedule_cost(tr, w, exports, len(hb))
    for k in ("lost_gpu_s", "pause_gpu_s", "bytes", "restart_gpu_s", "reprefill_gpu_s", "kv_kept_gpu_s", "cost"):
        assert per[k] == pytest.approx(whole[k], rel=1e-9, abs=1e-6), k
    # Leaving a session out raises the re-prefill of a failure it is alive in, and lowers the bytes.
    t_fail = tr.events(w)[0][0]
    alive = [j for j, (s, e) in enumerate(zip(w.start, w.end)) if s < t_fail < e and exports[j] and exports[j][0] < t_fail]
    if alive:
        fewer = [[] if j == alive[0] else ex for j, ex in enumerate(exports)]
        out = session_schedule_cost(tr, w, fewer, len(hb))
        assert out["reprefill_gpu_s"] > per["reprefill_gpu_s"] and out["bytes"] < per["bytes"]


def test_two_tier_maintenance_is_exported_by_the_drain_at_the_last_turn_boundary():
    cfg = profile_config("two-tier-h200", days=4, nodes=4)
    tr = make_trace(0, cfg)
    params = {"min_interval_s": 300, "max_interval_s": 7 * 86400}
    healthy = [w for w in tr.workloads if not w.short and tr.node_mtbf_s[w.node] == cfg.mtbf_h * H
               and all(m for _, m in tr.events(w))]                    # no failure: the window is the event
    assert healthy
    for w in healthy[:3]:
        ws = tr.windows[w.node][0]
        beats = ckptflow_heartbeats(tr, w, params)
        assert [(t, c.interruption_ahead) for t, c in beats] == [(ws - cfg.turn_s, True)]
        out = session_schedule_cost(tr, w, *session_exports(tr, w, beats))
        # Only the last 30 s of growth is re-prefilled: at most 16 sessions x 40 tokens/s.
        assert 0 < out["reprefill_gpu_s"] <= 16 * 40 * cfg.turn_s / cfg.cost.prefill_tokens_s
        assert out["kv_kept_gpu_s"] > 10 * out["reprefill_gpu_s"]
    # The process profile keeps its tick-time checkpoint (its numbers are pinned in test_sim).
    proc = make_trace(0, TraceConfig(days=4, nodes=4))
    w = next(w for w in proc.workloads if not w.short and proc.node_mtbf_s[w.node] == cfg.mtbf_h * H)
    assert all(not c.interruption_ahead for _, c in ckptflow_heartbeats(proc, w, params))


# --- sessions weighed at their turn ends (the simulator's two-tier default) ------------------------
def _replay_turn_by_turn(tr, w, tick_s=300, decide_every=12):
    """Every turn end of every session in time order, each decided by ``decide_sessions`` on the
    facts the live turn-end export builds (tokens now, tokens and time of its last export)."""
    from ckptflow.sim import _ctx, restore_of

    cfg, cost = tr.cfg, tr.cfg.cost
    T, every = cfg.turn_s, tick_s * decide_every
    fails, declared = tr.failures[w.node], tr.node_mtbf_s[w.node]
    ws = tr.windows[w.node][0]

    def tok(k):
        return int(min(cfg.context_start_tokens + cfg.context_growth_tokens_s * T * k, cfg.context_cap_tokens))

    items = []  # (time, order, session or event): turn ends first, then the drain, then an interruption
    for j, (s, e) in enumerate(zip(w.start, w.end)):
        k = 1
        while s + k * T < min(e, cfg.days * 86400):      # the trace ends at its last day
            if s + k * T > 0:
                items.append((s + k * T, 0, j, k))
            k += 1
    items.append((ws - T, 1, None, None))
    items += [(t, 2, maint, None) for t, maint in tr.events(w)]
    rec: dict[int, tuple[int, float]] = {}
    exports = 0
    lost = 0.0
    for t, order, j, k in sorted(items, key=lambda x: (x[0], x[1])):
        if order == 0:
            tick = math.ceil(t / every - 1) * every      # the newest decision tick before this turn end
            ctx = ExportContext(mtbf_s=(declared + tick) / (1 + int(np.searchsorted(fails, tick))),
                                kv_bytes_per_token=cfg.kv_bytes_per_token, cost=cost, at_turn_end=True)
            had = rec.get(j)
            records = {str(j): {"tokens": had[0], "exported_at": had[1]}} if had else {}
            d = decide_sessions(session_facts({str(j): tok(k)}, records, t), context=ctx)[0]
            if d.export:
                rec[j], exports = (tok(k), t), exports + 1
        elif order == 1:  # the drain: each session as of its last turn end, weighed with the window announced
            ahead = ExportContext(mtbf_s=declared, kv_bytes_per_token=cfg.kv_bytes_per_token, cost=cost,
                                  at_turn_end=True, interruption_ahead=True)
            for jj, (s, e) in enumerate(zip(w.start, w.end)):
                kd = math.floor((t - s) / T)
                if s < t < e and kd >= 1 and (jj not in rec or tok(kd) > rec[jj][0]):
                    records = {str(jj): {"tokens": rec[jj][0], "exported_at": rec[jj][1]}} if jj in rec else {}
                    d = decide_sessions(session_facts({str(jj): tok(kd)}, records, t), context=ahead)[0]
                    if d.export:
                        rec[jj], exports = (tok(kd), s + kd * T), exports + 1   # its KV as of that turn end
        else:
            alive = [jj for jj, (s, e) in enumerate(zip(w.start, w.end)) if s < t < e]
            live = float(_ctx(cfg, w.start[alive], t).sum()) if alive else 0.0
            done = float(sum(rec[jj][0] for jj in alive if jj in rec))
            lost += restore_of(cfg, w, done) + (live - done) / cost.prefill_tokens_s
    moved = sum(n for n, _ in rec.values())
    pause = exports * cost.turn_export_fixed_s + cost.turn_export_s_per_gib * cost.kv_gib(moved, cfg.kv_bytes_per_token)
    return {"checkpoints": exports, "lost_gpu_s": lost, "pause_gpu_s": pause, "sessions_exported": len(rec)}


@pytest.mark.parametrize("fixed_s,cap,priced", [(None, 128_000.0, False), (0.05, 60_000.0, False),
                                                (0.0005, 9_000.0, False), (None, 128_000.0, True),
                                                (0.0005, 9_000.0, True)])
def test_the_simulator_exports_at_turn_ends_what_the_live_rule_decides_turn_by_turn(fixed_s, cap, priced):
    from ckptflow.sim import turn_exports_cost

    cost = CostModel() if priced else FREE
    if fixed_s is not None:
        cost = cost.model_copy(update={"turn_export_fixed_s": fixed_s})
    cfg = profile_config("two-tier-h200", days=4, nodes=4, preemptible_nodes=2, flaky_fraction=0.25,
                         context_cap_tokens=cap, cost=cost)
    tr = make_trace(3, cfg)
    long = sorted((w for w in tr.workloads if not w.short), key=lambda w: tr.node_mtbf_s[w.node])
    classes = {tr.node_mtbf_s[w.node] for w in long}
    assert len(classes) >= 2
    checked = 0
    for w in long[:3] + long[-2:]:   # preemptible and healthy nodes
        want = _replay_turn_by_turn(tr, w)
        got = turn_exports_cost(tr, w)
        assert got["checkpoints"] == want["checkpoints"]
        assert got["lost_gpu_s"] == pytest.approx(want["lost_gpu_s"], rel=1e-9)
        assert got["pause_gpu_s"] == pytest.approx(want["pause_gpu_s"], rel=1e-9)
        checked += want["checkpoints"] > want["sessions_exported"]   # grown sessions moved again
        assert got["bytes_cost"] == pytest.approx(cost.bytes_s(got["bytes"]), rel=1e-9)
    assert checked or priced        # its bytes priced, a grown session moves again only where the drain moves it


def test_turn_end_rule_young_interval_and_never():
    c = ExportContext(mtbf_s=24 * H, kv_bytes_per_token=KV, at_turn_end=True,
                      cost=FREE.model_copy(update={"turn_export_fixed_s": 0.001, "turn_export_s_per_gib": 0.002}))
    # 2 x 0.001 s x 24 h = 172.8 s.GPU-s: 1200 tokens a 30 s turn = 0.12 s, so 0.12 m x 30 m >= 172.8: m = 7.
    assert turns_between_exports(c, 1200, 30) == 7
    assert not decide_export(6 * 1200, None, c, since_s=6 * 30)[0]
    ok, why = decide_export(7 * 1200, None, c, since_s=7 * 30)
    assert ok and why.startswith("export at turn end: 0.84 s re-prefill at risk x 210 s since its export >=")
    # A healthy node: a token's share of the pause is above its chance-weighted re-prefill: never.
    h = c.model_copy(update={"mtbf_s": 6000 * H})
    assert turns_between_exports(h, 1200, 30) is None
    assert decide_export(1e6, None, h, since_s=1e6)[1].startswith("waits: 1000000 new tokens never pay")
    # Announced: every turn end; without a since_s the one-shot rule (a heartbeat's) applies.
    assert turns_between_exports(c.model_copy(update={"interruption_ahead": True}), 1200, 30) == 1
    # ... with a fixed part a turn's KV does not cover: once a few turns' KV has built up.
    a = c.model_copy(update={"interruption_ahead": True, "cost": FREE.model_copy(update={"turn_export_fixed_s": 0.5})})
    m = turns_between_exports(a, 1200, 30)
    assert m == 5 and decide_export(m * 1200, None, a)[0] and not decide_export((m - 1) * 1200, None, a)[0]
    assert decide_export(1e5, None, c)[1].startswith("export: 100000 new tokens pause")
