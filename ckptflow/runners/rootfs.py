"""A container root filesystem made from this machine's own files, for nodes without a registry.

No registry is reachable from these machines (and a GPU node often has none either), so a
worker's image is built from local files: this Python interpreter and its standard library, the
site-packages a worker needs (numpy, ...), the ckptflow package itself, any binaries (criu, ip,
ss, ...), and every shared library ``ldd`` says they load. The result is a plain tar that
``podman import`` (or ``buildah``) turns into an image; the Containerfile of the node image
(``deployments/containers/node.Containerfile``) starts FROM one.

Layout inside: the interpreter at /usr/local/bin/python3 with its library under
/usr/local/lib/python3.X (where it looks for it), packages in its site-packages, binaries in
/usr/local/bin, every library in /usr/lib (the loader's default path, so no ld.so.cache is
needed) and the loader at the path the ELF files name (/lib64/ld-linux-x86-64.so.2).

Example:
    >>> build_rootfs(Path("demo-rootfs.tar"), packages=["numpy", "prometheus_client"])  # doctest: +SKIP
    >>> import_rootfs("podman", Path("demo-rootfs.tar"), "localhost/ckptflow-demo:abc")  # doctest: +SKIP

Run ``python -m ckptflow.runners.rootfs --help`` for the command line.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import ckptflow
from ckptflow.errors import RunnerUnavailable

# Parts of the standard library a worker never imports: 0.6 GiB of pyenv's 0.9 GiB.
_STDLIB_SKIP = {"test", "site-packages", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
                "__pycache__", "pydoc_data"}
_SKIP_DIRS = {"__pycache__", "tests", "test"}
_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)")
LOADER = "/lib64/ld-linux-x86-64.so.2"


def _ldd(paths: list[Path]) -> set[str]:
    """Absolute paths of every shared library the ELF files in ``paths`` load (recursively, as
    ldd resolves them on this machine)."""
    out: set[str] = set()
    for i in range(0, len(paths), 200):
        r = subprocess.run(["ldd", *map(str, paths[i:i + 200])], capture_output=True, text=True, timeout=120)
        for line in r.stdout.splitlines():
            m = _LDD_LINE.match(line)
            if m:
                out.add(m.group(1))
    return out


def _is_elf(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


class _Tar:
    """Adds files under chosen paths, dereferencing symlinks, each path once."""

    def __init__(self, path: Path):
        self.tar = tarfile.open(path, "w")
        self.seen: set[str] = set()
        self.elves: list[Path] = []

    def dir(self, arc: str, mode: int = 0o755) -> None:
        arc = arc.strip("/")
        parts = arc.split("/")
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d and d not in self.seen:
                ti = tarfile.TarInfo(d)
                ti.type, ti.mode = tarfile.DIRTYPE, mode
                self.tar.addfile(ti)
                self.seen.add(d)

    def file(self, src: Path, arc: str, mode: int | None = None) -> None:
        arc = arc.strip("/")
        if arc in self.seen:
            return
        self.dir(os.path.dirname(arc))
        st = os.stat(src)
        ti = tarfile.TarInfo(arc)
        ti.size, ti.mode, ti.mtime = st.st_size, mode if mode is not None else (st.st_mode & 0o777), int(st.st_mtime)
        with open(src, "rb") as f:
            self.tar.addfile(ti, f)
        self.seen.add(arc)
        if _is_elf(src):
            self.elves.append(src)

    def text(self, arc: str, data: str, mode: int = 0o644) -> None:
        arc = arc.strip("/")
        self.dir(os.path.dirname(arc))
        raw = data.encode()
        ti = tarfile.TarInfo(arc)
        ti.size, ti.mode = len(raw), mode
        self.tar.addfile(ti, io.BytesIO(raw))
        self.seen.add(arc)

    def symlink(self, arc: str, target: str) -> None:
        arc = arc.strip("/")
        if arc in self.seen:
            return
        self.dir(os.path.dirname(arc))
        ti = tarfile.TarInfo(arc)
        ti.type, ti.linkname = tarfile.SYMTYPE, target
        self.tar.addfile(ti)
        self.seen.add(arc)

    def tree(self, src: Path, arc: str, skip: set[str] = _SKIP_DIRS, exclude: tuple[str, ...] = ()) -> None:
        def kept(name: str) -> bool:
            return not any(fnmatch.fnmatch(name, pat) for pat in exclude)

        for root, dirs, files in os.walk(src):
            dirs[:] = sorted(d for d in dirs if d not in skip and (root != str(src) or kept(d)))
            rel = os.path.relpath(root, src)
            base = arc if rel == "." else f"{arc}/{rel}"
            self.dir(base)
            for name in sorted(files):
                p = Path(root) / name
                if p.is_file() and not name.endswith((".pyc", ".pyo")) and (root != str(src) or kept(name)):
                    self.file(p, f"{base}/{name}")


def _site_entries(name: str) -> list[Path]:
    """The site-packages entries of an importable top-level package or module ``name`` (with
    its bundled libraries, e.g. numpy.libs)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RunnerUnavailable(f"package {name!r} is not installed in {sys.prefix}",
                                fix=f"pip install {name} into the venv that builds the rootfs")
    origin = Path(spec.origin)
    top = origin.parent if origin.name == "__init__.py" else origin
    out = [top]
    libs = top.parent / f"{name}.libs"
    if libs.is_dir():
        out.append(libs)
    return out


