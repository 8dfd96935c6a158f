"""The what-if simulator (ckptflow/sim.py) under its two cost profiles, and the two-tier cost
model of the cost-based policy: calibration traceable to the H200 bench, the process profile
reproducing the first runs, and what two tiers change in what the policy protects."""

import doctest
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptflow.sim as sim
from ckptflow.models import Action
from ckptflow.policies.cadence import CostModel, WorkloadFacts, cost_based_interval, decide
from ckptflow.sim import PROFILES, TraceConfig, at_risk_tokens, make_trace, moved_tokens, profile_config, simulate

GPU_TWO_TIER = Path(__file__).parent.parent / "bench" / "results" / "gpu_two_tier.json"
H = 3600.0


def test_sim_docstring_examples_run():
    res = doctest.testmod(sim, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0 and res.attempted > 0


# --- calibration -------------------------------------------------------------------------------
def test_two_tier_costs_are_the_measured_h200_numbers():
    # The run the cost model was calibrated from: the first kept with a row B (2026-11-29). Later
    # runs (2026-12-01: standby rows, rows re-run with the keyed GPU hash) are not its source.
    runs = json.loads(GPU_TWO_TIER.read_text())["runs"]
    row = next(r for run in runs for r in run.get("rows", []) if r["row"] == "B")
    cost = CostModel()
    assert cost.session_pause_s_per_gib == pytest.approx(row["session_pause_s"] / row["changed_gib"], rel=0.05)
    assert cost.template_restore_s == pytest.approx(row["template_restore_s"] + row["restore_phases"]["chunks_checked"],
                                                    abs=0.05)
    assert cost.stream_gib_s == pytest.approx(row["stream_gib_s"], rel=0.01)
    # The model gives back the measured restore-to-ready of row B (weights + live KV streamed).
    kv_tokens = row["live_kv_gib"] * 2**30 / cost.kv_bytes_per_token
    assert cost.template_sessions_restore_s(row["weights_gib"], kv_tokens) == pytest.approx(row["restore_to_ready_s"], abs=0.1)
    # ... and overstates the measured heartbeat pause (fixed part charged on top), never understates it.
    changed = row["changed_gib"] * 2**30 / cost.kv_bytes_per_token
    assert row["session_pause_s"] <= cost.session_pause_s(changed) <= 2.1 * row["session_pause_s"]


def test_profiles_and_the_default_trace():
    assert set(PROFILES) == {"process-h200", "two-tier-h200"}
    assert profile_config("process-h200") == TraceConfig()          # old results stay the default
    assert profile_config("two-tier-h200").template_sessions and not TraceConfig().template_sessions
    with pytest.raises(KeyError, match="known: process-h200, two-tier-h200"):
        profile_config("two-tier-h100")


def test_a_two_tier_heartbeat_moves_only_what_changed_since_the_previous_one():
    cfg = profile_config("two-tier-h200")
    tr = make_trace(1, cfg)
    w = next(w for w in tr.workloads if not w.short)
    ckpts = np.sort(np.random.default_rng(0).uniform(0, cfg.days * 86400, 300))
    brute = sum(at_risk_tokens(cfg, w, float(t), float(ckpts[i - 1]) if i else None) for i, t in enumerate(ckpts))
    assert moved_tokens(cfg, w, ckpts) == pytest.approx(brute, rel=1e-9)
    assert moved_tokens(cfg, w, ckpts[:0]) == 0.0


# --- the policy with two-tier costs ---------------------------------------------------------------
def agent(**kw):
    from test_policies import facts  # the same facts, an agent on a preemptible node

    return facts(**{"name": "a", "mtbf_s": 24 * H, "live_tokens": 1e6, "growth_tokens_s": 200, **kw})


def test_two_tiers_protect_what_the_whole_process_cannot_afford():
    assert decide(agent()).action == Action.skip
    d = decide(agent(checkpoint_mode="template-sessions"))
    assert d.action == Action.protect and "0.036 s/GiB" in d.reason
    # On a healthy node, moving the new KV still costs more than the re-prefill it would save.
    d = decide(agent(checkpoint_mode="template-sessions", mtbf_s=6000 * H))
    assert d.action == Action.skip and "cost more than they save" in d.reason


def test_two_tier_maintenance_and_short_requests():
    window = [(1e6 + 600, 1e6 + 4 * H)]
    # 10 s of re-prefill at risk (1e5 tokens): below a 104 s process pause, above the 0.48 s two-tier
    # one (12.2 GiB of KV at 128 KiB/token moved at 0.036 s/GiB, + 0.036 s).
    assert decide(agent(maintenance=window)).action == Action.drain
    d = decide(agent(maintenance=window, checkpoint_mode="template-sessions"))
    assert d.action == Action.checkpoint_now and d.due and "0.48 s pause" in d.reason
    d = decide(agent(traffic="short_requests", checkpoint_mode="template-sessions"))
    assert d.action == Action.skip and "template restores" in d.reason


two_tier_facts = st.builds(
    WorkloadFacts, name=st.just("w"), traffic=st.just("long_sessions"), checkpoint_mode=st.just("template-sessions"),
    footprint_gib=st.floats(1, 200), mtbf_s=st.floats(60, 1e8), live_tokens=st.floats(0, 1e8),
    growth_tokens_s=st.floats(0, 1e5), tokens_since_ckpt=st.floats(0, 1e8), seconds_since_ckpt=st.floats(0, 1e7),
    kv_bytes_per_token=st.one_of(st.none(), st.floats(1e3, 1e6)))


@settings(max_examples=300, deadline=None)
@given(f=two_tier_facts, k=st.floats(1, 1000))
def test_two_tier_larger_mtbf_never_shortens_the_interval(f, k):
    cost = CostModel()
    a, _ = cost_based_interval(f, cost, 60, 7 * 86400)
    f.mtbf_s *= k
    b, _ = cost_based_interval(f, cost, 60, 7 * 86400)
    assert b >= a * (1 - 1e-9)


# --- the reference trace, seed 0, under both profiles -----------------------------------------
@pytest.fixture(scope="module")
def seed0():
    return {name: simulate(0, profile_config(name)) for name in PROFILES}


def test_process_profile_reproduces_the_first_runs(seed0):
    p = seed0["process-h200"]["policies"]  # bench/RESULTS.md, 2026-11-29 08:22 UTC, seed 0 exponential
    assert (p["never"]["cost"], p["hindsight"]["cost"], p["ckptflow"]["cost"]) == (794799.9, 143565.2, 136935.6)
    assert p["hindsight"]["checkpoints"] == 0                       # protecting KV never paid


def test_under_two_tiers_the_policy_protects_long_sessions(seed0):
    proc, tt = seed0["process-h200"], seed0["two-tier-h200"]
    pc, tc = proc["policies"]["ckptflow"], tt["policies"]["ckptflow"]
    # More session KV comes back from checkpoints instead of being re-prefilled.
    assert tc["kv_kept_gpu_s"] > 2 * pc["kv_kept_gpu_s"]
    assert tc["reprefill_gpu_s"] < 0.5 * pc["reprefill_gpu_s"]
    pcls, tcls = proc["ckptflow_by_class"], tt["ckptflow_by_class"]
    # Long sessions on preemptible nodes: exported at their turn ends, every few turns (Young's
    # interval over the H200 turn export's 0.00166 s fixed part), against one maintenance heartbeat
    # or none for the whole process.
    pre = tcls["preemptible/long"]
    assert pre["checkpoints"] > 10_000 * pre["workloads"]
    assert pcls["preemptible/long"]["checkpoints"] <= pcls["preemptible/long"]["workloads"]
    assert pre["reprefill_gpu_s"] < 0.05 * pre["kv_kept_gpu_s"]
    # Every node: long sessions carried across the maintenance window (process: under half of them).
    healthy = tcls["healthy/long"]
    assert healthy["with_checkpoints"] >= 0.95 * healthy["workloads"]
    assert pcls["healthy/long"]["with_checkpoints"] < 0.5 * healthy["workloads"]
    # ... but on healthy nodes new KV waits far longer: Young's interval grows with the MTBF (seed 0:
    # ~20 x fewer exports per worker than on the preemptible nodes, new sessions listed until they
    # hold ~100,000 tokens at 6,000 h).
    assert healthy["checkpoints"] < 0.1 * pre["checkpoints"] / pre["workloads"] * healthy["workloads"]
    assert healthy["pause_gpu_s"] < 0.1 * pre["pause_gpu_s"] / pre["workloads"] * healthy["workloads"]
    # Short requests: never.
    assert all(v["checkpoints"] == 0 for k, v in tcls.items() if k.endswith("/short"))
    # The targets still hold under the new profile, and a KV-protecting schedule now pays in hindsight.
    tp = tt["policies"]
    best_fixed = min(v["cost"] for k, v in tp.items() if k.startswith("fixed-"))
    assert tc["cost"] <= 1.10 * tp["hindsight"]["cost"] and tc["cost"] <= 0.70 * best_fixed
    assert tp["hindsight"]["checkpoints"] > 0 and tp["clairvoyant"]["cost"] <= tc["cost"]
    # Sessions weighed at their turn ends (#25 item 3): 1.21 x clairvoyant on seed 0, against 1.89 at
    # the cadence's heartbeats (the same rule, the engine held): within the 1.5 now that a
    # turn export costs the other sessions 0.00166 s and nothing per GiB (bench/RESULTS.md).
    hb = tp["ckptflow-heartbeat"]
    assert tc["cost"] <= 0.9 * hb["cost"]
    assert tc["cost"] <= 1.5 * tp["clairvoyant"]["cost"] and tc["cost"] <= 0.45 * tp["hindsight"]["cost"]
    # Before a window only the drain's last turn of growth is lost.
    assert healthy["reprefill_gpu_s"] < 0.6 * 5873.4   # seed 0 before: 5,873 GPU-s (bench/results/policy_sim.json)
    assert math.isclose(tp["never"]["cost"], proc["policies"]["never"]["cost"])  # no checkpoints: same


def test_turn_end_export_costs_are_the_measured_h200_numbers():
    # bench/gpu_turn_export.py: a batch-1 decoding session's loss per export beside it, fitted
    # through 0.25/0.5/1 GiB, the fixed part not below 0; the line is kept in the run's JSON.
    run = json.loads((GPU_TWO_TIER.parent / "gpu_turn_export.json").read_text())["runs"][-1]
    assert run["decode_tokens_equal"] and run["turn_digest_matches_engine"]
    cost = CostModel()
    fit = run["fits"]["turn_lost_s_per_export"]
    assert cost.turn_export_fixed_s == max(0.0, fit["fixed_s"]) == run["turn_export_fixed_s"]
    assert cost.turn_export_s_per_gib == max(0.0, fit["s_per_gib"]) == run["turn_export_s_per_gib"]
    # The line is each size's measured loss, within the run's noise either way.
    turn = [w for w in run["windows"] if w["window"].startswith("turn ")]
    assert len(turn) >= 3
    for w in turn:
        model = cost.turn_export_fixed_s + cost.turn_export_s_per_gib * w["copied_gib"]
        assert abs(model - w["lost_s_per_export"]) <= run["noise_s_per_export"], w["window"]
