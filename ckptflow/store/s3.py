"""S3 tier of the checkpoint store (boto3, no Prefect): content-addressed chunks + manifests.

Layout in the bucket::

    PREFIX/chunks/<sha256>                         one chunk of an image file (CHUNK bytes)
    PREFIX/manifests/<workload>/<checkpoint>.json  the manifest, uploaded last
    PREFIX/leases/<uuid>.json, PREFIX/locks/prune.json   push leases and the prune lock (see prune)

(The fleet state under ``PREFIX/placements``, ``alerts`` and ``nodes`` is store.fleetstate's
``S3FleetState``; both reach the bucket through ``S3Objects`` here.)

A checkpoint is pushed from the node's local store (where CRIU wrote it, and where the
newest copy stays for a fast restore in place) and pulled into another node's local store.
Chunks are addressed by their sha256, so a second heartbeat of the same worker, and workers
with the same weights, upload only chunks the bucket does not hold yet. Every downloaded
chunk is checked against its address before it is written. ``S3Tier`` implements
store.tier's ``CheckpointTier``.

Example:
    >>> s3 = S3Tier(bucket="ckpt", endpoint_url="http://127.0.0.1:8333")       # doctest: +SKIP
    >>> s3.push(local, manifest)            # -> {"uploaded_bytes": ..., "skipped_bytes": ...}
    >>> s3.pull(other_local, "chat", manifest.id, "node-b")
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from ckptflow.errors import ChecksumMismatch, CheckpointNotFound, StorageUnavailable, StoreError
from ckptflow.models import CheckpointKind, CheckpointState, CopyTier, Manifest, _check_ckpt_id, _check_name, utcnow
from ckptflow.store.local import LocalStore

if TYPE_CHECKING:
    from ckptflow.policies.retention import Retention

LEASE_TTL_S = 6 * 3600   # a push lease older than this is from a crashed push
PRUNE_TTL_S = 3600       # a prune lock older than this is from a crashed prune
CHUNK = 8 << 20      # small enough that a changed KV region re-uploads little, large enough for S3
THREADS = 16         # parallel PUT/GET of chunks (I/O bound; the GIL is released)


class S3Objects:
    """The objects under one prefix of one bucket, every call's error typed
    (``StorageUnavailable``: retry; a missing key: ``ClientError`` NoSuchKey, for the caller to
    read as "none"). What the S3 tier and the S3 fleet state share; one boto3 client each,
    or one between them (``client``).

    Args:
        bucket: the bucket's name.
        prefix: key prefix inside it (``storage.prefix``, default ``ckptflow``).
        endpoint_url: S3 endpoint (None: AWS).
        region: S3 region (default us-east-1).
        server_side_encryption: SSE mode passed on every PUT (None: none).
        client: a boto3 S3 client to use instead of a new one.
        pool: connections the new client keeps (parallel chunk transfers need one each).
        timeout_s: connect and read timeout of each call.
        attempts: tries per call (botocore's standard retry mode).
    """

    def __init__(self, bucket: str, prefix: str = "ckptflow", endpoint_url: str | None = None,
                 region: str | None = None, server_side_encryption: str | None = "AES256", client=None,
                 pool: int = 10, timeout_s: float = 60, attempts: int = 5):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.sse = server_side_encryption
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region or "us-east-1",
                                  config=Config(max_pool_connections=pool, connect_timeout=timeout_s,
                                                read_timeout=timeout_s,
                                                retries={"max_attempts": attempts, "mode": "standard"},
                                                # every chunk is checked against its sha256
                                                # address here; botocore's own response
                                                # checksum would hash each byte a second time
                                                response_checksum_validation="when_required"))
        self.s3 = client

    @property
    def location(self) -> str:
        """``s3://bucket/prefix``: where these objects are, as manifests and messages name it."""
        return f"s3://{self.bucket}/{self.prefix}"

    def _key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts])

    def _put_kw(self) -> dict:
        return {"ServerSideEncryption": self.sse} if self.sse else {}

    def _call(self, what: str, fn, *a, **kw):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*a, **kw)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise
            raise StorageUnavailable(f"S3 {what} failed: {code or e}",
                                     fix="check the S3 endpoint, bucket and credentials") from e
        except BotoCoreError as e:
            raise StorageUnavailable(f"S3 {what} failed: {e}", fix="check that the S3 endpoint is reachable") from e

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._call("head", self.s3.head_object, Bucket=self.bucket, Key=key)
            return True
        except ClientError:
            return False

    def _put(self, what: str, key: str, body: bytes) -> None:
        self._call(what, self.s3.put_object, Bucket=self.bucket, Key=key, Body=body, **self._put_kw())

    def _get(self, what: str, key: str) -> bytes | None:
        """The object's body, None when there is no such key."""
        from botocore.exceptions import ClientError

        try:
            return self._call(what, self.s3.get_object, Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError:  # NoSuchKey
            return None

    def _delete(self, key: str) -> None:
        self._call("delete", self.s3.delete_object, Bucket=self.bucket, Key=key)

    def _keys(self, prefix: str) -> list[dict]:
        """Every object under ``prefix`` (all pages), errors typed like every other call."""
        pages = self._call(f"list {prefix}", lambda: list(
            self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)))
        return [o for page in pages for o in page.get("Contents", [])]

    def _bodies(self, folder: str) -> dict[str, bytes]:
        """name (without .json) -> body, for each object in ``PREFIX/folder/``."""
        return {o["Key"].rsplit("/", 1)[1].removesuffix(".json"):
                self._call(f"get {folder}", self.s3.get_object, Bucket=self.bucket, Key=o["Key"])["Body"].read()
                for o in self._keys(self._key(folder) + "/")}


