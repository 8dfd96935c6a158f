"""The container runtime's client (podman; runc and CRIU underneath) and what its workload runtime
shares with the pod's (runners/runtime/podman.py and pod.py hold the steps): the CLI with a
timeout on every call, the fingerprint with the runtime's versions, ports and rebased URLs.

What each step does with it (heartbeat, migrate, restore, verify) and the fleet file's block: the
podman runtime's docstring (runners/runtime/podman.py).

runc calls the first ``criu`` on PATH: every runtime call runs with the directory of ckptflow's
CRIU (runners.criu.find_criu) first on PATH, so Debian's older criu, which podman pulls in, is
never the one used.

Example:
    >>> with NodeRunner(LocalStore(".ckptflow/store")) as node:        # doctest: +SKIP
    ...     m = node.checkpoint(workload)              # heartbeat, through the podman runtime
    ...     node.restore(workload)                      # after the container died
    >>> Podman(workload.container).inspect("chat-c").running            # doctest: +SKIP
    True
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from ckptflow.container_models import ContainerSpec, PortMap
from ckptflow.errors import CriuError, CriuTimeout, RunnerUnavailable, WorkloadNotFound
from ckptflow.models import Fingerprint, Workload
from ckptflow.runners.criu import fix_for
from ckptflow.runners.fingerprint import runtime_versions, workload_fingerprint

IMAGE_FILE = "container.tar"     # podman's export: CRIU images + config + rootfs diff, uncompressed
SPEC_FILE = "container.json"     # what the container was at the dump: name, image, published ports
TIMEOUT_S = 600                  # as CRIU's own: a 50 GiB image dumps in ~35 s; 10 min means stuck
MEMORY_MARGIN = 256 << 20        # a restore needs the image's pages in memory, plus room to run


@dataclass(frozen=True)
class ContainerState:
    """What ``podman container inspect`` says about one container."""

    id: str
    name: str
    status: str          # running, exited, created, ...
    pid: int             # host PID of its init (0 when not running)
    image: str
    ports: list[PortMap]

    @property
    def running(self) -> bool:
        return self.status == "running" and self.pid > 0


def _criu_path_env(criu_bin: str) -> dict[str, str]:
    """This environment with the directory of ckptflow's CRIU first on PATH (runc runs `criu`)."""
    path = shutil.which(criu_bin) or criu_bin
    d = os.path.dirname(os.path.abspath(path)) if os.sep in path else ""
    env = dict(os.environ)
    if d:
        env["PATH"] = d + os.pathsep + env.get("PATH", "")
    return env


_LOG_FILE = re.compile(r"log file: (\S+\.log)")


def _runtime_log_tail(stderr: str, lines: int = 20) -> str:
    """The tail of the CRIU log podman names in its error, else podman's own message."""
    m = _LOG_FILE.search(stderr)
    if m:
        try:
            text = [t for t in Path(m.group(1)).read_text(errors="replace").splitlines() if "RLIMIT_NOFILE" not in t]
            # CRIU's first "Error (" line is the cause; the last lines are its unwinding.
            first = [t for t in text if "Error (" in t][:1]
            return "\n".join(first + [t for t in text[-lines:] if t not in first] + [stderr.strip()[-500:]])
        except OSError:
            pass
    return stderr.strip()[-2000:]


