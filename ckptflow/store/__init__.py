"""Checkpoint images, manifests and fleet state. No Prefect here.

The fleet file's ``storage:`` picks the implementations; these three functions are the only
place that reads ``storage.kind`` (nothing outside ckptflow/store/ compares it or imports
store.s3)::

    storage: {kind: local, path: .ckptflow/store}
    storage: {kind: s3, path: /var/lib/ckptflow/{node}, bucket: ckpt-prod, endpoint_url: ...}

    open_store(storage, node)   the node's LocalStore (where CRIU writes)       both kinds
    open_tier(storage, key)     the fleet's shared CheckpointTier: S3Tier       s3 (local: None)
    open_fleet_state(storage)   placements, fingerprints, open alerts:
                                LocalFleetState in the store root | S3FleetState in the bucket

Modules: tier.py (the ``CheckpointTier`` interface), local.py (LocalStore), s3.py (S3Tier),
fleetstate.py (the ``FleetState`` interface and its two implementations), chunks.py
(content-addressed chunks of two-tier checkpoints on a node).

Example:
    >>> fleet = load_fleet(Path("deployments/example-h200-fleet.yaml"))      # doctest: +SKIP
    >>> store = open_store(fleet.storage, "h200-01")
    >>> tier = open_tier(fleet.storage)              # None for storage.kind local
    >>> if tier is not None:
    ...     tier.push(store, store.latest_valid("chat"))
    >>> open_fleet_state(fleet.storage).placements()
    {'chat': 'h200-02'}
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ckptflow.errors import ConfigError

if TYPE_CHECKING:
    from ckptflow.store.fleetstate import FleetState
    from ckptflow.store.local import LocalStore
    from ckptflow.store.tier import CheckpointTier

KINDS = ("local", "s3")


def _kind(storage) -> str:
    kind = getattr(storage.kind, "value", storage.kind)
    if kind not in KINDS:
        raise ConfigError(f"storage.kind {kind!r} is not supported", fix="use storage.kind: local or s3")
    return kind


def open_store(storage, node: str | None = None) -> "LocalStore":
    """The node's local store (where CRIU writes; with kind s3 the local tier of the bucket).

    ``{node}`` in ``storage.path`` becomes the node's name, so nodes sharing one machine (or
    one mounted volume) keep separate local tiers; without a node it is ``local``.

    Raises:
        ConfigError: an unknown ``storage.kind``.
    """
    from ckptflow.store.local import LocalStore

    _kind(storage)
    return LocalStore(Path(storage.path.replace("{node}", node or "local")))


def open_tier(storage, key: bytes | None = None) -> "CheckpointTier | None":
    """The fleet's shared tier, which every node can pull from: the S3 tier for kind s3, None
    for kind local (each node has its own store only). ``key``: the chunks' client-side
    encryption key (else read from ``storage.encryption_key_env``, if set).

    Raises:
        ConfigError: an unknown ``storage.kind``.
        StoreError: ``encryption_key_env`` names an unset variable, or the key is no 32-byte
            base64 value.
    """
    if _kind(storage) != "s3":
        return None
    from ckptflow.store.s3 import S3Tier

    return S3Tier.from_storage(storage, key)


def open_fleet_state(storage, tier: "CheckpointTier | None" = None) -> "FleetState":
    """Where the fleet's placements, node fingerprints and open alerts live: the bucket of an
    S3 fleet, else the fleet's store root (``storage.path`` with ``{node}`` read as ``local``).
    ``tier``: the fleet's tier if the caller opened it already (an S3 fleet state then shares
    its connection).

    Raises:
        ConfigError: an unknown ``storage.kind``.
    """
    from ckptflow.store.fleetstate import LocalFleetState, S3FleetState
    from ckptflow.store.s3 import S3Objects

    if _kind(storage) != "s3":
        return LocalFleetState(open_store(storage).root)
    if isinstance(tier, S3Objects):
        return S3FleetState(tier.bucket, tier.prefix, server_side_encryption=tier.sse, client=tier.s3)
    return S3FleetState.from_storage(storage)
