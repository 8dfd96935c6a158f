"""How a fleet file declares a worker that runs in an OCI container (a workload's ``container:``).

A container workload names its container instead of a pid file; ckptflow checkpoints and
restores it through the container runtime (``podman container checkpoint/restore``, runc and
CRIU underneath: ckptflow/runners/container.py). How it is started (image, command, ports,
mounts) is optional and lets a cold start or a restore on another node bring it back::

    workloads:
      - name: chat-c
        node: node-a
        container:
          runtime: podman
          name: chat-c                       # container name or id on the node
          image: localhost/ckptflow-demo:latest
          command: [python3, -m, ckptflow.demo.worker, --host, 0.0.0.0, --port, "8000"]
          ports: [{host: 18101, container: 8000}]
        health_url: http://127.0.0.1:18101/health

Example:
    >>> c = ContainerSpec(name="chat-c", ports=[PortMap(host=18101, container=8000)])
    >>> c.runtime.value, c.oci_runtime, c.publish_args()
    ('podman', 'runc', ['--publish', '127.0.0.1:18101:8000'])
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# What podman and docker accept as a container name.
_CONTAINER_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$")


def _check_container_name(value: str) -> str:
    if not _CONTAINER_RE.match(value):
        raise ValueError(f"{value!r} is not a container name or id: use 1-128 letters, digits, '_', '.' or '-', "
                         "starting with a letter or digit")
    return value


ContainerName = Annotated[str, AfterValidator(_check_container_name)]


class ContainerRuntime(StrEnum):
    """The container engine whose checkpoint/restore ckptflow drives."""

    podman = "podman"   # podman container checkpoint/restore --export/--import (runc + CRIU underneath)


class PortMap(BaseModel):
    """One published port: the node's ``host`` port forwards to the worker's ``container`` port."""

    model_config = ConfigDict(extra="forbid")

    host: int = Field(..., ge=1, le=65535, description="Port on the node (bound on host_ip).", examples=[18101])
    container: int = Field(..., ge=1, le=65535, description="Port the worker listens on inside.", examples=[8000])
    host_ip: str = Field("127.0.0.1", description="Address the node binds the host port on.",
                         examples=["127.0.0.1"])


class Mount(BaseModel):
    """A bind mount. It must exist on every node the workload may be restored on."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(..., description="Path on the node; a relative one (./models) is relative to the fleet "
                        "file's directory, a bare name is a podman named volume.", examples=["/var/lib/models"])
    target: str = Field(..., description="Path inside the container.", examples=["/models"])
    read_only: bool = Field(True, description="Mount read-only.")


def url_problem(value: str, example: str = "http://127.0.0.1:8000/metrics") -> str | None:
    """Why ``value`` is no http(s) URL with a host and a valid port, or None. The one check behind every
    URL field of a fleet file (fleet.py) and of ``ckptflow deploy``: a typo there failed only at its first use.

        >>> url_problem("http://127.0.0.1:10250"), url_problem("http://h:8o00")
        (None, "'http://h:8o00' is not a URL (Port could not be cast to integer value as '8o00')")
    """
    from urllib.parse import urlsplit

    try:
        u = urlsplit(value)
        u.port   # noqa: B018  (raises on a port that is no number or out of range: 8o00, 80000)
    except ValueError as e:
        return f"{value!r} is not a URL ({e})"
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"{value!r} is not an http(s) URL with a host (expected like {example})"
    return None


def _http_url(value: str | None) -> str | None:
    """A kubelet or API server address (a typo failed only when a restore first called it)."""
    if value is not None and (why := url_problem(value, "https://127.0.0.1:10250")):
        raise ValueError(why)
    return value


def _dns_label(value: str) -> str:
    """A Kubernetes namespace: a DNS label (RFC 1123), as the API server requires when a restore
    creates the pod."""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", value):
        raise ValueError(f"{value!r} is not a Kubernetes namespace name (lowercase letters, digits and '-', "
                         "starting and ending with a letter or digit)")
    return value


