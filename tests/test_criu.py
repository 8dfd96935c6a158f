"""Round trips with real CRIU on real processes."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HELPERS, free_port, kill_pid_file
from ckptflow.errors import CriuError, RunnerUnavailable, UndeclaredProcess, WorkloadNotFound
from ckptflow.models import CheckpointState, ProcessFinder, Workload
from ckptflow.runners.criu import CriuRunner

pytestmark = pytest.mark.criu


def _wait_file(path: Path, timeout=10):
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _spawn(args, pid_file: Path):
    p = subprocess.Popen([sys.executable, *map(str, args)], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_file(pid_file)
    return p


def _read_counter(pid: int, out: Path) -> int:
    out.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    _wait_file(out)
    return int(out.read_text())


def test_counter_round_trip_keeps_memory(tmp_path, criu):
    pid_file, out = tmp_path / "c.pid", tmp_path / "count"
    p = _spawn([HELPERS / "counter.py", pid_file, out], pid_file)
    w = Workload(name="counter", node="n", find=ProcessFinder(pid_file=str(pid_file),
                                                              cmdline_must_contain="counter.py"))
    try:
        time.sleep(0.5)
        before = _read_counter(p.pid, out)
        assert before > 50
        res = criu.dump(w, tmp_path / "img", leave_running=False)
        assert res.pid == p.pid
        p.wait(timeout=10)  # the dump ended it; its PID must be free before the restore
        pid = criu.restore(tmp_path / "img", old_pid=res.pid)
        assert pid == res.pid
        after = _read_counter(pid, out)
        # Restored from memory: it goes on from where it was, not from zero.
        assert before <= after < before + 5000
    finally:
        kill_pid_file(pid_file, "counter.py")


def test_listening_socket_worker_continues_like_reference(tmp_path, criu, demo_worker):
    w, ref = demo_worker("live"), demo_worker("ref")
    for x in (w, ref):
        x.complete("The quick brown fox " * 20, 16, "s1")
    digests = w.digests()
    res = criu.dump(w.workload, tmp_path / "img", leave_running=False)
    pid = criu.restore(tmp_path / "img", old_pid=res.pid)
    assert pid == res.pid
    assert w.digests() == digests == ref.digests()
    assert w.complete("and then", 40, "s1") == ref.complete("and then", 40, "s1")


def test_leave_running_then_restore_after_kill(tmp_path, criu, demo_worker):
    w, ref = demo_worker("live"), demo_worker("ref")
    for x in (w, ref):
        x.complete("hello " * 50, 8, "s")
    criu.dump(w.workload, tmp_path / "img", leave_running=True)
    # Still serving after the heartbeat dump:
    assert w.complete("more", 4, "other") == ref.complete("more", 4, "other")
    os.kill(w.pid, signal.SIGKILL)
    pid = criu.restore(tmp_path / "img", old_pid=w.pid)
    # The session created after the dump is gone; the one before is intact.
    assert set(w.digests()) == {"s"}
    assert w.digests()["s"] == ref.digests()["s"]
    assert pid == w.pid


def test_512mib_process_round_trip(tmp_path, criu, demo_worker, store):
    from ckptflow.demo.launch import http_json

    w = demo_worker("big", ballast_mib=512)
    url = f"http://127.0.0.1:{w.port}/v1/ballast/digest"
    before = http_json(url)
    assert before["bytes"] == 512 << 20
    p = store.begin("big", node="n")
    res = criu.dump(w.workload, p.images_dir, leave_running=False)
    m = store.commit(p, timings={"dump": res.seconds}, pid=res.pid)
    assert m.bytes > 512 << 20
    criu.restore(store.verify_bytes(m), old_pid=res.pid)
    assert http_json(url) == before


def test_established_tcp_connection_survives(tmp_path, criu):
    port, pid_file = free_port(), tmp_path / "e.pid"
    p = _spawn([HELPERS / "echo_counter.py", port, pid_file], pid_file)
    w = Workload(name="echo", node="n", tcp_established=True,
                 find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="echo_counter.py"))
    try:
        c = socket.create_connection(("127.0.0.1", port), timeout=20)
        f = c.makefile("rwb")
        for i, word in enumerate([b"a", b"b"], 1):
            f.write(word + b"\n"); f.flush()
            assert f.readline() == f"{i} ".encode() + word + b"\n"
        res = criu.dump(w, tmp_path / "img", leave_running=False)
        p.wait(timeout=10)
        criu.restore(tmp_path / "img", old_pid=res.pid, tcp_established=True)
        # Same connection, same server state: the count goes on.
        f.write(b"c\n"); f.flush()
        assert f.readline() == b"3 c\n"
        c.close()
    finally:
        kill_pid_file(pid_file, "echo_counter.py")


def _gated(tmp_path, hold_s: float = 0.0, open_gate: bool = False):
    """tests/helpers/gated_listener.py: its workload, port, gate file and process."""
    port, pid_file, gate = free_port(), tmp_path / "g.pid", tmp_path / "gate"
    if open_gate:
        gate.touch()
    p = _spawn([HELPERS / "gated_listener.py", port, pid_file, gate, hold_s], pid_file)
    w = Workload(name="gated", node="n",
                 find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="gated_listener.py"))
    return w, port, gate, p


def _ss(*filt: str) -> list[str]:
    return subprocess.run(["ss", "-Htn", *filt], capture_output=True, text=True).stdout.splitlines()


def _wait_for(cond, timeout=10):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition never held"
        time.sleep(0.01)


def test_a_connection_waiting_in_the_accept_queue_does_not_fail_the_dump(tmp_path, criu):
    """A client whose handshake the kernel completed while the worker had not accepted it yet
    (a poll arriving as the dump freezes the worker): CRIU cannot carry it and refused the whole
    dump ("In-flight connection"); now it skips it. The restored worker serves the next client
    with its state from the image; the skipped client's connection ends instead of hanging."""
    w, port, gate, p = _gated(tmp_path)
    try:
        waiting = socket.create_connection(("127.0.0.1", port), timeout=10)
        listener = _ss("-l", f"( sport = :{port} )")
        assert listener and listener[0].split()[1] == "1", listener      # one connection in its accept queue
        res = criu.dump(w, tmp_path / "img", leave_running=False)
        p.wait(timeout=10)
        criu.restore(tmp_path / "img", old_pid=res.pid)
        gate.touch()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            assert c.makefile().readline() == "1\n"                     # the first connection it ever served
        waiting.settimeout(10)
        try:
            got = waiting.recv(16)
        except ConnectionResetError:
            got = b""
        assert got == b"", got
        waiting.close()
    finally:
        kill_pid_file(tmp_path / "g.pid", "gated_listener.py")


