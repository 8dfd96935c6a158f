"""CRIU runner: dump and restore a declared workload's process tree.

No Prefect here: drive it from a script, a test or a task alike.

Example:
    >>> runner = CriuRunner()                                  # doctest: +SKIP
    >>> res = runner.dump(workload, Path("img"), leave_running=True)
    >>> pid = runner.restore(Path("img"), old_pid=res.pid)

Facts this module relies on (measured, see README "CRIU"):
- CRIU >= 4.2 is needed on kernels >= 6.16 to dump AF_INET sockets.
- A restore needs the dumped PID free; PID 1 reaps orphans only after 1-2 s here, so restore
  waits for /proc/PID to go (and reaps it itself when the dumped process was its child).
- Established TCP needs `--tcp-established --network-lock nftables` on both sides
  (iptables is not installed).
- A connection in a listener's accept queue is skipped (`--skip-in-flight`: its client sees a
  reset); a dump that meets a client's connection mid-request is tried again, as that closes
  in milliseconds (CONNECTED_RETRIES). Measured on the demo worker under three polling clients:
  28 of 30 dumps failed "In-flight connection" without the flag, 16 of 30 then "Connected TCP
  socket" without the retry.
- `-L` must name an existing directory; an empty one loads no plugin (CRIU's cuda plugin
  fails on the H200 nodes: the CUDA runner drives the driver API itself).
- A regular file the tree writes (a log opened with `>` or `>>`) that grew after the dump
  fails the restore (`File … has bad size`): the restore hands the tree that file, opened
  for appending, with `--inherit-fd` instead of letting CRIU reopen and size-check it.
- CRIU cannot dump io_uring (uvloop's libuv in vLLM's API server maps a ring): refused
  before the dump, with the node setting that avoids it.
- CRIU 4.2 saves neither a process's AMX permission nor its tile state: a restored process
  that had AMX enabled died of SIGILL (vLLM's CPU worker on an AMX Xeon). Asked inside each
  process (runners/xcomp.py) and refused before the dump, with the oneDNN cap that avoids it.
- The dump's own flags (link-remap, external UNIX sockets, file locks) must be repeated on
  restore: they are recorded beside the image (CRIU_FLAGS_FILE) and read back from there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import psutil

from ckptflow.errors import CriuError, CriuTimeout, PidBusy, RunnerUnavailable, UnsupportedWorkload
from ckptflow.models import CriuOptions, Workload
from ckptflow.poll import PollTimeout, poll
from ckptflow.runners import devshm, xcomp
from ckptflow.runners.isolate import is_isolated, nspid
from ckptflow.runners.process import DeclaredProcess, pid_alive, pid_taken, recheck, resolve, tree
from ckptflow.settings import settings

MIN_VERSION = (4, 2)
DEFAULT_TIMEOUT_S = 600  # a 50 GiB image dumps in ~35 s on an H200 node; 10 min means stuck
PID_FREE_TIMEOUT_S = 15  # init reaps orphans in 1.2-2 s here; 15 s means the PID was reused
# A dump that meets an established TCP connection of a workload without tcp_established fails
# (CRIU: "Connected TCP socket"). A serving worker holds a client's connection for the
# milliseconds of one request: the dump is tried again this often, this far apart.
CONNECTED = "Connected TCP socket"
CONNECTED_RETRIES = 3
CONNECTED_RETRY_S = 0.1
log = logging.getLogger("ckptflow")


@dataclass(frozen=True)
class DumpResult:
    pid: int
    seconds: float
    log: Path
    # How long the tree was frozen, from CRIU's own stats (None when it wrote none): ``seconds``
    # is CRIU's whole run, and its start-up before the freeze and its clean-up after the thaw
    # hold nobody (measured on a CPU vLLM beside a generating client: 5.70 s run, 1.82 s frozen).
    frozen_s: float | None = None


_DUMP_STATS = ("freezing_time", "frozen_time", "memdump_time", "memwrite_time", "pages_scanned",
               "pages_skipped_parent", "pages_written", "irmap_resolve", "pages_lazy", "page_pipes",
               "page_pipe_bufs")   # DumpStatsEntry's fields 1..11 (CRIU's images/stats.proto)


def _varint(b: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        c = b[i]
        v, i, shift = v | (c & 0x7F) << shift, i + 1, shift + 7
        if not c & 0x80:
            return v, i


def dump_stats(images_dir: Path) -> dict[str, int] | None:
    """CRIU's account of the dump into ``images_dir`` (its ``stats-dump``): times in µs, page
    counts; None when there is none or it cannot be read. The file is two magics, a 4-byte
    length and one StatsEntry whose field 1 is the DumpStatsEntry; read here without protobuf,
    which the runner does not otherwise need (checked against ``crit decode`` in the tests)."""
    try:
        b = (images_dir / "stats-dump").read_bytes()
        size = int.from_bytes(b[8:12], "little")
        entry, i, out = b[12:12 + size], 0, {}
        while i < len(entry):
            key, i = _varint(entry, i)
            if key != (1 << 3 | 2):  # not the dump entry (a restore's, in another CRIU)
                return out or None
            n, i = _varint(entry, i)
            end = i + n
            if end > len(entry):   # torn: no figure rather than some of them
                return None
            while i < end:
                key, i = _varint(entry, i)
                if key & 7 != 0:
                    return out or None
                v, i = _varint(entry, i)
                if 1 <= key >> 3 <= len(_DUMP_STATS):
                    out[_DUMP_STATS[(key >> 3) - 1]] = v
        return out or None
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class SandboxCopy:
    """A restored copy running in its own PID namespace beside the original."""

    pid: int          # host PID of the restored root task
    init_pid: int     # host PID of the namespace's init (criu); killing it ends the copy
    netns: str | None

    def stop(self, timeout_s: float = 10) -> None:
        """Kill the copy and wait (best effort, ``timeout_s``) until both its processes are gone."""
        for pid in (self.pid, self.init_pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        def gone() -> bool:
            _reap(self.init_pid)
            return not (pid_alive(self.pid) or pid_alive(self.init_pid))

        try:
            poll(gone, timeout_s, 0.05, what=f"sandbox copy {self.pid} (init {self.init_pid}) to exit")
        except PollTimeout as e:
            log.warning("%s; left to the kernel", e)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    # The RLIMIT_NOFILE warning appears in every log here and explains nothing.
    text = [t for t in text if "RLIMIT_NOFILE" not in t]
    return "\n".join(text[-lines:])


def parse_version(text: str) -> tuple[int, ...] | None:
    m = re.search(r"Version:\s*([0-9]+(?:\.[0-9]+)*)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


# A relocatable CRIU bundle (scripts/criu-bundle.sh) is looked for here when `criu` is not on
# PATH: the project's own .carry/criu (relative to the working directory, which for a node
# worker is the project directory: see `ckptflow deploy`), then the system-wide location.
BUNDLE_CANDIDATES = (Path(".carry/criu/bin/criu"), Path("/opt/ckptflow/criu/bin/criu"))


@dataclass(frozen=True)
class CriuBinary:
    """The CRIU binary to run and where it came from."""

    path: str    # a path, or the name "criu" (looked up on PATH when run)
    source: str  # "argument", "CKPTFLOW_CRIU", "PATH", "bundle", or "missing" (nothing found)


def find_criu(explicit: str | None = None) -> CriuBinary:
    """Which CRIU to run: ``explicit``, else $CKPTFLOW_CRIU, else `criu` on PATH, else a bundle
    (BUNDLE_CANDIDATES). The one lookup of the runner, the node fingerprint and `doctor`.

    Example:
        >>> find_criu()                                   # doctest: +SKIP
        CriuBinary(path='/srv/ckptflow/.carry/criu/bin/criu', source='bundle')
    """
    if explicit:
        return CriuBinary(explicit, "argument")
    env = settings().criu  # $CKPTFLOW_CRIU
    if env:  # the operator's choice stands, even when it is wrong: errors then name it
        return CriuBinary(env, "CKPTFLOW_CRIU")
    if shutil.which("criu"):
        return CriuBinary("criu", "PATH")
    for c in BUNDLE_CANDIDATES:
        if c.is_file() and os.access(c, os.X_OK):
            return CriuBinary(str(c.absolute()), "bundle")
    return CriuBinary("criu", "missing")


class CriuRunner:
    """Runs the `criu` binary with a timeout on every call and an empty plugin directory.

    Args:
        criu_bin: path or name of the criu binary (default: find_criu(): $CKPTFLOW_CRIU, `criu`
            on PATH, or a relocatable bundle).
        timeout_s: default timeout of every CRIU call.
        log_dir: where CRIU logs go (default: a private temporary directory).
    """

    def __init__(self, criu_bin: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 log_dir: Path | None = None, pid_free_timeout_s: float = PID_FREE_TIMEOUT_S):
        self.criu_bin = criu_bin or find_criu().path
        self.timeout_s = timeout_s
        self.pid_free_timeout_s = pid_free_timeout_s
        self._log_dir = Path(log_dir) if log_dir else None
        self._own_tmp: Path | None = None
        self._finalizer: weakref.finalize | None = None
        # How CRIU keeps peers quiet around established TCP: nftables (default), iptables, or
        # skip — safe only when every peer is inside the dumped tree (a TP worker's ranks).
        env = settings()
        self.network_lock = env.criu_network_lock  # $CKPTFLOW_CRIU_NETWORK_LOCK
        # Unlinked files still mapped go into the image ("ghost files"); CRIU refuses those over
        # 1 MiB by default, and NCCL maps a deleted 33 MiB /dev/shm segment per rank (measured
        # with NCCL_SHM_DISABLE=1 on two H200s), as does the TP worker's command ring (4 KiB).
        self.ghost_limit = env.criu_ghost_limit  # $CKPTFLOW_CRIU_GHOST_LIMIT

    def __enter__(self) -> "CriuRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tmp(self) -> Path:
        """This runner's private directory (CRIU logs, pid files, the empty plugin directory).

        Made on first use, so that a runner built only to read CRIU's version leaves nothing;
        removed by close(), or when the runner is collected or the interpreter exits; a
        directory whose process was killed is removed by the next runner that makes its own.
        """
        if self._own_tmp is None or not self._own_tmp.is_dir():
            if self._finalizer is not None:
                self._finalizer.detach()
            _remove_orphans()
            self._own_tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
            self._finalizer = weakref.finalize(self, _remove_tmp, str(self._own_tmp), os.getpid())
        return self._own_tmp

    @property
    def log_dir(self) -> Path:
        return self._log_dir or self._tmp()

    @property
    def plugin_dir(self) -> Path:
        d = self._tmp() / "no-plugins"
        d.mkdir(mode=0o700, exist_ok=True)
        return d

    # --- prerequisites -----------------------------------------------------------------
    def version(self) -> tuple[int, ...]:
        """Return CRIU's version, or raise RunnerUnavailable naming the fix."""
        path = shutil.which(self.criu_bin)
        if not path:
            raise RunnerUnavailable(f"criu binary {self.criu_bin!r} not found on PATH",
                                    fix="run ./scripts/setup.sh as root (it builds CRIU >= 4.2)")
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        v = parse_version(out.stdout)
        if not v:
            raise RunnerUnavailable(f"cannot read the version of {path}: {out.stdout!r}")
        if v < MIN_VERSION:
            raise RunnerUnavailable(
                f"criu {'.'.join(map(str, v))} at {path} is too old (need >= 4.2: older CRIU cannot "
                "dump AF_INET sockets on kernels >= 6.16)", fix="run ./scripts/setup.sh as root")
        return v

    def check(self) -> None:
        """Run `criu check`; raise RunnerUnavailable with its output when it fails."""
        self.version()
        if os.geteuid() != 0:
            raise RunnerUnavailable("CRIU needs root (CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE)",
                                    fix="run the node worker as root")
        out = subprocess.run([self.criu_bin, "check"], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RunnerUnavailable(f"`criu check` failed: {(out.stdout + out.stderr).strip()[-500:]}",
                                    fix="run ./scripts/setup.sh as root to build a CRIU that fits this kernel")

    # --- the calls ---------------------------------------------------------------------
    def _run(self, args: list[str], log: Path, timeout_s: float | None, what: str,
             exe: str | None = None, pass_fds: tuple[int, ...] = (), prefix: list[str] | None = None) -> float:
        cmd = [*(prefix or []), exe or self.criu_bin, *args]
        t0 = time.perf_counter()
        # Output goes to a file, not a pipe: criu-ns leaves criu running as the sandbox's init,
        # and a pipe it inherited would keep this call waiting for as long as the copy lives.
        with tempfile.TemporaryFile(mode="w+") as out:
            try:
                proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=timeout_s or self.timeout_s, pass_fds=pass_fds)
            except subprocess.TimeoutExpired:
                raise CriuTimeout(f"criu {what} timed out after {timeout_s or self.timeout_s:.0f} s",
                                  cmd=cmd, log_tail=_tail(log)) from None
            except FileNotFoundError:
                raise RunnerUnavailable(f"cannot run {cmd[0]!r}", fix="run ./scripts/setup.sh as root") from None
            out.seek(0)
            output = out.read()
        if proc.returncode != 0:
            tail = _tail(log) or output.strip()[-2000:]
            cause = first_error(_read(log))
            said = f"{cause}\n{tail}"
            raise CriuError(f"criu {what} failed" + (f": {cause}" if cause else ""), cmd=cmd, log_tail=tail,
                            returncode=proc.returncode, fix=fix_for(said),
                            node_condition=any(n in said for n in NODE_CONDITIONS))
        return time.perf_counter() - t0

    def _common(self, images_dir: Path, log: Path, tcp_established: bool) -> list[str]:
        args = ["-D", str(images_dir), "-o", str(log), "-v4", "-L", str(self.plugin_dir)]
        if tcp_established:
            args += ["--tcp-established", "--network-lock", self.network_lock]
        return args + _recorded(images_dir).get("flags", [])

    def dump(self, workload: Workload, images_dir: Path, *, leave_running: bool,
             proc: DeclaredProcess | None = None, timeout_s: float | None = None,
             refused: bool = False) -> DumpResult:
        """Dump the workload's process tree into ``images_dir``.

        The process is found from the declaration (or ``proc`` from an earlier resolve) and
        checked again right before the dump.

        Raises:
            WorkloadNotFound, UndeclaredProcess: the process is gone or not the declared one.
            CriuError, CriuTimeout: CRIU failed; the process keeps running if leave_running.
        """
        proc = recheck(workload, proc) if proc else resolve(workload)
        pids = tree(proc.pid)
        if not refused:  # the caller ran refuse_uncarriable before its own lock (NodeRunner's GPU path)
            refuse_uncarriable(workload, pids)
        images_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        isolated = is_isolated(proc.pid)
        _record(images_dir, workload.criu, written_files(pids), pids, isolated)
        if workload.criu.link_remap:  # a link-remap file left by a failed restore blocks CRIU's own
            devshm.remove_stale_link_remaps()
        # A connection still in a listening socket's accept queue (the client's handshake done,
        # the worker not yet at accept()) cannot go into an image, and CRIU refuses the whole
        # dump unless told to skip it. Skipped, that client sees its connection reset, as when a
        # worker restarts, and connects again.
        extra = ["--ghost-limit", self.ghost_limit, "--skip-in-flight"]
        if leave_running:
            extra.append("--leave-running")
        if isolated:  # its namespaces go into the image; the node's mounts it sees stay outside
            extra += ["--external", "mnt[]"]
        if workload.criu.devshm and devshm.needed(pids):  # runs while the tree is frozen, before CRIU drops its link-remaps
            script = devshm.action_script(self._tmp() / f"post-dump-{time.time_ns()}.sh", images_dir, proc.pid)
            extra += ["--action-script", str(script)]
        # Kept beside the image: a restore on this node frees these ports of the dead worker's
        # orphaned connections first, instead of discovering them one failed attempt at a time.
        (images_dir / LISTEN_PORTS_FILE).write_text(json.dumps({"listen_ports": sorted(listen_ports(proc.pid))}))
        ours = {p.name for p in images_dir.iterdir()}
        attempt = 0
        while True:
            log = self.log_dir / f"dump-{workload.name}-{proc.pid}-{time.time_ns()}.log"
            args = ["dump", "-t", str(proc.pid), *self._common(images_dir, log, workload.tcp_established), *extra]
            try:
                took = self._run(args, log, timeout_s, "dump")
                stats = dump_stats(images_dir)
                frozen = stats["frozen_time"] / 1e6 if stats and "frozen_time" in stats else None
                return DumpResult(pid=proc.pid, seconds=took, log=log, frozen_s=frozen)
            except CriuTimeout:
                raise
            except CriuError:
                # A client's request being answered right then: the tree runs on (CRIU let it
                # go), and that connection closes in milliseconds. One held open stays refused.
                attempt += 1
                if attempt > CONNECTED_RETRIES or workload.tcp_established or CONNECTED not in _read(log):
                    raise
                for f in images_dir.iterdir():  # the failed attempt's image files, not ours
                    if f.name not in ours:
                        shutil.rmtree(f) if f.is_dir() else f.unlink()
                time.sleep(CONNECTED_RETRY_S)

    def wait_pid_free(self, pid: int, timeout_s: float | None = None) -> None:
        """Wait until ``pid`` is gone (reaping it if it is our child).

        Raises:
            PidBusy: the PID is still in use after ``timeout_s``.
        """
        timeout_s = self.pid_free_timeout_s if timeout_s is None else timeout_s

        def free() -> bool:
            _reap(pid)
            return not pid_taken(pid)

        try:
            poll(free, timeout_s, 0.02, what=f"PID {pid} to be free")
        except PollTimeout:
            raise PidBusy(f"PID {pid} needed by the image is still in use after {timeout_s:.0f} s",
                          fix="stop the process holding it, or restore beside it (sandbox)") from None

    def restore(self, images_dir: Path, *, old_pid: int, tcp_established: bool = False,
                leave_stopped: bool = False, timeout_s: float | None = None) -> int:
        """Restore detached (the process outlives this call); return the restored PID.

        ``leave_stopped`` leaves the tree in SIGSTOP: nothing of it runs until the caller sends
        SIGCONT (after the image's checksums, verified in parallel, came out right).
        """
        freed: set[int] = set()
        ss = self._ss()
        try:
            recorded = set(json.loads((images_dir / LISTEN_PORTS_FILE).read_text())["listen_ports"])
        except (OSError, ValueError, KeyError):
            recorded = set()
        if recorded:
            close_orphans(recorded, ss)
        fork_wait_s = 0.0
        isolated = image_isolated(images_dir)
        while True:
            # An isolated worker comes back in new namespaces: the node's PIDs are not its own.
            for p in [] if isolated else [old_pid, *(p for p in _recorded(images_dir).get("pids", []) if p != old_pid)]:
                # Every PID of the tree, not only the root's: a killed engine's children are reaped
                # by init a second or two later, and until then they keep the root's PID in use as
                # their session id (clone3 -> "Can't fork for <root>: File exists", with vLLM).
                self.wait_pid_free(p)
            # The dumped tree is gone (its PIDs are free): its /dev/shm files are ours to reset.
            put = devshm.put_back(images_dir)
            log = self.log_dir / f"restore-{old_pid}-{time.time_ns()}.log"
            pidfile = self.log_dir / f"restore-{old_pid}-{time.time_ns()}.pid"
            args = ["restore", "-d", "--pidfile", str(pidfile),
                    *self._common(images_dir, log, tcp_established)]
            if leave_stopped:
                args.append("--leave-stopped")
            try:
                with _inherited_outputs(images_dir) as (inherit, fds), \
                        (_rbind_root(self._tmp()) if isolated else contextlib.nullcontext(([], []))) as (prefix, root):
                    self._run(args + root + inherit, log, timeout_s, "restore", pass_fds=fds, prefix=prefix or None)
                return int(pidfile.read_text().strip())
            except CriuError:
                devshm.remove_link_remaps(put)  # CRIU unlinks them only after a restore that worked
                # A listening port of the image still has TIME_WAIT connections of the dead
                # worker (NCCL's bootstrap listeners, measured on two H200s): free them, retry.
                ports = busy_listen_ports(log) - freed
                if ports:
                    release_time_wait(ports, ss=ss)
                    freed |= ports
                    continue
                # The tasks our own failed attempt created are killed, but their PIDs can stay
                # allocated a moment after /proc lets go of them (seen on the H200s).
                if freed and fork_wait_s < 10 and "Can't fork for" in _read(log):
                    time.sleep(0.25)
                    fork_wait_s += 0.25
                    continue
                raise

    def _ss(self) -> str | None:
        """iproute2's ss: on PATH, or beside the criu binary (the relocatable bundle)."""
        beside = Path(shutil.which(self.criu_bin) or self.criu_bin).parent / "ss"
        return shutil.which("ss") or (str(beside) if beside.exists() else None)

    def restore_beside(self, images_dir: Path, *, netns: str | None = None, tcp_established: bool = False,
                       timeout_s: float | None = None) -> SandboxCopy:
        """Restore a copy in a fresh PID namespace (criu-ns), beside the running original.

        ``netns`` names a network namespace (``ip netns add``) so the copy's ports do not clash.
        ``tcp_established``: the image was dumped with its established connections (the
        workload's flag), which CRIU restores only when told so again.
        """
        log = self.log_dir / f"sandbox-{time.time_ns()}.log"
        pidfile = self.log_dir / f"sandbox-{time.time_ns()}.pid"
        args = ["restore", "-d", "--pidfile", str(pidfile), *self._common(images_dir, log, False)]
        if tcp_established:
            # Without it CRIU refuses the image ("Connected TCP socket in image"): every verify or
            # standby of a TP vLLM (gloo's mesh) or a GPU vLLM (torch's TCPStore) failed so. In
            # the copy's own network namespace nothing else talks, so nothing needs locking there;
            # without one, the host's lock would hold the original's traffic.
            args += ["--tcp-established", "--network-lock", "skip" if netns else self.network_lock]
        if netns:
            args += ["--join-ns", f"net:/var/run/netns/{netns}"]
        if image_isolated(images_dir):
            return self._isolated_copy(images_dir, args, log, pidfile, netns, timeout_s)
        criu_ns = shutil.which("criu-ns")
        if not criu_ns:
            raise RunnerUnavailable("criu-ns not found", fix="run ./scripts/setup.sh as root")
        prefix = None
        if devshm.saved(images_dir):
            # The original still maps its /dev/shm files: the copy gets a /dev/shm of its own
            # (a private mount namespace with a fresh tmpfs), filled from the image.
            script, shm_args = _private_shm(images_dir)
            prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                      script + ' && shift 3 && exec "$@"', *shm_args, "--"]
        # Its outputs go nowhere: the original's log is not the copy's to write (nor to size-check).
        with _inherited_outputs(images_dir, sink=os.devnull) as (inherit, fds):
            self._run(args + inherit, log, timeout_s, "restore (sandbox)", exe=criu_ns, pass_fds=fds, prefix=prefix)
        try:
            poll(pidfile.exists, 10, 0.05, what=f"{pidfile}")
            pid = int(pidfile.read_text().strip())
            ppid = psutil.Process(pid).ppid()  # the namespace's init: criu, left running by criu-ns
        except (PollTimeout, psutil.NoSuchProcess) as e:
            raise CriuError(f"criu-ns restored no process ({e})", cmd=[criu_ns, *args], log_tail=_tail(log)) from None
        return SandboxCopy(pid=pid, init_pid=ppid, netns=netns)

    def _isolated_copy(self, images_dir: Path, args: list[str], log: Path, pidfile: Path, netns: str | None,
                       timeout_s: float | None) -> SandboxCopy:
        # The image brings its own PID and mount namespaces: plain criu makes new ones, and the
        # copy's root task is their init (no criu-ns, no criu left running as init). Its /dev/shm
        # is an external mount of the node's, found again under --root; the original still maps
        # its files there, so the copy's /dev/shm is a fresh tmpfs in criu's private namespace,
        # filled from the image before the rbind takes it along (a vLLM standby on a GPU).
        with _inherited_outputs(images_dir, sink=os.devnull) as (inherit, fds), \
                _rbind_root(self._tmp(), private_shm=images_dir if devshm.saved(images_dir) else None) as (prefix, root):
            self._run(args + root + inherit, log, timeout_s, "restore (sandbox)", pass_fds=fds, prefix=prefix)
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError) as e:
            raise CriuError(f"criu restored no process ({e})", cmd=args, log_tail=_tail(log)) from None
        return SandboxCopy(pid=pid, init_pid=pid, netns=netns)

    def close(self) -> None:
        """Remove this runner's private directory; the runner stays usable (it makes a new one)."""
        if self._finalizer is not None:
            self._finalizer()
        self._own_tmp = self._finalizer = None


