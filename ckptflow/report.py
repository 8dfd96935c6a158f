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


def fleet_manifests(fleet: Fleet, workload: str) -> list[Manifest]:
    """Every checkpoint of ``workload`` this machine can see, newest first: each node's local
    store (``{node}`` in the storage path names one per node) and the fleet's shared tier (an
    S3 fleet's bucket). A checkpoint held in several places is listed once, with all its copies."""
    seen: dict[str, Manifest] = {}
    stores = {s.root: s for s in [open_store(fleet.storage, n.name) for n in fleet.nodes] + [open_store(fleet.storage)]}
    for root in sorted(stores):
        if root.exists():
            for m in stores[root].manifests(workload):
                seen[m.id] = _merge(seen.get(m.id), m)
    tier = open_tier(fleet.storage)
    if tier is not None:
        try:
            for m in tier.manifests(workload):
                seen[m.id] = _merge(seen.get(m.id), m)
        except CkptflowError:  # the tier is unreachable: the nodes' copies still show
            pass
    return sorted(seen.values(), key=lambda m: m.id, reverse=True)


def _merge(a: Manifest | None, b: Manifest) -> Manifest:
    if a is None:
        return b
    for c in b.copies:
        a = a.with_copy(c.tier, c.location)
    return a


def fleet_status(fleet: Fleet, now: datetime | None = None) -> list[dict]:
    now = now or datetime.now(timezone.utc)
    rows = []
    for w in fleet.workloads:
        ms = fleet_manifests(fleet, w.name)
        valid = next((m for m in ms if m.state.restorable), None)
        checked = next((m for m in ms if m.state in (CheckpointState.verified, CheckpointState.verify_failed)), None)
        rows.append({
            "workload": w.name, "node": w.node, "traffic": w.traffic.value,
            "checkpoints": len(ms), "by_state": {s.value: sum(m.state == s for m in ms) for s in CheckpointState},
            "newest": ms[0].id if ms else None, "newest_state": ms[0].state.value if ms else None,
            "newest_reason": ms[0].state_reason if ms else None,
            "valid": valid.id if valid else None,
            "age_s": (now - valid.created).total_seconds() if valid else None,
            "verified": None if checked is None else checked.state == CheckpointState.verified,
            "bytes": sum(m.bytes for m in ms),
            "restores": [r for m in ms for r in m.probe.get("restores", [])],
        })
    return rows


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
        size = GaugeMetricFamily("ckptflow_bytes_stored", "Image bytes stored.", labels=["workload"])
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
