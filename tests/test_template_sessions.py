"""Two-tier checkpoints on the CPU demo worker, through the engine protocol: a template (the
engine with weights and sessions released, dumped by CRIU; weights as chunks) and session
checkpoints whose bytes follow what changed. Every continuation is compared token for token with
a reference worker that was never interrupted."""

import contextlib
import json
import os
import signal
import shutil
from pathlib import Path

import pytest

from ckptflow.errors import ChecksumMismatch, EngineProtocolError, IncompatibleCheckpoint
from ckptflow.models import CheckpointState
from ckptflow.runners.node import NodeRunner
from ckptflow.runners.template_sessions import SESSIONS_FILE, TemplateSessionsRunner
from ckptflow.store.local import LocalStore

pytestmark = pytest.mark.criu
BALLAST_MIB = 48  # stands in for weights: large next to the ~26 MB of the Python process itself


class NoCriu:
    """Stands in for CRIU where a refusal must come before any CRIU call."""

    def __getattr__(self, name):
        raise AssertionError(f"CRIU {name} called")


def _talk(*workers, turns=(("a", "You are a careful agent. " * 8), ("b", "Summarise the log: " + "ok " * 30))):
    outs = []
    for w in workers:
        outs.append([w.complete(p, 12, sid) for sid, p in turns])
    return outs


@pytest.fixture
def pair(demo_worker):
    live, ref = demo_worker("live", BALLAST_MIB), demo_worker("ref", BALLAST_MIB)
    a, b = _talk(live, ref)
    assert a == b
    return live, ref


@pytest.fixture
def tt(tmp_path):
    with NodeRunner(LocalStore(tmp_path / "store")) as node:
        yield TemplateSessionsRunner(node)


def _continues_on_standby(live, ref, sb, ns):
    """Sessions a and b, served by the promoted standby, continue as the reference's."""
    from ckptflow.runners import engine

    for sid in ("a", "b"):
        got = engine.call(live.workload, "/v1/completions", {"prompt": "and then?", "max_tokens": 16,
                                                             "session_id": sid}, base=sb.base, netns=ns)
        assert got["choices"][0]["tokens"] == ref.complete("and then?", 16, sid)


def _template(tt, m):
    return tt.store.get(m.probe.template.workload, m.probe.template.id)


def test_template_then_session_heartbeats_move_only_what_changed(pair, tt):
    live, ref = pair
    store = tt.store
    m1 = tt.heartbeat(live.workload)
    tmpl = _template(tt, m1)
    assert tmpl.kind == "engine_template" and m1.kind == "sessions"
    # The weights (ballast + model) left the image: it is smaller than the weights alone.
    assert tmpl.probe.weights.bytes > BALLAST_MIB << 20 > tmpl.bytes
    assert live.complete("go on", 8, "a") == ref.complete("go on", 8, "a")      # serves on, same tokens

    m2 = tt.heartbeat(live.workload)                                              # only "a" changed
    assert m2.probe.template.id == tmpl.id and m2.parent == m1.id
    assert m2.probe.export.changed == ["a"]
    assert m2.probe.export.decisions["b"].startswith("unchanged since its last checkpoint")
    assert m2.probe.export.decisions["a"].startswith("grew by")
    recs1 = json.loads((store.images_dir(m1) / SESSIONS_FILE).read_text())["sessions"]
    recs2 = json.loads((store.images_dir(m2) / SESSIONS_FILE).read_text())["sessions"]
    assert recs1["b"] == recs2["b"]
    new = {d for t in recs2["a"]["tensors"] for d in t["chunks"]} - \
          {d for t in recs1["a"]["tensors"] for d in t["chunks"]}
    changed_bytes = tt.chunks.size(sorted(new))
    assert 0 < m2.probe.export.moved_bytes <= changed_bytes * 1.05
    assert m2.probe.export.moved_bytes < recs2["a"]["total_bytes"] < m2.probe.export.total_bytes

    m3 = tt.heartbeat(live.workload)                                              # nothing changed
    assert m3.probe.export.changed == [] and m3.probe.export.moved_bytes == 0
    assert len([m for m in store.list(tmpl.workload)]) == 1                       # the template is reused


