"""Checkpoint images and manifests. No Prefect here."""

from __future__ import annotations

from pathlib import Path

from ckptflow.errors import ConfigError


def open_store(storage, node: str | None = None):
    """The node's local store (where CRIU writes; with kind s3 the local tier of the bucket).

    ``{node}`` in ``storage.path`` becomes the node's name, so nodes sharing one machine (or
    one mounted volume) keep separate local tiers.
    """
    from ckptflow.store.local import LocalStore

    kind = getattr(storage.kind, "value", storage.kind)
    if kind not in ("local", "s3"):
        raise ConfigError(f"storage.kind {kind!r} is not supported", fix="use storage.kind: local or s3")
    return LocalStore(Path(storage.path.replace("{node}", node or "local")))


def open_tier(storage, key: bytes | None = None):
    """The shared S3 tier for kind s3, else None (``key``: client-side encryption key)."""
    kind = getattr(storage.kind, "value", storage.kind)
    if kind != "s3":
        return None
    from ckptflow.store.s3 import S3Tier

    return S3Tier.from_storage(storage, key)