def test_a_request_being_answered_is_waited_out_and_a_held_connection_still_refused(tmp_path, monkeypatch):
    """A dump that meets a client's connection mid-request fails ("Connected TCP socket"); the
    worker runs on, the request is answered, and the dump is tried again. A connection the
    worker keeps open stays refused, naming tcp_established, with the worker untouched."""
    import ckptflow.runners.criu as criu_mod

    monkeypatch.setattr(criu_mod, "CONNECTED_RETRY_S", 0.5)
    logs = tmp_path / "logs"
    logs.mkdir()
    w, port, _, p = _gated(tmp_path, hold_s=1.0, open_gate=True)
    try:
        with CriuRunner(log_dir=logs) as criu, socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            _wait_for(lambda: _ss("state", "established", f"( sport = :{port} )"))   # accepted, being held
            criu.dump(w, tmp_path / "img", leave_running=True)
            tries = sorted(logs.glob("dump-*.log"), key=lambda f: f.stat().st_mtime)
            assert len(tries) >= 2 and "Connected TCP socket" in tries[0].read_text()
            assert c.makefile().readline() == "1\n"                      # answered, not cut off
        assert p.poll() is None
    finally:
        kill_pid_file(tmp_path / "g.pid", "gated_listener.py")

    monkeypatch.setattr(criu_mod, "CONNECTED_RETRY_S", 0.01)
    for f in logs.glob("*"):
        f.unlink()
    held = tmp_path / "held"
    held.mkdir()
    w, port, _, p = _gated(held, hold_s=-1, open_gate=True)
    try:
        with CriuRunner(log_dir=logs) as criu, socket.create_connection(("127.0.0.1", port), timeout=10):
            _wait_for(lambda: _ss("state", "established", f"( sport = :{port} )"))
            with pytest.raises(CriuError) as e:
                criu.dump(w, tmp_path / "img2", leave_running=False)
            assert "tcp_established" in (e.value.fix or "")
            assert len(list(logs.glob("dump-*.log"))) == 1 + criu_mod.CONNECTED_RETRIES
        assert p.poll() is None                                            # the worker runs on
    finally:
        kill_pid_file(held / "g.pid", "gated_listener.py")