def test_kill_then_template_plus_sessions_continue_token_for_token(pair, tt):
    live, ref = pair
    tt.heartbeat(live.workload)
    _talk(live, ref, turns=(("a", "next step"),))
    m = tt.heartbeat(live.workload)
    pid = live.pid
    os.kill(pid, signal.SIGKILL)
    live.proc.wait()
    r = tt.restore(live.workload)
    assert r.pid == r.template.pid and r.manifest.id == m.id
    assert {"load", "restore"} <= set(r.timings)          # weights and sessions in one call
    assert not {"weights", "sessions"} & set(r.timings)
    [took] = tt.store.get(live.workload.name, m.id).probe.restores.seconds   # counted, as status and the exporter read it
    assert took == pytest.approx(sum(r.timings.values()), abs=0.01)
    assert live.digests() == ref.digests()
    for sid in ("a", "b"):
        assert live.complete("and then?", 16, sid) == ref.complete("and then?", 16, sid)


def _stopped_after_a_heartbeat(live, tt):
    """(its session checkpoint, a two-tier runner on the same store whose CRIU must not be called)"""
    m = tt.heartbeat(live.workload)
    live.stop()
    return m, TemplateSessionsRunner(NodeRunner(tt.store, criu=NoCriu(), node_fp=tt.node.node_fp))


def test_a_session_bound_to_another_model_revision_or_a_gone_template_is_refused_before_criu(pair, tt):
    live, _ = pair
    store = tt.store
    m, refuse = _stopped_after_a_heartbeat(live, tt)
    other = live.workload.model_copy(update={"model_revision": "seed-9999"})
    with pytest.raises(IncompatibleCheckpoint, match="model_revision"):
        refuse.restore(other)
    tmpl = store.get(m.probe.template.workload, m.probe.template.id)
    store.set_state(tmpl, CheckpointState.invalidated, "engine version changed")
    with pytest.raises(IncompatibleCheckpoint, match="template") as e:
        refuse.restore(live.workload)
    assert not e.value.retryable


def test_a_torn_chunk_is_refused_before_criu_and_names_the_chunk(pair, tt):
    live, _ = pair
    m, refuse = _stopped_after_a_heartbeat(live, tt)
    recs = json.loads((tt.store.images_dir(m) / SESSIONS_FILE).read_text())["sessions"]
    victim = recs["a"]["tensors"][1]["chunks"][0]
    path = refuse.chunks.path(victim)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match=victim[:12]):
        refuse.restore(live.workload)


def test_a_failed_export_leaves_no_manifest_and_the_worker_serves_on(tmp_path, pair, tt, monkeypatch):
    live, ref = pair
    store = tt.store
    tt.heartbeat(live.workload)
    before = [m.id for m in store.list(live.workload.name)]
    _talk(live, ref, turns=(("b", "more"),))
    gone = tmp_path / "no-such-dir"
    monkeypatch.setattr(tt.chunks, "staging", lambda: contextlib.nullcontext(gone))  # the engine cannot write there
    with pytest.raises(EngineProtocolError, match="sessions/export refused"):
        tt.heartbeat(live.workload)
    assert [m.id for m in store.list(live.workload.name)] == before
    assert live.complete("still there?", 8, "b") == ref.complete("still there?", 8, "b")


def test_a_replaced_template_invalidates_its_sessions_and_a_new_one_is_captured(pair, tt):
    live, ref = pair
    store = tt.store
    m1 = tt.heartbeat(live.workload)
    old = _template(tt, m1)
    store.set_state(old, CheckpointState.invalidated, "driver changed")       # what invalidate does
    m2 = tt.heartbeat(live.workload)
    assert m2.probe.template.id != old.id
    assert store.get(live.workload.name, m1.id).state == CheckpointState.invalidated
    assert "replaced" in store.get(live.workload.name, m1.id).state_reason
    assert live.complete("after", 8, "a") == ref.complete("after", 8, "a")


def test_a_torn_weight_chunk_fails_the_restore_and_leaves_no_half_worker(pair, tt):
    """Weights are hashed by the engine while they stream: a torn one stops the restore after
    CRIU, and the restored template is killed (no worker without its weights passes for one)."""
    live, _ = pair
    m = tt.heartbeat(live.workload)
    tmpl = _template(tt, m)
    victim = tmpl.probe.weights.chunks[-1]
    path = tt.chunks.path(victim)
    data = bytearray(path.read_bytes())
    data[7] ^= 0xFF
    path.write_bytes(bytes(data))
    live.stop()
    with pytest.raises(EngineProtocolError, match="torn"):
        tt.restore(live.workload)
    from ckptflow.runners.process import pid_alive

    tt.node.criu.wait_pid_free(tmpl.pid)
    assert not pid_alive(tmpl.pid)


