"""The demo engines (ckptflow/demo/: the numpy worker, the torch GPU worker, the vLLM-shaped
LLM engine) as an engine adapter: vLLM's metric names, an OpenAI-style golden request, and
ckptflow's two-tier protocol, served by all three through ckptflow/engines/engine_side.py.

    workloads:
      - name: demo-chat
        engine: demo
        health_url: http://127.0.0.1:18001/health
        metrics_url: http://127.0.0.1:18001/metrics
        checkpoint: template-sessions
"""

from __future__ import annotations

from ckptflow.engines.adapter import EngineAdapter, register
from ckptflow.models import GoldenRequest
from ckptflow.policies.load import metric_names

GOLDEN_BODY = {"prompt": "ckptflow golden request", "max_tokens": 16}


@register
class DemoAdapter(EngineAdapter):
    name = "demo"
    summary = "ckptflow's demo workers (numpy, torch, vLLM-shaped): vLLM's metric names, protocol v1"
    metrics = metric_names("vllm")  # the workers publish vLLM's names (demo/worker.py Metrics)
    protocol = 1

    def golden_request(self, base: str, **kw: object) -> GoldenRequest:
        # Stateless (no session_id): the worker seeds a throwaway session from the prompt.
        return GoldenRequest(url=base.rstrip("/") + "/v1/completions", body=dict(GOLDEN_BODY),
                             field="choices.0.tokens")
