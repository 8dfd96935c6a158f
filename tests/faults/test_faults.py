"""Named faults with real processes, real CRIU, the real S3 server and a real Prefect server.

The promise under any single fault: no data lost, no checkpoint listed valid without its
bytes, the worker left running or cleanly restorable, one alert, nothing retried forever.
Other faults of the suite live beside the code they hit (marked ``fault`` there):
test_store (kill mid-write), test_criu (full disk, undeclared PID), test_s3 (corrupt chunk),
test_flows (worker gone), test_cuda_runner (lock timeout, GPU memory), test_invalidate
(version mismatch), test_fleet (malformed fleet files), test_verify (Slack errors).
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptflow.errors import PidBusy, WorkloadBusy
from ckptflow.models import Action, CheckpointState
from ckptflow.policies.cadence import WorkloadFacts, decide
from ckptflow.store.local import LocalStore

pytestmark = pytest.mark.fault

_CHECKPOINT_IN_CHILD = r"""
import json, sys
from pathlib import Path
from ckptflow.models import Workload
from ckptflow.runners.node import NodeRunner
from ckptflow.store.local import LocalStore
w = Workload.model_validate_json(sys.argv[2])
NodeRunner(LocalStore(sys.argv[1])).checkpoint(w, leave_running=True)
"""


def _pgrep(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.criu
def test_fault_runner_killed_during_criu_dump(tmp_path, demo_worker):
    """SIGKILL of the runner mid-dump: no manifest, the worker keeps serving, bytes are an orphan."""
    w = demo_worker("victim", ballast_mib=1024)
    w.complete("state to keep " * 20, 8, "s")
    digests = w.digests()
    store = LocalStore(tmp_path / "store")
    child = subprocess.Popen([sys.executable, "-c", _CHECKPOINT_IN_CHILD, str(store.root),
                              w.workload.model_dump_json()])
    deadline = time.time() + 30
    while not _pgrep(f"criu dump -t {w.pid}"):
        assert time.time() < deadline and child.poll() is None, "the dump never started"
        time.sleep(0.005)
    child.kill()
    child.wait()
    deadline = time.time() + 60  # CRIU, orphaned, finishes and unfreezes the worker
    while _pgrep(f"criu dump -t {w.pid}"):
        assert time.time() < deadline
        time.sleep(0.1)
    assert store.list("victim") == []                          # nothing listed valid
    assert w.proc.poll() is None and w.digests() == digests    # worker intact and serving
    from datetime import timedelta
    gone = store.apply_retention("victim", orphan_grace=timedelta(0))
    assert [why for _, why in gone] == ["orphan bytes without a manifest"]


def test_fault_two_heartbeats_race_on_one_workload(tmp_path):
    """The per-workload lock: the second one is refused, the first one finishes."""
    store = LocalStore(tmp_path / "store")
    got, errors = threading.Event(), []
    with store.lock("w"):
        def second():
            try:
                with store.lock("w"):
                    got.set()
            except WorkloadBusy as e:
                errors.append(e)
        t = threading.Thread(target=second)
        t.start()
        t.join()
    assert not got.is_set() and "another checkpoint or restore is running" in str(errors[0])
    with store.lock("w"):  # released when the holder is done
        pass


@pytest.mark.criu
def test_fault_two_heartbeat_processes_race(tmp_path, demo_worker):
    """Two runner processes checkpoint the same worker at once: exactly one manifest."""
    w = demo_worker("race", ballast_mib=512)
    store = LocalStore(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", _CHECKPOINT_IN_CHILD, str(store.root),
                               w.workload.model_dump_json()], stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 1]
    assert "WorkloadBusy" in next(err for rc, err in results if rc)
    assert len(store.list("race")) == 1 and w.proc.poll() is None


@pytest.mark.criu
def test_fault_pid_taken_at_restore(tmp_path, demo_worker):
    """Another process holds the PID the image needs: refused with PidBusy, checkpoint intact."""
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.criu import CriuRunner

    w = demo_worker("pid")
    store = LocalStore(tmp_path / "store")
    node = NodeRunner(store, criu=CriuRunner(pid_free_timeout_s=2))
    m = node.checkpoint(w.workload, leave_running=False)
    w.proc.wait()
    # Hand the freed PID to an unrelated process (ns_last_pid: the next fork gets PID+1).
    squatter = None
    for _ in range(50):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(m.pid - 1))
        p = subprocess.Popen(["sleep", "60"])
        if p.pid == m.pid:
            squatter = p
            break
        p.kill()
        p.wait()
    assert squatter is not None, "could not place a process on the PID"
    try:
        with pytest.raises(PidBusy, match=f"PID {m.pid} needed by the image is still in use"):
            node.restore(w.workload)
        assert store.get("pid", m.id).state == CheckpointState.complete   # still restorable
    finally:
        squatter.kill()
        squatter.wait()
    assert node.restore(w.workload).pid == m.pid


@pytest.mark.criu
def test_fault_runner_killed_during_upload(tmp_path, s3):
    """SIGKILL mid-push: the bucket lists no manifest; the local checkpoint stays valid; the next
    push completes and uploads only what is missing."""
    from ckptflow.store.s3 import CHUNK, S3Tier

    store = LocalStore(tmp_path / "store")
    p = store.begin("up", node="a")
    with open(p.images_dir / "pages-1.img", "wb") as f:
        f.write(os.urandom(64 * CHUNK))
    m = store.commit(p)
    code = (f"import os; os.environ.update(AWS_ACCESS_KEY_ID={s3.ACCESS!r}, AWS_SECRET_ACCESS_KEY={s3.SECRET!r});"
            f"from ckptflow.store.s3 import S3Tier; from ckptflow.store.local import LocalStore;"
            f"s=LocalStore({str(store.root)!r}); S3Tier({s3.bucket('ckpt-kill')!r}, endpoint_url={s3.endpoint!r}, threads=2)"
            f".push(s, s.get('up', {m.id!r}))")
    child = subprocess.Popen([sys.executable, "-c", code])
    tier = S3Tier("ckpt-kill", endpoint_url=s3.endpoint)
    deadline = time.time() + 60
    while s3.client.list_objects_v2(Bucket="ckpt-kill", Prefix="ckptflow/chunks/").get("KeyCount", 0) < 3:
        assert time.time() < deadline and child.poll() is None
        time.sleep(0.01)
    child.kill()
    child.wait()
    assert tier.ids("up") == []                       # no manifest without its bytes
    assert store.latest_valid("up").id == m.id
    again = tier.push(store, m)
    assert again["skipped_bytes"] >= 3 * CHUNK and tier.ids("up") == [m.id]


def test_fault_clock_jump_around_a_maintenance_window():
    """Time jumps forward past a window's lead, into it, and back: each tick decides from what
    it sees now, never checkpoints a short-request worker, and drains inside the window."""
    start, end = 1_000_000.0, 1_000_000.0 + 4 * 3600
    base = dict(name="w", traffic="long_sessions", footprint_gib=80, mtbf_s=6000 * 3600, live_tokens=4e6,
                growth_tokens_s=300, tokens_since_ckpt=4e6, seconds_since_ckpt=7200.0, maintenance=[(start, end)])
    seen = []
    for now in (start - 7200, start - 600, start + 60, start - 600, end + 1, start - 86400):
        seen.append(decide(WorkloadFacts(now=now, **base)).action)
        short = decide(WorkloadFacts(now=now, **{**base, "traffic": "short_requests"}))
        assert short.action in (Action.skip, Action.drain) and not short.due
    assert seen == [Action.skip, Action.checkpoint_now, Action.drain, Action.checkpoint_now, Action.skip,
                    Action.skip]


_RESTORE_IN_CHILD = r"""
import sys
from ckptflow.models import Workload
from ckptflow.runners.node import NodeRunner
from ckptflow.store.local import LocalStore
NodeRunner(LocalStore(sys.argv[1])).restore(Workload.model_validate_json(sys.argv[2]))
"""


@pytest.mark.criu
def test_fault_runner_killed_during_restore(tmp_path, demo_worker):
    """SIGKILL of the runner mid-restore: the checkpoint stays valid, whatever CRIU left (a
    stopped copy) is cleared by the next recover, which restores the session."""
    from ckptflow.runners.node import NodeRunner

    w = demo_worker("rk", ballast_mib=1024)
    w.complete("state before the crash " * 20, 8, "s")
    digests = w.digests()
    store = LocalStore(tmp_path / "store")
    m = NodeRunner(store).checkpoint(w.workload, leave_running=False)
    w.proc.wait()
    child = subprocess.Popen([sys.executable, "-c", _RESTORE_IN_CHILD, str(store.root), w.workload.model_dump_json()])
    deadline = time.time() + 30
    while not _pgrep("criu restore -d"):
        assert time.time() < deadline and child.poll() is None, "the restore never started"
        time.sleep(0.005)
    child.kill()
    child.wait()
    deadline = time.time() + 60
    while _pgrep("criu restore -d"):
        assert time.time() < deadline
        time.sleep(0.05)
    assert store.get("rk", m.id).state == CheckpointState.complete
    res = NodeRunner(store).restore(w.workload)
    assert res.pid == m.pid and w.digests() == digests


def test_fault_s3_unavailable_mid_upload(tmp_path, s3):
    """The S3 server stops answering mid-push: StorageUnavailable (retryable), no remote
    manifest, the local checkpoint valid; once it is back, the push completes."""
    from ckptflow.errors import StorageUnavailable
    from ckptflow.store.s3 import CHUNK, S3Tier

    store = LocalStore(tmp_path / "store")
    p = store.begin("s3down", node="a")
    (p.images_dir / "pages-1.img").write_bytes(os.urandom(48 * CHUNK))
    m = store.commit(p)
    tier = S3Tier(s3.bucket("ckpt-down"), endpoint_url=s3.endpoint, threads=2, timeout_s=2, attempts=1)
    errors = []

    def push():
        try:
            tier.push(store, m)
        except StorageUnavailable as e:
            errors.append(e)

    t = threading.Thread(target=push)
    t.start()
    deadline = time.time() + 60
    while s3.client.list_objects_v2(Bucket="ckpt-down", Prefix="ckptflow/chunks/").get("KeyCount", 0) < 2:
        assert time.time() < deadline
        time.sleep(0.01)
    os.killpg(s3.proc.pid, signal.SIGSTOP)            # the server hangs, as in a network partition
    try:
        t.join(timeout=120)
    finally:
        os.killpg(s3.proc.pid, signal.SIGCONT)
    assert not t.is_alive() and errors and errors[0].retryable
    assert S3Tier("ckpt-down", endpoint_url=s3.endpoint).list("s3down") == []
    assert store.latest_valid("s3down").id == m.id
    done = S3Tier("ckpt-down", endpoint_url=s3.endpoint).push(store, m)
    assert done["skipped_bytes"] >= 2 * CHUNK
    assert S3Tier("ckpt-down", endpoint_url=s3.endpoint).ids("s3down") == [m.id]
