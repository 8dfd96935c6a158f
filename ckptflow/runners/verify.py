"""Prove a checkpoint restores: a sandbox copy beside the running original.

The copy is restored with criu-ns into its own PID namespace and a fresh network namespace
(so it can bind the original's port), asked for /health and the golden request, compared
with what the original answered right before the dump, and killed. The original is never
touched.

Example:
    >>> res = verify_checkpoint(node, workload, manifest)    # doctest: +SKIP
    >>> res.state, res.reason
    (<VerifyOutcome.verified: 'verified'>, 'golden digest and 1 session digest(s) equal')
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from typing import Callable

from ckptflow.errors import CkptflowError, CriuError, GpuCheckpointError, NotEnoughGpuMemory
from ckptflow.models import EngineProbe, Manifest, VerifyOutcome, Workload
from ckptflow.runners.digests import VerifyResult, compare  # noqa: F401  (re-exported: callers import them here)
from ckptflow.runners.engine import golden_digest
from ckptflow.runners.node import NodeRunner

# Runs inside the sandbox's network namespace: poll health, then ask the golden request and
# the probe, print one JSON line. One process, so namespace entry is paid once.
_IN_NS = r"""
import json, sys, time
import httpx
from ckptflow.poll import PollTimeout, poll
cfg = json.loads(sys.argv[1]); out = {}
t0 = time.perf_counter()
with httpx.Client(follow_redirects=True) as http:
    try:
        poll(lambda: http.get(cfg["health"], timeout=2).raise_for_status().is_success, cfg["timeout"], 0.05,
             what="health", retry_on=(httpx.HTTPError,))
    except PollTimeout as e:
        print(json.dumps({"error": f"not healthy within {cfg['timeout']} s: {e.last}"})); sys.exit()
    out["health_s"] = time.perf_counter() - t0
    if cfg.get("resume"):  # the image was taken quiesced: the copy is held as the original was
        try:
            http.post(cfg["resume"], content=b"{}", timeout=10)
        except httpx.HTTPError:
            pass  # its own hold timeout lets it go, as for the original
    if cfg.get("golden"):
        g = cfg["golden"]  # the body as bytes exactly as runners.engine.probe sends it
        r = http.post(g["url"], content=json.dumps(g["body"]).encode(), timeout=120,
                      headers={"Content-Type": "application/json"}).raise_for_status()
        out["golden_answer"] = r.json()
    if cfg.get("probe"):
        out["sessions"] = http.get(cfg["probe"], timeout=60).raise_for_status().json()["sessions"]
