"""Local checkpoint store: one directory per workload and checkpoint id.

Layout::

    ROOT/<workload>/<checkpoint-id>/images/...   CRIU image files (0600)
    ROOT/<workload>/<checkpoint-id>/manifest.json written last, atomically

A checkpoint exists only once its manifest exists: a crash mid-write leaves bytes with no
manifest (an orphan, removed by retention after a grace period), never a listed checkpoint.

Example:
    >>> store = LocalStore(Path(".ckptflow/store"))           # doctest: +SKIP
    >>> pending = store.begin("chat-a", node="local")
    >>> ...  # CRIU writes into pending.images_dir
    >>> manifest = store.commit(pending, timings={"dump": 0.8})
    >>> store.latest_valid("chat-a").id == manifest.id
    True
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ckptflow.errors import CheckpointNotFound, ChecksumMismatch, StorageFull, StoreError, WorkloadBusy
from ckptflow.models import (CheckpointCopy, CheckpointKind, CheckpointState, CopyTier, FileEntry, Fingerprint,
                             Manifest, _check_ckpt_id, _check_name, utcnow)

if TYPE_CHECKING:
    from ckptflow.policies.retention import Retention

MANIFEST = "manifest.json"
IMAGES = "images"
_READ = 4 << 20
CHUNK = 64 << 20   # files above this are hashed per chunk, in parallel (a 50 GiB image in seconds)
_THREADS = min(32, 2 * (os.cpu_count() or 2))


def new_checkpoint_id(now: datetime | None = None) -> str:
    """``YYYYmmddTHHMMSSZ-uuuuurrr``: the suffix starts with the microsecond in 5 hex digits,
    then 3 random ones, so ids sort by creation time even within one second (the tier policy
    orders copies it only knows by id)."""
    now = now or utcnow()
    return now.strftime("%Y%m%dT%H%M%SZ") + f"-{now.microsecond:05x}" + secrets.token_hex(2)[:3]


def _sha256_range(path: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left > 0:
            data = f.read(min(_READ, left))
            if not data:
                break
            h.update(data)
            left -= len(data)
    return h.hexdigest()


def hash_files(root: Path, rel_paths: list[str]) -> list[FileEntry]:
    """Size and sha256 of each file; files above CHUNK are hashed per chunk, all in parallel
    (hashlib releases the GIL, so threads use every core)."""
    jobs = []
    sizes = {}
    for rel in rel_paths:
        size = (root / rel).stat().st_size
        sizes[rel] = size
        step = CHUNK if size > CHUNK else max(size, 1)
        jobs += [(rel, off, min(step, size - off)) for off in range(0, max(size, 1), step)]
    with ThreadPoolExecutor(max_workers=_THREADS) as ex:
        digests = list(ex.map(lambda j: _sha256_range(root / j[0], j[1], j[2]), jobs))
    per_file: dict[str, list[str]] = {}
    for (rel, _, _), d in zip(jobs, digests):
        per_file.setdefault(rel, []).append(d)
    out = []
    for rel in rel_paths:
        ds = per_file[rel]
        if sizes[rel] > CHUNK:
            root_digest = hashlib.sha256("".join(ds).encode()).hexdigest()
            out.append(FileEntry(path=rel, size=sizes[rel], sha256=root_digest, chunk_size=CHUNK, chunks=ds))
        else:
            out.append(FileEntry(path=rel, size=sizes[rel], sha256=ds[0]))
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: str) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename: readers see old or new."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass
class PendingCheckpoint:
    """A checkpoint being written: bytes go into ``images_dir``; no manifest yet."""

    workload: str
    node: str
    id: str
    dir: Path

    @property
    def images_dir(self) -> Path:
        return self.dir / IMAGES


class LocalStore:
    """Checkpoints under a root directory (0700 directories, 0600 files)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    # --- writing -----------------------------------------------------------------------
    def begin(self, workload: str, *, node: str) -> PendingCheckpoint:
        _check_name(workload)
        ckpt_id = new_checkpoint_id()
        d = self.root / workload / ckpt_id
        try:
            os.makedirs(d / IMAGES, mode=0o700)
        except OSError as e:
            raise _store_error(e, d) from e
        for p in (self.root, self.root / workload, d):
            os.chmod(p, 0o700)
        return PendingCheckpoint(workload=workload, node=node, id=ckpt_id, dir=d)

    def commit(self, pending: PendingCheckpoint, *, timings: dict[str, float] | None = None,
               fingerprint: Fingerprint | None = None, probe: dict[str, Any] | None = None,
               kind: CheckpointKind | str = CheckpointKind.heartbeat, pid: int | None = None,
               gpu_footprint_bytes: int = 0, parent: str | None = None, gpu_pids: list[int] | None = None) -> Manifest:
        """Checksum every image file, then write the manifest last and atomically."""
        t0 = time.perf_counter()
        try:
            paths = sorted(p for p in pending.images_dir.rglob("*") if p.is_file())
            for path in paths:
                os.chmod(path, 0o600)
            files = hash_files(pending.images_dir, [str(p.relative_to(pending.images_dir)) for p in paths])
            if not files:
                raise StoreError(f"checkpoint {pending.id} of {pending.workload} has no image files",
                                 fix="the dump wrote nothing; see the CRIU log")
            timings = dict(timings or {})
            timings["checksum"] = round(time.perf_counter() - t0, 4)
            m = Manifest(id=pending.id, workload=pending.workload, node=pending.node, kind=kind,
                         files=files, bytes=sum(f.size for f in files), timings=timings,
                         fingerprint=fingerprint, probe=probe or {}, pid=pid,
                         gpu_footprint_bytes=gpu_footprint_bytes, parent=parent, gpu_pids=gpu_pids or [],
                         copies=[CheckpointCopy(tier=CopyTier.node, location=pending.node)])
            write_json_atomic(pending.dir / MANIFEST, m.model_dump_json(indent=2))
        except OSError as e:
            self.abort(pending)
            raise _store_error(e, pending.dir) from e
        except BaseException:
            self.abort(pending)
            raise
        return m

    def abort(self, pending: PendingCheckpoint) -> None:
        """Discard a checkpoint that never got its manifest."""
        if not (pending.dir / MANIFEST).exists():
            shutil.rmtree(pending.dir, ignore_errors=True)

    # --- reading -----------------------------------------------------------------------
    def workloads(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def list(self, workload: str) -> list[Manifest]:
        """All checkpoints of a workload that have a manifest, newest first."""
        _check_name(workload)
        out = []
        wdir = self.root / workload
        if not wdir.exists():
            return []
        for d in wdir.iterdir():
            mpath = d / MANIFEST
            if mpath.exists():
                out.append(Manifest.model_validate_json(mpath.read_text()))
        return sorted(out, key=lambda m: (m.created, m.id), reverse=True)

    def get(self, workload: str, ckpt_id: str) -> Manifest:
        _check_name(workload)
        _check_ckpt_id(ckpt_id)
        mpath = self.root / workload / ckpt_id / MANIFEST
        if not mpath.exists():
            raise CheckpointNotFound(f"no checkpoint {ckpt_id} of workload {workload} in {self.root}",
                                     fix="`ckptflow ls` lists the checkpoints there are")
        return Manifest.model_validate_json(mpath.read_text())

    def valid(self, workload: str) -> Iterator[Manifest]:
        """Restorable checkpoints (complete or verified), newest first."""
        return (m for m in self.list(workload) if m.state.restorable)

    def latest_valid(self, workload: str) -> Manifest:
        for m in self.valid(workload):
            return m
        raise CheckpointNotFound(f"workload {workload} has no valid checkpoint in {self.root}",
                                 fix="run a heartbeat first, or cold start the worker")

    def images_dir(self, m: Manifest) -> Path:
        return self.root / m.workload / m.id / IMAGES

    def verify_bytes(self, m: Manifest) -> Path:
        """Check every file's size and sha256 against the manifest; return the image dir.

        Raises:
            ChecksumMismatch: naming the first file that is missing or differs.
        """
        d = self.images_dir(m)
        for f in m.files:
            p = d / f.path
            if not p.exists():
                raise ChecksumMismatch(f"checkpoint {m.id} of {m.workload}: file {f.path} is missing",
                                       fix="restore from an older checkpoint; this one is corrupt")
            size = p.stat().st_size
            if size != f.size:
                raise ChecksumMismatch(
                    f"checkpoint {m.id} of {m.workload}: {f.path} has {size} bytes, manifest says {f.size}",
                    fix="restore from an older checkpoint; this one is corrupt")
        got = {e.path: e for e in hash_files(d, [f.path for f in m.files])}
        for f in m.files:
            if got[f.path].sha256 != f.sha256:
                where = ""
                if f.chunks and got[f.path].chunks:
                    bad = next(i for i, (a, b) in enumerate(zip(f.chunks, got[f.path].chunks)) if a != b)
                    where = f" (chunk {bad}, bytes {bad * f.chunk_size}..{min(f.size, (bad + 1) * f.chunk_size)})"
                raise ChecksumMismatch(
                    f"checkpoint {m.id} of {m.workload}: {f.path} sha256 differs from the manifest{where}",
                    fix="restore from an older checkpoint; this one is corrupt")
        return d

    # --- state changes -----------------------------------------------------------------
    def set_state(self, m: Manifest, state: CheckpointState, reason: str | None = None,
                  **probe: Any) -> Manifest:
        new = m.model_copy(update={"state": state, "state_reason": reason,
                                   "probe": {**m.probe, **probe}})
        write_json_atomic(self.root / m.workload / m.id / MANIFEST, new.model_dump_json(indent=2))
        return new

    def add_copy(self, m: Manifest, tier: CopyTier, location: str) -> Manifest:
        """Record in this node's manifest that another place holds the same bytes."""
        cur = self.get(m.workload, m.id)
        new = cur.with_copy(tier, location)
        if new is not cur:
            write_json_atomic(self.root / m.workload / m.id / MANIFEST, new.model_dump_json(indent=2))
        return new

    # --- replicas scale_up started on this node (so a later scale_down finds them) -----
    def put_replica(self, workload: str, replica: dict) -> None:
        _check_name(workload)
        d = self.root / ".replicas" / workload
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(d / f"{_check_name(replica['netns'])}.json", json.dumps(replica))

    def replicas(self, workload: str) -> list[dict]:
        d = self.root / ".replicas" / _check_name(workload)
        return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.exists() else []

    def drop_replica(self, workload: str, netns: str) -> None:
        (self.root / ".replicas" / _check_name(workload) / f"{_check_name(netns)}.json").unlink(missing_ok=True)

    # --- open alerts, one per workload (ckptflow.alerts; an S3 fleet keeps them in the bucket) --
    def put_alert(self, workload: str, alert: dict) -> None:
        d = self.root / ".alerts"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(d / f"{_check_name(workload)}.json", json.dumps(alert))

    def get_alert(self, workload: str) -> dict | None:
        try:
            return json.loads((self.root / ".alerts" / f"{_check_name(workload)}.json").read_text())
        except FileNotFoundError:
            return None

    def drop_alert(self, workload: str) -> None:
        (self.root / ".alerts" / f"{_check_name(workload)}.json").unlink(missing_ok=True)

    def alerts(self) -> dict[str, dict]:
        """workload -> its open alert."""
        d = self.root / ".alerts"
        return {p.stem: json.loads(p.read_text()) for p in d.glob("*.json")} if d.exists() else {}

    def delete(self, m: Manifest) -> None:
        """Delete one checkpoint: manifest first, so a crash never leaves a listed checkpoint
        without its bytes."""
        d = self.root / m.workload / m.id
        (d / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)

    @contextmanager
    def lock(self, workload: str) -> Iterator[None]:
        """Exclusive, non-blocking lock of one workload on this node (flock: released by the
        kernel if the holder dies, so a killed runner never leaves it stuck).

        Raises:
            WorkloadBusy: another checkpoint or restore of the workload holds it.
        """
        _check_name(workload)
        d = self.root / workload
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise WorkloadBusy(f"workload {workload}: another checkpoint or restore is running on this node",
                                   fix="nothing to do: the running one covers this tick") from None
            yield
        finally:
            os.close(fd)

    # --- node fingerprints, as each node last reported them -------------------------------
    def mark_drained(self, node: str, record: dict) -> Path:
        """Record that ``node`` was drained (what went where, by which flow run)."""
        path = self.root / ".nodes" / f"{node}.drained"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, json.dumps(record))
        return path

    def put_node_fingerprint(self, node: str, fp: Fingerprint) -> None:
        _check_name(node)
        d = self.root / ".nodes"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(d / f"{node}.json", fp.model_dump_json(indent=2))

    def node_fingerprints(self) -> dict[str, Fingerprint]:
        d = self.root / ".nodes"
        if not d.exists():
            return {}
        return {p.stem: Fingerprint.model_validate_json(p.read_text()) for p in d.glob("*.json")}

    def apply_retention(self, workload: str, rule: "Retention | None" = None, now: datetime | None = None,
                        orphan_grace: timedelta = timedelta(hours=1)) -> list[tuple[str, str]]:
        """Delete what the retention policy names, and orphan bytes older than the grace period.

        The newest valid checkpoint is never deleted (policies.retention guarantees it, and
        this checks again: a policy bug must not cost the last good checkpoint).
        """
        from ckptflow.policies.retention import to_delete

        now = now or utcnow()
        manifests = self.list(workload)
        newest_valid = next((m.id for m in manifests if m.state.restorable), None)
        gone = []
        for m, why in to_delete(manifests, now, rule):
            if m.id == newest_valid:
                raise StoreError(f"retention wanted to delete {m.id}, the newest valid checkpoint of {workload}")
            self.delete(m)
            gone.append((m.id, why))
        for d in self.orphans(workload, orphan_grace):
            shutil.rmtree(d, ignore_errors=True)
            gone.append((d.name, "orphan bytes without a manifest"))
        return gone

    def orphans(self, workload: str, older_than: timedelta) -> list[Path]:
        """Checkpoint directories without a manifest, older than ``older_than``."""
        _check_name(workload)
        wdir = self.root / workload
        cutoff = time.time() - older_than.total_seconds()
        if not wdir.exists():
            return []
        return [d for d in wdir.iterdir()
                if d.is_dir() and not (d / MANIFEST).exists() and d.stat().st_mtime < cutoff]


def _store_error(e: OSError, where: Path) -> StoreError:
    if e.errno == errno.ENOSPC:
        return StorageFull(f"no space left on the checkpoint volume while writing {where}",
                           fix="free space or lower retention; the partial checkpoint was discarded")
    return StoreError(f"store I/O failed at {where}: {e}")
