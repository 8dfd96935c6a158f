"""The `ckptflow` command line (typer + rich).

Examples:
    ckptflow demo                       # the main job: checkpoint, kill, recover, prove
    ckptflow doctor                     # every prerequisite with its state and fix
    ckptflow ls                         # checkpoints with state, age and size
    ckptflow heartbeat deployments/local.yaml
    ckptflow recover deployments/local.yaml demo-chat [--node N]
    ckptflow recover-node deployments/example-h200-fleet.yaml h200-07   # a lost node: its workloads elsewhere
    ckptflow simulate --seed 0 --json   # policies on the reference fleet trace
    setsid ckptflow run-isolated --pid-file /run/w.pid -- python3 -m ...   # a worker in its own namespaces

Exit codes: 0 done; 1 the command ran and something failed (a checkpoint, a prerequisite, an
unexpected error); 2 refused: bad input or a typed error, printed as `error: …` and `fix: …`
on stderr. `ckptflow --debug …` shows the traceback instead.
"""

from __future__ import annotations

import os

# Prefect reports usage from the client on import and from its server; ckptflow's own commands
# keep both off unless the operator set them. Set before anything imports Prefect; the
# `prefect` processes `deploy` starts inherit it.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import logging  # noqa: E402
import sys  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, Callable  # noqa: E402

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from ckptflow.errors import CkptflowError, ConfigError, HeartbeatFailed, NotRecovered  # noqa: E402

if TYPE_CHECKING:
    from ckptflow.fleet import Fleet

DEFAULT_FLEET = Path("deployments/local.yaml")
_debug = False


class _Cli(typer.Typer):
    """One exit convention for every command: a typed error is two lines on stderr and exit 2,
    anything else one line and exit 1; the traceback only with --debug."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except CkptflowError as e:
            if _debug:
                raise
            _print_error(e.message, e.fix)
            sys.exit(2)
        except Exception as e:
            if _debug:
                raise
            _print_error(f"{type(e).__name__}: {e}", "run `ckptflow --debug ...` to see the traceback")
            sys.exit(1)


app = _Cli(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0],
           pretty_exceptions_show_locals=False)
# Piped, from cron or over ssh without a TTY, rich would assume 80 columns and cut the state
# column ("comp…"): a log or a grep wants whole words. COLUMNS still wins when set.
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200)


def _print_error(message: str, fix: str | None) -> None:
    # Plain writes, not rich: a message may hold [brackets], and an SRE greps these lines whole.
    lines = message.strip().splitlines() or [""]
    typer.echo(f"error: {lines[0]}", err=True)
    for line in lines[1:]:
        typer.echo(line if line.startswith(" ") else f"  {line}", err=True)
    if fix:
        typer.echo(f"fix: {fix}", err=True)


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="Show the traceback of an error.")) -> None:
    """Scheduled checkpoint policies for GPU inference workers."""
    global _debug
    _debug = debug


def _fleet(fleet_file: Path, workloads: list[str] | None = None, nodes: list[str | None] | None = None) -> "Fleet":
    """Read and check the fleet file and every name given on the command line, before any
    Prefect server starts: a typo costs a line, not a temporary server and a traceback."""
    from ckptflow.fleet import load_fleet

    fleet = load_fleet(fleet_file)
    for name in workloads or []:
        fleet.workload(name)
    for name in nodes or []:
        if name is not None:
            fleet.node(name)
    return fleet


def _fleet_path(positional: Path | None, legacy: Path | None) -> Path:
    if legacy is not None:
        if positional is not None and positional != legacy:
            raise ConfigError(f"two fleet files given: {positional} and --fleet {legacy}",
                              fix="pass one fleet file, as the first argument")
        typer.echo("warning: --fleet is deprecated; pass the fleet file as the first argument", err=True)
        return legacy
    return positional or DEFAULT_FLEET


class _NoTraceback(logging.Formatter):
    """Wraps a console handler's formatter: the record's message without its traceback."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def prefect_api_configured() -> bool:
    """Whether a Prefect server is configured (PREFECT_API_URL in the environment or the active
    profile), read without importing Prefect (~1.4 s, most of a fast restore).

        >>> os.environ["PREFECT_API_URL"] = "http://prefect:4200/api"; prefect_api_configured()
        True
        >>> del os.environ["PREFECT_API_URL"]
    """
    if os.environ.get("PREFECT_API_URL"):
        return True
    import tomllib

    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")
    try:
        doc = tomllib.loads((home / "profiles.toml").read_text())
    except (OSError, ValueError):
        return False
    name = os.environ.get("PREFECT_PROFILE") or doc.get("active") or "ephemeral"
    return bool((doc.get("profiles", {}).get(name) or {}).get("PREFECT_API_URL"))


