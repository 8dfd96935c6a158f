"""The cost policy on CPU-only workers (#23 item 7): costed in the worker's own seconds (recompute
at CPU prefill speed vs its pause), so a demo-like worker whose state grew re-checkpoints instead
of skipping at '0.0 vs 0.0 GPU-s/h'; GPU workers keep their order; a forced run says forced."""

import pytest

from ckptflow.models import Action, Decision
from ckptflow.policies.cadence import CostModel, WorkloadFacts, decide, forced

DEMO_RULE = {"min_interval_s": 60, "max_interval_s": 3600}     # deployments/local.yaml


def demo_worker(**kw) -> WorkloadFacts:
    """The demo worker after its first checkpoint (17 MiB image, a 0.66 s dump: llamacpp_cpu.json)
    and a long session of ~2,100 tokens, on the demo node (MTBF 6000 h), no GPU."""
    base = dict(name="demo-chat", traffic="long_sessions", footprint_gib=17.7e6 / 2**30, measured_pause_s=0.66,
                mtbf_s=6000 * 3600.0, live_tokens=2100, growth_tokens_s=20, tokens_since_ckpt=600,
                seconds_since_ckpt=90.0, device="cpu")
    return WorkloadFacts(**{**base, **kw})


def test_a_cpu_worker_whose_state_grew_is_checkpointed_with_its_numbers():
    d = decide(demo_worker(), params=DEMO_RULE)
    assert d.action == Action.checkpoint_now and d.due
    assert "0.0 vs 0.0" not in d.reason
    # 600 tokens at 200 tokens/s = 3.0 s of recompute, above 3 pauses of 0.66 s.
    assert d.reason == "CPU worker: 3.0 s of recompute at risk (600 new KV tokens at 200 tokens/s) > 3 x 0.66 s pause"


def test_the_same_facts_on_a_gpu_keep_the_skip_first_order_the_simulator_needs():
    # GPU-seconds: 600 tokens are 0.06 s of re-prefill against a measured 0.66 s pause, at 6000 h MTBF.
    d = decide(demo_worker(device="gpu"), params=DEMO_RULE)
    assert d.action == Action.skip and "GPU-s/h" in d.reason


def test_a_cpu_worker_with_little_new_state_skips_with_rates_in_cpu_seconds():
    d = decide(demo_worker(tokens_since_ckpt=110), params=DEMO_RULE)    # 0.55 s < 3 x 0.66 s
    assert d.action == Action.skip
    assert "CPU-s/h" in d.reason and "0.0 vs 0.0" not in d.reason and "C=0.66s" in d.reason


def test_the_cpu_threshold_follows_the_pause_and_the_prefill_rate():
    slow = CostModel(cpu_prefill_tokens_s=50)                 # a bigger model: 600 tokens = 12 s
    assert decide(demo_worker(measured_pause_s=3.0), params=DEMO_RULE).action == Action.skip
    assert decide(demo_worker(measured_pause_s=3.0), params=DEMO_RULE, cost=slow).action == Action.checkpoint_now
    # Nothing new: still nothing to do, whatever the device.
    assert "nothing new" in decide(demo_worker(tokens_since_ckpt=0), params=DEMO_RULE).reason


@pytest.mark.parametrize("action", [Action.skip, Action.protect, Action.drain])
def test_a_forced_run_says_forced_and_keeps_the_policys_view(action):
    d = Decision(workload="demo-chat", action=action, reason="checkpoints cost more than they save: 0.062 vs 0.0018 CPU-s/h")
    f = forced(d)
    assert f.action == Action.checkpoint_now and f.due
    assert f.reason == f"forced (policy said {action.value}: {d.reason})"


