"""The `ckptflow` command line (typer + rich).

Examples:
    ckptflow demo                       # the main job: checkpoint, kill, recover, prove
    ckptflow doctor                     # every prerequisite with its state and fix
    ckptflow ls                         # checkpoints with state, age and size
    ckptflow heartbeat deployments/local.yaml
    ckptflow recover deployments/local.yaml demo-chat [--node N]
    ckptflow recover-node deployments/fleet.yaml gpu-07   # a lost node: its workloads elsewhere
    ckptflow simulate --seed 0 --json   # policies on the reference fleet trace
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ckptflow.errors import CkptflowError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])
console = Console()


def _fail(e: Exception) -> None:
    console.print(f"[bold red]error:[/] {e}")
    raise typer.Exit(2)


@app.command()
def demo() -> None:
    """Run the end-to-end demo on this machine; exit 0 only if the continuation matched."""
    from ckptflow.demo.main import run_demo

    try:
        ok = run_demo(console)
    except CkptflowError as e:
        _fail(e)
    raise typer.Exit(0 if ok else 1)


@app.command()
def doctor() -> None:
    """List every prerequisite with its state and the fix."""
    from ckptflow.doctor import checks

    table = Table(title="ckptflow doctor")
    for col in ("check", "state", "detail / fix"):
        table.add_column(col)
    bad = 0
    for name, ok, detail in checks():
        bad += ok is False
        state = {True: "[green]ok[/]", False: "[red]FAIL[/]", None: "[yellow]n/a[/]"}[ok]
        table.add_row(name, state, detail)
    console.print(table)
    raise typer.Exit(1 if bad else 0)


@app.command("ls")
def ls(fleet_file: Path = typer.Option(Path("deployments/local.yaml"), "--fleet", help="Fleet file."),
       workload: str = typer.Option(None, help="Only this workload.")) -> None:
    """List checkpoints with state (and why, when invalidated or failed), age and size."""
    from ckptflow.fleet import load_fleet
    from ckptflow.store import open_store

    try:
        store = open_store(load_fleet(fleet_file).storage)
        names = [workload] if workload else store.workloads()
        table = Table(title=f"checkpoints in {getattr(store, 'root', store)}")
        for col in ("workload", "checkpoint", "state", "age", "size", "reason"):
            table.add_column(col)
        now = datetime.now(timezone.utc)
        for name in names:
            for m in store.list(name):
                age = now - m.created
                table.add_row(m.workload, m.id, m.state.value, _age(age.total_seconds()),
                              f"{m.bytes / 2**20:,.1f} MiB", m.state_reason or "")
    except CkptflowError as e:
        _fail(e)
    console.print(table)


def _age(s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"


@app.command()
def status(fleet_file: Path = typer.Option(Path("deployments/local.yaml"), "--fleet", help="Fleet file.")) -> None:
    """Per workload: newest checkpoint, its state (and why), age, verification, bytes, restores."""
    from ckptflow.fleet import load_fleet
    from ckptflow.report import fleet_status

    try:
        fleet = load_fleet(fleet_file)
        rows = fleet_status(fleet)
    except CkptflowError as e:
        _fail(e)
    table = Table(title=f"fleet {fleet.fleet}")
    for col in ("workload", "node", "traffic", "newest", "state", "valid age", "verified", "stored", "restores"):
        table.add_column(col)
    for r in rows:
        state = r["newest_state"] or "-"
        if r["newest_reason"]:
            state += f" ({r['newest_reason'][:60]})"
        ver = {None: "-", True: "[green]ok[/]", False: "[red]FAILED[/]"}[r["verified"]]
        last = f"{len(r['restores'])} (last {r['restores'][-1]:.1f} s)" if r["restores"] else "0"
        table.add_row(r["workload"], r["node"], r["traffic"], r["newest"] or "-", state,
                      _age(r["age_s"]) if r["age_s"] is not None else "[red]none valid[/]", ver,
                      f"{r['bytes'] / 2**20:,.1f} MiB", last)
    console.print(table)


@app.command()
def exporter(fleet_file: Path = typer.Option(Path("deployments/local.yaml"), "--fleet", help="Fleet file."),
             port: int = typer.Option(9464, help="Port for /metrics."),
             host: str = typer.Option("127.0.0.1", help="Address to bind.")) -> None:
    """Serve Prometheus metrics about checkpoints: age, states, verification, bytes, restores."""
    import time

    from prometheus_client import CollectorRegistry, start_http_server

    from ckptflow.fleet import load_fleet
    from ckptflow.report import StoreCollector

    try:
        fleet = load_fleet(fleet_file)
    except CkptflowError as e:
        _fail(e)
    reg = CollectorRegistry()
    reg.register(StoreCollector(fleet))
    start_http_server(port, addr=host, registry=reg)
    console.print(f"serving ckptflow metrics on http://{host}:{port}/metrics")
    while True:
        time.sleep(3600)


@app.command()
def verify(fleet_file: Path, workload: list[str] = typer.Option(None)) -> None:
    """Run the verify flow once: sandbox-restore the newest unverified checkpoints."""
    from ckptflow.flows.verify import verify as flow

    flow(str(fleet_file), workloads=workload or None)


@app.command()
def invalidate(fleet_file: Path, node: str = typer.Option(None)) -> None:
    """Run the invalidate flow once: report this node's fingerprint, retire stale checkpoints."""
    from ckptflow.flows.invalidate import invalidate as flow

    flow(str(fleet_file), node=node)