def _flow(module: str, name: str) -> Callable:
    """Import a flow; without --debug, Prefect's console log keeps its one-line messages and
    drops the tracebacks it prints around a failed run (the error line says what failed)."""
    import importlib

    fn = getattr(importlib.import_module(module), name)
    if not _debug:
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.StreamHandler) and h.formatter and not isinstance(h.formatter, _NoTraceback):
                h.setFormatter(_NoTraceback(h.formatter))
    return fn


FLEET_ARG = typer.Argument(..., help="Fleet file, e.g. deployments/local.yaml.")
OPT_FLEET_ARG = typer.Argument(None, show_default=False, help=f"Fleet file (default {DEFAULT_FLEET}).")
LEGACY_FLEET = typer.Option(None, "--fleet", hidden=True, help="Deprecated: pass the fleet file as the argument.")


@app.command()
def demo(port: int = typer.Option(
        18201, min=1, max=65534, help="Port of the demo worker; its uninterrupted reference twin takes the next "
        "one. The demo runs on a copy of deployments/local.yaml under .ckptflow/demo, on this port, so a "
        "worker of deployments/local.yaml itself keeps its 18001.")) -> None:
    """Run the end-to-end demo on this machine; exit 0 only if the continuation matched."""
    from ckptflow.demo.main import run_demo

    raise typer.Exit(0 if run_demo(console, port=port) else 1)


@app.command()
def doctor() -> None:
    """List every prerequisite with its state and the fix."""
    from rich.markup import escape

    from ckptflow.doctor import WARN, checks

    table = Table(title="ckptflow doctor")
    for col in ("check", "state", "detail / fix"):
        table.add_column(col)
    bad = 0
    for name, ok, detail in checks():
        bad += ok is False
        state = {True: "[green]ok[/]", False: "[red]FAIL[/]", None: "[yellow]n/a[/]", WARN: "[yellow]warn[/]"}[ok]
        table.add_row(name, state, escape(detail))  # a detail may hold [brackets]: pip install 'ckptflow[gpu]'
    console.print(table)
    raise typer.Exit(1 if bad else 0)


