"""Every measured figure README.md and the pages under docs/ quote comes from a run a bench kept in
bench/results/*.json: the figure is formatted from the JSON here and must
stand in the doc as written, so a re-run that moves a number, or an edit that drifts from the
JSON, fails this test until the doc says what the newest run measured.

FIGURES: (doc, text with ``{}`` where each figure stands, results name, field(s), format(s)).
A field is a path into one run (``rows[row=A].stream_gib_s``: the row whose ``row`` is ``A``)
or a function of the run; the run is the newest one in which every field resolves, among the
runs QUOTED says the docs quote (a small code-path check run does not replace the full-size one).
So each FIGURES row picks its own run: a field that is null, or a helper that raises KeyError
(``_ab``: rows A and B both there; ``_standby``: the standby rows, timed from the kill or not),
passes over a run that does not hold what the text quotes, and two rows of one table may quote
two runs (the docs say which). A field ``every(keep, fn)`` is a figure of several runs, not one:
``fn`` gets the list of every run QUOTED allows that ``keep`` accepts, oldest first (e.g. each
PostgreSQL move of bench/migrate_downtime.py), so a new run that ``keep`` accepts moves it too; an
empty list does not resolve. A claim beside a figure (``holds``, ``same``, ``absent``) that the
chosen run, or the runs, contradict fails the test instead.
CONFIG: figures that are settings, not measurements, checked against the line that sets them.
OTHERS: figures other work re-measures now (fleet tick, policy simulator); a test of their own
holds them (tests/test_bench_results.py for the fleet tick).
DOCS: every page the figure check reads: README.md and every docs/**/*.md but those NOT_YET names, so
a new page, or a figure moved to another page, is checked without a change here.
"""

from __future__ import annotations

import re
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from _common import runs_of  # noqa: E402

MiB = 2**20


def same(*values):
    """One figure the doc quotes for several rows: they must agree, or the doc cannot. No rows at
    all is a run that does not hold the figure (an S-only standby run for an S and SB figure): passed over."""
    if not values:
        raise KeyError("no rows for this figure")
    if len(set(values)) != 1:
        raise ValueError(f"rows disagree: {values}")
    return values[0]


def absent(row: dict, key: str, then):
    """A figure the doc quotes beside "cannot run": the row must hold no such measurement."""
    if row[key] is not None:
        raise ValueError(f"{key} = {row[key]}, the doc says it cannot run")
    return then


def holds(claim, then):
    """A figure the doc quotes beside a claim ("bit-exact", "equal"): the run must bear it out."""
    if not claim:
        raise ValueError(f"the run quoted for {then!r} does not bear out the doc's claim beside it")
    return then


def span(values, spec: str) -> str:
    """Several rows' figure as the doc writes it: ``lo–hi``, or one value when they round alike."""
    lo, hi = _fmt(min(values), spec), _fmt(max(values), spec)
    return lo if lo == hi else f"{lo}–{hi}"


class every:
    """A field computed from every quoted run that ``keep`` accepts (oldest first): ``fn(runs)``."""

    def __init__(self, keep, fn):
        self.keep, self.fn = keep, fn


def _rows(run, **match):
    return [r for r in run["rows"] if all(str(r.get(k)) == v for k, v in match.items())]


def _ab(run):
    """Rows A and B (restore in place); a run without both does not resolve (a standby-only run)."""
    rows = _rows(run, row="A") + _rows(run, row="B")
    if {x["row"] for x in rows} != {"A", "B"}:
        raise KeyError("rows A and B")
    return rows


def _standby(run, from_kill: bool = True):
    """Rows S and SB (failover onto a standby). ``from_kill``: runs whose restore-to-ready counts from
    the kill, the wait for the killed original included (they record when its GPU memory was freed);
    else the runs before them, which started the clock once the killed process had exited."""
    rows = _rows(run, row="S") + _rows(run, row="SB")
    if not rows or any(("original_gpu_memory_freed_s" in x) != from_kill for x in rows):
        raise KeyError("standby rows")
    return rows


def _timed_from_kill(run) -> bool:
    try:
        return bool(_standby(run))
    except KeyError:
        return False


def _tp8(run):
    return _rows(run, backend="nccl", world_size="2", ballast_gib_per_rank="8.0")


def _cores(machine: str) -> int:
    return int(re.search(r"(\d+) cores", machine).group(1))


def _moves(db):
    """Moves of bench/migrate_downtime.py with the Prefect server on ``db`` ("postgres", "sqlite"; None:
    the runs from before the field, SQLite with older code); a failed attempt has no downtime."""
    return lambda run: run.get("db") == db and run.get("downtime_s") is not None


_PHASES = ("dump_s", "upload_s", "download_s", "restore_s", "handoff_s")


def _met(runs):
    return [r for r in runs if r["downtime_s"] <= r["target_s"]]


def _missed(runs):
    """The moves over the target, slowest first."""
    return sorted((r for r in runs if r["downtime_s"] > r["target_s"]), key=lambda r: -r["downtime_s"])


def _largest_is(runs, phase):
    """How many moves ``phase`` was the largest phase of; the doc names it, so it must be most of them."""
    n = sum(max(_PHASES, key=r.__getitem__) == phase for r in runs)
    return holds(2 * n > len(runs), n)


