"""Replay the reference fleet trace under every policy, for each cost profile; check ckptflow
against the targets.

Usage:
    .venv/bin/python bench/policy_sim.py [--seeds 0,1,2,3,4] [--dists exponential,weibull]
        [--profiles process-h200,two-tier-h200] [--sensitivity-kv 131072,327680]
        [--sensitivity-bytes gpu-3.5,gpu-7,no-shared-tier,unpriced]

Profiles (ckptflow/sim.py PROFILES): ``process-h200`` is the whole-process calibration of the
first runs (pause 1.3 s per GiB held, restore 1.25 GiB/s + 5 s); ``two-tier-h200`` the two-tier
path measured in bench/results/gpu_two_tier.json (pause 0.036 s + 0.036 s per GiB of KV changed,
restore 2.85 s + weights and KV at 20.9 GiB/s). ``--sensitivity-kv`` reruns seed 0
(exponential) under two-tier-h200 with other KV bytes per token ("" to skip);
``--sensitivity-bytes`` with other prices of the bytes written (``BYTE_PRICES``; "" to skip).

Every cost is GPU cost (lost + pause) plus the bytes written priced in GPU-seconds
(``CostModel.bytes_s_per_gib``: node disk and network, the shared tier, at the GPU-hour price).

Keeps every run in bench/results/policy_sim.json (``record_run``: date, machine, command; per
seed its ratios to clairvoyant and to the hindsight-best fixed interval), writes
bench/results/policy_sim.png, appends the tables to bench/RESULTS.md, and also times deciding
10,000 workloads. Exit 1 if a target is missed. Targets (every profile and seed, on GPU cost +
bytes cost): ckptflow <= 1.10 x hindsight, and >= 30 % lower than the best fixed-* policy; under
two-tier-h200 also <= 1.3 x clairvoyant (issue #25 asked 1.5 for sessions at turn boundaries; the
bytes issue 1.3 with the bytes priced).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import BENCH, append_results, md_table, record_run  # noqa: E402

from ckptflow.policies.cadence import CostModel, WorkloadFacts, decide  # noqa: E402
from ckptflow.sim import PROFILES, profile_config, simulate  # noqa: E402

H = 3600.0
TIB = 2.0**40

# Other prices of the bytes written, for the sensitivity runs (seed 0, two-tier-h200).
BYTE_PRICES = {
    "gpu-3.5": ("H200 at $3.50/h (specialty cloud on demand)", {"gpu_usd_per_hour": 3.5}),
    "gpu-7": ("H200 at $7.00/h (hyperscaler on demand)", {"gpu_usd_per_hour": 7.0}),
    "no-shared-tier": ("no shared tier (node disk only)", {"shared_tier_usd_per_gib": 0.0}),
    "unpriced": ("bytes unpriced (the cost model before)", {"shared_tier_usd_per_gib": 0.0, "node_usd_per_gib": 0.0}),
}


def decide_10k(mode: str = "process") -> float:
    facts = [WorkloadFacts(name=f"w{i}", traffic=("long_sessions", "short_requests", "mixed")[i % 3],
                           footprint_gib=20 + i % 120, mtbf_s=(24 + i % 6000) * 3600.0,
                           live_tokens=(i % 50) * 40_000.0, growth_tokens_s=(i % 16) * 40.0,
                           tokens_since_ckpt=(i % 7) * 10_000.0, seconds_since_ckpt=float(i % 9000),
                           mean_request_s=float(i % 40), now=1e6, maintenance=[(1e6 + (i % 5) * 600, 1e6 + 1e4)],
                           checkpoint_mode=mode)
             for i in range(10_000)]
    t0 = time.perf_counter()
    for f in facts:
        decide(f)
    return time.perf_counter() - t0


def plot(curves: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(7 * len(curves), 5), squeeze=False)
    styles = {"ckptflow": "C0", "hindsight": "C2", "clairvoyant": "C3", "never": "C1", "young-daly": "C4"}
    for ax, run in zip(axes[0], curves):
        curve = run["fixed_curve"]
        ax.plot([c[0] / H for c in curve], [c[1] / H for c in curve], "o-", color="gray",
                label="fixed interval (all workloads)")
        for name, color in styles.items():
            ax.axhline(run["policies"][name]["cost"] / H, color=color, ls="--", label=name)
        ax.axvline(run["young_daly_interval_s"] / H, color="C4", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("checkpoint interval (hours)")
        ax.set_ylabel("GPU cost + bytes cost (GPU-hours / 30 days, 512 workers)")
        ax.set_title(f"{run['profile']}: seed {run['seed']}, {run['failure_dist']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gh(x: float) -> str:
    return f"{x / H:,.1f}"


def by_class(runs: list[dict], profile: str) -> dict[str, dict]:
    """ckptflow's checkpoints per node class and traffic, summed over the exponential runs."""
    tot: dict[str, dict] = {}
    for r in runs:
        if r["profile"] != profile or r["failure_dist"] != "exponential":
            continue
        for k, v in r["ckptflow_by_class"].items():
            row = tot.setdefault(k, {})
            for kk, vv in v.items():
                row[kk] = row.get(kk, 0) + vv
    return tot


