"""Version changes invalidate exactly the checkpoints no eligible node can restore."""

import time

import pytest
import yaml

from ckptflow.errors import IncompatibleCheckpoint
from ckptflow.models import CheckpointState, Fingerprint, ProcessFinder, Workload
from ckptflow.runners.fingerprint import workload_fingerprint
from ckptflow.store.fleetstate import LocalFleetState
from ckptflow.store.local import LocalStore

BASE = Fingerprint(arch="x86_64", kernel="6.18.44", glibc="2.36", criu="4.2.1",
                   cpu_features=["amx_tile", "avx2", "avx512f"], python="3.12.3",
                   gpu_model="NVIDIA H200", gpu_count=8, driver="580.159.04", cuda_driver="13.0", ckptflow="0.1.0")
H100 = BASE.model_copy(update={"gpu_model": "NVIDIA H100"})


def _workloads():
    def w(name, node, engine, version, rev, gpu=True):
        return Workload(name=name, node=node, find=ProcessFinder(pid_file=f"/run/{name}.pid"), engine=engine,
                        engine_version=version, model_id="org/model", model_revision=rev, gpu=gpu)
    return [w("w1", "a1", "vllm", "0.11.0", "r1"), w("w2", "a2", "sglang", "0.5.0", "r1"),
            w("w3", "b1", "vllm", "0.11.0", "r1"), w("w4", "a1", "other", None, None, gpu=False)]


def _fleet(tmp_path, workloads):
    data = {"fleet": "t", "storage": {"kind": "local", "path": str(tmp_path / "store")},
            "nodes": [{"name": "a1", "work_pool": "a1", "gpu_class": "H200"},
                      {"name": "a2", "work_pool": "a2", "gpu_class": "H200"},
                      {"name": "b1", "work_pool": "b1", "gpu_class": "H100"}],
            "workloads": [w.model_dump(mode="json", exclude_none=True) for w in workloads]}
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(data))
    return str(f)


@pytest.fixture
def fleet_with_checkpoints(tmp_path):
    store, state = LocalStore(tmp_path / "store"), LocalFleetState(tmp_path / "store")
    nodes = {"a1": BASE, "a2": BASE, "b1": H100}
    for n, fp in nodes.items():
        state.put_node_fingerprint(n, fp)
    ids = {}
    for w in _workloads():
        for _ in range(2):
            p = store.begin(w.name, node=w.node)
            (p.images_dir / "pages-1.img").write_bytes(b"x")
            m = store.commit(p, fingerprint=workload_fingerprint(w, nodes[w.node]))
            ids.setdefault(w.name, []).append(m.id)
            time.sleep(0.002)
    return tmp_path, store, ids


def _run(tmp_path, workloads=None):
    from ckptflow.flows.invalidate import invalidate

    return invalidate(_fleet(tmp_path, workloads or _workloads()))


def _invalidated(store):
    return {w: sorted(m.id for m in store.list(w) if m.state == CheckpointState.invalidated)
            for w in ("w1", "w2", "w3", "w4")}


def test_nothing_changed_invalidates_nothing(prefect_harness, fleet_with_checkpoints):
    tmp_path, store, ids = fleet_with_checkpoints
    out = _run(tmp_path)
    assert out["invalidated"] == [] and _invalidated(store) == {w: [] for w in ids}


def test_driver_upgrade_on_one_node(prefect_harness, fleet_with_checkpoints):
    tmp_path, store, ids = fleet_with_checkpoints
    # a1 upgraded: a2 (same class) can still restore w1's checkpoints, so nothing goes...
    LocalFleetState(tmp_path / "store").put_node_fingerprint("a1", BASE.model_copy(update={"driver": "590.48.01"}))
    assert _run(tmp_path)["invalidated"] == []
    # ...but b1 is the only H100 node: w3's checkpoints can no longer restore anywhere.
    LocalFleetState(tmp_path / "store").put_node_fingerprint("b1", H100.model_copy(update={"driver": "590.48.01"}))
    rows = _run(tmp_path)["invalidated"]
    assert _invalidated(store) == {"w1": [], "w2": [], "w3": sorted(ids["w3"]), "w4": []}
    assert all("driver: '580.159.04' -> '590.48.01'" in r["reason"] for r in rows)
    assert store.get("w3", ids["w3"][0]).state_reason.startswith("no eligible node can restore it; on b1:")


