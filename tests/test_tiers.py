"""Tiers: the node keeps the newest checkpoint while S3 holds a copy for any node; manifests
list each copy, and a restore reads the nearest valid one."""

import os
from pathlib import Path
import shutil
import signal

import pytest

from ckptflow.models import CheckpointState, CopyTier
from ckptflow.policies.tiers import LocalCopy, restore_order
from ckptflow.store.local import LocalStore

A, B, C = "20261129T100000Z-aaaaaaaa", "20261129T110000Z-bbbbbbbb", "20261129T120000Z-cccccccc"


def _order(local, remote):
    return [(c.checkpoint, c.tier) for c in restore_order([LocalCopy(i, s) for i, s in local], remote)]


def test_newest_checkpoint_wins_even_when_only_the_bucket_has_it():
    assert _order([(A, "complete")], [B, A]) == [(B, "s3"), (A, "node"), (A, "s3")]


def test_this_nodes_copy_comes_before_the_buckets_copy_of_the_same_checkpoint():
    assert _order([(B, "verified"), (A, "complete")], [A, B]) == [(B, "node"), (B, "s3"), (A, "node"), (A, "s3")]


def test_a_corrupt_local_copy_leaves_the_buckets_copy_and_invalidated_is_out_everywhere():
    assert _order([(C, "invalidated"), (B, "verify_failed"), (A, "complete")], [A, B, C]) == \
        [(B, "s3"), (A, "node"), (A, "s3")]
    assert _order([], []) == []


def _two_node_s3_fleet(tmp_path, s3, workloads, bucket):
    from test_migrate import _two_node_fleet

    return _two_node_fleet(tmp_path, s3, workloads, bucket)


@pytest.mark.criu
def test_manifests_list_every_copy(tmp_path, s3):
    from ckptflow.store.s3 import S3Tier

    tier = S3Tier(s3.bucket("ckpt-copies"), endpoint_url=s3.endpoint)
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    p = a.begin("w", node="node-a")
    (p.images_dir / "pages-1.img").write_bytes(os.urandom(1 << 20))
    m = a.commit(p)
    assert [(c.tier, c.location) for c in m.copies] == [(CopyTier.node, "node-a")]
    tier.push(a, m)
    want = [(CopyTier.node, "node-a"), (CopyTier.s3, f"s3://ckpt-copies/ckptflow")]
    assert [(c.tier, c.location) for c in a.get("w", m.id).copies] == want
    assert [(c.tier, c.location) for c in tier.manifest("w", m.id).copies] == want
    got, _ = tier.pull(b, "w", m.id, "node-b")
    assert [(c.tier, c.location) for c in b.get("w", m.id).copies] == [*want, (CopyTier.node, "node-b")]
    assert got.copies == b.get("w", m.id).copies