@pytest.mark.fault
def test_refuses_undeclared_process(tmp_path, criu):
    # The pid file points at a process that is not what the workload declares.
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        pid_file = tmp_path / "w.pid"
        pid_file.write_text(str(sleeper.pid))
        w = Workload(name="w", node="n",
                     find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="ckptflow.demo.worker"))
        with pytest.raises(UndeclaredProcess, match="lacks 'ckptflow.demo.worker'"):
            criu.dump(w, tmp_path / "img", leave_running=True)
        assert not (tmp_path / "img").exists() or not any((tmp_path / "img").iterdir())
        assert sleeper.poll() is None
    finally:
        sleeper.kill()


def test_process_gone_names_the_cause(tmp_path, criu):
    w = Workload(name="gone", node="n", find=ProcessFinder(pid_file=str(tmp_path / "none.pid")))
    with pytest.raises(WorkloadNotFound, match="pid file .* does not exist") as e:
        criu.dump(w, tmp_path / "img", leave_running=True)
    assert "fix:" in str(e.value)
    (tmp_path / "none.pid").write_text("999999999")
    with pytest.raises(WorkloadNotFound, match="no live process"):
        criu.dump(w, tmp_path / "img", leave_running=True)


def test_missing_criu_binary_is_unavailable_with_fix():
    r = CriuRunner(criu_bin="/nonexistent/criu")
    with pytest.raises(RunnerUnavailable, match="not found") as e:
        r.check()
    assert "setup.sh" in str(e.value)


def test_corrupt_image_gives_criu_error_with_log_tail(tmp_path, criu, demo_worker):
    w = demo_worker("c")
    res = criu.dump(w.workload, tmp_path / "img", leave_running=False)
    core = next((tmp_path / "img").glob("core-*.img"))
    core.write_bytes(b"\0" * 16)
    with pytest.raises(CriuError) as e:
        criu.restore(tmp_path / "img", old_pid=res.pid)
    assert e.value.cmd[1] == "restore" and e.value.log_tail
    assert "criu log tail" in str(e.value)


@pytest.mark.fault
def test_full_disk_discards_the_partial_checkpoint(tmp_path, demo_worker):
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], check=True)
    try:
        w = demo_worker("full", ballast_mib=96)
        node = NodeRunner(LocalStore(mnt / "store"))
        with pytest.raises(CriuError) as e:
            node.checkpoint(w.workload)
        assert "space" in str(e.value).lower()
        assert node.store.list("full") == []
        assert not any(p.is_dir() for p in (mnt / "store" / "full").iterdir())  # bytes discarded
        assert len(w.complete("still alive", 4)) == 4         # the worker kept running: it answers in full
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_sandbox_copy_beside_the_running_original(tmp_path, criu, demo_worker):
    """criu-ns restore in its own PID and network namespace; the original is untouched."""
    w = demo_worker("orig")
    w.complete("sandbox me " * 10, 8, "s")
    digests = w.digests()
    res = criu.dump(w.workload, tmp_path / "img", leave_running=True)
    ns = f"ckt{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        copy = criu.restore_beside(tmp_path / "img", netns=ns)
        assert copy.pid != res.pid
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                              f"import urllib.request;print(urllib.request.urlopen("
                              f"'http://127.0.0.1:{w.port}/v1/sessions/digests').read().decode())"],
                             capture_output=True, text=True, timeout=30)
        assert digests["s"] in out.stdout, out.stderr
        copy.stop()
        assert not Path(f"/proc/{copy.pid}").exists()
        assert w.digests() == digests and w.proc.poll() is None
    finally:
        subprocess.run(["ip", "netns", "del", ns])


def test_sandbox_copy_of_a_tree_holding_tcp_between_its_processes(tmp_path, criu):
    """A tree whose processes talk over loopback TCP (a TP vLLM's ranks, a GPU vLLM's TCPStore),
    dumped with tcp_established, is copied beside the original (verify, standby, replica): the
    copy's restore gets --tcp-established too (without it CRIU refuses the image: 'Connected TCP
    socket in image'), and the copy's inner connection carries on from the count at the dump."""
    import urllib.request

    port, pid_file = free_port(), tmp_path / "t.pid"
    p = _spawn([HELPERS / "tcp_pair.py", port, pid_file], pid_file)
    w = Workload(name="pair", node="n", tcp_established=True,
                 find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="tcp_pair.py"))
    ns = f"ckp{os.getpid() % 100000}"
    try:
        count = lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=20).read()
        assert count() == b"1\n" and count() == b"2\n"
        criu.dump(w, tmp_path / "img", leave_running=True)
        assert count() == b"3\n"                              # the original carries on
        subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        copy = criu.restore_beside(tmp_path / "img", netns=ns, tcp_established=w.tcp_established)
        try:
            out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                                  f"import urllib.request;print(urllib.request.urlopen("
                                  f"'http://127.0.0.1:{port}/', timeout=20).read().decode())"],
                                 capture_output=True, text=True, timeout=60)
            assert out.stdout.strip() == "3", out.stderr            # the dump's state: 2 counted, then one more
        finally:
            copy.stop()
        assert count() == b"4\n" and p.poll() is None              # the original untouched by its copy
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        kill_pid_file(pid_file, "tcp_pair.py")


