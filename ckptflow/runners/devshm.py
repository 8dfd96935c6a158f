"""The /dev/shm files of a worker's tree, carried in its checkpoint image.

CRIU dumps the *contents* of private memory, but a file the tree maps from /dev/shm is only
referred to by its path: vLLM's shared-memory rings between its processes (``psm_*``) and its
named semaphore stay outside the image. A restore then reads whatever is in /dev/shm at that
moment: nothing on another node, later ring contents after a SIGKILL on the same node, or a
live original's files (a sandbox copy would share them). And with ``--link-remap``, the hard
link CRIU makes for a semaphore opened under a since-replaced name (``link_remap.N``) is
deleted again after a ``--leave-running`` dump, so a heartbeat of vLLM is not restorable as
is (`Can't link dev/shm/link_remap.N -> …`, measured; docs/engines/vllm.md).

So CRIU runs this module as its ``post-dump`` action script, while every task of the tree is
still frozen and the link-remap files still exist: each /dev/shm file the tree has open or
mapped, and each link-remap file this dump created, is written into the image directory as
its data extents only (the rings are sparse: 400 MiB apparent, kilobytes used). Before a
restore they are put back as they were at the dump.

Example:
    >>> saved = save(Path("img"), root_pid=1234, before=set())     # doctest: +SKIP
    >>> put_back(Path("img"), Path("/dev/shm"))                     # doctest: +SKIP

Kept free of pydantic and the rest of ckptflow: CRIU starts it for every dump.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SHM = Path("/dev/shm")
INDEX = "ckptflow-devshm.json"
DATA = "ckptflow-devshm.bin"
LINK_REMAP = "link_remap."
_EXTENT = 8 << 20


def tree(root_pid: int) -> list[int]:
    """``root_pid`` and its descendants, from /proc's children lists (no psutil: CRIU runs this)."""
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def open_paths(pid: int) -> list[str]:
    """What the process's open files and file mappings point to (``/proc/PID/fd`` and
    ``map_files`` link targets); [] when it is gone or unreadable."""
    out = []
    for sub in ("fd", "map_files"):
        try:
            entries = os.listdir(f"/proc/{pid}/{sub}")
        except OSError:
            continue
        for e in entries:
            try:
                out.append(os.readlink(f"/proc/{pid}/{sub}/{e}"))
            except OSError:
                continue
    return out


def files_of(pids: list[int], shm: Path = SHM) -> set[str]:
    """Names of the /dev/shm files the processes hold open or map, that exist under that name."""
    names: set[str] = set()
    prefix = str(shm) + "/"
    for pid in pids:
        paths = open_paths(pid)
        for p in paths:
            # "(deleted)": no name left to restore it under; CRIU keeps those itself (ghost
            # files, or a link-remap file that this module saves by its own name).
            if p.startswith(prefix) and not p.endswith(" (deleted)") and "/" not in p[len(prefix):]:
                names.add(p[len(prefix):])
    return {n for n in names if (shm / n).is_file()}


def held(pids: list[int], shm: Path = SHM) -> set[str]:
    """Every name in ``shm`` of a file the processes use: open or mapped under it, or mapped
    under a since-replaced name (glibc's semaphores) with the same inode. What a killed tree
    leaves behind."""
    names = files_of(pids, shm)
    inodes = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith(str(shm) + "/"):
                        inodes.add(int(parts[4]))
        except OSError:
            continue
    try:
        for n in os.listdir(shm):
            try:
                if os.stat(shm / n).st_ino in inodes:
                    names.add(n)
            except OSError:
                continue
    except OSError:
        pass
    return names


def needed(pids: list[int], shm: Path = SHM) -> bool:
    """Whether the tree holds anything in /dev/shm that the image would lack (named or deleted)."""
    prefix = str(shm) + "/"
    return any(p.startswith(prefix) for pid in pids for p in open_paths(pid))


def _extents(fd: int, size: int):
    """(offset, length) of the data in a possibly sparse file."""
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end - start
        off = end


def save(images_dir: Path, root_pid: int, before: set[str], shm: Path = SHM) -> dict:
    """Write the tree's /dev/shm files and this dump's link-remap files into ``images_dir``."""
    names = files_of(tree(root_pid), shm)
    names |= {n for n in os.listdir(shm) if n.startswith(LINK_REMAP) and n not in before}
    index: dict = {"files": []}
    inodes: set[int] = set()
    with open(images_dir / DATA, "wb") as out:
        os.fchmod(out.fileno(), 0o600)
        for name in sorted(names):
            path = shm / name
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                entry = {"name": name, "size": st.st_size, "mode": st.st_mode & 0o7777, "extents": []}
                for start, length in _extents(fd, st.st_size):
                    entry["extents"].append([start, length, out.tell()])
                    done = 0
                    while done < length:
                        chunk = os.pread(fd, min(_EXTENT, length - done), start + done)
                        if not chunk:
                            break
                        out.write(chunk)
                        done += len(chunk)
            finally:
                os.close(fd)
            index["files"].append(entry)
            inodes.add(st.st_ino)
    # Other names of the same files (glibc's semaphore under its own name, whose link-remap the
    # image carries): what a worker that dies by itself leaves behind besides the carried names.
    index["aliases"] = sorted(n for n in os.listdir(shm) if n not in names and _ino(shm / n) in inodes)
    tmp = images_dir / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index))
    os.chmod(tmp, 0o600)
    os.replace(tmp, images_dir / INDEX)
    return index


