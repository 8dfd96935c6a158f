"""The S3 tier against a real S3 server (SeaweedFS on 127.0.0.1)."""

import os

import pytest

from conftest import write_fleet
from ckptflow.errors import ChecksumMismatch, CheckpointNotFound
from ckptflow.store.local import LocalStore
from ckptflow.store.s3 import CHUNK, S3Tier


def _ckpt(store, payload: bytes, workload="w"):
    p = store.begin(workload, node="a")
    (p.images_dir / "pages-1.img").write_bytes(payload)
    (p.images_dir / "core-1.img").write_bytes(b"core")
    return store.commit(p)


def test_push_pull_round_trip_bytes_match(tmp_path, s3):
    tier = S3Tier(s3.bucket("ckpt-rt"), endpoint_url=s3.endpoint)
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    payload = os.urandom(3 * CHUNK + 1234)
    m = _ckpt(a, payload)
    first = tier.push(a, m)
    assert first["uploaded_bytes"] == len(payload) + 4 and first["chunks"] == 5
    assert tier.ids("w") == [m.id] and [x.id for x in tier.list("w")] == [m.id]
    got, stats = tier.pull(b, "w", m.id, "node-b")
    assert stats["downloaded_bytes"] == len(payload) + 4
    assert (b.images_dir(got) / "pages-1.img").read_bytes() == payload
    assert b.latest_valid("w").id == m.id and [f.sha256 for f in got.files] == [f.sha256 for f in m.files]


def test_second_push_uploads_only_new_chunks(tmp_path, s3):
    tier = S3Tier(s3.bucket("ckpt-dedup"), endpoint_url=s3.endpoint)
    a = LocalStore(tmp_path / "a")
    base = bytearray(os.urandom(8 * CHUNK))
    tier.push(a, _ckpt(a, bytes(base)))
    base[5 * CHUNK + 10: 5 * CHUNK + 4096] = os.urandom(4086)   # one chunk's worth of KV changed
    second = tier.push(a, _ckpt(a, bytes(base)))
    assert second["uploaded_bytes"] == CHUNK
    assert second["skipped_bytes"] == 7 * CHUNK + 4


@pytest.mark.fault
def test_corrupt_chunk_in_the_bucket_is_refused_and_leaves_no_manifest(tmp_path, s3):
    tier = S3Tier(s3.bucket("ckpt-corrupt"), endpoint_url=s3.endpoint)
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    m = _ckpt(a, os.urandom(2 * CHUNK))
    tier.push(a, m)
    remote = tier.manifest("w", m.id)
    digest = remote.probe.chunk_maps["s3"].chunks["pages-1.img"][1]
    s3.client.put_object(Bucket="ckpt-corrupt", Key=f"ckptflow/chunks/{digest}", Body=b"garbage")
    with pytest.raises(ChecksumMismatch, match="from S3 is corrupt"):
        tier.pull(b, "w", m.id, "node-b")
    assert b.list("w") == [] and not (b.root / "w" / m.id).exists()
    with pytest.raises(CheckpointNotFound):
        tier.manifest("w", "20990101T000000Z-00000000")


@pytest.mark.criu
def test_heartbeat_pushes_and_a_second_heartbeat_uploads_little(tmp_path, prefect_harness, demo_worker, s3):
    import yaml

    from ckptflow.flows.heartbeat import heartbeat

    w = demo_worker("chat", ballast_mib=256)
    fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store")
    data = yaml.safe_load(fleet.read_text())
    data["storage"].update(kind="s3", bucket=s3.bucket("ckpt-fleet"), endpoint_url=s3.endpoint)
    fleet.write_text(yaml.safe_dump(data))
    w.complete("a long session " * 40, 16, "s")
    r1 = heartbeat(str(fleet))[0]
    w.complete("one more turn", 16, "s")            # only the KV cache (and heap) changed
    r2 = heartbeat(str(fleet), force=True)[0]
    assert r1["uploaded_bytes"] > 256 << 20
    assert r2["uploaded_bytes"] / r2["bytes"] <= 0.15, r2
    tier = S3Tier("ckpt-fleet", endpoint_url=s3.endpoint)
    assert set(tier.ids("chat")) == {r1["checkpoint"], r2["checkpoint"]}


