"""``podman``: a worker in an OCI container, checkpointed and restored through the container
runtime (podman; runc and CRIU underneath: the client is runners/container.py), with the same
store and gates as a process.

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

Example:
    >>> with NodeRunner(LocalStore(".ckptflow/store")) as node:        # doctest: +SKIP
    ...     m = node.checkpoint(workload)                               # heartbeat, through this runtime
    ...     node.restore(workload)                                       # after the container died
"""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import psutil

from ckptflow.container_models import PortMap
from ckptflow.errors import CkptflowError, RestoreFailed, WorkloadNotFound, WorkloadRunning
from ckptflow.models import ContainerRecord, Fingerprint, Manifest, ManifestProbe, VerifyOutcome, Workload
from ckptflow.results import Stopped
from ckptflow.runners import engine
from ckptflow.runners.container import (IMAGE_FILE, MEMORY_MARGIN, SPEC_FILE, ContainerState, Podman,
                                        container_fingerprint, container_spec, free_port, not_found, port_taken,
                                        rebased_workload)
from ckptflow.runners.criu import refuse_uncarriable
from ckptflow.runners.digests import VerifyResult, compare
from ckptflow.runners.node import Dumped
from ckptflow.runners.process import DeclaredProcess, start_time, tree
from ckptflow.runners.runtime import COLD_START_TIMEOUT_S, WorkloadRuntime, register_runtime

if TYPE_CHECKING:
    from ckptflow.container_models import ContainerSpec

log = logging.getLogger("ckptflow")


