"""``pod``: a worker in a Kubernetes pod (``container.kubernetes``), checkpointed through its
kubelet and restored into a new pod from a checkpoint image (runners/pod.py holds the kubelet
and API server calls; docs/kubernetes.md). Everything else is the podman runtime's: the same
archive (``container.tar``, the format podman exports), the same record, gate and checksums.

- alive: the API server says the pod is Running; its PID is 0 (the agent never acts on a
  pod's processes itself, and nothing may signal it: a stop deletes the pod);
- checkpoint: the kubelet's checkpoint API writes the archive, moved into the checkpoint; the pod
  keeps running (a migrate deletes it once the manifest is written);
- restore: no host port is checked (the pod's are the cluster's); a checkpoint image is built and
  the restore pod created;
- verify: the fingerprint and the checksums only (a copy of a pod beside it is not built yet);
- cold start: the cluster's (its Deployment or StatefulSet), not the node agent's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ckptflow.container_models import PortMap
from ckptflow.errors import RestoreFailed, WorkloadNotFound
from ckptflow.models import ContainerRecord, Manifest, VerifyOutcome, Workload
from ckptflow.results import Stopped
from ckptflow.runners import pod
from ckptflow.runners.container import IMAGE_FILE, container_spec
from ckptflow.runners.digests import VerifyResult
from ckptflow.runners.process import DeclaredProcess
from ckptflow.runners.runtime import COLD_START_TIMEOUT_S, register_runtime
from ckptflow.runners.runtime.podman import PodmanRuntime


@register_runtime("pod")
class PodRuntime(PodmanRuntime):
    """A pod's container, through its kubelet and the API server."""

    declares = "container.kubernetes"

    def resolve(self, w: Workload) -> DeclaredProcess:
        return pod.resolve_pod(w)

    def stop(self, w: Workload, grace_s: float = 30) -> Stopped:
        """Delete the pod (never a signal: its PIDs are unknown here)."""
        try:
            pod.resolve_pod(w)
        except WorkloadNotFound:
            return {"stopped": False, "reason": "not running"}
        pod.delete(w)
        k = container_spec(w).kubernetes
        return {"stopped": True, "pod": f"{k.namespace}/{k.pod}"}

    def container_record(self, w: Workload) -> ContainerRecord:
        spec = container_spec(w)
        k = spec.kubernetes
        return ContainerRecord(name=spec.name, pod=f"{k.namespace}/{k.pod}/{k.container}", ports=spec.ports)

    def export(self, w: Workload, dest: Path, leave_running: bool) -> float:
        """The kubelet checkpoints it, leaving it running (a migrate deletes it after the commit)."""
        return pod.take_archive(w, dest)

    def dumped(self, w: Workload, leave_running: bool) -> None:
        if not leave_running:
            pod.delete(w)

    def clear(self, w: Workload) -> None:
        pod.clear_dead(w)

    def taken_ports(self, w: Workload, ports: list[PortMap]) -> list[PortMap]:
        return []  # a pod's ports are the cluster's, not this node's to check

    def restore_as(self, w: Workload, m: Manifest, name: str, ports: list[PortMap]) -> int:
        """A checkpoint image of ``m`` and a new pod (under the declared name); its PID is 0."""
        pod.restore(w, m, self._node().store.images_dir(m) / IMAGE_FILE)
        return 0

    def verify_copy(self, w: Workload, m: Manifest, t: dict[str, float], timeout_s: float = 120,
                    inspect_copy: Callable | None = None) -> VerifyResult:
        return VerifyResult(VerifyOutcome.skipped, "fingerprint and checksums pass; a copy of a pod beside the "
                            "original is not built yet (docs/kubernetes.md)", t)

    def cold_start(self, w: Workload, timeout_s: float = COLD_START_TIMEOUT_S) -> tuple[int, float]:
        if container_spec(w).image:
            raise RestoreFailed(f"workload {w.name}: a pod is cold started by the cluster, not by the node agent",
                                fix="let its Deployment/StatefulSet recreate it, or kubectl apply its manifest")
        return super().cold_start(w, timeout_s)
