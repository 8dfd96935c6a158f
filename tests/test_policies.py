"""Every decision branch, the interval's monotonicity, placement, retention, engine metrics."""

import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptflow.models import Action, CheckpointState, Manifest
from ckptflow.policies.cadence import (CostModel, WorkloadFacts, cost_based_interval, daly_interval, decide,
                                       young_interval)
from ckptflow.policies.load import parse_metrics
from ckptflow.policies.placement import NodeState, place
from ckptflow.policies.retention import Retention, to_delete

DATA = Path(__file__).parent / "data"
H = 3600.0


def facts(**kw):
    base = dict(name="w", traffic="long_sessions", footprint_gib=80, mtbf_s=2 * H, live_tokens=1e7,
                growth_tokens_s=2000, tokens_since_ckpt=1e5, seconds_since_ckpt=600.0, now=1e6)
    base.update(kw)
    return WorkloadFacts(**base)


# --- branches -------------------------------------------------------------------------------
def test_protect_with_daly_interval_and_numbers():
    d = decide(facts())
    assert d.action == Action.protect
    c, g = 80 * 1.3 + 80 * CostModel().bytes_s_per_gib(), 2000 / 10_000   # the pause and the 80 GiB it writes
    assert d.interval_s == pytest.approx(daly_interval(c / g, 2 * H))
    assert "Daly interval" in d.reason and "C=104s + 91s bytes (80 GiB)" in d.reason and "M=2.0 h" in d.reason
    assert d.due is False  # 600 s since the last one < interval
    assert decide(facts(seconds_since_ckpt=d.interval_s + 1)).due is True


@pytest.mark.parametrize("policy", ["cost-based", "fixed", "never"])
def test_a_gone_worker_is_said_so_whatever_the_policy(policy):
    # Metrics of a dead worker read as "nothing new"; the decision must not say that.
    d = decide(facts(tokens_since_ckpt=0, live_tokens=0, gone="workload w: no live process found"), policy)
    assert d.action == Action.skip and not d.due
    assert d.reason == "worker gone: workload w: no live process found"


def test_interval_clamped_by_rule_bounds():
    assert decide(facts(), params={"min_interval_s": 5000}).interval_s == 5000
    assert decide(facts(), params={"max_interval_s": 300}).interval_s == 300


def test_skip_short_requests():
    d = decide(facts(traffic="short_requests", mean_request_s=4))
    assert d.action == Action.skip and "short requests (mean 4 s)" in d.reason and "104 s pause" in d.reason


def test_skip_mixed_traffic_observed_as_short():
    d = decide(facts(traffic="mixed", mean_request_s=3, live_tokens=0))
    assert d.action == Action.skip and "short requests" in d.reason


def test_skip_when_nothing_new_since_last_checkpoint():
    d = decide(facts(tokens_since_ckpt=0))
    assert d.action == Action.skip and "nothing new" in d.reason


def test_skip_when_checkpoints_cost_more_than_they_save():
    d = decide(facts(mtbf_s=6000 * H, live_tokens=2e6, growth_tokens_s=300))
    assert d.action == Action.skip and "cost more than they save" in d.reason and "M=6000.0 h" in d.reason


def test_skip_when_kv_not_growing():
    d = decide(facts(growth_tokens_s=0))
    assert d.action == Action.skip and "no KV growing" in d.reason


def test_checkpoint_now_without_any_valid_checkpoint():
    d = decide(facts(seconds_since_ckpt=None, tokens_since_ckpt=None))
    assert d.action == Action.checkpoint_now and d.due and "cold start" in d.reason


def test_checkpoint_now_when_newest_invalidated():
    d = decide(facts(newest_invalidated=True))
    assert d.action == Action.checkpoint_now and "invalidated" in d.reason


def test_checkpoint_now_after_a_burst_of_new_kv():
    d = decide(facts(tokens_since_ckpt=5e7))
    assert d.action == Action.checkpoint_now and d.reason.startswith("burst:")


def test_checkpoint_now_ahead_of_maintenance():
    f = facts(mtbf_s=6000 * H, maintenance=[(1e6 + 600, 1e6 + 4 * H)], tokens_since_ckpt=3e6)
    d = decide(f)
    assert d.action == Action.checkpoint_now and "maintenance in 10 min" in d.reason


