"""Tensor-parallel workers on the CPU side: the NCCL prerequisites and the refusal, before any
lock or dump. The all-ranks checkpoint itself runs on the H200 (bench/gpu_tp.py)."""

import pytest

from ckptflow.errors import UnsupportedWorkload
from ckptflow.policies.cadence import WorkloadFacts, decide
from ckptflow.policies.multigpu import NCCL_REQUIRED, tp_problems

GOOD = dict(NCCL_REQUIRED)


def test_one_gpu_needs_nothing_and_ready_ranks_pass():
    assert tp_problems(1, [{}]) == []
    assert tp_problems(2, [GOOD, {**GOOD, "PATH": "/usr/bin"}]) == []


def test_each_missing_or_wrong_variable_is_named_with_its_rank():
    wrong = {**GOOD, "NCCL_SHM_DISABLE": "0"}
    del wrong["NCCL_NVLS_ENABLE"]                                       # SHM on, NVLS unset
    assert tp_problems(2, [GOOD, wrong]) == ["rank process 1: NCCL_SHM_DISABLE is '0', needs 1",
                                             "rank process 1: NCCL_NVLS_ENABLE is unset, needs 0"]
    assert tp_problems(2, [{**GOOD, "NCCL_P2P_DISABLE": "0"}, GOOD]) == [
        "rank process 0: NCCL_P2P_DISABLE is '0', needs 1"]


def test_a_missing_rank_refuses_all():
    assert tp_problems(4, [GOOD] * 3)[0].startswith("found 3 GPU process(es), the workload declares tensor_parallel: 4")


def test_policy_skips_an_unsupported_worker_whatever_its_rule_says():
    f = WorkloadFacts(name="tp", unsupported="rank process 0: NCCL_P2P_DISABLE is unset, needs 1")
    for policy, params in (("cost-based", {}), ("fixed", {"interval_s": 60})):
        d = decide(f, policy, params)
        assert d.action.value == "skip" and not d.due
        assert d.reason == "cannot be checkpointed: rank process 0: NCCL_P2P_DISABLE is unset, needs 1"