class KubernetesPod(BaseModel):
    """Where the worker's container lives in a pod-based fleet: the kubelet checkpoints it by these
    names (KEP-2008), and a restore creates a new pod in ``namespace`` (ckptflow/kubernetes.py)."""

    model_config = ConfigDict(extra="forbid")

    namespace: Annotated[str, AfterValidator(_dns_label)] = Field(
        ..., min_length=1, max_length=63, description="The pod's namespace.", examples=["serving"])
    pod: str = Field(..., min_length=1, max_length=253, description="The pod's name.", examples=["chat-a-0"])
    container: str = Field(..., min_length=1, max_length=63, description="The container's name in the pod.",
                           examples=["vllm"])
    service_account: str | None = Field(None, description="ServiceAccount of a restored pod (default: the "
                                        "namespace's default).", examples=["vllm"])
    kubelet_url: Annotated[str, AfterValidator(_http_url)] = Field(
        "https://127.0.0.1:10250", description="The kubelet of the pod's node, as the node agent (hostNetwork) "
        "reaches it.", examples=["https://127.0.0.1:10250"])
    kubelet_ca: str | None = Field(None, description="CA bundle of the kubelet's serving certificate; none: not "
                                   "verified (kubelets serve a self-signed one by default; the agent asks its own "
                                   "node over loopback).", examples=["/etc/kubernetes/pki/kubelet-ca.crt"])
    api_url: Annotated[str | None, AfterValidator(_http_url)] = Field(
        None, description="The API server a restore creates the pod through (default: in-cluster, "
        "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT).", examples=["https://10.96.0.1:443"])
    token_file: str = Field("/var/run/secrets/kubernetes.io/serviceaccount/token",
                            description="The node agent's ServiceAccount token (kubelet and API server).")


class ContainerSpec(BaseModel):
    """A worker in a container: which container, and (optionally) how it is started."""

    model_config = ConfigDict(extra="forbid")

    runtime: ContainerRuntime = Field(ContainerRuntime.podman, description="Container engine.", examples=["podman"])
    name: ContainerName = Field(..., description="Container name (or id) on the node; a restore recreates it "
                                "under this name.", examples=["chat-c"])
    oci_runtime: str = Field("runc", description="OCI runtime podman runs it with (--runtime): runc calls CRIU "
                             "for checkpoints (Debian's crun has no CRIU support).", examples=["runc"])
    image: str | None = Field(None, description="Image to cold start it from.",
                              examples=["localhost/ckptflow-demo:latest"])
    rootfs: str | None = Field(None, description="A rootfs tar (python -m ckptflow.runners.rootfs build) imported "
                               "as ``image`` on a node that lacks the image (relative: to the fleet file's directory).",
                               examples=["/srv/images/demo-rootfs.tar"])
    command: list[str] | None = Field(None, description="Command of a cold start (default: the image's).",
                                      examples=[["python3", "-m", "ckptflow.demo.worker", "--host", "0.0.0.0"]])
    ports: list[PortMap] = Field(default_factory=list, description="Published ports. A restore publishes the "
                                 "same ones and refuses if one is taken; a verify copy gets fresh host ports.")
    mounts: list[Mount] = Field(default_factory=list, description="Bind mounts (cold start).")
    env: dict[str, str] = Field(default_factory=dict, description="Environment of a cold start.")
    kubernetes: KubernetesPod | None = Field(
        None, description="In a pod-based fleet: the pod and container (checkpointed through the kubelet, "
        "restored into a new pod from a checkpoint image; rendered by ckptflow.kubernetes, see docs/kubernetes.md).")
    ulimits: dict[str, str] = Field(
        default_factory=lambda: {"nofile": "20000:20000", "nproc": "32768:32768"},
        description="Explicit limits: podman's defaults fail under runc here ('error setting rlimit type 7').")

    shm_size: str | None = Field(None, description="Size of the container's own /dev/shm tmpfs (--shm-size); "
                                 "vLLM's multiprocessing rings and semaphore live there, and it is dumped with the "
                                 "container.", examples=["1g"])
    annotations: dict[str, str] = Field(
        default_factory=dict, description="OCI annotations (--annotation), e.g. runc's CRIU config file "
        "(org.criu.config) that gives CRIU the options an engine needs; exported with the container, so a "
        "restore reads it too.", examples=[{"org.criu.config": "/etc/ckptflow/vllm-criu.conf"}])

    def run_args(self) -> list[str]:
        """``podman run`` arguments of a cold start, image and command last.

        Examples:
            >>> ContainerSpec(name="chat", image="localhost/demo", shm_size="1g").run_args()[:7]
            ['--runtime', 'runc', 'run', '--detach', '--name', 'chat', '--shm-size']
        """
        return ["--runtime", self.oci_runtime, "run", "--detach", "--name", self.name,
                *(["--shm-size", self.shm_size] if self.shm_size else []),
                *(a for k, v in self.ulimits.items() for a in ("--ulimit", f"{k}={v}")),
                *self.publish_args(),
                *(a for mt in self.mounts
                  for a in ("--volume", f"{mt.source}:{mt.target}" + (":ro" if mt.read_only else ""))),
                *(a for k, v in self.env.items() for a in ("--env", f"{k}={v}")),
                *(a for k, v in self.annotations.items() for a in ("--annotation", f"{k}={v}")),
                self.image or "", *(self.command or [])]

    def publish_args(self, ports: list[PortMap] | None = None) -> list[str]:
        """``--publish`` arguments for ``ports`` (default: the declared ones)."""
        out: list[str] = []
        for p in self.ports if ports is None else ports:
            out += ["--publish", f"{p.host_ip}:{p.host}:{p.container}"]
        return out