def test_drain_ahead_of_maintenance_when_a_checkpoint_is_not_worth_it():
    d = decide(facts(maintenance=[(1e6 + 600, 1e6 + 4 * H)], tokens_since_ckpt=10))
    assert d.action == Action.drain and "drain" in d.reason
    d = decide(facts(traffic="short_requests", maintenance=[(1e6 + 600, 1e6 + 4 * H)]))
    assert d.action == Action.drain and "short requests finish" in d.reason


def test_drain_in_maintenance():
    d = decide(facts(maintenance=[(1e6 - 60, 1e6 + H)]))
    assert d.action == Action.drain and "in maintenance" in d.reason


def test_fixed_and_never_policies_and_unknown_name():
    d = decide(facts(seconds_since_ckpt=4000), "fixed", {"interval_s": 3600})
    assert d.action == Action.protect and d.due and d.interval_s == 3600
    assert decide(facts(), "never").action == Action.skip
    with pytest.raises(KeyError, match="unknown policy 'nope'"):
        decide(facts(), "nope")


def test_young_and_daly_formulas():
    assert young_interval(50, 10_000) == pytest.approx(1000)
    c, m = 50, 10_000
    assert daly_interval(c, m) == pytest.approx(math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3
                                                                       + c / (18 * m)) - c)
    assert daly_interval(300, 100) == pytest.approx(800 / 9)
    assert daly_interval(0, 100) == 0


