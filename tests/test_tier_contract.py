"""One behaviour suite for every checkpoint tier (store.tier.CheckpointTier: LocalStore, S3Tier,
and the toy tier of tests/helpers/toy_tier.py, a directory-backed object store registered as
``kind: toy``) and every fleet state (store.fleetstate.FleetState: LocalFleetState, and
ObjectFleetState on S3 and on the toy store).

The S3 cases run against a real S3 server (SeaweedFS on 127.0.0.1, the session's ``s3``
fixture), each test under a prefix of its own in one bucket. A new tier kind joins the ``tier``
fixture's params (docs/extending/storage-tier.md).
"""

import hashlib
import os
import re
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from ckptflow.errors import CheckpointNotFound, ChecksumMismatch, StoreError
from ckptflow.fleet import Storage
from ckptflow.models import CheckpointState, CopyTier, Fingerprint, utcnow
from ckptflow.policies.retention import Retention
from ckptflow.store import open_fleet_state, open_store, open_tier
from ckptflow.store.fleetstate import FleetState, LocalFleetState
from ckptflow.store.local import LocalStore
from ckptflow.store.tier import CheckpointTier
import toy_tier  # noqa: F401  (registers storage.kind toy; tests/helpers is on sys.path)

BUCKET = "ckpt-contract"
S3_CHUNK = 8 << 20   # store.s3.CHUNK: a payload above it spans two chunks in the bucket


