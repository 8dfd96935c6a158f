"""The GPU regression command: one device call (at most 10 minutes) that runs the claims users rely
on and exits non-zero if any of them fails. Run it before resolving any change to ``runners/``,
``engines/`` or the engine side (ckptflow/demo, engines/vllm_*.py) — CI has no GPU and cannot see
those break.

Claims, each from the bench that measures it (their own JSON and RESULTS.md rows are written too):
  vllm-b   vLLM whole process (CUDA + CRIU) restores; next 32 tokens equal (bench/vllm_gpu.py row b)
  vllm-p   vLLM two tiers through the protocol it serves (ckptflow's middleware), driven by the
           runner: restores; next 32 tokens equal, the session's tokens external prefix hits (row p)
  standby  the bench engine's standby promoted after a kill, bit-exact (bench/gpu_two_tier.py row S)
  verify   a GPU worker started isolated is verified beside its original, a wrong digest is
           verify_failed, the original unchanged (bench/gpu_isolated_verify.py)
  sglang-b SGLang whole process restores; next 32 tokens equal (bench/sglang_gpu.py row b)
  sglang-c SGLang two tiers through ckptflow's plugin, driven by the runner: restores; next 32
           tokens equal, the session's tokens fetched from its restored pages (row c)

The SGLang steps are a call of their own (SGLang's carry, and ~330 s that do not fit beside vLLM's):
    eval "$(scripts/carry-sglang.sh env)"; python3 bench/gpu_regress.py --only sglang

Usage on the GPU machine (root; vLLM, its deps and CRIU carried first: scripts/carry-vllm.sh):
    eval "$(scripts/carry-vllm.sh env)"; python3 bench/gpu_regress.py
It copies every results file it changed into $OUT/bench/ (the device's output folder); here, copy
them over bench/results/ and bench/RESULTS.md and commit them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _common import OUT_FILES_MAX, RESULTS_MD, append_results, md_table, out_files_over_limit, record_run, runs_of  # noqa: E402

HOME = Path(os.environ.get("HOME", "/root"))
BUDGET_S = 570   # a device call runs 600 s at most; what is left when a step starts is its limit


def _newest(name: str, before: int) -> dict:
    """The run this regression's step recorded (a step that recorded none fails its claim)."""
    runs = runs_of(name)
    if len(runs) <= before:
        raise ValueError(f"{name} recorded no run")
    return runs[-1]


def _rows(run: dict, key: str) -> dict:
    return {r.get(key): r for r in run.get("rows", [])} if isinstance(run.get("rows"), list) else run.get("rows", {})


def check_vllm(state: Path) -> list[dict]:
    res = json.loads(state.read_text())
    rows = res.get("rows", {})
    out = []
    for row, claim in (("b", "vLLM whole process restores, next 32 tokens equal"),
                       ("p", "vLLM two tiers through its protocol restore, next 32 tokens equal, session from the store")):
        r = rows.get(row, {})
        ok = r.get("next_tokens_equal") is True and not r.get("error")
        if row == "p":
            ok = ok and r.get("external_prefix_cache_hits_next_turn", 0) >= (r.get("session_tokens") or 1)
        out.append({"claim": f"vllm-{row}", "what": claim, "ok": ok,
                    "figure": f"restore-to-ready {r.get('restore_to_ready_s')} s" if ok else (r.get("error") or
                                                                                             "no result")})
    return out


def check_sglang(state: Path) -> list[dict]:
    rows = json.loads(state.read_text()).get("rows", {})
    out = []
    for row, claim in (("b", "SGLang whole process restores, next 32 tokens equal"),
                       ("c", "SGLang two tiers through its plugin restore, next 32 tokens equal, session from its pages")):
        r = rows.get(row, {})
        ok = r.get("next_tokens_equal") is True and not r.get("error")
        if row == "c":
            ok = ok and (r.get("cached_tokens_after_restore") or 0) >= (r.get("session_tokens") or 1)
        out.append({"claim": f"sglang-{row}", "what": claim, "ok": ok,
                    "figure": f"restore-to-ready {r.get('restore_to_ready_s')} s" if ok else (r.get("error") or
                                                                                             "no result")})
    return out


def check_standby(before: int) -> list[dict]:
    r = _rows(_newest("gpu_two_tier", before), "row").get("S", {})
    ok = r.get("bitexact") is True
    return [{"claim": "standby", "what": "bench engine's standby promoted after a kill, bit-exact", "ok": ok,
             "figure": f"kill → serving {r.get('restore_to_ready_s')} s" if ok else (r.get("error") or "no result")}]


