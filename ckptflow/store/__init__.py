"""Checkpoint images, manifests and fleet state. No Prefect here.

The fleet file's ``storage: {kind: ...}`` picks the implementations through a registry of tier
kinds; these functions are the only place that reads ``storage.kind`` (nothing outside
ckptflow/store/ compares it or imports store.s3)::

    storage: {kind: local, path: .ckptflow/store}
    storage: {kind: s3, path: /var/lib/ckptflow/{node}, bucket: ckpt-prod, endpoint_url: ...}

    open_store(storage, node)   the node's LocalStore (where CRIU writes)       every kind
    open_tier(storage, key)     the fleet's shared CheckpointTier               S3Tier (local: None)
    open_fleet_state(storage)   placements, fingerprints, open alerts:
                                LocalFleetState in the store root | ObjectFleetState in the
                                kind's object store (S3: the bucket)

``register_tier(kind, open_tier, objects=open_objects)`` adds a kind (``local`` and ``s3`` are
registered below); ``Storage.kind`` in the fleet file accepts every registered name. A kind
that gives its client (``objects``) keeps the fleet state in its store through the one
``ObjectFleetState``; it writes no fleet state of its own.
docs/extending/storage-tier.md walks through adding one.

Modules: tier.py (the ``CheckpointTier`` interface), local.py (LocalStore), objects.py
(``ChunkedTier``: chunks, dedup, encryption and the prune lock on any ``ObjectStore`` client),
s3.py (S3Objects, the boto3 client, and S3Tier), fleetstate.py (the ``FleetState`` interface:
``LocalFleetState`` in a directory, ``ObjectFleetState`` on any ``ObjectStore``), chunks.py (content-addressed chunks of two-tier checkpoints on a
node).

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

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ckptflow.errors import ConfigError
from ckptflow.registry import STORAGE_KINDS

if TYPE_CHECKING:
    from ckptflow.store.fleetstate import FleetState
    from ckptflow.store.local import LocalStore
    from ckptflow.store.objects import ObjectStore
    from ckptflow.store.tier import CheckpointTier


@dataclass(frozen=True)
class TierKind:
    """One registered ``storage.kind``: how to open its shared tier, its object store client and
    its fleet state."""

    name: str
    open_tier: Callable[[Any, "bytes | None"], "CheckpointTier"] | None   # (storage, key); None: no shared tier
    open_fleet_state: Callable[[Any, "CheckpointTier | None"], "FleetState"] | None  # None: see open_fleet_state
    open_objects: Callable[[Any], "ObjectStore"] | None = None   # (storage): the client, no chunk key needed


_KINDS: dict[str, TierKind] = STORAGE_KINDS.entries  # the registry's (registry.py): fleet.py checks names there


def register_tier(kind: str, open_tier: Callable | None, open_fleet_state: Callable | None = None, *,
                  objects: Callable | None = None) -> None:
    """Make ``storage.kind: <kind>`` open a shared tier with ``open_tier(storage, key)`` (key:
    the chunk encryption key a Prefect Secret block gave, or None).

    The fleet state (placements, alerts, node fingerprints) then lives: with ``objects``
    (``objects(storage)`` -> the kind's ``ObjectStore`` client, built without the chunk key) in
    that store, through ``ObjectFleetState``; with ``open_fleet_state(storage, tier)`` wherever
    it says; with neither, in the store root (``LocalFleetState``: one node, or nodes sharing a
    mounted volume). Registering a kind again replaces it."""
    STORAGE_KINDS.add(kind, TierKind(kind, open_tier, open_fleet_state, objects))


def tier_kinds() -> list[str]:
    """The registered ``storage.kind`` names."""
    return list(_KINDS)


def _kind(storage) -> TierKind:
    kind = getattr(storage.kind, "value", storage.kind)
    if kind not in _KINDS:
        raise ConfigError(STORAGE_KINDS.unknown(kind),
                          fix=f"use storage.kind: {' or '.join(_KINDS)} (or register the kind with "
                              "ckptflow.store.register_tier)")
    return _KINDS[kind]


def has_shared_tier(storage) -> bool:
    """Whether the fleet's kind has a shared tier (nodes on separate machines share it), without
    opening it.

    Raises:
        ConfigError: an unregistered ``storage.kind``.
    """
    return _kind(storage).open_tier is not None


def open_store(storage, node: str | None = None) -> "LocalStore":
    """The node's local store (where CRIU writes; with kind s3 the local tier of the bucket).

    ``{node}`` in ``storage.path`` becomes the node's name, so nodes sharing one machine (or
    one mounted volume) keep separate local tiers; without a node it is ``local``.

    Raises:
        ConfigError: an unregistered ``storage.kind``.
    """
    from ckptflow.store.local import LocalStore

    _kind(storage)
    return LocalStore(Path(storage.path.replace("{node}", node or "local")))


def open_tier(storage, key: bytes | None = None) -> "CheckpointTier | None":
    """The fleet's shared tier, which every node can pull from: the S3 tier for kind s3 (what a
    registered kind's opener returns), None for kind local (each node has its own store only). ``key``: the chunks' client-side
    encryption key (else read from ``storage.encryption_key_env``, if set).

    Raises:
        ConfigError: an unknown ``storage.kind``.
        StoreError: ``encryption_key_env`` names an unset variable, or the key is no 32-byte
            base64 value.
    """
    opener = _kind(storage).open_tier
    return None if opener is None else opener(storage, key)


def open_fleet_state(storage, tier: "CheckpointTier | None" = None) -> "FleetState":
    """Where the fleet's placements, node fingerprints and open alerts live: the object store of
    a kind registered with its client (S3: the bucket), else the fleet's store root
    (``storage.path`` with ``{node}`` read as ``local``). ``tier``: the fleet's tier if the
    caller opened it already (the fleet state then shares its client and connection).

    Raises:
        ConfigError: an unknown ``storage.kind``, or a kind's own setting missing.
    """
    kind = _kind(storage)
    if kind.open_fleet_state is not None:
        return kind.open_fleet_state(storage, tier)
    if kind.open_objects is not None:
        from ckptflow.store.fleetstate import ObjectFleetState
        from ckptflow.store.objects import ObjectStore

        shared = getattr(tier, "objects", None)
        return ObjectFleetState(shared if isinstance(shared, ObjectStore) else kind.open_objects(storage))
    from ckptflow.store.fleetstate import LocalFleetState

    return LocalFleetState(open_store(storage).root)


def _open_s3_tier(storage, key: bytes | None) -> "CheckpointTier":
    from ckptflow.store.s3 import S3Tier

    return S3Tier.from_storage(storage, key)


def _open_s3_objects(storage) -> "ObjectStore":
    from ckptflow.store.s3 import S3Objects

    return S3Objects(storage.bucket, storage.prefix, storage.endpoint_url, storage.region,
                     storage.server_side_encryption)


register_tier("local", None)
register_tier("s3", _open_s3_tier, objects=_open_s3_objects)
