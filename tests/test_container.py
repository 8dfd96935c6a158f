"""Container workloads with real containers: podman + runc + CRIU, the demo worker inside an image
built from this machine's own files (ckptflow.runners.rootfs). Each test compares the restored
worker's sessions and next tokens with an uninterrupted reference worker (a host process of the
same model and seed)."""

import json
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import free_port, write_fleet
from squat import squat as _squat
from ckptflow.container_models import ContainerSpec, PortMap
from ckptflow.models import Workload

pytestmark = [pytest.mark.criu, pytest.mark.slow]

CPORT = 8000  # the worker's port inside every container


@pytest.fixture(scope="session")
def demo_image():
    """The demo worker's image, built from local files and imported when missing (setup.sh
    builds it too). Fails, not skips, when podman is missing: scripts/setup.sh installs it."""
    from ckptflow.runners.rootfs import demo_image as build

    return build()


def _podman(*args, check=False):
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=120, check=check)


def _names(prefix: str) -> set[str]:
    out = _podman("ps", "-a", "--format", "{{.Names}}").stdout.split()
    return {n for n in out if n.startswith(prefix)}


def _numeric_env() -> dict[str, str]:
    """The BLAS settings the reference worker (a host process) runs with, for the container too:
    it inherits this process's environment, the container does not. On an AVX-512 machine whose
    environment sets OPENBLAS_CORETYPE=Haswell, the container picked OpenBLAS's SkylakeX kernels
    and the host's Haswell: the same tokens, other float bits, and every session digest differed
    before any checkpoint."""
    from ckptflow.demo import launch

    blas = {k: v for k, v in os.environ.items() if k.startswith(("OPENBLAS_", "OMP_", "MKL_", "GOTO_"))}
    return blas | launch._WORKER_ENV


class DemoContainer:
    """The demo worker in a container, started through the runner's own cold start."""

    def __init__(self, image: str, tmp_path: Path, name: str, port: int | None = None):
        from ckptflow.demo import launch

        self.port = port or free_port()
        self.cname = f"ckt-{name}-{secrets.token_hex(3)}"
        base = launch.demo_workload(name, self.port, tmp_path / f"{name}.pid")
        spec = ContainerSpec(name=self.cname, image=image, ports=[PortMap(host=self.port, container=CPORT)],
                             command=["python3", "-m", "ckptflow.demo.worker", "--host", "0.0.0.0",
                                      "--port", str(CPORT)],
                             env=_numeric_env())
        data = base.model_dump(exclude={"find", "start_command", "container"})
        self.workload = Workload(**data, container=spec)

    def start(self, store_root: Path):
        from ckptflow.runners.node import NodeRunner
        from ckptflow.store.local import LocalStore

        with NodeRunner(LocalStore(store_root)) as node:
            node.runtime_for(self.workload).cold_start(self.workload, timeout_s=60)
        return self

    def complete(self, prompt, n, sid=None):
        from ckptflow.demo import launch

        return launch.complete(self.port, prompt, n, sid)

    def digests(self):
        from ckptflow.demo import launch

        return launch.session_digests(self.port)

    def health(self):
        from ckptflow.demo import launch

        return launch.http_json(f"http://127.0.0.1:{self.port}/health")

    def state(self):
        from ckptflow.runners.container import Podman

        return Podman(self.workload.container).inspect(self.cname)

    def kill(self):
        _podman("kill", "--signal", "KILL", self.cname)
        # podman marks it exited once conmon saw the death
        deadline = time.time() + 30
        while time.time() < deadline and (self.state() and self.state().running):
            time.sleep(0.1)

    def remove(self):
        _podman("rm", "--force", "--time", "0", self.cname)
        for n in _names(f"{self.cname}-verify-"):
            _podman("rm", "--force", "--time", "0", n)


@pytest.fixture
def container(tmp_path, demo_image):
    made = []

    def start(name="chat", port=None, store_root=None):
        c = DemoContainer(demo_image, tmp_path, name, port).start(store_root or tmp_path / "store")
        made.append(c)
        return c

    yield start
    for c in made:
        c.remove()


def _fleet(tmp_path, workloads, store=None):
    return str(write_fleet(tmp_path / "fleet.yaml", workloads, store or tmp_path / "store"))


def _turn(workers, prompt, n, sid="s"):
    outs = [w.complete(prompt, n, sid) for w in workers]
    assert all(o == outs[0] for o in outs), "the container and the reference diverged before any restore"
    return outs[0]


