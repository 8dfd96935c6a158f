"""What a pod-based fleet needs in Kubernetes, rendered from the fleet file (docs/kubernetes.md).

A workload whose ``container.kubernetes`` names its pod is protected through the kubelet's
checkpoint API (KEP-2008) by the node agent, the DaemonSet ``ckptflow deploy`` renders
(templates/kubernetes/daemonset.yaml.j2: with pod workloads it also gets a ServiceAccount, the
node's IP for the kubelet, the kubelet's checkpoint directory and the node's containers-storage).
This module renders the rest:

- ``rbac.yaml``: the agent's ServiceAccount, a ClusterRole with ``create`` on ``nodes/checkpoint``
  (what the kubelet authorizes a checkpoint call against) and on pods, and its binding;
- ``restore/<workload>.yaml``: the pod a restore creates, from a checkpoint image, on one node
  (``restore_pod`` renders it for a real checkpoint at restore time).

No Prefect here, and no cluster is needed to render: tests/test_kubernetes.py validates every
rendered manifest against the Kubernetes JSON schema (kubernetes-validate, offline).

Example:
    >>> paths = render_pod_fleet(Path("deployments/example-pods.yaml"))                  # doctest: +SKIP
    >>> print(restore_pod(w, "20261130T120000Z-1a2b3c4d", "gpu-node-02"))                   # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from ckptflow.fleet import Fleet, load_fleet
from ckptflow.models import Workload
from ckptflow.render import env
from ckptflow.runners.kubelet import KUBELET_CHECKPOINT_DIR
from ckptflow.runners.pod import RESTORE_REPO, checkpoint_image, restore_pod  # noqa: F401  (rendered at restore time)
from ckptflow.runners.runtime import runtime_name

NAMESPACE = "ckptflow"  # the node agent's namespace (deploy.K8S_NAMESPACE)
SERVICE_ACCOUNT = "ckptflow-node-agent"
PLACEHOLDER = "CHECKPOINT"


def pod_workloads(fleet: Fleet) -> list[Workload]:
    """The fleet's workloads that run in pods (``container.kubernetes`` set)."""
    return [w for w in fleet.workloads if runtime_name(w) == "pod"]


def render_pod_fleet(fleet_file: Path, out_dir: Path | None = None, namespace: str = NAMESPACE) -> list[Path]:
    """Write ``rbac.yaml`` and one example ``restore/<workload>.yaml`` per pod workload into
    ``<fleet>.workers/kubernetes/`` (or ``out_dir``); nothing when the fleet has no pod workload.

    Returns:
        The files written.
    """
    fleet = load_fleet(fleet_file)
    pods = pod_workloads(fleet)
    if not pods:
        return []
    d = Path(out_dir) if out_dir else Path(fleet_file).with_name(f"{fleet.fleet}.workers") / "kubernetes"
    (d / "restore").mkdir(parents=True, exist_ok=True)
    rbac = d / "rbac.yaml"
    rbac.write_text(env().get_template("kubernetes/rbac.yaml.j2").render(
        fleet=fleet, pod_workloads=pods, namespace=namespace, service_account=SERVICE_ACCOUNT,
        checkpoint_dir=KUBELET_CHECKPOINT_DIR, out_name=rbac.name))
    out = [rbac]
    for w in pods:
        p = d / "restore" / f"{w.name}.yaml"
        p.write_text(restore_pod(w, PLACEHOLDER, w.node))  # an example: the agent renders the real one
        out.append(p)
    return out


def daemonset_context(fleet: Fleet) -> dict:
    """What templates/kubernetes/daemonset.yaml.j2 needs for the fleet's pod workloads."""
    return {"pod_workloads": pod_workloads(fleet), "service_account": SERVICE_ACCOUNT,
            "checkpoint_dir": KUBELET_CHECKPOINT_DIR}