def _slower_steps(runs):
    """The second-slowest move over the target: each step (dump, upload, download, restore) slower than
    in any move that met it, and the hand-off shorter than its upload, download and restore."""
    slow, met = _missed(runs)[1], _met(runs)
    steps = _PHASES[:-1]
    return holds(all(slow[k] > max(r[k] for r in met) for k in steps)
                 and slow["handoff_s"] < min(slow[k] for k in steps[1:]),
                 span([slow[k] for k in steps], ".2f"))


# Which runs of a results file the docs quote (default: every run).
def _window(run, name):
    return next(w for w in run["windows"] if w["window"] == name)


def _sim(run):
    """The two-tier, exponential seeds 0-4 of a policy_sim run: each one's targets."""
    ts = [r["targets"] for r in run.get("runs", []) if r.get("profile") == "two-tier-h200"
          and r.get("failure_dist") == "exponential" and "heartbeat_sessions_over_clairvoyant" in r["targets"]]
    if sorted(r["seed"] for r in run["runs"] if r.get("profile") == "two-tier-h200"
              and r.get("failure_dist") == "exponential") != [0, 1, 2, 3, 4] or len(ts) != 5:
        raise KeyError("two-tier seeds 0-4")
    return ts


QUOTED = {
    "gpu_checkpoint": lambda run: {8.0, 20.0, 50.0} <= {r["footprint_gib"] for r in run.get("rows", [])},
    "gpu_tp": lambda run: run.get("gpus") == 2,                                       # "on two H200s"
    # A run of older engine code, kept beside the current one for comparison (``engine_code``), is not quoted.
    "gpu_two_tier": lambda run: (run.get("layers"), run.get("sessions"), run.get("tokens_per_session")) == (43, 4, 1500)
    and "engine_code" not in run,
}

A, B = "rows[row=A]", "rows[row=B]"
R = "README.md"
D = "docs/DESIGN.md"
GPU = "docs/gpu.md"
OPS = "docs/operations.md"
BENCH = "docs/benchmarks.md"
ENG = "docs/engines.md"
LLAMA = "docs/engines/llamacpp.md"
SGL = "docs/engines/sglang.md"