def test_kill_then_recover_continues_the_long_session_exactly(tmp_path, prefect_harness, container, demo_worker):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover
    from ckptflow.store.local import LocalStore

    c, ref = container("chat"), demo_worker("ref")
    fleet = _fleet(tmp_path, [c.workload])
    _turn([c, ref], "a long agent session, turn one " * 20, 24)
    first = heartbeat(fleet, force=True)[0]
    _turn([c, ref], "turn two adds more context " * 15, 24)
    second = heartbeat(fleet, force=True)[0]
    assert first["ok"] and second["ok"] and first["checkpoint"] != second["checkpoint"]
    m = LocalStore(tmp_path / "store").get("chat", second["checkpoint"])
    assert [f.path for f in m.files] == ["container.json", "container.tar"]
    assert m.fingerprint.container_runtime.startswith("podman ") and m.fingerprint.oci_runtime.startswith("runc ")
    assert m.probe.container.name == c.cname
    # Work after the last checkpoint is lost with the container; the reference never saw it.
    c.complete("lost with the crash", 8, "s")
    old_pid = c.state().pid
    c.kill()
    assert not c.state().running
    res = recover(fleet, "chat")
    assert res["checkpoint"] == second["checkpoint"] and not res["cold_start"]
    st = c.state()
    assert st.running and st.pid != old_pid and st.name == c.cname
    assert c.digests() == ref.digests()
    assert c.complete("and the session goes on", 32, "s") == ref.complete("and the session goes on", 32, "s")
    # The heartbeat finds the restored container again and checkpoints it.
    assert heartbeat(fleet, force=True)[0]["ok"]


def test_recover_where_the_originals_pids_are_taken(tmp_path, container, demo_worker):
    from ckptflow.runners import process
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    c, ref = container("chat"), demo_worker("ref")
    _turn([c, ref], "a session whose PIDs will be taken " * 20, 16)
    with NodeRunner(LocalStore(tmp_path / "store")) as node:
        m = node.checkpoint(c.workload)
        host_pids = process.tree(c.state().pid)
        assert m.pid == host_pids[0] and c.health()["pid"] == 1  # PID 1 in its own namespace
        c.kill()
        deadline = time.time() + 20
        while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in host_pids):
            time.sleep(0.05)
        squatters = [s for s in (_squat(p) for p in host_pids) if s is not None]
        try:
            assert squatters and squatters[0].pid == host_pids[0], "could not take the original's init PID"
            res = node.restore(c.workload)
            assert all(s.poll() is None for s in squatters)  # still holding every PID they took
            assert res.pid not in {s.pid for s in squatters}
            assert c.health()["pid"] == 1  # the same PID inside as before the crash
            assert c.digests() == ref.digests()
            assert c.complete("next", 24, "s") == ref.complete("next", 24, "s")
        finally:
            for s in squatters:
                s.kill()
                s.wait()


def test_verify_restores_a_copy_beside_the_running_original(tmp_path, prefect_harness, container):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.verify import verify
    from ckptflow.models import CheckpointState
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.verify import verify_checkpoint
    from ckptflow.store.local import LocalStore

    c = container("chat")
    fleet = _fleet(tmp_path, [c.workload])
    c.complete("a session to verify " * 20, 16, "s1")
    ckpt = heartbeat(fleet, force=True)[0]["checkpoint"]
    before, digests = c.state(), c.digests()
    rows = verify(fleet)
    assert rows[0]["state"] == "verified", rows
    assert rows[0]["reason"] == "golden digest and 1 session digest(s) equal"
    store = LocalStore(tmp_path / "store")
    assert store.get("chat", ckpt).state == CheckpointState.verified
    # The copy had its own PID and network namespaces and another host port, beside the original.
    seen = {}

    def look(copy):
        seen["copy"] = copy
        seen["ns"] = {k: os.readlink(f"/proc/{copy.pid}/ns/{k}") for k in ("pid", "net")}
        seen["orig_alive"] = c.health()["status"] == "ok"

    with NodeRunner(store) as node:
        m = store.get("chat", ckpt)
        res = verify_checkpoint(node, c.workload, m, inspect_copy=look)
    assert res.state.value == "verified", res.reason
    orig_ns = {k: os.readlink(f"/proc/{before.pid}/ns/{k}") for k in ("pid", "net")}
    host_ns = {k: os.readlink(f"/proc/self/ns/{k}") for k in ("pid", "net")}
    assert seen["orig_alive"]
    assert seen["copy"].name.startswith(f"{c.cname}-verify-") and seen["copy"].running
    assert [p.host for p in seen["copy"].ports] != [c.port]
    for k in ("pid", "net"):
        assert seen["ns"][k] != orig_ns[k] and seen["ns"][k] != host_ns[k]
    # The original is untouched and no copy is left.
    after = c.state()
    assert (after.id, after.pid, after.running) == (before.id, before.pid, True)
    assert c.digests() == digests
    assert _names(f"{c.cname}-verify-") == set()