def _ino(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def saved(images_dir: Path) -> list[dict]:
    """The files an image carries ([] for an image without any)."""
    try:
        return json.loads((images_dir / INDEX).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return []


def put_back(images_dir: Path, shm: Path = SHM) -> list[str]:
    """Write every carried file into ``shm`` as it was at the dump (replacing what is there).

    Only call this when no live process uses these files: a restore over a dead worker, or a
    sandbox with a /dev/shm of its own.
    """
    names = []
    files = saved(images_dir)
    if not files:
        return names
    with open(images_dir / DATA, "rb") as data:
        for entry in files:
            path = shm / entry["name"]
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, entry["mode"])
            try:
                os.fchmod(fd, entry["mode"])
                os.ftruncate(fd, entry["size"])
                for start, length, at in entry["extents"]:
                    data.seek(at)
                    done = 0
                    while done < length:
                        chunk = data.read(min(_EXTENT, length - done))
                        os.pwrite(fd, chunk, start + done)
                        done += len(chunk)
            finally:
                os.close(fd)
            names.append(entry["name"])
    return names


def remove(images_dir: Path, shm: Path = SHM) -> None:
    """Remove from ``shm`` the files an image carries (the worker moved away: nothing else uses them)."""
    for entry in saved(images_dir):
        try:
            (shm / entry["name"]).unlink()
        except OSError:
            pass


def remove_orphans(images_dir: Path, shm: Path = SHM) -> list[str]:
    """Remove the files an image carries that no live process uses: what a worker that died by
    itself (not killed by ckptflow, which cleans after itself) left in ``shm`` (vLLM: ~400 MiB
    apparent of ``psm_*`` rings and its semaphore). A file some process still holds stays.
    Returns the names removed."""
    names = {e["name"] for e in saved(images_dir)}
    try:
        names |= set(json.loads((images_dir / INDEX).read_text()).get("aliases", []))
    except (OSError, ValueError):
        pass
    if not names:
        return []
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    left = sorted((names & {n for n in os.listdir(shm)}) - held(pids, shm)) if shm.is_dir() else []
    for n in left:
        try:
            (shm / n).unlink()
        except OSError:
            pass
    return left


def remove_link_remaps(names: list[str], shm: Path = SHM) -> None:
    """Remove the link-remap files among ``names`` (put back for a restore that then failed)."""
    for n in names:
        if n.startswith(LINK_REMAP):
            try:
                (shm / n).unlink()
            except OSError:
                pass


def remove_stale_link_remaps(shm: Path = SHM) -> list[str]:
    """Remove ``link_remap.*`` files no process maps or holds open. CRIU names them by file id and
    refuses a dump whose name is taken (`Can't link remap … File exists`); a restore that worked
    unlinks its own, so one still there belongs to nothing."""
    try:
        remaps = {n: os.stat(shm / n).st_ino for n in os.listdir(shm) if n.startswith(LINK_REMAP)}
    except OSError:
        return []
    if not remaps:
        return []
    used: set[int] = set()
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith(str(shm) + "/"):
                        used.add(int(parts[4]))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(shm) + "/" + LINK_REMAP):
                        used.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
                except OSError:
                    continue
        except OSError:
            continue
    gone = [n for n, ino in remaps.items() if ino not in used]
    for n in gone:
        try:
            (shm / n).unlink()
        except OSError:
            pass
    return gone


def action_script(script: Path, images_dir: Path, root_pid: int, shm: Path = SHM) -> Path:
    """Write the CRIU ``--action-script`` for one dump (CRIU execs it without arguments)."""
    before = sorted(n for n in os.listdir(shm) if n.startswith(LINK_REMAP))
    args = json.dumps({"images_dir": str(images_dir), "root_pid": root_pid, "before": before, "shm": str(shm)})
    pkg = str(Path(__file__).resolve().parents[2])
    script.write_text(
        "#!/bin/sh\n"
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        f"PYTHONPATH={_q(pkg)} exec {_q(sys.executable)} -I -c "
        f"{_q('import sys; sys.path.insert(0, sys.argv[2]); from ckptflow.runners import devshm; devshm._main(sys.argv[1])')}"
        f" {_q(args)} {_q(pkg)}\n")
    script.chmod(0o700)
    return script


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def _main(arg: str) -> None:
    a = json.loads(arg)
    save(Path(a["images_dir"]), a["root_pid"], set(a["before"]), Path(a["shm"]))
