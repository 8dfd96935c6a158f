"""`ckptflow demo`: checkpoint a live worker, kill it like a node failure, recover, and prove it.

Runs entirely on this machine on embedded defaults: Prefect's temporary server on SQLite
under ./.ckptflow/prefect, and a namespace of its own under ./.ckptflow/demo (its fleet file, store
and pid files), so that a worker started from deployments/local.yaml, and its checkpoints in
./.ckptflow/store, are never touched by a demo run.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

FLEET_FILE = "deployments/local.yaml"
DEMO_DIR = Path(".ckptflow/demo")  # the demo's own fleet file, store and pid files
PORT = 18001  # demo-chat's port in FLEET_FILE; the reference twin listens on the next one
# The demo's own default, not FLEET_FILE's: the docs start a worker of deployments/local.yaml by
# hand on 18001, and a demo run beside it must not find its port taken.
DEMO_PORT = 18201
LONG_PROMPT = ("You are an agent working through a long task. Keep notes of every step. " * 40)[:1900]
N_CONT = 64


def _prefect_env(home: Path) -> None:
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "true")
    # Prefect waits 20 s for its temporary server; a first start on a busy 2-core machine
    # (migrations, imports) took longer and the demo died on "Timed out while attempting to
    # connect to ephemeral Prefect API server".
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def _fleet_file(port: int, demo_dir: Path) -> str:
    """FLEET_FILE's fleet in the demo's own namespace: its store and demo-chat's pid file under
    ``demo_dir``, demo-chat's URLs on ``port`` (heartbeat and recover find the worker through them).
    A user's worker started from FLEET_FILE keeps its pid file and its checkpoints.

    Example: _fleet_file(18101, Path(".ckptflow/demo")) == ".ckptflow/demo/local-18101.yaml"
    """
    import yaml

    text = Path(FLEET_FILE).read_text().replace(f"127.0.0.1:{PORT}/", f"127.0.0.1:{port}/")
    data = yaml.safe_load(text)
    # Relative to the file written here, in demo_dir, as every fleet file's paths are to its own directory.
    data["storage"]["path"] = "store"
    for w in data["workloads"]:
        w["find"]["pid_file"] = f"run/{Path(w['find']['pid_file']).name}"
    out = demo_dir / f"local-{port}.yaml"
    out.write_text(f"# Written by `ckptflow demo` from {FLEET_FILE}: the demo's own store and pid files.\n"
                   + yaml.safe_dump(data, sort_keys=False))
    return str(out)


def run_demo(console: Console | None = None, port: int = DEMO_PORT) -> bool:
    """Run the demo with its worker on ``port``; return True when the restored continuation
    matched the reference. Example: run_demo(port=18101) (the reference twin on 18102)."""
    console = console or Console()
    ref_port = port + 1
    state = Path(".ckptflow")
    (DEMO_DIR / "run").mkdir(parents=True, exist_ok=True)
    _prefect_env(state / "prefect")

    from prefect import flow
    from prefect.artifacts import create_markdown_artifact
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from ckptflow.demo import launch
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover
    from ckptflow.fleet import load_fleet
    from ckptflow.render import render
    from ckptflow.runners.criu import CriuRunner

    CriuRunner().check()  # fail before starting anything, with the fix
    launch.require_free_port(port)
    launch.require_free_port(ref_port)
    fleet_file = _fleet_file(port, DEMO_DIR)
    fleet = load_fleet(fleet_file)
    w = fleet.workload("demo-chat")
    pid_file = Path(w.find.pid_file)
    procs = []
    # Checkpoints of an earlier demo run belong to a worker that no longer exists; the demo's store
    # holds nothing else (it is not the fleet file's).
    shutil.rmtree(Path(fleet.storage.path) / w.name, ignore_errors=True)

    @flow(name="ckptflow-demo")
    def demo_flow() -> bool:
        rows = []

        def step(name: str, seconds: float | None = None, nbytes: int | None = None) -> None:
            rows.append({"step": name, "seconds": seconds, "bytes": nbytes})
            console.print(f"[bold cyan]•[/] {name}" + (f"  [dim]{seconds:.2f} s[/]" if seconds is not None else ""))

        t0 = time.perf_counter()
        procs.append(launch.start_worker(port, pid_file))
        procs.append(launch.start_worker(ref_port, DEMO_DIR / "run" / "reference.pid"))
        step("start demo worker + uninterrupted reference twin", time.perf_counter() - t0)

        def both(prompt: str, n: int, sid: str | None) -> list[int]:
            a = launch.complete(port, prompt, n, sid)
            b = launch.complete(ref_port, prompt, n, sid)
            assert a == b, "worker and reference diverged before any checkpoint"
            return a

        t0 = time.perf_counter()
        both(LONG_PROMPT, 48, "agent-1")
        for i in range(3):
            both(f"short request {i}", 8, None)
        step("long session turn 1 (~1,900 prompt tokens) + 3 short requests", time.perf_counter() - t0)

        r1 = heartbeat(fleet_file)[0]  # no checkpoint yet: the policy says checkpoint_now
        step(f"heartbeat 1 ({r1['decision']}) → checkpoint {r1['checkpoint']}", r1["dump_s"], r1["bytes"])
        console.print(f"  [dim]policy: {r1['reason']}[/]")

        t0 = time.perf_counter()
        both("Step 2: summarise the notes so far and plan the next step.", 48, "agent-1")
        step("long session turn 2", time.perf_counter() - t0)

        r2 = heartbeat(fleet_file, force=True)[0]  # seconds later the policy would skip: force
        step(f"heartbeat 2 (manual) → checkpoint {r2['checkpoint']}", r2["dump_s"], r2["bytes"])
        console.print(f"  [dim]{r2['reason']}[/]")
        tokens = launch.http_json(f"http://127.0.0.1:{port}/v1/sessions")["sessions"]["agent-1"]

        # A turn after the last checkpoint: the node dies with it, the client retries it.
        lost_turn = "Step 3: call the search tool."
        launch.complete(port, lost_turn, 16, "agent-1")
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)
        step(f"SIGKILL worker PID {pid} (node failure; turn 3 was in flight)")

        t0 = time.perf_counter()
        res = recover(fleet_file, "demo-chat")
        step(f"recover → restored PID {res['pid']} from {res['checkpoint']}", time.perf_counter() - t0,
             res["bytes"])
        for phase, s in res["timings"].items():
            if phase == "restore_and_checksum":  # restore and checksum overlap: this is their wall time
                phase = "restore + checksum (run in parallel; wall time)"
            rows.append({"step": f"  restore phase: {phase}", "seconds": s, "bytes": None})

        digest_ok = res["checkpoint"] == r2["checkpoint"]
        got = launch.complete(port, lost_turn, N_CONT, "agent-1")
        want = launch.complete(ref_port, lost_turn, N_CONT, "agent-1")
        matched = digest_ok and got == want
        create_markdown_artifact(key="ckptflow-demo", markdown=render(
            "demo_report.md.j2", matched=matched, session_tokens=tokens, checkpoint_id=res["checkpoint"],
            rows=rows, digest_ok=digest_ok, n_tokens=N_CONT))

        table = Table(title="ckptflow demo: phases, times and bytes")
        table.add_column("step")
        table.add_column("seconds", justify="right")
        table.add_column("bytes", justify="right")
        for r in rows:
            table.add_row(r["step"], "" if r["seconds"] is None else f"{r['seconds']:.3f}",
                          "" if not r["bytes"] else f"{r['bytes'] / 2**20:,.1f} MiB")
        console.print(table)
        if matched:
            console.print(f"[bold green]continuation matched[/]: the restored worker's next {N_CONT} tokens "
                          f"of session agent-1 ({tokens} tokens of KV cache at checkpoint) equal the "
                          "uninterrupted reference's.")
        else:
            console.print(f"[bold red]continuation DIFFERED[/]: restored {got[:8]}... vs reference {want[:8]}...")
        return matched

    try:
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            return demo_flow()
    finally:
        for p in procs:
            _stop(p)
        try:
            _stop_pid(int(pid_file.read_text()))
        except (FileNotFoundError, ValueError):
            pass


def _stop(p) -> None:
    if p.poll() is None:
        p.kill()
        p.wait(timeout=10)


def _stop_pid(pid: int) -> None:
    from ckptflow.runners.process import cmdline

    if "ckptflow.demo.worker" in (cmdline(pid) or ""):
        os.kill(pid, signal.SIGKILL)
