"""The node image `ckptflow deploy`'s DaemonSet names, built here from local files (no registry):
deployments/node-image/Containerfile FROM a rootfs of this machine's Python, the venv's packages,
CRIU and tools (ckptflow/nodeimage.py, scripts/build-node-image.sh)."""

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.criu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
WORKDIR = "/srv/ckptflow"


def _run_in(image: str, *cmd: str, privileged: bool = False) -> subprocess.CompletedProcess:
    extra = ["--privileged", "--pid", "host"] if privileged else []
    return subprocess.run(["podman", "run", "--rm", "--runtime", "runc", "--ulimit", "nofile=20000:20000",
                           "--ulimit", "nproc=32768:32768", *extra, image, *cmd],
                          capture_output=True, text=True, timeout=300)


def test_node_image_runs_the_daemonsets_command_and_passes_doctor(tmp_path):
    from ckptflow.deploy import render_node_workers

    tag = f"localhost/ckptflow:test-{secrets.token_hex(3)}"
    out = subprocess.run([sys.executable, "-m", "ckptflow.nodeimage", tag, "--workdir", WORKDIR], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    try:
        info = json.loads(subprocess.run(["podman", "image", "inspect", "--format", "json", tag],
                                         capture_output=True, text=True, check=True).stdout)[0]
        assert info["Config"]["WorkingDir"] == WORKDIR
        # The DaemonSet ckptflow deploy renders for this image: its command runs in it as written.
        (ds_file,) = render_node_workers(ROOT / "deployments" / "example-h200-fleet.yaml", ROOT, image=tag,
                                         api_url="http://prefect.example.internal:4200/api", out_dir=tmp_path)["kubernetes"]
        c = next(d for d in yaml.safe_load_all(ds_file.read_text()) if d)["spec"]["template"]["spec"]["containers"][0]
        assert c["image"] == tag
        prefect = c["command"][0].replace(str(ROOT), WORKDIR)  # deploy --workdir /srv/ckptflow renders this path
        assert prefect == f"{WORKDIR}/.venv/bin/prefect"
        v = _run_in(tag, prefect, "--no-prompt", "version")
        assert v.returncode == 0 and "Version:" in v.stdout, v.stderr
        imp = _run_in(tag, f"{WORKDIR}/.venv/bin/python", "-c",
                      "import ckptflow, ckptflow.flows.heartbeat, boto3, numpy; print(ckptflow.__file__)")
        assert imp.stdout.strip() == f"{WORKDIR}/ckptflow/__init__.py", imp.stderr
        # What the node worker needs, as `ckptflow doctor` sees it on a privileged node (DaemonSet: privileged, hostPID).
        doc = _run_in(tag, "ckptflow", "doctor", privileged=True)
        assert doc.returncode == 0, doc.stdout + doc.stderr
        for line in ("criu >= 4.2", "criu check", "criu-ns (sandbox restores)", "nft (TCP network lock)"):
            row = next(r for r in doc.stdout.splitlines() if line in r)
            assert "│ ok" in row, row
    finally:
        subprocess.run(["podman", "rmi", tag], capture_output=True, timeout=120)