def check_verify(before: int) -> list[dict]:
    rows = _rows(_newest("gpu_isolated_verify", before), "layout")
    iso = rows.get("isolated", {})
    ok = (iso.get("outcome") == "verified" and iso.get("wrong_digest_outcome") == "verify_failed"
          and all(r.get("original_unchanged_after_both") for r in rows.values()))
    return [{"claim": "verify", "what": "isolated GPU worker verified beside its original; wrong digest refused",
             "ok": ok, "figure": iso.get("reason") if ok else f"{iso.get('outcome')}: {iso.get('reason')}"}]


# (step, its results name: its runs are counted before it runs, command)
# Run from the repository root with relative paths: each bench records its command line.
STEPS = [
    ("vllm", "vllm_gpu", ["python3", "bench/vllm_gpu.py", "--rows", "b,p"]),
    ("standby", "gpu_two_tier", ["python3", "bench/gpu_two_tier.py", "--rows", "S"]),
    ("verify", "gpu_isolated_verify", ["python3", "bench/gpu_isolated_verify.py", "--ballast-gib", "2",
                                       "--images", "/dev/shm"]),
    ("sglang", "sglang_gpu", ["python3", "bench/sglang_gpu.py", "--rows", "b,c"]),
]
# Each step's own state file (a bench that keeps rows across its runs): removed first, this run's rows only.
STATE = {"vllm": HOME / "vllm_gpu_state.json", "sglang": HOME / "sglang_gpu_state.json"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="vllm,standby,verify", help="steps to run (comma-separated)")
    a = ap.parse_args()
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    unknown = only - {name for name, _, _ in STEPS}
    if unknown:
        raise SystemExit(f"gpu_regress: unknown step(s) {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(name for name, _, _ in STEPS)})")
    t_start, started = time.monotonic(), time.time()
    for name in only & STATE.keys():
        STATE[name].unlink(missing_ok=True)
    claims: list[dict] = []
    for name, results, cmd in STEPS:
        if name not in only:
            continue
        before = len(runs_of(results))
        left = BUDGET_S - (time.monotonic() - t_start)
        t0 = time.monotonic()
        try:
            # A regression run records no fixtures: sglang_gpu.py's six recorded answers would take
            # the device's file limit from its results (8 files come back).
            r = subprocess.run(cmd, timeout=max(30, left), capture_output=True, text=True, cwd=BENCH.parent,
                               env={**os.environ, "CKPTFLOW_BENCH_RECORD": "0"})
            tail = (r.stdout + r.stderr)[-1500:]
            failed = r.returncode != 0
        except subprocess.TimeoutExpired:
            tail, failed = f"timed out after {left:.0f} s", True
        took = round(time.monotonic() - t0, 1)
        print(f"{name}: {took} s (rc {'!=0' if failed else 0})", flush=True)
        try:
            got = {"vllm": check_vllm, "standby": check_standby, "verify": check_verify, "sglang": check_sglang}[name](
                *((STATE[name],) if name in STATE else (before,)))
        except (OSError, ValueError, KeyError) as e:
            got = [{"claim": name, "what": "its results", "ok": False, "figure": f"no results: {e}"}]
        for c in got:
            c["seconds"] = took
            if failed and c["ok"]:
                c["ok"], c["figure"] = False, f"the bench exited non-zero: {tail.splitlines()[-1] if tail else ''}"
        if failed or not all(c["ok"] for c in got):
            print(tail, flush=True)
        claims += got
    table = md_table(["claim", "what", "ok", "figure", "step s"],
                     [[c["claim"], c["what"], c["ok"], c["figure"], c["seconds"]] for c in claims])
    record_run("gpu_regress", {"claims": claims, "all_ok": all(c["ok"] for c in claims)})
    append_results("GPU regression (bench/gpu_regress.py)", table)
    print(table)
    out = os.environ.get("OUT")
    if out:
        # Only what this run changed: the device returns a limited number of files, and a
        # run that copied every results file lost its own (2026-12-02).
        dest = Path(out) / "bench"
        (dest / "results").mkdir(parents=True, exist_ok=True)
        for f in (BENCH / "results").glob("*.json"):
            if f.stat().st_mtime >= started:
                shutil.copy(f, dest / "results" / f.name)
        shutil.copy(RESULTS_MD, dest / "RESULTS.md")
        for name, state in STATE.items():   # for bench/<name>_gpu.py --append-results here
            if name in only and state.exists() and not (Path(out) / f"{name}_gpu.json").exists():
                shutil.copy(state, dest / f"{name}_gpu.json")
        over = out_files_over_limit(Path(out))
        if over:
            print(f"gpu_regress: {len(over)} files under $OUT, the device returns {OUT_FILES_MAX}: "
                  f"some will be left behind ({', '.join(over)}); write fewer beside this run", flush=True)
    sys.exit(0 if claims and all(c["ok"] for c in claims) else 1)


if __name__ == "__main__":
    main()