@app.command("run-isolated", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run_isolated(ctx: typer.Context,
                 pid_file: Path = typer.Option(..., help="Where the worker's host PID is written (the fleet "
                                               "file's find.pid_file); the worker must not write it itself."),
                 log: Path = typer.Option(Path(os.devnull), help="The worker's stdout and stderr, appended.")) -> None:
    """Start a worker as PID 1 of its own PID and mount namespaces, e.g.
    `setsid ckptflow run-isolated --pid-file /run/w.pid --log /var/log/w.log -- python3 -m vllm...`:
    its restores then never need its old PIDs, and verify runs a copy beside it."""
    from ckptflow.runners.isolate import isolated_argv

    argv = list(ctx.args)
    if not argv:
        raise ConfigError("run-isolated: no worker command given",
                          fix="put the command after `--`: ckptflow run-isolated --pid-file F -- python3 -m ...")
    if os.geteuid() != 0:
        raise ConfigError("run-isolated needs root (new PID and mount namespaces)", fix="run it as root, as the node runner")
    import shutil

    # Checked here: inside the namespaces a command that cannot start fails only into --log
    # (often /dev/null), after the PID file naming a dead PID was written.
    if shutil.which(argv[0]) is None:
        raise ConfigError(f"run-isolated: cannot run {argv[0]!r}: no such executable file",
                          fix="give the worker's command as it runs in a shell on this node (on PATH, or its full path)")
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    os.execvp("unshare", isolated_argv(argv, pid_file.resolve(), log.resolve() if str(log) != os.devnull else log))


@app.command("ls")
def ls(fleet_file: Path = OPT_FLEET_ARG, legacy: Path = LEGACY_FLEET,
       workload: str = typer.Option(None, help="Only this workload.")) -> None:
    """List checkpoints with state (and why, when invalidated or failed), age and size."""
    from ckptflow.report import checkpoint_bytes, chunk_bytes, fleet_manifests

    fleet = _fleet(_fleet_path(fleet_file, legacy), [workload] if workload else None)
    names = [workload] if workload else [w.name for w in fleet.workloads]
    table = Table(title=f"checkpoints of fleet {fleet.fleet} (every node's store and the bucket)")
    for col in ("workload", "checkpoint", "state", "age", "size", "copies", "reason"):
        table.add_column(col, no_wrap=col in ("workload", "checkpoint"))
    now = datetime.now(timezone.utc)
    unreachable: list[str] = []
    for name in names:  # grows by the templates two-tier checkpoints name: their bytes are listed once
        for m in fleet_manifests(fleet, name, unreachable):
            if m.probe.template and m.probe.template.workload not in names:
                names.append(m.probe.template.workload)
            age = now - m.created
            table.add_row(m.workload, m.id, m.state.value, _age(age.total_seconds()),
                          f"{checkpoint_bytes(m) / 2**20:,.1f} MiB"
                          + (f" ({m.bytes / 2**20:,.1f} image + {chunk_bytes(m) / 2**20:,.1f} chunks)" if chunk_bytes(m) else ""),
                          ", ".join(f"{c.tier.value}:{c.location}" for c in m.copies),
                          m.state_reason or "")
    if unreachable:
        table.title = f"checkpoints of fleet {fleet.fleet} (the nodes' stores only: the bucket could not be read)"
    console.print(table)
    _say_unreachable(unreachable)


def _say_unreachable(unreachable: list[str]) -> None:
    if unreachable:
        typer.echo(f"warning: the shared tier {unreachable[0]}: only the nodes' own copies are shown", err=True)
        typer.echo("fix: check storage.endpoint_url, the credentials and the network, then run again", err=True)


def _age(s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"


@app.command()
def status(fleet_file: Path = OPT_FLEET_ARG, legacy: Path = LEGACY_FLEET) -> None:
    """Per workload: newest checkpoint, its state (and why), age, verification, bytes, restores."""
    from ckptflow.report import fleet_status

    fleet = _fleet(_fleet_path(fleet_file, legacy))
    unreachable: list[str] = []
    rows = fleet_status(fleet, unreachable=unreachable)
    # An SRE reads this in an 80-column terminal too: names are never cut; narrow terminals
    # drop the traffic class and show the checkpoint id's unique suffix.
    wide = console.width >= 120
    table = Table(title=f"fleet {fleet.fleet}", pad_edge=False)
    cols = ["workload", "node"] + (["traffic"] if wide else []) + ["newest", "state", "valid age", "verified",
                                                                  "all MiB", "restores"]
    for col in cols:
        table.add_column(col, no_wrap=col in ("workload", "node", "newest"))
    for r in rows:
        state = r["newest_state"] or "-"
        if r["newest_reason"]:
            state += f" ({r['newest_reason'][:60]})"
        ver = {None: "-", True: "[green]ok[/]", False: "[red]FAILED[/]"}[r["verified"]]
        last = f"{len(r['restores'])} (last {r['restores'][-1]:.1f} s)" if r["restores"] else "0"
        newest = r["newest"] or "-"
        if not wide and r["newest"]:
            newest = "…" + r["newest"][-8:]
        table.add_row(r["workload"], r["node"], *([r["traffic"]] if wide else []), newest, state,
                      _age(r["age_s"]) if r["age_s"] is not None else "[red]none valid[/]", ver,
                      f"{r['bytes'] / 2**20:,.1f}", last)
    if unreachable:
        table.title = f"fleet {fleet.fleet} (the nodes' stores only: the bucket could not be read)"
    console.print(table)
    _say_unreachable(unreachable)


@app.command()
def exporter(fleet_file: Path = OPT_FLEET_ARG, legacy: Path = LEGACY_FLEET,
             port: int = typer.Option(9464, min=1, max=65535, help="Port for /metrics."),
             host: str = typer.Option("127.0.0.1", help="Address to bind.")) -> None:
    """Serve Prometheus metrics about checkpoints: age, states, verification, bytes, restores."""
    import time

    from prometheus_client import CollectorRegistry, start_http_server

    from ckptflow.report import StoreCollector

    fleet = _fleet(_fleet_path(fleet_file, legacy))
    reg = CollectorRegistry()
    reg.register(StoreCollector(fleet))
    from ckptflow.demo.launch import require_free_port

    require_free_port(port, host)   # a taken port: one line naming it, not the socket's errno
    try:
        start_http_server(port, addr=host, registry=reg)
    except OSError as e:   # an address this machine does not have, or a port taken since the check
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}",
                          fix="pass --host with an address of this machine and a free --port") from None
    console.print(f"serving ckptflow metrics on http://{host}:{port}/metrics")
    while True:
        time.sleep(3600)