print(json.dumps(out))
"""


def probe_in_netns(ns: str, w: Workload, timeout_s: float = 120) -> dict:
    """Ask a copy running in network namespace ``ns`` for health, the golden answer and its probe."""
    cfg = {"health": w.health_url, "timeout": timeout_s, "probe": w.probe_url, "resume": w.resume_url,
           "golden": w.golden.model_dump() if w.golden else None}
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _IN_NS, json.dumps(cfg)],
                         capture_output=True, text=True, timeout=timeout_s + 180)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"probe crashed: {out.stderr.strip()[-300:]}"}


def new_netns(prefix: str) -> str:
    ns = f"{prefix}-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True)
    return ns


def del_netns(ns: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# Measured on the H200 (driver 580.159.04, bench/gpu_pidns_probe.py): a CRIU copy of a
# CUDA-checkpointed worker in its own PID namespace is unknown to the driver —
# cuCheckpointProcessGetState answers CUDA_ERROR_NOT_INITIALIZED for its host PID from the host
# and for its own PID from inside its namespaces; with the host's /proc the driver resolves that
# PID to the live original — so its GPU state cannot be restored beside the original.
GPU_SANDBOX = ("fingerprint and checksums pass; a GPU checkpoint cannot be restored beside its original "
               "(the driver restores CUDA state only into the PID that took it), so no sandbox run: "
               "prove it by a restore in place (recover) on a drained node")


def verify_checkpoint(node: NodeRunner, w: Workload, m: Manifest, timeout_s: float = 120,
                      inspect_copy: Callable | None = None) -> VerifyResult:
    """Restore ``m`` in a sandbox beside the original and compare its answers: the fingerprint
    gate and the checksums here, the copy through ``w``'s workload runtime (``verify_copy``).
    Never raises for a bad checkpoint (that is the result); raises only when the node cannot
    sandbox. ``inspect_copy``: called with the running copy, where the runtime shows one (tests)."""
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        node.gate(w, m)
        node.store.verify_bytes(m)
    except CkptflowError as e:
        return VerifyResult(VerifyOutcome.verify_failed, str(e).splitlines()[0], t)
    t["checksum"] = round(time.perf_counter() - t0, 4)
    return node.runtime_for(w).verify_copy(w, m, t, timeout_s, inspect_copy=inspect_copy)


def verify_process_copy(node: NodeRunner, w: Workload, m: Manifest, t: dict[str, float],
                        timeout_s: float = 120) -> VerifyResult:
    """The process runtime's copy: criu-ns into its own PID namespace and a fresh network
    namespace, its device state restored where the backend can, asked from inside the namespace."""
    why = node.copy_unsupported(w, m)
    if why:
        return VerifyResult(VerifyOutcome.skipped, GPU_SANDBOX + (" (or start the worker with `ckptflow run-isolated`, "
                            "whose copies can be verified beside it)" if node.gpu_for(w).restores_isolated_copy else ""), t)
    if m.gpu_pids and not node.gpu_for(w).restores_beside:
        try:  # the copy needs the footprint free once more, beside the original's
            node.gate_gpu_memory(w, m)
        except CkptflowError as e:
            return VerifyResult(VerifyOutcome.skipped, f"no room for a GPU copy beside the original: "
                                f"{str(e).splitlines()[0]}", t)
    ns = new_netns("ckv")
    copy = None
    try:
        try:
            copy = node.restore_copy(w, m, ns, t, gate=False)
        except CriuError as e:
            return VerifyResult(VerifyOutcome.verify_failed, f"sandbox restore failed: {str(e).splitlines()[0]}", t, e.log_tail)
        except NotEnoughGpuMemory as e:   # the device restore's own gate: nothing was restored on the device
            return VerifyResult(VerifyOutcome.skipped, f"no room for a GPU copy beside the original: "
                                f"{str(e).splitlines()[0]}", t)
        except GpuCheckpointError as e:   # the device restore: restore_copy stopped the copy
            return VerifyResult(VerifyOutcome.verify_failed, f"sandbox device restore failed: "
                                f"{str(e).splitlines()[0]}", t)
        # Anything else (a node that cannot sandbox: no criu-ns, an isolated image with /dev/shm
        # files) is raised, as the docstring says: it says nothing about the checkpoint.
        t0 = time.perf_counter()
        got = probe_in_netns(ns, w, timeout_s)
        t["probe"] = round(time.perf_counter() - t0, 4)
        return _compare(w, m, got, t)
    finally:
        if copy is not None:
            copy.stop()
        del_netns(ns)


def _compare(w: Workload, m: Manifest, got: dict, t: dict) -> VerifyResult:
    """The in-namespace answer (``probe_in_netns``) against the checkpoint: see ``compare``."""
    if "error" in got:
        return VerifyResult(VerifyOutcome.verify_failed, f"sandbox copy {got['error']}", t)
    t["health"] = round(got.get("health_s", 0), 4)
    # As the copy answered, unvalidated: a malformed answer differs, it does not crash the verify.
    have = EngineProbe.model_construct(golden=golden_digest(got["golden_answer"], w.golden.field)
                                       if w.golden and "golden_answer" in got else None, sessions=got.get("sessions"))
    return compare(w, m, have, t)
