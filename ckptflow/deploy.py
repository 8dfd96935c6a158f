"""`ckptflow deploy FLEET`: render prefect.yaml beside the fleet file, then `prefect deploy` it.

One deployment per flow, and per node for the flows whose steps must run on that node
(heartbeat, invalidate, verify, node-step), each on the node's process work pool. The
fleet-level flows (migrate, drain, scale-up/-down, recover, recover-node) run on the control
pool (the first node's) and start node steps with run_deployment; a step's result travels
back through Prefect's result storage, which for an S3 fleet is an ``S3Bucket`` block
(prefect-aws) on the fleet's bucket — nodes share no disk.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ckptflow.errors import ConfigError
from ckptflow.fleet import load_fleet
from ckptflow.render import env


def _schedule(s) -> str:
    return f"{{interval: {s.interval_s}}}" if s.interval_s else f"{{cron: \"{s.cron}\", timezone: UTC}}"


def results_block_name(fleet) -> str | None:
    """The S3Bucket block holding flow results of an S3 fleet (None for local storage)."""
    if fleet.storage.kind.value != "s3":
        return None
    return "ckptflow-results-" + re.sub(r"[^a-z0-9-]", "-", fleet.fleet)


def save_results_block(fleet) -> str:
    """Create (or update) the fleet's results block; credentials are not stored in it — each
    worker's boto3 finds its own (environment, instance profile), as the S3 tier does."""
    from prefect_aws import AwsClientParameters, AwsCredentials, S3Bucket

    st = fleet.storage
    name = results_block_name(fleet)
    S3Bucket(bucket_name=st.bucket, bucket_folder=f"{st.prefix}/prefect-results",
             credentials=AwsCredentials(region_name=st.region or "us-east-1",
                                        aws_client_parameters=AwsClientParameters(endpoint_url=st.endpoint_url)),
             ).save(name, overwrite=True)
    return name


def prefect_api_url() -> str | None:
    """The Prefect API the deployments would go to: PREFECT_API_URL from the environment or the
    active Prefect profile; None means Prefect would start a temporary server."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def render_prefect_yaml(fleet_file: Path, workdir: str = "{{ $PWD }}") -> Path:
    """Write ``prefect.<fleet>.yaml`` beside the fleet file; return its path."""
    fleet = load_fleet(fleet_file)
    out = fleet_file.with_name(f"prefect.{fleet.fleet}.yaml")
    nodes = {n.name: [w.name for w in fleet.workloads if w.node == n.name] for n in fleet.nodes}
    block = results_block_name(fleet)
    results = {"PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": f"s3-bucket/{block}"} if block else {}
    text = env().get_template("prefect.yaml.j2").render(
        fleet=fleet, fleet_file=str(fleet_file), out_name=out.name, workdir=workdir,
        control_pool=fleet.control_pool or fleet.nodes[0].work_pool, node_workloads=nodes, schedule=_schedule,
        node_env={"CKPTFLOW_NODE_LIMITS": "1", **results}, control_env=results)
    out.write_text(text)
    return out


def deploy(fleet_file: Path, *, create_pools: bool = True, ephemeral: bool = False) -> Path:
    """Render, create each node's process work pool if missing, run `prefect deploy --all`.

    Raises:
        ConfigError: no Prefect server is configured (PREFECT_API_URL) and ``ephemeral`` is not
            set: the deployments would go into a temporary server that vanishes on exit.
    """
    if not ephemeral and not prefect_api_url():
        raise ConfigError("PREFECT_API_URL is not set: the deployments would go into a temporary Prefect server "
                          "that is gone when this command exits",
                          fix="export PREFECT_API_URL=http://<prefect-server>:4200/api (or `prefect config set "
                              "PREFECT_API_URL=...`), or pass --ephemeral to deploy into a throwaway server on purpose")
    out = render_prefect_yaml(fleet_file)
    fleet = load_fleet(fleet_file)
    prefect = [sys.executable, "-m", "prefect", "--no-prompt"]
    if create_pools:
        for pool in sorted({n.work_pool for n in fleet.nodes} | ({fleet.control_pool} - {None})):
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
    if results_block_name(fleet):
        save_results_block(fleet)
    res = subprocess.run([*prefect, "deploy", "--all", "--prefect-file", str(out)], capture_output=True, text=True)
    if res.returncode != 0:
        raise ConfigError(f"prefect deploy of {out} failed:\n{(res.stdout + res.stderr)[-3000:]}",
                          fix="check PREFECT_API_URL points at your Prefect server")
    return out
