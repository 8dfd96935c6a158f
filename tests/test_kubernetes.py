"""Kubernetes for a pod-based fleet (docs/kubernetes.md): every rendered manifest validated against
the Kubernetes JSON schema (kubernetes-validate, offline); the kubelet checkpoint client against a
local stand-in for the kubelet; the checkpoint image a restore pod names, built from a real
container checkpoint and restored (by podman, which reads the format CRI-O reads).

Not run here (no cluster): a real kubelet's checkpoint, and CRI-O/containerd restoring the pod."""

import json
import secrets
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PODS = ROOT / "deployments" / "example-pods-fleet.yaml"
EXAMPLE = ROOT / "deployments" / "example-h200-fleet.yaml"
API = "http://prefect.internal:4200/api"
# The oldest release with the checkpoint API on by default (beta), and the newest schema shipped.
K8S_VERSIONS = ("1.30.0", "1.37.0")


def _validate(doc: dict) -> None:
    import kubernetes_validate

    for v in K8S_VERSIONS:
        kubernetes_validate.validate(doc, v, strict=True)  # raises ValidationError naming the field


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_pod_fleet_manifests_validate_against_the_kubernetes_schema(tmp_path):
    from ckptflow.deploy import render_node_workers

    files = render_node_workers(PODS, ROOT, api_url=API, image="ckptflow:0.1.0", out_dir=tmp_path)
    (ds_file,) = files["kubernetes"]
    rbac, restore = files["pods"]
    assert rbac.name == "rbac.yaml" and restore.relative_to(tmp_path).as_posix() == "kubernetes/restore/chat-pod.yaml"
    docs = {p.name: _docs(p) for p in (ds_file, rbac, restore)}
    for path_docs in docs.values():
        for d in path_docs:
            _validate(d)
    # The node agent: the ServiceAccount, the node's IP for its kubelet, the kubelet's checkpoint
    # directory and the node's containers-storage (checkpoint images are built into it).
    (ds,) = docs["daemonset.yaml"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ckptflow-node-agent" and pod["hostNetwork"] is True
    c = pod["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["CKPTFLOW_KUBELET_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    vols = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: vols[m["name"]] for m in c["volumeMounts"]}
    assert mounts["/var/lib/kubelet/checkpoints"] == "/var/lib/kubelet/checkpoints"
    assert mounts["/var/lib/containers/storage"] == "/var/lib/containers/storage"
    # RBAC: the kubelet authorizes POST /checkpoint/... as create on nodes/checkpoint.
    kinds = {d["kind"]: d for d in docs["rbac.yaml"]}
    assert set(kinds) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    rules = {r["resources"][0]: set(r["verbs"]) for r in kinds["ClusterRole"]["rules"]}
    assert rules["nodes/checkpoint"] == {"create"} and {"create", "delete"} <= rules["pods"]
    assert kinds["ClusterRoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "ckptflow-node-agent",
                                                       "namespace": "ckptflow"}]
    # The restore pod: on the node holding the checkpoint image, never pulled, never restarted.
    (rp,) = docs["chat-pod.yaml"]
    assert rp["metadata"]["namespace"] == "serving" and rp["spec"]["nodeName"] == "cpu-node-01"
    (rc,) = rp["spec"]["containers"]
    assert rc["name"] == "llama-server" and rc["imagePullPolicy"] == "Never"
    assert rc["image"] == "localhost/ckptflow-restore/chat-pod:CHECKPOINT" and rp["spec"]["restartPolicy"] == "Never"
    assert rc["ports"] == [{"containerPort": 8000, "protocol": "TCP"}]
    assert rc["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}


def test_a_restore_pod_for_a_real_checkpoint_validates(tmp_path):
    from ckptflow.fleet import load_fleet
    from ckptflow.kubernetes import restore_pod

    w = load_fleet(PODS).workload("chat-pod")
    doc = yaml.safe_load(restore_pod(w, "20261130T120000Z-1a2b3c4d", "k8s-node-7"))
    _validate(doc)
    assert doc["metadata"]["name"] == "chat-pod-0-r-1a2b3c4d"
    assert doc["metadata"]["labels"]["ckptflow.io/checkpoint"] == "20261130T120000Z-1a2b3c4d"
    assert doc["spec"]["containers"][0]["image"] == "localhost/ckptflow-restore/chat-pod:20261130T120000Z-1a2b3c4d"


def test_a_fleet_without_pods_renders_the_daemonset_as_before(tmp_path):
    from ckptflow.deploy import render_node_workers

    files = render_node_workers(EXAMPLE, ROOT, api_url=API, out_dir=tmp_path)
    assert "pods" not in files and not (tmp_path / "kubernetes" / "rbac.yaml").exists()
    for d in _docs(files["kubernetes"][0]):
        _validate(d)
        assert "serviceAccountName" not in d["spec"]["template"]["spec"]


class _Kubelet(BaseHTTPRequestHandler):
    """A stand-in for the kubelet's checkpoint endpoint: answers with ``status`` and records requests."""

    status = 200
    seen: list = []

    def do_POST(self):
        type(self).seen.append({"path": self.path, "auth": self.headers.get("Authorization")})
        if self.status == 200:
            parts = self.path.split("?")[0].split("/")  # /checkpoint/ns/pod/container
            body = {"items": [f"/var/lib/kubelet/checkpoints/checkpoint-{parts[3]}_{parts[2]}-{parts[4]}-2026.tar"]}
            data = json.dumps(body).encode()
        else:
            data = {404: b"404 page not found", 403: b"Forbidden (user=system:serviceaccount:x, verb=create, "
                    b"resource=nodes, subresource=checkpoint)", 500: b"checkpoint/restore support not "
                    b"available"}[self.status]
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def kubelet():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Kubelet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _Kubelet.seen = []
    yield srv
    srv.shutdown()
    srv.server_close()


def test_kubelet_checkpoint_client_speaks_kep_2008(tmp_path, kubelet):
    from ckptflow.errors import CriuError, RunnerUnavailable, WorkloadNotFound
    from ckptflow.runners.kubelet import KubeletCheckpointApi

    token = tmp_path / "token"
    token.write_text("sa-token\n")
    api = KubeletCheckpointApi(f"http://127.0.0.1:{kubelet.server_address[1]}", token_file=str(token), timeout_s=90)
    _Kubelet.status = 200
    assert api.checkpoint("serving", "chat-pod-0", "llama-server") == [
        "/var/lib/kubelet/checkpoints/checkpoint-chat-pod-0_serving-llama-server-2026.tar"]
    assert _Kubelet.seen == [{"path": "/checkpoint/serving/chat-pod-0/llama-server?timeout=90",
                              "auth": "Bearer sa-token"}]
    for status, err, fix in ((404, WorkloadNotFound, "ContainerCheckpoint"), (403, RunnerUnavailable, "nodes/checkpoint"),
                             (500, CriuError, "enable_criu_support")):
        _Kubelet.status = status
        with pytest.raises(err) as e:
            api.checkpoint("serving", "chat-pod-0", "llama-server")
        assert fix in e.value.fix, (status, e.value)
    _Kubelet.status = 200


@pytest.mark.criu
@pytest.mark.slow
def test_checkpoint_image_of_a_real_checkpoint_restores_the_container(tmp_path):
    """The archive a checkpoint stores (the same format the kubelet writes through CRI-O), turned
    into the checkpoint image a restore pod names, restores the container with its state."""
    from test_container import CPORT, DemoContainer
    from ckptflow.runners.container import IMAGE_FILE, free_port
    from ckptflow.runners.kubelet import CHECKPOINT_ANNOTATIONS, build_checkpoint_image, image_annotations
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.rootfs import demo_image
    from ckptflow.store.local import LocalStore

    c = DemoContainer(demo_image(), tmp_path, "chat").start(tmp_path / "store")
    image = f"localhost/ckptflow-restore/chat:t{secrets.token_hex(3)}"
    copy, port = f"{c.cname}-img", free_port()
    try:
        c.complete("a session that goes into an image " * 15, 16, "s")
        store = LocalStore(tmp_path / "store")
        with NodeRunner(store) as node:
            m = node.checkpoint(c.workload)
        build_checkpoint_image(store.images_dir(m) / IMAGE_FILE, c.cname, image)
        ann = image_annotations(image)
        assert all(ann[k] == c.cname for k in CHECKPOINT_ANNOTATIONS)
        from ckptflow.runners.container import Podman

        Podman(c.workload.container).call(
            ["--runtime", "runc", "container", "restore", "--name", copy, "--publish", f"127.0.0.1:{port}:{CPORT}",
             "--ignore-static-ip", "--ignore-static-mac", image], "restore from image")
        from ckptflow.demo import launch

        assert launch.session_digests(port) == m.probe["sessions"] == c.digests()
        assert launch.complete(port, "next", 16, "s") == c.complete("next", 16, "s")
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", copy], capture_output=True)
        c.remove()
        subprocess.run(["podman", "rmi", image], capture_output=True)
