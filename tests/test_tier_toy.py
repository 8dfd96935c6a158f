"""The toy tier (tests/helpers/toy_tier.py) as a new storage kind arrives: registered by name,
chosen by the fleet file, and carrying the generic parts (chunks, dedup, encryption, prune lock)
through its own client. The shared behaviour is tests/test_tier_contract.py's (param ``toy``)."""

import os

import pytest
import yaml

import toy_tier
from ckptflow.errors import ChecksumMismatch, ConfigError, StorageUnavailable
from ckptflow.fleet import Storage, load_fleet
from ckptflow.models import CopyTier, Manifest
from ckptflow.policies.retention import Retention
from ckptflow.store import open_fleet_state, open_store, open_tier, tier_kinds
from ckptflow.store.local import LocalStore
from ckptflow.store.objects import ObjectStore


def _ckpt(store: LocalStore, pages: bytes, workload: str = "chat") -> Manifest:
    p = store.begin(workload, node="node-a")
    (p.images_dir / "pages-1.img").write_bytes(pages)
    (p.images_dir / "core-1.img").write_bytes(b"core")
    return store.commit(p)


def test_the_fleet_file_picks_the_toy_kind_by_name(tmp_path):
    assert {"local", "s3", "toy"} <= set(tier_kinds())
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump({
        "fleet": "toys", "storage": {"kind": "toy", "path": str(tmp_path / "store" / "{node}"),
                                      "options": {"root": str(tmp_path / "objects")}},
        "nodes": [{"name": "n1", "work_pool": "p1"}], "workloads": []}))
    storage = load_fleet(f).storage
    tier = open_tier(storage)
    assert isinstance(tier, toy_tier.ToyTier) and isinstance(tier.objects, ObjectStore)
    assert tier.location == f"toy://{tmp_path / 'objects'}"
    assert open_store(storage, "n1").root == tmp_path / "store" / "n1"
    assert open_fleet_state(storage).location == tier.location   # the fleet state lives in the toy store


