"""Pure decisions: cadence, skip/protect, placement, retention. No I/O, no Prefect.

Policies are chosen by name in the fleet file (first matching rule wins)::

    policies:
      - match: {traffic: long_sessions}
        policy: cost-based
        params: {min_interval_s: 60, max_interval_s: 3600}
      - match: {engine: sglang, labels: {tier: batch}}
        policy: never
      - match: {}
        policy: fixed
        params: {interval_s: 1800}
"""

from ckptflow.policies.cadence import POLICIES, CostModel, WorkloadFacts, daly_interval, decide, young_interval
from ckptflow.policies.load import WorkloadLoad, parse_metrics

__all__ = ["POLICIES", "CostModel", "WorkloadFacts", "WorkloadLoad", "daly_interval", "decide",
           "parse_metrics", "young_interval"]
