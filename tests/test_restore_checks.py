"""The checks every restore path shares, each written once: the session-digest comparison
(runners/digests.py), the per-GPU memory gate (runners.gpu.gate_memory) and the refusal to
restore over a running worker (NodeRunner.refuse_if_running), as each caller uses them."""

import os
import signal
import subprocess
import sys

import pytest

from ckptflow.errors import CheckpointNotFound, NotEnoughGpuMemory, RestoreFailed, WorkloadRunning
from ckptflow.models import EngineProbe, Fingerprint, Manifest, ManifestProbe, ProcessFinder, VerifyOutcome, Workload
from ckptflow.poll import poll
from ckptflow.runners import process
from ckptflow.runners.digests import SessionMatch, compare_sessions
from ckptflow.runners.gpu import GpuBackend, NoGpu, gate_memory
from ckptflow.runners.node import NodeRunner
from ckptflow.store.local import LocalStore

GIB = 2**30
ID = "20261130T120000Z-0a0b0c0d"
RECORDED = {"a": "1" * 64, "b": "2" * 64, "c": "3" * 64}


# --- one digest comparison ---------------------------------------------------------------------
def test_the_comparison_names_each_session_that_differs_is_missing_or_new():
    got = {"a": "1" * 64, "b": "9" * 64, "d": "4" * 64}                  # b changed, c lost, d new
    c = compare_sessions(EngineProbe(sessions=RECORDED), EngineProbe(sessions=got))
    assert (c.outcome, c.differing, c.named()) == (SessionMatch.differ, ("b", "c", "d"), "b, c, d")
    same = compare_sessions(EngineProbe(sessions=RECORDED), EngineProbe(sessions=dict(RECORDED)))
    assert same.equal and same.compared == 3 and same.differing == ()


@pytest.mark.parametrize("recorded, got, outcome, why", [
    (EngineProbe(error="probe failed: HTTP 500"), EngineProbe(sessions={"a": "x"}), SessionMatch.unverifiable,
     "probe failed: HTTP 500"),                                                  # the checkpoint's probe failed
    (EngineProbe(), EngineProbe(sessions={"a": "x"}), SessionMatch.unverifiable,
     "the checkpoint recorded no session digests"),
    (EngineProbe(sessions=RECORDED), EngineProbe(), SessionMatch.unverifiable,
     "the sandbox copy's probe returned no sessions"),
    (EngineProbe(sessions=RECORDED), EngineProbe(error="probe failed: HTTP 503"), SessionMatch.differ,
     "probe failed: HTTP 503"),                                                  # the copy's probe failed: every session
])
def test_the_comparison_says_why_it_could_not_compare(recorded, got, outcome, why):
    c = compare_sessions(recorded, got)
    assert c.outcome is outcome and c.why == why
    if outcome is SessionMatch.differ:
        assert c.differing == tuple(sorted(RECORDED))


def _workload(**kw) -> Workload:
    return Workload(name="w", node="n", find=ProcessFinder(pid_file="/nonexistent/w.pid"), **kw)


def test_a_restore_in_place_and_a_sandbox_copy_name_the_same_differing_session(tmp_path, monkeypatch):
    from ckptflow.runners import engine
    from ckptflow.runners.template_sessions import _check_sessions
    from ckptflow.runners.verify import compare

    w = _workload(probe_url="http://127.0.0.1:9/digests")
    m = Manifest(id=ID, workload="w", node="n", probe=ManifestProbe(sessions=RECORDED))
    restored = EngineProbe(sessions={**RECORDED, "b": "9" * 64})
    monkeypatch.setattr(engine, "probe", lambda w: restored)
    with pytest.raises(RestoreFailed, match=r"restored from .* but sessions differ from the checkpoint: b\n"):
        NodeRunner(LocalStore(tmp_path / "s"), criu=object())._check_state(w, m)
    res = compare(w, m, restored, {})
    assert res.state is VerifyOutcome.verify_failed and res.reason == "session state differs from the checkpoint: b"
    recs = {k: {"digest": v} for k, v in RECORDED.items()}
    with pytest.raises(RestoreFailed, match=r"sessions differ from their export: b\n"):
        _check_sessions(w, recs, {**RECORDED, "b": "9" * 64, "extra": "0"}, "restored")   # extra: not its business
    _check_sessions(w, recs, {**RECORDED, "extra": "0"}, "restored")