class RecordingCuda:
    """Stands in for the driver on CPU; the refusal must come before any call reaches it."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*a, **kw):
            self.calls.append(name)
            raise AssertionError(f"CUDA {name} called")
        return call


@pytest.mark.criu
def test_runner_refuses_a_tp_worker_without_nccl_settings_before_any_lock(tmp_path, demo_worker):
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    w = demo_worker("tp")
    w.workload = w.workload.model_copy(update={"gpu": True, "tensor_parallel": 2})
    cuda = RecordingCuda()
    node = NodeRunner(LocalStore(tmp_path / "store"), cuda=cuda)
    with pytest.raises(UnsupportedWorkload) as e:
        node.checkpoint(w.workload)
    msg = str(e.value)
    assert "workload tp (tensor_parallel: 2) cannot be checkpointed" in msg
    assert "found 1 GPU process(es)" in msg and "NCCL_P2P_DISABLE is unset, needs 1" in msg
    assert "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 USE_LIBUV=0" in e.value.fix
    assert not e.value.retryable
    assert cuda.calls == [] and LocalStore(tmp_path / "store").list("tp") == []
    assert w.complete("still serving", 4, "s")          # untouched


@pytest.mark.criu
def test_heartbeat_reports_the_reason_instead_of_checkpointing(tmp_path, prefect_harness, demo_worker):
    from conftest import write_fleet
    from ckptflow.flows.heartbeat import heartbeat

    w = demo_worker("tp")
    w.workload = w.workload.model_copy(update={"gpu": True, "tensor_parallel": 2})
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    rows = heartbeat(str(fleet))
    assert [(r["decision"], r["checkpoint"]) for r in rows] == [("skip", None)]
    assert rows[0]["reason"].startswith("cannot be checkpointed: found 1 GPU process(es)")


def _report(pid: int, out) -> tuple[int, int]:
    import os
    import signal
    import time

    out.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.time() + 10
    while not out.exists():
        assert time.time() < deadline, "rank 0 never reported"
        time.sleep(0.01)
    sent, total = map(int, out.read_text().split())
    return sent, total


@pytest.mark.criu
def test_command_ring_survives_kill_and_restore_as_a_ghost_file(tmp_path, criu):
    """The ranks' CPU-side command ring (a /dev/shm file both map, unlinked once mapped) comes
    back inside the CRIU image: after a kill and a restore the same ranks go on exchanging
    commands with no command lost or repeated, and nothing is left in /dev/shm."""
    import glob
    import os
    import subprocess
    import sys
    import time

    from conftest import HELPERS, kill_pid_file
    from ckptflow.models import ProcessFinder, Workload

    pid_file, out = tmp_path / "r.pid", tmp_path / "sums"
    p = subprocess.Popen([sys.executable, str(HELPERS / "ring_pair.py"), str(pid_file), str(out)],
                         start_new_session=True, stdin=subprocess.DEVNULL)
    w = Workload(name="ring", node="n", find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="ring_pair.py"))
    try:
        deadline = time.time() + 20
        while not pid_file.exists():
            assert time.time() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
        sent, total = _report(p.pid, out)
        assert sent > 10 and total == sent * (sent + 1) // 2
        assert glob.glob(f"/dev/shm/ckptflow-ring-test-{p.pid}") == []  # unlinked once both mapped
        rank1 = int(open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()[0])
        res = criu.dump(w, tmp_path / "img", leave_running=False)
        p.wait(timeout=10)
        for gone in (res.pid, rank1):  # every PID of the tree must be free for the restore
            criu.wait_pid_free(gone)
        pid = criu.restore(tmp_path / "img", old_pid=res.pid)
        time.sleep(0.3)
        sent2, total2 = _report(pid, out)
        assert sent2 > sent and total2 == sent2 * (sent2 + 1) // 2
        assert glob.glob("/dev/shm/ckptflow-ring-test-*") == []
    finally:
        kill_pid_file(pid_file, "ring_pair.py")


def test_a_tp_checkpoint_is_refused_on_a_node_with_another_gpu_count_before_any_call(tmp_path):
    """A TP=2 checkpoint taken on a 2-GPU node, restored on a 1-GPU node: the fingerprint gate
    names gpu_count (2 -> 1) before CRIU or the driver is touched, and it is final (no retry)."""
    from ckptflow.errors import IncompatibleCheckpoint
    from ckptflow.models import Fingerprint, ProcessFinder, Workload
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.fingerprint import workload_fingerprint
    from ckptflow.store.local import LocalStore

    two = Fingerprint(arch="x86_64", kernel="6.18.44", criu="4.2.1", gpu_model="NVIDIA H200", gpu_count=2,
                      driver="580.159.04", cuda_driver="13.0", ckptflow="0.1.0")
    one = two.model_copy(update={"gpu_count": 1})
    w = Workload(name="tp", node="n", find=ProcessFinder(pid_file=str(tmp_path / "tp.pid")), gpu=True,
                 tensor_parallel=2, engine="vllm", engine_version="0.11.0", model_id="m", model_revision="r")
    store = LocalStore(tmp_path / "store")
    pending = store.begin("tp", node="n")
    (pending.images_dir / "core-1.img").write_bytes(b"x" * 1024)
    m = store.commit(pending, fingerprint=workload_fingerprint(w, two), pid=1, gpu_pids=[1, 2])

    class NoCriu:
        def __getattr__(self, name):
            raise AssertionError(f"CRIU {name} called")

    node = NodeRunner(store, criu=NoCriu(), cuda=RecordingCuda(), node_fp=one)
    with pytest.raises(IncompatibleCheckpoint) as e:
        node.gate(w, m)
    assert "gpu_count" in str(e.value) and "2" in str(e.value) and "1" in str(e.value)
    assert not e.value.retryable
    node.gate(w.model_copy(), m.model_copy(update={"fingerprint": workload_fingerprint(w, one)}))  # same count: ok


class _TpEngine:
    """The TP worker's quiesce protocol over HTTP (prepare answers its ranks URL, resume, ranks),
    recording the calls, for the runner's side of a lock that times out."""

    def __init__(self):
        import http.server
        import json
        import threading

        self.calls = []
        eng = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _json(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                eng.calls.append(self.path)
                self._json({"ranks": [{"describe": "rank 0 (PID 10): idle on the CPU ring after command 7"},
                                      {"describe": "rank 1 (PID 11): running ALLREDUCE for 12.0 s"}]})

            def do_POST(self):
                eng.calls.append(self.path)
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._json({"quiesced": True, "ranks_url": f"{eng.url}/v1/ckptflow/ranks"})

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()


def test_a_lock_timeout_names_each_rank_and_what_it_was_doing_and_resumes_the_engine(tmp_path, monkeypatch):
    from ckptflow.errors import CudaCheckpointError
    from ckptflow.models import ProcessFinder, Workload
    from ckptflow.runners import node as node_mod
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.cuda import CudaRunner
    from ckptflow.store.local import LocalStore

    class TimesOut:  # the driver, as it answered on two H200s for a rank spinning in NCCL
        name = "driver"

        def get_state(self, pid):
            return 0, 0  # RUNNING

        def lock(self, pid, timeout_ms):
            return 600 if pid == 11 else 0

        def unlock(self, pid):
            return 0

        def restore(self, pid, pairs):
            return 0

        def error_name(self, code):
            return {600: "CUDA_ERROR_NOT_READY"}.get(code, str(code))

    eng = _TpEngine()
    w = Workload(name="tp", node="n", find=ProcessFinder(pid_file=str(tmp_path / "tp.pid")), gpu=True,
                 tensor_parallel=2, prepare_url=f"{eng.url}/v1/ckptflow/prepare",
                 resume_url=f"{eng.url}/v1/ckptflow/resume")
    import ckptflow.runners.cuda as cuda_mod

    monkeypatch.setattr(cuda_mod, "cuda_pids", lambda root: [10, 11])
    monkeypatch.setattr(cuda_mod, "process_gpu_usage", lambda pids: {p: {f"GPU-{p}": 2**30} for p in pids})
    monkeypatch.setattr(node_mod, "tp_unsupported", lambda w, pids: None)
    node = NodeRunner(LocalStore(tmp_path / "store"), cuda=CudaRunner(backend=TimesOut()))

    class Proc:
        pid = 10

    with pytest.raises(CudaCheckpointError) as e:
        node._dump_gpu(w, Proc(), tmp_path / "img", leave_running=True)
    msg = str(e.value)
    assert "PID 11: CUDA_ERROR_NOT_READY" in msg
    assert "rank 1 (PID 11): running ALLREDUCE for 12.0 s" in msg
    assert eng.calls == ["/v1/ckptflow/prepare", "/v1/ckptflow/ranks", "/v1/ckptflow/resume"]