def _storage(request, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(kind="local", path=str(tmp_path / "fleet-root"))
    if request.param == "toy":
        return Storage(kind="toy", path=str(tmp_path / "store" / "{node}"), options={"root": str(tmp_path / "objects")})
    s3 = request.getfixturevalue("s3")
    return Storage(kind="s3", path=str(tmp_path / "store" / "{node}"), bucket=s3.bucket(BUCKET),
                   prefix=f"t-{uuid.uuid4().hex[:12]}", endpoint_url=s3.endpoint)


@pytest.fixture(params=["local", "s3", "toy"])
def tier(request, tmp_path) -> CheckpointTier:
    """The tier under test: a LocalStore of its own directory, or the shared tier the factory
    opens for the kind."""
    storage = _storage(request, tmp_path)
    t = LocalStore(tmp_path / "tier") if request.param == "local" else open_tier(storage)
    assert isinstance(t, CheckpointTier)
    return t


@pytest.fixture(params=["local", "s3", "toy"])
def state_storage(request, tmp_path) -> Storage:
    """The storage of a local, an S3 or a toy-store fleet."""
    return _storage(request, tmp_path)


@pytest.fixture
def state(state_storage) -> FleetState:
    """The fleet state the factory opens for that fleet."""
    st = open_fleet_state(state_storage)
    assert isinstance(st, FleetState)
    return st


@pytest.fixture
def node_a(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "node-a")


@pytest.fixture
def node_b(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "node-b")


def _ckpt(store: LocalStore, pages: bytes, workload: str = "chat"):
    p = store.begin(workload, node="node-a")
    (p.images_dir / "pages-1.img").write_bytes(pages)
    (p.images_dir / "core-1.img").write_bytes(b"core of the process")
    m = store.commit(p, timings={"dump": 0.1})
    time.sleep(0.002)  # distinct creation times: retention orders by them
    return m


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- the tier ---------------------------------------------------------------------------------
def test_push_list_manifest_pull_round_trip(tier, node_a, node_b):
    pages = os.urandom(S3_CHUNK + 4321)
    m = _ckpt(node_a, pages)
    pushed = tier.push(node_a, m)
    assert pushed["uploaded_bytes"] == m.bytes == len(pages) + len(b"core of the process")
    assert tier.ids("chat") == [m.id]
    held = tier.manifest("chat", m.id)
    assert [(f.path, f.size, f.sha256) for f in held.files] == [(f.path, f.size, f.sha256) for f in m.files]
    assert [x.id for x in tier.manifests("chat")] == [m.id]
    assert tier.list("chat") == tier.manifests("chat")          # one meaning on every tier

    got, stats = tier.pull(node_b, "chat", m.id, "node-b")
    assert stats["downloaded_bytes"] == m.bytes
    assert (got.id, got.state) == (m.id, CheckpointState.complete)
    assert (CopyTier.node, "node-b") in [(c.tier, c.location) for c in got.copies]
    for f in m.files:                              # every byte as the manifest's checksums say
        assert _sha256(node_b.images_dir(got) / f.path) == f.sha256
    assert (node_b.images_dir(got) / "pages-1.img").read_bytes() == pages
    node_b.verify_bytes(got)
    assert node_b.latest_valid("chat").id == m.id
    again, stats = tier.pull(node_b, "chat", m.id, "node-b")
    assert stats["downloaded_bytes"] == 0 and again.id == m.id      # a good copy there is kept


def test_a_second_push_of_the_same_checkpoint_copies_nothing(tier, node_a):
    m = _ckpt(node_a, os.urandom(4096))
    tier.push(node_a, m)
    again = tier.push(node_a, m)
    assert again["uploaded_bytes"] == 0 and again["skipped_bytes"] == m.bytes
    assert tier.ids("chat") == [m.id]


def test_push_refuses_bytes_that_differ_from_their_manifest(tier, node_a):
    m = _ckpt(node_a, b"x" * 5000)
    (node_a.images_dir(m) / "pages-1.img").write_bytes(b"y" * 5000)     # same size, other bytes
    with pytest.raises(ChecksumMismatch, match="pages-1.img"):
        tier.push(node_a, m)
    assert tier.ids("chat") == []
    with pytest.raises(CheckpointNotFound):
        tier.manifest("chat", m.id)


def test_pull_replaces_a_local_copy_that_failed_verification(tier, node_a, node_b):
    pages = os.urandom(10_000)
    m = _ckpt(node_a, pages)
    tier.push(node_a, m)
    got, _ = tier.pull(node_b, "chat", m.id, "node-b")
    (node_b.images_dir(got) / "pages-1.img").write_bytes(b"rot")
    node_b.set_state(got, CheckpointState.verify_failed, "checksum: pages-1.img")
    fresh, stats = tier.pull(node_b, "chat", m.id, "node-b")
    assert stats["downloaded_bytes"] == m.bytes and fresh.state == CheckpointState.complete
    assert (node_b.images_dir(fresh) / "pages-1.img").read_bytes() == pages
    assert node_b.get("chat", m.id).state == CheckpointState.complete


def test_an_unknown_checkpoint_is_not_found_and_leaves_nothing(tier, node_b):
    missing = "20990101T000000Z-00000000"
    with pytest.raises(CheckpointNotFound):
        tier.manifest("chat", missing)
    with pytest.raises(CheckpointNotFound):
        tier.pull(node_b, "chat", missing, "node-b")
    assert node_b.list("chat") == [] and not (node_b.root / "chat" / missing).exists()


def test_set_state_and_delete(tier, node_a):
    old, new = _ckpt(node_a, b"old" * 100), _ckpt(node_a, b"new" * 100)
    for m in (old, new):
        tier.push(node_a, m)
    assert tier.ids("chat") == [new.id, old.id]
    tier.set_state(tier.manifest("chat", new.id), CheckpointState.invalidated, "driver 580 -> 590")
    held = tier.manifest("chat", new.id)
    assert (held.state, held.state_reason) == (CheckpointState.invalidated, "driver 580 -> 590")
    assert node_a.get("chat", new.id).state == CheckpointState.complete   # the node's copy is its own
    tier.delete(held)
    assert tier.ids("chat") == [old.id]
    with pytest.raises(CheckpointNotFound):
        tier.manifest("chat", new.id)


def test_retention_keeps_the_newest_valid_checkpoint(tier, node_a):
    ms = [_ckpt(node_a, os.urandom(2048)) for _ in range(4)]
    for m in ms:
        tier.push(node_a, m)
    tier.set_state(tier.manifest("chat", ms[3].id), CheckpointState.invalidated, "criu 4.2 -> 4.3")
    gone = dict(tier.apply_retention("chat", Retention(keep=1, max_age_h=1, invalidated_grace_h=0),
                                     now=utcnow() + timedelta(hours=5)))
    assert tier.ids("chat") == [ms[2].id]              # the newest valid one, although 5 h old
    assert sorted(gone) == sorted([ms[0].id, ms[1].id, ms[3].id])
    assert gone[ms[3].id].startswith("invalidated")


def test_retention_refuses_a_rule_that_names_the_last_good_checkpoint(tier, node_a, monkeypatch):
    import ckptflow.policies.retention as retention

    ms = [_ckpt(node_a, os.urandom(1024)) for _ in range(2)]
    for m in ms:
        tier.push(node_a, m)
    # A policy bug: every checkpoint, oldest first (so a check made while deleting comes too late).
    monkeypatch.setattr(retention, "to_delete", lambda manifests, now, rule=None:
                        [(m, "bug") for m in sorted(manifests, key=lambda m: m.id)])
    with pytest.raises(StoreError, match="newest valid checkpoint"):
        tier.apply_retention("chat", Retention(keep=1))
    assert tier.ids("chat") == [ms[1].id, ms[0].id]      # nothing deleted
    with pytest.raises(StoreError, match="newest valid checkpoint"):
        tier.prune(Retention(keep=1))
    assert tier.ids("chat") == [ms[1].id, ms[0].id]


def test_prune_keeps_every_byte_of_what_it_keeps(tier, node_a, node_b):
    ms = [_ckpt(node_a, os.urandom(S3_CHUNK + 100)) for _ in range(3)]
    for m in ms:
        tier.push(node_a, m)
    res = tier.prune(Retention(keep=1))
    assert sorted(r["checkpoint"] for r in res["manifests_deleted"]) == sorted(m.id for m in ms[:2])
    assert {r["workload"] for r in res["manifests_deleted"]} == {"chat"}
    assert res["manifests_kept"] == 1 and res["bytes_freed"] > 0
    assert tier.ids("chat") == [ms[2].id]
    got, _ = tier.pull(node_b, "chat", ms[2].id, "node-b")
    for f in ms[2].files:
        assert _sha256(node_b.images_dir(got) / f.path) == f.sha256


# --- the fleet state --------------------------------------------------------------------------
def test_placements_set_and_get(state):
    assert state.placements() == {}
    state.put_placement("chat", "node-b", "20261129T081500Z-1a2b3c4d")
    state.put_placement("api", "node-c", "cold-start")
    assert state.placements() == {"chat": "node-b", "api": "node-c"}
    state.put_placement("chat", "node-a", "20261129T091500Z-1a2b3c4e")   # moved again
    assert state.placements() == {"chat": "node-a", "api": "node-c"}
    with pytest.raises(ValueError, match="not a valid name"):
        state.put_placement("chat", "../etc", "x")


def test_alerts_put_get_drop(state):
    assert state.get_alert("chat") is None and state.alerts() == {}
    alert = {"kind": "worker_gone", "token": "ab12", "reason": "no live process", "node": "node-a", "opened": 1.5}
    state.put_alert("chat", alert)
    state.put_alert("api", {"kind": "verify_failed", "token": "cd34"})
    assert state.get_alert("chat") == alert
    assert state.alerts() == {"chat": alert, "api": {"kind": "verify_failed", "token": "cd34"}}
    state.drop_alert("chat")
    assert state.get_alert("chat") is None and set(state.alerts()) == {"api"}
    state.drop_alert("chat")                                # closing a closed alert is no error


def test_fingerprints_put_and_list(state):
    a1 = Fingerprint(kernel="6.8.0", driver="580.95.05", gpu_model="H200", gpu_count=8)
    state.put_node_fingerprint("a1", a1)
    state.put_node_fingerprint("a2", a1.model_copy(update={"kernel": "6.19.0"}))
    got = state.node_fingerprints()
    assert got == {"a1": a1, "a2": a1.model_copy(update={"kernel": "6.19.0"})}
    state.put_node_fingerprint("a1", a1.model_copy(update={"driver": "590.48.01"}))
    assert state.node_fingerprints()["a1"].driver == "590.48.01"


def test_a_second_node_sees_the_same_state(state, state_storage):
    """Two processes (nodes) opening the fleet state of one fleet see each other's writes."""
    other = open_fleet_state(state_storage)
    state.put_alert("chat", {"kind": "restore_failed", "token": "t"})
    state.put_placement("chat", "node-b", "cold-start")
    assert other.get_alert("chat") == {"kind": "restore_failed", "token": "t"}
    assert other.placements() == {"chat": "node-b"}
    other.drop_alert("chat")
    assert state.get_alert("chat") is None


def test_alerter_keeps_its_open_alerts_in_the_fleet_state(state, slack):
    from ckptflow.alerts import Alerter, AlertKind
    from ckptflow.fleet import Slack

    cfg = Slack(webhook_url_env="CKPTFLOW_TEST_SLACK_WEBHOOK")
    node_a, node_b = Alerter(cfg, state=state), Alerter(cfg, state=state)
    assert node_a.send(AlertKind.worker_gone, workload="chat", key="gone", node="n1", reason="gone",
                       checkpoint=None, flow_run_id=None)
    assert state.get_alert("chat")["kind"] == "worker_gone"
    assert not node_b.send(AlertKind.worker_gone, workload="chat", key="gone", node="n1", reason="gone",
                           checkpoint=None, flow_run_id=None)          # the same reason: suppressed
    assert node_b.resolve("chat", node="n2", how="restored", checkpoint=None)
    assert state.get_alert("chat") is None and len(slack.requests) == 2


# --- the layouts existing stores and buckets hold ---------------------------------------------
def test_local_layout_is_unchanged(tmp_path):
    """A local fleet's state and a node's records are where stores written before the fleet
    state existed keep them, so those stores keep working."""
    storage = Storage(kind="local", path=str(tmp_path / "store"))
    state, root = open_fleet_state(storage), tmp_path / "store"
    state.put_alert("chat", {"kind": "worker_gone"})
    state.put_node_fingerprint("a1", Fingerprint(kernel="6.8.0"))
    state.put_placement("chat", "node-b", "cold-start")
    assert (root / ".alerts" / "chat.json").exists() and (root / ".nodes" / "a1.json").exists()
    assert (root / ".placements" / "chat.json").exists()
    drained = open_store(storage, "a1").mark_drained("a1", {"rows": []})
    assert drained == root / ".nodes" / "a1.drained"
    assert set(state.node_fingerprints()) == {"a1"}              # the drained mark is no fingerprint
    assert LocalFleetState(root).get_alert("chat") == {"kind": "worker_gone"}   # a state opened on the root reads it


def test_s3_layout_is_unchanged(s3, tmp_path):
    from ckptflow.store.s3 import S3Tier

    prefix = f"t-{uuid.uuid4().hex[:12]}"
    storage = Storage(kind="s3", bucket=s3.bucket(BUCKET), prefix=prefix, endpoint_url=s3.endpoint)
    state, tier = open_fleet_state(storage), open_tier(storage)
    assert isinstance(tier, S3Tier)
    shared = open_fleet_state(storage, tier)
    assert shared.objects is tier.objects                         # one client, one connection for both
    state.put_alert("chat", {"kind": "worker_gone"})
    state.put_node_fingerprint("a1", Fingerprint(kernel="6.8.0"))
    shared.put_placement("chat", "node-b", "cold-start")
    keys = sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")["Contents"])
    assert keys == [f"{prefix}/alerts/chat.json", f"{prefix}/nodes/a1.json", f"{prefix}/placements/chat.json"]
    assert shared.placements() == {"chat": "node-b"} and shared.get_alert("chat") == {"kind": "worker_gone"}


def test_a_local_fleet_has_no_shared_tier(tmp_path):
    storage = Storage(kind="local", path=str(tmp_path / "store" / "{node}"))
    assert open_tier(storage) is None
    assert Path(open_fleet_state(storage).location) == open_store(storage).root == tmp_path / "store" / "local"


def test_only_the_store_package_picks_an_implementation():
    """Outside ckptflow/store/ nothing compares storage.kind to s3 or names the S3 classes:
    store.open_store / open_tier / open_fleet_state choose."""
    root = Path(__file__).parent.parent / "ckptflow"
    # deploy.py's result storage is registered per kind (deploy.register_result_storage): no
    # module is allowed an exception any more.
    allowed: set[str] = set()
    kind_s3 = re.compile(r"""kind(\.value)?\s*[!=]=\s*["']s3["']|["']s3["']\s*[!=]=\s*\S*kind""")
    names = re.compile(r"store\.s3\b|store\.fleetstate import .*S3|\bS3Tier\b|\bS3FleetState\b|\bS3Objects\b")
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "store" or str(rel) in allowed:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if kind_s3.search(line) or names.search(line):
                bad.append(f"ckptflow/{rel}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)