# --- one memory gate, per GPU -----------------------------------------------------------------
def test_a_rank_whose_own_gpu_lacks_room_is_refused_though_the_sum_fits_on_another():
    need = {"GPU-a": 20 * GIB, "GPU-b": 20 * GIB}                       # TP-2: one rank on each
    free = {"GPU-a": 10 * GIB, "GPU-b": 100 * GIB}                      # 40 GiB would fit on GPU-b
    with pytest.raises(NotEnoughGpuMemory) as e:
        gate_memory(need, 40 * GIB, lambda: free)
    assert "GPU-a: 10.0 GiB free < 21.0 GiB needed" in str(e.value) and "GPU-b" not in str(e.value)
    gate_memory(need, 40 * GIB, lambda: {"GPU-a": 22 * GIB, "GPU-b": 22 * GIB})   # each fits its own
    gate_memory({}, 0, lambda: pytest.fail("free memory read with nothing to fit"))


class Roomy(NoGpu):
    """A backend whose devices have the free memory given; the gates are GpuBackend's own."""

    name = "roomy"

    def __init__(self, free: dict[str, int]):
        self.free = free

    def free_by_device(self) -> dict[str, int]:
        return self.free

    gate_restore = GpuBackend.gate_restore


def test_the_node_gates_each_rank_against_its_target_gpu(tmp_path):
    m = Manifest(id=ID, workload="w", node="n", gpu_footprint_bytes=40 * GIB,
                 gpu_footprints={"GPU-a": 20 * GIB, "GPU-b": 20 * GIB}, fingerprint=Fingerprint(gpu_uuids=["GPU-a", "GPU-b"]))
    w = _workload(gpu=True, tensor_parallel=2)
    node = NodeRunner(LocalStore(tmp_path / "s"), criu=object(), gpu=Roomy({"GPU-a": 10 * GIB, "GPU-b": 100 * GIB}),
                      node_fp=Fingerprint(gpu_uuids=["GPU-a", "GPU-b"]))
    with pytest.raises(NotEnoughGpuMemory, match="GPU-a: 10.0 GiB free"):
        node.gate_gpu_memory(w, m)
    swapped = NodeRunner(LocalStore(tmp_path / "s"), criu=object(), gpu=Roomy({"GPU-a": 30 * GIB, "GPU-b": 30 * GIB}),
                         node_fp=Fingerprint(gpu_uuids=["GPU-a", "GPU-b"]))
    swapped.gate_gpu_memory(w, m)