def test_migrate_through_s3_to_a_second_node(tmp_path, prefect_harness, container, demo_worker, s3):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.migrate import migrate
    from ckptflow.tasks.common import open_fleet

    c, ref = container("chat", store_root=tmp_path / "store" / "node-a"), demo_worker("ref")
    f = write_fleet(tmp_path / "fleet.yaml", [c.workload], tmp_path / "store" / "{node}")
    data = yaml.safe_load(f.read_text())
    data["nodes"] = [{"name": "node-a", "work_pool": "node-a"}, {"name": "node-b", "work_pool": "node-b"}]
    data["workloads"][0]["node"] = "node-a"
    data["storage"].update(kind="s3", bucket=s3.bucket("ckpt-containers"), endpoint_url=s3.endpoint)
    f.write_text(yaml.safe_dump(data))
    fleet = str(f)
    _turn([c, ref], "an agent session that moves to node-b " * 25, 24)
    old = c.state()
    res = migrate(fleet, "chat", "node-b", via_deployments=False)
    assert res["source"] == "node-a" and res["target"] == "node-b"
    assert res["out"]["uploaded_bytes"] > 0 and res["in"]["downloaded_bytes"] == res["out"]["bytes"]
    # node-b restored it from the bucket into its own store: the checkpoint is there now.
    assert (tmp_path / "store" / "node-b" / "chat" / res["checkpoint"] / "manifest.json").exists()
    new = c.state()
    assert new.running and new.id != old.id and new.pid == res["pid"]
    assert c.digests() == ref.digests()
    assert c.complete("continue on node-b", 32, "s") == ref.complete("continue on node-b", 32, "s")
    assert open_fleet(fleet).workload("chat").node == "node-b"
    rows = heartbeat(fleet, node="node-b", force=True)
    assert [(r["workload"], r["node"], r["ok"]) for r in rows] == [("chat", "node-b", True)]


def test_unknown_container_is_one_line_and_touches_nothing(tmp_path, container):
    from ckptflow.errors import WorkloadNotFound
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    c = container("chat")
    before, digests = c.state(), c.digests()
    ghost = c.workload.model_copy(update={
        "name": "ghost", "container": c.workload.container.model_copy(update={"name": "ckt-no-such-container"})})
    with NodeRunner(LocalStore(tmp_path / "store")) as node:
        with pytest.raises(WorkloadNotFound) as e:
            node.checkpoint(ghost)
    assert e.value.message == ("workload ghost: container 'ckt-no-such-container' not found in podman on this node")
    assert "podman ps -a" in e.value.fix and "container.name" in e.value.fix
    ghost_dir = tmp_path / "store" / "ghost"  # at most the workload's lock file: no checkpoint, no bytes
    assert [p.name for p in ghost_dir.iterdir() if not p.name.startswith(".")] == []
    after = c.state()
    assert (after.id, after.pid, after.running) == (before.id, before.pid, True) and c.digests() == digests


def test_port_clash_on_restore_is_refused_and_leaves_the_running_one_untouched(tmp_path, container):
    from ckptflow.errors import RestoreFailed
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    b = container("chat")
    b.complete("a session of b " * 10, 8, "s")
    with NodeRunner(LocalStore(tmp_path / "store")) as node:
        node.checkpoint(b.workload)
        b.kill()
        b.remove()
        a = container("other", port=b.port)  # another worker took b's host port meanwhile
        a.complete("a session of a " * 10, 8, "s")
        before, digests = a.state(), a.digests()
        with pytest.raises(RestoreFailed) as e:
            node.restore(b.workload)
    assert e.value.message == (f"workload chat: host port 127.0.0.1:{b.port} (container port {CPORT}) is taken on "
                               f"node local; refusing to restore container {b.cname!r} onto it")
    assert "container.ports" in e.value.fix
    after = a.state()
    assert (after.id, after.pid, after.running) == (before.id, before.pid, True)
    assert a.digests() == digests and a.complete("still serving", 8, "s")
    assert _names(b.cname) == set()  # no half-created container left behind


