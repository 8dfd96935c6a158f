"""A pod's container checkpoint through the kubelet (KEP-2008), and the checkpoint image a new pod
is restored from.

Kubernetes (>= 1.30, feature gate ``ContainerCheckpoint``, beta and on by default) checkpoints a
running container of a pod when asked on the kubelet's own API:

    POST https://<node>:10250/checkpoint/{namespace}/{pod}/{container}?timeout=<s>
    -> 200 {"items": ["/var/lib/kubelet/checkpoints/checkpoint-<pod>_<namespace>-<container>-<time>.tar"]}

The container runs on (CRI-O's and containerd's CRI checkpoint leaves it running); the archive is
written on that node under the kubelet's root directory, and nothing ever deletes it: the node
agent moves it into ckptflow's store (and so to S3, chunked) and removes it there. Kubernetes has
no restore call: a new pod is restored when its container's image is a *checkpoint image*, an
OCI image holding the archive with the annotation the runtime looks for (CRI-O with
``enable_criu_support``; containerd >= 2.0 reads the same format), built here with buildah
into the node's containers-storage (shared with CRI-O), so no registry is needed.

Not run here (no cluster on these machines): the kubelet call against a real kubelet and a
runtime's restore of the pod. ``tests/test_kubernetes.py`` runs the client against a local HTTP
stand-in for the kubelet and restores the checkpoint image built here with podman, which reads
the same format.

Example:
    >>> api = KubeletCheckpointApi("https://127.0.0.1:10250", token_file=SA_TOKEN)      # doctest: +SKIP
    >>> archive = api.checkpoint("serving", "chat-a-0", "vllm")[0]                       # doctest: +SKIP
    >>> build_checkpoint_image(archive, "vllm", "localhost/ckptflow-restore/chat-a:ID")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx

from ckptflow.errors import CriuError, RestoreFailed, RunnerUnavailable, WorkloadNotFound

SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
SA_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
KUBELET_CHECKPOINT_DIR = "/var/lib/kubelet/checkpoints"  # <kubelet --root-dir>/checkpoints
# What a runtime looks for on a checkpoint image: CRI-O's key, and podman's (same archive format).
CHECKPOINT_ANNOTATIONS = ("io.kubernetes.cri-o.annotations.checkpoint.name", "io.podman.annotations.checkpoint.name")
PODMAN_RUNTIME_ANNOTATION = "io.podman.annotations.checkpoint.runtime.name"
TIMEOUT_S = 600  # the kubelet's own default for a checkpoint is 4 min; a large GPU worker takes longer

# The kubelet's answers, mapped to what the operator should do.
_FIXES = {
    401: "give the node agent a ServiceAccount token the kubelet accepts (rendered rbac.yaml)",
    403: "bind the node agent's ServiceAccount to a ClusterRole with create on nodes/checkpoint (rendered rbac.yaml)",
    404: "check namespace/pod/container, and that the kubelet runs with feature gate ContainerCheckpoint "
         "(on by default from Kubernetes 1.30)",
    500: "the container runtime cannot checkpoint: CRI-O needs enable_criu_support = true and CRIU >= 4.2 on the "
         "node; containerd needs >= 2.0",
}


class KubeletCheckpointApi:
    """The kubelet's checkpoint endpoint, with a bearer token and a timeout on every call.

    Args:
        base_url: the kubelet, e.g. https://127.0.0.1:10250 from a hostNetwork node agent.
        token_file: a ServiceAccount token allowed to create nodes/checkpoint.
        ca_file: CA of the kubelet's serving certificate (None: the system's; False: no check,
            for a kubelet with a self-signed certificate on a private node network only).
    """

    def __init__(self, base_url: str, *, token_file: str | None = SA_TOKEN, ca_file: str | bool | None = None,
                 timeout_s: float = TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self.token_file = token_file
        self.verify = True if ca_file is None else ca_file
        self.timeout_s = timeout_s

    def url(self, namespace: str, pod: str, container: str) -> str:
        return f"{self.base_url}/checkpoint/{namespace}/{pod}/{container}"

    def checkpoint(self, namespace: str, pod: str, container: str) -> list[str]:
        """Checkpoint one container of a running pod; the archive path(s) on the node.

        Raises:
            WorkloadNotFound: 404 (no such pod/container, or the feature gate is off).
            RunnerUnavailable: 401/403 (token, RBAC) or no kubelet answering.
            CriuError: the runtime's checkpoint failed (500), with the kubelet's message.
        """
        headers = {}
        if self.token_file and Path(self.token_file).exists():
            headers["Authorization"] = f"Bearer {Path(self.token_file).read_text().strip()}"
        url = self.url(namespace, pod, container)
        try:
            r = httpx.post(url, params={"timeout": int(self.timeout_s)}, headers=headers, verify=self.verify,
                           timeout=self.timeout_s + 30)
        except httpx.HTTPError as e:
            raise RunnerUnavailable(f"kubelet at {self.base_url} did not answer the checkpoint of "
                                    f"{namespace}/{pod}/{container}: {e}",
                                    fix="run the node agent with hostNetwork on the pod's node (rendered "
                                        "daemonset.yaml) and check the kubelet's port") from None
        what = f"kubelet checkpoint of {namespace}/{pod}/{container}"
        body = r.text.strip()[:500]
        if r.status_code == 404:
            raise WorkloadNotFound(f"{what}: 404 {body}", fix=_FIXES[404])
        if r.status_code in (401, 403):
            raise RunnerUnavailable(f"{what}: {r.status_code} {body}", fix=_FIXES[r.status_code])
        if r.status_code != 200:
            raise CriuError(f"{what} failed", cmd=["POST", url], log_tail=body, returncode=r.status_code,
                            fix=_FIXES.get(500))
        try:
            items = r.json()["items"]
        except (ValueError, KeyError, TypeError):
            raise CriuError(f"{what}: unexpected answer", cmd=["POST", url], log_tail=body) from None
        if not items:
            raise CriuError(f"{what}: the kubelet named no archive", cmd=["POST", url], log_tail=body)
        return [str(i) for i in items]


def _run(cmd: list[str], what: str, timeout_s: float = 300) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RestoreFailed(f"{what} failed (exit {r.returncode}): {r.stderr.strip()[-400:]}",
                            fix="run ./scripts/setup.sh as root (installs buildah with podman)")
    return r.stdout.strip()


def build_checkpoint_image(archive: Path, container: str, image: str, *, buildah: str = "buildah",
                           oci_runtime: str = "runc") -> str:
    """An OCI checkpoint image ``image`` holding ``archive`` (a kubelet or podman checkpoint tar),
    annotated for CRI-O and podman, committed into the node's containers-storage; its id.

    A pod whose container names this image (``imagePullPolicy: Never`` on that node) is restored
    from the checkpoint instead of started (templates/kubernetes/restore-pod.yaml.j2).

    Raises:
        RunnerUnavailable: buildah is not installed.
        RestoreFailed: buildah failed.
    """
    exe = shutil.which(buildah)
    if not exe:
        raise RunnerUnavailable("buildah not found on PATH", fix="apt-get install buildah (the node image has it)")
    if not Path(archive).is_file():
        raise WorkloadNotFound(f"checkpoint archive {archive} does not exist",
                               fix=f"the kubelet writes them under {KUBELET_CHECKPOINT_DIR} on the pod's node")
    work = _run([exe, "from", "scratch"], "buildah from scratch")
    try:
        _run([exe, "add", work, str(archive), "/"], f"buildah add {archive}")
        ann = [a for key in CHECKPOINT_ANNOTATIONS for a in ("--annotation", f"{key}={container}")]
        # podman restores an image only when it names the OCI runtime too ("image is not a checkpoint")
        ann += ["--annotation", f"{PODMAN_RUNTIME_ANNOTATION}={oci_runtime}"]
        _run([exe, "config", *ann, work], "buildah config")
        return _run([exe, "commit", "--quiet", work, image], f"buildah commit {image}")
    finally:
        subprocess.run([exe, "rm", work], capture_output=True, timeout=60)


def image_annotations(image: str, podman: str = "podman") -> dict[str, str]:
    """The annotations of a local image (to check a checkpoint image)."""
    r = subprocess.run([podman, "image", "inspect", "--format", "json", image], capture_output=True, text=True,
                       timeout=60)
    return (json.loads(r.stdout)[0].get("Annotations") or {}) if r.returncode == 0 else {}


class KubeApi:
    """The few API-server calls a pod restore makes: get, create and delete one pod.

    Args:
        base_url: the API server (default: in-cluster, from KUBERNETES_SERVICE_HOST/PORT).
        token_file: a ServiceAccount token allowed to get/create/delete pods (rendered rbac.yaml).
    """

    def __init__(self, base_url: str | None = None, *, token_file: str | None = SA_TOKEN, timeout_s: float = 60):
        import os

        if base_url is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise RunnerUnavailable("no API server to restore a pod through (not in a cluster, and the workload's "
                                        "container.kubernetes.api_url is not set)",
                                        fix="run the node agent in the cluster (rendered daemonset.yaml) or set api_url")
            base_url = f"https://{host}:{port}"
        self.base_url = base_url.rstrip("/")
        self.token_file = token_file
        self.verify: str | bool = SA_CA if Path(SA_CA).exists() else True
        self.timeout_s = timeout_s

    def _headers(self) -> dict:
        if self.token_file and Path(self.token_file).exists():
            return {"Authorization": f"Bearer {Path(self.token_file).read_text().strip()}"}
        return {}

    def _call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            return httpx.request(method, f"{self.base_url}{path}", json=body, headers=self._headers(),
                                 verify=self.verify, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise RunnerUnavailable(f"API server {self.base_url}: {method} {path} failed: {e}",
                                    fix="check the node agent's network and its ServiceAccount") from None

    def get_pod(self, namespace: str, name: str) -> dict | None:
        r = self._call("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise RunnerUnavailable(f"API server: get pod {namespace}/{name}: {r.status_code} {r.text[:300]}",
                                    fix="give the node agent get on pods (rendered rbac.yaml)")
        return r.json()

    def create_pod(self, namespace: str, manifest: dict) -> dict:
        r = self._call("POST", f"/api/v1/namespaces/{namespace}/pods", manifest)
        if r.status_code not in (200, 201, 202):
            raise RestoreFailed(f"API server: create pod {namespace}/{manifest['metadata']['name']}: "
                                f"{r.status_code} {r.text[:300]}",
                                fix="give the node agent create on pods (rendered rbac.yaml); see the pod's events")
        return r.json()

    def delete_pod(self, namespace: str, name: str) -> None:
        r = self._call("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}?gracePeriodSeconds=0")
        if r.status_code not in (200, 202, 404):
            raise RunnerUnavailable(f"API server: delete pod {namespace}/{name}: {r.status_code} {r.text[:300]}",
                                    fix="give the node agent delete on pods (rendered rbac.yaml)")
