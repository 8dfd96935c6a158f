"""Engine load from Prometheus text: vLLM's, SGLang's and llama.cpp's own metric names.

One engine process may expose several series of a family: a data-parallel vLLM has one per
engine (``engine="0"``, ``engine="1"``), a labelled counter one per label value. How they
combine is said per family (``Combine``): counts and counters add up, a usage ratio is
averaged (two engines at 0.31 and 0.29 are a worker at 0.30 of its declared capacity, not
0.60), a high-water mark takes the largest.

Example (a data-parallel vLLM, two engines):
    >>> text = '''vllm:num_requests_running{engine="0"} 3
    ... vllm:num_requests_running{engine="1"} 2
    ... vllm:kv_cache_usage_perc{engine="0"} 0.31
    ... vllm:kv_cache_usage_perc{engine="1"} 0.29
    ... '''
    >>> load = parse_metrics("vllm", text)
    >>> load.running, round(load.kv_cache_usage, 2)
    (5.0, 0.3)
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field


class Combine(str, Enum):
    """How the series of one family make the worker's value."""

    sum = "sum"     # counts (requests, tokens) and counters: each series counts its own part
    mean = "mean"   # ratios of equal parts (per-engine KV usage): the worker's overall ratio
    max = "max"     # high-water marks: the largest one seen anywhere


class Metric(NamedTuple):
    """Family names for one WorkloadLoad field, newest first, and how their series combine."""

    families: tuple[str, ...]
    combine: Combine


_SUM, _MEAN, _MAX = Combine.sum, Combine.mean, Combine.max

# engine -> our field -> families (newest first: vLLM renamed gpu_cache_usage_perc).
# request_duration names a histogram; its mean comes from the summed _sum and _count.
_NAMES: dict[str, dict[str, Metric]] = {
    "vllm": {
        "running": Metric(("vllm:num_requests_running",), _SUM),
        "waiting": Metric(("vllm:num_requests_waiting",), _SUM),
        "kv_cache_usage": Metric(("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), _MEAN),
        "prompt_tokens_total": Metric(("vllm:prompt_tokens",), _SUM),
        "generation_tokens_total": Metric(("vllm:generation_tokens",), _SUM),
        "request_duration": Metric(("vllm:e2e_request_latency_seconds",), _SUM),
    },
    "sglang": {
        "running": Metric(("sglang:num_running_reqs",), _SUM),
        "waiting": Metric(("sglang:num_queue_reqs",), _SUM),
        "kv_cache_usage": Metric(("sglang:token_usage",), _MEAN),
        "used_tokens": Metric(("sglang:num_used_tokens",), _SUM),
        "prompt_tokens_total": Metric(("sglang:prompt_tokens",), _SUM),
        "generation_tokens_total": Metric(("sglang:generation_tokens",), _SUM),
        "request_duration": Metric(("sglang:e2e_request_latency_seconds",), _SUM),
    },
    # llama-server --metrics (tools/server/server-task.cpp). prompt_tokens_total counts only the
    # prompt tokens computed (cached ones are in prompt_tokens_cached_total): new KV, as the
    # cadence policy wants it. llama-server exports no current KV occupancy; n_tokens_max, the
    # longest sequence seen, stands for the tokens held: exact for one growing session per
    # slot, an over-estimate once sessions end, which errs on the side of protecting.
    "llamacpp": {
        "running": Metric(("llamacpp:requests_processing",), _SUM),
        "waiting": Metric(("llamacpp:requests_deferred",), _SUM),
        "used_tokens": Metric(("llamacpp:n_tokens_max",), _MAX),
        "prompt_tokens_total": Metric(("llamacpp:prompt_tokens_total",), _SUM),
        "generation_tokens_total": Metric(("llamacpp:tokens_predicted_total",), _SUM),
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


def known_engines() -> list[str]:
    return sorted(_NAMES)


def _combine(values: list[float], how: Combine) -> float:
    if how is Combine.mean:
        return sum(values) / len(values)
    if how is Combine.max:
        return max(values)
    return sum(values)


def _series(text: str) -> dict[str, list[float]]:
    """Family name (as exposed, counters with their ``_total``) -> its series' values.

    Histograms give ``<name>_sum`` and ``<name>_count``; a counter's ``_created`` timestamps
    are left out (they are not counts).
    """
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if fam.type == "counter":
                # The parser drops a counter family's _total and adds it to every sample, even
                # to llama.cpp's counter without one (n_tokens_max): key both spellings.
                if s.name != fam.name + "_total":
                    continue
                keys = (fam.name, fam.name + "_total")
            elif fam.type == "histogram":
                if not s.name.endswith(("_sum", "_count")):
                    continue
                keys = (s.name,)
            else:
                if s.name != fam.name:
                    continue
                keys = (fam.name,)
            for k in keys:
                out.setdefault(k, []).append(s.value)
    return out


def metric_names(engine: str) -> dict[str, Metric]:
    """The mapping of one engine named here (a copy): what its adapter declares (engines/adapter.py)."""
    return dict(_NAMES[engine])


def parse_metrics(engine: str, text: str) -> WorkloadLoad:
    """Parse a /metrics body; the series of each family combine as its mapping says.

    Raises:
        ValueError: the engine has no mapping, or the text is not Prometheus exposition.
    """
    names = _NAMES.get(engine)
    if names is None:
        raise ValueError(f"engine {engine!r} has no metric mapping (known: {', '.join(_NAMES)})")
    return parse_mapped(names, text)


def parse_mapped(names: Mapping[str, Metric], text: str) -> WorkloadLoad:
    """Parse a /metrics body with a mapping of WorkloadLoad field -> Metric (an engine adapter's).

    Raises:
        ValueError: the text is not Prometheus exposition.
    """
    series = _series(text)
    out: dict[str, float | None] = {}
    for field, metric in names.items():
        if field == "request_duration":
            for f in metric.families:
                total, count = series.get(f + "_sum"), series.get(f + "_count")
                if total and count and sum(count):
                    out["mean_request_s"] = sum(total) / sum(count)
                    break
            continue
        for f in metric.families:
            if series.get(f):
                out[field] = _combine(series[f], metric.combine)
                break
    if "kv_cache_usage" in out:
        out["kv_cache_usage"] = min(1.0, max(0.0, out["kv_cache_usage"]))
    return WorkloadLoad(**out)
