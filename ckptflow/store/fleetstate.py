"""Fleet state: what every node of a fleet reads and writes, kept where every node sees it.

    placements          workload -> the node a migrate or a recover elsewhere moved it to
                        (flows read them once per run: ``tasks.common.open_fleet``)
    node fingerprints   node -> its fingerprint as it last reported it (invalidate reads all)
    open alerts         workload -> its one open alert (``ckptflow.alerts``)

A fleet with ``storage.kind: local`` keeps it in its store root (``storage.path`` with
``{node}`` read as ``local``); a fleet on an object store (S3, or any kind registered with its
client) in that store, beside the checkpoints. One JSON object per entry; the layouts are
those of the stores before this module existed::

    LocalFleetState (ROOT)              ObjectFleetState (ROOT = the client's: S3 PREFIX = storage.prefix)
    ROOT/.placements/<workload>.json    ROOT/placements/<workload>.json
    ROOT/.nodes/<node>.json             ROOT/nodes/<node>.json
    ROOT/.alerts/<workload>.json        ROOT/alerts/<workload>.json

Records about one node's own processes stay in that node's LocalStore, not here: the
replicas scale-up started there and the node's drained mark (``ROOT/.nodes/<node>.drained``).

Open one with ``store.open_fleet_state(storage)``, which picks the implementation.

Example:
    >>> import tempfile
    >>> state = LocalFleetState(tempfile.mkdtemp())
    >>> state.put_placement("chat", "node-b", "20261129T081500Z-1a2b3c4d")
    >>> state.placements()
    {'chat': 'node-b'}
    >>> state.put_alert("chat", {"kind": "worker_gone", "token": "ab12"})
    >>> state.get_alert("chat")["kind"], state.get_alert("api")
    ('worker_gone', None)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ckptflow.models import Fingerprint, check_name
from ckptflow.store.local import write_json_atomic
from ckptflow.store.s3 import S3Names, S3Objects

if TYPE_CHECKING:
    from ckptflow.store.objects import ObjectStore


@runtime_checkable
class FleetState(Protocol):
    """Placements, node fingerprints and open alerts of one fleet.

    Workload and node names are checked (``models.Name``): a bad one raises ValueError before
    anything is written. Writes replace the entry whole (readers see the old or the new one).
    Errors of an unreachable object store are ``StorageUnavailable`` (a retry can help).

    Example:
        >>> import tempfile
        >>> from ckptflow.models import Fingerprint
        >>> state: FleetState = LocalFleetState(tempfile.mkdtemp())   # or store.open_fleet_state(storage)
        >>> state.put_node_fingerprint("h200-01", Fingerprint(kernel="6.8.0"))
        >>> state.node_fingerprints()["h200-01"].kernel
        '6.8.0'
    """

    @property
    def location(self) -> str:
        """Where the state lives (a directory, or the object store's ``s3://bucket/prefix``), for messages."""
        ...

    def put_placement(self, workload: str, node: str, checkpoint: str) -> None:
        """Record that ``workload`` runs on ``node`` now, restored from ``checkpoint`` (or
        ``cold-start``)."""
        ...

    def placements(self) -> dict[str, str]:
        """workload -> node, for every workload with a recorded placement."""
        ...

    def put_alert(self, workload: str, alert: dict) -> None:
        """Open (or replace) the workload's alert; ``alert`` is JSON-serialisable."""
        ...

    def get_alert(self, workload: str) -> dict | None:
        """The workload's open alert, None when none is open."""
        ...

    def drop_alert(self, workload: str) -> None:
        """Close the workload's alert (nothing happens when none is open)."""
        ...

    def alerts(self) -> dict[str, dict]:
        """workload -> its open alert."""
        ...

    def put_node_fingerprint(self, node: str, fp: Fingerprint) -> None:
        """Record ``node``'s fingerprint as it reports it now (replacing the last report)."""
        ...

    def node_fingerprints(self) -> dict[str, Fingerprint]:
        """node -> its last reported fingerprint."""
        ...


class LocalFleetState:
    """Fleet state in a directory (a local fleet's store root): 0700 directories, 0600 files,
    each file written atomically (store.local.write_json_atomic).

    Args:
        root: the directory; created on the first write.
    """

    def __init__(self, root: Path | str):
        self.root = Path(root)

    @property
    def location(self) -> str:
        return str(self.root)

    def _dir(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d

    def _read(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def _all(self, name: str) -> dict[str, str]:
        d = self.root / name
        return {p.stem: p.read_text() for p in sorted(d.glob("*.json"))} if d.exists() else {}

    # --- placements ---------------------------------------------------------------------------
    def put_placement(self, workload: str, node: str, checkpoint: str) -> None:
        check_name(workload)
        check_name(node)
        write_json_atomic(self._dir(".placements") / f"{workload}.json",
                          json.dumps({"node": node, "checkpoint": checkpoint, "at": time.time()}))

    def placements(self) -> dict[str, str]:
        return {w: json.loads(body)["node"] for w, body in self._all(".placements").items()}

    # --- open alerts --------------------------------------------------------------------------
    def put_alert(self, workload: str, alert: dict) -> None:
        write_json_atomic(self._dir(".alerts") / f"{check_name(workload)}.json", json.dumps(alert))

    def get_alert(self, workload: str) -> dict | None:
        return self._read(self.root / ".alerts" / f"{check_name(workload)}.json")

    def drop_alert(self, workload: str) -> None:
        (self.root / ".alerts" / f"{check_name(workload)}.json").unlink(missing_ok=True)

    def alerts(self) -> dict[str, dict]:
        return {w: json.loads(body) for w, body in self._all(".alerts").items()}

    # --- node fingerprints (``.nodes/<node>.drained`` beside them is the node's drained mark) --
    def put_node_fingerprint(self, node: str, fp: Fingerprint) -> None:
        path, body = self._dir(".nodes") / f"{check_name(node)}.json", fp.model_dump_json(indent=2)
        try:  # every heartbeat reports it, and it changes only with a reboot or an upgrade: an
            if path.read_text() == body:  # atomic rewrite's two fsyncs per node per tick buy nothing
                return
        except (FileNotFoundError, UnicodeDecodeError):
            pass
        write_json_atomic(path, body)

    def node_fingerprints(self) -> dict[str, Fingerprint]:
        return {n: Fingerprint.model_validate_json(body) for n, body in self._all(".nodes").items()}


class ObjectFleetState:
    """Fleet state in the fleet's object store, beside its checkpoints: every node sees (and
    resolves) the same placements, alerts and fingerprints. Any ``store.objects.ObjectStore``
    client carries it (S3's, the toy's, a GCS one): a registered kind that gives its client
    (``register_tier(..., objects=...)``) gets this without a fleet state of its own.

    Args:
        objects: the store's client; keys ``placements/<workload>.json``, ``alerts/...``,
            ``nodes/<node>.json`` relative to its root (an open tier's ``objects``: one connection).

    Example:
        >>> state = ObjectFleetState(tier.objects)   # doctest: +SKIP  (an open ChunkedTier's client)
        >>> state.put_placement("chat", "node-b", "cold-start")
        >>> state.placements(), [k for k, _ in state.objects.list("placements/")]
        ({'chat': 'node-b'}, ['placements/chat.json'])
    """

    def __init__(self, objects: "ObjectStore"):
        self.objects = objects

    @property
    def location(self) -> str:
        return self.objects.location

    def _bodies(self, folder: str) -> dict[str, bytes]:
        """name (without .json) -> body, for each entry of ``folder`` (one deleted meanwhile is left out)."""
        out = {}
        for key, _ in self.objects.list(f"{folder}/"):
            name = key[len(folder) + 1:]
            if "/" not in name and name.endswith(".json") and (body := self.objects.get(key)) is not None:
                out[name.removesuffix(".json")] = body
        return out

    # --- placements ---------------------------------------------------------------------------
    def put_placement(self, workload: str, node: str, checkpoint: str) -> None:
        check_name(workload)
        check_name(node)
        self.objects.put(f"placements/{workload}.json",
                         json.dumps({"node": node, "checkpoint": checkpoint, "at": time.time()}).encode())

    def placements(self) -> dict[str, str]:
        return {w: json.loads(body)["node"] for w, body in self._bodies("placements").items()}

    # --- open alerts --------------------------------------------------------------------------
    def put_alert(self, workload: str, alert: dict) -> None:
        self.objects.put(f"alerts/{check_name(workload)}.json", json.dumps(alert).encode())

    def get_alert(self, workload: str) -> dict | None:
        body = self.objects.get(f"alerts/{check_name(workload)}.json")
        return None if body is None else json.loads(body)

    def drop_alert(self, workload: str) -> None:
        self.objects.delete(f"alerts/{check_name(workload)}.json")

    def alerts(self) -> dict[str, dict]:
        return {w: json.loads(body) for w, body in self._bodies("alerts").items()}

    # --- node fingerprints --------------------------------------------------------------------
    def put_node_fingerprint(self, node: str, fp: Fingerprint) -> None:
        self.objects.put(f"nodes/{check_name(node)}.json", fp.model_dump_json(indent=2).encode())

    def node_fingerprints(self) -> dict[str, Fingerprint]:
        return {n: Fingerprint.model_validate_json(body) for n, body in self._bodies("nodes").items()}


class S3FleetState(S3Names, ObjectFleetState):
    """``ObjectFleetState`` in an S3 bucket, opened by its names (tools and tests; the factory
    ``store.open_fleet_state`` opens the same through the s3 kind's registered client).

    Args:
        bucket, prefix, endpoint_url, region, server_side_encryption, client: as
            store.s3's ``S3Objects`` (``client``: share an open tier's, e.g. ``tier.s3``).
    """

    def __init__(self, bucket: str, prefix: str = "ckptflow", endpoint_url: str | None = None,
                 region: str | None = None, server_side_encryption: str | None = "AES256", client=None):
        super().__init__(S3Objects(bucket, prefix, endpoint_url, region, server_side_encryption, client))

    @classmethod
    def from_storage(cls, storage) -> "S3FleetState":
        """From the fleet file's ``storage:`` (the chunk encryption key plays no part here)."""
        return cls(bucket=storage.bucket, prefix=storage.prefix, endpoint_url=storage.endpoint_url,
                   region=storage.region, server_side_encryption=storage.server_side_encryption)