def test_client_side_encryption_keeps_dedup_and_refuses_another_key(tmp_path, s3, monkeypatch):
    import base64

    from ckptflow.fleet import Storage
    from ckptflow.store.s3 import _load_key

    key = os.urandom(32)
    tier = S3Tier(s3.bucket("ckpt-enc"), endpoint_url=s3.endpoint, key=key)
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    payload = os.urandom(2 * CHUNK)
    m = _ckpt(a, payload)
    tier.push(a, m)
    digest = tier.manifest("w", m.id).probe.chunk_maps["s3"].chunks["pages-1.img"][0]
    stored = s3.client.get_object(Bucket="ckpt-enc", Key=f"ckptflow/chunks/{digest}")["Body"].read()
    assert payload[:CHUNK] not in stored and len(stored) == CHUNK + 12 + 16   # nonce + tag
    assert tier.push(a, m)["uploaded_bytes"] == 0                              # dedup by plaintext digest
    got, _ = tier.pull(b, "w", m.id, "node-b")
    assert (b.images_dir(got) / "pages-1.img").read_bytes() == payload
    wrong = S3Tier("ckpt-enc", endpoint_url=s3.endpoint, key=os.urandom(32))
    with pytest.raises(ChecksumMismatch, match="does not decrypt with this node's key"):
        wrong.pull(LocalStore(tmp_path / "c"), "w", m.id, "node-c")
    monkeypatch.setenv("CKPT_KEY", base64.b64encode(key).decode())
    assert _load_key(Storage(kind="s3", bucket="x", encryption_key_env="CKPT_KEY")) == key


def test_prune_applies_retention_in_the_bucket_and_frees_unreferenced_chunks(tmp_path, s3):
    from ckptflow.policies.retention import Retention

    tier = S3Tier(s3.bucket("ckpt-prune"), endpoint_url=s3.endpoint)
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    ms = []
    for i in range(3):                                   # three heartbeats, each with its own bytes
        ms.append(_ckpt(a, os.urandom(2 * CHUNK)))
        tier.push(a, ms[-1])
    before = {o["Key"] for o in s3.client.list_objects_v2(Bucket="ckpt-prune", Prefix="ckptflow/chunks/")["Contents"]}
    res = tier.prune(Retention(keep=1))
    assert sorted(r["checkpoint"] for r in res["manifests_deleted"]) == sorted(m.id for m in ms[:2])
    assert tier.ids("w") == [ms[2].id]                  # the newest stays
    assert res["chunks_deleted"] == 4 and res["bytes_freed"] == 4 * CHUNK   # core-1.img's chunk is shared
    after = {o["Key"] for o in s3.client.list_objects_v2(Bucket="ckpt-prune", Prefix="ckptflow/chunks/")["Contents"]}
    assert len(before) - len(after) == 4
    got, _ = tier.pull(b, "w", ms[2].id, "node-b")       # the kept checkpoint still has every byte
    assert (b.images_dir(got) / "pages-1.img").read_bytes() == (a.images_dir(ms[2]) / "pages-1.img").read_bytes()
    assert s3.client.list_objects_v2(Bucket="ckpt-prune", Prefix="ckptflow/locks/").get("KeyCount", 0) == 0


@pytest.mark.fault
def test_prune_and_push_never_overlap(tmp_path, s3):
    from ckptflow.errors import StorageUnavailable
    from ckptflow.policies.retention import Retention

    tier = S3Tier(s3.bucket("ckpt-lease"), endpoint_url=s3.endpoint)
    a = LocalStore(tmp_path / "a")
    m = _ckpt(a, os.urandom(CHUNK))
    tier.push(a, m)
    lease = tier._lease()                                # a push in flight (its dedup checks done)
    assert tier.prune(Retention(keep=1))["skipped"].startswith("1 push(es) in progress")
    tier.objects.delete(lease)
    tier._stamp("locks/prune.json")                      # a prune in flight
    with pytest.raises(StorageUnavailable, match="is being pruned") as e:
        tier.push(a, _ckpt(a, os.urandom(CHUNK)))
    assert e.value.retryable
    assert s3.client.list_objects_v2(Bucket="ckpt-lease", Prefix="ckptflow/leases/").get("KeyCount", 0) == 0
    tier.objects.delete("locks/prune.json")
    assert tier.push(a, _ckpt(a, os.urandom(CHUNK)))["uploaded_bytes"] == CHUNK