class S3Tier(S3Objects):
    """Push and pull checkpoints between a node's LocalStore and an S3-compatible bucket
    (store.tier's ``CheckpointTier``; the copies it holds are ``CopyTier.s3``).

    Args:
        bucket, prefix, endpoint_url, region, server_side_encryption, client, timeout_s,
            attempts: as ``S3Objects``.
        threads: parallel PUT/GET of chunks.
        key: 32-byte client-side encryption key (AES-256-GCM per chunk); None: none.

    Raises:
        StoreError: ``key`` is not 32 bytes.
    """

    copy_tier = CopyTier.s3

    def __init__(self, bucket: str, prefix: str = "ckptflow", endpoint_url: str | None = None,
                 region: str | None = None, server_side_encryption: str | None = "AES256",
                 client=None, threads: int = THREADS, key: bytes | None = None, timeout_s: float = 60,
                 attempts: int = 5):
        if key is not None and len(key) != 32:
            raise StoreError(f"client-side encryption key has {len(key)} bytes; AES-256-GCM needs 32",
                             fix="generate one with: python -c 'import os,base64;print(base64.b64encode(os.urandom(32)).decode())'")
        super().__init__(bucket, prefix, endpoint_url, region, server_side_encryption, client,
                         pool=threads * 2, timeout_s=timeout_s, attempts=attempts)
        self.key = key
        self.threads = threads

    @classmethod
    def from_storage(cls, storage, key: bytes | None = None) -> "S3Tier":
        return cls(bucket=storage.bucket, prefix=storage.prefix, endpoint_url=storage.endpoint_url,
                   region=storage.region, server_side_encryption=storage.server_side_encryption,
                   key=key if key is not None else _load_key(storage))

    # Chunks keep their plaintext sha256 as address (dedup still works); with a key, the object
    # is nonce || AES-256-GCM(chunk), the address as associated data, so a swapped object fails.
    def _seal(self, digest: str, data: bytes) -> bytes:
        if self.key is None:
            return data
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        nonce = os.urandom(12)
        return nonce + AESGCM(self.key).encrypt(nonce, data, digest.encode())

    def _open(self, digest: str, blob: bytes) -> bytes:
        if self.key is None:
            return blob
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        try:
            return AESGCM(self.key).decrypt(blob[:12], blob[12:], digest.encode())
        except (InvalidTag, ValueError):
            raise ChecksumMismatch(f"chunk {digest[:16]}... does not decrypt with this node's key",
                                   fix="the chunk is corrupt or was written with another key") from None

    # --- push ------------------------------------------------------------------------------
    def push(self, local: LocalStore, m: Manifest) -> dict:
        """Upload the checkpoint's new chunks in parallel, then its manifest (last), under a
        lease that keeps ``prune`` from deleting a chunk this push counts on (see prune).

        Returns:
            ``uploaded_bytes``, ``skipped_bytes`` (chunks the bucket held already), ``chunks``,
            ``seconds``.

        Raises:
            ChecksumMismatch: the local bytes differ from their manifest (nothing is uploaded).
            StorageUnavailable: the bucket is unreachable or being pruned (retry later).
        """
        lease = self._lease()
        try:
            return self._push(local, m)
        finally:
            self._delete(lease)

    def _push(self, local: LocalStore, m: Manifest) -> dict:
        images = local.verify_bytes(m)  # never upload bytes that already differ from their manifest
        t0 = time.perf_counter()
        jobs = [(f.path, off, min(CHUNK, f.size - off)) for f in m.files for off in range(0, max(f.size, 1), CHUNK)]

        def one(job) -> tuple[str, int, bool]:
            path, off, n = job
            with open(images / path, "rb") as fh:
                fh.seek(off)
                data = fh.read(n)
            digest = hashlib.sha256(data).hexdigest()
            key = self._key("chunks", digest)
            if self._exists(key):
                return digest, len(data), False
            body = self._seal(digest, data)
            self._call("put", self.s3.put_object, Bucket=self.bucket, Key=key, Body=body,
                       ChecksumSHA256=_b64(hashlib.sha256(body).hexdigest()), **self._put_kw())
            return digest, len(data), True

        # A two-tier checkpoint names chunks outside its images (weights, session KV): they go up
        # under their own sha256, as image chunks do, so a pull can rebuild the node's chunk store.
        from ckptflow.store.chunks import REFS_FILE, ChunkStore

        refs = json.loads((images / REFS_FILE).read_text()) if (images / REFS_FILE).exists() else []
        outside = ChunkStore(local.root)

        def one_outside(digest: str) -> tuple[str, int, bool]:
            key = self._key("chunks", digest)
            if self._exists(key):
                return digest, outside.path(digest).stat().st_size, False
            data = outside.read(digest)  # checked against its name before it leaves the node
            body = self._seal(digest, data)
            self._call("put", self.s3.put_object, Bucket=self.bucket, Key=key, Body=body,
                       ChecksumSHA256=_b64(hashlib.sha256(body).hexdigest()), **self._put_kw())
            return digest, len(data), True

        with ThreadPoolExecutor(max_workers=self.threads) as ex:
            results = list(ex.map(one, jobs))
            results += list(ex.map(one_outside, refs))
        chunks: dict[str, list[str]] = {}
        for (path, _, _), (digest, _, _) in zip(jobs, results):
            chunks.setdefault(path, []).append(digest)
        local_m = local.add_copy(m, CopyTier.s3, self.location)  # written before the manifest goes up:
        remote = local_m.model_copy(update={"probe": {**local_m.probe, "s3_chunk_size": CHUNK,  # it lists both
                                                      "s3_chunks": chunks,
                                                      **({"s3_outside_chunks": refs} if refs else {})}})
        self._put("put manifest", self._manifest_key(m.workload, m.id), remote.model_dump_json(indent=2).encode())
        up = sum(n for _, n, new in results if new)
        return {"uploaded_bytes": up, "skipped_bytes": sum(n for _, n, new in results if not new),
                "chunks": len(results), "seconds": round(time.perf_counter() - t0, 3)}

    def _manifest_key(self, workload: str, checkpoint: str) -> str:
        return self._key("manifests", _check_name(workload), f"{_check_ckpt_id(checkpoint)}.json")

    # --- prune: retention in the bucket, then chunks no manifest references -----------------
    # A push checks which chunks the bucket already holds and uploads only the others, so a
    # chunk deleted between that check and the push's manifest would leave a manifest without
    # its bytes. Push and prune therefore never overlap: a push writes a lease, then looks for
    # the prune lock (and backs off if it is there); prune writes the lock, then looks for
    # leases (and gives up if any is live). Whichever wrote second sees the other. Deleting a
    # manifest (delete, apply_retention) needs neither: no push counts on another's manifest.
    def _stamp(self, key: str) -> None:
        import json

        self._put("put", key, json.dumps({"at": time.time()}).encode())

    def _stamp_at(self, key: str) -> float | None:
        import json

        body = self._get("get", key)
        return None if body is None else float(json.loads(body)["at"])

    def _lease(self) -> str:
        import uuid

        key = self._key("leases", f"{uuid.uuid4().hex}.json")
        self._stamp(key)
        since = self._stamp_at(self._key("locks", "prune.json"))
        if since is not None and time.time() - since < PRUNE_TTL_S:
            self._delete(key)
            raise StorageUnavailable(f"s3://{self.bucket}/{self.prefix} is being pruned (since "
                                     f"{time.time() - since:.0f} s); the upload waits for it",
                                     fix="nothing to do: the local copy stands and the next heartbeat pushes it")
        return key

    def leases(self) -> list[str]:
        """Keys of the push leases in the bucket (live ones and those a crashed push left;
        ``prune`` tells them apart by age, ``LEASE_TTL_S``). None once every push is done."""
        return [o["Key"] for o in self._keys(self._key("leases") + "/")]

    def delete(self, m: Manifest) -> None:
        """Delete the bucket's copy of one checkpoint: its manifest (its chunks go at the next
        ``prune``, once no manifest references them)."""
        self._delete(self._manifest_key(m.workload, m.id))

    def _retain(self, workload: str, ms: list[Manifest], now: datetime,
                rule: "Retention | None") -> tuple[list[tuple[str, str]], list[Manifest]]:
        """Delete the manifests of ``ms`` (one workload's) that the rule names: (deleted, kept)."""
        from ckptflow.policies.retention import to_delete

        newest_valid = max((m for m in ms if m.state.restorable), key=lambda m: (m.created, m.id), default=None)
        drop = {m.id: why for m, why in to_delete(ms, now, rule)}
        if newest_valid is not None and newest_valid.id in drop:
            raise StoreError(f"retention wanted to delete {newest_valid.id}, the newest valid checkpoint "
                             f"of {workload} in the bucket")
        gone, kept = [], []
        for m in ms:
            if m.id in drop:
                self.delete(m)
                gone.append((m.id, drop[m.id]))
            else:
                kept.append(m)
        return gone, kept

    def _retain_templates(self, ms: list[Manifest], bound: set, now: datetime,
                          rule: "Retention | None") -> tuple[list[tuple[str, str]], list[Manifest]]:
        from ckptflow.policies.retention import templates_to_delete

        drop = {m.id: why for m, why in templates_to_delete(ms, bound, now, rule)}
        for m in ms:
            if m.id in drop:
                self.delete(m)
        return [(i, why) for i, why in drop.items()], [m for m in ms if m.id not in drop]

    def apply_retention(self, workload: str, rule: "Retention | None" = None,
                        now: datetime | None = None) -> list[tuple[str, str]]:
        """Delete the bucket's manifests of ``workload`` that the retention rule names, never its
        newest valid one; returns (checkpoint id, why) of each. Chunks stay until ``prune``.

        Raises:
            StoreError: the rule named the newest valid checkpoint (a policy bug; nothing of it
                is deleted).
        """
        return self._retain(workload, self.manifests(workload), now or utcnow(), rule)[0]

    def prune(self, rule: "Retention | None" = None, now: datetime | float | None = None) -> dict:
        """Apply the retention rule to the bucket's manifests (never the newest valid one of a
        workload), then delete the chunks no remaining manifest references.

        Returns:
            ``manifests_deleted`` (``workload``, ``checkpoint``, ``why`` each), ``manifests_kept``,
            ``chunks_deleted``, ``bytes_freed``; or ``{"skipped": reason}`` while pushes are running.
        """
        if now is None:
            now = utcnow()
        elif not isinstance(now, datetime):
            now = datetime.fromtimestamp(now, timezone.utc)
        lock = self._key("locks", "prune.json")
        self._stamp(lock)
        try:
            live = [k for k in self.leases() if (self._stamp_at(k) or 0) > time.time() - LEASE_TTL_S]
            if live:
                return {"skipped": f"{len(live)} push(es) in progress; prune again later"}
            kept, gone = [], []
            by_workload: dict[str, list[Manifest]] = {}
            for o in self._keys(self._key("manifests") + "/"):
                workload, name = o["Key"].rsplit("/", 2)[-2:]
                by_workload.setdefault(workload, []).append(self.manifest(workload, name.removesuffix(".json")))
            bound = {m.probe.get("template") for ms in by_workload.values() for m in ms
                     if m.kind == CheckpointKind.sessions and m.state.restorable}
            for workload, ms in by_workload.items():
                if ms and all(m.kind == CheckpointKind.template for m in ms):  # keep-N would take bound ones
                    deleted, still = self._retain_templates(ms, bound, now, rule)
                else:
                    deleted, still = self._retain(workload, ms, now, rule)
                gone += [{"workload": workload, "checkpoint": i, "why": why} for i, why in deleted]
                kept += still
            referenced = {d for m in kept for ds in m.probe.get("s3_chunks", {}).values() for d in ds}
            referenced |= {d for m in kept for d in m.probe.get("s3_outside_chunks", [])}
            freed = chunks = 0
            for o in self._keys(self._key("chunks") + "/"):
                if o["Key"].rsplit("/", 1)[1] not in referenced:
                    self._delete(o["Key"])
                    freed += o["Size"]
                    chunks += 1
            return {"manifests_deleted": gone, "chunks_deleted": chunks, "bytes_freed": freed,
                    "manifests_kept": len(kept)}
        finally:
            self._delete(lock)

    def set_state(self, m: Manifest, state: CheckpointState, reason: str | None = None) -> Manifest:
        """Rewrite the bucket's manifest with a new state (e.g. invalidated), keeping its chunk map."""
        remote = self.manifest(m.workload, m.id).model_copy(update={"state": state, "state_reason": reason})
        self._put("put manifest", self._manifest_key(m.workload, m.id), remote.model_dump_json(indent=2).encode())
        return remote

    # --- read ------------------------------------------------------------------------------
    def ids(self, workload: str) -> list[str]:
        """Ids of the workload's checkpoints in the bucket, newest first (ids sort by time)."""
        _check_name(workload)
        return sorted((o["Key"].rsplit("/", 1)[1].removesuffix(".json")
                       for o in self._keys(self._key("manifests", workload) + "/")), reverse=True)

    def list(self, workload: str) -> list[str]:
        """The same as ``ids`` (the name runners.node and older callers use)."""
        return self.ids(workload)

    def manifests(self, workload: str) -> list[Manifest]:
        """The bucket's manifests of ``workload``, newest first (one GET each)."""
        return [self.manifest(workload, i) for i in self.ids(workload)]

    def manifest(self, workload: str, checkpoint: str) -> Manifest:
        """The bucket's manifest (it lists its chunks in ``probe["s3_chunks"]``).

        Raises:
            CheckpointNotFound: the bucket holds no such checkpoint.
        """
        body = self._get("get manifest", self._manifest_key(workload, checkpoint))
        if body is None:
            raise CheckpointNotFound(f"no checkpoint {checkpoint} of {workload} in s3://{self.bucket}/{self.prefix}")
        return Manifest.model_validate_json(body)

    # --- pull ------------------------------------------------------------------------------
    def pull(self, local: LocalStore, workload: str, checkpoint: str, node: str,
             remote: Manifest | None = None) -> tuple[Manifest, dict]:
        """Download a checkpoint into ``local``, the store of ``node`` (manifest written last,
        listing this new copy); every chunk verified. A local copy that already passed is kept;
        one marked ``verify_failed`` is replaced. ``remote``: the bucket's manifest, when the
        caller read it already.

        Returns:
            (the local manifest, ``{"downloaded_bytes", "seconds"}``).

        Raises:
            CheckpointNotFound: no such checkpoint in the bucket.
            ChecksumMismatch: a chunk does not match its address (nothing is left behind).
            StorageUnavailable: the bucket is unreachable.
        """
        from ckptflow.store.chunks import ChunkStore

        have = local.usable_copy(workload, checkpoint)
        if have is not None:
            return have, {"downloaded_bytes": 0, "seconds": 0.0}
        remote = remote or self.manifest(workload, checkpoint)
        t0 = time.perf_counter()
        pending = local.begin_copy(workload, checkpoint, node=node)
        images = pending.images_dir
        try:
            size = remote.probe["s3_chunk_size"]
            jobs = []
            for f in remote.files:
                target = images / f.path
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as fh:  # extents up front: parallel writes land in place
                    os.posix_fallocate(fh.fileno(), 0, f.size) if f.size else None
                os.chmod(target, 0o600)
                jobs += [(f.path, i * size, digest) for i, digest in enumerate(remote.probe["s3_chunks"][f.path])]

            def one(job) -> int:
                path, off, digest = job
                body = self._call("get", self.s3.get_object, Bucket=self.bucket,
                                  Key=self._key("chunks", digest))["Body"]
                fd = os.open(images / path, os.O_WRONLY)
                try:
                    if self.key is None:
                        n, got_digest = _stream_to(body, fd, off)
                    else:  # AES-GCM opens the whole object at once
                        data = self._open(digest, body.read())
                        n, got_digest = os.pwrite(fd, data, off), hashlib.sha256(data).hexdigest()
                finally:
                    os.close(fd)
                if got_digest != digest:
                    raise ChecksumMismatch(f"chunk {digest[:16]}... of {path} (offset {off}) from S3 is corrupt",
                                           fix="the bucket holds damaged data; restore an older checkpoint")
                return n

            outside = ChunkStore(local.root)

            def one_outside(digest: str) -> int:
                if outside.has(digest):
                    outside.touch([digest])
                    return 0
                body = self._call("get", self.s3.get_object, Bucket=self.bucket,
                                  Key=self._key("chunks", digest))["Body"].read()
                return outside.put(digest, self._open(digest, body))

            with ThreadPoolExecutor(max_workers=self.threads) as ex:
                got = sum(ex.map(one, jobs))
                got += sum(ex.map(one_outside, remote.probe.get("s3_outside_chunks", [])))
            local_m = remote.model_copy(update={"probe": {k: v for k, v in remote.probe.items()
                                                          if not k.startswith("s3_")}}).with_copy(CopyTier.node, node)
            # Every chunk matched its sha256 address, taken from bytes the pushing node verified
            # against this manifest: the file-level hashes hold without a second read here (and
            # a restore checks them again, in parallel with CRIU).
            local_m = local.commit_copy(pending, local_m)
        except BaseException:
            local.abort(pending)  # no manifest without its bytes
            raise
        return local_m, {"downloaded_bytes": got, "seconds": round(time.perf_counter() - t0, 3)}