@pytest.mark.criu
def test_recover_reads_in_place_then_the_s3_copy_of_a_corrupt_local_checkpoint(tmp_path, prefect_harness,
                                                                               demo_worker, s3):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover

    w, ref = demo_worker("chat"), demo_worker("ref")
    fleet = _two_node_s3_fleet(tmp_path, s3, [w.workload], "ckpt-near")
    for x in (w, ref):
        x.complete("a long session " * 30, 16, "s")
    row = heartbeat(fleet, force=True)[0]
    assert row["uploaded_bytes"] > 0

    os.kill(w.pid, signal.SIGKILL)
    first = recover(fleet, "chat")
    assert first["checkpoint"] == row["checkpoint"] and first["downloaded_bytes"] == 0  # read in place
    assert w.digests() == ref.digests()

    store = LocalStore(tmp_path / "store" / "node-a")
    pages = max(store.images_dir(store.get("chat", row["checkpoint"])).glob("pages-*.img"),
                key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(8192)
        f.write(b"\xff" * 16)
    os.kill(w.pid, signal.SIGKILL)
    second = recover(fleet, "chat")
    # Same checkpoint, from the bucket: no session turn lost to an older local checkpoint.
    assert second["checkpoint"] == row["checkpoint"] and second["downloaded_bytes"] == row["bytes"]
    assert [s["id"] for s in second["skipped"]] == [row["checkpoint"]]
    assert store.get("chat", row["checkpoint"]).state == CheckpointState.complete  # fresh, verified bytes
    assert w.complete("next", 24, "s") == ref.complete("next", 24, "s")


@pytest.mark.criu
def test_recover_node_brings_a_lost_nodes_workloads_back_elsewhere(tmp_path, prefect_harness, demo_worker, s3):
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover_node
    from ckptflow.tasks.common import open_fleet

    w, ref = demo_worker("chat"), demo_worker("ref")
    fleet = _two_node_s3_fleet(tmp_path, s3, [w.workload], "ckpt-lost")
    for x in (w, ref):
        x.complete("an agent session on a node about to die " * 20, 16, "s")
    ckpt = heartbeat(fleet, force=True)[0]["checkpoint"]

    os.kill(w.pid, signal.SIGKILL)                          # node-a is gone: its process and its disk
    shutil.rmtree(tmp_path / "store" / "node-a")
    rows = recover_node(fleet, "node-a")
    assert rows == [{"workload": "chat", "target": "node-b", "action": f"restored {ckpt}",
                     "reason": rows[0]["reason"]}]
    assert w.digests() == ref.digests()
    assert w.complete("go on", 24, "s") == ref.complete("go on", 24, "s")
    m = LocalStore(tmp_path / "store" / "node-b").get("chat", ckpt)
    assert [(c.tier.value, c.location) for c in m.copies] == [
        ("node", "node-a"), ("s3", f"s3://{s3.bucket('ckpt-lost')}/ckptflow"), ("node", "node-b")]
    assert open_fleet(fleet).workload("chat").node == "node-b"   # heartbeats follow it


def test_checkpoint_ids_sort_by_creation_time_within_one_second():
    # restore_order knows bucket copies only by id; two heartbeats in one second must still
    # order newest first (a random suffix alone once put the older one first).
    from datetime import datetime, timezone

    from ckptflow.store.local import new_checkpoint_id

    t = datetime(2026, 11, 29, 10, 0, 0, tzinfo=timezone.utc)
    ids = [new_checkpoint_id(t.replace(microsecond=us)) for us in (999_999, 500_000, 1_000, 0, 10)]
    assert sorted(ids) == [ids[3], ids[4], ids[2], ids[1], ids[0]]


@pytest.mark.criu
def test_a_bucket_copy_invalidated_there_is_never_pulled(tmp_path, s3):
    from ckptflow.errors import CheckpointNotFound
    from ckptflow.models import ProcessFinder, Workload
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.s3 import S3Tier

    tier = S3Tier(s3.bucket("ckpt-inv-pull"), endpoint_url=s3.endpoint)
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    p = a.begin("gone", node="node-a")
    (p.images_dir / "pages-1.img").write_bytes(os.urandom(4096))
    m = a.commit(p)
    tier.push(a, m)
    tier.set_state(m, CheckpointState.invalidated, "driver: 580 -> 590")
    w = Workload(name="gone", node="node-b", find=ProcessFinder(pid_file=str(tmp_path / "none.pid")))
    with pytest.raises(CheckpointNotFound, match="no valid checkpoint"):
        NodeRunner(b).restore(w, tier=tier)
    assert b.list("gone") == []                      # nothing downloaded


def test_ls_and_status_of_an_s3_fleet_with_node_paths_show_every_node_and_the_bucket(tmp_path, s3):
    """storage.path with {node} (the recommended layout): ls, status and the exporter read every
    node's store and the bucket, not a '…/local' directory nobody writes."""
    import os
    import subprocess

    import yaml

    from ckptflow.fleet import load_fleet
    from ckptflow.report import fleet_status
    from ckptflow.store.s3 import S3Tier

    fleet_file = Path(_two_node_s3_fleet(tmp_path, s3, [_declared(tmp_path, "chat"), _declared(tmp_path, "tools")],
                                         "ckpt-nodepaths"))
    bucket = "ckpt-nodepaths"
    data = yaml.safe_load(fleet_file.read_text())
    data["workloads"][1]["node"] = "node-b"
    fleet_file.write_text(yaml.safe_dump(data))
    ids = {}
    for name, node in (("chat", "node-a"), ("tools", "node-b")):
        store = LocalStore(tmp_path / "store" / node)
        p = store.begin(name, node=node)
        (p.images_dir / "core-1.img").write_bytes(os.urandom(4096))
        ids[name] = store.commit(p)
    S3Tier(bucket, endpoint_url=s3.endpoint).push(LocalStore(tmp_path / "store" / "node-a"), ids["chat"])
    rows = {r["workload"]: r for r in fleet_status(load_fleet(fleet_file))}
    assert rows["chat"]["newest"] == ids["chat"].id and rows["tools"]["newest"] == ids["tools"].id
    assert not (tmp_path / "store" / "local").exists()
    root = Path(__file__).parent.parent
    out = subprocess.run([str(root / ".venv" / "bin" / "ckptflow"), "ls", str(fleet_file)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "250"})
    assert out.returncode == 0, out.stderr
    assert ids["chat"].id in out.stdout and ids["tools"].id in out.stdout
    assert f"node:node-a, s3:s3://{bucket}" in out.stdout


def test_node_verify_follows_placements(tmp_path, s3, prefect_harness):
    """Node deployments pass their node, not a list frozen at deploy time: after a migrate the
    workload is verified by the node it runs on now."""
    from ckptflow.flows.verify import verify
    from ckptflow.store.fleetstate import S3FleetState

    bucket = "ckpt-verify-follows"
    fleet_file = _two_node_s3_fleet(tmp_path, s3, [_declared(tmp_path, "chat")], bucket)
    assert [r["workload"] for r in verify(str(fleet_file), node="node-a")] == ["chat"]
    S3FleetState(bucket, endpoint_url=s3.endpoint).put_placement("chat", "node-b", "c1")    # what migrate records
    assert verify(str(fleet_file), node="node-a") == []
    assert [r["workload"] for r in verify(str(fleet_file), node="node-b")] == ["chat"]


def _declared(tmp_path, name: str):
    """A declared workload whose process never exists (reports and verify lists only)."""
    from ckptflow.models import ProcessFinder, Workload

    return Workload(name=name, node="node-a", find=ProcessFinder(pid_file=str(tmp_path / f"{name}.pid")))