FIGURES = [
    # --- whole-process GPU checkpoint (bench/gpu_checkpoint.py) ---
    (GPU, "Measured on an H200 at {}, {} and {} GiB: bit-exact continuation", "gpu_checkpoint",
     lambda r: tuple(x["footprint_gib"] for x in r["rows"] if x["bitexact"]), "g"),
    (GPU, "`bench/gpu_checkpoint.py`: {} s of frozen worker per GiB held and restores at {} GiB/s at {} and {} GiB",
     "gpu_checkpoint",
     (lambda r: same(*(f"{x['pause_s'] / x['footprint_gib']:.1f}" for x in r["rows"] if x["footprint_gib"] >= 20)),
      lambda r: same(*(f"{x['restore_gib_s']:.1f}" for x in r["rows"] if x["footprint_gib"] >= 20)),
      "rows[footprint_gib=20.0].footprint_gib", "rows[footprint_gib=50.0].footprint_gib"), ("s", "s", "g", "g")),
    (BENCH, "| whole-process GPU checkpoint at {} GiB | H200 |", "gpu_checkpoint",
     lambda r: "/".join(f"{x['footprint_gib']:g}" for x in r["rows"]), "s"),
    # --- tensor parallel over NCCL (bench/gpu_tp.py) ---
    (GPU, "(`bench/gpu_tp.py --configs {}`", "gpu_tp",
     lambda r: ",".join(x["config"] for x in _rows(r, backend="nccl", world_size="2")
                        if x["bitexact"] and x["allreduce_ok"]), "s"),
    (GPU, "NVML shows rank 0 on GPU {} and rank 1 on GPU {} afterwards", "gpu_tp",
     lambda r: tuple(same(*(tuple(x["rank_gpus_after"]) for x in _rows(r, swapped_gpus="True")))), "d"),
    (GPU, "{} GiB per rank: pause {}–{} s, restore-to-ready {}–{} s ({} GiB image on /dev/shm)", "gpu_tp",
     (lambda r: same(*(x["ballast_gib_per_rank"] for x in _tp8(r))),
      lambda r: min(x["pause_s"] for x in _tp8(r)), lambda r: max(x["pause_s"] for x in _tp8(r)),
      lambda r: min(x["restore_to_ready_s"] for x in _tp8(r)), lambda r: max(x["restore_to_ready_s"] for x in _tp8(r)),
      lambda r: same(*(x["image_gib"] for x in _tp8(r)))), ("g", ".1f", ".1f", ".1f", ".1f", ".1f")),
    (BENCH, "incl. swapped GPUs | {}× H200 |", "gpu_tp", "gpus", "d"),
    # --- two tiers on the vLLM-shaped engine (bench/gpu_two_tier.py) ---
    # The whole-process column comes from the newest run that took it (the later runs are
    # --no-transparent), the two-tier figures from the newest run with rows A and B, the standby's
    # from the newest run with rows S and SB.
    (GPU, "a vLLM-shaped engine with {} GiB of bf16 weights", "gpu_two_tier", f"{A}.weights_gib", ".1f"),
    (GPU, "{} 1,500-token sessions = {} GiB of live KV", "gpu_two_tier",
     (lambda r: ["no", "one", "two", "three", "four", "five"][r["sessions"]], f"{A}.live_kv_gib"), ("s", ".0f")),
    (GPU, "four {}-token sessions", "gpu_two_tier", "tokens_per_session", ","),
    (GPU, "the template image is {} GiB whatever the engine reserves", "gpu_two_tier",
     lambda r: same(*(_fmt(x["template_image_gib"], ".1f") for x in _ab(r))), "s"),
    (GPU, "| {} GiB reserved: restore to serving | {} s |", "gpu_two_tier",
     (f"{A}.reserved_gib", f"{A}.transparent_restore_s"), (".0f", ".1f")),
    (GPU, "**{} s** (CRIU + CUDA {} s, weights + KV streamed {} s = {} GiB/s of a {} GiB/s limit) |", "gpu_two_tier",
     (f"{A}.restore_to_ready_s",
      lambda r: _rows(r, row="A")[0]["restore_phases"]["restore"] + _rows(r, row="A")[0]["restore_phases"]["cuda_restore"],
      f"{A}.stream_s", f"{A}.stream_gib_s", f"{A}.stream_limit_gib_s"), ".1f"),
    (GPU, "| {} GiB reserved: heartbeat pause | {} s |", "gpu_two_tier",
     (f"{A}.reserved_gib", f"{A}.transparent_pause_s"), (".0f", ".1f")),
    (GPU, "**{} s** for {} GiB of changed KV", "gpu_two_tier", (f"{A}.session_pause_s", f"{A}.changed_gib"),
     (".3f", ".0f")),
    (GPU, "| {} GiB reserved (90 % pool) | cannot run: the footprint must fit twice in host memory | restore {} s, "
        "pause {} s |", "gpu_two_tier",
     (lambda r: absent(_rows(r, row="B")[0], "transparent_restore_s", _rows(r, row="B")[0]["reserved_gib"]),
      f"{B}.restore_to_ready_s", f"{B}.session_pause_s"), (".0f", ".1f", ".3f")),
    (GPU, "| {} or {} GiB reserved: failover onto a standby | — | **{} s** from the kill", "gpu_two_tier",
     (lambda r: same(*(_fmt(x["reserved_gib"], ".0f") for x in _standby(r) if x["row"] == "S")),
      lambda r: same(*(_fmt(x["reserved_gib"], ".0f") for x in _standby(r) if x["row"] == "SB")),
      lambda r: holds(all(x["bitexact"] for x in _standby(r)),
                      span([x["restore_to_ready_s"] for x in _standby(r)], ".2f"))), "s"),
    (GPU, "the weights' check on the GPU took {} s of the restore", "gpu_two_tier",
     lambda r: holds(all(x["bitexact"] and x["chunk_hash"] == "fused" for x in _ab(r)),
                     span([x["restore_phases"]["weights_checked"] for x in _ab(r)], ".3f")), "s"),
    (GPU, "Missed: restore-to-ready ≤ 0.1× cold start on the {} GiB row — this toy engine cold-starts in {} s "
        "(weights from page cache at {} GiB/s", "gpu_two_tier",
     (lambda r: [x["reserved_gib"] for x in _rows(r, row="B") if x["restore_to_ready_s"] > 0.1 * x["cold_start_s"]][0],
      f"{B}.cold_start_s", lambda r: _rows(r, row="B")[0]["weights_gib"] / _rows(r, row="B")[0]["load_s"]),
     (".0f", ".1f", ".0f")),
    (GPU, "the template's CRIU restore alone takes {} s", "gpu_two_tier", f"{B}.restore_phases.restore", ".1f"),
    (GPU, "CUDA context and graphs back ({} GiB on the GPU), no weights, no sessions", "gpu_two_tier",
     lambda r: same(*(_fmt(x["standby_gpu_gib"], ".1f") for x in _standby(r))), "s"),
    (GPU, "rows at {} and {} GiB reserved): the standby took {} s", "gpu_two_tier",
     (lambda r: same(*(_fmt(x["reserved_gib"], ".0f") for x in _standby(r) if x["row"] == "S")),
      lambda r: same(*(_fmt(x["reserved_gib"], ".0f") for x in _standby(r) if x["row"] == "SB")),
      lambda r: span([x["standby_s"] for x in _standby(r)], ".1f")), "s"),
    (GPU, "kill → serving took {} s, bit-exact", "gpu_two_tier",
     lambda r: holds(all(x["bitexact"] for x in _standby(r)),
                     span([x["restore_to_ready_s"] for x in _standby(r)], ".2f")), "s"),
    (GPU, "Runs differ: across the {} runs kept that timed it from the kill, kill → serving took {} s and the "
        "stream reached {} of its limit", "gpu_two_tier",
     (every(_timed_from_kill, len),
      every(_timed_from_kill, lambda rs: span([x["restore_to_ready_s"] for r in rs for x in _standby(r)], ".2f")),
      every(_timed_from_kill, lambda rs: span([x["stream_of_limit"] for r in rs for x in _standby(r)], ".2f"))),
     ("d", "s", "s")),
    (GPU, "its GPU memory was free {} s after the kill", "gpu_two_tier",
     lambda r: span([x["original_gpu_memory_freed_s"] for x in _standby(r)], ".2f"), "s"),
    (GPU, "weights + KV streamed at {} of the limit measured in the same run", "gpu_two_tier",
     lambda r: span([x["stream_of_limit"] for x in _standby(r)], ".2f"), "s"),
    (GPU, "That is {}× the same rows' cold starts", "gpu_two_tier",
     lambda r: span([x["restore_to_ready_s"] / x["cold_start_s"] for x in _standby(r)], ".2f"), "s"),
    (GPU, "The run before it started the clock once the killed process had exited: {} s", "gpu_two_tier",
     lambda r: holds(all(x["bitexact"] for x in _standby(r, from_kill=False)),
                     span([x["restore_to_ready_s"] for x in _standby(r, from_kill=False)], ".2f")), "s"),
    (BENCH, "(rows at {} and {} GiB reserved, restored in place and onto a standby, torn-chunk faults)", "gpu_two_tier",
     (f"{A}.reserved_gib", f"{B}.reserved_gib"), ".0f"),
    (D, "a worker reserving {} GiB froze for {} s per heartbeat and came back in {} s", "gpu_two_tier",
     (f"{A}.reserved_gib", f"{A}.transparent_pause_s", f"{A}.transparent_restore_s"), (".0f", ".1f", ".1f")),
    (D, "one reserving vLLM's default 90 % ({} GiB) cannot be checkpointed at all", "gpu_two_tier",
     lambda r: absent(_rows(r, row="B")[0], "transparent_pause_s", _rows(r, row="B")[0]["reserved_gib"]), ".0f"),
    (D, "The image is the process plus {} GiB of CUDA context and graph scratch: {} GiB at {} or {} GiB reserved",
     "gpu_two_tier", (lambda r: same(*(_fmt(x["template_gpu_gib"], ".1f") for x in _ab(r))),
                      lambda r: same(*(_fmt(x["template_image_gib"], ".1f") for x in _ab(r))),
                      f"{A}.reserved_gib", f"{B}.reserved_gib"), ("s", "s", ".0f", ".0f")),
    (D, "the only pause: {} ms for {} GiB changed", "gpu_two_tier",
     (lambda r: span([x["session_pause_s"] * 1000 for x in _ab(r)], ".0f"), f"{A}.changed_gib"), ("s", ".0f")),
    (D, "template image (CRIU {} s + CUDA {} s)", "gpu_two_tier",
     (f"{A}.restore_phases.restore", f"{A}.restore_phases.cuda_restore"), ".1f"),
    (D, "({} GiB/s of the {} GiB/s this machine reaches without checks)", "gpu_two_tier",
     (f"{A}.stream_gib_s", f"{A}.stream_limit_gib_s"), ".1f"),
    (D, "{} s to serving, bit-exact by sha256", "gpu_two_tier",
     lambda r: holds(_rows(r, row="A")[0]["bitexact"], _rows(r, row="A")[0]["restore_to_ready_s"]), ".1f"),
    (D, "the run that also took the whole process: {} s against {} s", "gpu_two_tier",
     (lambda r: [x["restore_to_ready_s"] for x in _rows(r, row="A") if x["bitexact"] and x["transparent_bitexact"]][0],
      f"{A}.transparent_restore_s"), ".1f"),
    (D, "first touch of ~{} GiB of process memory and {} GiB of CUDA state) is a floor of ~{} s", "gpu_two_tier",
     (lambda r: _rows(r, row="A")[0]["template_image_gib"] - _rows(r, row="A")[0]["template_gpu_gib"],
      f"{A}.template_gpu_gib",
      lambda r: _rows(r, row="A")[0]["restore_phases"]["restore"] + _rows(r, row="A")[0]["restore_phases"]["cuda_restore"]),
     ".1f"),
    (D, "an engine that cold-starts in {} s", "gpu_two_tier", f"{B}.cold_start_s", ".1f"),
    (D, "two tiers win only {}×", "gpu_two_tier",
     lambda r: _rows(r, row="B")[0]["cold_start_s"] / _rows(r, row="B")[0]["restore_to_ready_s"], ".1f"),
    (D, "restore-to-ready {} s from the kill, bit-exact", "gpu_two_tier",
     lambda r: holds(all(x["bitexact"] for x in _standby(r)),
                     span([x["restore_to_ready_s"] for x in _standby(r)], ".2f")), "s"),
    # --- the keyed chunk hash on the GPU (bench/gpu_hash.py) ---
    (GPU, "`bench/gpu_hash.py` on {} GiB: the fused kernel's chunk hashes equal the torch reference's and a swap "
        "of two words changes them; it takes {} s against the reference's {} s, a new key {} s", "gpu_hash",
     (lambda r: holds(_rows(r, impl="fused")[0]["equal_to_reference"] and _rows(r, impl="fused")[0]["swap_detected"],
                      _rows(r, impl="fused")[0]["gib"]),
      "rows[impl=fused].fused_s", "rows[impl=fused].reference_s", "rows[impl=fused].new_key_s"),
     ("g", ".3f", ".2f", ".3f")),
    # --- verify of a GPU worker started isolated (bench/gpu_isolated_verify.py) ---
    (GPU, "(`bench/gpu_isolated_verify.py`, the GPU demo worker holding {} GiB on the GPU): started isolated, `{}` "
        "({}), the copy's device restore {} s; with one session digest recorded wrong, `{}`; started plainly, `{}`; "
        "the original unchanged after each", "gpu_isolated_verify",
     ("rows[layout=isolated].ballast_gib", "rows[layout=isolated].outcome", "rows[layout=isolated].reason",
      "rows[layout=isolated].phases.device_restore", "rows[layout=isolated].wrong_digest_outcome",
      lambda r: holds(all(x["original_unchanged_after_both"] for x in r["rows"]),
                      _rows(r, layout="plain")[0]["outcome"])),
     ("g", "s", "s", ".2f", "s", "s")),
    # --- vLLM on the H200 (bench/vllm_gpu.py) ---
    (ENG, "vLLM 0.26.0 on an H200 with a {} GiB Llama-3-8B-shaped model", "vllm_gpu", "rows.a.model_gib", ".0f"),
    (ENG, "cold start {} s, whole-process restore {} s, two tiers (sleep-level-2 template + connector sessions) "
        "{} s = {} × cold start, next tokens equal", "vllm_gpu",
     ("rows.a.cold_start_s", "rows.b.restore_to_ready_s", "rows.c.restore_to_ready_s", "rows.c.ratio_to_cold_start"),
     (".1f", ".1f", ".2f", ".3f")),
    # --- SGLang on the H200 (bench/sglang_gpu.py) ---
    (SGL, "the Llama-3-8B-shaped random model of `bench/vllm_gpu.py` ({} GiB bf16", "sglang_gpu", "model.gib", ".0f"),
    (SGL, "across the runs kept, the cold start took {} s, the slowest on a fresh machine", "sglang_gpu",
     every(lambda r: "cold_start_s" in r["rows"].get("a", {}),
           lambda rs: span([r["rows"]["a"]["cold_start_s"] for r in rs], ".1f")), "s"),
    (SGL, "Ready in {} s\n  (template image {} GiB; phases: CRIU restore with the checksums {} s, `update_weights_from_disk`\n"
        "  {} s, the session's pages {} s). The next 32 tokens equal the engine's before the kill, with\n  {} of the {} "
        "prompt tokens fetched from the restored pages", "sglang_gpu",
     ("rows.c.restore_to_ready_s", "rows.c.template_image_gib", "rows.c.restore_phases.restore_and_checksum",
      "rows.c.restore_phases.load_update_weights_from_disk", "rows.c.restore_phases.load_sessions",
      lambda r: holds(r["rows"]["c"]["next_tokens_equal"] and "radix_vs_session_pages_equal" in r["rows"]["c"],
                      r["rows"]["c"]["cached_tokens_after_restore"]), "rows.c.prompt_tokens_next_turn"),
     (".1f", ".1f", ".1f", ".1f", ".1f", ",d", ",d")),
    (SGL, "the run before, without those reads, restored a {} GiB image, ready in {} s", "sglang_gpu",
     (every(lambda r: "c" in r["rows"] and "radix_vs_session_pages_equal" not in r["rows"]["c"],
            lambda rs: f"{rs[-1]['rows']['c']['template_image_gib']:.1f}"),
      every(lambda r: "c" in r["rows"] and "radix_vs_session_pages_equal" not in r["rows"]["c"],
            lambda rs: f"{rs[-1]['rows']['c']['restore_to_ready_s']:.1f}")), ("s", "s")),
    (SGL, "The\n  target of ≤ 0.1 × the cold start ({} s against the fresh machine's) is not met yet", "sglang_gpu",
     every(lambda r: "cold_start_s" in r["rows"].get("a", {}),
           lambda rs: f"{max(r['rows']['a']['cold_start_s'] for r in rs) * 0.1:.1f}"), "s"),
    (SGL, "Cold start** to the first token: {} s. Weights load in {} s; capturing the prefill CUDA graphs takes {} s "
        "and the decode graphs {} s.", "sglang_gpu",
     ("rows.a.cold_start_s", "rows.a.weights_load_s", "rows.a.prefill_graph_capture_s", "rows.a.decode_graph_capture_s"),
     (".1f", ".1f", ".1f", ".1f")),
    (SGL, "the engine pauses {} s for the CUDA checkpoint and the CRIU dump (footprint {} GiB on the GPU, image {} GiB). "
        "The restore is ready in {} s. The next 32 tokens of a {}-token session are equal to the engine's before the "
        "kill, and {} of its {} prompt tokens came from the restored radix cache", "sglang_gpu",
     ("rows.b.pause_s", "rows.b.footprint_gib", "rows.b.image_gib", "rows.b.restore_to_ready_s",
      lambda r: holds(r["rows"]["b"]["next_tokens_equal"], r["rows"]["b"]["prompt_tokens_next_turn"]),
      "rows.b.cached_tokens_after_restore", "rows.b.prompt_tokens_next_turn"),
     (".1f", ".1f", ".1f", ".1f", ",d", ",d", ",d")),
    # --- llama-server on CPU (bench/llamacpp_cpu.py) ---
    (LLAMA, "llama GGUF with llama.cpp's own vocabulary (tiny: {} MiB;", "llamacpp_cpu",
     lambda r: r["model_bytes"] / MiB if r["size"] == "tiny" else None, ".1f"),
    (LLAMA, "a live server's checkpoint is {} MiB, dumped in {} s and restored (CRIU and checksums) in {} s; "
        "a {}-token session exported through the slot API is {} KiB", "llamacpp_cpu",
     (lambda r: r["checkpoint_bytes"] / MiB, "dump_s", "restore_s", "session_tokens",
      lambda r: r["session_bytes"] / 1024), (".1f", ".2f", ".2f", "d", ".0f")),
    # --- S3 tier (bench/s3_store.py) ---
    (OPS, "— {} % of the image when a demo worker with 512 MiB of static ballast took one more turn", "s3_store",
     lambda r: r["second_heartbeat_byte_ratio"] * 100, ".1f"),
    # --- soak (bench/soak.py) ---
    (BENCH, "Soak (`bench/soak.py`, {} kill/recover cycles on the CPU demo worker", "soak", "summary.cycles", "d"),
    (BENCH, "{} of them through the heartbeat/recover flows): {} sessions lost beyond the last checkpoint "
        "({} recoveries compared digest and next tokens), {} leaked CRIU temp dirs, network namespaces or stopped "
        "processes, {} stuck runs, {} alerts opened and {} resolved; {} s per cycle on {} cores", "soak",
     (lambda r: sum(m["via_flow"] for m in r["summary"]["by_moment"].values()), "summary.lost",
      lambda r: same(r["summary"]["next_tokens_checked"], r["summary"]["digest_checked"]),
      lambda r: same(*(r["summary"][k] for k in ("leaked_temp_dirs", "leaked_netns", "stopped_left",
                                                 "stopped_left_at_end"))),
      lambda r: same(r["summary"]["stuck_runs"], r["summary"]["stuck_flow_runs"], r["summary"]["stuck_cycles"]),
      "summary.alerts_opened", "summary.alerts_resolved", "summary.cycle_s_median", lambda r: _cores(r["machine"])),
     ("d",) * 7 + (".1f", "d")),
    (OPS, "a 10-cycle soak of random kills (`tests/test_soak.py`; {} cycles in [benchmarks.md](benchmarks.md))", "soak",
     "summary.cycles", "d"),
    # --- a manual migrate's downtime (bench/migrate_downtime.py): every move of a kind, not one run ---
    (OPS, "With the Prefect server on PostgreSQL {} of {} moves took ≤ {} s, {} s, the upload to S3 the largest "
        "phase in {} ({} s; the Prefect hand-off {} s)", "migrate_downtime",
     (every(_moves("postgres"), lambda rs: len(_met(rs))), every(_moves("postgres"), len),
      every(_moves("postgres"), lambda rs: same(*(r["target_s"] for r in rs))),
      every(_moves("postgres"), lambda rs: span([r["downtime_s"] for r in rs], ".2f")),
      every(_moves("postgres"), lambda rs: _largest_is(rs, "upload_s")),
      every(_moves("postgres"), lambda rs: span([r["upload_s"] for r in rs], ".2f")),
      every(_moves("postgres"), lambda rs: span([r["handoff_s"] for r in rs], ".2f"))),
     ("d", "d", "g", "s", "d", "s", "s")),
    (OPS, "On SQLite {} of {} did ({} s); of the others, one took {} s, {} s of it between the push and the "
        "checkpoint's label written on the server, and one {} s, its dump, upload, download and restore each "
        "slower than in any of the {} ({} s; hand-off {} s)", "migrate_downtime",
     (every(_moves("sqlite"), lambda rs: len(_met(rs))), every(_moves("sqlite"), len),
      every(_moves("sqlite"), lambda rs: span([r["downtime_s"] for r in _met(rs)], ".2f")),
      every(_moves("sqlite"), lambda rs: holds(len(_missed(rs)) == 2, _missed(rs)[0]["downtime_s"])),
      every(_moves("sqlite"), lambda rs: holds(max(_PHASES, key=_missed(rs)[0].__getitem__) == "handoff_s",
                                               _missed(rs)[0]["published_s"] - _missed(rs)[0]["pushed_s"])),
      every(_moves("sqlite"), lambda rs: _missed(rs)[1]["downtime_s"]),
      every(_moves("sqlite"), lambda rs: ["none", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"][len(_met(rs))]),
      every(_moves("sqlite"), _slower_steps),
      every(_moves("sqlite"), lambda rs: _missed(rs)[1]["handoff_s"])),
     ("d", "d", "s", ".2f", ".2f", ".2f", "s", "s", ".2f")),
    (OPS, "Older code on SQLite (runs without `db`) took {} s; its {} failed attempts (`criu dump failed`, then "
        "tried again) are kept in the JSON too", "migrate_downtime",
     (every(_moves(None), lambda rs: span([r["downtime_s"] for r in rs], ".2f")),
      every(lambda r: "failed" in r,
            lambda rs: holds(all(r.get("db") is None and "criu dump failed" in r["failed"] for r in rs), len(rs)))),
     ("s", "d")),
    # --- sessions at their turn ends (bench/gpu_turn_export.py, bench/policy_sim.py) ---
    (GPU, "the client lost {} s per export of 0.25 GiB and {} s at 1 GiB ({} s when the export held the engine); "
        "the cost model takes {} s + {} s per GiB", "gpu_turn_export",
     (lambda r: _window(r, "turn 0.25")["lost_s_per_export"], lambda r: _window(r, "turn 1")["lost_s_per_export"],
      lambda r: _window(r, "held 1")["lost_s_per_export"], "turn_export_fixed_s", "turn_export_s_per_gib"),
     (".4f", ".4f", ".4f", "g", "g")),
    (GPU, "That fixed part is within the bench's noise ({} s per export)", "gpu_turn_export", "noise_s_per_export",
     ".4f"),
    (GPU, "the simulator puts ckptflow at {}× the clairvoyant bound on seeds 0–4 (two-tier-h200, exponential "
        "failures), against {}× with the same sessions weighed at the cadence's heartbeats, and at {}× the best "
        "fixed interval chosen in hindsight", "policy_sim",
     (lambda r: span([t["ckptflow_over_clairvoyant"] for t in _sim(r)], ".2f"),
      lambda r: span([t["heartbeat_sessions_over_clairvoyant"] for t in _sim(r)], ".2f"),
      lambda r: span([t["ckptflow_over_hindsight"] for t in _sim(r)], ".2f")), ("s", "s", "s")),
    # --- the driver and a copy in another PID namespace (bench/gpu_pidns_probe.py, gpu_pidns_born.py) ---
    (GPU, "on the H200 (driver {}) the driver does not know a copy under another PID", "gpu_pidns",
     lambda r: re.search(r"(\d+)\.\d+\.\d+", r["versions"]["driver"]).group(1), "s"),
]

# Settings, not measurements: (doc, text, file that sets it, what must stand there).
CONFIG = [
    (SGL, "waits up to 10 s for pages HiCache writes", "ckptflow/engines/sglang_protocol.py", r"PAGE_WAIT_S = 10\.0\b"),
    (OPS, "`fixed` (`interval_s`, 3600 s when left out)", "ckptflow/policies/cadence.py",
     r'interval_s: float = Field\(3600\.0, ge=0, description="Checkpoint interval\."'),
    (OPS, "priced for a $2.50 H200", "ckptflow/policies/cadence.py", r"gpu_usd_per_hour: float = Field\(\s*2\.50,"),
    (GPU, "free GPU memory ≥ footprint + 1 GiB first", "ckptflow/runners/cuda.py", r"RESTORE_MARGIN_GIB = 1\.0\b"),
    (GPU, "(48 MiB of weights", "tests/test_template_sessions.py", r"BALLAST_MIB = 48\b"),
    (GPU, "within the 1.3× target", "bench/policy_sim.py", r"ratio_c <= 1\.3\b"),
    (GPU, "the export waits up to 1 s for that turn", "ckptflow/demo/llm_worker.py", r"TURN_WAIT_S = 1\.0\n"),
    (GPU, "one 16 MiB piece at a time", "ckptflow/demo/llm_worker.py", r"TURN_COPY_PIECE = 16 << 20\n"),
    (GPU, "(90 % pool)", "bench/gpu_two_tier.py", r'"--b-kv-fraction", type=float, default=0\.9\b'),
    (D, "vLLM's default 90 %", "bench/gpu_two_tier.py", r'"--b-kv-fraction", type=float, default=0\.9\b'),
    (ENG, "≥ 90 % of the prompt", "tests/test_vllm.py", r'\["hits"\] >= 0\.9 \*'),
    (GPU, "≤ 0.1× cold start", "bench/vllm_gpu.py", r"Target: restore-to-ready <= 0\.1 x"),
    (OPS, "sha256-addressed 8 MiB chunks", "ckptflow/store/objects.py", r"CHUNK = 8 << 20\b"),
    (OPS, "a demo worker with 512 MiB of static ballast", "bench/s3_store.py", r"ballast_mib=512\b"),
    (D, "content-addressed 64 MiB chunks", "ckptflow/engines/weight_chunks.py", r"SLOT = 64 << 20\b"),
    (D, "pinned 8 MiB slots", "ckptflow/engines/weight_chunks.py", r"PIECE, RING = 8 << 20\b"),
    (OPS, "`worker_query_seconds`, default 1 s", "ckptflow/fleet.py", r"\nWORKER_QUERY_S = 1\.0\b"),
    (OPS, "polls its `/health` every 50 ms", "bench/migrate_downtime.py", r"\nPOLL_S = 0\.05\b"),
    (GPU, "looks at the engine's sessions every 2 s", "ckptflow/deploy.py", r"\nTURN_POLL_S = 2\b"),
    (GPU, "reach 2 × the export's fixed part × the MTBF", "ckptflow/policies/sessions.py",
     r"return 2 \* _pause\(0\.0, ctx\) \* ctx\.mtbf_s"),
]

# Re-measured by other work now: their own tests hold them; this one skips the text from the
# first phrase to the second.
OTHERS = [
    (BENCH, "**Fleet tick** (`bench/fleet_tick.py`)", "5,000 / 250 5.0–20.7 s"),
]


def _flat(text: str) -> str:
    return " ".join(text.split())


def _doc(name: str) -> str:
    return _flat((ROOT / name).read_text())


def _get(run: dict, path: str):
    v = run
    for key, sel_k, sel_v in re.findall(r"([^.\[\]]+)(?:\[([^=\]]+)=([^\]]+)\])?", path):
        v = v[key]
        if sel_k:
            v = next(x for x in v if str(x.get(sel_k)) == sel_v)
    return v


def _value(run: dict, field, runs: list[dict]):
    if isinstance(field, every):
        kept = [r for r in runs if field.keep(r)]
        if not kept:
            raise KeyError(field)
        assert all(r.get("date") or r.get("note") for r in kept), "a run quoted has no date"
        v = field.fn(kept)
    else:
        v = field(run) if callable(field) else _get(run, field)
    if v is None:
        raise KeyError(field)
    return v


def _fmt(value, spec: str) -> str:
    """As a reader rounds the number the JSON shows: 29.45 -> 29.5 (float formatting gives 29.4)."""
    m = re.fullmatch(r"\.(\d+)f", spec)
    if m and isinstance(value, float):
        return str(Decimal(repr(value)).quantize(Decimal(1).scaleb(-int(m.group(1))), rounding=ROUND_HALF_UP))
    return format(value, spec)


def expected(text: str, name: str, fields, fmts) -> str:
    """``text`` with its figures formatted from the newest run of ``name`` that has them all (an
    ``every`` field: from all the runs it keeps, whichever run the others pick)."""
    fields = fields if isinstance(fields, tuple) else (fields,)
    runs = [r for r in runs_of(name) if QUOTED.get(name, lambda r: True)(r)]
    assert runs, f"bench/results/{name}.json has no run the docs quote"
    for run in reversed(runs):
        try:
            values = [_value(run, f, runs) for f in fields]
        except (KeyError, IndexError, StopIteration, TypeError):
            continue
        # A run from before runs were kept has no date; its note says so (and where it came from).
        assert run.get("date") or run.get("note"), f"{name}: the run quoted has no date"
        flat = [x for v in values for x in (v if isinstance(v, tuple) else (v,))]
        specs = fmts if isinstance(fmts, tuple) else (fmts,) * len(flat)
        return text.format(*(_fmt(v, s) for v, s in zip(flat, specs, strict=True)))
    raise AssertionError(f"no run of bench/results/{name}.json has {fields}")


@pytest.mark.parametrize("doc,text,name,fields,fmts", FIGURES, ids=[f"{f[0]}:{f[1][:48]}" for f in FIGURES])
def test_the_doc_quotes_the_figure_its_bench_measured(doc, text, name, fields, fmts):
    want = _flat(expected(text, name, fields, fmts))
    assert want in _doc(doc), f"{doc} should say: {want!r} (from bench/results/{name}.json)"


@pytest.mark.parametrize("doc,text,source,setting", CONFIG, ids=[f"{c[0]}:{c[1][:40]}" for c in CONFIG])
def test_a_configured_figure_is_what_the_code_sets(doc, text, source, setting):
    assert _flat(text) in _doc(doc), f"{doc} no longer says {text!r}: update CONFIG"
    assert re.search(setting, (ROOT / source).read_text()), f"{source} no longer sets {setting!r}, which {doc} quotes"


# A number with a unit of time, size, rate, ratio or share; counts without a unit are held by FIGURES.
_MEASURE = re.compile(r"(?<![\w.-])\d[\d,.]*(?:–\d[\d,.]*)?\s?(?:ms|s|min|GiB/s|GiB|MiB|KiB|MB|GB|%|×)(?!\w)")


# Pages whose figures were written before the benches kept their runs, and no bench JSON holds yet.
NOT_YET = {
    "docs/containers.md": "podman timings and image sizes, measured by hand",
    "docs/engines/protocol.md": "the protocol's GPU numbers, from bench/RESULTS.md rows without a JSON",
    "docs/engines/vllm.md": "vLLM's CPU and GPU runs, quoted from bench/RESULTS.md",
    "docs/extending/engine-adapter.md": "a test's duration",
    "docs/extending/gpu-backend.md": "the restore margin",
    "docs/extending/storage-tier.md": "the S3 client's pull rate",
}
DOCS = [R] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")
                    if p.relative_to(ROOT).as_posix() not in NOT_YET)


def test_every_page_a_row_names_is_read_by_the_figure_check():
    named = {row[0] for table in (FIGURES, CONFIG, OTHERS) for row in table}
    assert named <= set(DOCS), f"rows name pages the figure check does not read: {named - set(DOCS)}"
    assert all((ROOT / doc).exists() for doc in NOT_YET), "NOT_YET names a page that is gone"


@pytest.mark.parametrize("doc", DOCS)
def test_every_measured_figure_of_the_doc_is_in_a_table_here(doc):
    """A new figure with a unit in README or docs/ must come with its row above (or a CONFIG row)."""
    text = _doc(doc)
    spans = []
    for d, t, *rest in FIGURES:
        if d == doc:
            t = _flat(expected(t, *rest))
            spans += [(m.start(), m.end()) for m in re.finditer(re.escape(t), text)]
    for d, t, *_ in CONFIG:
        if d == doc:
            spans += [(m.start(), m.end()) for m in re.finditer(re.escape(_flat(t)), text)]
    for d, first, last in OTHERS:
        if d == doc:
            start = text.index(first)
            spans.append((start, text.index(last, start) + len(last)))
    loose = [f"{m.group(0)!r} in …{text[max(0, m.start() - 50):m.end() + 20]}…" for m in _MEASURE.finditer(text)
             if not any(a <= m.start() and m.end() <= b for a, b in spans)]
    assert not loose, f"{doc}: figures with no bench JSON behind them (add a FIGURES or CONFIG row):\n" + "\n".join(loose)


def test_the_gpu_pages_born_in_namespace_outcome_is_the_runs():
    """docs/gpu.md: a worker born as PID 1 gives a copy that CUDA-restores from inside its namespaces and
    from the host with the checkpoint's digests; as PID 2 under criu-ns it never restores."""
    born = [r for r in runs_of("gpu_pidns") if r.get("probe") == "born_in_namespace" and not r["cpu_plumbing_only"]]
    copies = {(layout, c["restored_from"], c["state_equal_to_checkpoint"])
              for r in born for layout, x in r["layouts"].items()
              for c in (x.get("copy"), x.get("copy_original_killed")) if c}
    assert {("init", "all", True), ("init", "host", True)} <= copies
    assert all(not restored and not equal for layout, restored, equal in copies if layout == "child")
    child_restores = [c[1] for r in born for s in r["layouts"].get("child", {}).get("steps", [])
                      if s["step"].startswith("copy") and isinstance(s.get("got"), dict)
                      for c in s["got"].get("calls", []) if c[0] == "restore"]
    assert child_restores and set(child_restores) == {"CUDA_ERROR_NOT_INITIALIZED"}
    page = _doc(GPU)
    assert "the copy's CUDA restore succeeded from inside its namespaces and from the host" in page
    assert "criu-ns, got `CUDA_ERROR_NOT_INITIALIZED` from every vantage point" in page