class Podman:
    """The podman CLI, with a timeout on every call and ckptflow's CRIU first on PATH.

    Args:
        spec: the workload's container declaration.
        criu_bin: the CRIU runc should run (default: runners.criu.find_criu()).
    """

    def __init__(self, spec: ContainerSpec, criu_bin: str | None = None, timeout_s: float = TIMEOUT_S):
        from ckptflow.runners.criu import find_criu

        self.spec = spec
        self.exe = shutil.which(spec.runtime.value)
        self.env = _criu_path_env(criu_bin or find_criu().path)
        self.timeout_s = timeout_s

    def _require(self) -> str:
        if not self.exe:
            raise RunnerUnavailable(f"{self.spec.runtime.value} not found on PATH",
                                    fix="run ./scripts/setup.sh as root (installs podman and runc)")
        return self.exe

    def call(self, args: list[str], what: str, timeout_s: float | None = None, check: bool = True,
             fix: str | None = None) -> subprocess.CompletedProcess:
        cmd = [self._require(), *args]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s or self.timeout_s,
                               env=self.env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise CriuTimeout(f"{self.spec.runtime.value} {what} timed out after {timeout_s or self.timeout_s:.0f} s",
                              cmd=cmd) from None
        if check and r.returncode != 0:
            tail = _runtime_log_tail(r.stderr)
            raise CriuError(f"{self.spec.runtime.value} {what} failed", cmd=cmd, log_tail=tail,
                            returncode=r.returncode, fix=fix or fix_for(tail))
        return r

    def inspect(self, name: str) -> ContainerState | None:
        """The container's state; None when the runtime knows no container of that name or id."""
        r = self.call(["container", "inspect", "--format", "json", name], "inspect", timeout_s=60, check=False)
        if r.returncode != 0:
            if "no such container" in r.stderr.lower():
                return None
            raise CriuError(f"{self.spec.runtime.value} inspect {name} failed", cmd=[self.exe or "", "inspect", name],
                            log_tail=r.stderr.strip()[-500:], returncode=r.returncode)
        data = json.loads(r.stdout)[0]
        ports = []
        for key, binds in ((data.get("NetworkSettings") or {}).get("Ports") or {}).items():
            for b in binds or []:
                ports.append(PortMap(host=int(b["HostPort"]), container=int(key.split("/")[0]),
                                     host_ip=b.get("HostIp") or "0.0.0.0"))
        st = data.get("State") or {}
        return ContainerState(id=data["Id"], name=data["Name"].lstrip("/"), status=st.get("Status", ""),
                              pid=int(st.get("Pid") or 0), image=data.get("ImageName") or data.get("Image", ""),
                              ports=ports)

    def remove(self, name: str) -> None:
        """Remove a container (force: a stopped or half-created one); none of that name is fine."""
        self.call(["rm", "--force", "--time", "0", name], "rm", timeout_s=120, check=False)


def container_fingerprint(w: Workload, node_fp: Fingerprint) -> Fingerprint:
    """The workload's fingerprint with the runtime and OCI runtime versions it is restored by."""
    spec = container_spec(w)
    fp = workload_fingerprint(w, node_fp)
    return Fingerprint(**{**fp.model_dump(), **runtime_versions(spec.runtime.value, spec.oci_runtime)})


def container_spec(w: Workload) -> ContainerSpec:
    """``w``'s container declaration.

    Raises:
        RunnerUnavailable: ``w`` declares none.
    """
    if w.container is None:
        raise RunnerUnavailable(f"workload {w.name} is not a container workload")
    return w.container


def not_found(w: Workload, spec: ContainerSpec) -> WorkloadNotFound:
    """The error of a declared container this node's runtime does not know."""
    return WorkloadNotFound(
        f"workload {w.name}: container {spec.name!r} not found in {spec.runtime.value} on this node",
        fix=f"start it (`{spec.runtime.value} ps -a` lists the containers here), correct container.name in the "
            "fleet file, or run `ckptflow recover` to restore it")


def port_taken(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is no owner
        try:
            s.bind((ip if ip not in ("", "0.0.0.0") else "0.0.0.0", port))
        except OSError:
            return True
    return False


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _rebase(url: str | None, ports: dict[int, int]) -> str | None:
    """``url`` with its port moved to the copy's (``ports``: original host port -> copy's)."""
    if not url:
        return url
    u = urlsplit(url)
    if u.port in ports:
        return urlunsplit(u._replace(netloc=f"{u.hostname}:{ports[u.port]}"))
    return url


def rebased_workload(w: Workload, ports: dict[int, int]) -> Workload:
    """``w`` with every URL pointed at a copy whose host ports are ``ports`` (old -> new)."""
    upd = {k: _rebase(getattr(w, k), ports) for k in ("health_url", "metrics_url", "probe_url", "prepare_url",
                                                      "resume_url")}
    if w.golden:
        upd["golden"] = w.golden.model_copy(update={"url": _rebase(w.golden.url, ports)})
    return w.model_copy(update=upd)
