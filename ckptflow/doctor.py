"""Prerequisite checks for `ckptflow doctor`: (name, ok | None for n/a | WARN, detail with fix)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ckptflow.errors import CkptflowError


# Needed by some workloads and not set: said with the fix, not a failure of the node.
WARN = "warn"

_FROM = {"argument": "given explicitly", "CKPTFLOW_CRIU": "from $CKPTFLOW_CRIU", "PATH": "on PATH",
         "bundle": "relocatable bundle from scripts/criu-bundle.sh, used because `criu` is not on PATH"}


def criu_binary() -> tuple[str, bool, str]:
    """Which CRIU the runner uses, and where it came from (runners.criu.find_criu)."""
    from ckptflow.runners.criu import BUNDLE_CANDIDATES, find_criu

    c = find_criu()
    if c.source == "missing":
        where = " or ".join(str(b) for b in BUNDLE_CANDIDATES)
        return ("criu binary", False, f"not on PATH and no bundle at {where}: run ./scripts/setup.sh as root, "
                                      "or unpack a bundle built by scripts/criu-bundle.sh there")
    path = shutil.which(c.path)
    if path is None:  # $CKPTFLOW_CRIU names something that cannot run: it is used all the same
        return ("criu binary", False, f"{c.path} ({_FROM[c.source]}) is not an executable file: fix or unset it")
    detail = f"{path} ({_FROM[c.source]})"
    if c.source == "bundle":
        version = Path(path).parent.parent / "VERSION"
        if version.is_file():
            detail += f"; criu {version.read_text().replace('Version:', '').strip()}"
    return ("criu binary", True, detail)


def _criu_ns(criu_path: str | None) -> tuple[str, bool, str]:
    name = "criu-ns (sandbox restores)"
    found = shutil.which("criu-ns")
    if found:
        return (name, True, found)
    beside = Path(criu_path).parent / "criu-ns" if criu_path else None
    if beside is not None and beside.is_file():
        return (name, False, f"only beside the bundle's criu ({beside}); sandbox restores (verify, scale-up) look on "
                             f"PATH: add {beside.parent} to the worker's PATH (the rendered systemd unit does)")
    return (name, False, "missing: run ./scripts/setup.sh as root")


def io_uring_check(sysctl: Path | None = None) -> tuple[str, bool | str | None, str]:
    """``kernel.io_uring_disabled``, which engines need at 2 before they start: uvloop's libuv (vLLM's
    and SGLang's API servers, torch.distributed's TCPStore) maps an io_uring ring otherwise, which
    CRIU cannot dump (the runner refuses such a tree before freezing it). Not a failure where it is
    not 2: a node of CPU demo workers alone checkpoints without it.

    Example:
        >>> io_uring_check(Path("/nonexistent"))[1:]
        (None, 'no such sysctl on this kernel (before 6.6): nothing to set')
    """
    from ckptflow.engines.vllm import IO_URING_SYSCTL

    name = "kernel.io_uring_disabled (engines)"
    try:
        value = (sysctl or IO_URING_SYSCTL).read_text().strip()
    except OSError:
        return (name, None, "no such sysctl on this kernel (before 6.6): nothing to set")
    if value == "2":
        return (name, True, "2: io_uring is off, so an engine's event loop uses epoll and CRIU can dump it")
    who = "every process" if value == "0" else "root's processes (an engine's, as a node runs it)"
    return (name, WARN, f"{value}: io_uring is open to {who}; a vLLM, SGLang or tensor-parallel worker started "
                        "now maps a ring CRIU cannot dump: run `sysctl -w kernel.io_uring_disabled=2` before "
                        "starting it (persist it in /etc/sysctl.d/); CPU demo workers need nothing")


def checks() -> list[tuple[str, bool | str | None, str]]:
    from ckptflow.runners.criu import CriuRunner

    out: list[tuple[str, bool | str | None, str]] = []
    out.append(("python >= 3.11", sys.version_info >= (3, 11), sys.version.split()[0]))
    root = os.geteuid() == 0
    out.append(("root", root, "ok" if root else "CRIU needs root: run the node worker as root"))
    out.append(criu_binary())
    r = CriuRunner()
    try:
        v = r.version()
        out.append(("criu >= 4.2", True, f"{'.'.join(map(str, v))} at {shutil.which(r.criu_bin)}"))
        try:
            r.check()
            out.append(("criu check", True, "Looks good"))
        except CkptflowError as e:
            out.append(("criu check", False, str(e)))
    except CkptflowError as e:
        out.append(("criu >= 4.2", False, str(e)))
    finally:
        r.close()
    out.append(_criu_ns(shutil.which(r.criu_bin)))
    out.append(("nft (TCP network lock)", bool(shutil.which("nft")),
                shutil.which("nft") or "missing: apt-get install nftables"))
    out.append(io_uring_check())
    from ckptflow.runners.fingerprint import runtime_versions

    rt = runtime_versions()  # container workloads only: n/a, not a failure, where podman is absent
    out.append(("podman + runc (container workloads)", True if len(rt) == 2 else None,
                ", ".join(rt.values()) if len(rt) == 2 else
                "not installed; for container workloads: ./scripts/setup.sh as root (apt-get install podman runc)"))
    from ckptflow.runners import xcomp

    feats = xcomp.isa_features()
    cap = "=".join(xcomp.ONEDNN_ISA_CAP)
    out.append(("CPU features (fingerprint)", True if feats else None,
                f"{len(feats)} recorded in every manifest; AMX: "
                + (f"yes: CRIU cannot carry AMX, so a worker holding it is refused; keep CPU workers off it ({cap}, "
                   "vLLM with --dtype float32) and declare criu: {amx_unused: true}"
                   if xcomp.cpu_has_amx() else "no") if feats else "/proc/cpuinfo lists no features here"))
    try:
        import pynvml

        try:
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            out.append(("NVML (GPU workers)", True, f"{n} GPU(s), driver {pynvml.nvmlSystemGetDriverVersion()}"))
        except pynvml.NVMLError as e:
            out.append(("NVML (GPU workers)", None, f"no GPU here ({e}); CPU workers checkpoint with CRIU alone"))
    except ImportError:
        out.append(("NVML (GPU workers)", False, "pynvml missing: pip install nvidia-ml-py"))
    try:
        from cuda.bindings import driver  # noqa: F401

        out.append(("cuda-bindings (GPU workers)", True, "installed"))
    except ImportError:
        out.append(("cuda-bindings (GPU workers)", None, "not installed; on GPU nodes: pip install 'ckptflow[gpu]'"))
    return out
