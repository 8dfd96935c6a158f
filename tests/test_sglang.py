"""SGLang's adapter (ckptflow/engines/sglang.py) on the answers a live SGLang 0.5.17 gave on the
H200 (bench/sglang_gpu.py, recorded in tests/data/sglang/): SGLang does not serve on CPU from
registry packages (docs/engines/sglang.md), so these answers are served here from a local HTTP
server, and each goes through the caller a heartbeat or a restore uses: the fleet loader, the
load read (runners/engine.read_load), the restore's golden check (runners/engine.answers_real_work).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ckptflow.engines import sglang
from ckptflow.errors import RestoreFailed
from ckptflow.fleet import load_fleet
from ckptflow.models import ProcessFinder, Workload
from ckptflow.runners import engine
from ckptflow.runners.node import NodeRunner
from ckptflow.store.local import LocalStore

ROOT = Path(__file__).parent.parent
DATA = Path(__file__).parent / "data" / "sglang"
DOC = ROOT / "docs" / "engines" / "sglang.md"


class Recorded(BaseHTTPRequestHandler):
    """SGLang's recorded answers; ``generate`` can be swapped for another body."""

    generate: dict = json.loads((DATA / "generate.json").read_text())["response"]
    requests: list[dict] = []

    def do_GET(self):  # noqa: N802
        if self.path == "/metrics":
            self._send(200, (DATA / "metrics.txt").read_bytes(), "text/plain; version=0.0.4")
        elif self.path == "/health":
            rec = json.loads((DATA / "health.json").read_text())
            self._send(rec["status"], rec["body"].encode(), "text/plain")
        else:
            self._send(404, b"{}", "application/json")

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "body": body})
        if self.path == "/generate":
            self._send(200, json.dumps(type(self).generate).encode(), "application/json")
        else:
            self._send(404, b"{}", "application/json")

    def _send(self, status: int, data: bytes, ctype: str):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Recorded)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    Recorded.requests = []
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


def _doc_fleet_block() -> str:
    return re.search(r"### Declaring it\n\n```yaml\n(.*?)```", DOC.read_text(), re.S).group(1)


def _fleet(tmp_path: Path, workloads_yaml: str) -> Path:
    f = tmp_path / "fleet.yaml"
    f.write_text("fleet: sgl\nstorage: {kind: local, path: store}\n"
                 "nodes:\n  - {name: gpu-node-01, work_pool: gpu, gpu_class: h200, gpus: 1}\n" + workloads_yaml)
    return f


def _workload(base: str, **kw) -> Workload:
    return Workload(name="chat-sglang", node="n", engine="sglang", gpu=True, health_url=base + "/health",
                    metrics_url=base + "/metrics", golden=sglang.ADAPTER.golden_request(base),
                    find=ProcessFinder(pid_file="/nonexistent", cmdline_must_contain=sglang.CMDLINE), **kw)


def test_the_documented_fleet_block_loads_with_sglangs_criu_options_and_matches_the_recorded_tree(tmp_path):
    w = load_fleet(_fleet(tmp_path, _doc_fleet_block())).workloads[0]
    assert w.engine.value == "sglang" and w.tcp_established
    # engine: sglang brings the options its tree was checkpointed with on the H200
    assert (w.criu.link_remap, w.criu.ext_unix_sk, w.criu.file_locks, w.criu.devshm) == (True, True, True, True)
    assert not w.criu.amx_unused
    # the finder picks the API server, the tree's root, and none of its children
    tree = json.loads((DATA / "tree.json").read_text())
    roots = [p for p in tree if w.find.cmdline_must_contain in p["cmdline"]]
    assert [p["comm"] for p in roots] == ["python3"] and roots[0] is tree[0]
    assert {p["comm"] for p in tree[1:]} >= {"sglang::schedul", "sglang::detoken"}
    # the page's golden request is the adapter's
    assert w.golden == sglang.ADAPTER.golden_request("http://127.0.0.1:30000")