@register_runtime("podman")
class PodmanRuntime(WorkloadRuntime):
    """A container of the node's podman: found, dumped, restored and copied by podman."""

    what = "container"
    declares = "container"
    gated = ("container",)   # the runtime and OCI runtime versions (runners.fingerprint.runtime_versions)
    recorded: ContainerRecord | None = None   # what ``record`` found, written beside the image by ``dump``

    def podman(self, w: Workload) -> Podman:
        """The runtime's CLI, running this node's CRIU (the one ``find_criu`` finds without a node)."""
        return Podman(container_spec(w), self.node.criu.criu_bin if self.node is not None else None)

    def fingerprint(self, w: Workload) -> Fingerprint:
        return container_fingerprint(w, self._node().node_fp)

    # --- finding and stopping ---------------------------------------------------------------
    def resolve(self, w: Workload) -> DeclaredProcess:
        """The running container's init, as the declared process of ``w`` (host PID).

        Raises:
            WorkloadNotFound: no such container, or it is not running.
        """
        spec = container_spec(w)
        c = self.podman(w).inspect(spec.name)
        if c is None:
            raise not_found(w, spec)
        if not c.running:
            raise WorkloadNotFound(f"workload {w.name}: container {spec.name!r} is {c.status}, not running",
                                   fix="run `ckptflow recover` to restore it from its newest checkpoint")
        st = start_time(c.pid)
        if st is None:
            raise WorkloadNotFound(f"workload {w.name}: container {spec.name!r} exited while being resolved")
        return DeclaredProcess(workload=w.name, pid=c.pid, start_time=st, cmdline=f"container {c.name} ({c.id[:12]})")

    def stop(self, w: Workload, grace_s: float = 30) -> Stopped:
        """``podman stop`` (SIGTERM, SIGKILL after ``grace_s``); never a signal to a host PID."""
        spec = container_spec(w)
        try:
            proc = self.resolve(w)
        except WorkloadNotFound:
            return {"stopped": False, "reason": "not running"}
        self.podman(w).call(["stop", "--time", str(int(grace_s)), spec.name], "stop", timeout_s=grace_s + 60)
        return {"stopped": True, "pid": proc.pid, "container": spec.name}

    # --- checkpoint ---------------------------------------------------------------------------
    def refuse(self, w: Workload, proc: DeclaredProcess) -> None:
        if proc.pid > 0:  # the container's processes as the host sees them
            refuse_uncarriable(w, tree(proc.pid))  # runc's CRIU carries them no better than ours

    def container_record(self, w: Workload) -> ContainerRecord:
        """What the manifest records of the container: its name, id, image and published ports."""
        c = self.podman(w).inspect(container_spec(w).name)
        return ContainerRecord(name=c.name, id=c.id, image=c.image, ports=c.ports)

    def record(self, w: Workload, proc: DeclaredProcess, state: ManifestProbe) -> ManifestProbe:
        self.recorded = self.container_record(w)  # the dump writes the same record beside the image
        return state.updated(container=self.recorded)

    def dump(self, w: Workload, proc: DeclaredProcess, images_dir: Path, leave_running: bool) -> Dumped:
        """The record beside the image (``container.json``), then the runtime's export (``container.tar``)."""
        record = self.recorded or self.container_record(w)
        (images_dir / SPEC_FILE).write_text(record.model_dump_json(exclude_none=True))
        took = round(self.export(w, images_dir / IMAGE_FILE, leave_running), 4)
        return Dumped(proc.pid, {"dump": took, "pause": took})

    def export(self, w: Workload, dest: Path, leave_running: bool) -> float:
        """``podman container checkpoint --export``; seconds."""
        args = ["container", "checkpoint", "--compress", "none", "--export", str(dest)]
        if leave_running:
            args.append("--leave-running")
        if w.tcp_established:
            args.append("--tcp-established")
        t0 = time.perf_counter()
        self.podman(w).call([*args, container_spec(w).name], "checkpoint")
        return time.perf_counter() - t0

    def dumped(self, w: Workload, leave_running: bool) -> None:
        if not leave_running:  # checkpointed and stopped: free the name for the restore, here or elsewhere
            self.podman(w).remove(container_spec(w).name)

    # --- restore ------------------------------------------------------------------------------
    def clear(self, w: Workload) -> None:
        spec = container_spec(w)
        pm = self.podman(w)
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

    def ports(self, w: Workload, m: Manifest) -> list[PortMap]:
        """The host ports a restore of ``m`` publishes: the declared ones, else those it was exported with."""
        spec = container_spec(w)
        if spec.ports:
            return list(spec.ports)
        return list(m.probe.container.ports) if m.probe.container else []

    def taken_ports(self, w: Workload, ports: list[PortMap]) -> list[PortMap]:
        """The host ports of ``ports`` something on this node listens on."""
        return [p for p in ports if port_taken(p.host_ip, p.host)]

    def preflight(self, w: Workload, m: Manifest, gpu_pairs: list[tuple[str, str]] | None) -> None:
        """Refuse, before the runtime is called, what would fail or break something: a taken host
        port, too little memory for the image."""
        taken = self.taken_ports(w, self.ports(w, m))
        if taken:
            p = taken[0]
            raise RestoreFailed(
                f"workload {w.name}: host port {p.host_ip}:{p.host} (container port {p.container}) is taken on "
                f"node {w.node}; refusing to restore container {container_spec(w).name!r} onto it",
                fix=f"stop what listens there (`ss -ltnp 'sport = :{p.host}'`) or declare another host port in "
                    "container.ports")
        need = m.bytes + MEMORY_MARGIN
        avail = psutil.virtual_memory().available
        if avail < need:
            raise RestoreFailed(f"workload {w.name}: checkpoint {m.id} needs {need / 2**30:.2f} GiB of memory, "
                                f"node {w.node} has {avail / 2**30:.2f} GiB available",
                                fix="free memory on the node, or recover on another node (--node)")

    def restore(self, w: Workload, m: Manifest, timings: dict[str, float]) -> int:
        """Every byte checked first, then the runtime's restore under the declared name and ports."""
        node = self._node()
        t0 = time.perf_counter()
        node.store.verify_bytes(m)
        timings["checksum"] = round(time.perf_counter() - t0, 4)
        t0 = time.perf_counter()
        pid = self.restore_as(w, m, container_spec(w).name, self.ports(w, m))
        timings["restore"] = round(time.perf_counter() - t0, 4)
        return pid

    def restore_as(self, w: Workload, m: Manifest, name: str, ports: list[PortMap]) -> int:
        """``podman container restore --import`` as ``name`` publishing ``ports``; the host PID of
        its init. A failed restore leaves no container of that name behind."""
        spec = container_spec(w)
        pm = self.podman(w)
        exported = m.probe.container.name if m.probe.container else None
        # podman (4.3) refuses --tcp-established together with --name: in place, the name the
        # container was exported under is the declared one, so it can stand; a copy beside the
        # original gets a new name and no established connections (they are the original's).
        keep_name = w.tcp_established and name == spec.name == exported
        args = ["--runtime", spec.oci_runtime, "container", "restore", "--import",
                str(self._node().store.images_dir(m) / IMAGE_FILE), *([] if keep_name else ["--name", name]),
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

    # --- verify -------------------------------------------------------------------------------
    def verify_copy(self, w: Workload, m: Manifest, t: dict[str, float], timeout_s: float = 120,
                    inspect_copy: Callable[[ContainerState], None] | None = None) -> VerifyResult:
        """``m`` restored as a copy beside the running original (another name, fresh host ports, its
        own PID and network namespaces), its golden answer and session digests compared with the
        checkpoint's, and removed. The original is never touched."""
        spec = container_spec(w)
        ports = self.ports(w, m)
        fresh = [p.model_copy(update={"host": free_port(p.host_ip if p.host_ip != "0.0.0.0" else "127.0.0.1")})
                 for p in ports]
        moved = {old.host: new.host for old, new in zip(ports, fresh)}
        copy = f"{spec.name}-verify-{secrets.token_hex(3)}"
        pm = self.podman(w)
        try:
            t0 = time.perf_counter()
            try:
                self.restore_as(w, m, copy, fresh)
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
            return compare(w, m, got, t)
        finally:
            pm.remove(copy)

    # --- cold start ---------------------------------------------------------------------------
    def can_cold_start(self, w: Workload) -> bool:
        return bool(container_spec(w).image) or super().can_cold_start(w)

    def cold_start(self, w: Workload, timeout_s: float = COLD_START_TIMEOUT_S) -> tuple[int, float]:
        """Start the container from its declared image (imported from ``rootfs`` when the node
        lacks it) and wait until healthy: (host PID of its init, seconds); without an image, its
        ``start_command``.

        Raises:
            RestoreFailed: a host port is taken, or it never became healthy.
        """
        spec = container_spec(w)
        if not spec.image:
            return super().cold_start(w, timeout_s)
        return self.start_image(w, spec, timeout_s)

    def start_image(self, w: Workload, spec: "ContainerSpec", timeout_s: float) -> tuple[int, float]:
        """``podman run`` of the declared image."""
        pm = self.podman(w)
        self.clear(w)
        taken = self.taken_ports(w, spec.ports)
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

    def refuse_replica(self, w: Workload) -> None:
        from ckptflow.errors import UnsupportedWorkload

        raise UnsupportedWorkload(f"workload {w.name}: scale-up replicas of a container workload are not built yet",
                                  fix="start another container of its image; verify already restores copies beside it")