def test_restore_resumes_every_process_of_the_tree(tmp_path, store):
    # Found on the H200 with a TP=2 worker: CRIU's --leave-stopped stops the whole tree; a child
    # left stopped (another rank) hung the restore. Every restored process must run again.
    import signal

    from conftest import free_port
    from ckptflow.demo import launch
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.process import pid_alive, pid_stopped, tree

    port, pid_file = free_port(), tmp_path / "tree.pid"
    proc = launch.start_worker(port, pid_file, extra=["--helper"])
    w = launch.demo_workload("tree", port, pid_file)
    root = int(pid_file.read_text())
    before = tree(root)
    assert len(before) == 2
    node = NodeRunner(store)
    try:
        m = node.checkpoint(w, leave_running=False)             # the whole tree exits
        proc.wait(timeout=30)
        for p in before:
            node.criu.wait_pid_free(p)
        res = node.restore(w, manifest=m)
        after = tree(res.pid)
        assert after == before                                  # same PIDs, parent and child
        assert not any(pid_stopped(p) for p in after) and all(pid_alive(p) for p in after)
        assert len(launch.complete(port, "still there", 4)) == 4   # the restored pair serves
    finally:
        for p in tree(root):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_runner_leaves_no_temp_dir_and_removes_a_killed_runners(tmp_path, demo_worker):
    import tempfile

    def dirs():
        return set(Path(tempfile.gettempdir()).glob(f"ckptflow-criu-{os.getpid()}-*"))  # ours: other CRIU users share /tmp

    # A runner killed mid-call (SIGKILL: no cleanup ran) left its directory behind.
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = Path(tempfile.gettempdir()) / f"ckptflow-criu-{dead.pid}-x1y2z3"
    (orphan / "no-plugins").mkdir(parents=True)
    before = dirs() - {orphan}
    w = demo_worker("w")
    with CriuRunner() as r:
        res = r.dump(w.workload, tmp_path / "img", leave_running=False)
        w.proc.wait(timeout=10)
        r.restore(tmp_path / "img", old_pid=res.pid)
        assert r.log_dir.is_dir() and not orphan.exists()
    assert dirs() <= before
    r2 = CriuRunner()
    r2.version()  # no CRIU call that needs its directory: none is made
    del r2
    assert dirs() <= before


def test_restore_frees_time_wait_on_a_listening_port_of_the_image(tmp_path, criu):
    """A worker killed and restored at once on the same node: its listening port still has
    TIME_WAIT connections, so CRIU's bind fails ("Address already in use"). The runner finds the
    port in CRIU's log, closes those orphaned connections, and the restore succeeds."""
    pid_file, out = tmp_path / "t.pid", tmp_path / "count"
    p = _spawn([HELPERS / "tw_listener.py", pid_file, out], pid_file)
    w = Workload(name="tw", node="n", find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="tw_listener.py"))
    try:
        before, port = map(int, _read_counter_raw(p.pid, out).split())
        tw = subprocess.run(["ss", "-Htan", "state", "time-wait", f"( sport = :{port} )"], capture_output=True,
                            text=True).stdout
        assert tw.strip(), "the helper should leave a TIME_WAIT connection on its listening port"
        res = criu.dump(w, tmp_path / "img", leave_running=False)
        p.wait(timeout=10)
        pid = criu.restore(tmp_path / "img", old_pid=res.pid)
        after, port2 = map(int, _read_counter_raw(pid, out).split())
        assert port2 == port and after >= before
        s = socket.socket()
        with pytest.raises(OSError):  # the restored listener holds the port again
            s.bind(("127.0.0.1", port))
        s.close()
    finally:
        kill_pid_file(pid_file, "tw_listener.py")


