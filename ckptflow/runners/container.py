"""Container workloads: checkpoint and restore a worker that runs in an OCI container, through
the container runtime (podman; runc and CRIU underneath), with the same store and gates as a
process.

A fleet file names the container instead of a pid file (ckptflow/container_models.py)::

    - name: chat-c
      node: node-a
      container: {name: chat-c, image: localhost/ckptflow-demo:latest,
                  ports: [{host: 18101, container: 8000}]}
      health_url: http://127.0.0.1:18101/health

What each step does (measured on Debian 12, podman 4.3.1, runc 1.1.5, CRIU 4.2.1):
- heartbeat: ``podman container checkpoint --leave-running --export images/container.tar
  --compress none`` (~0.3-0.5 s); the tar (CRIU images, the container's config, its rootfs
  diff) is one image file of the checkpoint: checksummed, chunked and pushed to S3 like any.
- migrate out: the same without ``--leave-running``; the stopped container is removed once the
  manifest is written, so the name is free for the restore (here or on the source again).
- restore (recover, migrate in): ``podman container restore --import`` under the declared name
  and ports. The container has its own PID namespace, so the host PIDs the original had do not
  matter: a restore never fails on a taken PID. A taken host port is refused before podman runs
  (a clashing restore was seen to break the running container's networking).
- verify: a copy restored beside the running original under another name, with fresh host
  ports (``--publish NEW:PORT``, its own PID and network namespaces), asked for health, the
  golden request and the session digests, compared with the checkpoint's, and removed.

runc calls the first ``criu`` on PATH: every runtime call runs with the directory of ckptflow's
CRIU (runners.criu.find_criu) first on PATH, so Debian's older criu, which podman pulls in, is
never the one used.

Example:
    >>> with NodeRunner(LocalStore(".ckptflow/store")) as node:        # doctest: +SKIP
    ...     m = ContainerRunner(node).checkpoint(workload)              # heartbeat
    ...     ContainerRunner(node).restore(workload)                      # after the container died
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable
from urllib.parse import urlsplit, urlunsplit

import psutil

from ckptflow.container_models import ContainerSpec, PortMap
from ckptflow.errors import (CheckpointNotFound, ChecksumMismatch, CkptflowError, CriuError, CriuTimeout,
                             IncompatibleCheckpoint, RestoreFailed, RunnerUnavailable, WorkloadNotFound,
                             WorkloadRunning)
from ckptflow.models import CheckpointState, ContainerRecord, Fingerprint, Manifest, VerifyOutcome, Workload
from ckptflow.policies.compat import diff
from ckptflow.runners import engine
from ckptflow.runners.criu import fix_for, refuse_uncarriable
from ckptflow.runners.fingerprint import runtime_versions, workload_fingerprint
from ckptflow.runners.process import DeclaredProcess, start_time, tree

if TYPE_CHECKING:
    from ckptflow.runners.node import NodeRunner, RestoreResult
    from ckptflow.runners.digests import VerifyResult

log = logging.getLogger("ckptflow")

IMAGE_FILE = "container.tar"     # podman's export: CRIU images + config + rootfs diff, uncompressed
SPEC_FILE = "container.json"     # what the container was at the dump: name, image, published ports
TIMEOUT_S = 600                  # as CRIU's own: a 50 GiB image dumps in ~35 s; 10 min means stuck
MEMORY_MARGIN = 256 << 20        # a restore needs the image's pages in memory, plus room to run
GATE_GROUPS = ("host", "workload", "container")


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
    spec = _spec(w)
    fp = workload_fingerprint(w, node_fp)
    return Fingerprint(**{**fp.model_dump(), **runtime_versions(spec.runtime.value, spec.oci_runtime)})


def _spec(w: Workload) -> ContainerSpec:
    if w.container is None:
        raise RunnerUnavailable(f"workload {w.name} is not a container workload")
    return w.container


def _not_found(w: Workload, spec: ContainerSpec) -> WorkloadNotFound:
    return WorkloadNotFound(
        f"workload {w.name}: container {spec.name!r} not found in {spec.runtime.value} on this node",
        fix=f"start it (`{spec.runtime.value} ps -a` lists the containers here), correct container.name in the "
            "fleet file, or run `ckptflow recover` to restore it")


def resolve_container(w: Workload, podman: Podman | None = None) -> DeclaredProcess:
    """The running container's init, as the declared process of ``w`` (host PID).

    Raises:
        WorkloadNotFound: no such container, or it is not running.
    """
    spec = _spec(w)
    if spec.kubernetes is not None:  # a pod: the API server says whether it runs (runners/pod.py)
        from ckptflow.runners import pod

        return pod.resolve_pod(w)
    c = (podman or Podman(spec)).inspect(spec.name)
    if c is None:
        raise _not_found(w, spec)
    if not c.running:
        raise WorkloadNotFound(f"workload {w.name}: container {spec.name!r} is {c.status}, not running",
                               fix="run `ckptflow recover` to restore it from its newest checkpoint")
    st = start_time(c.pid)
    if st is None:
        raise WorkloadNotFound(f"workload {w.name}: container {spec.name!r} exited while being resolved")
    return DeclaredProcess(workload=w.name, pid=c.pid, start_time=st, cmdline=f"container {c.name} ({c.id[:12]})")


def stop_container(w: Workload, grace_s: float = 30) -> dict:
    """Stop a container workload through its runtime (``podman stop``: SIGTERM, SIGKILL after
    ``grace_s``), or delete its pod; never by a signal to a host PID (a pod's is unknown here)."""
    spec = _spec(w)
    if spec.kubernetes is not None:
        from ckptflow.runners import pod

        try:
            pod.resolve_pod(w)
        except WorkloadNotFound:
            return {"stopped": False, "reason": "not running"}
        pod.delete(w)
        return {"stopped": True, "pod": f"{spec.kubernetes.namespace}/{spec.kubernetes.pod}"}
    pm = Podman(spec)
    try:
        proc = resolve_container(w, pm)
    except WorkloadNotFound:
        return {"stopped": False, "reason": "not running"}
    pm.call(["stop", "--time", str(int(grace_s)), spec.name], "stop", timeout_s=grace_s + 60)
    return {"stopped": True, "pid": proc.pid, "container": spec.name}


def _port_taken(ip: str, port: int) -> bool:
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


class ContainerRunner:
    """Checkpoint and restore container workloads into a NodeRunner's store, with its gates."""

    def __init__(self, node: "NodeRunner"):
        self.node = node
        self.store = node.store

    def podman(self, w: Workload) -> Podman:
        return Podman(_spec(w), self.node.criu.criu_bin)

    def fingerprint(self, w: Workload) -> Fingerprint:
        return container_fingerprint(w, self.node.node_fp)

    def gate(self, w: Workload, m: Manifest, overrides: frozenset[str] = frozenset()) -> None:
        """Refuse a checkpoint of another host, workload or runtime fingerprint, before any runtime call.

        Raises:
            IncompatibleCheckpoint: naming every differing field as old -> new (final).
        """
        c = diff(m.fingerprint, self.fingerprint(w), overrides, GATE_GROUPS)
        for f, (a, b) in c.overridden.items():
            log.warning("OVERRIDE: restoring %s of %s although %s differs: %r -> %r", m.id, w.name, f, a, b)
        if not c.ok:
            raise IncompatibleCheckpoint(c.differences, checkpoint=m.id)

    # --- checkpoint ------------------------------------------------------------------------
    def checkpoint(self, w: Workload, *, leave_running: bool = True, kind: str | None = None) -> Manifest:
        """Export the running container into the store and commit its manifest.

        Raises:
            WorkloadNotFound: no such container, or it is not running (nothing is written).
            CriuError: the runtime's checkpoint failed (bytes discarded; with leave_running the
                container runs on).
        """
        with self.store.lock(w.name):
            return self._checkpoint(w, leave_running, kind)

    def _checkpoint(self, w: Workload, leave_running: bool, kind: str | None) -> Manifest:
        pm = self.podman(w)
        spec = _spec(w)
        proc = resolve_container(w, pm)
        if proc.pid > 0:  # the container's processes as the host sees them (a pod's are on its kubelet's node)
            refuse_uncarriable(w, tree(proc.pid))  # runc's CRIU carries them no better than ours
        from ckptflow.runners.node import probe_for_checkpoint

        state = probe_for_checkpoint(w, engine.probe)
        if spec.kubernetes is not None:
            k = spec.kubernetes
            record = ContainerRecord(name=spec.name, pod=f"{k.namespace}/{k.pod}/{k.container}", ports=spec.ports)
        else:
            c = pm.inspect(spec.name)
            record = ContainerRecord(name=c.name, id=c.id, image=c.image, ports=c.ports)
        state = state.updated(container=record)
        pending = self.store.begin(w.name, node=w.node)
        try:
            images = pending.images_dir
            (images / SPEC_FILE).write_text(record.model_dump_json(exclude_none=True))
            if spec.kubernetes is not None:  # the kubelet checkpoints it, leaving it running (runners/pod.py)
                from ckptflow.runners import pod

                took = round(pod.take_archive(w, images / IMAGE_FILE), 4)
            else:
                args = ["container", "checkpoint", "--compress", "none", "--export", str(images / IMAGE_FILE)]
                if leave_running:
                    args.append("--leave-running")
                if w.tcp_established:
                    args.append("--tcp-established")
                t0 = time.perf_counter()
                pm.call([*args, spec.name], "checkpoint")
                took = round(time.perf_counter() - t0, 4)
        except BaseException:
            self.store.abort(pending)
            raise
        m = self.store.commit(pending, timings={"dump": took, "pause": took}, probe=state,
                              kind=kind or ("heartbeat" if leave_running else "migrate"), pid=proc.pid,
                              fingerprint=self.fingerprint(w))
        if not leave_running:  # checkpointed and stopped: free the name for the restore, here or elsewhere
            if spec.kubernetes is not None:
                from ckptflow.runners import pod

                pod.delete(w)
            else:
                pm.remove(spec.name)
        return m

    # --- restore ---------------------------------------------------------------------------
    def restore(self, w: Workload, *, manifest: Manifest | None = None, fallback: bool = True,
                overrides: frozenset[str] = frozenset(), tier=None) -> "RestoreResult":
        """Restore the container of ``w`` on this node from ``manifest`` (default: its newest
        valid checkpoint, nearest copy first; the S3 tier's pulled when this node has none).

        Raises:
            WorkloadRunning: the container runs (nothing to recover).
            RestoreFailed: a declared host port is taken, memory is short, or the restored
                container is unhealthy or its sessions differ from the checkpoint's.
            CheckpointNotFound / ChecksumMismatch / IncompatibleCheckpoint: nothing restorable.
        """
        with self.store.lock(w.name):
            return self._restore(w, manifest, fallback, overrides, tier)

    def _clear_dead(self, w: Workload, pm: Podman) -> None:
        spec = _spec(w)
        if spec.kubernetes is not None:
            from ckptflow.runners import pod

            return pod.clear_dead(w)
        c = pm.inspect(spec.name)
        if c is None:
            return
        if c.running:
            raise WorkloadRunning(f"workload {w.name}: container {spec.name!r} is running (PID {c.pid}); "
                                  "refusing to restore over it",
                                  fix="stop it first, or use verify to test a checkpoint beside it")
        # Holding the workload lock, a stopped container of this name is the dead worker (or what a
        # failed restore left "created"): the restore recreates it under the same name.
        log.warning("workload %s: removing its %s container %s (%s) before the restore", w.name, c.status,
                    spec.name, c.id[:12])
        pm.remove(spec.name)

    def _ports(self, w: Workload, m: Manifest) -> list[PortMap]:
        spec = _spec(w)
        if spec.ports:
            return list(spec.ports)
        return list(m.probe.container.ports) if m.probe.container else []

    def _preflight(self, w: Workload, m: Manifest, ports: list[PortMap]) -> None:
        """Refuse, before the runtime is called, what would fail or break something."""
        taken = [p for p in ports if _port_taken(p.host_ip, p.host)] if _spec(w).kubernetes is None else []
        if taken:
            p = taken[0]
            raise RestoreFailed(
                f"workload {w.name}: host port {p.host_ip}:{p.host} (container port {p.container}) is taken on "
                f"node {w.node}; refusing to restore container {_spec(w).name!r} onto it",
                fix=f"stop what listens there (`ss -ltnp 'sport = :{p.host}'`) or declare another host port in "
                    "container.ports")
        need = m.bytes + MEMORY_MARGIN
        avail = psutil.virtual_memory().available
        if avail < need:
            raise RestoreFailed(f"workload {w.name}: checkpoint {m.id} needs {need / 2**30:.2f} GiB of memory, "
                                f"node {w.node} has {avail / 2**30:.2f} GiB available",
                                fix="free memory on the node, or recover on another node (--node)")

    def _restore(self, w: Workload, manifest: Manifest | None, fallback: bool, overrides: frozenset[str],
                 tier) -> "RestoreResult":
        from ckptflow.runners.node import RestoreResult

        pm = self.podman(w)
        self._clear_dead(w, pm)
        skipped: list[dict] = []
        candidates = (iter([(manifest, {}, 0)]) if manifest else
                      self.node._candidates(w, tier, skipped, overrides))
        tried = 0
        for m, timings, downloaded in candidates:
            tried += 1
            self.gate(w, m, overrides)
            ports = self._ports(w, m)
            self._preflight(w, m, ports)
            t0 = time.perf_counter()
            try:
                self.store.verify_bytes(m)
            except ChecksumMismatch as e:
                self.store.set_state(m, CheckpointState.verify_failed, f"checksum: {e}")
                skipped.append({"id": m.id, "reason": str(e).splitlines()[0]})
                if not fallback:
                    raise
                continue
            timings["checksum"] = round(time.perf_counter() - t0, 4)
            t0 = time.perf_counter()
            pid = self._runtime_restore(w, m, _spec(w).name, ports)
            timings["restore"] = round(time.perf_counter() - t0, 4)
            timings["health"] = round(engine.wait_healthy(w), 4)
            self.node._check_state(w, m)
            total = round(sum(timings.values()), 4)
            m = self.store.set_state(m, m.state, m.state_reason, restores=m.probe.restores.adding(total))
            return RestoreResult(manifest=m, pid=pid, timings=timings, skipped=skipped, downloaded_bytes=downloaded)
        if not tried and not skipped:
            raise CheckpointNotFound(f"workload {w.name} has no valid checkpoint in {self.store.root}"
                                     + (f" or {tier.location}" if tier is not None else ""),
                                     fix="run a heartbeat first, or cold start the container")
        raise ChecksumMismatch(f"workload {w.name}: every valid checkpoint failed its checksums: "
                               + "; ".join(s["reason"] for s in skipped),
                               fix="cold start the container; the store volume may be failing")

    def _runtime_restore(self, w: Workload, m: Manifest, name: str, ports: list[PortMap]) -> int:
        """``podman container restore --import`` as ``name`` publishing ``ports``; the host PID of
        its init. A failed restore leaves no container of that name behind."""
        spec = _spec(w)
        if spec.kubernetes is not None:  # a checkpoint image and a new pod (runners/pod.py)
            from ckptflow.runners import pod

            pod.restore(w, m, self.store.images_dir(m) / IMAGE_FILE)
            return 0
        pm = self.podman(w)
        exported = m.probe.container.name if m.probe.container else None
        # podman (4.3) refuses --tcp-established together with --name: in place, the name the
        # container was exported under is the declared one, so it can stand; a copy beside the
        # original gets a new name and no established connections (they are the original's).
        keep_name = w.tcp_established and name == spec.name == exported
        args = ["--runtime", spec.oci_runtime, "container", "restore", "--import",
                str(self.store.images_dir(m) / IMAGE_FILE), *([] if keep_name else ["--name", name]),
                "--ignore-static-ip", "--ignore-static-mac", *spec.publish_args(ports)]
        if keep_name:
            args.append("--tcp-established")
        try:
            pm.call(args, "restore")
        except CkptflowError:
            pm.remove(name)  # podman leaves a "created" container after a failed restore
            raise
        c = pm.inspect(name)
        if c is None or not c.running:
            pm.remove(name)
            raise RestoreFailed(f"workload {w.name}: container {name!r} is {c.status if c else 'gone'} right after "
                                f"its restore from {m.id}", fix="see `podman logs` of the container")
        return c.pid

    # --- verify ----------------------------------------------------------------------------
    def verify(self, w: Workload, m: Manifest, timeout_s: float = 120,
               inspect_copy: Callable[[ContainerState], None] | None = None) -> "VerifyResult":
        """Restore ``m`` as a copy beside the running original (another name, fresh host ports, its
        own PID and network namespaces), compare its golden answer and session digests with the
        checkpoint's, and remove it. The original is never touched. ``inspect_copy`` is called
        with the running copy (tests look at its namespaces)."""
        from ckptflow.runners.digests import VerifyResult

        t: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            self.gate(w, m)
            self.store.verify_bytes(m)
        except CkptflowError as e:
            return VerifyResult(VerifyOutcome.verify_failed, str(e).splitlines()[0], t)
        t["checksum"] = round(time.perf_counter() - t0, 4)
        spec = _spec(w)
        if spec.kubernetes is not None:
            return VerifyResult(VerifyOutcome.skipped, "fingerprint and checksums pass; a copy of a pod beside the "
                                "original is not built yet (docs/kubernetes.md)", t)
        fresh = [p.model_copy(update={"host": free_port(p.host_ip if p.host_ip != "0.0.0.0" else "127.0.0.1")})
                 for p in self._ports(w, m)]
        moved = {old.host: new.host for old, new in zip(self._ports(w, m), fresh)}
        copy = f"{spec.name}-verify-{secrets.token_hex(3)}"
        pm = self.podman(w)
        try:
            t0 = time.perf_counter()
            try:
                self._runtime_restore(w, m, copy, fresh)
            except CkptflowError as e:
                return VerifyResult(VerifyOutcome.verify_failed, f"sandbox restore failed: {str(e).splitlines()[0]}",
                                    t, getattr(e, "log_tail", ""))
            t["restore"] = round(time.perf_counter() - t0, 4)
            wc = rebased_workload(w, moved)
            t0 = time.perf_counter()
            try:
                t["health"] = round(engine.wait_healthy(wc, timeout_s), 4)
            except CkptflowError as e:
                return VerifyResult(VerifyOutcome.verify_failed, f"sandbox copy {str(e).splitlines()[0]}", t)
            if inspect_copy is not None:
                inspect_copy(pm.inspect(copy))
            got = engine.probe(wc)
            t["probe"] = round(time.perf_counter() - t0, 4)
            from ckptflow.runners.digests import compare

            return compare(w, m, got, t)
        finally:
            pm.remove(copy)

    # --- cold start ------------------------------------------------------------------------
    def start(self, w: Workload, timeout_s: float = 600) -> tuple[int, float]:
        """Start the container from its declared image (imported from ``rootfs`` when the node
        lacks it) and wait until healthy; (host PID of its init, seconds).

        Raises:
            RestoreFailed: no image declared, a host port is taken, or it never became healthy.
        """
        spec = _spec(w)
        if spec.kubernetes is not None:
            raise RestoreFailed(f"workload {w.name}: a pod is cold started by the cluster, not by the node agent",
                                fix="let its Deployment/StatefulSet recreate it, or kubectl apply its manifest")
        if not spec.image:
            raise RestoreFailed(f"workload {w.name}: container {spec.name!r} declares no image to start it from",
                                fix="declare container.image (and container.rootfs where no registry is reachable)")
        pm = self.podman(w)
        self._clear_dead(w, pm)
        taken = [p for p in spec.ports if _port_taken(p.host_ip, p.host)]
        if taken:
            raise RestoreFailed(f"workload {w.name}: host port {taken[0].host} is taken on node {w.node}",
                                fix="stop what listens there or declare another host port in container.ports")
        t0 = time.perf_counter()
        if spec.rootfs:
            from ckptflow.runners.rootfs import image_exists, import_rootfs

            if not image_exists(spec.runtime.value, spec.image):
                import_rootfs(spec.runtime.value, Path(spec.rootfs), spec.image)
        try:
            pm.call(spec.run_args(), "run")
        except CkptflowError:
            pm.remove(spec.name)
            raise
        engine.wait_healthy(w, timeout_s)
        c = pm.inspect(spec.name)
        return (c.pid if c else 0), time.perf_counter() - t0
