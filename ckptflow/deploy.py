"""`ckptflow deploy FLEET`: render prefect.yaml beside the fleet file, then deploy what it says
through Prefect's Python client; and render what runs each node's Prefect worker in production.

One deployment per flow, and per node for the flows whose steps must run on that node
(heartbeat, invalidate, verify, node-step), each on the node's process work pool and named
``<fleet>:<node>`` (``node_deployment``: one Prefect server holds many fleets, and two of them
may both have a ``node-a``). The fleet-level flows, named ``<fleet>`` (migrate, drain,
scale-up/-down, recover, recover-node, prune), run on the control pool (the first node's) and
start node steps with run_deployment; a step's result travels back through Prefect's result
storage, a block on the fleet's own object store registered for its ``storage.kind``
(``register_result_storage``; S3: an ``S3Bucket`` block of prefect-aws on the fleet's bucket)
— nodes share no disk.

Every flow run starts in the project directory (``--workdir``, default: where deploy runs):
prefect.yaml's pull step enters it, and each node's worker — a systemd unit per node
(``<fleet>.workers/systemd/``) or a privileged DaemonSet per node pool
(``<fleet>.workers/kubernetes/daemonset.yaml``) — runs there. Deploy refuses a directory that
does not hold the project, so the assumption is written down once and checked.

Example:
    $ ckptflow deploy deployments/example-h200-fleet.yaml --render-only
    rendered deployments/prefect.example-h200.yaml
    rendered deployments/example-h200.workers/systemd/ckptflow-prefect-worker-example-h200-h200-01.service
    ...
    rendered deployments/example-h200.workers/systemd/ckptflow-prefect-worker-example-h200-h200-08.service
    rendered deployments/example-h200.workers/kubernetes/daemonset.yaml (8 DaemonSets, one per node pool)
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

import yaml

from ckptflow.container_models import url_problem
from ckptflow.errors import ConfigError
# WORKER_QUERY_S: how often each node's worker asks the server for flow runs
# (PREFECT_WORKER_QUERY_SECONDS) unless the fleet file or `deploy --worker-query-seconds` says.
from ckptflow.fleet import WORKER_QUERY_S, load_fleet, node_deployment
from ckptflow.registry import RESULT_STORAGES
from ckptflow.render import env

# The flow files prefect.yaml's entrypoints name (templates/prefect.yaml.j2): a directory holds
# the project when every one of them is there.
FLOW_FILES = tuple(f"ckptflow/flows/{m}.py" for m in
                   ("heartbeat", "invalidate", "verify", "node_step", "migrate", "drain", "scale", "recover", "prune"))
K8S_NAMESPACE = "ckptflow"
# PATH of a node worker: the project's venv, the system, then a relocatable CRIU bundle, so a
# system CRIU wins and a node without one uses the bundle (runners.criu.BUNDLE_CANDIDATES).
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
API_URL_PLACEHOLDER = "http://PREFECT-SERVER:4200/api"
API_URL_EXAMPLE = "http://prefect.internal:4200/api"  # what a refused --api-url is shown to look like
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
NODE_LIMIT = "ckptflow-node-{node}"  # one checkpoint or restore per node at a time (tasks.common.node_slot)

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.deployments.runner import RunnerDeployment


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


@dataclass(frozen=True)
class ResultStorage:
    """Where Prefect keeps the flow results of a fleet on one ``storage.kind``: a block of the
    Prefect integration for that store, on the fleet's bucket."""

    block_type: str                  # the block type's slug: PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK=<slug>/<name>
    build: Callable[[Any], Any]      # storage -> the (unsaved) block; imports its integration itself


# The registry's own dict (registry.RESULT_STORAGES, keyed by storage.kind; only deploy reads it).
RESULT_STORAGE: dict[str, ResultStorage] = RESULT_STORAGES.entries


def register_result_storage(kind: str, block_type: str, build: Callable[[Any], Any]) -> None:
    """Make ``ckptflow deploy`` keep the flow results of a ``storage.kind: <kind>`` fleet in
    ``build(storage)``, a Prefect block of type ``block_type`` saved as ``ckptflow-results-<fleet>``.
    A kind with a shared tier and none registered is refused for a fleet with remote nodes
    (``check_result_storage``). Registering a kind again replaces it.

    Example:
        >>> register_result_storage("gcs", "gcs-bucket", lambda st: __import__("prefect_gcp").GcsBucket(
        ...     bucket=st.bucket, bucket_folder=f"{st.prefix}/prefect-results"))   # doctest: +SKIP
    """
    RESULT_STORAGES.add(kind, ResultStorage(block_type, build))


