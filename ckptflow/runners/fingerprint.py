"""Fingerprints: everything a restore depends on, read from this node and a workload.

Example:
    >>> fp = node_fingerprint()          # doctest: +SKIP
    >>> fp.kernel, fp.criu, fp.driver    # ('6.18.44', '4.2.1', None) on a CPU node
    >>> fp.cpu_features                  # ['abm', 'adx', 'aes', 'amx_bf16', 'amx_int8', 'amx_tile', ...]
    >>> fp.notes["gpu"]                  # why the GPU fields are empty (the node's GPU backend says)
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from functools import lru_cache

import ckptflow
from ckptflow.models import Fingerprint, Workload
from ckptflow.runners.criu import find_criu, parse_version
from ckptflow.runners.gpu import get_backend
from ckptflow.runners.xcomp import isa_features


@lru_cache(maxsize=4)
def runtime_versions(runtime: str = "podman", oci_runtime: str = "runc") -> dict[str, str]:
    """``container_runtime`` and ``oci_runtime`` fingerprint fields ("podman 4.3.1", "runc 1.1.5"),
    empty where the runtime is not installed."""
    out: dict[str, str] = {}
    for field, exe, pat in (("container_runtime", runtime, r"version\s+(\S+)"),
                            ("oci_runtime", oci_runtime, r"version\s+([0-9][^\s+]*)")):
        path = shutil.which(exe)
        if not path:
            continue
        try:
            text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        m = re.search(pat, text)
        if m:
            out[field] = f"{exe} {m.group(1)}"
    return out


def _criu_version(criu_bin: str) -> tuple[str | None, str | None]:
    try:
        out = subprocess.run([criu_bin, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"criu not runnable: {e}"
    v = parse_version(out.stdout)
    return (".".join(map(str, v)), None) if v else (None, "criu --version unreadable")


@lru_cache(maxsize=4)
def node_fingerprint(criu_bin: str | None = None, gpu_backend: str | None = None) -> Fingerprint:
    """This node's host and GPU fields (cached per process: they change only with a reboot).
    ``criu_bin``: the runner's CRIU (default: find_criu(), the runner's own lookup);
    ``gpu_backend``: the registered backend whose driver gives the GPU fields (default ``cuda``)."""
    criu_bin = find_criu(criu_bin).path
    notes: dict[str, str] = {}
    gpu, why = get_backend(gpu_backend).fingerprint_fields()
    if why:
        notes["gpu"] = why
    criu, why = _criu_version(criu_bin)
    if why:
        notes["criu"] = why
    libc = platform.libc_ver()
    return Fingerprint(arch=platform.machine(), kernel=platform.release(), cpu_features=isa_features() or None,
                       glibc=libc[1] if libc[0] == "glibc" else None, criu=criu,
                       python=platform.python_version(), ckptflow=ckptflow.__version__, notes=notes, **gpu,
                       **runtime_versions())  # podman and runc, where installed


def workload_fingerprint(w: Workload, node: Fingerprint | None = None) -> Fingerprint:
    """The node's fields plus the workload's declared engine and model."""
    base = (node or node_fingerprint()).model_dump()
    base.update(engine=w.engine.value, engine_version=w.engine_version, model_id=w.model_id,
                model_revision=w.model_revision)
    return Fingerprint(**base)

