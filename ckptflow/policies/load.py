"""Engine load from Prometheus text: vLLM's and SGLang's own metric names.

Example:
    >>> load = parse_metrics("vllm", open("tests/data/vllm_metrics.txt").read())   # doctest: +SKIP
    >>> load.running, load.kv_cache_usage
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

# engine -> our field -> metric family names, newest first (vLLM renamed gpu_cache_usage_perc).
_NAMES = {
    "vllm": {
        "running": ["vllm:num_requests_running"],
        "waiting": ["vllm:num_requests_waiting"],
        "kv_cache_usage": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        "prompt_tokens_total": ["vllm:prompt_tokens"],
        "generation_tokens_total": ["vllm:generation_tokens"],
        "request_duration": ["vllm:e2e_request_latency_seconds"],
    },
    "sglang": {
        "running": ["sglang:num_running_reqs"],
        "waiting": ["sglang:num_queue_reqs"],
        "kv_cache_usage": ["sglang:token_usage"],
        "used_tokens": ["sglang:num_used_tokens"],
        "prompt_tokens_total": ["sglang:prompt_tokens"],
        "generation_tokens_total": ["sglang:generation_tokens"],
        "request_duration": ["sglang:e2e_request_latency_seconds"],
    },
}


class WorkloadLoad(BaseModel):
    """What an engine's /metrics says right now."""

    running: float = Field(0, ge=0, description="Requests running.")
    waiting: float = Field(0, ge=0, description="Requests waiting.")
    kv_cache_usage: float = Field(0, ge=0, le=1, description="KV-cache usage, 0..1.")
    used_tokens: float | None = Field(None, ge=0, description="Tokens held in the KV cache, if reported.")
    prompt_tokens_total: float = Field(0, ge=0, description="Prefill tokens processed (counter).")
    generation_tokens_total: float = Field(0, ge=0, description="Generated tokens (counter).")
    mean_request_s: float | None = Field(None, ge=0, description="Mean end-to-end request duration.")

    @property
    def tokens_total(self) -> float:
        return self.prompt_tokens_total + self.generation_tokens_total

    @property
    def in_flight(self) -> float:
        return self.running + self.waiting


def parse_metrics(engine: str, text: str) -> WorkloadLoad:
    """Parse a /metrics body. Series of one family are summed (e.g. over tp_rank labels)."""
    names = _NAMES.get(engine)
    if names is None:
        raise ValueError(f"engine {engine!r} has no metric mapping (known: {', '.join(_NAMES)})")
    samples: dict[str, float] = {}
    hist: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
            if fam.type == "histogram" and s.name.endswith(("_sum", "_count")):
                suffix = s.name.rsplit("_", 1)[1]
                hist.setdefault(fam.name, {})[suffix] = hist.get(fam.name, {}).get(suffix, 0.0) + s.value
    out: dict[str, float | None] = {}
    for field, fams in names.items():
        if field == "request_duration":
            h = next((hist[f] for f in fams if f in hist), None)
            if h and h.get("count"):
                out["mean_request_s"] = h["sum"] / h["count"]
            continue
        for f in fams:
            for key in (f, f + "_total"):
                if key in samples:
                    out[field] = samples[key]
                    break
            if field in out:
                break
    if "kv_cache_usage" in out:
        out["kv_cache_usage"] = min(1.0, max(0.0, out["kv_cache_usage"]))
    return WorkloadLoad(**out)