def _table(title: str, rows: list[dict], cols: tuple[str, ...]) -> None:
    table = Table(title=title)
    for col in cols:
        table.add_column(col)
    for r in rows:
        table.add_row(*(str(r.get(c) if r.get(c) is not None else "-") for c in cols))
    console.print(table)


@app.command()
def verify(fleet_file: Path = FLEET_ARG, workload: list[str] = typer.Option(None, help="Only these workloads."),
           node: str = typer.Option(None, help="Only the workloads running on this node now.")) -> None:
    """Run the verify flow once: sandbox-restore the newest unverified checkpoints."""
    from ckptflow.models import VerifyOutcome

    _fleet(fleet_file, workload, nodes=[node] if node else None)
    rows = _flow("ckptflow.flows.verify", "verify")(str(fleet_file), workloads=workload or None, node=node)
    _table("verify", rows, ("workload", "checkpoint", "state", "reason"))
    if any(r["state"] == VerifyOutcome.verify_failed for r in rows):
        raise typer.Exit(1)


@app.command()
def turns(fleet_file: Path = FLEET_ARG, workload: str = typer.Argument(..., help="A template-sessions workload."),
          every: float = typer.Option(2.0, min=0.05, help="Seconds between looks at the engine's sessions "
                                      "(shorter than the gap between a session's turns)."),
          duration: float = typer.Option(None, "--for", min=0.0, help="Stop after this many seconds "
                                         "(default: until interrupted).")) -> None:
    """Export a two-tier workload's sessions at their turn ends, on its node, beside the heartbeat."""
    from ckptflow.errors import ConfigError
    from ckptflow.runners.facts import node_mtbf_s
    from ckptflow.runners.modes import mode_runner
    from ckptflow.runners.template_sessions import TemplateSessionsMode
    from ckptflow.runners.turns import TurnWatch
    from ckptflow.tasks.common import node_runner

    fleet = _fleet(fleet_file, [workload])
    w = fleet.workload(workload)
    node = node_runner(fleet, w.node)
    mode = mode_runner(node, w)
    if not isinstance(mode, TemplateSessionsMode):
        raise ConfigError(f"workload {workload} is checkpointed as '{w.checkpoint}': only template-sessions "
                          "workloads export sessions", fix=f"declare 'checkpoint: template-sessions' on {workload}")
    spec = fleet.node(w.node)
    from ckptflow.fleet import load_fleet
    from ckptflow.tasks.common import tier

    watch = TurnWatch(mode.runner(), w, every_s=every, mtbf_s=node_mtbf_s(spec.mtbf_hours, spec.failures),
                      tier=tier(fleet), reload=lambda: load_fleet(fleet_file).workload(workload))

    def said(m) -> None:
        e = m.probe.export
        console.print(f"{m.id}: exported {', '.join(e.changed) or 'nothing new'} at turn end "
                      f"({e.moved_bytes / 2**20:.1f} MiB written)")

    with node:
        n = watch.run(duration_s=duration, on_checkpoint=said)
    console.print(f"{n} turn-end checkpoint(s) of {workload}")