def test_a_truncated_weight_chunk_is_refused_before_criu_and_named(pair, tt):
    """The weights are not hashed on the host, but their sizes are checked: a chunk cut short
    (a disk that filled, a copy cut off) is refused before any CRIU call, naming the chunk."""
    live, _ = pair
    m = tt.heartbeat(live.workload)
    victim = _template(tt, m).probe.weights.chunks[0]
    path = tt.chunks.path(victim)
    path.write_bytes(path.read_bytes()[:-1000])
    live.stop()
    calls = []
    real = tt.node.criu.restore
    tt.node.criu.restore = lambda *a, **k: calls.append(a) or real(*a, **k)
    with pytest.raises(ChecksumMismatch, match=victim[:12]):
        tt.restore(live.workload)
    assert calls == []                                                          # no CRIU call was made


def test_one_template_starts_replicas_of_two_workloads_that_continue_exactly(demo_worker, tt):
    """Two workers of the same model; the template taken from the first starts two copies (own
    PID and network namespaces), one given each workload's sessions: each continues exactly
    like the workload it copies. The weights' chunks are stored once for both workloads."""
    from ckptflow.runners.verify import del_netns, new_netns

    one, two = demo_worker("one", BALLAST_MIB), demo_worker("two", BALLAST_MIB)
    _talk(one, turns=(("a", "first workload " * 10),))
    _talk(two, turns=(("c", "second workload " * 12), ("d", "another")))
    m1, m2 = tt.heartbeat(one.workload), tt.heartbeat(two.workload)
    t1, t2 = _template(tt, m1), _template(tt, m2)
    assert t1.workload == t2.workload and t1.probe.weights.chunks == t2.probe.weights.chunks
    chunks_on_disk = sum(1 for p in tt.chunks.root.glob("??/*"))
    assert chunks_on_disk < len(t1.probe.weights.chunks) * 2                 # dedup'd, not stored twice
    copies, nss = [], []
    try:
        for w in (one, two):
            ns = new_netns("cktt")
            nss.append(ns)
            copy, info = tt.start_replica(w.workload, ns, template_source="one")
            copies.append((copy, info, ns, w))
            assert info["template"] == t1.id
        from ckptflow.runners import engine

        decided = tt.store.get("two", m2.id).probe.export.decisions
        assert decided["d"] == "new session (19 tokens)"         # short, and protected: never lost silently
        for copy, info, ns, w in copies:
            for sid in w.digests():
                got = engine.call(w.workload, "/v1/completions", {"prompt": "next?", "max_tokens": 12,
                                                                   "session_id": sid}, base=info["base_url"], netns=ns)
                assert got["choices"][0]["tokens"] == w.complete("next?", 12, sid)
    finally:
        for copy, *_ in copies:
            copy.stop()
        for ns in nss:
            del_netns(ns)


def test_a_standby_taken_while_the_worker_runs_is_promoted_after_it_died_and_continues_exactly(pair, tt):
    """Failover without CRIU on the critical path: the template restored ahead of need beside the
    live worker (own PID and network namespaces) and parked; after the worker dies, promote gives
    it the weights and the newest sessions, taken after the standby was, and it continues token
    for token like the reference. A standby of a replaced template is refused, not promoted."""
    from ckptflow.runners import engine
    from ckptflow.runners.verify import del_netns, new_netns

    live, ref = pair
    tt.heartbeat(live.workload)
    ns = new_netns("ckts")
    sb = tt.standby(live.workload, ns)
    try:
        info = engine.call(live.workload, "/v1/ckptflow/engine", base=sb.base, netns=ns)
        assert info.get("parked") and sb.copy.pid != live.pid           # parked: no weights, no sessions
        assert "warm" in sb.timings                                     # the engine's optional warm-up was asked
        _talk(live, ref, turns=(("a", "a turn after the standby was taken"),))
        m = tt.heartbeat(live.workload)
        os.kill(live.pid, signal.SIGKILL)
        live.proc.wait()
        r = tt.promote(live.workload, sb)
        assert r.manifest.id == m.id and r.template.id == sb.template.id and r.pid == sb.copy.pid
        # the standby itself serves now (no new process was restored for the failover)
        assert engine.call(live.workload, "/v1/ckptflow/engine", base=sb.base, netns=ns)["parked"] is False
        _continues_on_standby(live, ref, sb, ns)
    finally:
        sb.copy.stop()
        del_netns(ns)


