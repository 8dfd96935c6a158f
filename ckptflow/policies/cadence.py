"""Checkpoint cadence per workload: skip, protect(interval), checkpoint_now, drain.

A fleet file picks a policy per workload by name, first matching rule wins, and gives it
parameters; each policy's parameters are a pydantic model, so a misspelt key is an error
that names its line instead of a default silently used::

    policies:
      - match: {traffic: long_sessions}
        policy: cost-based                 # CostBasedParams
        params: {min_interval_s: 300, max_interval_s: 86400}
      - match: {labels: {tier: batch}}
        policy: never                      # NeverParams: no parameters
      - match: {}
        policy: fixed                      # FixedParams
        params: {interval_s: 1800}

Policies are registered by name (``@register("fixed", FixedParams)``) in
``registry.CADENCE_POLICIES`` (``POLICIES`` is its dict), which the fleet loader checks rules
against; an unknown name is refused in the line every seam's registry gives.

Pure: facts in, a Decision out (with a one-line reason that shows the numbers).

The cost model, in GPU-seconds of one worker:
- a checkpoint pauses the worker for C seconds (measured pause, else footprint x 1.3 s/GiB,
  the H200 heartbeat pause of bench/gpu_checkpoint.py in bench/RESULTS.md);
- the bytes it writes cost b GPU-seconds per GiB (``CostModel.bytes_s_per_gib``: node disk and
  network, the shared tier, their dollars at the GPU-hour price), so C is the pause plus b x the
  GiB written (a whole process writes its footprint);
- a failure costs a restore R plus re-prefilling every KV token not in the checkpoint
  (at ``prefill_tokens_s``); with no checkpoint at all, a cold start instead of R.
If the KV at risk grows at g GPU-s per second (new tokens / prefill rate), the loss since
the last checkpoint grows like g*t, so Young's interval becomes sqrt(2 C M / g) and Daly's
higher-order form applies to C' = C/g. A checkpoint pays off only when its pause and bytes cost
less than the re-prefill it saves: C/tau + lambda*min(g*tau/2, A) < lambda*A, A = live KV in
GPU-s. Short-request traffic never pays: what is at risk is a retry of a few seconds.

A ``template-sessions`` workload (``WorkloadFacts.checkpoint_mode``) is checkpointed as a template of
the initialised engine plus the session KV it exports, bytes in proportion to what changed
(bench/gpu_two_tier.py). Its heartbeat pauses C0 + p x (GiB of KV changed since the previous
one) and writes those GiB, so pause and bytes are paid at a rate k = (p + b) x (GiB of new KV per
second) whatever the interval, plus C0 per heartbeat; the interval is Daly's for C0 and it pays
off only when C0/tau + k + lambda*min(g*tau/2, A) < lambda*A. Its restore is the template's fixed
cost plus weights and live KV streamed at ``stream_gib_s``.

A CPU-only worker (``WorkloadFacts.device == "cpu"``: llama.cpp, the demo worker) is costed in
seconds of the worker, not GPU-seconds (which are 0 for it): its lost KV is recomputed at
``cpu_prefill_tokens_s`` and a checkpoint costs its pause (its bytes are not priced: b is in
GPU-seconds). Its pause holds no accelerator, so new state worth more than ``burst_factor``
pauses of recompute is checkpointed whatever the MTBF says; the GPU order (steady-state skip
before the burst check) is unchanged.

Example:
    >>> facts = WorkloadFacts(name="chat", traffic="long_sessions", footprint_gib=20, mtbf_s=24 * 3600,
    ...                       live_tokens=2e7, growth_tokens_s=2000, tokens_since_ckpt=1e6,
    ...                       seconds_since_ckpt=600.0)
    >>> d = decide(facts)
    >>> d.action.value, round(d.interval_s), d.due
    ('protect', 6329, False)
    >>> d.reason
    'Daly interval 1.8 h saves 29.2 GPU-s/h (C=26s + 23s bytes (20 GiB), M=24.0 h, KV at risk 2000 GPU-s growing 720/h)'
    >>> decide(facts, "cost-based", {"max_interval_s": 1800}).interval_s
    1800.0

An agent worker on a node that fails about daily: its whole process costs more to checkpoint
than the KV it would save; in two tiers a heartbeat pauses only to move the new KV, which pays
while bytes are free, but not the 88 GiB an hour it would write at the default price:
    >>> agent = WorkloadFacts(name="agent", traffic="long_sessions", footprint_gib=80, mtbf_s=24 * 3600,
    ...                       live_tokens=1e6, growth_tokens_s=200, tokens_since_ckpt=1e5, seconds_since_ckpt=600.0)
    >>> decide(agent).reason
    'checkpoints cost more than they save: 24.3 vs 4.2 GPU-s/h (C=104s + 91s bytes (80 GiB), M=24.0 h, KV at risk 100 GPU-s growing 72/h)'
    >>> agent.checkpoint_mode = "template-sessions"
    >>> free_bytes = CostModel(shared_tier_usd_per_gib=0.0, node_usd_per_gib=0.0)
    >>> d = decide(agent, cost=free_bytes)
    >>> d.action.value, round(d.interval_s), d.due
    ('protect', 557, True)
    >>> d.reason
    'Daly interval 9.3 min saves 0.5 GPU-s/h (C=0.04s + 0.036 s/GiB x 87.9 GiB/h changed, M=24.0 h, KV at risk 100 GPU-s growing 72/h)'
    >>> decide(agent).reason
    'checkpoints cost more than they save: 103.6 vs 4.2 GPU-s/h (C=0.04s + (0.036 s/GiB pause + 1.138 s/GiB bytes) x 87.9 GiB/h changed, M=24.0 h, KV at risk 100 GPU-s growing 72/h)'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckptflow.models import Action, Decision
from ckptflow.registry import CADENCE_POLICIES, Entry

INF = math.inf


GIB = float(2**30)


class CostModel(BaseModel):
    """Measured and assumed costs; defaults from the H200 measurements in bench/RESULTS.md.

    The first five fields are the whole-process path (``checkpoint: process``); the ``session_*``,
    ``template_restore_s``, ``stream_gib_s`` and ``kv_bytes_per_token`` fields are the two-tier
    path (``checkpoint: template-sessions``), measured on the vLLM-shaped engine of bench/gpu_two_tier.py
    (bench/results/gpu_two_tier.json, row B of its first run, 2026-11-29: 124 GiB reserved, pool at
    90 %; the re-run of 2026-12-01 gave 2.76 s and 20.5 GiB/s, within the model's margins). A workload's
    ``WorkloadFacts.checkpoint_mode`` picks which apply.

    Bytes are priced too, in the model's one unit, GPU-seconds: the dollars a GiB written costs
    (``node_usd_per_gib``: the node's disk and network; ``shared_tier_usd_per_gib``: the shared tier)
    at the price of a GPU-second (``gpu_usd_per_hour`` / 3600), so ``bytes_s_per_gib`` is what a GiB
    an export or a heartbeat writes costs beside the GPU-seconds it pauses. Defaults (1.14 GPU-s per
    GiB): an H200 at $2.50 an hour, S3 Standard with ckptflow's 8 MiB chunks, a data-center NVMe's
    endurance; a GiB of KV at 64 KiB/token re-prefills in 1.64 GPU-s (at 128 KiB/token in 0.82, less
    than writing it), so moving KV pays only where an interruption is likely to need it. The
    GPU-side contention of writing is not here but in the measured pause fields (a turn export's is
    0 per GiB); the node's bandwidth is not charged as contention (2 GB/s across 64 nodes is 31 MB/s
    a node, well under 1 % of its NIC). A CPU-only worker's bytes are not priced: its costs count
    its own seconds, which a GPU-hour price does not convert.

    Examples:
        >>> cost = CostModel()
        >>> round(cost.bytes_s_per_gib(), 3), cost.bytes_s_per_gib("cpu")
        (1.138, 0.0)
        >>> round(CostModel(shared_tier_usd_per_gib=0.0).bytes_s_per_gib(), 3)   # no shared tier: the disk only
        0.115
    """

    pause_s_per_gib: float = Field(1.3, gt=0, description="Heartbeat pause per GiB of GPU footprint.")
    restore_gib_s: float = Field(1.25, gt=0, description="Restore throughput (CRIU + CUDA), GiB/s.")
    restore_fixed_s: float = Field(5.0, ge=0, description="Fixed part of a restore (health, probes).")
    cold_start_s: float = Field(600.0, gt=0, description="Cold start of a worker: weights, graphs.")
    prefill_tokens_s: float = Field(10_000.0, gt=0, description="Re-prefill rate of lost KV.")
    session_pause_s_per_gib: float = Field(
        0.036, ge=0, description="Two-tier heartbeat: pause per GiB of session KV changed since the previous "
        "heartbeat (H200: 0.036 s holding the engine for 0.987 GiB of changed blocks out of 4.97 GiB live).")
    session_pause_fixed_s: float = Field(
        0.036, ge=0, description="Two-tier heartbeat: fixed part of the pause (lock, fingerprints of the live "
        "blocks, sync). The one measurement cannot be split, so the whole measured pause is charged here too: "
        "the model overstates it (0.072 s for 1 GiB changed, measured 0.036 s).")
    turn_export_fixed_s: float = Field(
        0.00166, ge=0, description="Two-tier export of one session at its turn end (it is between turns: the export "
        "holds that session only, the engine serves on): fixed GPU-seconds the other sessions lose per export. "
        "H200 (bench/results/gpu_turn_export.json, 2026-12-01 16:06): 0.0017, 0.0016, 0.0016 s at 0.25, 0.5 and "
        "1 GiB, within the noise (0.0028 s per export; the host-only control window lost 0.0023 s).")
    turn_export_s_per_gib: float = Field(
        0.0, ge=0, description="Two-tier export at a turn end: GPU-seconds a batch-1 decoding session beside "
        "it loses per GiB copied out. Same run: the fit's slope is -0.00004 s/GiB, so 0. It was 0.0266 before "
        "the export copied one piece in flight and wrote from a process of its own (bench/gpu_copy_interference.py). "
        "A held export of the same bytes: 0.0046 s + 0.0183 s/GiB.")
    template_restore_s: float = Field(
        2.85, ge=0, description="Two-tier restore, fixed part: CRIU + CUDA restore of the template image "
        "(2.18 GiB; 2.40 s) and the chunk check (0.45 s), row B.")
    stream_gib_s: float = Field(
        20.9, gt=0, description="Two-tier restore: weights and session KV streamed from host to GPU, GiB/s "
        "(row B 20.9, row A 23.7; limit of the host 32.4).")
    kv_bytes_per_token: float = Field(
        131_072.0, gt=0, description="KV bytes per token when the facts do not say: bf16 K and V of 32 layers "
        "x 8 KV heads x 128 (an 8B-class GQA model, one GPU).", examples=[65_536, 327_680])
    cpu_prefill_tokens_s: float = Field(
        200.0, gt=0, description="Re-prefill rate of lost KV on a CPU-only worker (device cpu). Assumed, not "
        "measured here: llama.cpp prompt processing of a 7B-class Q4 model on 8-16 cores is roughly "
        "50-300 tokens/s, 50x below prefill_tokens_s.", examples=[50, 1000])
    gpu_usd_per_hour: float = Field(
        2.50, gt=0, description="Price of one GPU-hour, to turn the dollars bytes cost into GPU-seconds. Assumed: an "
        "H200 fleet serving all month on committed capacity, about $2.50 (2026 surveys: H200 on demand $2.50-3.50 "
        "at long-tail clouds, $3.50-4.50 at specialty ones, $4.50-7.00 at hyperscalers; reservations 30-50 % less). "
        "A dearer GPU makes bytes cheaper in GPU-seconds.", examples=[3.5, 7.0])
    shared_tier_usd_per_gib: float = Field(
        0.00071, ge=0, description="Dollars per GiB written to the shared tier (a fleet's S3 bucket). S3 Standard "
        "list prices: PUT $0.005 per 1,000 requests x 128 chunks of 8 MiB (store/objects.py CHUNK) = $0.00064, plus "
        "$0.023 per GB-month for the ~2 h a session's chunks stay referenced (its remaining life in the reference "
        "trace, until a later export replaces them) = $0.00007. 0: no shared tier.", examples=[0.0, 0.00071])
    node_usd_per_gib: float = Field(
        0.00008, ge=0, description="Dollars per GiB the node's own disk and network carry: a 7.68 TB data-center "
        "NVMe rated 1 drive write a day for 5 years (14 PB) at about $1,000 wears $0.00008 per GiB written; the "
        "upload to an in-region bucket is not billed (across zones add $0.02: $0.01/GB each way).",
        examples=[0.00008, 0.0216])

    def bytes_s_per_gib(self, device: str = "gpu") -> float:
        """GPU-seconds one GiB written costs (node disk and network, shared tier; 0 on a CPU-only worker)."""
        if device == "cpu":
            return 0.0
        return (self.node_usd_per_gib + self.shared_tier_usd_per_gib) * 3600 / self.gpu_usd_per_hour

    def bytes_s(self, n_bytes: float, device: str = "gpu") -> float:
        """GPU-seconds writing ``n_bytes`` costs."""
        return n_bytes / GIB * self.bytes_s_per_gib(device)

    def kv_bytes_s(self, tokens: float, bytes_per_token: float | None = None, device: str = "gpu") -> float:
        """GPU-seconds writing the KV of ``tokens`` tokens costs."""
        return self.kv_gib(tokens, bytes_per_token) * self.bytes_s_per_gib(device)

    def prefill_rate(self, device: str = "gpu") -> float:
        """Tokens per second a lost KV is recomputed at, on this device."""
        return self.cpu_prefill_tokens_s if device == "cpu" else self.prefill_tokens_s

    def pause_s(self, footprint_gib: float, measured: float | None = None) -> float:
        return measured if measured is not None and measured > 0 else footprint_gib * self.pause_s_per_gib

    def restore_s(self, footprint_gib: float) -> float:
        return footprint_gib / self.restore_gib_s + self.restore_fixed_s

    def kv_gib(self, tokens: float, bytes_per_token: float | None = None) -> float:
        """GiB of KV that ``tokens`` tokens hold."""
        return tokens * (bytes_per_token or self.kv_bytes_per_token) / GIB

    def session_pause_s(self, changed_tokens: float, bytes_per_token: float | None = None) -> float:
        """Pause of one two-tier heartbeat that moves ``changed_tokens`` tokens of KV."""
        return self.session_pause_fixed_s + self.session_pause_s_per_gib * self.kv_gib(changed_tokens, bytes_per_token)

    def turn_export_s(self, changed_tokens: float, bytes_per_token: float | None = None) -> float:
        """GPU-seconds one turn-boundary export of ``changed_tokens`` tokens of a session costs."""
        return self.turn_export_fixed_s + self.turn_export_s_per_gib * self.kv_gib(changed_tokens, bytes_per_token)

    def template_sessions_restore_s(self, weights_gib: float, kv_tokens: float,
                                    bytes_per_token: float | None = None) -> float:
        """Restore of a two-tier checkpoint: template, then weights and ``kv_tokens`` of sessions streamed in."""
        return self.template_restore_s + (weights_gib + self.kv_gib(kv_tokens, bytes_per_token)) / self.stream_gib_s


@dataclass(slots=True)
class WorkloadFacts:
    """What can be observed about one workload at one tick (seconds, tokens, epoch times)."""

    name: str
    traffic: str = "mixed"                     # TrafficClass value
    footprint_gib: float = 0.0
    measured_pause_s: float | None = None
    mtbf_s: float = 6000 * 3600.0
    live_tokens: float = 0.0                   # KV tokens held now (sessions alive)
    growth_tokens_s: float = 0.0               # rate at which new KV tokens appear
    tokens_since_ckpt: float | None = None     # new KV since the newest valid checkpoint
    seconds_since_ckpt: float | None = None    # None: no valid checkpoint
    restarted: str | None = None               # why the newest checkpoint is not of the running process
    newest_invalidated: bool = False
    mean_request_s: float | None = None
    now: float = 0.0
    maintenance: list[tuple[float, float]] = field(default_factory=list)
    unsupported: str | None = None             # why the worker, as started, cannot be checkpointed
    gone: str | None = None                    # why its process cannot be found: the worker is lost
    checkpoint_mode: str = "process"           # CheckpointMode value: "process" or "template-sessions"
    weights_gib: float | None = None           # two-tier: weights a restore streams (None: the footprint)
    kv_bytes_per_token: float | None = None    # two-tier: None = CostModel.kv_bytes_per_token
    device: str = "gpu"                        # "cpu": a CPU-only worker, costed in its own seconds

    @property
    def template_sessions(self) -> bool:
        return self.checkpoint_mode == "template-sessions"

    @property
    def unit(self) -> str:
        """What the policy's cost rates count: GPU-seconds, or a CPU-only worker's own seconds."""
        return "CPU-s" if self.device == "cpu" else "GPU-s"


def heartbeat_pause_s(f: WorkloadFacts, cost: CostModel, changed_tokens: float | None = None) -> float:
    """Pause of a heartbeat now: the whole process's (measured, else by footprint), or in two tiers
    the fixed part plus the KV changed since the last checkpoint (``changed_tokens``, default
    what the facts say is new). ``measured_pause_s`` applies to the process path only: a two-tier
    pause depends on what changed, not on the last one."""
    if not f.template_sessions:
        return cost.pause_s(f.footprint_gib, f.measured_pause_s)
    if changed_tokens is None:
        changed_tokens = f.live_tokens if f.tokens_since_ckpt is None else f.tokens_since_ckpt
    return cost.session_pause_s(max(changed_tokens, 0.0), f.kv_bytes_per_token)


def heartbeat_bytes_gib(f: WorkloadFacts, cost: CostModel, changed_tokens: float | None = None) -> float:
    """GiB a heartbeat now writes: the whole process's footprint, or in two tiers the KV changed since
    the last checkpoint (``changed_tokens``, default what the facts say is new)."""
    if not f.template_sessions:
        return f.footprint_gib
    if changed_tokens is None:
        changed_tokens = f.live_tokens if f.tokens_since_ckpt is None else f.tokens_since_ckpt
    return cost.kv_gib(max(changed_tokens, 0.0), f.kv_bytes_per_token)


def heartbeat_cost_s(f: WorkloadFacts, cost: CostModel, changed_tokens: float | None = None) -> float:
    """What a heartbeat now costs: its pause (``heartbeat_pause_s``) plus the bytes it writes, priced
    at ``CostModel.bytes_s_per_gib``."""
    return (heartbeat_pause_s(f, cost, changed_tokens)
            + heartbeat_bytes_gib(f, cost, changed_tokens) * cost.bytes_s_per_gib(f.device))


def restore_estimate_s(f: WorkloadFacts, cost: CostModel) -> float:
    """Restore of the workload's newest checkpoint, by its checkpoint mode."""
    if not f.template_sessions:
        return cost.restore_s(f.footprint_gib)
    weights = f.weights_gib if f.weights_gib is not None else f.footprint_gib
    return cost.template_sessions_restore_s(weights, f.live_tokens, f.kv_bytes_per_token)


def young_interval(c: float, m: float) -> float:
    """Young (1974): sqrt(2 C M)."""
    return math.sqrt(2 * c * m)


def daly_interval(c: float, m: float) -> float:
    """Daly (2006) higher-order optimum; for C >= 2M the continuous value 8M/9.

    Non-decreasing in both C and M (the C >= 2M branch meets the formula at C = 2M), so a
    larger checkpoint cost or a more reliable node never shortens the interval.
    """
    if c <= 0:
        return 0.0
    if c >= 2 * m:
        return 8 * m / 9
    return math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c


def _fmt(s: float) -> str:
    if s == INF:
        return "never"
    for unit, n in (("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}"
    return f"{s:.0f} s"


def _maintenance(f: WorkloadFacts, lead_s: float) -> tuple[str, float] | None:
    for start, end in f.maintenance:
        if start <= f.now < end:
            return "in", end
        if 0 <= start - f.now <= lead_s:
            return "ahead", start
    return None


def _is_short(f: WorkloadFacts, short_request_s: float) -> bool:
    if f.traffic == "short_requests":
        return True
    return (f.traffic == "mixed" and f.mean_request_s is not None and f.mean_request_s < short_request_s
            and f.live_tokens <= 0)


def cost_based_interval(f: WorkloadFacts, cost: CostModel, min_s: float = 0.0, max_s: float = INF
                        ) -> tuple[float, str]:
    """Interval for one workload (INF = not worth checkpointing) and the reason with numbers."""
    b = cost.bytes_s_per_gib(f.device)   # what a GiB written costs, beside the pause
    if f.template_sessions:
        # Fixed pause per heartbeat, plus a rate k for moving the new KV: its pause and its bytes,
        # paid whatever tau (each heartbeat writes what changed since the previous one).
        c = cost.session_pause_fixed_s
        k = (cost.session_pause_s_per_gib + b) * cost.kv_gib(max(f.growth_tokens_s, 0.0), f.kv_bytes_per_token)
    else:  # every heartbeat writes the whole footprint
        c, k = cost.pause_s(f.footprint_gib, f.measured_pause_s) + b * f.footprint_gib, 0.0
    g = f.growth_tokens_s / cost.prefill_rate(f.device)
    a = f.live_tokens / cost.prefill_rate(f.device)
    lam = 1.0 / f.mtbf_s
    if g <= 0 or a <= 0:
        return INF, f"no KV growing (live {f.live_tokens:.0f} tokens, +{f.growth_tokens_s:.0f}/s)"
    # Whether checkpoints pay off is judged at the optimum; the rule's bounds then only move
    # the interval (an operator's max_interval_s must not turn protection off).
    opt = daly_interval(c / g, f.mtbf_s)
    if opt > 0:
        with_ckpt = c / opt + k + lam * min(g * opt / 2, a)
    else:  # no fixed pause (two tiers, C0 = 0): the limit tau -> 0
        with_ckpt = k if k > 0 else INF
    tau = min(max(opt, min_s), max_s)
    without = lam * a
    if f.template_sessions:
        per_h = cost.kv_gib(f.growth_tokens_s * 3600, f.kv_bytes_per_token)
        per_gib = (f"({cost.session_pause_s_per_gib:.3f} s/GiB pause + {b:.3f} s/GiB bytes)" if b else
                   f"{cost.session_pause_s_per_gib:.3f} s/GiB")
        pause = f"C={c:.2f}s + {per_gib} x {per_h:.1f} GiB/h changed"
    elif b:
        pause = f"C={c - b * f.footprint_gib:.0f}s + {b * f.footprint_gib:.0f}s bytes ({f.footprint_gib:.0f} GiB)"
    else:
        pause = f"C={c:.2f}s" if f.device == "cpu" else f"C={c:.0f}s"
    numbers = (f"{pause}, M={_fmt(f.mtbf_s)}, KV at risk {a:.0f} {f.unit} growing {g * 3600:.0f}/h")
    if with_ckpt >= without:
        return INF, (f"checkpoints cost more than they save: {_rate(with_ckpt * 3600)} vs "
                     f"{_rate(without * 3600)} {f.unit}/h ({numbers})")
    return tau, f"Daly interval {_fmt(tau)} saves {_rate((without - with_ckpt) * 3600)} {f.unit}/h ({numbers})"


def _rate(x: float) -> str:
    """A cost rate that stays readable when small: two significant digits below 0.1 (a CPU worker's
    rates are in millionths of a GPU-second per hour; '0.0 vs 0.0' told nothing)."""
    return "inf" if x == INF else (f"{x:.1f}" if abs(x) >= 0.1 or x == 0 else f"{x:.2g}")


class PolicyParams(BaseModel):
    """Parameters of one policy (a rule's ``params:``). Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CostBasedParams(PolicyParams):
    """``cost-based``: Daly's interval for the KV growth rate, only where it pays (see above)."""

    min_interval_s: float = Field(60.0, ge=0, description="Never protect more often than this.", examples=[300])
    max_interval_s: float = Field(7 * 86400.0, ge=0, description="Protect at least this often once checkpoints "
                                  "pay off at all (it never turns protection on).", examples=[86400])
    short_request_s: float = Field(60.0, ge=0, description="Mixed traffic whose mean request is shorter than "
                                   "this and holds no KV is treated as short requests (skip).")
    burst_factor: float = Field(3.0, ge=0, description="Checkpoint now when the new KV since the last checkpoint "
                                "exceeds this many intervals' worth (or pauses' worth).")
    maintenance_lead_s: float | None = Field(None, ge=0, description="How long before a maintenance window to "
                                             "checkpoint or drain; default max(900 s, 3 x the pause).")

    @model_validator(mode="after")
    def _ordered(self) -> "CostBasedParams":
        if self.min_interval_s > self.max_interval_s:
            raise ValueError(f"min_interval_s {self.min_interval_s:g} is above max_interval_s {self.max_interval_s:g}")
        return self


class FixedParams(PolicyParams):
    """``fixed``: protect at one interval, whatever the costs."""

    interval_s: float = Field(3600.0, ge=0, description="Checkpoint interval.", examples=[1800])


class NeverParams(PolicyParams):
    """``never``: no checkpoints (no parameters)."""


P = TypeVar("P", bound=PolicyParams)
DecideFn = Callable[[WorkloadFacts, Any, CostModel], Decision]


@dataclass(frozen=True, slots=True)
class Policy(Entry):
    """A registered policy: its name in fleet files, its parameters' model (``name`` and ``params``
    are the registry's ``Entry``'s), its decision."""

    decide: DecideFn
    defaults: PolicyParams          # what a rule without ``params:`` gets

    def parse(self, params: Mapping[str, Any] | PolicyParams | None) -> PolicyParams:
        """``params`` as this policy's model (None: ``defaults``).

        Raises:
            pydantic.ValidationError: an unknown key, or a value of the wrong type or range.
        """
        return self.defaults if params is None else Entry.parse(self, params)


# The registry's own dict (registry.CADENCE_POLICIES, which fleet.py checks rules against).
POLICIES: dict[str, Policy] = CADENCE_POLICIES.entries


def register(name: str, params: type[P]) -> Callable[[DecideFn], DecideFn]:
    """Register a decision function under ``name`` with its parameters' model."""
    def add(fn: DecideFn) -> DecideFn:
        CADENCE_POLICIES.add(name, Policy(name, params, fn, params()))
        return fn
    return add


def get_policy(name: str) -> Policy:
    """The registered policy called ``name``.

    Raises:
        KeyError: no policy of that name (the fleet file loader checks names first).
    """
    return CADENCE_POLICIES.lookup(name)


@register("cost-based", CostBasedParams)
def decide_cost_based(f: WorkloadFacts, params: CostBasedParams, cost: CostModel) -> Decision:
    min_s = params.min_interval_s
    max_s = params.max_interval_s
    short_request_s = params.short_request_s
    burst_factor = params.burst_factor
    pause = heartbeat_pause_s(f, cost)  # two tiers: the pause of moving what is new now
    c = heartbeat_cost_s(f, cost)       # ... and the bytes it writes
    ps = f"{pause:.2f}" if f.template_sessions else f"{pause:.0f}"
    cs = f"{ps} s pause" if c == pause else (f"{ps} s pause + {c - pause:.{2 if f.template_sessions else 0}f} s "
                                             f"for {heartbeat_bytes_gib(f, cost):.1f} GiB written")
    lead_s = params.maintenance_lead_s if params.maintenance_lead_s is not None else max(900.0, 3 * pause)
    at_risk_tokens = f.live_tokens if f.tokens_since_ckpt is None else f.tokens_since_ckpt
    at_risk_s = at_risk_tokens / cost.prefill_rate(f.device)
    short = _is_short(f, short_request_s)

    m = _maintenance(f, lead_s)
    if m and m[0] == "in":
        return Decision(workload=f.name, action=Action.drain, reason=f"node in maintenance until t={m[1]:.0f}")
    if m:
        mins = (m[1] - f.now) / 60
        if not short and at_risk_s > c and (f.seconds_since_ckpt is None or f.seconds_since_ckpt > f.now - m[1] + lead_s):
            return Decision(workload=f.name, action=Action.checkpoint_now, due=True,
                            reason=f"maintenance in {mins:.0f} min: {at_risk_s:.0f} s of re-prefill at risk "
                                   f"> {cs}")
        why = ("short requests finish" if short else
               f"at risk {at_risk_s:.0f} s <= {cs} or already checkpointed")
        return Decision(workload=f.name, action=Action.drain, reason=f"maintenance in {mins:.0f} min: drain ({why})")
    if short:
        retry = f.mean_request_s if f.mean_request_s is not None else short_request_s / 2
        if f.template_sessions:
            return Decision(workload=f.name, action=Action.skip,
                            reason=f"short requests (mean {retry:.0f} s): no session KV worth a heartbeat; "
                                   "the template restores the worker")
        return Decision(workload=f.name, action=Action.skip,
                        reason=f"short requests (mean {retry:.0f} s): a retry costs less than a {pause:.0f} s pause")
    if f.restarted:
        return Decision(workload=f.name, action=Action.checkpoint_now, due=True,
                        reason=f"{f.restarted}: nothing this process did is checkpointed")
    if f.seconds_since_ckpt is None:
        return Decision(workload=f.name, action=Action.checkpoint_now, due=True,
                        reason=f"no valid checkpoint: a failure would cost a {cost.cold_start_s:.0f} s cold start "
                               f"instead of a {restore_estimate_s(f, cost):.0f} s restore")
    if f.tokens_since_ckpt is not None and f.tokens_since_ckpt <= 0:
        return Decision(workload=f.name, action=Action.skip,
                        reason=f"nothing new since the last checkpoint {_fmt(f.seconds_since_ckpt)} ago")
    if f.device == "cpu" and f.tokens_since_ckpt is not None and at_risk_s > burst_factor * c:
        # Judged before the steady-state skip, unlike a GPU worker's burst: the pause holds no
        # accelerator and costs the worker well under a second, while the recompute is its own
        # seconds at CPU prefill speed; an MTBF-weighted rate said skip at every heartbeat.
        return _not_before_min(f, min_s, Decision(
            workload=f.name, action=Action.checkpoint_now, due=True,
            reason=f"CPU worker: {at_risk_s:.1f} s of recompute at risk ({at_risk_tokens:.0f} new KV "
                   f"tokens at {cost.cpu_prefill_tokens_s:.0f} tokens/s) > {burst_factor:g} x {c:.2f} s pause"))
    tau, why = cost_based_interval(f, cost, min_s, max_s)
    if f.newest_invalidated and at_risk_s > 0 and tau != INF:
        return Decision(workload=f.name, action=Action.checkpoint_now, interval_s=tau, due=True,
                        reason=f"newest checkpoint invalidated; {at_risk_s:.0f} s of KV unprotected")
    # The steady-state skip comes before the burst check on purpose: judging bursts first
    # (against pauses' worth) doubled the simulated fleet's cost (tests/test_cli.py, seed 3:
    # 307,906 vs 160,032 GPU-s for hindsight), since a burst is lost only on a failure, which
    # these very rates say is too rare to pay a pause for.
    if tau == INF:
        return Decision(workload=f.name, action=Action.skip, reason=why)
    g = f.growth_tokens_s / cost.prefill_rate(f.device)
    if f.tokens_since_ckpt is not None and at_risk_s > burst_factor * max(g * tau, c):
        return _not_before_min(f, min_s, Decision(
            workload=f.name, action=Action.checkpoint_now, interval_s=tau, due=True,
            reason=f"burst: {at_risk_s:.0f} s of new KV since the last checkpoint > {burst_factor:g} x "
                   f"{max(g * tau, c):.0f} s"))
    due = f.seconds_since_ckpt is None or f.seconds_since_ckpt >= tau
    return Decision(workload=f.name, action=Action.protect, interval_s=tau, due=due, reason=why)


def _not_before_min(f: WorkloadFacts, min_s: float, d: Decision) -> Decision:
    """A burst's checkpoint, held back while the last checkpoint is younger than ``min_interval_s``
    ("never protect more often than this" holds for bursts too; the next heartbeat after the
    minimum takes it, the KV still at risk then).

    Example:
        >>> f = WorkloadFacts(name="w", seconds_since_ckpt=11.0)
        >>> d = _not_before_min(f, 60.0, Decision(workload="w", action=Action.checkpoint_now, due=True, reason="burst"))
        >>> d.action.value, d.due, d.reason
        ('protect', False, 'burst held back: the last checkpoint is 11 s old < min_interval_s 1.0 min (burst)')
    """
    if f.seconds_since_ckpt is None or f.seconds_since_ckpt >= min_s:
        return d
    return Decision(workload=f.name, action=Action.protect, interval_s=min_s, due=False,
                    reason=f"burst held back: the last checkpoint is {_fmt(f.seconds_since_ckpt)} old < "
                           f"min_interval_s {_fmt(min_s)} ({d.reason})")


def forced(d: Decision) -> Decision:
    """What a manual ``heartbeat --force`` run reports for a checkpoint the policy did not ask for:
    a checkpoint, said to be forced, with the policy's own view kept in the reason.

    Example:
        >>> d = forced(Decision(workload="chat", action=Action.skip, reason="nothing new"))
        >>> d.action.value, d.reason
        ('checkpoint_now', 'forced (policy said skip: nothing new)')
    """
    return Decision(workload=d.workload, action=Action.checkpoint_now, interval_s=d.interval_s, due=True,
                    reason=f"forced (policy said {d.action.value}: {d.reason})")


@register("fixed", FixedParams)
def decide_fixed(f: WorkloadFacts, params: FixedParams, cost: CostModel) -> Decision:
    tau = params.interval_s
    due = f.seconds_since_ckpt is None or f.seconds_since_ckpt >= tau
    return Decision(workload=f.name, action=Action.protect, interval_s=tau, due=due,
                    reason=f"fixed interval {_fmt(tau)}")


@register("never", NeverParams)
def decide_never(f: WorkloadFacts, params: NeverParams, cost: CostModel) -> Decision:
    return Decision(workload=f.name, action=Action.skip, reason="policy never")


def decide(f: WorkloadFacts, policy: str = "cost-based", params: Mapping[str, Any] | PolicyParams | None = None,
           cost: CostModel | None = None) -> Decision:
    """Decide for one workload with a named policy.

    ``params`` is the policy's model, or a mapping validated into it (None: its defaults).

    Example:
        >>> decide(WorkloadFacts(name="api", seconds_since_ckpt=100.0), "fixed", {"interval_s": 60}).reason
        'fixed interval 1.0 min'
        >>> try:
        ...     decide(WorkloadFacts(name="api"), "fixed", {"intervall_s": 60})
        ... except ValueError as e:                      # pydantic.ValidationError
        ...     print(e.errors()[0]["loc"], e.errors()[0]["msg"])
        ('intervall_s',) Extra inputs are not permitted

    Raises:
        KeyError: the policy name is not registered (the fleet file loader checks names first).
        pydantic.ValidationError: ``params`` has an unknown key or a bad value.
    """
    chosen = get_policy(policy)
    params = chosen.parse(params)
    if f.gone:  # whatever the policy: nothing runs to checkpoint, and what ran is lost until recovered
        return Decision(workload=f.name, action=Action.skip, reason=f"worker gone: {f.gone}")
    if f.unsupported:  # whatever the policy: a checkpoint it cannot take is no protection
        return Decision(workload=f.name, action=Action.skip, reason=f"cannot be checkpointed: {f.unsupported}")
    return chosen.decide(f, params, cost or _DEFAULT_COST)


_DEFAULT_COST = CostModel()
