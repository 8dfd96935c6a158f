"""SGLang as an engine adapter, on paper (docs/engines/sglang.md): its metric names and an
OpenAI-style golden request. It is not run here; the two-tier calls go to ckptflow's protocol
on its address, which SGLang would serve through a plugin (the mapping in docs/engines/protocol.md).
"""

from __future__ import annotations

from ckptflow.engines.adapter import EngineAdapter, register
from ckptflow.models import GoldenRequest
from ckptflow.policies.load import metric_names


@register
class SglangAdapter(EngineAdapter):
    name = "sglang"
    summary = "SGLang (on paper): its metric names; the protocol through a plugin"
    metrics = metric_names("sglang")

    def golden_request(self, base: str, *, served_name: str = "default", **kw: object) -> GoldenRequest:
        return GoldenRequest(url=base.rstrip("/") + "/v1/completions", field="choices.0.text",
                             body={"model": served_name, "prompt": "ckptflow golden request", "max_tokens": 8,
                                   "temperature": 0})