def test_a_standby_of_a_replaced_template_is_refused_and_a_torn_session_chunk_fails_its_promotion(pair, tt):
    from ckptflow.runners.verify import del_netns, new_netns

    live, _ = pair
    m1 = tt.heartbeat(live.workload)
    ns = new_netns("ckts")
    sb = tt.standby(live.workload, ns)
    try:
        tt.store.set_state(_template(tt, m1), CheckpointState.invalidated, "driver changed")
        tt.heartbeat(live.workload)                                   # a new template, new sessions
        with pytest.raises(IncompatibleCheckpoint, match="template"):
            tt.promote(live.workload, sb)
    finally:
        sb.copy.stop()
        del_netns(ns)
    ns = new_netns("ckts")
    sb = tt.standby(live.workload, ns)
    try:
        m = tt.heartbeat(live.workload)
        digest = json.loads((tt.store.images_dir(m) / SESSIONS_FILE).read_text())["sessions"]["a"]["tensors"][0]["chunks"][0]
        p = tt.chunks.path(digest)
        p.chmod(0o600)
        raw = p.read_bytes()
        p.write_bytes(raw[:10] + bytes([raw[10] ^ 1]) + raw[11:])
        with pytest.raises(ChecksumMismatch, match=digest[:12]):
            tt.promote(live.workload, sb)
    finally:
        sb.copy.stop()
        del_netns(ns)


def _calls(monkeypatch, strip_sessions_from_resume=False):
    """The protocol calls the runner makes (path, body keys), optionally as an engine that
    predates sessions on ``template/resume`` sees them: the field dropped on the way."""
    from ckptflow.runners import engine

    seen, real = [], engine.call

    def call(w, path, body=None, *a, **k):
        seen.append((path.rsplit("/v1/ckptflow/", 1)[-1], sorted(body or {})))
        if strip_sessions_from_resume and path.endswith("/template/resume"):
            body = {k2: v for k2, v in body.items() if k2 != "sessions"}
        return real(w, path, body, *a, **k)

    monkeypatch.setattr(engine, "call", call)
    return seen


def test_a_standby_is_given_weights_and_sessions_in_one_call_and_a_torn_session_chunk_fails_it_named(
        pair, tt, monkeypatch):
    """promote sends the sessions with ``template/resume``: the engine brings weights and
    sessions back in one pass (no ``sessions/import``) and continues exactly. A torn session
    chunk that reaches the engine (records it checks itself skip the runner's hash) fails that
    one call, naming the chunk, and the standby stays parked with no session."""
    from ckptflow.errors import EngineProtocolError
    from ckptflow.runners import engine
    from ckptflow.runners.verify import del_netns, new_netns

    live, ref = pair
    tt.heartbeat(live.workload)
    ns = new_netns("ckts")
    sb = tt.standby(live.workload, ns)
    try:
        _talk(live, ref, turns=(("a", "a turn after the standby was taken"),))
        m = tt.heartbeat(live.workload)
        os.kill(live.pid, signal.SIGKILL)
        live.proc.wait()
        digest = json.loads((tt.store.images_dir(m) / SESSIONS_FILE).read_text())["sessions"]["b"]["tensors"][0]["chunks"][0]
        p = tt.chunks.path(digest)
        p.chmod(0o600)
        raw = p.read_bytes()
        p.write_bytes(raw[:10] + bytes([raw[10] ^ 1]) + raw[11:])
        monkeypatch.setattr(tt.chunks, "verify", tt.chunks.present)   # as for GPU-checked records
        seen = _calls(monkeypatch)
        with pytest.raises(EngineProtocolError, match=digest[:12]):
            tt.promote(live.workload, sb)
        assert [c for c, _ in seen] == ["template/resume"] and "sessions" in seen[0][1]
        info = engine.call(live.workload, "/v1/ckptflow/engine", base=sb.base, netns=ns)
        assert info["parked"] and info["sessions"] == {}                 # all or nothing
        p.write_bytes(raw)                                               # repaired: the same standby takes it
        seen.clear()
        r = tt.promote(live.workload, sb)
        assert [c for c, _ in seen if c != "engine"] == ["template/resume"]
        assert "load" in r.timings and "sessions" not in r.timings
        _continues_on_standby(live, ref, sb, ns)
    finally:
        sb.copy.stop()
        del_netns(ns)