def build_rootfs(dest: Path, *, packages: list[str] = (), binaries: list[str] = (), with_ckptflow: bool = True,
                 files: list[tuple[Path, str]] = (), exclude: tuple[str, ...] = ()) -> Path:
    """Write a root filesystem tar to ``dest``: this interpreter, ``packages`` from its
    site-packages, the ckptflow package (``with_ckptflow``), ``binaries`` found on PATH (into
    /usr/local/bin), ``files`` as (source, path inside; a directory's top-level entries matching
    an ``exclude`` glob are left out), and the libraries all of them load.

    Raises:
        RunnerUnavailable: a package or binary is not installed here.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = f"usr/local/lib/{ver}/site-packages"
    t = _Tar(tmp)
    try:
        for d in ("tmp", "var/tmp"):
            t.dir(d, 0o1777)
        for d in ("etc", "proc", "sys", "dev", "run", "root"):
            t.dir(d)
        t.text("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
        t.text("etc/group", "root:x:0:\nnogroup:x:65534:\n")
        t.file(Path(os.path.realpath(sys._base_executable if hasattr(sys, "_base_executable") else sys.executable)),
               f"usr/local/bin/{ver}", 0o755)
        t.symlink("usr/local/bin/python3", ver)
        t.symlink("usr/local/bin/python", ver)
        t.tree(stdlib, f"usr/local/lib/{ver}", skip=_STDLIB_SKIP)
        t.dir(site)
        for name in packages:
            for entry in _site_entries(name):
                if entry.is_dir():
                    t.tree(entry, f"{site}/{entry.name}")
                else:
                    t.file(entry, f"{site}/{entry.name}")
        if with_ckptflow:
            t.tree(Path(ckptflow.__file__).parent, f"{site}/ckptflow")
        for b in binaries:
            path = shutil.which(b)
            if not path:
                raise RunnerUnavailable(f"{b} is not on PATH here", fix=f"install {b} first (./scripts/setup.sh)")
            t.file(Path(os.path.realpath(path)), f"usr/local/bin/{os.path.basename(b)}", 0o755)
        for src, arc in files:
            (t.tree(src, arc, exclude=tuple(exclude)) if src.is_dir() else t.file(src, arc))
        libs = _ldd(list(t.elves))
        for lib in sorted(libs):
            real = Path(os.path.realpath(lib))
            if os.path.basename(lib).startswith("ld-linux"):
                t.file(real, LOADER, 0o755)
            else:
                t.file(real, f"usr/lib/{os.path.basename(lib)}", 0o755)
        t.tar.close()
        os.replace(tmp, dest)
    except BaseException:
        t.tar.close()
        tmp.unlink(missing_ok=True)
        raise
    return dest


def inputs_digest(packages: list[str] = (), binaries: list[str] = (), files: list[tuple[Path, str]] = ()) -> str:
    """A short digest of what a rootfs would hold (interpreter, package versions, ckptflow's
    sources, binaries): an image tagged with it is rebuilt exactly when one of them changed."""
    h = hashlib.sha256(sys.version.encode())
    for name in packages:
        for entry in _site_entries(name):
            h.update(str(entry).encode())
            h.update(str(entry.stat().st_mtime_ns).encode())
    root = Path(ckptflow.__file__).parent
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    for b in binaries:
        path = shutil.which(b)
        h.update(f"{b}={path}:{os.stat(path).st_size if path else 0}".encode())
    for src, arc in files:
        h.update(f"{src}:{arc}".encode())
    return h.hexdigest()[:12]


def import_rootfs(runtime: str, tar: Path, image: str, timeout_s: float = 300) -> str:
    """``podman import`` the tar as ``image``; return the image id.

    Raises:
        RunnerUnavailable: the runtime is missing or refused the tar.
    """
    exe = shutil.which(runtime)
    if not exe:
        raise RunnerUnavailable(f"{runtime} not found on PATH", fix="run ./scripts/setup.sh as root (installs podman)")
    r = subprocess.run([exe, "import", str(tar), image], capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RunnerUnavailable(f"{runtime} import {tar} {image} failed: {r.stderr.strip()[-400:]}")
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else image


def image_exists(runtime: str, image: str) -> bool:
    exe = shutil.which(runtime)
    return bool(exe) and subprocess.run([exe, "image", "exists", image], capture_output=True, timeout=60).returncode == 0


DEMO_PACKAGES = ["numpy", "prometheus_client"]
DEMO_REPO = "localhost/ckptflow-demo"


def demo_image(runtime: str = "podman", work_dir: Path | None = None) -> str:
    """The demo worker's image (python, numpy, prometheus_client, ckptflow), tagged with the
    digest of its inputs; built from local files and imported only when that tag is missing."""
    tag = f"{DEMO_REPO}:{inputs_digest(DEMO_PACKAGES)}"
    if image_exists(runtime, tag):
        return tag
    work_dir = work_dir or Path(".ckptflow/containers")
    tar = build_rootfs(work_dir / f"demo-rootfs-{tag.rsplit(':', 1)[1]}.tar", packages=DEMO_PACKAGES)
    try:
        import_rootfs(runtime, tar, tag)
    finally:
        tar.unlink(missing_ok=True)
    prune_tags(runtime, DEMO_REPO, keep=tag)
    return tag


PRUNE_AFTER = "24h"  # another checkout on the node may have built its own tag minutes ago and be about to use it


def prune_tags(runtime: str, repo: str, keep: str) -> None:
    """Remove ``repo``'s other tags older than PRUNE_AFTER (one still used by a container stays:
    rmi refuses it)."""
    out = subprocess.run([runtime, "images", "--filter", f"reference={repo}", "--filter", f"until={PRUNE_AFTER}",
                          "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True, text=True, timeout=60).stdout.split()
    for old in (t for t in out if t != keep):
        subprocess.run([runtime, "rmi", old], capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptflow.runners.rootfs",
                                description="Build a container rootfs tar from this machine's files.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write a rootfs tar")
    b.add_argument("dest", type=Path)
    b.add_argument("--package", action="append", default=[], help="site-packages entry to include (repeat)")
    b.add_argument("--binary", action="append", default=[], help="binary on PATH to include (repeat)")
    b.add_argument("--file", action="append", default=[], help="SRC:PATH_INSIDE (repeat)")
    b.add_argument("--no-ckptflow", action="store_true")
    b.add_argument("--import-as", help="then podman import it as this image")
    d = sub.add_parser("demo-image", help="build and import the demo worker's image unless present; print its tag")
    d.add_argument("--runtime", default="podman")
    a = p.parse_args(argv)
    if a.cmd == "demo-image":
        print(demo_image(a.runtime))
        return 0
    files = [(Path(s.split(":", 1)[0]), s.split(":", 1)[1]) for s in a.file]
    build_rootfs(a.dest, packages=a.package, binaries=a.binary, with_ckptflow=not a.no_ckptflow, files=files)
    if a.import_as:
        import_rootfs("podman", a.dest, a.import_as)
    print(a.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
