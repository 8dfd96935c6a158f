"""`ckptflow deploy FLEET`: render prefect.yaml beside the fleet file, then `prefect deploy` it.

One deployment per flow, and per node for the flows whose steps must run on that node
(heartbeat, invalidate, verify, node-step), each on the node's process work pool. The
fleet-level flows (migrate, drain, recover) run on the control pool (the first node's).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ckptflow.errors import ConfigError
from ckptflow.fleet import load_fleet
from ckptflow.render import env


def _schedule(s) -> str:
    return f"{{interval: {s.interval_s}}}" if s.interval_s else f"{{cron: \"{s.cron}\", timezone: UTC}}"


def render_prefect_yaml(fleet_file: Path, workdir: str = "{{ $PWD }}") -> Path:
    """Write ``prefect.<fleet>.yaml`` beside the fleet file; return its path."""
    fleet = load_fleet(fleet_file)
    out = fleet_file.with_name(f"prefect.{fleet.fleet}.yaml")
    nodes = {n.name: [w.name for w in fleet.workloads if w.node == n.name] for n in fleet.nodes}
    text = env().get_template("prefect.yaml.j2").render(
        fleet=fleet, fleet_file=str(fleet_file), out_name=out.name, workdir=workdir,
        control_pool=fleet.nodes[0].work_pool, node_workloads=nodes, schedule=_schedule)
    out.write_text(text)
    return out


def deploy(fleet_file: Path, *, create_pools: bool = True) -> Path:
    """Render, create each node's process work pool if missing, run `prefect deploy --all`."""
    out = render_prefect_yaml(fleet_file)
    fleet = load_fleet(fleet_file)
    prefect = [sys.executable, "-m", "prefect", "--no-prompt"]
    if create_pools:
        for pool in sorted({n.work_pool for n in fleet.nodes}):
            got = subprocess.run([*prefect, "work-pool", "inspect", pool], capture_output=True, text=True)
            if got.returncode != 0:
                subprocess.run([*prefect, "work-pool", "create", pool, "--type", "process"], check=True,
                               capture_output=True, text=True)
        for n in fleet.nodes:  # one checkpoint or restore per node at a time (see tasks.common.node_slot)
            name = f"ckptflow-node-{n.name}"
            got = subprocess.run([*prefect, "global-concurrency-limit", "inspect", name], capture_output=True, text=True)
            if got.returncode != 0:
                subprocess.run([*prefect, "global-concurrency-limit", "create", name, "--limit", "1"], check=True,
                               capture_output=True, text=True)
    res = subprocess.run([*prefect, "deploy", "--all", "--prefect-file", str(out)], capture_output=True, text=True)
    if res.returncode != 0:
        raise ConfigError(f"prefect deploy of {out} failed:\n{(res.stdout + res.stderr)[-3000:]}",
                          fix="check PREFECT_API_URL points at your Prefect server")
    return out