# --- properties -------------------------------------------------------------------------------
pos = st.floats(min_value=1e-3, max_value=1e7, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(c=pos, m1=pos, m2=pos)
def test_daly_never_shorter_with_larger_mtbf(c, m1, m2):
    lo, hi = sorted((m1, m2))
    assert daly_interval(c, hi) >= daly_interval(c, lo) - 1e-9 * max(1, daly_interval(c, lo))


@settings(max_examples=300, deadline=None)
@given(m=pos, c1=pos, c2=pos)
def test_daly_never_shorter_with_larger_cost(m, c1, c2):
    lo, hi = sorted((c1, c2))
    assert daly_interval(hi, m) >= daly_interval(lo, m) - 1e-9 * max(1, daly_interval(lo, m))


fact_st = st.builds(
    WorkloadFacts, name=st.just("w"), traffic=st.sampled_from(["long_sessions", "mixed"]),
    footprint_gib=st.floats(1, 200), mtbf_s=st.floats(60, 1e8), live_tokens=st.floats(0, 1e8),
    growth_tokens_s=st.floats(0, 1e5), tokens_since_ckpt=st.floats(0, 1e8), seconds_since_ckpt=st.floats(0, 1e7))


@settings(max_examples=300, deadline=None)
@given(f=fact_st, k=st.floats(1, 1000))
def test_larger_mtbf_never_shortens_the_interval(f, k):
    cost = CostModel()
    a, _ = cost_based_interval(f, cost, 60, 7 * 86400)
    f.mtbf_s *= k
    b, _ = cost_based_interval(f, cost, 60, 7 * 86400)
    assert b >= a * (1 - 1e-9)


@settings(max_examples=300, deadline=None)
@given(f=fact_st, k=st.floats(1, 1000))
def test_larger_checkpoint_cost_never_shortens_the_interval(f, k):
    cost = CostModel()
    f.measured_pause_s = cost.pause_s(f.footprint_gib)
    a, _ = cost_based_interval(f, cost, 60, 7 * 86400)
    f.measured_pause_s *= k
    b, _ = cost_based_interval(f, cost, 60, 7 * 86400)
    assert b >= a * (1 - 1e-9)


@settings(max_examples=500, deadline=None)
@given(f=fact_st, since=st.one_of(st.none(), st.floats(0, 1e7)), inval=st.booleans(),
       window=st.one_of(st.none(), st.floats(-1e4, 1e5)))
def test_short_request_workload_is_never_checkpointed(f, since, inval, window):
    f.traffic = "short_requests"
    f.seconds_since_ckpt = since
    f.newest_invalidated = inval
    f.now = 1e6
    if window is not None:
        f.maintenance = [(1e6 + window, 1e6 + window + 4 * H)]
    d = decide(f)
    assert d.action in (Action.skip, Action.drain) and not d.due


# --- placement --------------------------------------------------------------------------------
def test_placement_filters_and_spreads():
    nodes = [NodeState("a", "H200", 150, load=2), NodeState("b", "H200", 150, load=1),
             NodeState("c", "H100", 300), NodeState("d", "H200", 50), NodeState("e", "H200", 150, in_maintenance=True)]
    p = place(80, "H200", nodes)
    assert p.node == "b"
    assert place(80, "H200", nodes, exclude=("b",)).node == "a"
    none = place(80, "H200", nodes[2:])
    assert none.node is None
    assert "c: GPU class H100 != H200" in none.reason and "d: 50 GiB free < 82 GiB" in none.reason
    assert "e: in maintenance" in none.reason


def test_spreader_leaves_out_nodes_in_or_about_to_enter_their_own_window():
    from datetime import datetime, timezone

    from ckptflow.fleet import Fleet
    from ckptflow.flows.steps import spreader_off
    from ckptflow.policies.placement import in_maintenance

    assert in_maintenance([(1000.0, 2000.0)], now=1500.0)                      # in it
    assert in_maintenance([(1000.0, 2000.0)], now=1000.0 - 3599)               # opens within the hour
    assert not in_maintenance([(1000.0, 2000.0)], now=1000.0 - 3601)
    assert not in_maintenance([(1000.0, 2000.0)], now=2000.0)                  # over
    now = datetime(2026, 12, 1, 1, 30, tzinfo=timezone.utc).timestamp()
    window = [{"start": "2026-12-01T02:00:00Z", "end": "2026-12-01T04:00:00Z"}]
    fleet = Fleet.model_validate({"fleet": "f", "nodes": [
        {"name": "a", "work_pool": "a"}, {"name": "b", "work_pool": "b", "maintenance": window},
        {"name": "c", "work_pool": "c"}]})
    assert spreader_off(fleet, "a", now=now).place(10).node == "c"
    only_b = fleet.model_copy(update={"nodes": fleet.nodes[:2]})
    p = spreader_off(only_b, "a", now=now).place(10)
    assert p.node is None and "b: in maintenance" in p.reason
    assert spreader_off(only_b, "a", now=now + 3 * 3600).place(10).node == "b"   # window over


# --- retention --------------------------------------------------------------------------------
NOW = datetime(2026, 11, 29, tzinfo=timezone.utc)


def _m(i, hours_ago, state=CheckpointState.complete):
    return Manifest(id=f"20261129T0000{i:02d}Z-0000000{i % 10}", workload="w", node="n",
                    created=NOW - timedelta(hours=hours_ago), state=state)


def test_retention_keeps_newest_valid_and_verified():
    ms = [_m(1, 1), _m(2, 2), _m(3, 3), _m(4, 4, CheckpointState.verified), _m(5, 100),
          _m(6, 0.5, CheckpointState.invalidated), _m(7, 48, CheckpointState.verify_failed)]
    gone = {m.id: why for m, why in to_delete(ms, NOW, Retention(keep=2, max_age_h=72, invalidated_grace_h=24))}
    assert _m(1, 1).id not in gone and _m(4, 4).id not in gone  # newest valid, newest verified
    assert "beyond the 2 newest" in gone[_m(3, 3).id]
    assert _m(6, 0.5).id not in gone                              # invalidated, within grace
    assert "verify_failed" in gone[_m(7, 48).id]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 500), st.sampled_from(list(CheckpointState))), min_size=1, max_size=12),
       st.integers(1, 5), st.floats(0.1, 100), st.integers(1, 4))
def test_no_sequence_of_retention_runs_drops_the_newest_valid(items, keep, max_age, runs):
    ms = [_m(i, h, s) for i, (h, s) in enumerate(items)]
    valid = sorted((m for m in ms if m.state.restorable), key=lambda m: (m.created, m.id), reverse=True)
    rule = Retention(keep=keep, max_age_h=max_age, invalidated_grace_h=0)
    for r in range(runs):
        gone = {m.id for m, _ in to_delete(ms, NOW + timedelta(hours=100 * r), rule)}
        ms = [m for m in ms if m.id not in gone]
    if valid:
        assert valid[0].id in {m.id for m in ms}