def protects_text(runs: list[dict], profiles: list[str], n: int) -> str:
    """What the policy now protects and why, with this run's numbers."""
    if not {"process-h200", "two-tier-h200"} <= set(profiles):
        return ""
    proc, tt = by_class(runs, "process-h200"), by_class(runs, "two-tier-h200")
    cfg = profile_config("two-tier-h200")
    cost = cfg.cost

    def per(d: dict, k: str, f: str) -> float:
        return d.get(k, {}).get(f, 0) / n

    kept = {name: sum(per(d, k, "kv_kept_gpu_s") for k in d) / H for name, d in (("p", proc), ("t", tt))}
    lost = {name: sum(per(d, k, "reprefill_gpu_s") for k in d) / H for name, d in (("p", proc), ("t", tt))}
    from ckptflow.policies.sessions import ExportContext, new_session_threshold_tokens

    def ctx(mtbf_h: float) -> ExportContext:
        return ExportContext(mtbf_s=mtbf_h * H, kv_bytes_per_token=cfg.kv_bytes_per_token, at_turn_end=True,
                             cost=cost)

    def exports_per_worker(cls: str) -> float:
        w = per(tt, f"{cls}/long", "workloads")
        return per(tt, f"{cls}/long", "checkpoints") / w if w else 0.0

    classes = [("preemptible", cfg.preemptible_mtbf_h), ("flaky", cfg.flaky_mtbf_h), ("healthy", cfg.mtbf_h)]

    def threshold(m: float) -> str:
        t = new_session_threshold_tokens(ctx(m))
        return "never" if t == float("inf") else f"at {t:,.0f} tokens"

    first = ", ".join(f"{threshold(m)} on {c} nodes ({m:,.0f} h)" for c, m in classes)
    if all(new_session_threshold_tokens(ctx(m)) == float("inf") for _, m in classes):
        first = (f"never, on any node class ({', '.join(f'{m:,.0f} h' for _, m in classes)}): its bytes cost more "
                 f"than the chance a failure needs them")
    drain = new_session_threshold_tokens(ctx(cfg.mtbf_h).model_copy(update={"interruption_ahead": True}))
    grown = ", ".join(f"{exports_per_worker(c):,.0f} on {c} nodes" for c, m in classes)
    return (
        "What the policy now protects, and why (two-tier-h200 against process-h200, mean per seed):\n"
        f"- Sessions at their turn ends: a session is idle then, so its export holds it alone and the engine "
        f"serves on ({cost.turn_export_fixed_s:.5f} GPU-s + {cost.turn_export_s_per_gib:.4f} GPU-s per GiB for "
        f"the other sessions, bench/results/gpu_turn_export.json), and writes its new KV "
        f"({cost.bytes_s_per_gib():.2f} GPU-s per GiB). A new session is exported at a turn end once its KV pays "
        f"for that against the chance a failure needs it: {first}; one that does not is listed (named, its KV "
        f"not moved). The drain before an announced window exports every session whose change holds more than "
        f"{drain:,.0f} tokens, at its last turn end.\n"
        f"- Grown sessions: where their bytes pay, each at Young's interval for its own growth (re-prefill at "
        f"risk x seconds since its export >= 2 x fixed x M); exports per long-session worker in 30 days, the "
        f"drain's included: {grown}.\n"
        f"- Short-request workers: never (no session KV; the template restores them).\n"
        f"In all, ckptflow keeps {kept['t']:.1f} GPU-h of KV per seed across interruptions instead of "
        f"{kept['p']:.1f}, and re-prefills {lost['t']:.1f} instead of {lost['p']:.1f}."
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--dists", default="exponential,weibull")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--sensitivity-kv", default="131072,327680",
                    help="KV bytes per token for extra two-tier runs of seed 0 (exponential); '' for none")
    ap.add_argument("--sensitivity-bytes", default=",".join(BYTE_PRICES),
                    help=f"prices of the bytes written for extra two-tier runs of seed 0: {', '.join(BYTE_PRICES)}; "
                         "'' for none")
    a = ap.parse_args()
    profiles = a.profiles.split(",")
    seeds = list(map(int, a.seeds.split(",")))
    runs, rows, ok = [], [], True
    for profile in profiles:
        for dist in a.dists.split(","):
            for seed in seeds:
                run = simulate(seed, profile_config(profile, failure_dist=dist),
                               with_curve=(seed == seeds[0] and dist == "exponential"))
                run["profile"] = profile
                p = run["policies"]
                best_fixed = min((k for k in p if k.startswith("fixed-")), key=lambda k: p[k]["cost"])
                ratio_h = p["ckptflow"]["cost"] / p["hindsight"]["cost"]
                ratio_c = p["ckptflow"]["cost"] / p["clairvoyant"]["cost"]
                hb = p.get("ckptflow-heartbeat")
                ratio_hb = hb["cost"] / p["clairvoyant"]["cost"] if hb else None
                below_fixed = 1 - p["ckptflow"]["cost"] / p[best_fixed]["cost"]
                met = ratio_h <= 1.10 and below_fixed >= 0.30 and (profile != "two-tier-h200" or ratio_c <= 1.3)
                ok &= met
                run["targets"] = {"ckptflow_over_hindsight": round(ratio_h, 3),
                                  "ckptflow_over_clairvoyant": round(ratio_c, 3), "best_fixed": best_fixed,
                                  "heartbeat_sessions_over_clairvoyant": round(ratio_hb, 3) if hb else None,
                                  "ckptflow_below_best_fixed": round(below_fixed, 3), "met": met}
                runs.append(run)
                c, cv = p["ckptflow"], p["clairvoyant"]
                rows.append([profile, dist, seed, run["node_failures"], f"{p['never']['cost'] / H:,.0f}",
                             f"{p[best_fixed]['cost'] / H:,.0f} ({best_fixed})",
                             f"{p['young-daly']['cost'] / H:,.0f}", f"{p['hindsight']['cost'] / H:,.1f}",
                             f"{gh(cv['gpu_cost'])} + {gh(cv['bytes_cost'])} = {gh(cv['cost'])}",
                             f"{gh(c['gpu_cost'])} + {gh(c['bytes_cost'])} = {gh(c['cost'])}",
                             f"{gh(c['restart_gpu_s'])} / {gh(c['reprefill_gpu_s'])} / {gh(c['pause_gpu_s'])}",
                             gh(c["kv_kept_gpu_s"]), f"{c['checkpoints']:,.0f}",
                             f"{c['bytes'] / TIB:,.1f} ({cv['bytes'] / TIB:,.1f})",
                             f"{ratio_h:.3f}", f"{ratio_c:.2f}", f"{ratio_hb:.2f}" if hb else "",
                             f"{below_fixed:.1%}", "yes" if met else "NO"])
    sens = []
    if a.sensitivity_kv and "two-tier-h200" in PROFILES:
        for kv in map(float, a.sensitivity_kv.split(",")):
            run = simulate(seeds[0], profile_config("two-tier-h200", kv_bytes_per_token=kv))
            cls = run["ckptflow_by_class"]
            sens.append({"kv_bytes_per_token": kv, "seed": seeds[0], "policies": run["policies"],
                         "ckptflow_by_class": cls})
    prices = []
    for key in filter(None, a.sensitivity_bytes.split(",")):
        label, fields = BYTE_PRICES[key]
        cost = CostModel(**fields)
        run = simulate(seeds[0], profile_config("two-tier-h200", cost=cost),
                       policies=("ckptflow", "clairvoyant", "hindsight"))
        prices.append({"price": key, "label": label, "cost_fields": fields, "seed": seeds[0],
                       "bytes_s_per_gib": run["bytes_s_per_gib"], "policies": run["policies"]})
    dt = {mode: decide_10k(mode) for mode in ("process", "template-sessions")}
    out = BENCH / "results"
    out.mkdir(exist_ok=True)
    plot([r for r in runs if "fixed_curve" in r], out / "policy_sim.png")
    cfgs = {name: {k: v for k, v in dataclasses.asdict(profile_config(name)).items() if k != "cost"}
            for name in profiles}
    cost = profile_config(profiles[0]).cost.model_dump()
    per_seed = [{"profile": r["profile"], "failure_dist": r["failure_dist"], "seed": r["seed"],
                 "ckptflow_over_clairvoyant": r["targets"]["ckptflow_over_clairvoyant"],
                 "ckptflow_over_hindsight": r["targets"]["ckptflow_over_hindsight"]} for r in runs]
    record_run("policy_sim", {"profiles": cfgs, "cost_model": cost, "per_seed": per_seed, "runs": runs,
                              "sensitivity_two_tier_kv": sens, "sensitivity_two_tier_bytes_price": prices,
                              "all_targets_met": ok,
                              "decide_10k_s": {k: round(v, 4) for k, v in dt.items()}})

    headers = ["profile", "failures", "seed", "node failures", "never", "best fixed", "young-daly", "hindsight",
               "clairvoyant GPU + bytes = total", "ckptflow GPU + bytes = total",
               "ckptflow restart / re-prefill / pause", "ckptflow KV kept",
               "ckptflow checkpoints", "ckptflow TiB written (clairvoyant)", "ckptflow / hindsight",
               "ckptflow / clairvoyant",
               "sessions at heartbeats instead / clairvoyant", "below best fixed",
               "targets met"]
    table = md_table(headers, rows)

    # Where ckptflow's checkpoints go, per profile (exponential failures, seeds summed).
    cls_rows = []
    n_exp = sum(1 for r in runs if r["failure_dist"] == "exponential") // max(1, len(profiles))
    for profile in profiles:
        for k, v in sorted(by_class(runs, profile).items()):
            cls_rows.append([profile, k, f"{v['workloads'] / n_exp:.0f}", f"{v['with_checkpoints'] / n_exp:.0f}",
                             f"{v['checkpoints'] / n_exp:,.0f}", f"{v['pause_gpu_s'] / n_exp / H:,.2f}",
                             f"{v['reprefill_gpu_s'] / n_exp / H:,.2f}", f"{v['kv_kept_gpu_s'] / n_exp / H:,.2f}"])
    cls_table = md_table(["profile", "node class / traffic", "workloads", "with a checkpoint", "checkpoints",
                          "pause GPU-h", "re-prefill lost GPU-h", "KV kept GPU-h"], cls_rows)
    sens_rows = []
    for srun in sens:
        p = srun["policies"]
        pre = srun["ckptflow_by_class"].get("preemptible/long", {})
        fl = srun["ckptflow_by_class"].get("flaky/long", {})
        sens_rows.append([f"{srun['kv_bytes_per_token']:,.0f}", f"{p['hindsight']['cost'] / H:,.1f}",
                          f"{p['ckptflow']['cost'] / H:,.1f}", gh(p["ckptflow"]["kv_kept_gpu_s"]),
                          f"{pre.get('checkpoints', 0):,.0f}", f"{fl.get('checkpoints', 0):,.0f}"])
    sens_table = md_table(["KV bytes / token", "hindsight", "ckptflow", "ckptflow KV kept",
                           "checkpoints preemptible/long", "checkpoints flaky/long"], sens_rows) if sens else ""

    print(table)
    print()
    print(cls_table)
    if sens:
        print()
        print(sens_table)
    price_rows = []
    for pr in prices:
        p = pr["policies"]
        c, cv = p["ckptflow"], p["clairvoyant"]
        price_rows.append([pr["label"], f"{pr['bytes_s_per_gib']:.3f}",
                           f"{gh(c['gpu_cost'])} + {gh(c['bytes_cost'])} = {gh(c['cost'])}",
                           f"{gh(cv['gpu_cost'])} + {gh(cv['bytes_cost'])} = {gh(cv['cost'])}",
                           f"{p['hindsight']['cost'] / H:,.1f}", f"{c['checkpoints']:,.0f}",
                           f"{c['bytes'] / TIB:,.1f} ({cv['bytes'] / TIB:,.1f})",
                           f"{c['cost'] / cv['cost']:.2f}"])
    price_table = md_table(["bytes priced at", "GPU-s per GiB", "ckptflow GPU + bytes = total",
                            "clairvoyant GPU + bytes = total", "hindsight", "ckptflow checkpoints",
                            "ckptflow TiB (clairvoyant)", "ckptflow / clairvoyant"], price_rows) if prices else ""
    if prices:
        print()
        print(price_table)
    never = next(r["notes"]["never"] for r in runs if r["profile"] == profiles[-1])
    print(f"\n{never}")
    print(f"\ndeciding 10,000 workloads: {dt['process']:.3f} s (process), {dt['template-sessions']:.3f} s (two-tier)")
    notes = NOTES.format(dt_p=dt["process"], dt_t=dt["template-sessions"], cls_table=cls_table,
                         bytes_s=CostModel().bytes_s_per_gib(), never=never,
                         prices=(f"Seed 0 (exponential) under two-tier-h200 with the bytes priced otherwise (GPU-hours):"
                                 f"\n\n{price_table}\n" if prices else ""),
                         protects=protects_text(runs, profiles, n_exp),
                         sens=(f"Seed 0 (exponential) under two-tier-h200 with other KV bytes per token (GPU-hours; "
                               f"the reference uses 65,536):\n\n{sens_table}\n" if sens else ""),
                         n=n_exp)
    append_results("Policy simulator (bench/policy_sim.py): GPU cost + bytes cost, GPU-hours per 30 days, "
                   "process vs two-tier cost profile", table, notes)
    return 0 if ok else 1


