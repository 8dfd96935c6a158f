"""vLLM's OpenAI server in a podman container, checkpointed through the container runtime
(runners/container.py: podman + runc + CRIU), without a registry and without copying vLLM.

The image holds only what the host's vLLM loads from the system: the C library, libstdc++,
libgomp, libnuma, zlib, ... (everything ``ldd`` finds for the venv's and the interpreter's
ELF files outside those two trees) and ``/bin/sh``. vLLM's virtualenv, the Python it links to
and the model are bind-mounted read-only at the paths they have on the node, so the command
line is the node's own (``engines.vllm.server_args``) with ``--host 0.0.0.0``.

What a container needs beyond the process case (docs/engines/vllm.md, "vLLM in a container"):
- CRIU's options reach CRIU through runc's CRIU config file: ``--annotation
  org.criu.config=FILE`` (``link-remap``, ``ext-unix-sk``, ``file-locks``; podman itself
  passes ``--tcp-established``). The annotation is in the exported config, so a restore reads
  the same file: it must exist on every node the container may be restored on.
- ``/dev/shm`` is the container's own tmpfs (``--shm-size``), dumped and restored with it.
- ``--enforce-eager``: the inductor backend compiles C++ at start (g++ is not in the image);
  the reference engine must run with the same flag, or its numbers (and tokens) may differ.

Example:
    >>> inst = vllm.require_install()                                    # doctest: +SKIP
    >>> img = base_image(inst)
    >>> w = container_workload("chat-c", img, inst, model, host_port=18200, criu_conf=write_criu_config(p))
    >>> start(w, shm_size="1g")
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

from ckptflow.container_models import ContainerSpec, Mount, PortMap
from ckptflow.engines import vllm
from ckptflow.errors import CkptflowError, RunnerUnavailable
from ckptflow.models import VLLM_CRIU, GoldenRequest, Workload

REPO_NAME = "localhost/ckptflow-vllm-base"
CPORT = 8000                       # vLLM's port inside the container
EAGER = ["--enforce-eager"]        # no C++ compiler in the image: no inductor (reference: same flag)
SHM_SIZE = "1g"                    # vLLM's rings are sparse (~400 MiB apparent); podman's 64m is the default
CRIU_CONF_OPTIONS = ("link-remap", "ext-unix-sk", "file-locks")
CRIU_ANNOTATION = "org.criu.config"
# gloo (torch.distributed, even at TP=1) listens on the address the container's hostname resolves
# to; a restore under a new IP then fails: "inet: Can't bind inet socket: Cannot assign requested
# address" (measured). On loopback it exists in every network namespace.
NET_ENV = {"GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}
BINARIES = ["lscpu"]               # vLLM's CPU worker runs `lscpu` to find its CPUs
_LDD = re.compile(r"^\s*(\S+)\s+=>\s+(/\S+)\s+\(0x[0-9a-f]+\)")


def python_prefix(inst: vllm.VllmInstall) -> Path:
    """The installation the venv's interpreter belongs to (``/root/.pyenv/versions/3.11.7``)."""
    return Path(os.path.realpath(inst.python)).parents[1]


def venv_prefix(inst: vllm.VllmInstall) -> Path:
    return Path(os.path.realpath(inst.prefix))


def system_libs(inst: vllm.VllmInstall) -> dict[str, Path]:
    """soname -> file of every shared library the venv's and its interpreter's ELF files load
    from outside those two trees (what the image must hold)."""
    roots = [venv_prefix(inst), python_prefix(inst)]
    elves = [str(roots[1] / "bin" / os.path.basename(os.path.realpath(inst.python)))]
    for root in roots:
        for dirpath, _, files in os.walk(root):
            elves += [os.path.join(dirpath, f) for f in files if ".so" in f]
    out: dict[str, Path] = {}
    for i in range(0, len(elves), 200):
        r = subprocess.run(["ldd", *elves[i:i + 200]], capture_output=True, text=True, timeout=300)
        for line in r.stdout.splitlines():
            m = _LDD.match(line)
            if m and not any(m.group(2).startswith(str(x) + os.sep) for x in roots):
                out.setdefault(m.group(1), Path(os.path.realpath(m.group(2))))
    return out


def base_image(inst: vllm.VllmInstall, runtime: str = "podman", work_dir: Path | None = None) -> str:
    """The small image vLLM runs in (system libraries, /bin/sh, the loader), tagged with a digest
    of what it holds; built from local files and imported only when that tag is missing."""
    from ckptflow.runners.rootfs import build_rootfs, image_exists, import_rootfs

    libs = system_libs(inst)
    files = [(p, f"usr/lib/{name}") for name, p in sorted(libs.items())]
    files.append((Path(os.path.realpath("/bin/sh")), "bin/sh"))
    h = hashlib.sha256(sys.version.encode() + " ".join(BINARIES).encode())
    for src, arc in files:
        h.update(f"{src}:{arc}:{src.stat().st_size}".encode())
    tag = f"{REPO_NAME}:{h.hexdigest()[:12]}"
    if image_exists(runtime, tag):
        return tag
    work_dir = work_dir or vllm.REPO / ".ckptflow" / "containers"
    tar = build_rootfs(work_dir / f"vllm-base-{tag.rsplit(':', 1)[1]}.tar", with_ckptflow=False, files=files,
                       binaries=BINARIES)
    try:
        import_rootfs(runtime, tar, tag)
    finally:
        tar.unlink(missing_ok=True)
    return tag


