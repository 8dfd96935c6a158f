"""The checkpoint tier interface: a place that holds checkpoints, and how they move in and out.

Fleet file (``storage:``) -> the fleet's shared tier (``store.open_tier``)::

    storage: {kind: local, path: /var/lib/ckptflow/{node}}         # None: each node's store only
    storage: {kind: s3, path: /var/lib/ckptflow/{node}, bucket: ckpt-prod,
              endpoint_url: https://s3.example.com}                # S3Tier: any node pulls from it

Implementations, all checked by one test suite (tests/test_tier_contract.py):

    LocalStore (store/local.py)  a directory: the store CRIU writes into on each node; copies
                                 there are ``CopyTier.node``. push/pull copy a checkpoint
                                 between two stores; on the same store they are no-ops.
    ChunkedTier (store/objects.py)  any object store behind an ``ObjectStore`` client:
                                 sha256-addressed chunks (dedup, optional AES-256-GCM) and
                                 manifests, the push lease / prune lock. Copies there carry the
                                 tier's ``copy_tier`` name.
    S3Tier (store/s3.py)         the ChunkedTier of the fleet's bucket (boto3); ``CopyTier.s3``.

A new kind of shared tier (GCS, Azure Blob, ...) is an ``ObjectStore`` client and one
``store.register_tier`` call: docs/extending/storage-tier.md.

A tier's checkpoint exists once its manifest exists, and its manifest is written after its
bytes: a crash mid-copy leaves bytes without a manifest, never a listed checkpoint without its
bytes. Retention never deletes a workload's newest valid checkpoint (and raises StoreError if a
rule ever names it). Pushes and pruning of one bucket never overlap (see ChunkedTier.prune).

``list`` is ``manifests`` on every tier; ``LocalStore.get`` (= manifest) is kept for the runners.

Example:
    >>> tier = open_tier(fleet.storage)                              # doctest: +SKIP
    >>> m = node_a.latest_valid("chat")                              # node_a: a LocalStore
    >>> tier.push(node_a, m)["uploaded_bytes"]
    268435456
    >>> tier.ids("chat")[0] == m.id
    True
    >>> copy, stats = tier.pull(node_b, "chat", m.id, "node-b")      # into node-b's store
    >>> node_b.verify_bytes(copy)                                    # every byte as the manifest says
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ckptflow.models import CheckpointState, CopyTier, Manifest

if TYPE_CHECKING:
    from ckptflow.policies.retention import Retention
    from ckptflow.store.local import LocalStore


@runtime_checkable
class CheckpointTier(Protocol):
    """What a checkpoint tier does. Arguments everywhere:

    - ``workload``: the workload's name (``models.Name``; a bad one raises ValueError);
    - ``checkpoint``: a checkpoint id (``YYYYmmddTHHMMSSZ-xxxxxxxx``, sorts by creation time);
    - ``local``: the LocalStore of the node a checkpoint is copied from or to;
    - ``m``: a checkpoint's manifest (``models.Manifest``).

    Errors are typed (``ckptflow.errors``): ``CheckpointNotFound`` (no such checkpoint),
    ``ChecksumMismatch`` (bytes differ from their manifest: final), ``StorageUnavailable``
    (unreachable or busy: a retry can help), ``StoreError`` / ``StorageFull``.
    """

    copy_tier: CopyTier | str
    """How manifests label a copy held here (``node``, ``s3``, or a registered kind's name)."""

    @property
    def location(self) -> str:
        """Where this tier is (a directory, or ``s3://bucket/prefix``), for copies and messages."""
        ...

    # --- read --------------------------------------------------------------------------------
    def ids(self, workload: str) -> list[str]:
        """Ids of the workload's checkpoints here (those with a manifest), newest first."""
        ...

    def manifest(self, workload: str, checkpoint: str) -> Manifest:
        """One checkpoint's manifest here. Raises CheckpointNotFound."""
        ...

    def manifests(self, workload: str) -> list[Manifest]:
        """Every manifest of the workload here, newest first."""
        ...

    def list(self, workload: str) -> list[Manifest]:
        """The same as ``manifests``, on every tier (ids: ``ids``)."""
        ...

    # --- move --------------------------------------------------------------------------------
    def push(self, local: "LocalStore", m: Manifest) -> dict:
        """Copy checkpoint ``m`` of ``local`` here: ``local``'s bytes are checked against ``m``
        first, the manifest goes last. Returns ``uploaded_bytes``, ``skipped_bytes`` (already
        here) and ``seconds``."""
        ...

    def pull(self, local: "LocalStore", workload: str, checkpoint: str, node: str,
             remote: Manifest | None = None) -> tuple[Manifest, dict]:
        """Copy a checkpoint from here into ``local``, the store of ``node``; every byte checked,
        the manifest (listing the copy ``node:<node>``) written last. A copy in ``local`` that
        has not failed verification is kept as it is. ``remote``: this tier's manifest, when the
        caller read it. Returns (``local``'s manifest, ``{"downloaded_bytes", "seconds"}``)."""
        ...

    # --- change and delete -------------------------------------------------------------------
    def set_state(self, m: Manifest, state: CheckpointState, reason: str | None = None) -> Manifest:
        """Rewrite the manifest here with a new state (e.g. ``invalidated``) and its reason."""
        ...

    def delete(self, m: Manifest) -> None:
        """Delete this tier's copy of ``m``: its manifest first, then (S3: at the next
        ``prune``) the bytes no other manifest uses."""
        ...

    def apply_retention(self, workload: str, rule: "Retention | None" = None,
                        now: datetime | None = None) -> list[tuple[str, str]]:
        """Delete the workload's checkpoints the retention rule names (``policies.retention``),
        never its newest valid one; returns (checkpoint id, why) of each."""
        ...

    def prune(self, rule: "Retention | None" = None, now: datetime | None = None) -> dict:
        """``apply_retention`` for every workload here, then the bytes nothing references.
        Returns ``manifests_deleted`` (``workload``, ``checkpoint``, ``why``), ``manifests_kept``,
        ``chunks_deleted``, ``bytes_freed``; or ``{"skipped": why}`` when it must wait (S3:
        pushes in progress)."""
        ...
