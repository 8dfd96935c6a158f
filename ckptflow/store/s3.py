"""S3 tier of the checkpoint store (boto3, no Prefect): the S3 client of ``ChunkedTier``.

``S3Objects`` is the bucket (one prefix of it) behind store.objects' ``ObjectStore``: every
boto3 call and its error typing live here. ``S3Tier`` is store.objects' ``ChunkedTier`` (chunks,
dedup, AES-256-GCM, the push lease / prune lock) on it; copies there are ``CopyTier.s3``.

Layout in the bucket (store.objects's, under ``PREFIX/``)::

    PREFIX/chunks/<sha256>                         one chunk of an image file (CHUNK bytes)
    PREFIX/manifests/<workload>/<checkpoint>.json  the manifest, uploaded last
    PREFIX/leases/<uuid>.json, PREFIX/locks/prune.json   push leases and the prune lock

(The fleet state under ``PREFIX/placements``, ``alerts`` and ``nodes`` is store.fleetstate's
``ObjectFleetState`` on the same ``S3Objects``: the s3 kind registers it as its client.)

A checkpoint is pushed from the node's local store (where CRIU wrote it, and where the
newest copy stays for a fast restore in place) and pulled into another node's local store.
Chunks are addressed by their sha256, so a second heartbeat of the same worker, and workers
with the same weights, upload only chunks the bucket does not hold yet. Every downloaded
chunk is checked against its address before it is written.

Example:
    >>> s3 = S3Tier(bucket="ckpt", endpoint_url="http://127.0.0.1:8333")       # doctest: +SKIP
    >>> s3.push(local, manifest)            # -> {"uploaded_bytes": ..., "skipped_bytes": ...}
    >>> s3.pull(other_local, "chat", manifest.id, "node-b")
"""

from __future__ import annotations

import hashlib
from typing import Iterator

from ckptflow.errors import StorageUnavailable
from ckptflow.models import CopyTier
from ckptflow.store.objects import (CHUNK, LEASE_TTL_S, PRUNE_TTL_S, THREADS, ChunkedTier,  # noqa: F401 (kept names)
                                   check_key, load_key)

_PIECE = 256 << 10   # measured best of 64 KiB..4 MiB on the CI machine (see objects._stream_to)


class S3Objects:
    """The objects under one prefix of one bucket, every call's error typed
    (``StorageUnavailable``: retry; a missing key: ``ClientError`` NoSuchKey, for the caller to
    read as "none"). What the S3 tier and the S3 fleet state share; one boto3 client each,
    or one between them (``client``). Its public calls (``put``, ``get``, ``stream``,
    ``exists``, ``delete``, ``list``) are store.objects' ``ObjectStore``, keys relative to the
    prefix.

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

    # --- store.objects.ObjectStore: keys relative to the prefix ---------------------------
    def put(self, key: str, body: bytes, check: bool = False) -> None:
        extra = {"ChecksumSHA256": _b64(hashlib.sha256(body).hexdigest())} if check else {}
        self._call("put", self.s3.put_object, Bucket=self.bucket, Key=self._key(key), Body=body,
                   **extra, **self._put_kw())

    def get(self, key: str) -> bytes | None:
        return self._get("get", self._key(key))

    def stream(self, key: str) -> Iterator[bytes]:
        return self._call("get", self.s3.get_object, Bucket=self.bucket,
                          Key=self._key(key))["Body"].iter_chunks(_PIECE)

    def exists(self, key: str) -> bool:
        return self._exists(self._key(key))

    def delete(self, key: str) -> None:
        self._delete(self._key(key))

    def list(self, prefix: str) -> list[tuple[str, int]]:
        cut = len(self.prefix) + 1
        return [(o["Key"][cut:], o["Size"]) for o in self._keys(self._key(prefix))]


class S3Names:
    """The bucket's own names, read through ``self.objects`` (an ``S3Objects``): what tools, tests
    and an S3 fleet state opened beside a tier (sharing its client) read, on the tier and the
    fleet state alike."""

    objects: S3Objects

    @property
    def bucket(self) -> str:
        return self.objects.bucket

    @property
    def prefix(self) -> str:
        return self.objects.prefix

    @property
    def sse(self) -> str | None:
        return self.objects.sse

    @property
    def s3(self):
        """The boto3 client."""
        return self.objects.s3


class S3Tier(S3Names, ChunkedTier):
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

    label = "S3"
    chunk_key = "s3"   # the bucket's manifests have always named their chunk map so (s3_chunks before)

    def __init__(self, bucket: str, prefix: str = "ckptflow", endpoint_url: str | None = None,
                 region: str | None = None, server_side_encryption: str | None = "AES256",
                 client=None, threads: int = THREADS, key: bytes | None = None, timeout_s: float = 60,
                 attempts: int = 5):
        check_key(key)  # before a client is built
        objects = S3Objects(bucket, prefix, endpoint_url, region, server_side_encryption, client,
                            pool=threads * 2, timeout_s=timeout_s, attempts=attempts)
        super().__init__(objects, CopyTier.s3, threads, key)

    @classmethod
    def from_storage(cls, storage, key: bytes | None = None) -> "S3Tier":
        return cls(bucket=storage.bucket, prefix=storage.prefix, endpoint_url=storage.endpoint_url,
                   region=storage.region, server_side_encryption=storage.server_side_encryption,
                   key=key if key is not None else load_key(storage))


def _b64(hexdigest: str) -> str:
    import base64

    return base64.b64encode(bytes.fromhex(hexdigest)).decode()


_load_key = load_key   # the name tests and older callers use
