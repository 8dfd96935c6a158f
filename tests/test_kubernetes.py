"""Kubernetes for a pod-based fleet (docs/kubernetes.md): every rendered manifest validated against
the Kubernetes JSON schema (kubernetes-validate, offline); the kubelet checkpoint client against a
local stand-in for the kubelet; the checkpoint image a restore pod names, built from a real
container checkpoint and restored (by podman, which reads the format CRI-O reads).

The node runner's pod path (runners/pod.py) runs end to end against stand-ins for the kubelet and
the API server that do with podman what CRI-O does. Not run here (no cluster): a real kubelet's
checkpoint, a real API server, and CRI-O/containerd restoring the pod."""

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
    # The node agent: the ServiceAccount, the kubelet's checkpoint directory and the node's
    # containers-storage (checkpoint images are built into it); hostNetwork reaches its kubelet.
    # One DaemonSet per node pool, and one pool per node (a node step must run on its own node).
    dss = docs["daemonset.yaml"]
    assert [d["metadata"]["name"] for d in dss] == [f"ckptflow-prefect-worker-example-pods-cpu-node-0{i}" for i in (1, 2)]
    ds = dss[0]
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ckptflow-node-agent" and pod["hostNetwork"] is True
    c = pod["containers"][0]
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
    assert rc["ports"] == [{"containerPort": 8000, "hostPort": 18101, "protocol": "TCP"}]
    assert rc["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}


def test_a_restore_pod_for_a_real_checkpoint_validates(tmp_path):
    from ckptflow.fleet import load_fleet
    from ckptflow.kubernetes import restore_pod

    w = load_fleet(PODS).workload("chat-pod")
    doc = yaml.safe_load(restore_pod(w, "20261130T120000Z-1a2b3c4d", "k8s-node-7"))
    _validate(doc)
    assert doc["metadata"]["name"] == "chat-pod-0"  # the declared name: the next heartbeat finds it
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

        assert launch.session_digests(port) == m.probe.sessions == c.digests()
        assert launch.complete(port, "next", 16, "s") == c.complete("next", 16, "s")
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", copy], capture_output=True)
        c.remove()
        subprocess.run(["podman", "rmi", image], capture_output=True)


class _Cluster:
    """Stand-ins for one node's kubelet and the API server, on 127.0.0.1, that do what CRI-O does with
    podman: a checkpoint call exports the pod's container into the kubelet's checkpoint directory; a
    pod created from a checkpoint image is restored from it; get reports the container's state as the
    pod's phase; delete removes it. A pod is a podman container named after it."""

    def __init__(self, tmp_path: Path, names: dict):
        self.dir = tmp_path / "kubelet-checkpoints"
        self.dir.mkdir()
        self.names = names  # (namespace, pod) -> podman container name
        self.calls: list[str] = []
        cluster = self

        class H(BaseHTTPRequestHandler):
            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                path = self.path.split("?")[0].split("/")
                cluster.calls.append(f"POST {self.path}")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if path[1] == "checkpoint":  # kubelet: /checkpoint/ns/pod/container
                    out = cluster.dir / f"checkpoint-{path[3]}_{path[2]}-{path[4]}-{secrets.token_hex(2)}.tar"
                    r = subprocess.run(["podman", "container", "checkpoint", "--leave-running", "--compress", "none",
                                        "--export", str(out), cluster.names[(path[2], path[3])]],
                                       capture_output=True, text=True)
                    return self._send(200 if r.returncode == 0 else 500, {"items": [str(out)]} if r.returncode == 0
                                      else {"message": r.stderr})
                pod = json.loads(body)  # API server: /api/v1/namespaces/ns/pods
                (c,) = pod["spec"]["containers"]
                (p,) = c["ports"]
                name = cluster.names[(path[4], pod["metadata"]["name"])]
                r = subprocess.run(["podman", "--runtime", "runc", "container", "restore", "--name", name,
                                    "--publish", f"127.0.0.1:{p['hostPort']}:{p['containerPort']}",
                                    "--ignore-static-ip", "--ignore-static-mac", c["image"]],
                                   capture_output=True, text=True)
                self._send(201 if r.returncode == 0 else 500, pod if r.returncode == 0 else {"message": r.stderr})

            def do_GET(self):
                path = self.path.split("?")[0].split("/")
                name = cluster.names.get((path[4], path[6]))
                r = subprocess.run(["podman", "container", "inspect", "--format", "{{.State.Status}}", name or "-"],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    return self._send(404, {"reason": "NotFound"})
                phase = {"running": "Running", "created": "Pending"}.get(r.stdout.strip(), "Failed")
                self._send(200, {"metadata": {"name": path[6]}, "status": {"phase": phase}})

            def do_DELETE(self):
                path = self.path.split("?")[0].split("/")
                cluster.calls.append(f"DELETE {self.path}")
                subprocess.run(["podman", "rm", "-f", "-t", "0", cluster.names[(path[4], path[6])]],
                               capture_output=True)
                self._send(200, {})

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def stop(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.mark.criu
@pytest.mark.slow
def test_pod_workload_heartbeat_and_recover_through_kubelet_and_api_stand_ins(tmp_path, prefect_harness, demo_worker):
    """The node runner's pod path end to end, against stand-ins (no cluster here): the heartbeat
    calls the kubelet's checkpoint API and stores the archive it wrote; after the pod's container
    dies, recover deletes the dead pod, builds the checkpoint image and creates the restore pod
    through the API server; the session continues exactly."""
    from conftest import write_fleet
    from test_container import DemoContainer
    from ckptflow.container_models import KubernetesPod
    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover
    from ckptflow.flows.verify import verify
    from ckptflow.runners.rootfs import demo_image

    c, ref = DemoContainer(demo_image(), tmp_path, "chat"), demo_worker("ref")
    c.start(tmp_path / "store")
    cluster = _Cluster(tmp_path, {("serving", "chat-0"): c.cname})
    token = tmp_path / "token"
    token.write_text("sa-token")
    k = KubernetesPod(namespace="serving", pod="chat-0", container="worker", kubelet_url=cluster.url,
                      api_url=cluster.url, token_file=str(token))
    c.workload = c.workload.model_copy(update={"container": c.workload.container.model_copy(update={"kubernetes": k})})
    fleet = str(write_fleet(tmp_path / "fleet.yaml", [c.workload], tmp_path / "store"))
    row = None
    try:
        for x in (c, ref):
            x.complete("a long session in a pod " * 20, 24, "s")
        row = heartbeat(fleet, force=True)[0]
        assert row["ok"], row
        assert cluster.calls == ["POST /checkpoint/serving/chat-0/worker?timeout=600"]
        assert list(cluster.dir.iterdir()) == []  # the archive moved into the store
        assert verify(fleet)[0]["state"] == "skipped"
        c.complete("lost with the pod", 8, "s")
        c.kill()
        res = recover(fleet, "chat")
        assert res["checkpoint"] == row["checkpoint"] and not res["cold_start"]
        assert cluster.calls[1:] == ["DELETE /api/v1/namespaces/serving/pods/chat-0?gracePeriodSeconds=0",
                                     "POST /api/v1/namespaces/serving/pods"]
        assert c.digests() == ref.digests()
        assert c.complete("the pod goes on", 32, "s") == ref.complete("the pod goes on", 32, "s")
    finally:
        cluster.stop()
        c.remove()
        if row is not None:
            subprocess.run(["podman", "rmi", f"localhost/ckptflow-restore/chat:{row['checkpoint']}"], capture_output=True)


def test_a_fleet_file_outside_the_project_is_mounted_where_the_flow_runs_open_it(tmp_path):
    """Issue #36 finding 9: the DaemonSet mounted no fleet file, so with one kept outside the
    project (/etc/ckptflow/fleet.yaml) every flow run of the pod's worker found none. The image
    holds the project, so a fleet file inside it needs no mount."""
    from ckptflow.deploy import render_node_workers, render_prefect_yaml

    etc = tmp_path / "etc" / "ckptflow"   # stands in for /etc/ckptflow, outside the project
    etc.mkdir(parents=True)
    f = etc / "fleet.yaml"
    f.write_text(EXAMPLE.read_text())
    (ds_file,) = render_node_workers(f, ROOT, api_url=API, out_dir=tmp_path / "w")["kubernetes"]
    opened = {d["work_pool"]["name"]: d["parameters"]["fleet_file"]       # what each pool's flow runs open
              for d in yaml.safe_load(render_prefect_yaml(f, ROOT).read_text())["deployments"]}
    assert set(opened.values()) == {str(f)}
    docs = _docs(ds_file)
    assert len(docs) == 8
    for d in docs:
        _validate(d)
        pod = d["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        vols = {v["name"]: v["hostPath"] for v in pod["volumes"]}
        fleet_mounts = [m for m in c["volumeMounts"] if m["name"] == "fleet-file"]
        assert fleet_mounts == [{"name": "fleet-file", "mountPath": str(etc), "readOnly": True}]
        assert vols["fleet-file"] == {"path": str(etc), "type": "Directory"}   # the same path on the host
        # The container's worker runs its pool's flow runs in workingDir: the path they open is the mounted one.
        pool = pod["nodeSelector"]["ckptflow.io/work-pool"]
        assert c["command"][c["command"].index("--pool") + 1] == pool and c["workingDir"] == str(ROOT)
        assert Path(c["workingDir"], opened[pool]).parent == etc
    assert f"the fleet file {f}" in ds_file.read_text()                  # the header says it must be on every node
    # Inside the project: the image has it, nothing is mounted for it.
    (inside,) = render_node_workers(EXAMPLE, ROOT, api_url=API, out_dir=tmp_path / "in")["kubernetes"]
    for d in _docs(inside):
        assert "fleet-file" not in {v["name"] for v in d["spec"]["template"]["spec"]["volumes"]}


def test_a_fleet_file_in_a_directory_the_image_has_is_mounted_alone(tmp_path):
    """A fleet file right in /etc or /tmp: mounting the host's directory over the image's would hide
    the image's own files, so the file alone is mounted."""
    from ckptflow.deploy import render_node_workers

    f = Path("/tmp") / f"ckptflow-test-{secrets.token_hex(4)}.yaml"
    f.write_text(EXAMPLE.read_text())
    try:
        (ds_file,) = render_node_workers(f, ROOT, api_url=API, out_dir=tmp_path / "w")["kubernetes"]
    finally:
        f.unlink()
    for d in _docs(ds_file):
        _validate(d)
        pod = d["spec"]["template"]["spec"]
        assert {"name": "fleet-file", "mountPath": str(f), "readOnly": True} in pod["containers"][0]["volumeMounts"]
        assert {"name": "fleet-file", "hostPath": {"path": str(f), "type": "File"}} in pod["volumes"]