# CRIU deletes the link-remap file it made for vLLM's semaphore (dev/shm/link_remap.N) at the end
# of a --leave-running dump, and podman tars the container's /dev/shm only after the dump, so a
# heartbeat fails to restore: "Can't link dev/shm/link_remap.N -> dev/shm/sem.XXXXXX: No such
# file or directory" (measured). This action script (runc's CRIU config: action-script) copies it
# into the checkpoint directory at post-dump, while the tree is frozen, and puts it into the new
# container's /dev/shm (userdata/shm, which podman has filled from the export) at pre-restore.
# It runs on the node, as CRIU does; CRTOOLS_IMAGE_DIR is podman's userdata/checkpoint.
ACTION_SCRIPT = """#!/bin/sh
# ckptflow: keep vLLM's link-remap file across a podman checkpoint --leave-running (engines/vllm_container.py)
dir=$(readlink -f "$CRTOOLS_IMAGE_DIR") || exit 0
case "$CRTOOLS_SCRIPT_ACTION" in
post-dump)
  mkdir -p "$dir/ckptflow-link-remap" || exit 1
  for f in /proc/"$CRTOOLS_INIT_PID"/root/dev/shm/link_remap.*; do
    [ -e "$f" ] && { cp -a "$f" "$dir/ckptflow-link-remap/" || exit 1; }
  done ;;
pre-restore)
  for f in "$dir"/ckptflow-link-remap/link_remap.*; do
    [ -e "$f" ] && { cp -a "$f" "$dir/../shm/" || exit 1; }
  done ;;
esac
exit 0
"""


def write_criu_config(path: Path, options: tuple[str, ...] = CRIU_CONF_OPTIONS) -> Path:
    """runc's CRIU config file (one option a line, without the dashes) and its action script
    beside it (``<path>.action.sh``); the container's ``org.criu.config`` annotation names the
    file, and runc hands it to CRIU on checkpoint and restore."""
    path.parent.mkdir(parents=True, exist_ok=True)
    script = path.with_name(path.name + ".action.sh")
    script.write_text(ACTION_SCRIPT)
    script.chmod(0o755)
    path.write_text("".join(f"{o}\n" for o in options) + f"action-script {script}\n")
    return path


def container_args(inst: vllm.VllmInstall, model: Path, **kw) -> list[str]:
    """The server's command line inside the container: the node's own, listening on 0.0.0.0:CPORT."""
    args = vllm.server_args(inst, Path(os.path.realpath(model)), CPORT, **kw)
    args[0] = str(venv_prefix(inst) / "bin" / "python")
    args[args.index("--host") + 1] = "0.0.0.0"
    return args


def container_workload(name: str, image: str, inst: vllm.VllmInstall, model: vllm.VllmModel, *, host_port: int,
                       container_name: str | None = None, extra: list[str] | None = None,
                       node: str = "local") -> Workload:
    """A container workload (engine: vllm) of vLLM serving ``model`` on 127.0.0.1:``host_port``."""
    spec = ContainerSpec(
        name=container_name or name, image=image,
        command=container_args(inst, model.path, extra=[*EAGER, *(extra or [])]),
        ports=[PortMap(host=host_port, container=CPORT)],
        mounts=[Mount(source=str(p), target=str(p)) for p in
                (venv_prefix(inst), python_prefix(inst), Path(os.path.realpath(model.path)))],
        env={**vllm.CPU_ENV, **NET_ENV})
    url = f"http://127.0.0.1:{host_port}"
    return Workload(name=name, node=node, engine=vllm.ENGINE, engine_version=inst.version, model_id=model.model_id,
                    model_revision=model.revision, container=spec, health_url=url + "/health",
                    # At TP=1 on CPU the tree has no established TCP connection (gloo over a file://
                    # rendezvous): measured. (True works too: an in-place restore then keeps the
                    # exported name, since podman 4.3 refuses --tcp-established with --name.)
                    metrics_url=url + "/metrics", tcp_established=False,
                    criu=VLLM_CRIU.model_copy(update={"amx_unused": vllm.CPU_AMX}),  # float32 on AMX CPUs
                    golden=GoldenRequest(url=url + "/v1/completions", field="choices.0.token_ids",
                                         body=vllm.golden_body()))


def run_args(w: Workload, *, criu_conf: Path | None, shm_size: str = SHM_SIZE) -> list[str]:
    """``podman run`` arguments: the workload's ContainerSpec with ``--shm-size`` and the CRIU
    config annotation set (when the spec does not already say)."""
    spec = w.container
    annotations = {**({CRIU_ANNOTATION: str(criu_conf)} if criu_conf is not None else {}), **spec.annotations}
    return spec.model_copy(update={"shm_size": spec.shm_size or shm_size, "annotations": annotations}).run_args()


def start(w: Workload, *, criu_conf: Path | None, shm_size: str = SHM_SIZE, timeout_s: float = 900) -> float:
    """Run the container and wait until vLLM answers /health; seconds it took.

    Raises:
        RunnerUnavailable: podman refused, or vLLM never became healthy (with the container's log).
    """
    import time

    from ckptflow.runners.container import Podman
    from ckptflow.runners.engine import wait_url

    pm = Podman(w.container)
    t0 = time.perf_counter()
    try:
        pm.call(run_args(w, criu_conf=criu_conf, shm_size=shm_size), "run")
        deadline = time.time() + timeout_s
        while True:
            try:
                wait_url(w.health_url, 10)
                break
            except TimeoutError:
                c = pm.inspect(w.container.name)
                if c is None or not c.running or time.time() > deadline:
                    raise TimeoutError(f"container is {c.status if c else 'gone'}") from None
    except (CkptflowError, TimeoutError) as e:
        logs = pm.call(["logs", "--tail", "40", w.container.name], "logs", timeout_s=60, check=False)
        pm.remove(w.container.name)
        raise RunnerUnavailable(f"vLLM in container {w.container.name} did not start ({str(e).splitlines()[0]}):\n"
                                f"{(logs.stdout + logs.stderr)[-3000:]}") from None
    return time.perf_counter() - t0