def _s3_bucket(st) -> Any:
    """Credentials are not stored in the block: each worker's boto3 finds its own (environment,
    instance profile), as the S3 tier does."""
    from prefect_aws import AwsClientParameters, AwsCredentials, S3Bucket

    return S3Bucket(bucket_name=st.bucket, bucket_folder=f"{st.prefix}/prefect-results",
                    credentials=AwsCredentials(region_name=st.region or "us-east-1",
                                               aws_client_parameters=AwsClientParameters(endpoint_url=st.endpoint_url)))


register_result_storage("s3", "s3-bucket", _s3_bucket)


def _kind(fleet) -> str:
    return getattr(fleet.storage.kind, "value", fleet.storage.kind)


def results_block_name(fleet) -> str | None:
    """The block holding the fleet's flow results (None where its kind registers none, e.g.
    ``local``: Prefect's default, the worker's own disk)."""
    if _kind(fleet) not in RESULT_STORAGES:
        return None
    return "ckptflow-results-" + re.sub(r"[^a-z0-9-]", "-", fleet.fleet)


def results_env(fleet) -> dict[str, str]:
    """The environment that points a deployment's flow runs at the fleet's results block."""
    name = results_block_name(fleet)
    if name is None:
        return {}
    return {"PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": f"{RESULT_STORAGES.lookup(_kind(fleet)).block_type}/{name}"}


def save_results_block(fleet) -> str:
    """Create (or update) the fleet's results block; its name."""
    name = results_block_name(fleet)
    RESULT_STORAGES.lookup(_kind(fleet)).build(fleet.storage).save(name, overwrite=True)
    return name


def check_result_storage(fleet, all_nodes_here: bool = False) -> None:
    """Refuse a fleet whose steps run on other machines when its kind has a shared tier but no
    result storage: a node step's result would stay on that node's disk, where the fleet flow
    that started it cannot read it.

    Raises:
        ConfigError: naming the kind and the registration that fixes it.
    """
    from ckptflow.store import has_shared_tier

    remote = [] if all_nodes_here else remote_nodes(fleet)
    if remote and results_block_name(fleet) is None and has_shared_tier(fleet.storage):
        raise ConfigError(f"storage.kind {_kind(fleet)} registers no result storage, and node {remote[0]} is another "
                          "machine: its steps' results would stay on its own disk, where the fleet flows cannot read them",
                          fix=f"register one: ckptflow.deploy.register_result_storage({_kind(fleet)!r}, <block type slug>, "
                              "<storage -> Prefect block on the fleet's bucket>), or pass --all-nodes-here when every "
                              "node runs on this machine")


def shared_tier_warning(fleet) -> str | None:
    """The warning for a fleet of several nodes on a kind without a shared tier (``local``): it
    deploys, and each node checkpoints and recovers in place, but migrate, drain and recover-node
    refuse to move a workload between its nodes. None when that does not apply."""
    from ckptflow.store import has_shared_tier

    if len(fleet.nodes) < 2 or has_shared_tier(fleet.storage):
        return None
    return (f"warning: fleet {fleet.fleet} has {len(fleet.nodes)} nodes and storage.kind {_kind(fleet)} has no shared "
            "tier: migrate, drain and recover-node cannot move workloads between its nodes (fix: set storage.kind "
            "to s3 or another shared tier)")


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
    if warning := shared_tier_warning(fleet):
        # Here, where both `ckptflow deploy` and its --render-only pass: once each, before the
        # deployments exist, and never a refusal (each node still checkpoints in place).
        print(warning, file=sys.stderr)
    out = fleet_file.with_name(f"prefect.{fleet.fleet}.yaml")
    nodes = {n.name: [w.name for w in fleet.workloads if w.node == n.name] for n in fleet.nodes}
    results = results_env(fleet)
    text = env().get_template("prefect.yaml.j2").render(
        fleet=fleet, fleet_file=_fleet_param(fleet_file, wd), out_name=out.name, workdir=str(wd),
        control_pool=fleet.control_pool or fleet.nodes[0].work_pool, node_workloads=nodes, schedule=_schedule,
        node_deployment=node_deployment, node_env={"CKPTFLOW_NODE_LIMITS": "1", **results}, control_env=results)
    out.write_text(text)
    return out