# --- engine metrics ---------------------------------------------------------------------------
def test_vllm_metrics_text():
    load = parse_metrics("vllm", (DATA / "vllm_metrics.txt").read_text())
    assert (load.running, load.waiting, load.kv_cache_usage) == (12, 3, 0.4375)
    assert load.prompt_tokens_total == 1_234_567 and load.generation_tokens_total == 456_789
    assert load.mean_request_s == pytest.approx(90.0)


def test_sglang_metrics_text():
    # Recorded from a live SGLang 0.5.17 on the H200 (bench/sglang_gpu.py), after a 4,080-token session.
    load = parse_metrics("sglang", (DATA / "sglang" / "metrics.txt").read_text())
    assert (load.running, load.waiting, load.kv_cache_usage, load.used_tokens) == (1, 0, 0.04, 4087)
    assert (load.prompt_tokens_total, load.generation_tokens_total) == (12168, 105)
    assert load.mean_request_s == pytest.approx(9.96843135000006 / 5)


def test_old_vllm_cache_metric_name_and_unknown_engine():
    text = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n"
    assert parse_metrics("vllm", text).kv_cache_usage == 0.5
    with pytest.raises(ValueError, match="no metric mapping"):
        parse_metrics("tgi", text)


def test_demo_worker_metrics_parse(demo_worker):
    from ckptflow.demo.launch import complete

    w = demo_worker("m")
    complete(w.port, "hello " * 20, 10, "s")
    from ckptflow.runners.engine import read_load

    load = read_load(w.workload)
    assert load.prompt_tokens_total == 120 and load.generation_tokens_total == 10
    assert load.kv_cache_usage == pytest.approx(130 / 65536)


# --- typed parameters and the registry --------------------------------------------------------
def test_a_misspelt_parameter_is_refused_not_ignored():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="min_intervl_s"):
        decide(facts(), params={"min_intervl_s": 5000})
    with pytest.raises(KeyError, match="unknown policy 'yolo'"):
        decide(facts(), "yolo")


def test_a_registered_policy_is_chosen_by_name_from_the_fleet_file(tmp_path, monkeypatch):
    from ckptflow.fleet import load_fleet
    from ckptflow.models import Decision
    from ckptflow.policies import cadence
    from ckptflow.registry import CADENCE_POLICIES

    class EveryParams(cadence.PolicyParams):
        every_s: float = 60.0

    # the registry as it was, after the test (register and the fleet loader both go through it)
    monkeypatch.setattr(CADENCE_POLICIES, "entries", dict(CADENCE_POLICIES.loaded()))

    @cadence.register("every", EveryParams)
    def decide_every(f, params, cost):
        return Decision(workload=f.name, action=Action.protect, interval_s=params.every_s, due=True, reason="every")

    f = tmp_path / "fleet.yaml"
    f.write_text("fleet: t\nnodes: [{name: n1, work_pool: n1}]\n"
                 "policies: [{policy: every, params: {every_s: 5}}]\n")
    rule = load_fleet(f).policies[0]
    assert isinstance(rule.params, EveryParams) and decide(facts(), rule.policy, rule.params).interval_s == 5


def test_small_cost_rates_are_printed_readably():
    # A CPU worker: a 0.3 s dump, a few hundred tokens; both rates are far below 0.1 GPU-s/h.
    d = decide(facts(footprint_gib=0, measured_pause_s=0.3, mtbf_s=6000 * H, live_tokens=500,
                     growth_tokens_s=1, tokens_since_ckpt=100))
    assert d.action == Action.skip and "cost more than they save" in d.reason
    with_ckpt, without = d.reason.split(": ", 1)[1].split(" GPU-s/h")[0].split(" vs ")
    assert float(with_ckpt) > float(without) > 0, d.reason


def test_a_short_session_is_protected_not_silently_lost():
    # Left out of the checkpoint, it would be gone after a restore and its client's next turn
    # would start a fresh session without a word.
    from ckptflow.policies.sessions import SessionFacts, decide_sessions

    [d] = decide_sessions([SessionFacts(id="q", tokens=19)])
    assert d.protect and d.export and d.reason == "new session (19 tokens)"
    [kept] = decide_sessions([SessionFacts(id="q", tokens=19, tokens_at_ckpt=19)])
    assert kept.protect and not kept.export
