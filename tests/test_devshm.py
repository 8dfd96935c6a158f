"""/dev/shm files a worker maps travel in its image (runners/devshm.py), without vLLM.

The worker does what vLLM's processes do: a shared-memory segment under its name in /dev/shm
(multiprocessing.shared_memory, sparse) and a named semaphore of a spawn context (glibc creates
it under a temporary name and links it to its own: a link-remap for CRIU). After a heartbeat
the segment changes and the worker is killed; the restore gives it the bytes of the dump.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptflow.models import CriuOptions, ProcessFinder, Workload

pytestmark = pytest.mark.criu

WORKER = r"""
import multiprocessing as mp, os, sys, time
from multiprocessing import shared_memory
lock = mp.get_context("spawn").Lock()                 # a named semaphore in /dev/shm
shm = shared_memory.SharedMemory(create=True, size=64 << 20)
shm.buf[0:5] = b"first"
shm.buf[32 << 20:(32 << 20) + 6] = b"middle"          # the rest stays a hole
open(sys.argv[2], "w").write(shm.name)
open(sys.argv[1], "w").write(str(os.getpid()))
while True:
    with lock:
        time.sleep(0.05)
"""


def _start(tmp_path: Path, isolated: bool = False) -> tuple[Path, int, Path]:
    """Start WORKER detached (``isolated``: PID 1 of its own namespaces); its pid file, host PID
    and segment, once it has made the segment."""
    from ckptflow.runners.isolate import isolated_argv

    pid_file, name_file = tmp_path / "w.pid", tmp_path / "shm.name"
    (tmp_path / "w.py").write_text(WORKER)
    if isolated:   # the worker writes 1, its PID inside, elsewhere: the host PID is unshare's to write
        argv = isolated_argv([sys.executable, str(tmp_path / "w.py"), str(tmp_path / "w.pid.ns"), str(name_file)],
                             pid_file, tmp_path / "w.log")
    else:
        argv = ["/bin/sh", "-c", f"exec {sys.executable} {tmp_path / 'w.py'} {pid_file} {name_file} "
                f"</dev/null >>{tmp_path / 'w.log'} 2>&1"]
    boot = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 20
    while not (pid_file.exists() and pid_file.read_text() and name_file.exists() and name_file.read_text()):
        if time.time() > deadline:
            os.killpg(boot.pid, signal.SIGKILL)   # the worker (and unshare): one session
            pytest.fail("the worker did not start")
        time.sleep(0.05)
    return pid_file, int(pid_file.read_text()), Path("/dev/shm") / name_file.read_text().lstrip("/")


def _kill_and_clean(pid: int, held: set[str], seg: Path) -> None:
    """SIGKILL the worker's tree and remove its /dev/shm files (``held`` and its segment)."""
    from ckptflow.runners.process import pid_alive, tree

    for p in tree(pid) if pid_alive(pid) else []:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for n in held | {seg.name}:
        (Path("/dev/shm") / n).unlink(missing_ok=True)


def test_a_heartbeat_carries_the_workers_shm_and_semaphore_and_the_restore_puts_them_back(tmp_path, criu):
    from ckptflow.runners import devshm
    from ckptflow.runners.process import pid_alive, tree

    pid_file, pid, seg = _start(tmp_path)
    w = Workload(name="w", node="local", find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="w.py"),
                 criu=CriuOptions(link_remap=True, devshm=True))
    img = tmp_path / "img"
    try:
        criu.dump(w, img, leave_running=True)
        saved = {f["name"]: f for f in devshm.saved(img)}
        assert seg.name in saved and saved[seg.name]["size"] == seg.stat().st_size
        # Only the data travels: two pages of a 64 MiB segment.
        assert sum(e[1] for e in saved[seg.name]["extents"]) <= 2 * 4096 * 16
        assert (img / devshm.DATA).stat().st_size < 1 << 20
        assert any(n.startswith(devshm.LINK_REMAP) for n in saved)        # the semaphore's remap file
        assert not any(n.startswith(devshm.LINK_REMAP) for n in os.listdir("/dev/shm"))  # CRIU dropped it

        with open(seg, "r+b") as f:                                       # newer than the image
            f.write(b"later")
        pids = tree(pid)
        for p in pids:
            os.kill(p, signal.SIGKILL)
        while any(pid_alive(p) for p in pids):
            time.sleep(0.02)
        assert criu.restore(img, old_pid=pid) == pid
        time.sleep(0.3)
        assert seg.read_bytes()[:5] == b"first"                           # as at the dump
        with open(seg, "rb") as f:
            f.seek(32 << 20)
            assert f.read(6) == b"middle"
        # The restored worker runs (its semaphore works): it is not stopped and not a zombie.
        assert pid_alive(pid)
        assert not any(n.startswith(devshm.LINK_REMAP) for n in os.listdir("/dev/shm"))
    finally:
        _kill_and_clean(pid, devshm.held(tree(pid)) if pid_alive(pid) else set(), seg)


