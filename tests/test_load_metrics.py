"""Engine /metrics → WorkloadLoad: how several series of one family combine, per engine."""

from pathlib import Path

import pytest

from ckptflow.policies.load import _NAMES, Combine, parse_metrics

DATA = Path(__file__).parent / "data"


def test_data_parallel_vllm_ratio_is_averaged_counts_are_summed():
    # Two engines of one data-parallel vLLM worker, each with its own series.
    load = parse_metrics("vllm", (DATA / "vllm_dp_metrics.txt").read_text())
    assert load.kv_cache_usage == pytest.approx(0.30)          # not 0.60
    assert (load.running, load.waiting) == (12, 3)
    assert (load.prompt_tokens_total, load.generation_tokens_total) == (3000, 700)  # _created left out
    assert load.mean_request_s == pytest.approx(600 / 40)       # pooled histogram, not a mean of means


def test_one_series_reads_the_same_whatever_the_combine():
    one = "\n".join(line for line in (DATA / "vllm_dp_metrics.txt").read_text().splitlines()
                    if 'engine="1"' not in line) + "\n"
    load = parse_metrics("vllm", one)
    assert (load.kv_cache_usage, load.running, load.prompt_tokens_total) == (0.31, 5, 1000)


def test_every_ratio_family_is_averaged_and_every_count_summed():
    # The rule, for every engine: a family whose value is a ratio (0..1) never adds up.
    for engine, fields in _NAMES.items():
        for field, metric in fields.items():
            want = Combine.mean if field == "kv_cache_usage" else (
                Combine.max if metric.families[0].endswith("n_tokens_max") else Combine.sum)
            assert metric.combine is want, (engine, field)


def test_llamacpp_metrics_text():
    # As llama-server 11434 exposes them (tools/server/server-task.cpp): n_tokens_max is typed
    # counter without a _total suffix, which the parser renames.
    load = parse_metrics("llamacpp", (DATA / "llamacpp_metrics.txt").read_text())
    assert (load.running, load.waiting) == (1, 2)
    assert load.prompt_tokens_total == 313 and load.generation_tokens_total == 96
    assert load.used_tokens == 409
    assert load.kv_cache_usage == 0 and load.mean_request_s is None


def test_llamacpp_high_water_mark_takes_the_largest_series():
    text = ("# TYPE llamacpp:n_tokens_max counter\n"
            'llamacpp:n_tokens_max{server="a"} 300\nllamacpp:n_tokens_max{server="b"} 500\n')
    assert parse_metrics("llamacpp", text).used_tokens == 500
