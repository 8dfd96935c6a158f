"""Moved: kept so that existing imports keep working. New code imports from the modules below.

- ``runners.node``: NodeRunner, RestoreResult (checkpoint / restore of a workload)
- ``runners.engine``: probe, golden_digest, read_load, wait_url, wait_healthy, quiesce, resume
- ``runners.facts``: collect_facts, tp_unsupported (what the cadence policy reads)
- ``runners.coldstart``: cold_start
"""

from ckptflow.runners.coldstart import cold_start
from ckptflow.runners.engine import golden_digest, probe, read_load, wait_healthy, wait_url
from ckptflow.runners.facts import collect_facts, tp_unsupported
from ckptflow.runners.node import NodeRunner, RestoreResult

__all__ = ["NodeRunner", "RestoreResult", "cold_start", "collect_facts", "golden_digest", "probe", "read_load",
           "tp_unsupported", "wait_healthy", "wait_url"]
