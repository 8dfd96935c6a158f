"""Local checkpoint store: one directory per workload and checkpoint id.

Layout::

    ROOT/<workload>/<checkpoint-id>/images/...   CRIU image files (0600)
    ROOT/<workload>/<checkpoint-id>/manifest.json written last, atomically
    ROOT/<workload>/.lock                         flock of the workload on this node
    ROOT/.replicas/<workload>/<netns>.json        replicas scale-up started on this node
    ROOT/.nodes/<node>.drained                    the node's drained mark (what went where)

A checkpoint exists only once its manifest exists: a crash mid-write leaves bytes with no
manifest (an orphan, removed by retention after a grace period), never a listed checkpoint.

A LocalStore is also a checkpoint tier (store.tier's ``CheckpointTier``, copies ``CopyTier.node``):
``push`` copies a checkpoint of another store into this one and ``pull`` copies one of this
store into another, each file checked against the manifest, the manifest written last; on the
same store both are no-ops. Fleet state (placements, fingerprints, open alerts) is
store.fleetstate's; a local fleet keeps it under the same root.

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
from ckptflow.models import (CKPT_ID_RE, CheckpointCopy, CheckpointKind, CheckpointState, CopyTier, FileEntry,
                             EngineProbe, Fingerprint, Manifest, ManifestProbe, check_ckpt_id, check_name,
                             utcnow)

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
    """Checkpoints under a root directory (0700 directories, 0600 files); a ``CheckpointTier``.

    Args:
        root: the directory (created by the first checkpoint).
    """

    def __init__(self, root: Path | str):
        self.root = Path(root)

    # --- writing -----------------------------------------------------------------------
    def begin(self, workload: str, *, node: str) -> PendingCheckpoint:
        check_name(workload)
        return self._pending(workload, new_checkpoint_id(), node)

    def _pending(self, workload: str, checkpoint: str, node: str) -> PendingCheckpoint:
        d = self.root / workload / checkpoint
        try:
            os.makedirs(d / IMAGES, mode=0o700)
        except OSError as e:
            raise _store_error(e, d) from e
        for p in (self.root, self.root / workload, d):
            os.chmod(p, 0o700)
        return PendingCheckpoint(workload=workload, node=node, id=checkpoint, dir=d)

    def commit(self, pending: PendingCheckpoint, *, timings: dict[str, float] | None = None,
               fingerprint: Fingerprint | None = None, probe: ManifestProbe | EngineProbe | dict | None = None,
               kind: CheckpointKind | str = CheckpointKind.heartbeat, pid: int | None = None,
               gpu_footprint_bytes: int = 0, parent: str | None = None, gpu_pids: list[int] | None = None,
               gpu_footprints: dict[str, int] | None = None) -> Manifest:
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
                         gpu_footprints=gpu_footprints or {},
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
        check_name(workload)
        out = []
        wdir = self.root / workload
        if not wdir.exists():
            return []
        for d in wdir.iterdir():
            mpath = d / MANIFEST
            if mpath.exists():
                out.append(Manifest.model_validate_json(mpath.read_text()))
        return sorted(out, key=lambda m: (m.created, m.id), reverse=True)

    def get(self, workload: str, checkpoint: str) -> Manifest:
        check_name(workload)
        check_ckpt_id(checkpoint)
        mpath = self.root / workload / checkpoint / MANIFEST
        if not mpath.exists():
            raise CheckpointNotFound(f"no checkpoint {checkpoint} of workload {workload} in {self.root}",
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

    def ids(self, workload: str) -> list[str]:
        """Ids of the workload's checkpoints here (with a manifest), newest first."""
        return [m.id for m in self.list(workload)]

    def manifests(self, workload: str) -> list[Manifest]:
        """The same as ``list`` (the tier interface's name)."""
        return self.list(workload)

    def manifest(self, workload: str, checkpoint: str) -> Manifest:
        """The same as ``get`` (the tier interface's name).

        Raises:
            CheckpointNotFound: no such checkpoint here.
        """
        return self.get(workload, checkpoint)

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
        """Rewrite ``m``'s manifest with a new state; ``probe``: fields of its probe to replace
        (``restores=m.probe.restores.adding(s)``, ``verify_timings=...``), validated."""
        new = m.model_copy(update={"state": state, "state_reason": reason,
                                   "probe": m.probe.updated(**probe) if probe else m.probe})
        write_json_atomic(self.root / m.workload / m.id / MANIFEST, new.model_dump_json(indent=2))
        return new

    def add_copy(self, m: Manifest, tier: CopyTier, location: str) -> Manifest:
        """Record in this node's manifest that another place holds the same bytes."""
        cur = self.get(m.workload, m.id)
        new = cur.with_copy(tier, location)
        if new is not cur:
            write_json_atomic(self.root / m.workload / m.id / MANIFEST, new.model_dump_json(indent=2))
        return new

    # --- the newest heartbeat's export context, for the turn-end export beside it -----------
    def put_export_context(self, workload: str, context_json: str) -> None:
        """Keep the context the newest heartbeat weighed ``workload``'s sessions in (its MTBF
        estimate, an announced interruption): the node-local turn-end export (runners/turns.py)
        weighs sessions between heartbeats in it."""
        d = self.root / ".export-context"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(d / f"{check_name(workload)}.json", context_json)

    def export_context(self, workload: str) -> str | None:
        p = self.root / ".export-context" / f"{check_name(workload)}.json"
        return p.read_text() if p.exists() else None

    # --- replicas scale_up started on this node (so a later scale_down finds them) -----
    def put_replica(self, workload: str, replica: dict) -> None:
        check_name(workload)
        d = self.root / ".replicas" / workload
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(d / f"{check_name(replica['netns'])}.json", json.dumps(replica))

    def replicas(self, workload: str) -> list[dict]:
        d = self.root / ".replicas" / check_name(workload)
        return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.exists() else []

    def drop_replica(self, workload: str, netns: str) -> None:
        (self.root / ".replicas" / check_name(workload) / f"{check_name(netns)}.json").unlink(missing_ok=True)

    def delete(self, m: Manifest) -> None:
        """Delete one checkpoint: manifest first, so a crash never leaves a listed checkpoint
        without its bytes."""
        d = self.root / m.workload / m.id
        (d / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)

    @contextmanager
    def lock(self, workload: str, wait_s: float = 0.0) -> Iterator[None]:
        """Exclusive lock of one workload on this node (flock: released by the kernel if the
        holder dies, so a killed runner never leaves it stuck); ``wait_s``: how long to wait for
        a holder (0: not at all).

        Raises:
            WorkloadBusy: another checkpoint or restore of the workload holds it.
        """
        check_name(workload)
        d = self.root / workload
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise WorkloadBusy(f"workload {workload}: another checkpoint or restore is running on "
                                           "this node", fix="nothing to do: the running one covers this tick") from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    # --- the node's drained mark (a record on the node itself, beside the fleet state's
    # ``.nodes/<node>.json`` fingerprints of a local fleet) -----------------------------------
    def mark_drained(self, node: str, record: dict) -> Path:
        """Record that ``node`` was drained (what went where, by which flow run)."""
        path = self.root / ".nodes" / f"{check_name(node)}.drained"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(path, json.dumps(record))
        return path

    # --- copies of checkpoints from another tier (S3Tier.pull, LocalStore.pull / push) --------
    def usable_copy(self, workload: str, checkpoint: str) -> Manifest | None:
        """This store's copy of a checkpoint, unless there is none or it failed verification
        (a copy from a tier then replaces it: the tier's bytes were checked when pushed)."""
        try:
            have = self.get(workload, checkpoint)
        except CheckpointNotFound:
            return None
        return None if have.state == CheckpointState.verify_failed else have

    def begin_copy(self, workload: str, checkpoint: str, *, node: str) -> PendingCheckpoint:
        """An empty checkpoint directory with a given id, for a copy from a tier to write its
        image files into; whatever was there (a copy that failed verification, orphan bytes)
        is removed first. Finish with ``commit_copy``, or ``abort``."""
        check_name(workload)
        check_ckpt_id(checkpoint)
        d = self.root / workload / checkpoint
        if d.exists():
            (d / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(d)
        return self._pending(workload, checkpoint, node)

    def commit_copy(self, pending: PendingCheckpoint, m: Manifest) -> Manifest:
        """Write the manifest of a copied checkpoint, last and atomically. The caller checked
        every byte against ``m`` (its files are not hashed again here)."""
        if (m.workload, m.id) != (pending.workload, pending.id):
            raise StoreError(f"manifest {m.workload}/{m.id} does not belong in {pending.dir}")
        write_json_atomic(pending.dir / MANIFEST, m.model_dump_json(indent=2))
        return m

    # --- this store as a tier ----------------------------------------------------------------
    copy_tier = CopyTier.node

    @property
    def location(self) -> str:
        """The store's root directory (manifests name its copies by node: ``node:<name>``)."""
        return str(self.root)

    def _same(self, other: "LocalStore") -> bool:
        return self.root.resolve() == other.root.resolve()

    def _copy_in(self, src: "LocalStore", m: Manifest, node: str) -> PendingCheckpoint:
        """Copy the image files of ``src``'s checkpoint ``m`` into a new checkpoint directory here,
        checking each against the manifest; the caller commits or aborts it."""
        from_dir = src.images_dir(m)
        pending = self.begin_copy(m.workload, m.id, node=node)
        try:
            for f in m.files:
                target = pending.images_dir / f.path
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                shutil.copyfile(from_dir / f.path, target)
                os.chmod(target, 0o600)
            self.verify_bytes(m)
        except BaseException as e:
            self.abort(pending)
            if isinstance(e, FileNotFoundError):
                raise ChecksumMismatch(f"checkpoint {m.id} of {m.workload}: {e.filename} is missing in {src.root}",
                                       fix="restore from an older checkpoint; this one is corrupt") from None
            if isinstance(e, OSError):
                raise _store_error(e, pending.dir) from e
            raise
        return pending

    def push(self, local: "LocalStore", m: Manifest) -> dict:
        """Copy checkpoint ``m`` of ``local`` into this store, every file checked against the
        manifest, the manifest written last. Pushing a store into itself, or a checkpoint this
        store already holds (and has not failed verification), copies nothing.

        Returns:
            ``uploaded_bytes`` (copied), ``skipped_bytes``, ``seconds``.

        Raises:
            ChecksumMismatch: a file of ``local`` is missing or differs (nothing is left here).
            StorageFull, StoreError: writing here failed (nothing is left here).
        """
        t0 = time.perf_counter()
        if self._same(local) or self.usable_copy(m.workload, m.id) is not None:
            return {"uploaded_bytes": 0, "skipped_bytes": m.bytes, "seconds": 0.0}
        current = local.get(m.workload, m.id)
        self.commit_copy(self._copy_in(local, current, current.node), current)
        return {"uploaded_bytes": m.bytes, "skipped_bytes": 0, "seconds": round(time.perf_counter() - t0, 3)}

    def pull(self, local: "LocalStore", workload: str, checkpoint: str, node: str,
             remote: Manifest | None = None) -> tuple[Manifest, dict]:
        """Copy a checkpoint of this store into ``local``, the store of ``node`` (every file
        checked, the manifest written last, listing the new copy ``node:<node>``). A copy in
        ``local`` that has not failed verification is kept; pulling into this same store
        returns its own manifest. ``remote``: this store's manifest, when the caller read it.

        Returns:
            (the manifest in ``local``, ``{"downloaded_bytes", "seconds"}``).

        Raises:
            CheckpointNotFound: no such checkpoint here.
            ChecksumMismatch: a file here is missing or differs (nothing is left in ``local``).
        """
        t0 = time.perf_counter()
        if self._same(local):
            return self.get(workload, checkpoint), {"downloaded_bytes": 0, "seconds": 0.0}
        have = local.usable_copy(workload, checkpoint)
        if have is not None:
            return have, {"downloaded_bytes": 0, "seconds": 0.0}
        remote = remote or self.get(workload, checkpoint)
        pending = local._copy_in(self, remote, node)
        try:
            m = local.commit_copy(pending, remote.with_copy(CopyTier.node, node))
        except BaseException:
            local.abort(pending)
            raise
        return m, {"downloaded_bytes": m.bytes, "seconds": round(time.perf_counter() - t0, 3)}

    def apply_retention(self, workload: str, rule: "Retention | None" = None, now: datetime | None = None,
                        orphan_grace: timedelta = timedelta(hours=1)) -> list[tuple[str, str]]:
        """Delete what the retention policy names, and orphan bytes older than the grace period.

        The newest valid checkpoint is never deleted (policies.retention guarantees it, and
        this checks again: a policy bug must not cost the last good checkpoint).

        Returns:
            (checkpoint id or orphan directory name, why) of each deletion.

        Raises:
            StoreError: the rule named the newest valid checkpoint (nothing is deleted).
        """
        from ckptflow.policies.retention import to_delete

        now = now or utcnow()
        manifests = self.list(workload)
        newest_valid = next((m.id for m in manifests if m.state.restorable), None)
        drop = to_delete(manifests, now, rule)
        if any(m.id == newest_valid for m, _ in drop):
            raise StoreError(f"retention wanted to delete {newest_valid}, the newest valid checkpoint of {workload}")
        gone = []
        for m, why in drop:
            self.delete(m)
            gone.append((m.id, why))
        for d in self.orphans(workload, orphan_grace):
            shutil.rmtree(d, ignore_errors=True)
            gone.append((d.name, "orphan bytes without a manifest"))
        return gone

    def prune(self, rule: "Retention | None" = None, now: datetime | None = None,
              orphan_grace: timedelta = timedelta(hours=1)) -> dict:
        """``apply_retention`` for every workload with a directory here.

        Returns:
            ``manifests_deleted`` (``workload``, ``checkpoint``, ``why`` each; orphan bytes
            too), ``manifests_kept``, ``bytes_freed`` (of the deleted manifests),
            ``chunks_deleted`` (two-tier chunks no remaining checkpoint names: collect_chunks).
        """
        gone, kept, freed = [], 0, 0
        for workload in self.workloads():
            try:
                check_name(workload)
            except ValueError:  # not a workload's directory (lost+found, ...)
                continue
            listed = self.list(workload)
            if listed and all(m.kind == CheckpointKind.engine_template for m in listed):
                continue  # templates: retain_templates below (keep-N would take ones still bound)
            sizes = {m.id: m.bytes for m in listed}
            deleted = self.apply_retention(workload, rule, now, orphan_grace)
            gone += [{"workload": workload, "checkpoint": i, "why": why} for i, why in deleted]
            freed += sum(sizes.get(i, 0) for i, _ in deleted)
            kept += len(sizes) - sum(i in sizes for i, _ in deleted)
        gone += self.retain_templates(rule, now)
        chunks = self.collect_chunks(orphan_grace)
        return {"manifests_deleted": gone, "chunks_deleted": chunks.get("chunks_deleted", 0),
                "bytes_freed": freed + chunks.get("bytes_freed", 0), "manifests_kept": kept,
                **({"chunks_skipped": chunks["skipped"]} if "skipped" in chunks else {})}

    def _groups(self) -> Iterator[tuple[str, list[Manifest]]]:
        for workload in self.workloads():
            try:
                yield workload, self.list(workload)
            except ValueError:  # not a workload's directory
                continue

    def retain_templates(self, rule: "Retention | None" = None, now: datetime | None = None) -> list[dict]:
        """Delete two-tier templates nothing needs any more (policies.retention.templates_to_delete:
        kept while the newest of their source workload or bound to a restorable session
        checkpoint here). Returns ``workload``, ``checkpoint``, ``why`` of each deletion."""
        from ckptflow.policies.retention import templates_to_delete

        groups = dict(self._groups())
        bound = {m.probe.template.id for ms in groups.values() for m in ms if m.probe.template
                 if m.kind == CheckpointKind.sessions and m.state.restorable}
        gone = []
        for workload, ms in groups.items():
            if ms and all(m.kind == CheckpointKind.engine_template for m in ms):
                for m, why in templates_to_delete(ms, bound, now or utcnow(), rule):
                    self.delete(m)
                    gone.append({"workload": workload, "checkpoint": m.id, "why": why})
        return gone

    def collect_chunks(self, grace: timedelta = timedelta(hours=1)) -> dict:
        """Delete two-tier chunks (``ROOT/chunks``) that no checkpoint here names any more and
        nobody relied on within ``grace``. Refuses (``skipped``) while a template or session
        checkpoint does not list its chunks (written before chunk lists existed): its chunks
        would look unused.

        Returns:
            ``chunks_deleted``, ``bytes_freed``, ``chunks_kept``; or ``{"skipped": why}``.
        """
        from ckptflow.store.chunks import REFS_FILE, ChunkStore

        referenced: set[str] = set()
        for _, manifests in self._groups():
            for m in manifests:
                refs = self.images_dir(m) / REFS_FILE
                if refs.exists():
                    referenced.update(json.loads(refs.read_text()))
                elif m.kind in (CheckpointKind.engine_template, CheckpointKind.sessions):
                    return {"skipped": f"{m.workload}/{m.id} ({m.kind}) does not list its chunks; "
                                       "delete it or take a new heartbeat before chunks are collected"}
        n, freed = ChunkStore(self.root).collect(referenced, grace.total_seconds())
        return {"chunks_deleted": n, "bytes_freed": freed, "chunks_kept": len(referenced)}

    def orphans(self, workload: str, older_than: timedelta) -> list[Path]:
        """Checkpoint directories (named like a checkpoint id) without a manifest, older than
        ``older_than``. Other directories are never orphans: ``ROOT/chunks/<xx>`` of two-tier
        checkpoints must not be mistaken for one."""
        check_name(workload)
        wdir = self.root / workload
        cutoff = time.time() - older_than.total_seconds()
        if not wdir.exists():
            return []
        return [d for d in wdir.iterdir()
                if d.is_dir() and CKPT_ID_RE.match(d.name) and not (d / MANIFEST).exists()
                and d.stat().st_mtime < cutoff]


def _store_error(e: OSError, where: Path) -> StoreError:
    if e.errno == errno.ENOSPC:
        return StorageFull(f"no space left on the checkpoint volume while writing {where}",
                           fix="free space or lower retention; the partial checkpoint was discarded")
    return StoreError(f"store I/O failed at {where}: {e}")