def test_an_unregistered_kind_and_a_missing_option_are_named(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        Storage(kind="gcs-not-registered")
    with pytest.raises(ConfigError, match="options.root"):
        open_tier(Storage(kind="toy"))


def test_copies_are_labelled_with_the_kind_and_read_back(tmp_path):
    tier = toy_tier.ToyTier(tmp_path / "objects")
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    m = _ckpt(a, os.urandom(5000))
    tier.push(a, m)
    held = a.get("chat", m.id)
    assert (CopyTier("toy"), tier.location) in [(c.tier, c.location) for c in held.copies]
    assert held.copies[-1].tier.value == "toy"
    got, _ = tier.pull(b, "chat", m.id, "node-b")
    assert [c.tier.value for c in got.copies] == ["node", "toy", "node"]
    assert not got.probe.chunk_maps                                # the chunk map stays in the tier


def test_chunks_dedup_through_the_toy_client(tmp_path):
    tier = toy_tier.ToyTier(tmp_path / "objects", chunk=4096)
    a = LocalStore(tmp_path / "a")
    base = bytearray(os.urandom(10 * 4096))
    tier.push(a, _ckpt(a, bytes(base)))
    base[4096 * 3 + 7] ^= 0xFF                                   # one chunk changed
    second = tier.push(a, _ckpt(a, bytes(base)))
    assert second["uploaded_bytes"] == 4096 and second["skipped_bytes"] == 9 * 4096 + 4
    assert len(tier.objects.list("chunks/")) == 12               # 10 + the changed one + core


def test_encryption_is_the_generic_one(tmp_path):
    key = os.urandom(32)
    tier = toy_tier.ToyTier(tmp_path / "objects", key=key)
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    pages = os.urandom(3000)
    m = _ckpt(a, pages)
    tier.push(a, m)
    digest = tier.manifest("chat", m.id).probe.chunk_maps["objects"].chunks["pages-1.img"][0]
    stored = tier.objects.get(f"chunks/{digest}")
    assert pages not in stored and len(stored) == len(pages) + 12 + 16
    got, _ = tier.pull(b, "chat", m.id, "node-b")
    assert (b.images_dir(got) / "pages-1.img").read_bytes() == pages
    with pytest.raises(ChecksumMismatch, match="does not decrypt"):
        toy_tier.ToyTier(tmp_path / "objects", key=os.urandom(32)).pull(LocalStore(tmp_path / "c"), "chat", m.id, "c")


def test_a_corrupt_object_is_refused_and_names_the_store(tmp_path):
    tier = toy_tier.ToyTier(tmp_path / "objects")
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    m = _ckpt(a, os.urandom(3000))
    tier.push(a, m)
    digest = tier.manifest("chat", m.id).probe.chunk_maps["objects"].chunks["pages-1.img"][0]
    tier.objects.put(f"chunks/{digest}", b"garbage")
    with pytest.raises(ChecksumMismatch, match="from the toy store is corrupt"):
        tier.pull(b, "chat", m.id, "node-b")
    assert b.list("chat") == []


def test_the_prune_lock_and_push_leases_hold_on_the_toy_store(tmp_path):
    tier = toy_tier.ToyTier(tmp_path / "objects")
    a = LocalStore(tmp_path / "a")
    tier.push(a, _ckpt(a, os.urandom(2000)))
    lease = tier._lease()                                        # a push in flight
    assert tier.prune(Retention(keep=1))["skipped"].startswith("1 push(es) in progress")
    tier.objects.delete(lease)
    tier._stamp("locks/prune.json")                              # a prune in flight
    with pytest.raises(StorageUnavailable, match="is being pruned"):
        tier.push(a, _ckpt(a, os.urandom(2000)))
    assert tier.leases() == []
    tier.objects.delete("locks/prune.json")
    assert tier.push(a, _ckpt(a, os.urandom(2000)))["uploaded_bytes"] == 2000   # core-1.img is there


def test_the_fleet_state_lives_in_the_toy_store_with_no_state_of_its_own(tmp_path):
    """The toy registers its client (``objects=``) and nothing else for the fleet state: the one
    ObjectFleetState keeps placements, alerts and fingerprints in the toy store, where a node
    with another local store sees them, under the layout an S3 bucket has."""
    from ckptflow.models import Fingerprint
    from ckptflow.store.fleetstate import ObjectFleetState

    def node(n):  # each node its own local store, the one shared toy store
        return Storage(kind="toy", path=str(tmp_path / n / "{node}"), options={"root": str(tmp_path / "objects")})

    a, b = open_fleet_state(node("a")), open_fleet_state(node("b"))
    assert type(a) is ObjectFleetState and isinstance(a.objects, toy_tier.DirObjects)
    a.put_placement("chat", "node-b", "20261129T081500Z-1a2b3c4d")
    a.put_alert("chat", {"kind": "worker_gone", "token": "t1"})
    b.put_node_fingerprint("node-b", Fingerprint(kernel="6.8.0"))
    assert b.placements() == {"chat": "node-b"} and b.get_alert("chat")["token"] == "t1"
    assert a.node_fingerprints()["node-b"].kernel == "6.8.0"
    b.drop_alert("chat")
    assert a.get_alert("chat") is None and a.alerts() == {}
    objects = tmp_path / "objects"
    assert sorted(p.relative_to(objects).as_posix() for p in objects.rglob("*.json")) == [
        "nodes/node-b.json", "placements/chat.json"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()   # nothing in a node's store root
    tier = open_tier(node("a"))
    assert open_fleet_state(node("a"), tier).objects is tier.objects       # an open tier's client is shared
    with pytest.raises(ConfigError, match="options.root"):
        open_fleet_state(Storage(kind="toy"))


def test_a_manifest_pushed_before_the_probe_was_typed_pulls_from_its_flat_chunk_map(tmp_path):
    """A bucket keeps manifests an older ckptflow wrote ("objects_chunk_size", "objects_chunks"):
    a pull still finds every chunk through them, and the node's copy drops the map."""
    import json

    tier = toy_tier.ToyTier(tmp_path / "objects", chunk=4096)
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    pages = os.urandom(3 * tier.chunk + 5)
    m = _ckpt(a, pages)
    tier.push(a, m)
    key = f"manifests/chat/{m.id}.json"
    raw = json.loads(tier.objects.get(key))
    cmap = raw["probe"].pop("chunk_maps")["objects"]
    raw["probe"] |= {f"objects_{k}": v for k, v in cmap.items() if v} | {"restores": [2.0]}
    tier.objects.put(key, json.dumps(raw).encode())
    assert "chunk_maps" not in json.loads(tier.objects.get(key))["probe"]       # the old shape, as stored
    assert tier.manifest("chat", m.id).probe.chunk_maps["objects"].chunk_size == tier.chunk
    got, _ = tier.pull(b, "chat", m.id, "node-b")
    assert (b.images_dir(got) / "pages-1.img").read_bytes() == pages
    assert not got.probe.chunk_maps and got.probe.restores.seconds == [2.0]