NOTES = """\
Every cost is GPU cost (lost + pause) + bytes cost (the bytes written, priced at
{bytes_s:.2f} GPU-s per GiB), in GPU-hours; "clairvoyant" and "ckptflow" show the three. After
"ckptflow": its lost time split into restarts (restores or cold starts), re-prefill of KV not
in the newest checkpoint, and heartbeat pauses; "KV kept" is the re-prefill its checkpoints saved
(KV restored instead of recomputed); TiB its checkpoints wrote, clairvoyant's in brackets.
Deciding 10,000 workloads (cost-based policy): {dt_p:.3f} s process, {dt_t:.3f} s two-tier
(target < 1 s). Plot: bench/results/policy_sim.png (seed 0, both profiles). Trace: 'Reference
trace' above, unchanged; with the bytes unpriced (CostModel(shared_tier_usd_per_gib=0,
node_usd_per_gib=0)) the `process-h200` rows reproduce the 2026-11-29 runs (tests/test_sim.py).

Why bytes are priced now (the issue "Bytes are not priced"): under the GPU-hours-only model
ckptflow took 1,341,543 checkpoints on seed 0 (two-tier-h200) and wrote 4,718.5 TiB in 30 days,
about 2 GB/s across the fleet, against clairvoyant's 25.6 TiB, because a turn-end export costs
the GPU 0.00166 s and nothing per GiB, so every session's KV was exported every few turns on
preemptible nodes and once it paid its fixed part elsewhere. CostModel now prices each GiB
written in the model's one unit, GPU-seconds: its dollars (S3 Standard PUTs of 8 MiB chunks,
$0.00064, and ~2 h of storage, $0.00007; a data-center NVMe's wear, $0.00008) at $2.50 per H200
hour, {bytes_s:.2f} GPU-s per GiB (CostModel's gpu_usd_per_hour, shared_tier_usd_per_gib,
node_usd_per_gib; the node's bandwidth is not charged as contention: 2 GB/s across 64 nodes is
31 MB/s a node). A GiB of KV at 64 KiB/token re-prefills in 1.64 GPU-s, so writing it pays only
where an interruption is at least ~70 % likely to need it: the policy (policies/cadence.py,
policies/sessions.py ``decide_export``) weighs pause + bytes, and exports a session's new KV at
the drain before a window (certain) but not on a 24 h preemptible node (a ~4 % chance per
session-hour); clairvoyant checkpoints before an interruption only where the re-prefill saved
exceeds pause + bytes; hindsight picks each worker's interval by the sum. The ratio to
clairvoyant depends on the price (table below): clairvoyant's foresight is worth most where
bytes cost a fair share of the KV they save, and no online policy can export on a preemptible
node at those prices (a token exported pays only if its session outlives ~70 % of the MTBF).
Where bytes are free the old ratios stand; at $3.50 per GPU-hour (0.81 GPU-s per GiB) ckptflow
is 1.27-1.47 x clairvoyant on seeds 0-4.

{prices}
Why never and hindsight differ at 0 checkpoints (seed 0, as `ckptflow simulate` prints it):
{never}

Why the simulator was recalibrated: its cost model described the whole-process path only
(heartbeat pause 1.3 s per GiB the worker holds, restore 1.25 GiB/s + 5 s), under which a
heartbeat of a 20-140 GiB worker costs 26-182 s and protecting long sessions' KV almost never
pays (`hindsight` = never on every seed). The two-tier path was measured on the H200
(bench/results/gpu_two_tier.json, 'Two tiers ... vLLM-shaped engine' above): a session
heartbeat held the engine 0.036 s for 0.987 GiB of changed KV (4.97 GiB live), bytes written
= exactly the changed chunks, for a worker reserving 124 GiB; restore-to-ready 3.87 s = template
CRIU + CUDA restore 2.40 s + chunk check 0.45 s + weights and session KV (21.1 GiB) streamed at
20.9 GiB/s (row A: 23.7 GiB/s, 3.47 s, vs 29.45 s for the whole process). Profile
`two-tier-h200` (CostModel's session_* / template_restore_s / stream_gib_s fields): a heartbeat
pauses 0.036 s + 0.036 s per GiB of KV changed since the previous one (the one measurement
cannot be split into fixed and per-GiB parts, so it is charged as both: pessimistic), a restore
costs 2.85 s + (weights + the checkpointed live KV) / 20.9 GiB/s. Assumptions the bench does not
measure, stated: KV 64 KiB per token (the trace counts tokens: mean 0.87 M live per long-session
worker, which then holds 53 GiB, inside its 20-140 GiB footprint; an 8B-class GQA model with fp8
KV, or a 70B-class bf16 model's per-GPU share at TP 8); weights half the footprint; re-prefill
10k tokens/s and cold start 10 min as before; the template's one capture per (engine, model)
(≈ 2.1-2.6 s pause + 1.7 s weight export) is not charged, as the process profile's initialised
checkpoint is not.

Two tiers, sessions at their turn ends (issue #25 item 3): a session is weighed when its turn
ends (policies/sessions.py ``decide_export`` with ``at_turn_end``, the rule the live turn-end loop
calls; ``sim.turn_exports_cost`` replays it, held to a turn-by-turn replay in
tests/test_session_policy.py). It is idle then, so the export holds it alone and the engine
serves on: CostModel.turn_export_fixed_s + turn_export_s_per_gib, from bench/gpu_turn_export.py
(the other sessions' loss per export; the fixed part measured there is within that bench's
noise, and it alone sets Young's interval below). Moving a session's new KV pays at all when a
token's share of the export is below its chance-weighted re-prefill; then it moves once the
re-prefill at risk x the seconds since its last export reach 2 x the fixed part x the node's
MTBF (Young's interval, per session). Before a maintenance window the drain exports every
changed session at its last turn end (30 s earlier). ``sessions at heartbeats instead`` is the
same rule at the cadence's heartbeats, the engine held (0.036 s + 0.036 s per GiB). The
``ckptflow / clairvoyant`` column is the ratio the issues ask to bring within 1.5 (#25), then
within 1.3 with the bytes priced: clairvoyant exports right before each failure, knowing when,
so it pays for no export that a failure never needed and re-prefills nothing.

What ckptflow's checkpoints protect, per node class and traffic (exponential failures, mean
per seed over {n} seeds):

{cls_table}

{protects}

{sens}
"""


if __name__ == "__main__":
    sys.exit(main())