def test_a_criu_block_overrides_sglangs_options_one_by_one(tmp_path):
    block = _doc_fleet_block().replace("    tcp_established: true\n", "    tcp_established: true\n    criu: {devshm: false}\n")
    w = load_fleet(_fleet(tmp_path, block)).workloads[0]
    assert (w.criu.link_remap, w.criu.ext_unix_sk, w.criu.file_locks, w.criu.devshm) == (True, True, True, False)


def test_template_sessions_with_sglang_loads_and_an_sglang_without_the_plugin_is_told_how_to_start_it(tmp_path,
                                                                                                   server):
    # Run on the H200 through ckptflow's plugin (bench/sglang_gpu.py row c): no longer refused at load.
    block = _doc_fleet_block().replace("    gpu: true\n", "    gpu: true\n    checkpoint: template-sessions\n")
    assert load_fleet(_fleet(tmp_path, block)).workloads[0].checkpoint == "template-sessions"
    # The recorded SGLang was started without the plugin: the heartbeat's first call names the fix.
    from ckptflow.errors import EngineProtocolError
    from ckptflow.runners.template_sessions import TemplateSessionsRunner

    w = _workload(server).model_copy(update={"checkpoint": "template-sessions"})
    with pytest.raises(EngineProtocolError) as e:
        TemplateSessionsRunner(NodeRunner(LocalStore(tmp_path / "store"), criu=object())).heartbeat(w)
    assert "start SGLang with ckptflow's plugin" in e.value.fix and "protocol_args" in e.value.fix


def test_protocol_args_are_the_flags_the_plugin_asks_for():
    flags, env = sglang.protocol_args(Path("/var/lib/ckptflow/kv/chat-s"), page_size=32, hicache_gib=1)
    args: dict = {}
    i = 0
    while i < len(flags):   # --flag [value]
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            args[flags[i]] = flags[i + 1]
            i += 2
        else:
            args[flags[i]] = True
            i += 1
    # What the plugin refuses to run without (sglang_protocol._kv_dir, the template's release).
    assert args["--enable-hierarchical-cache"] is True and args["--hicache-storage-backend"] == "file"
    assert args["--enable-memory-saver"] is True and args["--hicache-write-policy"] == "write_through"
    assert json.loads(args["--hicache-storage-backend-extra-config"]) == {"prefetch_threshold": 32}
    assert args["--page-size"] == "32" and env == {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/var/lib/ckptflow/kv/chat-s"}


def test_the_heartbeats_load_read_parses_the_live_metrics(server):
    load = engine.read_load(_workload(server))
    assert load is not None
    assert (load.running, load.waiting, load.kv_cache_usage, load.used_tokens) == (1, 0, 0.04, 4087)
    assert (load.prompt_tokens_total, load.generation_tokens_total) == (12168, 105)


def test_a_restore_counts_once_sglang_answers_its_golden_request(server):
    w = _workload(server)
    engine.answers_real_work(w, pid=0, what="restored")   # the recorded answer has output_ids
    req = Recorded.requests[-1]
    assert req["path"] == "/generate" and req["body"]["sampling_params"]["temperature"] == 0
    assert req["body"]["input_ids"] == [1, 17, 42, 99]


def test_a_restored_sglang_that_answers_without_tokens_fails_the_restore_and_is_stopped(server, monkeypatch):
    # What a broken engine sends: HTTP 200 with an error body (SGLang's abort answer has no output_ids).
    monkeypatch.setattr(Recorded, "generate", {"error": {"message": "scheduler died"}, "meta_info": {}})
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RestoreFailed) as e:
            engine.answers_real_work(_workload(server), pid=worker.pid, what="restored")
        assert "golden request" in str(e.value) and "output_ids" in str(e.value)
        assert worker.wait(timeout=10) == -9      # the tree was killed: it holds the port a cold start needs
    finally:
        worker.kill()


def test_the_golden_digest_is_the_recorded_tokens():
    answer = json.loads((DATA / "generate.json").read_text())["response"]
    same = dict(answer, meta_info={"cached_tokens": 0})          # timings and cache hits are not compared
    assert engine.golden_digest(answer, "output_ids") == engine.golden_digest(same, "output_ids")
    other = dict(answer, output_ids=answer["output_ids"][::-1])
    assert engine.golden_digest(answer, "output_ids") != engine.golden_digest(other, "output_ids")
