"""What `ckptflow status` prints and `ckptflow exporter` serves: one row per workload, from
the store and the fleet file (no Prefect).

Example:
    >>> rows = fleet_status(load_fleet("deployments/local.yaml"))   # doctest: +SKIP
    >>> rows[0]["newest_state"], rows[0]["age_s"]
"""

from __future__ import annotations

from datetime import datetime, timezone

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from ckptflow.fleet import Fleet
from ckptflow.errors import CkptflowError
from ckptflow.models import CheckpointState, Manifest
from ckptflow.store import open_store, open_tier

RESTORE_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


def chunk_bytes(m: Manifest) -> int:
    """Bytes of the content-addressed chunks a two-tier checkpoint names, as recorded when it was
    taken (a session checkpoint's sessions, a template's weights); 0 for a whole-process one."""
    p = m.probe
    return (p.export.total_bytes if p.export else 0) + (p.weights.bytes if p.weights else 0)


def checkpoint_bytes(m: Manifest) -> int:
    """What a restore of ``m`` reads: its image plus the chunks it names. A session checkpoint's
    image is a few KB of records; its bytes are in the chunks (``ls`` showed them as 0.0 MiB)."""
    return m.bytes + chunk_bytes(m)


def stored_bytes(fleet: Fleet, ms: list[Manifest]) -> int:
    """Bytes the checkpoints ``ms`` (of one workload) hold: their images, plus each chunk they
    name counted once (chunks are shared between successive checkpoints), sized from the node
    stores' chunk directories; a checkpoint whose chunk list is not on this machine (a bucket
    copy) counts what it recorded, the largest such once."""
    import json

    from ckptflow.store.chunks import REFS_FILE, ChunkStore

    stores = {s.root: s for s in [open_store(fleet.storage, n.name) for n in fleet.nodes] + [open_store(fleet.storage)]}
    named: dict = {}          # store root -> digests named by checkpoints found there
    unlisted = 0
    for m in ms:
        if not chunk_bytes(m):
            continue
        for root in sorted(stores):
            refs = stores[root].images_dir(m) / REFS_FILE
            if refs.is_file():
                named.setdefault(root, set()).update(json.loads(refs.read_text()))
                break
        else:
            unlisted = max(unlisted, chunk_bytes(m))
    chunks = 0
    for root, digests in named.items():
        cs = ChunkStore(root)
        chunks += cs.size([d for d in digests if cs.has(d)])
    return sum(m.bytes for m in ms) + chunks + unlisted


def fleet_manifests(fleet: Fleet, workload: str, unreachable: list[str] | None = None) -> list[Manifest]:
    """Every checkpoint of ``workload`` this machine can see, newest first: each node's local
    store (``{node}`` in the storage path names one per node) and the fleet's shared tier (an
    S3 fleet's bucket). A checkpoint held in several places is listed once, with all its copies.
    A shared tier that cannot be read is said in ``unreachable`` (one line; once it is there the
    tier is not asked again), so that a report never passes the nodes' copies off as all there is."""
    seen: dict[str, Manifest] = {}
    stores = {s.root: s for s in [open_store(fleet.storage, n.name) for n in fleet.nodes] + [open_store(fleet.storage)]}
    for root in sorted(stores):
        if root.exists():
            for m in stores[root].manifests(workload):
                seen[m.id] = _merge(seen.get(m.id), m)
    tier = open_tier(fleet.storage) if not unreachable else None
    if tier is not None:
        try:
            for m in tier.manifests(workload):
                seen[m.id] = _merge(seen.get(m.id), m)
        except CkptflowError as e:  # the nodes' copies still show, and the caller says what is missing
            if unreachable is not None:
                unreachable.append(f"{tier.location} could not be read ({str(e).splitlines()[0]})")
    return sorted(seen.values(), key=lambda m: m.id, reverse=True)


def _merge(a: Manifest | None, b: Manifest) -> Manifest:
    if a is None:
        return b
    for c in b.copies:
        a = a.with_copy(c.tier, c.location)
    # A restore is recorded where it ran: a checkpoint migrated to another node was restored
    # there, and the source's copy says 0. Each copy's history starts from the one it was copied
    # with, so the longest is the whole of it (issue #36, finding 10).
    ra, rb = a.probe.restores, b.probe.restores
    if len(rb.seconds) + len(rb.failures) > len(ra.seconds) + len(ra.failures):
        a = a.model_copy(update={"probe": a.probe.updated(restores=rb)})
    return a