# --- one refusal to restore over a running worker ------------------------------------------------
@pytest.fixture
def sleeper(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # ckptflow-sleeper"])
    pid_file = tmp_path / "w.pid"
    pid_file.write_text(str(proc.pid))
    yield proc, Workload(name="w", node="n", find=ProcessFinder(pid_file=str(pid_file),
                                                                cmdline_must_contain="ckptflow-sleeper"),
                         checkpoint="template-sessions")
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.mark.parametrize("mode", ["process", "template-sessions"])
def test_both_restores_refuse_a_running_worker_the_same_way(tmp_path, sleeper, mode):
    from ckptflow.runners.template_sessions import TemplateSessionsRunner

    proc, w = sleeper
    with NodeRunner(LocalStore(tmp_path / "s")) as node:
        restore = node.restore if mode == "process" else TemplateSessionsRunner(node).restore
        with pytest.raises(WorkloadRunning, match=f"running \\(PID {proc.pid}\\); refusing to restore over it") as e:
            restore(w)
    assert "verify" in e.value.fix and proc.poll() is None                       # untouched


def test_a_two_tier_restore_clears_a_worker_an_interrupted_restore_left_stopped(tmp_path, sleeper, caplog):
    """The soak's fix, which the two-tier copy of the check lacked: a stopped worker under the
    workload lock is what an interrupted restore left; it is killed, not taken for a live one."""
    from ckptflow.runners.template_sessions import TemplateSessionsRunner

    proc, w = sleeper
    os.kill(proc.pid, signal.SIGSTOP)
    poll(lambda: process.pid_stopped(proc.pid), 5, 0.01, what="state T")
    with NodeRunner(LocalStore(tmp_path / "s")) as node:
        with pytest.raises(CheckpointNotFound, match="no session checkpoint"):   # got past the check
            TemplateSessionsRunner(node).restore(w)
    assert f"PID {proc.pid} is stopped, left by an interrupted restore; killing it" in caplog.text
    assert not process.pid_alive(proc.pid)                                       # killed and reaped


# --- a restore is done when the worker has served real work ----------------------------------------
@pytest.mark.parametrize("broken", [True, False])
def test_a_restored_worker_that_dies_on_its_first_request_is_a_failed_restore(tmp_path, broken):
    """Issue #36, finding 1: a restored vLLM answered /health and died on its first completion,
    and ckptflow said "recovered". The golden request runs after /health; a worker that cannot
    serve it fails the restore and is stopped. A worker that serves it passes (both ways)."""
    from conftest import free_port
    from ckptflow.models import CheckpointState, GoldenRequest
    from ckptflow.runners.engine import http

    port, pid_file, flag = free_port(), tmp_path / "b.pid", tmp_path / "broken"
    log = open(tmp_path / "b.log", "w")
    subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "helpers", "brittle_engine.py"),
                      str(port), str(pid_file), str(flag)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                     start_new_session=True)
    poll(lambda: pid_file.exists(), 10, 0.02, what="the engine's pid file")
    url = f"http://127.0.0.1:{port}"
    poll(lambda: http().get(url + "/health", timeout=1).status_code == 200, 10, 0.05, what="health")
    w = Workload(name="b", node="n", find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="brittle_engine"),
                 health_url=url + "/health",
                 golden=GoldenRequest(url=url + "/v1/completions", body={"prompt": [1]}, field="choices.0.tokens"))
    with NodeRunner(LocalStore(tmp_path / "s")) as node:
        m = node.checkpoint(w, leave_running=False)
        node.criu.wait_pid_free(m.pid)
        if broken:
            flag.touch()                              # what the restored process will hit: its model dies
            for n in (1, 2, 3):
                with pytest.raises(RestoreFailed) as e:
                    node.restore(w)
                msg = e.value.message
                assert msg.startswith(f"workload b: restored from {m.id} and healthy, but it could not serve its "
                                      "golden request (") and msg.endswith("); the restored worker was stopped"), msg
                assert "cold start" in e.value.fix
                poll(lambda: not process.pid_alive(m.pid), 10, 0.05, what="the broken worker gone")
                node.criu.wait_pid_free(m.pid)
                now = node.store.get("b", m.id)
                assert len(now.probe.restores.failures) == n and now.probe.restores.seconds == []
            # Finding 10: not tried a fourth time: marked, with why, and recover says none is left.
            assert now.state == CheckpointState.verify_failed and now.state_reason.startswith(
                "3 restores from it failed (the last: workload b: restored from")
            with pytest.raises(CheckpointNotFound):
                node.restore(w)
        else:
            r = node.restore(w, manifest=m)
            assert r.pid == m.pid and "golden" in r.timings
            assert http().post(url + "/v1/completions", json={}).json()["choices"][0]["tokens"] == [1, 2, 3]
            os.kill(r.pid, signal.SIGKILL)