@app.command()
def invalidate(fleet_file: Path = FLEET_ARG, node: str = typer.Option(None, help="This node's name.")) -> None:
    """Run the invalidate flow once: report this node's fingerprint, retire stale checkpoints."""
    _fleet(fleet_file, nodes=[node])
    out = _flow("ckptflow.flows.invalidate", "invalidate")(str(fleet_file), node=node)
    console.print(f"{len(out['invalidated'])} checkpoint(s) invalidated, {out['alerts']} alert(s), "
                  f"{len(out['deleted'])} deleted by retention")


@app.command()
def deploy(fleet_file: Path = FLEET_ARG,
           render_only: bool = typer.Option(False, "--render-only", help="Only write the files below, for review."),
           ephemeral: bool = typer.Option(False, "--ephemeral", help="Deploy without PREFECT_API_URL, into a "
                                          "temporary local Prefect server that is gone when this command exits."),
           workdir: Path = typer.Option(None, "--workdir", help="The project directory flow runs and node workers "
                                        "start in, the same path on every node (default: the current directory)."),
           image: str = typer.Option(None, "--image", help="Container image of the DaemonSet (holds the project "
                                     "at --workdir; default ckptflow:<version>)."),
           api_url: str = typer.Option(None, "--api-url", help="The Prefect API URL as the nodes reach it, written into "
                                       "every node's unit and DaemonSet (default: this shell's PREFECT_API_URL; a "
                                       "loopback one is refused for nodes on other machines)."),
           all_nodes_here: bool = typer.Option(False, "--all-nodes-here", help="Every node of the fleet runs on "
                                               "this machine (a one-box fleet): a loopback API URL is then right."),
           worker_query_seconds: float = typer.Option(
               None, "--worker-query-seconds", help="How often each node's Prefect worker asks the server for flow "
               "runs, written into every unit and DaemonSet (PREFECT_WORKER_QUERY_SECONDS; default: the fleet "
               "file's worker_query_seconds, 1 s). A migrate's steps wait up to this long to start.")
           ) -> None:
    """Render prefect.<fleet>.yaml beside the fleet file and deploy it to the Prefect server; render
    each node's Prefect worker as a systemd unit and a Kubernetes DaemonSet (<fleet>.workers/)."""
    from ckptflow.deploy import API_URL_PLACEHOLDER, deploy as run, render_node_workers, render_prefect_yaml
    from ckptflow.deploy import worker_files

    fleet = _fleet(fleet_file)
    from ckptflow.deploy import check_api_url, check_worker_query_s, prefect_api_url

    check_api_url(fleet, api_url or prefect_api_url(), api_url is not None, all_nodes_here)  # before any file
    if worker_query_seconds is not None:
        check_worker_query_s(worker_query_seconds)
    if render_only:
        out = render_prefect_yaml(fleet_file, workdir)
        workers = render_node_workers(fleet_file, workdir, api_url=api_url, image=image, all_nodes_here=all_nodes_here,
                                      worker_query_s=worker_query_seconds)
    else:
        out = run(fleet_file, ephemeral=ephemeral, workdir=workdir, image=image, api_url=api_url,
                  all_nodes_here=all_nodes_here, worker_query_s=worker_query_seconds)
        workers = worker_files(fleet_file, fleet)
    # Plain lines, not rich: paths are long and an operator copies them whole.
    typer.echo(f"{'rendered' if render_only else 'deployed'} {out}")
    units, (ds,) = workers["systemd"], workers["kubernetes"]
    for unit in [*units, *workers.get("turns", [])]:  # a turn-end exporter beside each two-tier workload
        typer.echo(f"rendered {unit}")
    typer.echo(f"rendered {ds} ({len({n.work_pool for n in fleet.nodes})} DaemonSets, one per node pool)")
    for p in workers.get("pods", []):  # pod workloads: rbac.yaml, restore/<workload>.yaml (docs/kubernetes.md)
        typer.echo(f"rendered {p}")
    if API_URL_PLACEHOLDER in units[0].read_text():
        typer.echo(f"warning: PREFECT_API_URL is not set: the node workers name {API_URL_PLACEHOLDER}; "
                   "pass --api-url and render again", err=True)
    elif not api_url:  # said, not copied without a word
        typer.echo(f"note: the node workers reach Prefect at {prefect_api_url()} (this shell's PREFECT_API_URL; "
                   "--api-url to choose)", err=True)