def test_busy_listen_ports_reads_the_port_from_criu_log(tmp_path):
    from ckptflow.runners.criu import busy_listen_ports

    log = tmp_path / "restore.log"
    log.write_text(
        "(00.174794)   2003: inet: \tRestore: family AF_INET    type SOCK_STREAM    proto IPPROTO_TCP      "
        "port 51491 state TCP_LISTEN       src_addr 192.0.2.2\n"
        "(00.178461)   2004: inet: \tRestore: family AF_INET    type SOCK_STREAM    proto IPPROTO_TCP      "
        "port 34061 state TCP_LISTEN       src_addr 192.0.2.2\n"
        "(00.174818)   2003: Error (criu/sk-inet.c:1059): inet: Can't bind inet socket (id 107): "
        "Address already in use\n")
    assert busy_listen_ports(log) == {51491}


def _read_counter_raw(pid: int, out: Path) -> str:
    out.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    _wait_file(out)
    return out.read_text()


# --- the process probes CRIU acts on (runners/process.py, psutil) ---------------------------------
def test_process_tree_environ_start_time_and_stopped_state(tmp_path):
    import psutil

    from ckptflow.poll import poll
    from ckptflow.runners import process

    marker = f"ckptflow-probe-{os.getpid()}"
    p = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                          "subprocess.Popen(['sh', '-c', 'sleep 60 & wait']); time.sleep(60)", marker],
                         env={**os.environ, "CKPTFLOW_PROBE_MARK": marker}, start_new_session=True)
    try:
        pids = poll(lambda: len(process.tree(p.pid)) == 3 and process.tree(p.pid), 10, 0.02,
                    what="python -> sh -> sleep")
        assert pids[0] == p.pid
        for i, pid in enumerate(pids[1:], 1):                    # parents first, grandchildren included
            assert psutil.Process(pid).ppid() in pids[:i]
        assert process.environ(p.pid)["CKPTFLOW_PROBE_MARK"] == marker
        stat = Path(f"/proc/{p.pid}/stat").read_text()
        assert process.start_time(p.pid) == int(stat.rsplit(")", 1)[1].split()[19])  # clock ticks, as recorded
        w = Workload(name="probe", node="n", find=ProcessFinder(cmdline_match=marker))
        found = process.resolve(w)                               # the /proc scan, by command line
        assert (found.pid, found.start_time) == (p.pid, process.start_time(p.pid)) and marker in found.cmdline
        assert process.recheck(w, found) == found
        os.kill(p.pid, signal.SIGSTOP)
        poll(lambda: process.pid_stopped(p.pid), 5, 0.01, what="state T")
        assert process.pid_alive(p.pid)                          # stopped is alive
        os.kill(p.pid, signal.SIGCONT)
        poll(lambda: not process.pid_stopped(p.pid), 5, 0.01, what="running again")
    finally:
        for pid in reversed(process.tree(p.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def test_a_zombie_is_not_alive_but_holds_its_pid_until_reaped(tmp_path, criu):
    import psutil

    from ckptflow.errors import PidBusy
    from ckptflow.poll import poll
    from ckptflow.runners import process

    z = subprocess.Popen(["true"])
    poll(lambda: psutil.Process(z.pid).status() == psutil.STATUS_ZOMBIE, 5, 0.01, what="a zombie")
    assert not process.pid_alive(z.pid) and process.pid_taken(z.pid)
    pid_file = tmp_path / "z.pid"
    pid_file.write_text(str(z.pid))
    with pytest.raises(WorkloadNotFound, match="no live process"):
        process.resolve(Workload(name="z", node="n", find=ProcessFinder(pid_file=str(pid_file))))
    criu.wait_pid_free(z.pid, timeout_s=5)                       # our child: reaped, then free
    assert not process.pid_taken(z.pid)
    z.poll()                                                     # Popen learns it is gone (ECHILD)
    gone = 999_999_999
    assert (process.pid_alive(gone), process.pid_stopped(gone), process.start_time(gone), process.environ(gone),
            process.tree(gone)) == (False, False, None, {}, [gone])
    live = subprocess.Popen(["sleep", "30"])
    try:
        t0 = time.monotonic()
        with pytest.raises(PidBusy, match=f"PID {live.pid} needed by the image is still in use"):
            criu.wait_pid_free(live.pid, timeout_s=0.2)
        assert time.monotonic() - t0 < 2
    finally:
        live.kill()
        live.wait()


def test_a_restore_whose_working_directory_is_gone_names_it_and_the_fix(tmp_path):
    """Issue #36 finding 10: CRIU's `Can't open cwd` reached the operator as `fix | -`. The
    directory is named, with what to do."""
    import shutil

    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    cwd, pid_file = tmp_path / "workdir", tmp_path / "c.pid"
    cwd.mkdir()
    log = open(tmp_path / "c.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", "import os, time\nopen(os.environ['PF'], 'w').write(str(os.getpid()))"
                             "\nwhile True: time.sleep(0.1)  # ckptflow-cwd"], cwd=cwd,
                            env={**os.environ, "PF": str(pid_file)}, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True)
    deadline = time.time() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline
        time.sleep(0.02)
    w = Workload(name="c", node="n", find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="ckptflow-cwd"))
    with NodeRunner(LocalStore(tmp_path / "s")) as node:
        m = node.checkpoint(w, leave_running=False)
        proc.wait()
        shutil.rmtree(cwd)
        with pytest.raises(CriuError) as e:
            node.restore(w)
        assert e.value.fix == (f"the directory the worker ran in ({cwd}) is gone since the checkpoint; recreate it "
                               "(same path) or start workers from a directory that stays, then checkpoint again")
        # The node's fault, not the image's (new-user trial: the third such recover marked the last
        # good checkpoint verify_failed): not counted, however often it is tried.
        from ckptflow.runners.node import MAX_FAILED_RESTORES
        for _ in range(MAX_FAILED_RESTORES):
            node.criu.wait_pid_free(m.pid)
            with pytest.raises(CriuError, match="cwd"):
                node.restore(w)
        cur = node.store.get("c", m.id)
        assert cur.state == CheckpointState.complete and cur.probe.restores.failures == []
        node.criu.wait_pid_free(m.pid)
        cwd.mkdir()                                                          # the fix, followed
        r = node.restore(w)
        os.kill(r.pid, signal.SIGKILL)