def test_an_engine_that_ignores_sessions_on_resume_gets_them_by_sessions_import(pair, tt, monkeypatch):
    """An engine that predates sessions on ``template/resume`` answers without ``imported``: the
    runner falls back to ``sessions/import`` and the restore continues exactly."""
    live, ref = pair
    tt.heartbeat(live.workload)
    _talk(live, ref, turns=(("a", "next step"),))
    tt.heartbeat(live.workload)
    live.stop()
    seen = _calls(monkeypatch, strip_sessions_from_resume=True)
    r = tt.restore(live.workload)
    assert [c for c, _ in seen if c in ("template/resume", "sessions/import")] == ["template/resume", "sessions/import"]
    assert {"weights", "sessions"} <= set(r.timings) and "load" not in r.timings
    assert live.digests() == ref.digests()
    for sid in ("a", "b"):
        assert live.complete("and then?", 16, sid) == ref.complete("and then?", 16, sid)


def test_a_turn_heartbeat_asks_the_engine_for_a_turn_export_and_restores_exactly(pair, tt, monkeypatch):
    """``heartbeat(turn=True)`` passes ``"turn": true`` to ``sessions/export`` (the CPU worker
    holds itself as for any export: its answer does not say ``turn``), and only then."""
    live, ref = pair
    tt.heartbeat(live.workload)
    _talk(live, ref, turns=(("a", "one more"),))
    seen = _calls(monkeypatch)
    m = tt.heartbeat(live.workload, turn=True)
    assert [k for c, k in seen if c == "sessions/export"] == [["dir", "known", "sessions", "turn"]]
    assert m.probe.export.changed == ["a"] and "turn" not in m.timings
    _talk(live, ref, turns=(("b", "and one more"),))
    seen.clear()
    tt.heartbeat(live.workload)
    assert [k for c, k in seen if c == "sessions/export"] == [["dir", "known", "sessions"]]
    live.stop()
    tt.restore(live.workload)
    for sid in ("a", "b"):
        assert live.complete("and then?", 16, sid) == ref.complete("and then?", 16, sid)


_RUNNER = """
import sys
from ckptflow.models import Workload
from ckptflow.runners.node import NodeRunner
from ckptflow.runners.template_sessions import TemplateSessionsRunner
from ckptflow.store.local import LocalStore
with NodeRunner(LocalStore(sys.argv[1])) as node:
    TemplateSessionsRunner(node).heartbeat(Workload.model_validate_json(sys.argv[2]))
"""