@app.command()
def simulate(seed: int = typer.Option(0, min=0, help="Trace seed."),
             failures: str = typer.Option("exponential", help="exponential or weibull"),
             profile: str = typer.Option("process-h200", help="Cost profile: process-h200 (whole-process "
                                         "checkpoints) or two-tier-h200 (template + sessions)."),
             as_json: bool = typer.Option(False, "--json", help="Print JSON: {policies: {name: {cost, ...}}}.")) -> None:
    """Replay the reference fleet trace under every policy (what-if simulator)."""
    import json

    from ckptflow.sim import PROFILES, profile_config, simulate as run

    if failures not in ("exponential", "weibull"):
        raise typer.BadParameter(f"must be exponential or weibull, not {failures!r}", param_hint="--failures")
    if profile not in PROFILES:
        raise typer.BadParameter(f"must be one of {', '.join(PROFILES)}, not {profile!r}", param_hint="--profile")
    out = run(seed, profile_config(profile, failure_dist=failures))
    if as_json:
        print(json.dumps(out, indent=1))
        return
    table = Table(title=f"policies on the reference trace (seed {seed}, {failures} failures, {profile}), "
                        f"GPU-hours / 30 days; bytes written at {out['bytes_s_per_gib']:.2f} GPU-s per GiB")
    for col in ("policy", "GPU cost", "bytes cost", "total", "lost", "pause", "checkpoints", "TiB written"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    for name, p in sorted(out["policies"].items(), key=lambda kv: kv[1]["cost"]):
        table.add_row(name, f"{p['gpu_cost'] / 3600:,.1f}", f"{p['bytes_cost'] / 3600:,.1f}",
                      f"{p['cost'] / 3600:,.1f}", f"{p['lost_gpu_s'] / 3600:,.1f}",
                      f"{p['pause_gpu_s'] / 3600:,.1f}", f"{p['checkpoints']:,.0f}", f"{p['bytes'] / 2**40:,.1f}")
    console.print(table)
    console.print(out["notes"]["never"], highlight=False, soft_wrap=True)


@app.command()
def heartbeat(fleet_file: Path = FLEET_ARG, node: str = typer.Option(None, help="Only this node's workloads."),
              workload: list[str] = typer.Option(None, help="Only these workloads."),
              force: bool = typer.Option(False, help="Checkpoint every selected workload, whatever the policy.")) -> None:
    """Run the heartbeat flow once: decide per workload, checkpoint those due (leave running).
    Without a Prefect server configured it runs here, in this process, without a flow run."""
    _fleet(fleet_file, workload, [node])
    # Without a Prefect server configured: here, without a flow run (no temporary server first).
    flow = _flow("ckptflow.flows.heartbeat", "heartbeat" if prefect_api_configured() else "heartbeat_here")
    try:
        rows = flow(str(fleet_file), node=node, workloads=workload or None, force=force)
    except HeartbeatFailed as e:
        # Each failure's error is the error line below: the table says what happened, not that again.
        rows = [r if r["ok"] else {**r, "reason": _without(r["reason"], r.get("error"))} for r in e.rows]
        _table("heartbeat", rows, ("workload", "decision", "checkpoint", "reason"))
        _print_error(e.message, e.fix)
        raise typer.Exit(1)
    _table("heartbeat", rows, ("workload", "decision", "checkpoint", "reason"))


def _without(reason: str | None, error: str | None) -> str | None:
    """``reason`` without the ``error`` it ends with ("worker gone: <error>" is "worker gone").

        >>> _without("worker gone: pid file w.pid does not exist", "pid file w.pid does not exist")
        'worker gone'
    """
    if reason and error and reason.endswith(error) and reason != error:
        return reason[:-len(error)].rstrip(" :;")
    return reason


@app.command()
def recover(fleet_file: Path = FLEET_ARG, workload: str = typer.Argument(..., help="Workload to bring back."),
            node: str = typer.Option(None, help="Restore on this node (default: the workload's own).")) -> None:
    """Run the recover flow for one lost workload (nearest valid copy: the node's, else S3).
    Without a Prefect server configured it runs here, in this process, without Prefect: the
    worker first (a temporary server would take ~12 s to start before it is touched)."""
    _fleet(fleet_file, [workload], [node])
    if prefect_api_configured():
        res = _flow("ckptflow.flows.recover", "recover")(str(fleet_file), workload, node=node)
    else:
        from ckptflow.recovery import recover_here

        res = recover_here(str(fleet_file), workload, node=node)
    if res["cold_start"]:
        console.print(f"cold started {workload} on {res['node']}: PID {res['pid']} in {res['cold_start_s']:.1f} s")
    else:
        console.print(f"restored {workload} on {res['node']} from {res['checkpoint']}: PID {res['pid']}")


@app.command()
def prune(fleet_file: Path = FLEET_ARG) -> None:
    """Apply retention in the fleet's S3 bucket and delete chunks no manifest references."""
    from ckptflow.store import has_shared_tier

    fleet = _fleet(fleet_file)
    if not has_shared_tier(fleet.storage):  # said before a Prefect server is started for nothing
        typer.echo(f"prune: nothing to do: storage.kind {fleet.storage.kind.value} has no shared tier "
                   "(the invalidate flow applies retention in each node's store)")
        return
    res = _flow("ckptflow.flows.prune", "prune")(str(fleet_file))
    if "skipped" in res:
        typer.echo(f"prune skipped: {res['skipped']}")
        return
    typer.echo(f"pruned {fleet.storage.kind.value} tier: {len(res['manifests_deleted'])} manifest(s) past retention, "
               f"{res['chunks_deleted']} chunk(s) nothing names, {res['bytes_freed'] / 2**20:.1f} MiB freed")


@app.command("recover-node")
def recover_node(fleet_file: Path = FLEET_ARG, node: str = typer.Argument(..., help="The lost node.")) -> None:
    """Bring every workload of a lost node back on other nodes (from S3, or a cold start)."""
    _fleet(fleet_file, nodes=[node])
    # The flow fails (NotRecovered) when a workload did not come back; the table of every row
    # is still worth printing, so the flow's return value is taken from its state.
    state = _flow("ckptflow.flows.recover", "recover_node")(str(fleet_file), node, return_state=True)
    try:
        rows, failed = state.result(), None
    except NotRecovered as e:
        rows, failed = getattr(e, "rows", []), e
    _table(f"recovery of {node}", rows, ("workload", "action", "target", "reason"))
    if failed is not None:
        _print_error(failed.message, failed.fix)
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