def test_stale_link_remap_files_are_removed_unless_something_maps_them(tmp_path):
    import mmap

    from ckptflow.runners import devshm

    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "link_remap.7").write_bytes(b"x" * 32)
    (shm / "link_remap.8").write_bytes(b"y" * 4096)
    (shm / "psm_keep").write_bytes(b"z")
    with open(shm / "link_remap.8", "r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert devshm.remove_stale_link_remaps(shm) == ["link_remap.7"]
        assert sorted(os.listdir(shm)) == ["link_remap.8", "psm_keep"]


def test_a_worker_that_died_by_itself_leaves_nothing_in_dev_shm_after_the_next_heartbeat(tmp_path, monkeypatch):
    """Issue #36 finding 11: a worker that dies on its own (not killed by ckptflow) left its
    segment and semaphore in /dev/shm. The heartbeat that finds it gone removes what its
    checkpoints carry and no live process uses; a file another process still maps stays."""
    import json
    import mmap

    from ckptflow.runners import devshm
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.process import pid_alive, tree
    from ckptflow.store.local import LocalStore

    pid_file, pid, seg = _start(tmp_path)
    w = Workload(name="w", node="local", find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="w.py"),
                 criu=CriuOptions(link_remap=True, devshm=True))
    keep = Path("/dev/shm") / f"ckptflow-test-keep-{os.getpid()}"
    left: set[str] = set()
    try:
        with NodeRunner(LocalStore(tmp_path / "s")) as node:
            m = node.checkpoint(w)
            carried = {f["name"] for f in devshm.saved(node.store.images_dir(m))}
            assert seg.name in carried and any(n.startswith(devshm.LINK_REMAP) for n in carried)
            pids = tree(pid)
            left = devshm.held(pids)
            for p in pids:                      # it dies by itself: nothing of ckptflow's cleans up
                os.kill(p, signal.SIGKILL)
            while any(pid_alive(p) for p in pids):
                time.sleep(0.02)
            assert seg.exists() and left
            # A carried name that a live process maps now (a new worker's file under that name).
            keep.write_bytes(b"\0" * 4096)
            f = open(keep, "r+b")
            held_map = mmap.mmap(f.fileno(), 4096)
            index = node.store.images_dir(m) / devshm.INDEX
            doc = json.loads(index.read_text())
            doc["files"].append({**doc["files"][0], "name": keep.name})
            index.write_text(json.dumps(doc))
            # The next heartbeat, as the flow runs it: its facts find the worker gone (the batch
            # checkpoints nothing then), and the same step removes what it left.
            from contextlib import contextmanager

            from ckptflow.fleet import FleetScope, Node, PolicyChoice, Storage
            from ckptflow.tasks import node as node_tasks

            @contextmanager
            def this_runner(scope, name):
                yield node

            monkeypatch.setattr(node_tasks, "node_runner", this_runner)
            scope = FleetScope(fleet="t", storage=Storage(path=str(tmp_path / "s")))
            [row] = node_tasks.checkpoint_batch(scope, Node(name="local", work_pool="local"), [PolicyChoice(workload=w)])
            assert row["gone"] and not row["ok"] and row["checkpoint"] is None
            assert not seg.exists() and not any((Path("/dev/shm") / n).exists() for n in left)
            assert keep.exists()                                 # still mapped by this process
            held_map.close()
            f.close()
    finally:
        for n in {seg.name, keep.name} | left:
            (Path("/dev/shm") / n).unlink(missing_ok=True)


def test_a_copy_of_an_isolated_worker_beside_it_gets_a_dev_shm_of_its_own(tmp_path, criu):
    """An isolated worker (PID 1 of its own namespaces, as a GPU standby of vLLM needs) keeps
    files in /dev/shm; its copy restored beside it sees them as they were at the dump, in a
    tmpfs of its own, while the original's files keep what the original wrote since."""
    from ckptflow.runners import devshm
    from ckptflow.runners.isolate import is_isolated
    from ckptflow.runners.process import pid_alive, tree

    pid_file, pid, seg = _start(tmp_path, isolated=True)
    w = Workload(name="w", node="local", find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="w.py"),
                 criu=CriuOptions(link_remap=True, devshm=True))
    img, copy, held = tmp_path / "img", None, set()
    try:
        assert is_isolated(pid)
        held = devshm.held(tree(pid))
        criu.dump(w, img, leave_running=True)
        assert seg.name in {f["name"] for f in devshm.saved(img)}
        with open(seg, "r+b") as f:                                       # the original writes on
            f.write(b"later")
        before = sorted(os.listdir("/dev/shm"))
        copy = criu.restore_beside(img)
        time.sleep(0.3)
        assert pid_alive(copy.pid) and copy.pid != pid
        mine = Path(f"/proc/{copy.pid}/root/dev/shm") / seg.name            # the copy's view
        assert mine.read_bytes()[:5] == b"first"                           # as at the dump
        with open(mine, "rb") as f:
            f.seek(32 << 20)
            assert f.read(6) == b"middle"
        assert seg.read_bytes()[:5] == b"later"                            # the original's: untouched
        assert sorted(os.listdir("/dev/shm")) == before                   # nothing added to the node's
        assert "ckptflow-sandbox-shm" not in Path("/proc/self/mountinfo").read_text()
        time.sleep(0.3)
        assert pid_alive(copy.pid) and pid_alive(pid)                      # both still run
    finally:
        if copy is not None:
            copy.stop()
        _kill_and_clean(pid, held, seg)
