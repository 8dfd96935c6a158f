"""The node image that ``ckptflow deploy``'s DaemonSet names, built from this machine's own files.

No registry is reachable from these machines, so nothing is pulled and nothing is pip-installed
in the build: a base rootfs (ckptflow.runners.rootfs) holds this Python, the project venv's
site-packages (less the test and simulation extras), CRIU >= 4.2 with criu-ns, ip, ss, nft and
buildah (checkpoint images for pod workloads) with every library they load; it is ``podman
import``ed as ``localhost/ckptflow-node-base:<digest of its inputs>``, and
``deployments/node-image/Containerfile`` adds the project at ``--workdir`` (the path the
DaemonSet runs in, default /srv/ckptflow) with a ``.venv/bin`` holding ``python``, ``prefect`` and
``ckptflow``, exactly the paths the rendered DaemonSet's command uses. No RUN step: the build
needs no shell and no network.

Build it (as root; about a minute the first time, the base is reused while its inputs stay):

    ./scripts/build-node-image.sh                       # -> localhost/ckptflow:<version>
    ./scripts/build-node-image.sh localhost/ckptflow:dev --workdir /srv/ckptflow

Example:
    >>> build_node_image("localhost/ckptflow:0.1.0", workdir="/srv/ckptflow")   # doctest: +SKIP
    'localhost/ckptflow:0.1.0'
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import ckptflow
from ckptflow.errors import RunnerUnavailable
from ckptflow.runners.rootfs import build_rootfs, image_exists, import_rootfs, inputs_digest, prune_tags

BASE_REPO = "localhost/ckptflow-node-base"
CONTAINERFILE = Path("deployments/node-image/Containerfile")
DEFAULT_WORKDIR = "/srv/ckptflow"
# What a node worker runs: CRIU (criu-ns for sandbox copies), iproute2 (netns, ss -K), nft (CRIU's
# network lock), env (criu-ns's #!/usr/bin/env python3); buildah only where it is installed.
BINARIES = ("criu", "criu-ns", "ip", "ss", "nft")
OPTIONAL_BINARIES = ("buildah",)
# The test and simulation extras, and the project's own editable install (the image holds the
# project at its workdir and a .pth naming it instead).
SITE_EXCLUDE = ("__editable__*", "ckptflow-*.dist-info", "seaweedfs*", "matplotlib*", "mpl_toolkits", "hypothesis*",
                "_pytest", "pytest*", "py.py", "kubernetes_validate*", "_hypothesis*")
PROJECT_FILES = ("ckptflow", "deployments", "scripts", "pyproject.toml", "README.md")
ENTRY_POINTS = ("prefect", "ckptflow")


def _run(cmd: list[str], what: str, timeout_s: float = 900) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RunnerUnavailable(f"{what} failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-800:]}",
                                fix="run ./scripts/setup.sh as root (podman, CRIU, the venv)")
    return r.stdout.strip()


def base_image(runtime: str = "podman", work_dir: Path = Path(".ckptflow/containers")) -> str:
    """The base rootfs image (interpreter, site-packages, binaries), built and imported when its tag is missing."""
    site = Path(sysconfig.get_paths()["purelib"])
    binaries = [b for b in BINARIES] + [b for b in OPTIONAL_BINARIES if shutil.which(b)]
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    files = [(site, f"usr/local/lib/{ver}/site-packages")]
    for p in ("/usr/bin/env", "/etc/containers/policy.json", "/etc/containers/registries.conf",
              "/etc/containers/storage.conf"):
        if Path(p).exists():
            files.append((Path(os.path.realpath(p)), p.lstrip("/")))
    h = hashlib.sha256(inputs_digest(binaries=binaries, files=files).encode())
    for entry in sorted(site.iterdir()):  # the venv's packages and their versions
        h.update(entry.name.encode())
    tag = f"{BASE_REPO}:{h.hexdigest()[:12]}"
    if image_exists(runtime, tag):
        return tag
    tar = build_rootfs(work_dir / f"node-base-{tag.rsplit(':', 1)[1]}.tar", binaries=binaries, with_ckptflow=False,
                       files=files, exclude=SITE_EXCLUDE)
    try:
        import_rootfs(runtime, tar, tag)
    finally:
        tar.unlink(missing_ok=True)
    prune_tags(runtime, BASE_REPO, keep=tag)
    return tag


def _context(project: Path, ctx: Path, workdir: str) -> None:
    """The build context: the project's files, the venv's entry points, the .pth naming the workdir."""
    shutil.rmtree(ctx, ignore_errors=True)
    (ctx / "project").mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.workers", "prefect.*.yaml")
    for name in PROJECT_FILES:
        src = project / name
        if src.is_dir():
            shutil.copytree(src, ctx / "project" / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, ctx / "project" / name)
    vbin = ctx / "venv-bin"
    vbin.mkdir()
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    os.symlink(f"/usr/local/bin/{ver}", vbin / "python")
    os.symlink("python", vbin / "python3")
    here = Path(sys.prefix) / "bin"
    for name in ENTRY_POINTS:
        text = (here / name).read_text()
        body = text.split("\n", 1)[1] if text.startswith("#!") else text
        (vbin / name).write_text(f"#!{workdir}/.venv/bin/python\n{body}")
        (vbin / name).chmod(0o755)
    (ctx / "ckptflow-project.pth").write_text(workdir + "\n")


def build_node_image(tag: str | None = None, *, workdir: str = DEFAULT_WORKDIR, project: Path = Path("."),
                     runtime: str = "podman") -> str:
    """Build the node image ``tag`` (default ``localhost/ckptflow:<version>``: what ``ckptflow deploy``
    names by default resolves to it on a node without a registry) from local files; return the tag.

    Raises:
        RunnerUnavailable: podman, a binary or the venv is missing, or the build failed.
    """
    tag = tag or f"localhost/ckptflow:{ckptflow.__version__}"
    project = project.resolve()
    if not (project / "ckptflow" / "flows" / "heartbeat.py").exists():
        raise RunnerUnavailable(f"{project} does not hold the ckptflow project", fix="run it from the repository root")
    base = base_image(runtime, project / ".ckptflow" / "containers")
    ctx = project / ".ckptflow" / "containers" / "node-context"
    _context(project, ctx, workdir)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    _run([runtime, "build", "--quiet", "--file", str(project / CONTAINERFILE), "--build-arg", f"BASE={base}",
          "--build-arg", f"WORKDIR={workdir}", "--build-arg", f"PYVER={ver}", "--tag", tag, str(ctx)],
         f"{runtime} build {tag}")
    shutil.rmtree(ctx, ignore_errors=True)
    return tag


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptflow.nodeimage", description=__doc__.split("\n\n")[0])
    p.add_argument("tag", nargs="?", help="image tag (default: localhost/ckptflow:<version>)")
    p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="the project's path in the image (deploy --workdir)")
    p.add_argument("--runtime", default="podman")
    a = p.parse_args(argv)
    print(build_node_image(a.tag, workdir=a.workdir, runtime=a.runtime))
    return 0


if __name__ == "__main__":
    sys.exit(main())
