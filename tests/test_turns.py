"""Sessions exported at their turn ends (runners/turns.py, #25 item 3) on the CPU demo worker:
a session is exported once its turn is over and only where the rule the simulator replays says
so; the checkpoint it commits restores token for token like a heartbeat's."""

import json
import os
import signal
import time

import pytest

from ckptflow.demo import launch

from ckptflow.policies.cadence import CostModel
from ckptflow.policies.sessions import ExportContext, decide_sessions, session_facts
from ckptflow.runners.node import NodeRunner
from ckptflow.runners.template_sessions import SESSIONS_FILE, TemplateSessionsRunner
from ckptflow.runners.turns import TurnWatch
from ckptflow.store.local import LocalStore

pytestmark = pytest.mark.criu
H = 3600.0


@pytest.fixture
def tt(tmp_path):
    with NodeRunner(LocalStore(tmp_path / "store")) as node:
        yield TemplateSessionsRunner(node)


def _records(tt, m):
    return json.loads((tt.store.images_dir(m) / SESSIONS_FILE).read_text())["sessions"]


def test_a_session_is_exported_at_its_turn_end_where_it_pays_and_restores_token_for_token(demo_worker, tt):
    live, ref = demo_worker("live", 8), demo_worker("ref", 8)
    for w in (live, ref):
        w.complete("You are a careful agent. " * 8, 12, "a")
        w.complete("Summarise the log: " + "ok " * 30, 12, "b")
    m1 = tt.heartbeat(live.workload)                     # the template and every session
    # The heartbeat's context: a CPU worker on a node failing about every minute.
    ctx = ExportContext(mtbf_s=60, device="cpu")
    tt.store.put_export_context(live.workload.name, ctx.model_dump_json())
    watch = TurnWatch(tt, live.workload, every_s=0.1)
    assert watch.poll() is None                           # first look: no turn seen to end yet
    for w in (live, ref):
        w.complete("next step, with the tool's output: " + "x " * 40, 12, "a")
    time.sleep(1.5)                                       # its change has been at risk a while
    assert watch.poll() is None                           # "a" moved since the last look: in a turn
    before = _records(tt, m1)
    m2 = watch.poll()                                     # unchanged since: its turn is over
    assert m2 is not None and m2.parent == m1.id and m2.probe.export.changed == ["a"]
    recs = _records(tt, m2)
    assert recs["b"] == before["b"] and recs["a"]["tokens"] > before["a"]["tokens"]
    assert recs["a"]["exported_at"] > before["a"]["exported_at"]
    # The decision is the rule's on the live facts (what the simulator's turn-by-turn replay builds).
    held = {"a": recs["a"]["tokens"], "b": recs["b"]["tokens"]}
    want = decide_sessions(session_facts(held, before, recs["a"]["exported_at"]),
                           context=ctx.model_copy(update={"at_turn_end": True}))
    assert m2.probe.export.decisions["a"].startswith("export at turn end:")
    assert [d.export for d in want] == [True, False]
    assert m2.probe.export.decisions["b"] == want[1].reason
    # Another turn of "a": the loop's next checkpoint replaces its previous one, not the heartbeat's.
    for w in (live, ref):
        w.complete("and the next tool call: " + "y " * 30, 12, "a")
    watch.poll()
    time.sleep(1.5)
    m3 = watch.poll()
    assert m3 is not None and m3.probe.export.changed == ["a"]
    assert [m.id for m in tt.store.list(live.workload.name) if m.kind == "sessions"] == [m3.id, m1.id]
    m2 = m3
    # Restored from the turn-end checkpoint: both sessions continue as the uninterrupted worker's.
    os.kill(live.pid, signal.SIGKILL)
    live.proc.wait()
    r = tt.restore(live.workload)
    assert r.manifest.id == m2.id
    assert live.digests() == ref.digests()
    for sid in ("a", "b"):
        assert live.complete("and then?", 16, sid) == ref.complete("and then?", 16, sid)