def test_live_facts_of_a_cpu_worker_are_cpu_facts_and_a_restarted_worker_has_new_work(demo_worker, tmp_path):
    """On a node with a GPU backend object (every node has one) a CPU workload is still costed in
    CPU seconds; and a worker restarted since the newest checkpoint (its token counter went back)
    has everything since its start as new work, never 'nothing new' (the trial's finding 2)."""
    from ckptflow.demo import launch
    from ckptflow.runners.engine import read_load
    from ckptflow.runners.facts import collect_facts
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    w = demo_worker("cpu-facts")
    for sid in ("a", "b", "c"):
        w.complete("a long turn that grows the KV " * 12, 24, sid)
    with NodeRunner(LocalStore(tmp_path / "store")) as node:
        m = node.checkpoint(w.workload)
        f = collect_facts(w.workload, node.store, gpu=node.gpu)
        assert node.gpu is not None and f.device == "cpu" and f.measured_pause_s > 0
        w.stop()
        proc = launch.start_worker(w.port, w.pid_file)        # a fresh worker under the same declaration
        try:
            launch.complete(w.port, "a new session on the new worker " * 4, 8, "z")
            now = read_load(w.workload).tokens_total
            assert 0 < now < m.probe.tokens_total                # its counter started again
            f = collect_facts(w.workload, node.store, gpu=node.gpu)
            assert f.tokens_since_ckpt == now
            assert "nothing new" not in decide(f, params=DEMO_RULE).reason
        finally:
            proc.kill()
            proc.wait()
            from tests.conftest import kill_pid_file

            kill_pid_file(w.pid_file, "ckptflow.demo.worker")


def test_min_interval_holds_back_a_cpu_burst_until_it_has_passed():
    """Issue #36 finding 7: min_interval_s 60 and a heartbeat 11 s after the last checkpoint decided
    checkpoint_now, because the CPU burst rule ran before the minimum was applied."""
    d = decide(demo_worker(seconds_since_ckpt=11.0), params=DEMO_RULE)
    assert d.action == Action.protect and not d.due and d.interval_s == 60
    assert d.reason.startswith("burst held back: the last checkpoint is 11 s old < min_interval_s 1.0 min (CPU worker: ")
    later = decide(demo_worker(seconds_since_ckpt=61.0), params=DEMO_RULE)
    assert later.action == Action.checkpoint_now and later.due


def test_min_interval_holds_back_a_gpu_burst_too():
    rule = {"min_interval_s": 600, "max_interval_s": 86400}
    # 99 s of re-prefill at risk > 3 x (5 s pause + 22.8 s for the 20 GiB a heartbeat writes)
    gpu = dict(device="gpu", mtbf_s=24 * 3600.0, footprint_gib=20.0, measured_pause_s=5.0, growth_tokens_s=1.0,
               live_tokens=1_000_000, tokens_since_ckpt=990_000)
    burst = decide(demo_worker(seconds_since_ckpt=3600.0, **gpu), params=rule)
    assert burst.action == Action.checkpoint_now and burst.reason.startswith("burst: ")
    held = decide(demo_worker(seconds_since_ckpt=120.0, **gpu), params=rule)
    assert held.action == Action.protect and not held.due and "burst held back" in held.reason


def test_a_worker_started_anew_after_its_checkpoint_is_checkpointed_not_skipped_as_nothing_new(demo_worker, tmp_path):
    # New-user trial: a worker started again from the same pid file did the same requests as the
    # one its checkpoint holds; its token counter equals the checkpoint's, read as "nothing new".
    from ckptflow.runners.engine import read_load
    from ckptflow.runners.facts import collect_facts
    from ckptflow.store.local import LocalStore

    store = LocalStore(tmp_path / "store")
    old = demo_worker("w")
    old.complete("a long session " * 20, 8, "s")
    pending = store.begin(old.workload.name, node="local")
    (pending.images_dir / "img").write_bytes(b"x")
    m = store.commit(pending, probe={"tokens_total": read_load(old.workload).tokens_total}, pid=old.pid)
    old_pid = old.pid
    old.stop()
    new = demo_worker("w")                                   # the same pid file, another process
    new.complete("a long session " * 20, 8, "s")
    assert read_load(new.workload).tokens_total == m.probe.tokens_total
    f = collect_facts(new.workload, store)
    assert f.restarted == f"the newest checkpoint {m.id} is of PID {old_pid}; the worker now runs as PID {new.pid}"
    d = decide(f)
    assert d.action == Action.checkpoint_now and d.due
    assert d.reason.endswith("now runs as PID %d: nothing this process did is checkpointed" % new.pid)
    # The process the checkpoint is of still reads "nothing new": the check is about the PID.
    m2 = store.commit(_pending(store, new), probe={"tokens_total": read_load(new.workload).tokens_total}, pid=new.pid)
    d = decide(collect_facts(new.workload, store))
    assert m2.pid == new.pid and d.action == Action.skip and "nothing new" in d.reason


def _pending(store, w):
    p = store.begin(w.workload.name, node="local")
    (p.images_dir / "img").write_bytes(b"x")
    return p