def test_runtime_version_change_is_refused_before_the_runtime_runs(tmp_path, container):
    from ckptflow.errors import IncompatibleCheckpoint
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    c = container("chat")
    store = LocalStore(tmp_path / "store")
    with NodeRunner(store) as node:
        m = node.checkpoint(c.workload)
        fp = m.fingerprint.model_copy(update={"container_runtime": "podman 3.0.0"})
        m = m.model_copy(update={"fingerprint": fp})
        (store.root / "chat" / m.id / "manifest.json").write_text(m.model_dump_json())
        c.kill()
        with pytest.raises(IncompatibleCheckpoint) as e:
            node.restore(c.workload)
    assert "container_runtime: 'podman 3.0.0' -> 'podman " in e.value.message
    assert _names(c.cname) == set()  # the dead container was cleared; nothing was restored


def _s3_fleet(tmp_path, s3, workloads, bucket):
    f = write_fleet(tmp_path / "fleet.yaml", workloads, tmp_path / "store" / "{node}")
    data = yaml.safe_load(f.read_text())
    data["nodes"] = [{"name": "node-a", "work_pool": "node-a"}, {"name": "node-b", "work_pool": "node-b"}]
    for w in data["workloads"]:
        w["node"] = "node-a"
    data["storage"].update(kind="s3", bucket=s3.bucket(bucket), endpoint_url=s3.endpoint)
    f.write_text(yaml.safe_dump(data))
    return str(f)


def test_recover_on_another_node_from_the_bucket_after_the_node_is_lost(tmp_path, prefect_harness, container,
                                                                     demo_worker, s3):
    import shutil

    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    c, ref = container("chat", store_root=tmp_path / "store" / "node-a"), demo_worker("ref")
    fleet = _s3_fleet(tmp_path, s3, [c.workload], "ckpt-ctr-recover")
    _turn([c, ref], "a session that outlives its node " * 20, 24)
    row = heartbeat(fleet, force=True)[0]
    assert row["ok"] and row["uploaded_bytes"] > 0
    c.kill()
    shutil.rmtree(tmp_path / "store" / "node-a")  # the node and its disk are gone: only the bucket has it
    res = recover(fleet, "chat", node="node-b")
    assert res["node"] == "node-b" and res["checkpoint"] == row["checkpoint"] and res["downloaded_bytes"] > 0
    assert c.state().running
    assert c.digests() == ref.digests()
    assert c.complete("on node-b now", 32, "s") == ref.complete("on node-b now", 32, "s")


def test_recover_without_a_checkpoint_cold_starts_from_the_declared_rootfs(tmp_path, prefect_harness, demo_image,
                                                                         slack):
    """No checkpoint and the image missing on the node: recover imports the declared rootfs as the
    image and starts the container from it (what a new node with no registry gets)."""
    from ckptflow.flows.recover import recover
    from ckptflow.runners.rootfs import DEMO_PACKAGES, build_rootfs, image_exists

    tag = f"localhost/ckptflow-demo-cold:t{secrets.token_hex(3)}"
    tar = build_rootfs(tmp_path / "rootfs.tar", packages=DEMO_PACKAGES)
    c = DemoContainer(tag, tmp_path, "fresh")
    c.workload = c.workload.model_copy(update={"container": c.workload.container.model_copy(
        update={"rootfs": str(tar)})})
    fleet = str(write_fleet(tmp_path / "fleet.yaml", [c.workload], tmp_path / "store", slack=True))
    try:
        assert not image_exists("podman", tag)
        res = recover(fleet, "fresh")
        assert res["cold_start"] is True and res["cold_start_s"] > 0
        assert image_exists("podman", tag) and c.state().running and c.health()["pid"] == 1
        assert len(c.complete("hello", 8, "s")) == 8  # serving
        assert len(slack.requests) == 1  # the restore-failed alert says it was cold started
        assert "cold start" in json.dumps(slack.requests[0]["body"])
    finally:
        c.remove()
        _podman("rmi", tag)