def worker_files(fleet_file: Path, fleet, out_dir: Path | None = None) -> dict[str, list[Path]]:
    """Where render_node_workers writes: {"systemd": [a unit per node], "kubernetes": [daemonset.yaml]}."""
    d = Path(out_dir) if out_dir else fleet_file.with_name(f"{fleet.fleet}.workers")
    # The fleet in every unit name: node and workload names are only unique within a fleet, and
    # units of two fleets on one host share /etc/systemd/system (new-user trial, issue #36).
    return {"systemd": [d / "systemd" / f"ckptflow-prefect-worker-{fleet.fleet}-{n.name}.service" for n in fleet.nodes],
            "kubernetes": [d / "kubernetes" / "daemonset.yaml"],
            # a turn-end exporter beside each two-tier workload (ckptflow turns, runners/turns.py)
            "turns": [d / "systemd" / f"ckptflow-turns-{fleet.fleet}-{w.name}.service" for w in _two_tier(fleet)]}


def _two_tier(fleet) -> list:
    """The workloads a turn-end exporter runs beside, in fleet order (worker_files names their units)."""
    return [w for w in fleet.workloads if w.checkpoint == "template-sessions"]


# How often a turn-end exporter looks at its engine's sessions: below an agent's gap between
# turns (seconds), far above the cost of one look (a local HTTP GET).
TURN_POLL_S = 2

# A name's lookup that takes longer is a resolver not answering (getaddrinfo itself would wait
# resolv.conf's timeout times its attempts, 10 s and more): the name then counts as not loopback.
_RESOLVE_TIMEOUT_S = 2.0
# Paths every image has: a workload's command naming them needs no mount of the node's.
_IMAGE_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev", "/tmp")


def is_loopback(url: str) -> bool:
    """Whether ``url`` points at the machine it is used on: 127.0.0.0/8, ::1, 0.0.0.0, ::,
    ``localhost``, or a name all of whose addresses are those (say a host's own name in
    /etc/hosts). A name that does not resolve, or not within 2 s, is not loopback.

    Example:
        >>> is_loopback("http://localhost:4200/api"), is_loopback("http://10.0.0.5:4200/api")
        (True, False)
    """
    return loopback_addresses(url) is not None


def loopback_addresses(url: str) -> list[str] | None:
    """None when ``url``'s host is not loopback; else the addresses its name resolved to, [] for
    an address or ``localhost`` (nothing to explain).

    Example:
        >>> loopback_addresses("http://127.0.0.1:4200/api"), loopback_addresses("http://10.0.0.5/api")
        ([], None)
    """
    import ipaddress

    host = (urlsplit(url).hostname or "").lower()
    if not host:
        return None
    if host.rstrip(".") == "localhost":  # RFC 6761: loopback whatever the resolver says
        return []
    try:
        return [] if _is_here(ipaddress.ip_address(host)) else None
    except ValueError:
        pass
    addrs = _resolve(host)
    if addrs and all(_is_here(ipaddress.ip_address(a.split("%")[0])) for a in addrs):
        return addrs
    return None


def _is_here(ip) -> bool:
    """Loopback or unspecified (0.0.0.0, ::): wherever the URL is used, that machine itself."""
    ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1 is 127.0.0.1
    return ip.is_loopback or ip.is_unspecified