@app.command()
def deploy(fleet_file: Path, render_only: bool = typer.Option(False, "--render-only",
                                                              help="Only write prefect.<fleet>.yaml for review.")) -> None:
    """Render prefect.<fleet>.yaml beside the fleet file and deploy it to the Prefect server."""
    from ckptflow.deploy import deploy as run, render_prefect_yaml

    try:
        out = render_prefect_yaml(fleet_file) if render_only else run(fleet_file)
    except CkptflowError as e:
        _fail(e)
    console.print(f"{'rendered' if render_only else 'deployed'} {out}")


@app.command()
def simulate(seed: int = typer.Option(0, help="Trace seed."),
             failures: str = typer.Option("exponential", help="exponential or weibull"),
             as_json: bool = typer.Option(False, "--json", help="Print JSON: {policies: {name: {cost, ...}}}.")) -> None:
    """Replay the reference fleet trace under every policy (what-if simulator)."""
    import json

    from ckptflow.sim import TraceConfig, simulate as run

    if failures not in ("exponential", "weibull"):
        _fail(ValueError(f"--failures must be exponential or weibull, not {failures!r}"))
    out = run(seed, TraceConfig(failure_dist=failures))
    if as_json:
        print(json.dumps(out, indent=1))
        return
    table = Table(title=f"policies on the reference trace (seed {seed}, {failures} failures), GPU-hours / 30 days")
    for col in ("policy", "total cost", "lost", "pause", "checkpoints", "TiB written"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    for name, p in sorted(out["policies"].items(), key=lambda kv: kv[1]["cost"]):
        table.add_row(name, f"{p['cost'] / 3600:,.1f}", f"{p['lost_gpu_s'] / 3600:,.1f}",
                      f"{p['pause_gpu_s'] / 3600:,.1f}", f"{p['checkpoints']:,.0f}", f"{p['bytes'] / 2**40:,.1f}")
    console.print(table)


@app.command()
def heartbeat(fleet_file: Path, node: str = typer.Option(None), workload: list[str] = typer.Option(None),
              force: bool = typer.Option(False, help="Checkpoint every selected workload, whatever the policy.")) -> None:
    """Run the heartbeat flow once: decide per workload, checkpoint those due (leave running)."""
    from ckptflow.flows.heartbeat import heartbeat as flow

    flow(str(fleet_file), node=node, workloads=workload or None, force=force)


@app.command()
def recover(fleet_file: Path, workload: str,
            node: str = typer.Option(None, help="Restore on this node (default: the workload's own).")) -> None:
    """Run the recover flow for one lost workload (nearest valid copy: the node's, else S3)."""
    from ckptflow.flows.recover import recover as flow

    flow(str(fleet_file), workload, node=node)


@app.command()
def prune(fleet_file: Path) -> None:
    """Apply retention in the fleet's S3 bucket and delete chunks no manifest references."""
    from ckptflow.flows.prune import prune as flow

    console.print(flow(str(fleet_file)))


@app.command("recover-node")
def recover_node(fleet_file: Path, node: str) -> None:
    """Bring every workload of a lost node back on other nodes (from S3, or a cold start)."""
    from ckptflow.flows.recover import recover_node as flow

    rows = flow(str(fleet_file), node)
    table = Table(title=f"recovery of {node}")
    for col in ("workload", "action", "target", "reason"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["workload"], r["action"], r["target"], r.get("reason", ""))
    console.print(table)
    if any(r["action"] in ("FAILED", "NOT RECOVERED") for r in rows):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