def test_invalidate_retires_container_checkpoints_when_the_runtime_changes(tmp_path, prefect_harness, container,
                                                                           demo_worker):
    """A podman (or runc) upgrade retires the container workloads' checkpoints, and only theirs: a
    process workload's checkpoint does not depend on the container runtime."""
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.invalidate import invalidate
    from ckptflow.models import CheckpointState
    from ckptflow.store.local import LocalStore

    c, p = container("chat"), demo_worker("proc")
    fleet = _fleet(tmp_path, [c.workload, p.workload])
    rows = {r["workload"]: r["checkpoint"] for r in heartbeat(fleet, force=True)}
    store = LocalStore(tmp_path / "store")
    for name, ckpt in rows.items():  # as if both were taken before this node's podman was upgraded
        m = store.get(name, ckpt)
        fp = m.fingerprint.model_copy(update={"container_runtime": "podman 3.0.0"})
        (store.root / name / ckpt / "manifest.json").write_text(m.model_copy(update={"fingerprint": fp}).model_dump_json())
    out = invalidate(fleet)
    assert [(r["workload"], r["checkpoint"]) for r in out["invalidated"]] == [("chat", rows["chat"])]
    m = store.get("chat", rows["chat"])
    assert m.state == CheckpointState.invalidated and "container_runtime: 'podman 3.0.0' -> 'podman " in m.state_reason
    assert store.get("proc", rows["proc"]).state == CheckpointState.complete


def test_drain_stops_a_short_request_container_through_its_runtime(tmp_path, container):
    """A short-request container is stopped by drain with `podman stop`, not by a signal to a PID."""
    from ckptflow.models import TrafficClass
    from ckptflow.tasks.move import stop_workload

    c = container("api")
    c.workload = c.workload.model_copy(update={"traffic": TrafficClass.short_requests})
    pid = c.state().pid
    out = stop_workload.fn(c.workload, grace_s=10)
    assert out == {"stopped": True, "pid": pid, "container": c.cname}
    st = c.state()
    assert st is not None and not st.running  # stopped, kept (podman rm is the operator's call)
    assert stop_workload.fn(c.workload) == {"stopped": False, "reason": "not running"}


def test_restore_refused_when_the_node_lacks_the_memory_for_the_image(tmp_path, container, monkeypatch):
    """The memory gate: a restore that needs more than the node has available is refused before
    podman runs, and the checkpoint stays restorable."""
    import psutil

    from ckptflow.errors import RestoreFailed
    from ckptflow.models import CheckpointState
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    c = container("chat")
    store = LocalStore(tmp_path / "store")
    with NodeRunner(store) as node:
        m = node.checkpoint(c.workload)
        c.kill()
        real = psutil.virtual_memory()
        monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=m.bytes // 2))
        with pytest.raises(RestoreFailed) as e:
            node.restore(c.workload)
        assert e.value.message.startswith(f"workload chat: checkpoint {m.id} needs ")
        assert "GiB available" in e.value.message and "--node" in e.value.fix
        assert _names(c.cname) == set() and store.get("chat", m.id).state == CheckpointState.complete
        monkeypatch.undo()
        assert node.restore(c.workload).manifest.id == m.id and c.state().running


def test_a_container_declared_with_established_tcp_recovers(tmp_path, container, demo_worker):
    """`tcp_established: true` (engines that keep connections open) on a container: podman 4.3
    refuses `restore --tcp-established` together with `--name`, so an in-place restore lets the
    exported name stand."""
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    c, ref = container("chat"), demo_worker("ref")
    c.workload = c.workload.model_copy(update={"tcp_established": True})
    _turn([c, ref], "a session over a kept connection " * 20, 16)
    with NodeRunner(LocalStore(tmp_path / "store")) as node:
        node.checkpoint(c.workload)
        c.kill()
        node.restore(c.workload)
        st = c.state()
        assert st.running and st.name == c.cname
        assert c.digests() == ref.digests()
        assert c.complete("next", 24, "s") == ref.complete("next", 24, "s")


def test_declared_shm_size_and_annotations_reach_the_container(tmp_path, demo_image):
    c = DemoContainer(demo_image, tmp_path, "shm")
    c.workload.container.shm_size = "96m"
    c.workload.container.annotations = {"io.ckptflow.test": "yes"}
    try:
        c.start(tmp_path / "store")
        info = json.loads(_podman("inspect", c.cname, check=True).stdout)[0]
        assert info["HostConfig"]["ShmSize"] == 96 * 2**20
        assert info["Config"]["Annotations"]["io.ckptflow.test"] == "yes"
    finally:
        c.remove()
