"""Prerequisite checks for `ckptflow doctor`: (name, ok | None for n/a, detail with fix)."""

from __future__ import annotations

import os
import shutil
import sys

from ckptflow.errors import CkptflowError


def checks() -> list[tuple[str, bool | None, str]]:
    from ckptflow.runners.criu import CriuRunner

    out: list[tuple[str, bool | None, str]] = []
    out.append(("python >= 3.11", sys.version_info >= (3, 11), sys.version.split()[0]))
    root = os.geteuid() == 0
    out.append(("root", root, "ok" if root else "CRIU needs root: run the node worker as root"))
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
    out.append(("criu-ns (sandbox restores)", bool(shutil.which("criu-ns")),
                shutil.which("criu-ns") or "missing: run ./scripts/setup.sh as root"))
    out.append(("nft (TCP network lock)", bool(shutil.which("nft")),
                shutil.which("nft") or "missing: apt-get install nftables"))
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