def test_criu_upgrade_on_the_h200_nodes(prefect_harness, fleet_with_checkpoints):
    tmp_path, store, ids = fleet_with_checkpoints
    for n in ("a1", "a2"):
        LocalFleetState(tmp_path / "store").put_node_fingerprint(n, BASE.model_copy(update={"criu": "4.3"}))
    _run(tmp_path)
    assert _invalidated(store) == {"w1": sorted(ids["w1"]), "w2": sorted(ids["w2"]), "w3": [],
                                   "w4": sorted(ids["w4"])}


def test_model_revision_change(prefect_harness, fleet_with_checkpoints):
    tmp_path, store, ids = fleet_with_checkpoints
    ws = _workloads()
    ws[0] = ws[0].model_copy(update={"model_revision": "r2"})
    rows = _run(tmp_path, ws)["invalidated"]
    assert _invalidated(store) == {"w1": sorted(ids["w1"]), "w2": [], "w3": [], "w4": []}
    assert "model_revision: 'r1' -> 'r2'" in rows[0]["reason"]


def test_engine_upgrade(prefect_harness, fleet_with_checkpoints):
    tmp_path, store, ids = fleet_with_checkpoints
    ws = _workloads()
    ws[1] = ws[1].model_copy(update={"engine_version": "0.5.1"})
    _run(tmp_path, ws)
    assert _invalidated(store) == {"w1": [], "w2": sorted(ids["w2"]), "w3": [], "w4": []}
    # A second run changes nothing and keeps the newest valid checkpoints of the others.
    assert _run(tmp_path, ws)["invalidated"] == []
    assert all(store.latest_valid(w) for w in ("w1", "w3", "w4"))


def test_retry_rule_treats_incompatible_as_final():
    from prefect.states import Failed

    from ckptflow.errors import CriuTimeout
    from ckptflow.tasks.common import retry_if_retryable

    final = Failed(data=IncompatibleCheckpoint({"driver": ("580", "590")}, checkpoint="c"))
    again = Failed(data=CriuTimeout("slow", cmd=["criu"]))
    assert retry_if_retryable(None, None, final) is False
    assert retry_if_retryable(None, None, again) is True


# --- the gate on a real process and real CRIU ------------------------------------------------
@pytest.mark.fault
@pytest.mark.criu
def test_restore_onto_incompatible_node_is_refused_before_criu(tmp_path, demo_worker, caplog):
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.fingerprint import node_fingerprint
    from ckptflow.runners.process import pid_alive

    w = demo_worker("gated")
    w.workload = w.workload.model_copy(update={"gpu": False})
    store = LocalStore(tmp_path / "store")
    m = NodeRunner(store).checkpoint(w.workload, leave_running=False)
    here = node_fingerprint()
    other = here.model_copy(update={"kernel": "7.0.0", "criu": "5.0", "glibc": "2.41"})
    node = NodeRunner(store, node_fp=other)
    t0 = time.perf_counter()
    with pytest.raises(IncompatibleCheckpoint) as e:
        node.restore(w.workload)
    took = time.perf_counter() - t0
    msg = str(e.value)
    for field, old, new in (("kernel", here.kernel, "7.0.0"), ("criu", here.criu, "5.0"),
                            ("glibc", here.glibc, "2.41")):
        assert f"{field}: {old!r} -> {new!r}" in msg
    assert e.value.differences.keys() == {"kernel", "criu", "glibc"}
    assert took < 1.0
    assert not list(node.criu.log_dir.glob("restore-*.log"))  # no CRIU process was started
    assert not pid_alive(m.pid)
    assert store.get("gated", m.id).state == CheckpointState.complete  # a gate is not corruption

    # An explicit override restores anyway, loudly.
    with caplog.at_level("WARNING", logger="ckptflow"):
        res = node.restore(w.workload, overrides=frozenset({"kernel", "criu", "glibc"}))
    assert res.pid == m.pid and pid_alive(m.pid)
    assert "OVERRIDE: restoring" in caplog.text and "kernel differs" in caplog.text


@pytest.mark.criu
def test_manifest_without_fingerprint_is_refused_unless_overridden(tmp_path, demo_worker, caplog):
    from ckptflow.policies.compat import GATED
    from ckptflow.runners.node import NodeRunner

    w = demo_worker("old")
    store = LocalStore(tmp_path / "store")
    node = NodeRunner(store)
    m = node.checkpoint(w.workload, leave_running=False)
    store.set_state(m.model_copy(update={"fingerprint": None}), m.state)
    with pytest.raises(IncompatibleCheckpoint, match=r"kernel: None -> '") as e:  # nothing proves it fits here
        node.restore(w.workload)
    assert not list(node.criu.log_dir.glob("restore-*.log"))
    with caplog.at_level("WARNING", logger="ckptflow"):
        res = node.restore(w.workload, overrides=frozenset(f for g in GATED.values() for f in g))
    assert res.pid == m.pid
    assert "OVERRIDE: restoring" in caplog.text and set(e.value.differences) <= {f for g in GATED.values() for f in g}


