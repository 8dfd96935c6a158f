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
from ckptflow.models import CheckpointState
from ckptflow.store import open_store

RESTORE_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


def fleet_status(fleet: Fleet, now: datetime | None = None) -> list[dict]:
    now = now or datetime.now(timezone.utc)
    store = open_store(fleet.storage)
    rows = []
    for w in fleet.workloads:
        ms = store.list(w.name)
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