# The stats-dump CRIU 4.2.1 wrote for a `sleep` dumped with --leave-running, and what `crit decode`
# read in it (times in µs).
STATS_DUMP = bytes.fromhex("4059105506330957200000000a1e084a10a22218b402207028393000381e4000480050065806600068007000")
STATS_DECODED = {"freezing_time": 74, "frozen_time": 4386, "memdump_time": 308, "memwrite_time": 112,
                 "pages_scanned": 57, "pages_skipped_parent": 0, "pages_written": 30, "irmap_resolve": 0,
                 "pages_lazy": 0, "page_pipes": 6, "page_pipe_bufs": 6}


def test_dump_stats_read_as_crit_reads_them(tmp_path):
    from ckptflow.runners.criu import dump_stats

    (tmp_path / "stats-dump").write_bytes(STATS_DUMP)
    assert dump_stats(tmp_path) == STATS_DECODED
    (tmp_path / "stats-dump").write_bytes(STATS_DUMP[:20])          # torn: no figure rather than a wrong one
    assert dump_stats(tmp_path) is None
    assert dump_stats(tmp_path / "none") is None


def test_a_heartbeats_pause_is_the_time_criu_held_the_worker_frozen(tmp_path, demo_worker, store):
    """The pause a heartbeat reports (which the cadence prices) is CRIU's frozen time, not its whole
    run: CRIU's start-up before the freeze and its clean-up after the thaw hold nobody. A dump that
    stops the worker holds it for the whole run."""
    import shutil as sh

    from ckptflow.runners.criu import dump_stats
    from ckptflow.runners.node import NodeRunner

    w = demo_worker("hb", ballast_mib=64)
    with NodeRunner(store) as node:
        m = node.checkpoint(w.workload)
        stats = dump_stats(store.images_dir(m))
        assert stats and stats["pages_written"] > (64 << 20) // 4096     # the ballast was written
        assert m.timings["frozen"] == round(stats["frozen_time"] / 1e6, 4) == m.timings["pause"]
        assert 0 < m.timings["pause"] < m.timings["dump"]
        if sh.which("crit"):   # CRIU's own decoder, where installed, reads the same
            out = subprocess.run(["crit", "decode", "-i", str(store.images_dir(m) / "stats-dump")],
                                 capture_output=True, text=True, check=True).stdout
            assert f'"frozen_time": {stats["frozen_time"]}' in out
        stop = node.checkpoint(w.workload, leave_running=False)
        assert stop.timings["pause"] == stop.timings["dump"] >= stop.timings["frozen"]