def test_a_runner_killed_mid_export_leaves_no_manifest_the_worker_serves_on_and_the_next_run_cleans_up(pair, tt):
    import subprocess
    import sys

    from holdproxy import HoldProxy

    live, ref = pair
    store = tt.store
    tt.heartbeat(live.workload)
    before = [m.id for m in store.list(live.workload.name)]
    _talk(live, ref, turns=(("a", "one more long turn " * 20),))
    base = live.workload.health_url.rsplit("/", 1)[0]
    proxy = HoldProxy(base, "/v1/ckptflow/sessions/export")
    via = live.workload.model_copy(update={"health_url": proxy.url + "/health",
                                           "metrics_url": proxy.url + "/metrics"})
    runner = subprocess.Popen([sys.executable, "-c", _RUNNER, str(store.root), via.model_dump_json()],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proxy.in_flight.wait(60), runner.communicate(timeout=5)[0]  # the engine has exported
        staged = list((tt.chunks.root / ".staging").iterdir())
        assert [d.name.split("-")[0] for d in staged] == [str(runner.pid)]
        assert any(staged[0].iterdir())                                       # bytes the runner never adopted
        runner.kill()
        runner.wait(10)
    finally:
        proxy.close()
    assert [m.id for m in store.list(live.workload.name)] == before            # no manifest
    assert live.complete("still there?", 8, "a") == ref.complete("still there?", 8, "a")

    m = tt.heartbeat(live.workload)                                           # the next run goes through
    assert m.probe.export.changed == ["a"]
    assert list((tt.chunks.root / ".staging").iterdir()) == []               # and removed what the dead one left


def test_the_policy_reads_a_two_tier_workload_as_two_tier_with_its_own_sizes(pair, tt):
    from ckptflow.models import CheckpointMode
    from ckptflow.runners.facts import collect_facts

    live, _ = pair
    w = live.workload.model_copy(update={"checkpoint": CheckpointMode.template_sessions})
    m = tt.heartbeat(w)
    tmpl = _template(tt, m)
    recs = json.loads((tt.store.images_dir(m) / SESSIONS_FILE).read_text())["sessions"]
    f = collect_facts(w, tt.store)
    assert f.checkpoint_mode == "template-sessions" and f.measured_pause_s == m.timings["pause"]
    assert f.weights_gib == tmpl.probe.weights.bytes / 2**30
    assert f.kv_bytes_per_token == sum(r["total_bytes"] for r in recs.values()) / sum(r["tokens"] for r in recs.values())
    assert collect_facts(live.workload, tt.store).checkpoint_mode == "process"


def test_chunks_no_checkpoint_names_are_collected_and_the_rest_still_restores_exactly(pair, tt):
    from datetime import timedelta

    from ckptflow.policies.retention import Retention
    from ckptflow.store.chunks import REFS_FILE

    live, ref = pair
    store, name = tt.store, live.workload.name
    tt.heartbeat(live.workload)
    for turn in ("first long turn " * 12, "second long turn " * 12):
        _talk(live, ref, turns=(("a", turn),))
        tt.heartbeat(live.workload)
    everything = {f.name for f in tt.chunks.root.glob("??/*")}
    # Young chunks are left alone (a heartbeat may be between adopting and its manifest).
    assert store.collect_chunks()["chunks_deleted"] == 0
    store.apply_retention(name, Retention(keep=1))
    remaining = store.list(name)
    named = {d for m in [*remaining, *store.list(_template(tt, remaining[0]).workload)]
             for d in json.loads((store.images_dir(m) / REFS_FILE).read_text())}
    got = store.collect_chunks(grace=timedelta(0))
    left = {f.name for f in tt.chunks.root.glob("??/*")}
    assert left == named and got["chunks_deleted"] == len(everything - named) > 0
    assert got["bytes_freed"] > 0

    os.kill(live.pid, signal.SIGKILL)
    live.proc.wait()
    tt.restore(live.workload)
    assert live.digests() == ref.digests()
    assert live.complete("after the collect", 12, "a") == ref.complete("after the collect", 12, "a")


def test_chunks_are_not_collected_while_a_checkpoint_does_not_list_them(pair, tt):
    from datetime import timedelta

    from ckptflow.store.chunks import REFS_FILE

    live, _ = pair
    m = tt.heartbeat(live.workload)
    (tt.store.images_dir(m) / REFS_FILE).unlink()   # as written before chunk lists existed
    before = {f.name for f in tt.chunks.root.glob("??/*")}
    got = tt.store.collect_chunks(grace=timedelta(0))
    assert "does not list its chunks" in got["skipped"] and m.id in got["skipped"]
    assert {f.name for f in tt.chunks.root.glob("??/*")} == before


def test_prune_drops_a_replaced_template_and_its_sessions_keeps_the_bound_one_and_still_restores(pair, tt):
    from datetime import timedelta

    from ckptflow.policies.retention import Retention

    live, ref = pair
    store, name = tt.store, live.workload.name
    m1 = tt.heartbeat(live.workload)
    old = _template(tt, m1)
    store.set_state(old, CheckpointState.invalidated, "driver changed")       # what invalidate does
    m2 = tt.heartbeat(live.workload)                                           # a new template
    new = _template(tt, m2)
    old_image = {f.name for f in store.images_dir(old).iterdir()}
    rule = Retention(invalidated_grace_h=0)
    res = store.prune(rule, orphan_grace=timedelta(0))
    deleted = {(r["workload"], r["checkpoint"]) for r in res["manifests_deleted"]}
    assert (old.workload, old.id) in deleted and (name, m1.id) in deleted       # both invalidated
    assert [t.id for t in store.list(new.workload)] == [new.id]                 # the bound one stays
    assert old_image and not store.images_dir(old).exists()
    assert res["bytes_freed"] > 0

    _talk(live, ref, turns=(("b", "after the prune"),))
    tt.heartbeat(live.workload)
    os.kill(live.pid, signal.SIGKILL)
    live.proc.wait()
    tt.restore(live.workload)
    assert live.digests() == ref.digests()


def test_a_capture_whose_prepare_call_fails_gives_the_engine_its_weights_and_sessions_back(pair, tt, monkeypatch):
    from ckptflow.runners import engine

    live, ref = pair
    real = engine.call

    def late(w, path, body=None, *a, **k):  # the engine did release, but the answer never arrived
        got = real(w, path, body, *a, **k)
        if path == "/v1/ckptflow/template/prepare":
            raise EngineProtocolError(f"workload {w.name}: {path} failed: timed out", retryable=True)
        return got

    monkeypatch.setattr(engine, "call", late)
    with pytest.raises(EngineProtocolError, match="timed out"):
        tt.heartbeat(live.workload)
    monkeypatch.setattr(engine, "call", real)
    assert engine.engine_info(live.workload)["parked"] is False
    assert tt.store.list(live.workload.name) == []                             # no manifest
    assert live.complete("still serving?", 8, "a") == ref.complete("still serving?", 8, "a")


def test_a_runner_that_died_with_the_engine_parked_is_cleaned_up_by_the_next_heartbeat(pair, tt):
    import tempfile

    from ckptflow.runners import engine

    live, ref = pair
    tt.heartbeat(live.workload)                                                # sessions as of here
    base = tt.chunks.root / ".staging"
    dead = _exited_pid()
    stage = Path(tempfile.mkdtemp(dir=base, prefix=f"{dead}-"))
    os.chmod(stage, 0o733)
    engine.call(live.workload, "/v1/ckptflow/template/prepare", {"dir": str(stage), "known": []})
    info = engine.engine_info(live.workload)
    assert info["parked"] and info["parked_with"]["dir"] == str(stage)     # as the dead runner left it
    m = tt.heartbeat(live.workload)
    assert engine.engine_info(live.workload)["parked"] is False and m.kind == "sessions"
    assert live.digests() == ref.digests()                                     # rolled back to the checkpoint = unchanged
    assert live.complete("and now?", 8, "b") == ref.complete("and now?", 8, "b")


def _exited_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_two_tier_checkpoints_go_through_s3_and_restore_on_another_node(pair, tt, tmp_path, s3):
    from ckptflow.store.s3 import S3Tier

    live, ref = pair
    tier = S3Tier(s3.bucket("ckpt-2t"), endpoint_url=s3.endpoint)
    m1 = tt.heartbeat(live.workload)
    first = tt.push(m1, tier)
    tmpl = _template(tt, m1)
    assert first["template_uploaded_bytes"] > BALLAST_MIB << 20                 # weights go up once
    _talk(live, ref, turns=(("a", "a turn after the first push " * 4),))
    m2 = tt.heartbeat(live.workload)
    at_m2 = ref.digests()
    second = tt.push(m2, tier)
    assert "template_uploaded_bytes" not in second                               # the bucket has it
    assert 0 < second["uploaded_bytes"] < first["template_uploaded_bytes"] / 10  # only what changed
    assert tier.ids(tmpl.workload) == [tmpl.id] and tier.ids(live.workload.name) == [m2.id, m1.id]

    os.kill(live.pid, signal.SIGKILL)                                          # the node is lost
    live.proc.wait()
    with NodeRunner(LocalStore(tmp_path / "node-b")) as other:
        r = TemplateSessionsRunner(other).restore(live.workload, tier=tier)
        assert r.manifest.id == m2.id and r.template.id == tmpl.id and "fetch" in r.timings
        assert live.digests() == ref.digests()
        for sid in ("a", "b"):
            assert live.complete("on the new node", 12, sid) == ref.complete("on the new node", 12, sid)
        # The bucket keeps every chunk a kept checkpoint names, and frees the rest.
        tier.delete(tier.manifest(live.workload.name, m1.id))
        res = tier.prune()
        assert res["manifests_kept"] == 2
        os.kill(live.pid, signal.SIGKILL)
        live.proc.wait()
        shutil.rmtree(other.store.root)
    with NodeRunner(LocalStore(tmp_path / "node-c")) as third:
        TemplateSessionsRunner(third).restore(live.workload, tier=tier)
        assert live.digests() == at_m2                                          # m1's removal cost m2 nothing
