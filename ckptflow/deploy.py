"""`ckptflow deploy FLEET`: render prefect.yaml beside the fleet file, then `prefect deploy` it;
and render what runs each node's Prefect worker in production.

One deployment per flow, and per node for the flows whose steps must run on that node
(heartbeat, invalidate, verify, node-step), each on the node's process work pool. The
fleet-level flows (migrate, drain, scale-up/-down, recover, recover-node) run on the control
pool (the first node's) and start node steps with run_deployment; a step's result travels
back through Prefect's result storage, which for an S3 fleet is an ``S3Bucket`` block
(prefect-aws) on the fleet's bucket — nodes share no disk.

Every flow run starts in the project directory (``--workdir``, default: where deploy runs):
prefect.yaml's pull step enters it, and each node's worker — a systemd unit per node
(``<fleet>.workers/systemd/``) or a privileged DaemonSet per node pool
(``<fleet>.workers/kubernetes/daemonset.yaml``) — runs there. Deploy refuses a directory that
does not hold the project, so the assumption is written down once and checked.

Example:
    $ ckptflow deploy deployments/example-h200-fleet.yaml --render-only
    rendered deployments/prefect.example-h200.yaml
    rendered deployments/example-h200.workers/systemd/ckptflow-prefect-worker-<node>.service (8 systemd units)
    rendered deployments/example-h200.workers/kubernetes/daemonset.yaml (8 DaemonSets, one per node pool)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ckptflow.errors import ConfigError
from ckptflow.fleet import load_fleet
from ckptflow.render import env

# The flow files prefect.yaml's entrypoints name (templates/prefect.yaml.j2): a directory holds
# the project when every one of them is there.
FLOW_FILES = tuple(f"ckptflow/flows/{m}.py" for m in
                   ("heartbeat", "invalidate", "verify", "node_step", "migrate", "recover", "prune"))
K8S_NAMESPACE = "ckptflow"
# PATH of a node worker: the project's venv, the system, then a relocatable CRIU bundle, so a
# system CRIU wins and a node without one uses the bundle (runners.criu.BUNDLE_CANDIDATES).
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
API_URL_PLACEHOLDER = "http://PREFECT-SERVER:4200/api"
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def check_workdir(workdir: Path | str | None = None) -> Path:
    """The project directory every flow run and node worker starts in, made absolute.

    Raises:
        ConfigError: it does not hold the project (a flow file of prefect.yaml is missing), or
            its path has whitespace (systemd and Prefect's pull step take it unquoted).
    """
    wd = Path(workdir or Path.cwd()).expanduser().resolve()
    missing = [f for f in FLOW_FILES if not (wd / f).is_file()]
    if missing:
        raise ConfigError(f"{wd} does not hold the ckptflow project (no {missing[0]}): every flow run and node "
                          "worker starts in this directory",
                          fix="run `ckptflow deploy` from the repository root, or pass --workdir DIR: the directory "
                              "holding the project, at the same path on every node")
    if any(c.isspace() for c in str(wd)):
        raise ConfigError(f"{wd}: the project directory's path holds whitespace",
                          fix="move the project to a path without spaces (systemd units and prefect.yaml name it bare)")
    return wd


def _fleet_param(fleet_file: Path, wd: Path) -> str:
    """The fleet file as the flow runs will open it: relative to the project directory when
    inside it, else absolute (then it must exist at that path on every node)."""
    f = fleet_file.resolve()
    return str(f.relative_to(wd)) if f.is_relative_to(wd) else str(f)


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


def render_prefect_yaml(fleet_file: Path, workdir: Path | str | None = None) -> Path:
    """Write ``prefect.<fleet>.yaml`` beside the fleet file; return its path.

    Raises:
        ConfigError: ``workdir`` (default: the current directory) does not hold the project.
    """
    wd = check_workdir(workdir)
    fleet = load_fleet(fleet_file)
    out = fleet_file.with_name(f"prefect.{fleet.fleet}.yaml")
    nodes = {n.name: [w.name for w in fleet.workloads if w.node == n.name] for n in fleet.nodes}
    block = results_block_name(fleet)
    results = {"PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": f"s3-bucket/{block}"} if block else {}
    text = env().get_template("prefect.yaml.j2").render(
        fleet=fleet, fleet_file=_fleet_param(fleet_file, wd), out_name=out.name, workdir=str(wd),
        control_pool=fleet.control_pool or fleet.nodes[0].work_pool, node_workloads=nodes, schedule=_schedule,
        node_env={"CKPTFLOW_NODE_LIMITS": "1", **results}, control_env=results)
    out.write_text(text)
    return out


def worker_files(fleet_file: Path, fleet, out_dir: Path | None = None) -> dict[str, list[Path]]:
    """Where render_node_workers writes: {"systemd": [a unit per node], "kubernetes": [daemonset.yaml]}."""
    d = Path(out_dir) if out_dir else fleet_file.with_name(f"{fleet.fleet}.workers")
    return {"systemd": [d / "systemd" / f"ckptflow-prefect-worker-{n.name}.service" for n in fleet.nodes],
            "kubernetes": [d / "kubernetes" / "daemonset.yaml"]}


def render_node_workers(fleet_file: Path, workdir: Path | str | None = None, api_url: str | None = None,
                        image: str | None = None, out_dir: Path | None = None) -> dict[str, list[Path]]:
    """Write what runs each node's Prefect worker: a systemd unit per node and a privileged
    DaemonSet per node pool, into ``<fleet>.workers/`` beside the fleet file (or ``out_dir``).

    Both run ``prefect worker start --pool <the node's pool>`` as root in the project directory,
    with PREFECT_API_URL (``api_url``, default: this shell's, else a placeholder to replace) and
    CKPTFLOW_NODE; the unit restarts always and its stop leaves what the flows started running;
    the DaemonSet has hostPID, privileged, /dev/shm and the node's store mounted.

    Returns:
        {"systemd": [unit files], "kubernetes": [daemonset.yaml]}.

    Raises:
        ConfigError: ``workdir`` does not hold the project, or a work pool's name cannot be a
            Kubernetes label value.
    """
    wd = check_workdir(workdir)
    fleet = load_fleet(fleet_file)
    api_url = api_url or prefect_api_url() or API_URL_PLACEHOLDER
    image = image or f"ckptflow:{_version()}"
    files = worker_files(fleet_file, fleet, out_dir)
    path = f"{wd}/.venv/bin:{_SYSTEM_PATH}:{wd}/.carry/criu/bin:/opt/ckptflow/criu/bin"
    pools: dict[str, list] = {}
    for n in fleet.nodes:
        pools.setdefault(n.work_pool, []).append(n)
    for pool in pools:
        if not _LABEL_VALUE.match(pool):
            raise ConfigError(f"work pool {pool!r} cannot be a Kubernetes label value (the DaemonSet's node selector)",
                              fix="name work pools with up to 63 letters, digits, '-', '_' or '.', "
                                  "starting and ending with a letter or digit")

    def store_paths(nodes) -> list[str]:
        return sorted({str(wd / fleet.storage.path.replace("{node}", n.name)) for n in nodes})

    ctx = dict(fleet=fleet, fleet_file=_fleet_param(fleet_file, wd), workdir=str(wd), api_url=api_url,
               path=path, control_pool=fleet.control_pool or fleet.nodes[0].work_pool)
    units, (ds,) = files["systemd"], files["kubernetes"]
    units[0].parent.mkdir(parents=True, exist_ok=True)
    for stale in set(units[0].parent.glob("ckptflow-prefect-worker-*.service")) - set(units):
        stale.unlink()  # a node no longer in the fleet file
    for n, unit in zip(fleet.nodes, units):
        unit.write_text(env().get_template("systemd/prefect-worker.service.j2").render(
            node=n, unit_name=unit.name, **ctx))
    ds.parent.mkdir(parents=True, exist_ok=True)
    ds.write_text(env().get_template("kubernetes/daemonset.yaml.j2").render(
        pools=list(pools.items()), namespace=K8S_NAMESPACE, image=image, out_name=ds.name,
        ds_name=lambda pool: "ckptflow-prefect-worker-" + re.sub(r"[^a-z0-9-]", "-", pool.lower()).strip("-"),
        store_paths=store_paths, **ctx))
    return files


def _version() -> str:
    import ckptflow

    return ckptflow.__version__


def deploy(fleet_file: Path, *, create_pools: bool = True, ephemeral: bool = False,
           workdir: Path | str | None = None, image: str | None = None) -> Path:
    """Render, create each node's process work pool if missing, run `prefect deploy --all`.

    Raises:
        ConfigError: no Prefect server is configured (PREFECT_API_URL) and ``ephemeral`` is not
            set: the deployments would go into a temporary server that vanishes on exit; or
            ``workdir`` does not hold the project.
    """
    if not ephemeral and not prefect_api_url():
        raise ConfigError("PREFECT_API_URL is not set: the deployments would go into a temporary Prefect server "
                          "that is gone when this command exits",
                          fix="export PREFECT_API_URL=http://<prefect-server>:4200/api (or `prefect config set "
                              "PREFECT_API_URL=...`), or pass --ephemeral to deploy into a throwaway server on purpose")
    out = render_prefect_yaml(fleet_file, workdir)
    render_node_workers(fleet_file, workdir, image=image)
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