CRIU_FLAGS_FILE = "ckptflow-criu.json"


def _recorded(images_dir: Path) -> dict:
    try:
        return json.loads((images_dir / CRIU_FLAGS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _record(images_dir: Path, opts: CriuOptions, outputs: list[str], pids: list[int], isolated: bool = False) -> None:
    flags = [f for f, on in (("--link-remap", opts.link_remap), ("--ext-unix-sk", opts.ext_unix_sk),
                             ("--file-locks", opts.file_locks)) if on]
    rec = {"flags": flags, "outputs": outputs, "pids": pids, "isolated": isolated}
    if isolated:  # what each process is inside its namespace: a copy's host PIDs are found by it
        rec["ns_pids"] = {str(p): ns[-1] for p in pids if (ns := nspid(p))}
    (images_dir / CRIU_FLAGS_FILE).write_text(json.dumps(rec))


def copy_pids(images_dir: Path, copy_root: int, original_pids: list[int]) -> list[int]:
    """The host PIDs, in a copy of an isolated image rooted at host PID ``copy_root``, of the
    original's processes ``original_pids`` (host PIDs at the dump): each is matched by the PID it
    has inside its namespace, which the copy keeps.

    Raises:
        CriuError: the image recorded no namespace PIDs, or the copy lacks one of the processes.
    """
    recorded = _recorded(images_dir).get("ns_pids")
    if not recorded:
        raise CriuError("the image recorded no namespace PIDs (taken by an older ckptflow, or not isolated)")
    in_copy = {ns[-1]: p for p in tree(copy_root) if (ns := nspid(p))}
    missing = [p for p in original_pids if in_copy.get(recorded.get(str(p), -1)) is None]
    if missing:
        raise CriuError(f"the copy has no process for PID(s) {', '.join(map(str, missing))} of the original")
    return [in_copy[recorded[str(p)]] for p in original_pids]


def image_isolated(images_dir: Path) -> bool:
    """True when the image holds a worker born in its own PID and mount namespaces (runners/isolate.py)."""
    return bool(_recorded(images_dir).get("isolated"))


def _private_shm(images_dir: Path) -> tuple[str, list[str]]:
    """A shell fragment (and its ``$0 $1 $2``) that mounts a fresh tmpfs on /dev/shm and writes
    the image's /dev/shm files into it; run only inside a private mount namespace."""
    return ('mount -t tmpfs -o mode=1777,nosuid,nodev ckptflow-sandbox-shm /dev/shm && '
            '"$0" -I -c "import sys; sys.path.insert(0, sys.argv[2]); from ckptflow.runners import devshm; '
            'devshm.put_back(__import__(\'pathlib\').Path(sys.argv[1]))" "$1" "$2"',
            [sys.executable, str(images_dir), str(Path(devshm.__file__).resolve().parents[2])])


@contextlib.contextmanager
def _rbind_root(parent: Path, private_shm: Path | None = None):
    """``(prefix, args)`` restoring an isolated image: CRIU rebuilds the dumped mount namespace
    under ``--root``, an rbind of / made in a private mount namespace of criu's own, so the
    node's mount table never changes (and nothing is left mounted when criu exits).
    ``private_shm``: an image whose /dev/shm files the restored tree gets in a tmpfs of its own."""
    root = Path(tempfile.mkdtemp(prefix="root-", dir=parent))
    script, args = 'mount --rbind / "$0" && exec "$@"', [str(root)]
    if private_shm is not None:
        shm, shm_args = _private_shm(private_shm)
        script = shm + ' && mount --rbind / "$3" && shift 3 && exec "$@"'
        args = [*shm_args, str(root)]
    try:
        yield (["unshare", "--mount", "--propagation", "private", "sh", "-c", script, *args],
               ["--ext-mount-map", "auto", "--root", str(root)])
    finally:
        with contextlib.suppress(OSError):
            root.rmdir()


def refuse_uncarriable(workload: Workload, pids: list[int]) -> None:
    """Refuse, before anything is frozen or locked, a tree holding state CRIU cannot carry.

    Raises:
        UnsupportedWorkload: a process holds io_uring (CRIU would fail half-way with a cryptic
            mapfile error) or has AMX enabled while the workload does not declare it unused
            (``criu.amx_unused``; the restore of an AMX user would die of SIGILL later), with the fix.
    """
    name = workload.name
    holder = io_uring_holder(pids)
    if holder:
        raise UnsupportedWorkload(
            f"workload {name}: PID {holder[0]} ({holder[1]}) holds an io_uring instance, which "
            "CRIU cannot dump", fix="run `sysctl -w kernel.io_uring_disabled=2` on the node and restart the "
            "worker (uvloop/libuv then falls back to epoll; docs/engines/vllm.md); for torch.distributed's "
            "TCPStore start it with USE_LIBUV=0")
    amx = None if workload.criu.amx_unused else xcomp.amx_holder(pids)
    if amx is not None:
        raise UnsupportedWorkload(
            f"workload {name}: PID {amx} ({_comm(amx)}) has AMX enabled (it asked the kernel for AMX tile state, as "
            "oneDNN does for bf16 work on this CPU); CRIU saves neither that permission nor the tile registers, so "
            "its restore would die of SIGILL; not checkpointing",
            fix=f"keep the worker off AMX and say so: restart it with {'='.join(xcomp.ONEDNN_ISA_CAP)} in its "
            "environment (vLLM on the CPU: also --dtype float32, its bf16 attention runs AMX kernels of its own), "
            "then declare criu: {amx_unused: true} for it (docs/engines/vllm.md \"AMX CPUs\")")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def io_uring_holder(pids: list[int]) -> tuple[int, str] | None:
    """(PID, name) of the first process of ``pids`` with an io_uring fd or mapping, or None."""
    for pid in pids:
        links = devshm.open_paths(pid)
        if any("io_uring" in link for link in links):
            return pid, _comm(pid)
    return None


def written_files(pids: list[int]) -> list[str]:
    """Regular files the processes hold open write-only (their logs), by path."""
    out: set[str] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                flags = int(Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
                regular = stat.S_ISREG(os.stat(f"/proc/{pid}/fd/{fd}").st_mode)
            except (OSError, IndexError, ValueError):
                continue
            if regular and flags & os.O_ACCMODE == os.O_WRONLY and path.startswith("/") \
                    and not path.endswith(" (deleted)"):
                out.add(path)
    return sorted(out)


@contextlib.contextmanager
def _inherited_outputs(images_dir: Path, sink: str | None = None):
    """``--inherit-fd`` arguments (and the fds to pass) handing the restored tree its output
    files opened for appending (or ``sink``), so a log that grew since the dump cannot fail it."""
    args: list[str] = []
    fds: list[int] = []
    try:
        for path in _recorded(images_dir).get("outputs", []):
            try:
                if sink is None:
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(sink or path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            except OSError as e:
                log.warning("cannot reopen %s for the restored worker (%s); CRIU will try itself", path, e)
                continue
            fds.append(fd)
            args += ["--inherit-fd", f"fd[{fd}]:{path.lstrip('/')}"]
        yield args, tuple(fds)
    finally:
        for fd in fds:
            os.close(fd)


TMP_PREFIX = "ckptflow-criu-"  # + the owner's PID, so a killed owner's directory can be told apart


def _remove_tmp(path: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked child must not remove its parent's directory
        shutil.rmtree(path, ignore_errors=True)


def _remove_orphans() -> None:
    """Remove the private directories of runners whose process is gone (killed mid-call)."""
    for d in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*-*"):
        pid = d.name[len(TMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


# Restore failures of the node, not of the image: the working directory or root the worker ran
# in is gone, or the PID the image needs is taken. Every checkpoint of the worker would meet them.
NODE_CONDITIONS = ("Can't open cwd", "Can't restore cwd", "Can't open root", "Can't fork for")


def fix_for(log_tail: str) -> str | None:
    """Map the CRIU failures we have met to what the operator should do."""
    hints = [
        ("No space left", "free space on the checkpoint volume or lower retention"),
        # The worker's working directory (or root) is gone since the dump: a temporary directory
        # it was started from, removed (the new-user trial, issue #36).
        ("Can't open cwd", "the directory the worker ran in is gone since the checkpoint; recreate it (same path) "
                           "or start workers from a directory that stays, then checkpoint again"),
        ("Can't restore cwd", "the directory the worker ran in is gone since the checkpoint; recreate it (same "
                              "path) or start workers from a directory that stays, then checkpoint again"),
        ("Can't open root", "the root directory the worker ran in is gone since the checkpoint; recreate it"),
        ("Can't fork for", "the PID the image needs is taken; stop that process or restore in a sandbox"),
        ("File exists", "the PID the image needs is taken; stop that process or restore in a sandbox"),
        ("Can't get 1:16 opt", "CRIU older than 4.2 on a >= 6.16 kernel; run ./scripts/setup.sh"),
        ("Operation not permitted", "run as root"),
        ("has bad size", "a file the process had open changed size since the dump"),
        ("Connected TCP socket", "the process has established TCP connections; set tcp_established: true"),
        ("External socket", "the process talks over a socket to something outside its tree"),
        ("/dev/nvidia", "the process holds GPU state: checkpoint it through the CUDA runner first"),
        # Seen on the H200 with torch 2.11: torch.distributed's TCPStore runs on libuv, which
        # maps an io_uring ring; CRIU cannot dump io_uring.
        ("io_uring", "the process uses io_uring, which CRIU cannot dump; for torch.distributed's "
                     "TCPStore (libuv) start the worker with USE_LIBUV=0"),
    ]
    for needle, fix in hints:
        if needle in log_tail:
            gone = _GONE_CWD.search(log_tail) if "cwd" in needle else None
            return fix.replace("the directory the worker ran in", f"the directory the worker ran in (/{gone[1]})",
                               1) if gone else fix
    return None


# CRIU names the missing directory on the line before "Can't open cwd" (relative to /).
_GONE_CWD = re.compile(r"Can't open file (\S+) on restore: No such file or directory")


_RESTORE_SOCK = re.compile(r"^\(\S+\)\s+(\d+): inet: \s*Restore: .* port (\d+) state TCP_LISTEN")
_BIND_BUSY = re.compile(r"^\(\S+\)\s+(\d+): Error .*Can't bind inet socket.*Address already in use")
TIME_WAIT_S = 65  # Linux keeps TIME_WAIT for 60 s (TCP_TIMEWAIT_LEN)
LISTEN_PORTS_FILE = "ckptflow-listen-ports.json"


def first_error(log_text: str) -> str | None:
    """CRIU's first error line, without its timestamp and source location: the cause (the
    log's tail holds only the unwinding that followed).

    Example:
        >>> first_error("(00.01) Error (criu/sk-inet.c:161): inet: In-flight connection (l) for 9dd3\\n"
        ...             "(00.02) Error (criu/cr-dump.c:1975): Dumping FAILED.")
        'inet: In-flight connection (l) for 9dd3'
    """
    for line in log_text.splitlines():
        m = re.search(r"Error \([^)]*\):\s*(.*)", line)
        if m and "RLIMIT_NOFILE" not in line:
            return m.group(1).strip()
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def busy_listen_ports(log: Path) -> set[int]:
    """Listening ports a failed restore could not bind because they were in use."""
    last: dict[str, int] = {}
    busy = set()
    for line in _read(log).splitlines():
        m = _RESTORE_SOCK.match(line)
        if m:
            last[m.group(1)] = int(m.group(2))
            continue
        m = _BIND_BUSY.match(line)
        if m and m.group(1) in last:
            busy.add(last[m.group(1)])
    return busy


def _port_states(ports: set[int]) -> dict[int, set[str]]:
    """TCP states (hex, /proc/net/tcp) of this host's sockets bound to ``ports``."""
    out: dict[int, set[str]] = {p: set() for p in ports}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            port = int(f[1].rsplit(":", 1)[1], 16)
            if port in out:
                out[port].add(f[3])
    return out


def listen_ports(root_pid: int) -> set[int]:
    """TCP ports the process tree of ``root_pid`` listens on (its own network namespace).

    Read from /proc/PID/net, not psutil: psutil's per-process connections look up the socket
    tables of the caller's network namespace, where a copy in its own namespace has none."""
    inodes = set()
    for p in tree(root_pid):
        for fd in Path(f"/proc/{p}/fd").glob("*"):
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{root_pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


_ORPHAN_STATES = ("time-wait", "fin-wait-1", "fin-wait-2", "last-ack", "closing")


def close_orphans(ports: set[int], ss: str | None) -> None:
    """Close connections on ``ports`` that no process owns any more (a dead worker's), if ss can."""
    if not ss or not ports:
        return
    flt = " or ".join(f"sport = :{p}" for p in sorted(ports))
    for state in _ORPHAN_STATES:
        subprocess.run([ss, "-K", "-tan", "state", state, f"( {flt} )"], capture_output=True, timeout=10)


def release_time_wait(ports: set[int], ss: str | None, timeout_s: float = TIME_WAIT_S) -> None:
    """Close the TIME_WAIT connections left on ``ports`` by a dead process (``ss -K``), or wait
    for the kernel to expire them. A port held by a live socket is an error: not ours to free.

    Raises:
        CriuError: a port is in use by a live socket, or still busy after ``timeout_s``.
    """
    owned = {"01", "08", "0A"}  # ESTABLISHED, CLOSE_WAIT, LISTEN: a live process holds them
    live = {p: st & owned for p, st in _port_states(ports).items() if st & owned}
    if live:
        raise CriuError(f"listening port(s) {sorted(live)} of the image are held by live sockets on this node",
                        cmd=[], fix="stop the process holding them, or restore on another node")
    close_orphans(ports, ss)
    try:
        poll(lambda: not any(_port_states(ports).values()), timeout_s, 0.2,
             what=f"port(s) {sorted(ports)} to leave TIME_WAIT")
    except PollTimeout:
        raise CriuError(f"listening port(s) {sorted(ports)} still busy after {timeout_s:.0f} s", cmd=[],
                        fix="retry the restore in a minute") from None
