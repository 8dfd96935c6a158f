"""Pure decisions: cadence, skip/protect, placement, retention. No I/O, no Prefect.

Policies are chosen by name in the fleet file (first matching rule wins); each one's
``params`` are checked against its model (``CostBasedParams``, ``FixedParams``, ``NeverParams``
in cadence.py), so an unknown key fails the load with its line::

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

from ckptflow.policies.cadence import (POLICIES, CostBasedParams, CostModel, FixedParams, NeverParams, Policy,
                                       PolicyParams, WorkloadFacts, daly_interval, decide, get_policy, register,
                                       young_interval)
from ckptflow.policies.load import WorkloadLoad, parse_metrics

__all__ = ["POLICIES", "CostBasedParams", "CostModel", "FixedParams", "NeverParams", "Policy", "PolicyParams",
           "WorkloadFacts", "WorkloadLoad", "daly_interval", "decide", "get_policy", "parse_metrics", "register",
           "young_interval"]