def test_on_a_healthy_node_new_kv_waits_and_a_lost_session_is_answered_so_never_restarted_silently(
        demo_worker, tt):
    live, ref = demo_worker("live", 8), demo_worker("ref", 8)
    for w in (live, ref):
        w.complete("You are a careful agent. " * 8, 12, "a")
    tt.heartbeat(live.workload)
    n = len(tt.store.list(live.workload.name))
    tt.store.put_export_context(live.workload.name, ExportContext(mtbf_s=6000 * H).model_dump_json())
    watch = TurnWatch(tt, live.workload, every_s=0.1)
    watch.poll()
    live.complete("more", 12, "a")
    watch.poll()
    assert watch.poll() is None                           # at its turn end, and its new KV waits
    assert len(tt.store.list(live.workload.name)) == n
    # A new session there: its KV does not pay either; it is listed, so a restore knows of it.
    live.complete("hello, a new task", 12, "c")
    assert watch.poll() is None                           # first seen: its turn may go on
    m = watch.poll()                                      # its first turn end: weighed, listed
    assert m is not None and m.probe.export.decisions["c"].startswith("new session (")
    assert "listed without its KV, waits:" in m.probe.export.decisions["c"]
    assert m.probe.export.decisions["a"] == "kept as last checkpointed: not at a turn end this look"
    assert "c" not in _records(tt, m) and json.loads((tt.store.images_dir(m) / SESSIONS_FILE).read_text())[
        "listed"] == ["c"]
    assert watch.poll() is None                           # weighed at this turn end already: not again
    os.kill(live.pid, signal.SIGKILL)
    live.proc.wait()
    tt.restore(live.workload)
    # Until its client comes back, "c" stays listed: a heartbeat now lists it again.
    m4 = tt.heartbeat(live.workload)
    assert json.loads((tt.store.images_dir(m4) / SESSIONS_FILE).read_text())["listed"] == ["c"]
    # "a" as checkpointed by the heartbeat (its growth since was the price of waiting): its
    # client's retry of the lost turn continues as the reference's did.
    assert live.complete("more", 12, "a") == ref.complete("more", 12, "a")
    code, body = launch.complete_status(live.port, "go on", 8, "c")
    assert code == 410 and body["error"] == ("session c was lost in a restore (its KV was not checkpointed): "
                                             "send its whole history again to start it afresh")
    # Its client sends the history again: the same id starts afresh, as a new session would.
    assert live.complete("hello, a new task", 12, "c") == ref.complete("hello, a new task", 12, "c")  # ref never had c


def test_the_loop_runs_until_stopped_and_counts_its_checkpoints(demo_worker, tt):
    live = demo_worker("live", 8)
    live.complete("hi", 4, "a")
    tt.heartbeat(live.workload)
    live.complete("a new one", 4, "z")
    # No fixed part: a new session pays at its first turn end, however small.
    free = CostModel(turn_export_fixed_s=0.0, turn_export_s_per_gib=0.0266,    # the H200 before this fix,
                     shared_tier_usd_per_gib=0.0, node_usd_per_gib=0.0)        # its bytes unpriced
    tt.store.put_export_context(live.workload.name, ExportContext(mtbf_s=24 * H, cost=free).model_dump_json())
    got = []
    assert TurnWatch(tt, live.workload, every_s=0.05).run(duration_s=1.0, on_checkpoint=got.append) == 1
    assert got[0].probe.export.changed == ["z"]


def test_the_command_refuses_a_process_workload_with_one_line():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "ckptflow", "turns", "deployments/local.yaml", "demo-chat", "--for", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.splitlines()[0] == ("error: workload demo-chat is checkpointed as 'process': only "
                                        "template-sessions workloads export sessions")


def test_the_heartbeat_cadence_counts_from_the_newest_heartbeat_not_the_loops_checkpoints(demo_worker, tt):
    from ckptflow.runners.facts import collect_facts

    live = demo_worker("live", 8)
    live.complete("hi there", 8, "a")
    m1 = tt.heartbeat(live.workload)
    tt.store.put_export_context(live.workload.name, ExportContext(mtbf_s=60, device="cpu").model_dump_json())
    watch = TurnWatch(tt, live.workload, every_s=0.1)
    watch.poll()
    live.complete("more of it " * 10, 8, "a")
    watch.poll()
    time.sleep(2.5)
    m2 = watch.poll()
    assert m2 is not None and m2.probe.export.at_turn_end and not m1.probe.export.at_turn_end
    f = collect_facts(live.workload, tt.store)
    age = time.time() - m1.created.timestamp()
    assert age > 2.0 and f.seconds_since_ckpt >= age - 0.5     # the loop's checkpoint is ~0 s old
    assert f.measured_pause_s == m1.timings["pause"]
    # A template no longer valid: the loop leaves the workload to the heartbeat (no checkpoint over it).
    from ckptflow.models import CheckpointState

    tmpl = tt.store.get(m1.probe.template.workload, m1.probe.template.id)
    tt.store.set_state(tmpl, CheckpointState.invalidated, "engine_version changed")
    live.complete("and more", 8, "a")
    watch.poll()
    n = len(tt.store.list(live.workload.name))
    assert watch.poll() is None and len(tt.store.list(live.workload.name)) == n


def test_a_heartbeat_waits_for_the_loops_short_hold_of_the_lock(tmp_path):
    import threading

    from ckptflow.errors import WorkloadBusy

    store = LocalStore(tmp_path / "store")
    held = threading.Event()

    def hold():
        with store.lock("w"):
            held.set()
            time.sleep(0.4)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    with pytest.raises(WorkloadBusy):
        with store.lock("w"):
            pass
    t0 = time.monotonic()
    with store.lock("w", wait_s=5):
        waited = time.monotonic() - t0
    t.join()
    assert 0.1 < waited < 2.0
