"""Two-tier sessions protected at turn boundaries (#25 item 3): one per-session decision
(policies/sessions.py) that the simulator replays and the live heartbeat calls, fed the same
facts; its rule; and the simulator's per-session costs against the whole-worker ones."""

import numpy as np
import pytest

from ckptflow.models import Action, Decision
from ckptflow.policies.cadence import CostModel, WorkloadFacts
from ckptflow.policies.sessions import (ExportContext, SessionFacts, decide_export, decide_sessions,
                                        export_context)
from ckptflow.sim import (TraceConfig, Workload, ckptflow_heartbeats, make_trace, profile_config,
                          schedule_cost, session_exports, session_schedule_cost)

H = 3600.0
KV = 65_536.0


def ctx(mtbf_h: float, ahead: bool = False) -> ExportContext:
    return ExportContext(mtbf_s=mtbf_h * H, interruption_ahead=ahead, kv_bytes_per_token=KV)


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
def _tiny_trace():
    cfg = profile_config("two-tier-h200", days=4, nodes=1, gpus_per_node=1)
    tr = make_trace(0, cfg)
    # Sessions (start, end): alive across both heartbeats, one starting between them, one ending.
    w = Workload(node=0, short=False, footprint=80.0, start=np.array([0.0, 1000.0, 2000.0, 5000.0]),
                 end=np.array([20_000.0, 4000.0, 30_000.0, 30_000.0]))
    tr.workloads = [w]
    return tr, w


@pytest.mark.parametrize("mtbf_h", [24.0, 45.0, 46.0, 500.0, 6000.0])
@pytest.mark.parametrize("ahead", [False, True])
def test_simulator_and_live_heartbeat_decide_the_same_on_the_same_facts(mtbf_h, ahead):
    tr, w = _tiny_trace()
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
    again = ahead or mtbf_h <= 45
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