def _resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to; [] when it does not, or not within _RESOLVE_TIMEOUT_S."""
    import socket
    import threading

    got: list[str] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError):  # gaierror; a label idna refuses
            return
        got.extend(sorted({info[4][0] for info in infos}))

    # getaddrinfo takes no timeout: wait for it on a daemon thread, which a resolver that never
    # answers cannot keep alive past the command's exit.
    t = threading.Thread(target=lookup, name=f"resolve {host}", daemon=True)
    t.start()
    t.join(_RESOLVE_TIMEOUT_S)
    return [] if t.is_alive() else got


def remote_nodes(fleet) -> list[str]:
    """The fleet's nodes that are not this machine (named ``local``, this host's short name or
    $CKPTFLOW_NODE count as this machine)."""
    import socket

    from ckptflow.settings import settings

    here = {"local", socket.gethostname().split(".")[0].lower(), settings().node}
    return [n.name for n in fleet.nodes if n.name not in here]


def check_api_url(fleet, api_url: str | None, given: bool, all_nodes_here: bool = False) -> None:
    """Refuse a loopback Prefect API URL for node workers of nodes on other machines: there it
    would name the node itself, and its worker would never see a flow run. ``all_nodes_here``:
    the operator says every node of the fleet runs on this machine (a one-box fleet, tests).

    Raises:
        ConfigError: ``api_url`` is not an http(s) URL with a host, or it is loopback and a node is
            remote; ``given``: it came from --api-url (else from this shell's PREFECT_API_URL, which
            the message says).
    """
    where = "--api-url" if given else "this shell's PREFECT_API_URL"
    if api_url and not _is_http_url(api_url):  # rendered as it is, it would fail only on the nodes, at their start
        raise ConfigError(f"{where} {api_url!r} is not a URL: expected http(s)://<host>[:<port>]/api, e.g. "
                          f"{API_URL_EXAMPLE}", fix=f"pass the Prefect API URL as the nodes reach it, e.g. --api-url "
                          f"{API_URL_EXAMPLE}" + ("" if given else " (or correct PREFECT_API_URL)"))
    remote = [] if all_nodes_here else remote_nodes(fleet)
    addrs = loopback_addresses(api_url) if api_url and remote else None
    if addrs is not None:
        # A name is not visibly loopback: say what it resolved to here.
        why = f" ({urlsplit(api_url).hostname} resolves to {', '.join(addrs)} here)" if addrs else ""
        raise ConfigError(f"{where} {api_url} is a loopback address{why}: on node {remote[0]}"
                          + (f" (and {len(remote) - 1} more)" if len(remote) > 1 else "")
                          + " it would name that node itself, not the Prefect server",
                          fix=f"pass --api-url http://<the Prefect server, as the nodes reach it>:"
                              f"{urlsplit(api_url).port or 4200}{urlsplit(api_url).path or '/api'} (or "
                              "--all-nodes-here when every node of the fleet runs on this machine)")


def _is_http_url(url: str) -> bool:
    """Whether ``url`` is http(s) with a host (and a numeric port, when it has one).

        >>> _is_http_url("http://prefect.internal:4200/api"), _is_http_url("notaurl"), _is_http_url("http://")
        (True, False, False)
    """
    return url_problem(url) is None


def node_mounts(fleet, nodes, wd: Path) -> list[tuple[str, str]]:
    """Host directories a node pool's worker pod needs at the same paths, derived from the fleet
    file: each workload's pid file directory and the directories of the absolute paths its
    start_command names (models, logs, slot files), as (path, why). The checkpoint store and
    /dev/shm are mounted on their own; paths every image has (/usr, /etc, ...) are left out."""
    import shlex

    names = {n.name for n in nodes}
    found: dict[str, str] = {}
    for w in fleet.workloads:
        if w.node not in names:
            continue
        if w.find is not None and w.find.pid_file:
            found.setdefault(str((wd / w.find.pid_file).parent), f"pid file of {w.name}")
        for arg in w.start_command or []:
            try:
                tokens = shlex.split(arg) if any(c.isspace() for c in arg) else [arg]
            except ValueError:
                tokens = arg.split()
            for tok in tokens:
                path = tok.split("=", 1)[1] if tok.startswith("-") and "=" in tok else tok.lstrip("<>&12")
                if path.startswith("/") and not any(path == d or path.startswith(d + "/") for d in _IMAGE_DIRS):
                    found.setdefault(str(Path(path).parent), f"named by {w.name}'s start_command ({path})")
    found = {p: why for p, why in found.items() if p != "/"}
    keep = sorted(p for p in found if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in found))
    return [(p, found[p]) for p in keep]


def fleet_file_mount(fleet_param: str, wd: Path | str, taken: list[str]) -> tuple[str, str] | None:
    """What a node pool's worker pod mounts from its host so that its flow runs open the fleet
    file at ``fleet_param`` (the deployments' ``fleet_file``), as (host path, hostPath type); None
    when nothing is needed: a path relative to the project ``wd`` is in the image, one under a
    path in ``taken`` (the pod's other mounts) is mounted already.

    The file's directory is mounted, not the file: a file bind-mounted alone keeps the inode it
    had when the pod started, so an edit that replaces the file (an editor, rsync, ``install``)
    would never reach a pod that lives for months (``OnDelete``). A file right in a directory the
    image has (/etc, /tmp, /) or in one holding the project is the exception: the host's
    directory would hide the image's own files.

    Example:
        >>> fleet_file_mount("/etc/ckptflow/fleet.yaml", "/srv/ckptflow", [])
        ('/etc/ckptflow', 'Directory')
        >>> fleet_file_mount("/etc/fleet.yaml", "/srv/ckptflow", [])        # /etc is the image's
        ('/etc/fleet.yaml', 'File')
        >>> fleet_file_mount("/srv/fleet.yaml", "/srv/ckptflow", [])        # /srv holds the project
        ('/srv/fleet.yaml', 'File')
        >>> fleet_file_mount("deployments/local.yaml", "/srv/ckptflow", [])   # in the image, with the project
        >>> fleet_file_mount("/models/fleet.yaml", "/srv/ckptflow", ["/models"])  # mounted already
    """
    f = Path(fleet_param)
    if not f.is_absolute() or any(f.is_relative_to(t) for t in taken):
        return None
    d = f.parent
    if str(d) == "/" or str(d) in _IMAGE_DIRS or Path(wd).is_relative_to(d):
        return str(f), "File"
    return str(d), "Directory"


def check_worker_query_s(seconds: float) -> float:
    """A node workers' poll interval given on the command line, checked as the fleet file's is.

    Example:
        >>> check_worker_query_s(2.5)
        2.5

    Raises:
        ConfigError: not more than 0 and at most 60 s.
    """
    if not 0 < seconds <= 60:
        raise ConfigError(f"worker poll interval {seconds:g} s: it must be more than 0 and at most 60 s",
                          fix=f"pass --worker-query-seconds of about {WORKER_QUERY_S:g} (a migrate waits up to that "
                              "long for the target's worker to pick up its step)")
    return seconds


def render_node_workers(fleet_file: Path, workdir: Path | str | None = None, api_url: str | None = None,
                        image: str | None = None, out_dir: Path | None = None,
                        all_nodes_here: bool = False, worker_query_s: float | None = None) -> dict[str, list[Path]]:
    """Write what runs each node's Prefect worker: a systemd unit per node and a privileged
    DaemonSet per node pool, into ``<fleet>.workers/`` beside the fleet file (or ``out_dir``).

    Both run ``prefect worker start --pool <the node's pool>`` as root in the project directory,
    with PREFECT_API_URL (``api_url``, default: this shell's, else a placeholder to replace),
    CKPTFLOW_NODE and PREFECT_WORKER_QUERY_SECONDS (``worker_query_s``, default the fleet file's
    ``worker_query_seconds``: how soon a node step starts after a fleet flow asks for it); the
    unit restarts always and its stop leaves what the flows started running;
    the DaemonSet has hostPID, privileged, /dev/shm, the node's store, what its workloads
    name (``node_mounts``: pid files, models, logs) and a fleet file kept outside the project
    (``fleet_file_mount``) mounted.

    Returns:
        {"systemd": [unit files], "kubernetes": [daemonset.yaml]}.

    Raises:
        ConfigError: ``workdir`` does not hold the project, or a work pool's name cannot be a
            Kubernetes label value.
    """
    wd = check_workdir(workdir)
    fleet = load_fleet(fleet_file)
    worker_query_s = fleet.worker_query_seconds if worker_query_s is None else check_worker_query_s(worker_query_s)
    given = api_url is not None
    api_url = api_url or prefect_api_url() or API_URL_PLACEHOLDER
    check_api_url(fleet, api_url, given, all_nodes_here)
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
               path=path, query_s=f"{worker_query_s:g}", control_pool=fleet.control_pool or fleet.nodes[0].work_pool)
    units, (ds,) = files["systemd"], files["kubernetes"]
    units[0].parent.mkdir(parents=True, exist_ok=True)
    for stale in set(units[0].parent.glob("ckptflow-prefect-worker-*.service")) - set(units):
        stale.unlink()  # a node no longer in the fleet file
    for n, unit in zip(fleet.nodes, units):
        unit.write_text(env().get_template("systemd/prefect-worker.service.j2").render(
            node=n, unit_name=unit.name, **ctx))
    turns = list(zip(_two_tier(fleet), files["turns"], strict=True))
    for stale in set(units[0].parent.glob("ckptflow-turns-*.service")) - {u for _, u in turns}:
        stale.unlink()  # a workload gone, or no longer two-tier
    for w, unit in turns:
        unit.write_text(env().get_template("systemd/turns.service.j2").render(
            workload=w, unit_name=unit.name, every=TURN_POLL_S, **ctx))
    ds.parent.mkdir(parents=True, exist_ok=True)
    from ckptflow.kubernetes import daemonset_context, render_pod_fleet  # pod workloads (docs/kubernetes.md)

    ds_ctx = daemonset_context(fleet)

    def mounts(nodes) -> list[tuple[str, str]]:
        return [(p, why) for p, why in node_mounts(fleet, nodes, wd) if p not in store_paths(nodes) and p != "/dev/shm"]

    def fleet_mount(nodes) -> tuple[str, str] | None:
        taken = ["/dev/shm", *store_paths(nodes), *(p for p, _ in mounts(nodes))]
        if ds_ctx["pod_workloads"]:
            taken += [ds_ctx["checkpoint_dir"], "/var/lib/containers/storage"]
        return fleet_file_mount(ctx["fleet_file"], wd, taken)

    ds.write_text(env().get_template("kubernetes/daemonset.yaml.j2").render(
        pools=list(pools.items()), namespace=K8S_NAMESPACE, image=image, out_name=ds.name,
        ds_name=lambda pool: daemonset_name(fleet.fleet, pool),
        store_paths=store_paths, mounts=mounts, fleet_mount=fleet_mount, **ds_ctx, **ctx))
    pods = render_pod_fleet(fleet_file, ds.parent, K8S_NAMESPACE)
    if pods:  # rbac.yaml and the restore pods, only for a fleet with pod workloads
        files["pods"] = pods
    return files


def daemonset_name(fleet: str, pool: str) -> str:
    """The node agent's DaemonSet for ``pool``: the fleet in the name, as the systemd units carry
    it, so two fleets with a pool named alike in one namespace do not overwrite each other's.
    A DNS label (63 characters at most): a longer one keeps a hash of the whole, so it stays unique.

    >>> daemonset_name("example-h200", "h200_01")
    'ckptflow-prefect-worker-example-h200-h200-01'
    >>> len(daemonset_name("f" * 40, "p" * 40))
    63
    """
    name = "ckptflow-prefect-worker-" + re.sub(r"[^a-z0-9-]+", "-", f"{fleet}-{pool}".lower()).strip("-")
    if len(name) <= 63:
        return name
    return name[:54].rstrip("-") + "-" + hashlib.sha256(name.encode()).hexdigest()[:8]


def _version() -> str:
    import ckptflow

    return ckptflow.__version__


def deploy(fleet_file: Path, *, create_pools: bool = True, ephemeral: bool = False,
           workdir: Path | str | None = None, image: str | None = None, api_url: str | None = None,
           all_nodes_here: bool = False, worker_query_s: float | None = None) -> Path:
    """Render, then deploy through Prefect's client what the rendered prefect.yaml says (the file
    an operator reviews is the one deployed): each node's process work pool and its
    ``ckptflow-node-<node>`` global concurrency limit (1 slot) when missing, the fleet's results
    block (its storage kind's, ``register_result_storage``), then every deployment, created or
    updated in place.

    ``api_url``: the Prefect API the node workers use (default: this shell's PREFECT_API_URL);
    ``all_nodes_here``: every node runs on this machine, so a loopback one is right;
    ``worker_query_s``: the node workers' poll interval (default: the fleet file's; render_node_workers).

    Raises:
        ConfigError: no Prefect server is configured (PREFECT_API_URL) and ``ephemeral`` is not
            set: the deployments would go into a temporary server that vanishes on exit; or
            ``workdir`` does not hold the project; or the node workers' API URL is loopback and a
            node is remote, or the storage kind keeps no flow results where remote nodes' fleet
            flows read them (both checked before anything is deployed); or the server refused or could
            not be reached (one line: what failed and why).
    """
    if not ephemeral and not prefect_api_url():
        raise ConfigError("PREFECT_API_URL is not set: the deployments would go into a temporary Prefect server "
                          "that is gone when this command exits",
                          fix="export PREFECT_API_URL=http://<prefect-server>:4200/api (or `prefect config set "
                              "PREFECT_API_URL=...`), or pass --ephemeral to deploy into a throwaway server on purpose")
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import DeploymentApplyError
    from prefect.exceptions import PrefectException
    from pydantic import ValidationError

    check_api_url(load_fleet(fleet_file), api_url or prefect_api_url(), api_url is not None, all_nodes_here)
    check_result_storage(load_fleet(fleet_file), all_nodes_here)
    out = render_prefect_yaml(fleet_file, workdir)
    render_node_workers(fleet_file, workdir, api_url=api_url, image=image, all_nodes_here=all_nodes_here,
                        worker_query_s=worker_query_s)
    fleet = load_fleet(fleet_file)
    spec = yaml.safe_load(out.read_text())
    step = "connecting"
    try:
        with get_client(sync_client=True) as client:
            if create_pools:
                for pool in sorted({n.work_pool for n in fleet.nodes} | ({fleet.control_pool} - {None})):
                    step = f"work pool {pool}"
                    _ensure_process_pool(client, pool)
                for n in fleet.nodes:
                    step = f"concurrency limit {NODE_LIMIT.format(node=n.name)}"
                    _ensure_node_limit(client, NODE_LIMIT.format(node=n.name))
        if results_block_name(fleet):
            step = f"results block {results_block_name(fleet)}"
            save_results_block(fleet)
        for d in spec["deployments"]:
            step = f"deployment {d['name']} of {d['entrypoint']}"
            runner_deployment(d, spec["pull"]).apply()
    except (httpx.HTTPError, PrefectException, DeploymentApplyError, ValidationError) as e:
        # DeploymentApplyError: the server's own reason; PrefectException: a flow file that does
        # not load (ScriptError), an object the server does not know; ValidationError: a bad field.
        why = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"deploy of {out.name} to {prefect_api_url() or 'a temporary server'} failed at "
                          f"{step}: {why[:500]}", fix="check PREFECT_API_URL points at your Prefect server") from e
    return out


def _ensure_process_pool(client: SyncPrefectClient, name: str) -> None:
    """Create process work pool ``name`` with the process worker's default job template (what
    `prefect work-pool create --type process` does), unless it exists; an existing one is kept."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        client.read_work_pool(name)
    except ObjectNotFound:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process",
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
        except ObjectAlreadyExists:
            pass  # another deploy made it meanwhile


def _ensure_node_limit(client: SyncPrefectClient, name: str) -> None:
    """Create global concurrency limit ``name`` with 1 slot, unless it exists (an operator may
    have changed it: it is left as it is)."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass


def runner_deployment(d: dict[str, Any], pull: list[dict[str, Any]]) -> RunnerDeployment:
    """One deployment of a rendered prefect.yaml as a RunnerDeployment: its flow loaded from the
    project directory that the pull step enters (so the parameter schema is the code's that
    will run), the same work pool, job variables, parameters, tags, schedules and limit.

    Raises:
        ConfigError: the pull step is not the one prefect.yaml.j2 renders.
    """
    from prefect.deployments.runner import RunnerDeployment
    from prefect.runner.storage import LocalStorage
    from prefect.schedules import Cron, Interval

    steps = [s.get("prefect.deployments.steps.set_working_directory") for s in pull]
    if len(steps) != 1 or not steps[0]:
        raise ConfigError(f"prefect.yaml pull steps {pull!r}: expected one set_working_directory step",
                          fix="render prefect.yaml again with `ckptflow deploy --render-only`")
    schedules = [Interval(s["interval"]) if "interval" in s else Cron(s["cron"], timezone=s.get("timezone"))
                 for s in d.get("schedules") or []]
    pool = d["work_pool"]
    return RunnerDeployment.from_storage(
        storage=LocalStorage(steps[0]["directory"]), entrypoint=d["entrypoint"], name=d["name"],
        parameters=d.get("parameters") or {}, tags=d.get("tags") or [], schedules=schedules,
        concurrency_limit=d.get("concurrency_limit"), work_pool_name=pool["name"],
        job_variables=pool.get("job_variables") or {})