@pytest.mark.criu
def test_s3_fleet_reads_every_nodes_report_from_the_bucket_and_retires_bucket_copies(tmp_path, prefect_harness, s3):
    from ckptflow.flows.invalidate import invalidate
    from ckptflow.store.fleetstate import S3FleetState
    from ckptflow.store.s3 import S3Tier

    w = Workload(name="w1", node="a1", find=ProcessFinder(pid_file="/run/w1.pid"), engine="vllm",
                 engine_version="0.11.0", model_id="org/model", model_revision="r1")
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump({
        "fleet": "t", "storage": {"kind": "s3", "path": str(tmp_path / "store" / "{node}"),
                                  "bucket": s3.bucket("ckpt-inval"), "endpoint_url": s3.endpoint},
        "nodes": [{"name": "a1", "work_pool": "a1", "gpu_class": "H200"},
                  {"name": "a2", "work_pool": "a2", "gpu_class": "H200"}],
        "workloads": [w.model_dump(mode="json", exclude_none=True)]}))
    tier = S3Tier("ckpt-inval", endpoint_url=s3.endpoint)
    state = S3FleetState("ckpt-inval", endpoint_url=s3.endpoint, client=tier.s3)
    a1 = LocalStore(tmp_path / "store" / "a1")
    p = a1.begin("w1", node="a1")
    (p.images_dir / "pages-1.img").write_bytes(b"x" * 4096)
    m = a1.commit(p, fingerprint=workload_fingerprint(w, BASE))   # taken before a1's upgrade
    tier.push(a1, m)

    state.put_node_fingerprint("a2", BASE)            # a2, reported from another machine, not upgraded
    res = invalidate(str(f), node="a1")              # a1 reports this machine: kernel, CRIU... differ
    assert res["invalidated"] == []                  # a2 can still restore it: nothing retired
    assert set(state.node_fingerprints()) == {"a1", "a2"}

    state.put_node_fingerprint("a2", BASE.model_copy(update={"kernel": "6.19.0"}))   # a2 upgraded too
    res = invalidate(str(f), node="a1")
    assert sorted((r["copy"], r["checkpoint"]) for r in res["invalidated"]) == [("node", m.id), ("s3", m.id)]
    assert a1.get("w1", m.id).state == CheckpointState.invalidated
    assert tier.manifest("w1", m.id).state == CheckpointState.invalidated
    assert "kernel" in tier.manifest("w1", m.id).state_reason


# --- fail closed: a field the checkpoint did not record is a difference, not a pass ---------------
def test_a_gpu_checkpoint_without_gpu_fields_is_refused_on_a_node_that_has_them():
    from ckptflow.policies.compat import diff

    old = BASE.model_copy(update={"gpu_model": None, "gpu_count": None, "driver": None, "cuda_driver": None})
    c = diff(old, BASE)
    assert not c.ok and c.differences == {"gpu_model": (None, "NVIDIA H200"), "gpu_count": (None, 8),
                                          "driver": (None, "580.159.04"), "cuda_driver": (None, "13.0")}
    assert diff(old, BASE, overrides={"gpu_model", "gpu_count", "driver", "cuda_driver"}).ok  # explicit, loud
    assert not diff(None, BASE).ok                                     # no fingerprint at all: nothing proven
    cpu = BASE.model_copy(update={"gpu_model": None, "gpu_count": None, "driver": None, "cuda_driver": None})
    assert diff(cpu, cpu, groups=("host", "gpu")).ok  # known on neither side: nothing to compare
    assert diff(cpu, cpu, groups=("host", "gpu")).skipped == ["gpu_model", "gpu_count", "driver", "cuda_driver"]


def test_an_old_gpu_checkpoint_is_retired_when_no_node_can_prove_it_fits():
    from ckptflow.models import Manifest
    from ckptflow.policies.compat import stale

    old = BASE.model_copy(update={"driver": None})
    m = Manifest(id="20261129T081500Z-1a2b3c4d", workload="w1", node="a1", fingerprint=old)
    [(got, why)] = stale([m], {"a1": BASE}, gpu=True)
    assert got.id == m.id and "driver: None -> '580.159.04'" in why
