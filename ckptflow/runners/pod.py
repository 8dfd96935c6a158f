"""Pod workloads (``container.kubernetes``): the kubelet and API server calls of the pod runtime
(runners/runtime/pod.py), for a worker that runs in a Kubernetes pod (docs/kubernetes.md).

- alive: the API server says the pod is Running (``KubeApi.get_pod``);
- checkpoint: the kubelet's checkpoint API (KEP-2008) on the pod's node writes the archive; the
  node agent moves it into the checkpoint as ``container.tar`` (the same format podman exports),
  so the store, S3 and the gates treat it like any container checkpoint; the pod keeps running;
- restore: a checkpoint image is built from the archive into the node's containers-storage
  (buildah), and the pod templates/kubernetes/restore-pod.yaml.j2 renders (same name, this node,
  ``imagePullPolicy: Never``) is created through the API server: the runtime restores it.

The fleet node name is taken to be the Kubernetes node name (``nodeName`` of a restored pod).

Tested against stand-ins only (tests/test_kubernetes.py: a kubelet and an API server on 127.0.0.1
that do what CRI-O does, with podman); never against a cluster.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from ckptflow.errors import ConfigError, RestoreFailed, WorkloadNotFound, WorkloadRunning
from ckptflow.models import Manifest, Workload
from ckptflow.render import env
from ckptflow.runners.kubelet import KubeApi, KubeletCheckpointApi, build_checkpoint_image
from ckptflow.runners.process import DeclaredProcess


def _k(w: Workload):
    return w.container.kubernetes


def api(w: Workload) -> KubeApi:
    k = _k(w)
    return KubeApi(k.api_url, token_file=k.token_file)


def kubelet(w: Workload) -> KubeletCheckpointApi:
    k = _k(w)
    return KubeletCheckpointApi(k.kubelet_url, token_file=k.token_file,
                                ca_file=k.kubelet_ca if k.kubelet_ca else False)


def _phase(pod: dict | None) -> str:
    return ((pod or {}).get("status") or {}).get("phase", "Unknown")


def resolve_pod(w: Workload) -> DeclaredProcess:
    """The pod of ``w`` while it runs. Its pid is 0: the agent never acts on a pod's processes
    itself, and nothing may signal it (the pod runtime's ``stop`` deletes the pod instead).

    Raises:
        WorkloadNotFound: no such pod, or it is not Running.
    """
    k = _k(w)
    pod = api(w).get_pod(k.namespace, k.pod)
    if pod is None:
        raise WorkloadNotFound(f"workload {w.name}: pod {k.namespace}/{k.pod} not found",
                               fix="run `ckptflow recover` to restore it, or correct container.kubernetes")
    if _phase(pod) != "Running":
        raise WorkloadNotFound(f"workload {w.name}: pod {k.namespace}/{k.pod} is {_phase(pod)}, not Running",
                               fix="run `ckptflow recover` to restore it from its newest checkpoint")
    return DeclaredProcess(workload=w.name, pid=0, start_time=0, cmdline=f"pod {k.namespace}/{k.pod}/{k.container}")


def take_archive(w: Workload, dest: Path) -> float:
    """Checkpoint the pod's container through its kubelet and move the archive to ``dest``; seconds."""
    k = _k(w)
    t0 = time.perf_counter()
    archive = kubelet(w).checkpoint(k.namespace, k.pod, k.container)[0]
    shutil.move(archive, dest)  # the kubelet never deletes its archives: the store now owns it
    return time.perf_counter() - t0


def clear_dead(w: Workload) -> None:
    """Refuse a running pod; delete a pod object of that name that is not running (it is the lost worker)."""
    k = _k(w)
    a = api(w)
    pod = a.get_pod(k.namespace, k.pod)
    if pod is None:
        return
    if _phase(pod) in ("Running", "Pending"):
        raise WorkloadRunning(f"workload {w.name}: pod {k.namespace}/{k.pod} is {_phase(pod)}; refusing to restore "
                              "over it", fix="delete it first if it is broken, or use verify to test a checkpoint")
    a.delete_pod(k.namespace, k.pod)


def delete(w: Workload) -> None:
    k = _k(w)
    api(w).delete_pod(k.namespace, k.pod)


RESTORE_REPO = "localhost/ckptflow-restore"  # checkpoint images live in the node's containers-storage only


def checkpoint_image(w: Workload, checkpoint: str) -> str:
    """The checkpoint image of ``checkpoint`` on the node that restores it."""
    return f"{RESTORE_REPO}/{w.name}:{checkpoint}"


def _pod_name(w: Workload, checkpoint: str) -> str:
    """The declared pod name: the restored pod replaces the lost one, and the next heartbeat's kubelet
    call names it."""
    return w.container.kubernetes.pod


def restore_pod(w: Workload, checkpoint: str, node: str, image: str | None = None) -> str:
    """The Pod manifest that restores ``w`` from ``checkpoint`` on Kubernetes node ``node``.

    Raises:
        ConfigError: ``w`` declares no pod (container.kubernetes).
    """
    if w.container is None or w.container.kubernetes is None:
        raise ConfigError(f"workload {w.name} declares no pod (container.kubernetes)",
                          fix="add container: {kubernetes: {namespace: ..., pod: ..., container: ...}}")
    health = urlsplit(w.health_url) if w.health_url else None
    hport = None
    if health is not None:  # the probe asks the container's port for the path the health URL names
        hport = next((p.container for p in w.container.ports if p.host == health.port), health.port)
    return env().get_template("kubernetes/restore-pod.yaml.j2").render(
        w=w, checkpoint=checkpoint, node=node, image=image or checkpoint_image(w, checkpoint),
        pod_name=_pod_name(w, checkpoint), health_path=health.path if health else "/", health_port=hport)


def restore(w: Workload, m: Manifest, archive: Path, timeout_s: float = 120) -> None:
    """Build the checkpoint image of ``m`` on this node and create the restore pod through the API server."""
    k = _k(w)
    image = checkpoint_image(w, m.id)
    build_checkpoint_image(archive, k.container, image, oci_runtime=w.container.oci_runtime)
    manifest = yaml.safe_load(restore_pod(w, m.id, w.node, image))
    a = api(w)
    a.create_pod(k.namespace, manifest)
    deadline = time.monotonic() + timeout_s
    while True:
        phase = _phase(a.get_pod(k.namespace, k.pod))
        if phase == "Running":
            return
        if phase in ("Failed", "Succeeded") or time.monotonic() > deadline:
            raise RestoreFailed(f"workload {w.name}: restored pod {k.namespace}/{k.pod} is {phase}",
                                fix=f"kubectl -n {k.namespace} describe pod {k.pod} (is the runtime's checkpoint "
                                    "support on? CRI-O: enable_criu_support = true)")
        time.sleep(0.2)