_PIECE = 256 << 10   # measured best of 64 KiB..4 MiB on the CI machine (see _stream_to)


def _stream_to(body, fd: int, off: int) -> tuple[int, str]:
    """Write an object's body to ``fd`` at ``off`` piece by piece, hashing as it goes.

    Measured on the 2-core CI machine (1 GiB, 16 threads): reading each 8 MiB chunk into one
    bytes object and writing it at once ran at 0.25 GiB/s, a third of boto3's download_file;
    fresh memory for every chunk (page faults), not sha256 (1.7 GB/s), was the cost. 256 KiB
    pieces: 0.68 GiB/s (4 MiB: 0.25, 1 MiB: 0.56, 64 KiB: 0.42).
    """
    h = hashlib.sha256()
    n = 0
    for piece in body.iter_chunks(_PIECE):
        h.update(piece)
        view = memoryview(piece)
        while view:  # a regular file may take less than asked
            w = os.pwrite(fd, view, off + n)
            view = view[w:]
            n += w
    return n, h.hexdigest()


def _b64(hexdigest: str) -> str:
    import base64

    return base64.b64encode(bytes.fromhex(hexdigest)).decode()




def _load_key(storage) -> bytes | None:
    """The client-side encryption key from the env var the fleet file names (a Prefect Secret
    block is read by the tasks layer, which passes the key in)."""
    import base64

    raw = None
    if getattr(storage, "encryption_key_env", None):
        raw = os.environ.get(storage.encryption_key_env)
        if not raw:
            raise StoreError(f"storage.encryption_key_env names {storage.encryption_key_env}, which is not set",
                             fix="export the base64 key on every node (or use encryption_key_block)")
    if raw is None:
        return None
    try:
        return base64.b64decode(raw, validate=True)
    except ValueError:
        raise StoreError("the chunk encryption key is not valid base64") from None
