import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from ckptflow.errors import CheckpointNotFound, ChecksumMismatch
from ckptflow.models import CheckpointState


def _fake_checkpoint(store, workload="w", payload=b"abc" * 1000):
    p = store.begin(workload, node="n")
    (p.images_dir / "pages-1.img").write_bytes(payload)
    (p.images_dir / "core-1.img").write_bytes(b"core")
    return store.commit(p, timings={"dump": 0.1}, pid=123)


def test_commit_lists_checksums_and_permissions(store):
    m = _fake_checkpoint(store)
    assert [f.path for f in m.files] == ["core-1.img", "pages-1.img"]
    assert m.bytes == 3004
    import hashlib
    assert m.files[1].sha256 == hashlib.sha256(b"abc" * 1000).hexdigest()
    d = store.root / "w" / m.id
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / "images" / "pages-1.img").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d / "manifest.json").st_mode) == 0o600
    assert store.latest_valid("w").id == m.id
    assert store.verify_bytes(m) == d / "images"


def test_latest_valid_skips_invalidated_and_failed(store):
    a = _fake_checkpoint(store)
    time.sleep(0.01)
    b = _fake_checkpoint(store)
    store.set_state(b, CheckpointState.invalidated, "driver 580 -> 590")
    assert store.latest_valid("w").id == a.id
    store.set_state(a, CheckpointState.verify_failed, "golden differs")
    with pytest.raises(CheckpointNotFound, match="no valid checkpoint"):
        store.latest_valid("w")
    assert store.get("w", b.id).state_reason == "driver 580 -> 590"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_bytes_refused_naming_the_file(store, damage):
    m = _fake_checkpoint(store)
    f = store.images_dir(m) / "pages-1.img"
    if damage == "flip":
        data = bytearray(f.read_bytes())
        data[100] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-1])
    else:
        f.unlink()
    with pytest.raises(ChecksumMismatch) as e:
        store.verify_bytes(m)
    assert "pages-1.img" in str(e.value) and m.id in str(e.value)
    assert "older checkpoint" in str(e.value)


def test_empty_dump_is_not_committed(store):
    from ckptflow.errors import StoreError

    p = store.begin("w", node="n")
    with pytest.raises(StoreError, match="no image files"):
        store.commit(p)
    assert store.list("w") == []
    assert not p.dir.exists()


_WRITER = r"""
import sys, pathlib
from ckptflow.store.local import LocalStore
s = LocalStore(sys.argv[1]); p = s.begin("w", node="n")
with open(p.images_dir / "pages-1.img", "wb") as f:
    for _ in range(64):
        f.write(b"\xab" * (8 << 20))
pathlib.Path(sys.argv[2]).write_text("committing")
s.commit(p)
pathlib.Path(sys.argv[2]).write_text("done")
"""


@pytest.mark.fault
def test_kill_during_store_write_leaves_no_manifest(store, tmp_path):
    marker = tmp_path / "marker"
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(store.root), str(marker)])
    deadline = time.time() + 60
    while not (marker.exists() and marker.read_text() == "committing"):
        assert time.time() < deadline and child.poll() is None
        time.sleep(0.001)
    child.send_signal(signal.SIGKILL)  # mid-checksum of 512 MiB: before the manifest
    child.wait()
    assert marker.read_text() == "committing", "the writer finished before the kill; test proves nothing"
    assert store.list("w") == []
    with pytest.raises(CheckpointNotFound):
        store.latest_valid("w")
    from datetime import timedelta
    assert len(store.orphans("w", older_than=timedelta(0))) == 1


def test_large_file_is_hashed_in_chunks_and_the_bad_chunk_is_named(store):
    from ckptflow.store.local import CHUNK

    p = store.begin("w", node="n")
    big = p.images_dir / "pages-1.img"
    with open(big, "wb") as f:
        for i in range(3):
            f.write(bytes([i + 1]) * CHUNK)
        f.write(b"tail")
    m = store.commit(p)
    entry = next(e for e in m.files if e.path == "pages-1.img")
    assert entry.chunk_size == CHUNK and len(entry.chunks) == 4
    import hashlib
    assert entry.chunks[1] == hashlib.sha256(b"\x02" * CHUNK).hexdigest()
    store.verify_bytes(m)
    with open(store.images_dir(m) / "pages-1.img", "r+b") as f:
        f.seek(2 * CHUNK + 5)
        f.write(b"\xff")
    with pytest.raises(ChecksumMismatch, match=rf"chunk 2, bytes {2 * CHUNK}\.\.{3 * CHUNK}"):
        store.verify_bytes(m)


def test_apply_retention_keeps_newest_valid_and_removes_orphans(store):
    from datetime import timedelta

    from ckptflow.models import utcnow
    from ckptflow.policies.retention import Retention

    made = []
    for _ in range(4):
        made.append(_fake_checkpoint(store))
        time.sleep(0.002)
    store.set_state(made[-1], CheckpointState.invalidated, "criu 4.2 -> 4.3")
    orphan = store.begin("w", node="n")
    (orphan.images_dir / "pages-1.img").write_bytes(b"partial")
    gone = dict(store.apply_retention("w", Retention(keep=1, max_age_h=1, invalidated_grace_h=0),
                                      now=utcnow() + timedelta(hours=5), orphan_grace=timedelta(0)))
    left = [m.id for m in store.list("w")]
    assert left == [made[2].id]                      # the newest valid one, although 5 h old
    assert gone[made[3].id].startswith("invalidated")
    assert gone[orphan.id] == "orphan bytes without a manifest"
    assert not orphan.dir.exists()


def test_push_and_pull_within_one_store_copy_nothing(store):
    m = _fake_checkpoint(store)
    assert store.push(store, m)["uploaded_bytes"] == 0
    got, stats = store.pull(store, "w", m.id, "n")
    assert stats["downloaded_bytes"] == 0 and got == store.get("w", m.id)
    assert store.ids("w") == [m.id]


def test_prune_never_takes_two_tier_chunks_for_orphans(store):
    import hashlib
    from datetime import timedelta

    import json

    from ckptflow.store.chunks import REFS_FILE, ChunkStore

    m = _fake_checkpoint(store)
    digest, unused = hashlib.sha256(b"kv").hexdigest(), hashlib.sha256(b"old kv").hexdigest()
    with ChunkStore(store.root).staging() as stage:
        (stage / digest).write_bytes(b"kv")
        (stage / unused).write_bytes(b"old kv")
        ChunkStore(store.root).adopt(stage)
    (store.images_dir(m) / REFS_FILE).write_text(json.dumps([digest]))   # m names one of them
    res = store.prune(orphan_grace=timedelta(0))
    assert res["manifests_deleted"] == [] and res["manifests_kept"] == 1
    assert ChunkStore(store.root).read(digest) == b"kv" and store.ids("w") == [m.id]
    assert res["chunks_deleted"] == 1 and not ChunkStore(store.root).has(unused)   # nothing names it
