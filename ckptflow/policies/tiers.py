"""Which copy of which checkpoint a restore reads first: the nearest valid one.

A checkpoint can be held by the node that took it (its local store: tmpfs or disk, read in
place) and by the fleet's shared tier (S3, or another registered kind: any node pulls it). The newest restorable checkpoint wins — an
older checkpoint loses every session turn since, which costs more than a download — and for
one checkpoint the copy on this node comes before the bucket's. A local copy whose bytes
failed their checksums does not rule out the bucket's copy of the same checkpoint (the bytes
there were verified when pushed); a checkpoint invalidated for its fingerprint is out in
every tier.

Example:
    >>> order = restore_order(
    ...     local=[LocalCopy("20261129T100000Z-aa", CheckpointState.complete)],
    ...     remote=["20261129T110000Z-bb", "20261129T100000Z-aa"])
    >>> [(c.checkpoint, c.tier.value) for c in order]
    [('20261129T110000Z-bb', 's3'), ('20261129T100000Z-aa', 'node'), ('20261129T100000Z-aa', 's3')]
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptflow.models import CheckpointState, CopyTier


@dataclass(frozen=True, slots=True)
class LocalCopy:
    checkpoint: str
    state: CheckpointState | str    # this node's manifest's state (its value is accepted too)


@dataclass(frozen=True, slots=True)
class Candidate:
    checkpoint: str
    tier: CopyTier                  # node (read in place) or the shared tier's (pull first)


def restore_order(local: list[LocalCopy], remote: list[str],
                  remote_tier: CopyTier = CopyTier.s3) -> list[Candidate]:
    """Candidates newest checkpoint first; per checkpoint this node's copy, then the bucket's.

    ``remote``: ids of the shared tier's checkpoints (``CheckpointTier.ids``); ``remote_tier``:
    that tier's ``copy_tier``, which labels its candidates. Checkpoint ids start with their UTC
    creation time, so they sort by age.
    """
    states = {c.checkpoint: CheckpointState(c.state) for c in local}
    out = []
    for ckpt in sorted(set(states) | set(remote), reverse=True):
        state = states.get(ckpt)
        if state is not None and state.restorable:
            out.append(Candidate(ckpt, CopyTier.node))
        # a local copy that failed its checksums leaves the bucket's (verified when pushed); an
        # invalidated one rules the checkpoint out everywhere
        if ckpt in remote and (state is None or state.restorable or state == CheckpointState.verify_failed):
            out.append(Candidate(ckpt, remote_tier))
    return out