def _placements(fleet: Fleet) -> dict[str, str]:
    """Where a migrate or a recover elsewhere last moved each workload (the fleet state), for
    the nodes the fleet file declares; {} when the fleet state cannot be read."""
    from ckptflow.store import open_fleet_state

    nodes = {n.name for n in fleet.nodes}
    try:
        return {w: n for w, n in open_fleet_state(fleet.storage).placements().items() if n in nodes}
    except (CkptflowError, OSError):
        return {}


def fleet_status(fleet: Fleet, now: datetime | None = None, unreachable: list[str] | None = None) -> list[dict]:
    """One row per workload (on the node it runs on now), then one per template its two-tier
    checkpoints bind to (``traffic: template``): shared by the workloads of a model, their bytes
    are counted once, under the template."""
    now = now or datetime.now(timezone.utc)
    rows = []
    placed = _placements(fleet)
    templates: dict[str, str] = {}
    for w in fleet.workloads:
        ms = fleet_manifests(fleet, w.name, unreachable)
        for m in ms:
            if m.probe.template:
                templates.setdefault(m.probe.template.workload, m.node)
        rows.append(_row(fleet, w.name, placed.get(w.name, w.node), w.traffic.value, ms, now))
    for name, node in sorted(templates.items()):
        rows.append(_row(fleet, name, node, "template", fleet_manifests(fleet, name, unreachable), now))
    return rows


def _row(fleet: Fleet, name: str, node: str, traffic: str, ms: list[Manifest], now: datetime) -> dict:
    valid = next((m for m in ms if m.state.restorable), None)
    checked = next((m for m in ms if m.state in (CheckpointState.verified, CheckpointState.verify_failed)), None)
    return {
        "workload": name, "node": node, "traffic": traffic,
        "checkpoints": len(ms), "by_state": {s.value: sum(m.state == s for m in ms) for s in CheckpointState},
        "newest": ms[0].id if ms else None, "newest_state": ms[0].state.value if ms else None,
        "newest_reason": ms[0].state_reason if ms else None,
        "valid": valid.id if valid else None,
        "age_s": (now - valid.created).total_seconds() if valid else None,
        "verified": None if checked is None else checked.state == CheckpointState.verified,
        "bytes": stored_bytes(fleet, ms),
        "restores": [r for m in ms for r in m.probe.restores.seconds],
    }


class StoreCollector:
    """prometheus_client collector: reads the store on every scrape."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet

    def collect(self):
        rows = fleet_status(self.fleet)
        age = GaugeMetricFamily("ckptflow_checkpoint_age_seconds",
                                "Age of the newest valid checkpoint (absent: none).", labels=["workload", "node"])
        count = GaugeMetricFamily("ckptflow_checkpoints", "Checkpoints by state.", labels=["workload", "state"])
        ver = GaugeMetricFamily("ckptflow_last_verification_ok",
                                "1 if the newest verified-or-failed checkpoint passed verification.",
                                labels=["workload"])
        size = GaugeMetricFamily("ckptflow_bytes_stored", "Bytes stored: images plus the chunks two-tier checkpoints "
                                 "name, each chunk once (templates in their own series).", labels=["workload"])
        hist = HistogramMetricFamily("ckptflow_restore_duration_seconds", "Restore durations.",
                                     labels=["workload"])
        for r in rows:
            if r["age_s"] is not None:
                age.add_metric([r["workload"], r["node"]], r["age_s"])
            for state, n in r["by_state"].items():
                count.add_metric([r["workload"], state], n)
            if r["verified"] is not None:
                ver.add_metric([r["workload"]], 1.0 if r["verified"] else 0.0)
            size.add_metric([r["workload"]], r["bytes"])
            buckets = [(str(b), sum(x <= b for x in r["restores"])) for b in RESTORE_BUCKETS]
            buckets.append(("+Inf", len(r["restores"])))
            hist.add_metric([r["workload"]], buckets, sum(r["restores"]))
        yield from (age, count, ver, size, hist)
