"""Soak: kill/recover cycles at random moments on the CPU demo worker, and count what is lost
or left behind.

Usage (as root, after ./scripts/setup.sh):
    .venv/bin/python bench/soak.py [--cycles 200] [--seed 0] [--flow-every 3]
    .venv/bin/python bench/soak.py --cycles 10 --no-record --json /tmp/soak.json   # the CI check

One worker (``ckptflow.demo.worker``) serves three long sessions; an S3 fleet (SeaweedFS on
127.0.0.1, its own ports) with a local Slack capture. Every cycle sends some traffic, then
kills at one moment, drawn from a seeded shuffle so that each moment comes up equally often:

- ``between_heartbeats``: a checkpoint completes, more traffic (legitimately lost), then the
  worker is SIGKILLed at a random instant, sometimes with a request in flight;
- ``mid_dump``: a runner process is killed (with its CRIU) while ``criu dump`` runs, and the
  worker with it (a node crash) — the previous checkpoint is the last one;
- ``mid_upload``: the checkpoint is on the node; the runner pushing it to S3 is killed mid-push
  and the worker with it; after recovery the next push must complete it;
- ``mid_restore``: the worker is gone, a runner restoring it is killed while ``criu restore``
  runs; half the time the partly restored worker dies too (node crash), half the time it is
  left as CRIU left it (runner crash) for the next recover to clear.

Every ``--flow-every``-th cycle runs its checkpoint through the ``heartbeat`` flow, runs a
heartbeat on the dead worker (which opens a ``worker_gone`` alert), and recovers through the
``recover`` flow; every third of those also runs the ``verify`` flow (a sandbox restore in a
network namespace, so the netns count means something). The other cycles drive NodeRunner
directly (cheaper: no flow run per step).

After each recovery: the restored checkpoint must be the newest valid one at the time of the
kill, the session digests must equal what that checkpoint recorded, and the next tokens of the
probe session must equal what the original produced right after that checkpoint. Counted:
sessions lost beyond the last checkpoint, leaked CRIU temp dirs (/tmp/ckptflow-criu-<pid>-* of
this process and its runners), leaked network namespaces, stopped processes of the soak left
behind, stuck runs (flow runs not in a final state, cycles over the watchdog), alerts opened and
the opened ones resolved. Appends the run to bench/results/soak.json (every run kept, with date
and command) and a table to bench/RESULTS.md (unless --no-record; --json also writes this run
alone to a file). Exit 1 if any must-be-zero count is not zero.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "helpers"))
from _common import append_results, machine, md_table, record_run  # noqa: E402
from seaweed import SeaweedS3  # noqa: E402
from slackcap import SlackCapture  # noqa: E402

MOMENTS = ("between_heartbeats", "mid_dump", "mid_upload", "mid_restore")
CYCLE_TIMEOUT_S = 180     # a cycle that takes longer is stuck (one takes 1-5 s here)
CHILD_TIMEOUT_S = 120     # a runner child that neither finishes nor gets killed by then is stuck
SESSIONS = ("agent", "chat", "tools")
PROBE_SESSION = "agent"   # its next tokens are compared after every recovery
NEXT_PROMPT, NEXT_TOKENS = "continue.", 6
SESSION_EPOCH = 40        # new session ids every N cycles: a session's context stays far below max_len
WORDS = ("plan", "tool", "call", "read", "file", "diff", "test", "fix", "ok", "next", "why", "list")


# --- the soak's own process plumbing ---------------------------------------------------------
def become_subreaper() -> None:
    """Orphans of this process tree (a restored worker, the CRIU of a killed runner) become our
    children, so we reap them at once instead of waiting 1-2 s for PID 1 (notes/criu.md)."""
    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # [state, ppid, ...]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def reap_zombies(keep: set[int]) -> int:
    """Reap our zombie children (except ``keep``: those a Popen object will wait for)."""
    me, n = str(os.getpid()), 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in keep:
            continue
        st = _stat(int(d.name))
        if st and st[0] == "Z" and st[1] == me:
            try:
                os.waitpid(int(d.name), os.WNOHANG)
                n += 1
            except ChildProcessError:
                pass
    return n


def kill_and_reap(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for p in pids:
        while time.monotonic() < deadline:
            st = _stat(p)
            if st is None:
                break
            if st[0] == "Z":
                try:
                    os.waitpid(p, 0)
                except ChildProcessError:
                    pass  # not ours: its parent reaps it
                break
            time.sleep(0.005)


def ours(marker: str) -> list[int]:
    """Live processes of this soak: their command line names the soak's directory."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid() and marker in _cmdline(int(d.name)):
            st = _stat(int(d.name))
            if st and st[0] != "Z":
                out.append(int(d.name))
    return out


def stopped(marker: str) -> list[int]:
    return [p for p in ours(marker) if (_stat(p) or ["?"])[0] in ("T", "t")]


def criu_tmp_dirs(owners: set[int]) -> list[Path]:
    from ckptflow.runners.criu import TMP_PREFIX

    out = []
    for d in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*-*"):
        pid = d.name[len(TMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) in owners:
            out.append(d)
    return out


def netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- S3 and Slack stand-ins: the test suite's own (tests/helpers) -------------------------------
def alert_counts(bodies: list[dict]) -> dict:
    opened = resolved = plain = 0
    for b in bodies:
        header = next((x["text"]["text"] for x in b.get("blocks", []) if x.get("type") == "header"), "")
        if header.startswith("Recovered: "):
            resolves = any(x.get("type") == "section" and x.get("text", {}).get("text", "").startswith("*Resolves*")
                           for x in b["blocks"])
            resolved += resolves
            plain += not resolves
        else:
            opened += 1
    return {"alerts_opened": opened, "alerts_resolved": resolved, "recovered_without_open_alert": plain}


# --- runner children, killed at a moment ------------------------------------------------------
_CHILD = r"""
import json, sys
from ckptflow.models import Workload
from ckptflow.runners.node import NodeRunner
from ckptflow.runners.criu import CriuRunner
from ckptflow.store.local import LocalStore
from ckptflow.store.s3 import S3Tier
op, root, wjson, s3 = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
w = Workload.model_validate_json(wjson)
store = LocalStore(root)
tier = S3Tier(s3["bucket"], endpoint_url=s3["endpoint"], threads=2)
if op == "push":
    m = store.get(w.name, sys.argv[5])
    print("PUSHING", flush=True)
    tier.push(store, m)
    print("PUSHED", flush=True)
    sys.exit()
with CriuRunner(timeout_s=60) as criu, NodeRunner(store, criu=criu) as node:
    if op == "checkpoint":
        print(node.checkpoint(w, leave_running=True).id, flush=True)
    else:
        print(node.restore(w, tier=tier).pid, flush=True)
"""


class Child:
    """A runner in its own process group (it and its CRIU die together, as on a node crash)."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.started = time.monotonic()

    def criu(self, verb: str) -> int | None:
        """PID of the child's `criu <verb>` while it runs."""
        from ckptflow.runners.process import tree

        for p in tree(self.proc.pid)[1:]:
            argv = _cmdline(p).split()
            if len(argv) > 1 and argv[1] == verb and "criu" in argv[0]:
                return p
        return None

    def kill(self) -> list[int]:
        """SIGKILL the child's process group; return the PIDs that were in it."""
        from ckptflow.runners.process import tree

        try:  # frozen first: a CRIU of the group cannot fork a task between the snapshot and the kill
            os.killpg(self.proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        group = tree(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        kill_and_reap([p for p in group if p != self.proc.pid])
        return group


# --- the soak ------------------------------------------------------------------------------------
class Soak:
    def __init__(self, root: Path, seed: int, flow_every: int, verbose: bool, ballast_mib: int,
                 session_epoch: int = SESSION_EPOCH):
        self.root, self.rng, self.flow_every, self.verbose = root, random.Random(seed), flow_every, verbose
        self.ballast_mib, self.session_epoch = ballast_mib, session_epoch
        self.marker = str(root)
        self.expect_next: dict[str, tuple[str, list[int]]] = {}  # checkpoint id -> (probe session, next tokens)
        self.owners = {os.getpid()}                     # PIDs whose CRIU temp dirs count as ours
        self.netns_ours: set[str] = set()
        self.est = {"dump": 0.15, "restore": 0.2, "push": 0.3}
        self.rows: list[dict] = []
        self.totals = {"lost": 0, "next_tokens_checked": 0, "digest_checked": 0, "stopped_left": 0,
                       "stuck_cycles": 0, "uploads_resumed": 0, "uploads_interrupted": 0,
                       "cleared_interrupted_restores": 0, "recovered_by_interrupted_restore": 0, "gone_missed": 0,
                       "recover_flows_refused": 0}

    # -- setup ----------------------------------------------------------------------------------
    def start(self, stack: ExitStack) -> None:
        from ckptflow.demo import launch
        from ckptflow.fleet import Storage
        from ckptflow.store import open_fleet_state
        from ckptflow.store.local import LocalStore
        from ckptflow.store.s3 import S3Tier

        # Its own directory: the soak's marker (its root path) must not name the S3 server.
        s3_root = Path(tempfile.mkdtemp(prefix="ckptflow-s3-", dir=self.root.parent))
        stack.callback(shutil.rmtree, s3_root, True)
        self.s3 = SeaweedS3(s3_root, access="ckptflow-soak", secret="ckptflow-soak-secret")
        self.s3.bucket("soak")
        stack.callback(self.s3.stop)
        self.slack = SlackCapture()
        stack.callback(self.slack.close)
        os.environ["CKPTFLOW_SOAK_SLACK"] = self.slack.url
        self.port = free_port()
        self.pid_file = self.root / "run" / "soak.pid"
        self.pid_file.parent.mkdir()
        self.worker = launch.start_worker(self.port, self.pid_file, ballast_mib=self.ballast_mib, timeout_s=120)
        stack.callback(self.stop_worker)
        self.w = launch.demo_workload("soak", self.port, self.pid_file)
        self.store = LocalStore(self.root / "store")
        self.tier = S3Tier("soak", endpoint_url=self.s3.endpoint, threads=2)
        self.s3_args = json.dumps({"bucket": "soak", "endpoint": self.s3.endpoint})
        import yaml

        storage = {"kind": "s3", "path": str(self.store.root), "bucket": "soak", "prefix": "ckptflow",
                   "endpoint_url": self.s3.endpoint}
        self.state = open_fleet_state(Storage(**storage), self.tier)   # the flows' open alerts
        self.fleet_file = self.root / "fleet.yaml"
        self.fleet_file.write_text(yaml.safe_dump({
            "fleet": "soak",
            "storage": storage,
            "nodes": [{"name": "local", "work_pool": "local"}],
            "workloads": [self.w.model_dump(mode="json", exclude_none=True)],
            "slack": {"webhook_url_env": "CKPTFLOW_SOAK_SLACK"},
            "retention": {"keep": 2}}))

    def stop_worker(self) -> None:
        kill_and_reap(ours(self.marker))
        if self.worker.poll() is None:
            self.worker.kill()
        self.worker.wait()

    # -- the worker -----------------------------------------------------------------------------
    def sid(self, name: str, cycle: int) -> str:
        return f"{name}-{cycle // self.session_epoch}"

    def plan(self, cycle: int, n: int | None = None) -> list[tuple[str, int, str]]:
        """Requests to send: drawn here, in the main thread, so a seed gives the same soak."""
        n = n if n is not None else self.rng.randint(1, 3)
        return [(" ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 4))), self.rng.randint(1, 6),
                 self.sid(self.rng.choice(SESSIONS), cycle)) for _ in range(n)]

    def send(self, plan: list[tuple[str, int, str]]) -> None:
        from ckptflow.demo import launch

        for prompt, n, sid in plan:
            launch.complete(self.port, prompt, n, sid)

    def record_next(self, ckpt: str, cycle: int) -> None:
        """What the original says right after checkpoint ``ckpt``: a restore must say the same."""
        from ckptflow.demo import launch

        sid = self.sid(PROBE_SESSION, cycle)
        self.expect_next[ckpt] = (sid, launch.complete(self.port, NEXT_PROMPT, NEXT_TOKENS, sid))

    def worker_pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None
        return pid if self.marker in _cmdline(pid) else None

    def kill_worker(self) -> None:
        """SIGKILL every process of the soak (the worker, whatever CRIU left of it) and reap."""
        kill_and_reap(ours(self.marker))
        reap_zombies({self.s3.proc.pid})

    def newest_valid(self) -> str | None:
        return next((m.id for m in self.store.valid(self.w.name)), None)

    # -- steps ----------------------------------------------------------------------------------
    def checkpoint(self, cycle: int, via_flow: bool) -> str:
        if via_flow:
            from ckptflow.flows.heartbeat import heartbeat

            rows = heartbeat(str(self.fleet_file), force=True)
            ckpt = rows[0]["checkpoint"]
            m = self.store.get(self.w.name, ckpt)
        else:
            from ckptflow.runners.node import NodeRunner
            from ckptflow.runners.criu import CriuRunner

            with CriuRunner(timeout_s=60) as criu, NodeRunner(self.store, criu=criu) as node:
                m = node.checkpoint(self.w, leave_running=True)
            ckpt = m.id
        self.est["dump"] = 0.8 * self.est["dump"] + 0.2 * m.timings["dump"]
        self.record_next(ckpt, cycle)
        return ckpt

    def kill_between(self, r: dict) -> dict:
        """More traffic after the checkpoint (lost by design), the kill at a random instant,
        sometimes with a request in flight."""
        self.send(r["after"])
        t = threading.Thread(target=self._quiet, args=(r["in_flight"],), daemon=True)
        t.start()
        time.sleep(0.2 * r["u"])
        self.kill_worker()
        t.join(timeout=30)
        return {"hit": True}

    def _quiet(self, plan) -> None:
        try:
            self.send(plan)
        except (OSError, urllib.error.URLError, ValueError):
            pass  # the worker was killed under it

    def kill_mid_dump(self, r: dict) -> dict:
        child = Child("checkpoint", str(self.store.root), self.w.model_dump_json(), self.s3_args)
        self.owners.add(child.proc.pid)
        pid = self._await(child, lambda: child.criu("dump"))
        hit = False
        if pid is not None:
            time.sleep(r["u"] * 0.8 * self.est["dump"])
            hit = (_stat(pid) or ["Z"])[0] != "Z"
        child.kill()
        self.kill_worker()
        return {"hit": hit}

    def kill_mid_upload(self, ckpt: str, r: dict) -> dict:
        child = Child("push", str(self.store.root), self.w.model_dump_json(), self.s3_args, ckpt)
        self.owners.add(child.proc.pid)
        line = child.proc.stdout.readline()  # PUSHING: imports done, the push starts now
        hit = False
        if line.strip() == "PUSHING":
            t0 = time.monotonic()
            time.sleep(r["u"] * 0.8 * self.est["push"])
            child.kill()
            hit = ckpt not in self.tier.ids(self.w.name)      # no manifest in the bucket: it was mid-push
            if not hit:
                self.est["push"] = max(0.05, 0.8 * self.est["push"] + 0.2 * (time.monotonic() - t0))
        else:
            child.kill()
        self.kill_worker()
        self.totals["uploads_interrupted"] += hit
        return {"hit": hit}

    def kill_mid_restore(self, r: dict) -> dict:
        self.kill_worker()
        child = Child("restore", str(self.store.root), self.w.model_dump_json(), self.s3_args)
        self.owners.add(child.proc.pid)
        pid = self._await(child, lambda: child.criu("restore"))
        hit = criu_alive = False
        if pid is not None:
            time.sleep(r["u"] * self.est["restore"])
            hit = child.proc.poll() is None                      # the runner had not finished restoring
            criu_alive = (_stat(pid) or ["Z"])[0] != "Z"
        child.kill()
        node_crash = r["node_crash"]
        if node_crash:
            self.kill_worker()
        return {"hit": hit, "criu_alive": criu_alive, "node_crash": node_crash}

    def _await(self, child: Child, probe):
        """Poll until ``probe`` finds the CRIU call (or the child ends)."""
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while time.monotonic() < deadline:
            pid = probe()
            if pid is not None:
                return pid
            if child.proc.poll() is not None:
                return None
            time.sleep(0.002)
        return None

    def recover(self, via_flow: bool) -> dict:
        """Bring the worker back; return what came back (checkpoint id) and how."""
        from ckptflow.errors import WorkloadRunning

        live = self.worker_pid()
        running = live is not None and (_stat(live) or ["?"])[0] not in ("T", "t", "Z")
        t0 = time.perf_counter()
        try:
            if via_flow:
                from ckptflow.flows.recover import recover

                res = recover(str(self.fleet_file), self.w.name)
                ckpt, how = res.get("checkpoint"), "cold start" if res.get("cold_start") else "restore"
            else:
                from ckptflow.runners.node import NodeRunner
                from ckptflow.runners.criu import CriuRunner

                with CriuRunner(timeout_s=60) as criu, NodeRunner(self.store, criu=criu) as node:
                    r = node.restore(self.w, tier=self.tier)
                ckpt, how = r.manifest.id, "restore"
                # The whole restore (CRIU, checksums, SIGCONT, health, state check): a kill at a
                # random instant of it lands in CRIU or after it, where a stopped copy is left.
                self.est["restore"] = 0.8 * self.est["restore"] + 0.2 * (time.perf_counter() - t0)
        except WorkloadRunning:
            if not running:
                raise
            # An interrupted restore got as far as letting the worker run: nothing to recover
            # (the recover flow refuses, and ends Failed: WorkloadRunning).
            self.totals["recovered_by_interrupted_restore"] += 1
            self.totals["recover_flows_refused"] += via_flow
            return {"checkpoint": None, "how": "already running", "recover_s": 0.0}
        if live is not None and not running:
            self.totals["cleared_interrupted_restores"] += 1
        return {"checkpoint": ckpt, "how": how, "recover_s": round(time.perf_counter() - t0, 3)}

    def gone_heartbeat(self) -> bool:
        """A scheduled heartbeat meets the dead worker: it must fail and open a worker_gone alert."""
        from ckptflow.flows.heartbeat import HeartbeatFailed, heartbeat

        try:
            heartbeat(str(self.fleet_file))
        except HeartbeatFailed as e:
            return "no live process" in str(e)
        return False

    def verify_flow(self) -> str:
        from ckptflow.flows.verify import verify

        before = netns()
        rows = verify(str(self.fleet_file))
        self.netns_ours |= netns() - before
        return rows[0]["state"] if rows else "none"

    def check(self, expected: str | None, got: dict) -> dict:
        """The session continues exactly from the last checkpoint."""
        from ckptflow.demo import launch

        problems = []
        m = self.store.get(self.w.name, expected) if expected else None
        if got["how"] == "already running":
            pass  # compared below against the newest valid checkpoint all the same
        elif got["checkpoint"] != expected:
            problems.append(f"restored {got['checkpoint']} ({got['how']}), expected {expected}")
        want = (m.probe.sessions if m else None) or {}
        now = launch.session_digests(self.port)
        self.totals["digest_checked"] += 1
        if now != want:
            problems.append(f"session digests differ from {expected}: "
                            f"{sorted(k for k in set(now) | set(want) if now.get(k) != want.get(k))[:4]}")
        if expected in self.expect_next:
            self.totals["next_tokens_checked"] += 1
            sid, want_next = self.expect_next[expected]   # the session the original was asked on
            again = launch.complete(self.port, NEXT_PROMPT, NEXT_TOKENS, sid)
            if again != want_next:
                problems.append(f"next tokens of {sid} differ after {expected}: {again} != {want_next}")
        return {"problems": problems}

    # -- one cycle ------------------------------------------------------------------------------
    def cycle(self, i: int, moment: str, via_flow: bool) -> dict:
        row: dict = {"cycle": i, "moment": moment, "via_flow": via_flow}
        r = {"before": self.plan(i), "after": self.plan(i), "in_flight": self.plan(i, 2), "u": self.rng.random(),
             "node_crash": self.rng.random() < 0.5}
        t0 = time.perf_counter()
        self.send(r["before"])
        if moment == "mid_dump":
            row.update(self.kill_mid_dump(r))
        else:
            # A heartbeat flow pushes its checkpoint itself: the push to interrupt is a runner's.
            ckpt = self.checkpoint(i, via_flow and moment != "mid_upload")
            if moment == "between_heartbeats":
                row.update(self.kill_between(r))
            elif moment == "mid_upload":
                row.update(self.kill_mid_upload(ckpt, r))
            else:
                row.update(self.kill_mid_restore(r))
        expected = self.newest_valid()   # the last checkpoint at the time of the kill
        row["expected"] = expected
        if via_flow and row.get("node_crash", True) and moment != "mid_restore":
            row["gone_alert"] = self.gone_heartbeat()
            if not row["gone_alert"]:
                self.totals["gone_missed"] += 1
        got = self.recover(via_flow)
        row.update(got)
        row.update(self.check(expected, got))
        if moment == "mid_upload" and row["hit"]:
            # The next push completes the interrupted one (the chunks already there are skipped).
            self.tier.push(self.store, self.store.get(self.w.name, expected))
            if expected in self.tier.ids(self.w.name):
                self.totals["uploads_resumed"] += 1
            else:
                row["problems"].append(f"push of {expected} did not complete after the interrupted one")
        if via_flow and (i // self.flow_every) % 3 == 0:
            row["verify"] = self.verify_flow()
        left = stopped(self.marker)
        if left:
            row["problems"].append(f"stopped processes left behind: {left}")
            self.totals["stopped_left"] += len(left)
        self.store.apply_retention(self.w.name, orphan_grace=timedelta(0))
        reap_zombies({self.s3.proc.pid})
        row["seconds"] = round(time.perf_counter() - t0, 3)
        if row["problems"]:
            self.totals["lost"] += 1
        return row

    def schedule(self, cycles: int) -> list[tuple[str, bool]]:
        moments: list[str] = []
        while len(moments) < cycles:
            block = list(MOMENTS)
            self.rng.shuffle(block)
            moments += block
        return [(m, i % self.flow_every == 0) for i, m in enumerate(moments[:cycles])]

    def run(self, cycles: int) -> None:
        from ckptflow.runners.node import NodeRunner
        from ckptflow.runners.criu import CriuRunner

        with CriuRunner(timeout_s=60) as criu, NodeRunner(self.store, criu=criu) as node:
            first = node.checkpoint(self.w, leave_running=True)  # cycle 0 has a checkpoint to go back to
        self.record_next(first.id, 0)

        def on_alarm(*_):
            raise TimeoutError(f"cycle over {CYCLE_TIMEOUT_S} s")

        signal.signal(signal.SIGALRM, on_alarm)
        for i, (moment, via_flow) in enumerate(self.schedule(cycles)):
            signal.alarm(CYCLE_TIMEOUT_S)
            try:
                row = self.cycle(i, moment, via_flow)
            except Exception as e:  # the soak goes on; the cycle counts as lost (and stuck if it hung)
                row = {"cycle": i, "moment": moment, "via_flow": via_flow,
                       "problems": [f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]}
                self.totals["lost"] += 1
                if isinstance(e, TimeoutError):
                    self.totals["stuck_cycles"] += 1
                self._reset()
            finally:
                signal.alarm(0)
            self.rows.append(row)
            if self.verbose or row["problems"]:
                print(json.dumps(row), flush=True)
            elif (i + 1) % 10 == 0:
                print(f"soak: {i + 1}/{cycles} cycles, {self.totals['lost']} lost", flush=True)

    def _reset(self) -> None:
        """After a failed cycle: a fresh start from the newest checkpoint, so the next cycle counts."""
        try:
            self.kill_worker()
            got = self.recover(False)
            self.check(self.newest_valid(), got)
        except Exception as e:
            print(f"soak: could not reset after a failed cycle: {e}", file=sys.stderr)

    # -- the counts -----------------------------------------------------------------------------
    def stuck_flow_runs(self) -> dict:
        from prefect import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
        from prefect.client.schemas.objects import StateType

        with get_client(sync_client=True) as c:
            runs: list = []
            while True:  # the API pages at 200
                page = c.read_flow_runs(limit=200, offset=len(runs))
                runs += page
                if len(page) < 200:
                    break
            busy = c.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING,
                                                  StateType.PAUSED, StateType.CANCELLING]))))
        by_state: dict[str, int] = {}
        for r in runs:
            by_state[r.state.name if r.state else "none"] = by_state.get(r.state.name if r.state else "none", 0) + 1
        # A heartbeat on the dead worker fails by design (HeartbeatFailed: no live process), as does
        # a recover (and its node-step subflow) refused because an interrupted restore already let
        # the worker run (WorkloadRunning). Any other failure is unexpected.
        failed = [(r.state.message or "") for r in runs if r.state and r.state.is_failed()]
        unexpected = sorted({m[:200] for m in failed
                             if "no live process found" not in m and "WorkloadRunning" not in m})
        return {"flow_runs": len(runs), "flow_runs_by_state": by_state, "stuck_flow_runs": len(busy),
                "unexpected_flow_failures": len(unexpected), "unexpected_flow_failure_messages": unexpected}

    def summary(self, wall_s: float) -> dict:
        from ckptflow.runners.criu import CriuRunner

        with CriuRunner() as r:  # a runner's first call removes dead runners' directories, as on a node
            r.plugin_dir
        tmp_left = criu_tmp_dirs(self.owners)
        leaked_ns = sorted(self.netns_ours & netns())
        out = {"cycles": len(self.rows), **self.totals, **alert_counts([r["body"] for r in self.slack.requests]), **self.stuck_flow_runs(),
               "leaked_temp_dirs": len(tmp_left), "leaked_netns": len(leaked_ns),
               "stopped_left_at_end": len(stopped(self.marker)),
               "open_alerts_at_end": len(self.state.alerts()),
               "leases_left": len(self.tier.leases()),
               "wall_s": round(wall_s, 1),
               "cycle_s_median": round(statistics.median(r.get("seconds", 0) for r in self.rows), 2)
               if self.rows else 0}
        by = {m: {"cycles": 0, "hit": 0, "via_flow": 0, "lost": 0} for m in MOMENTS}
        for r in self.rows:
            b = by[r["moment"]]
            b["cycles"] += 1
            b["hit"] += bool(r.get("hit"))
            b["via_flow"] += r["via_flow"]
            b["lost"] += bool(r["problems"])
        out["by_moment"] = by
        out["stuck_runs"] = out["stuck_flow_runs"] + out["stuck_cycles"]
        out["verify_runs"] = sum("verify" in r for r in self.rows)
        out["gone_heartbeats"] = sum(bool(r.get("gone_alert")) for r in self.rows)
        return out


ZEROS = ("lost", "leaked_temp_dirs", "leaked_netns", "stopped_left", "stopped_left_at_end", "stuck_runs",
         "open_alerts_at_end", "gone_missed", "unexpected_flow_failures")


def failures(s: dict) -> list[str]:
    bad = [f"{k} = {s[k]}" for k in ZEROS if s[k]]
    if s["alerts_opened"] != s["alerts_resolved"]:
        bad.append(f"alerts opened {s['alerts_opened']} != resolved {s['alerts_resolved']}")
    return bad


def table(s: dict) -> str:
    rows = [[m, b["cycles"], b["hit"], b["via_flow"], b["lost"]] for m, b in s["by_moment"].items()]
    rows.append(["all", s["cycles"], sum(b["hit"] for b in s["by_moment"].values()),
                 sum(b["via_flow"] for b in s["by_moment"].values()), s["lost"]])
    t1 = md_table(["kill moment", "cycles", "kill landed in the moment", "through Prefect flows",
                   "sessions lost beyond the last checkpoint"], rows)
    t2 = md_table(["count", "value", "required"], [
        ["sessions lost beyond the last checkpoint", s["lost"], "0"],
        ["  recoveries checked: session digests / next tokens",
         f"{s['digest_checked']} / {s['next_tokens_checked']}", ""],
        ["leaked temp dirs (/tmp/ckptflow-criu-*)", s["leaked_temp_dirs"], "0"],
        ["leaked network namespaces", f"{s['leaked_netns']} (of {s['verify_runs']} sandbox verifies)", "0"],
        ["stopped processes left behind", s["stopped_left"] + s["stopped_left_at_end"], "0"],
        ["  interrupted restores cleared by the next recover", s["cleared_interrupted_restores"], ""],
        ["  interrupted restores that had already let the worker run (recover refused: running)",
         f"{s['recovered_by_interrupted_restore']} ({s['recover_flows_refused']} through the flow)", ""],
        ["stuck runs (flow runs not final / cycles over the watchdog)",
         f"{s['stuck_flow_runs']} / {s['stuck_cycles']} (of {s['flow_runs']} flow runs)", "0"],
        ["  flow runs by final state", ", ".join(f"{k} {v}" for k, v in sorted(s["flow_runs_by_state"].items())),
         "Failed: only heartbeats on the dead worker, recovers refused (running)"],
        ["  flow runs failed otherwise", s["unexpected_flow_failures"], "0"],
        ["alerts opened / opened alerts resolved", f"{s['alerts_opened']} / {s['alerts_resolved']}", "equal"],
        ["  heartbeats on the dead worker / that missed it", f"{s['gone_heartbeats']} / {s['gone_missed']}", "- / 0"],
        ["  `recovered` sent with no alert open", s["recovered_without_open_alert"], ""],
        ["open alerts at the end", s["open_alerts_at_end"], "0"],
        ["uploads interrupted / completed by the next push",
         f"{s['uploads_interrupted']} / {s['uploads_resumed']}", "equal"],
        ["push leases left in the bucket by killed pushes", s["leases_left"], ""],
        ["wall time (median per cycle)", f"{s['wall_s']:.0f} s ({s['cycle_s_median']} s)", ""],
    ])
    return t1 + "\n\n" + t2


def record(a: argparse.Namespace, summary: dict, rows: list[dict], bad: list[str], text: str) -> None:
    """The run into bench/results/soak.json (every run kept) and bench/RESULTS.md unless
    --no-record; with --json also alone into that file (the CI check reads it)."""
    if a.json:
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        head = json.dumps({"machine": machine(), "seed": a.seed, "summary": summary, "failures": bad}, indent=1)
        lines = ",\n  ".join(json.dumps(r) for r in rows)  # one line per cycle
        out.write_text(head[:-2] + f',\n "cycles": [\n  {lines}\n ]\n}}\n')
    if not a.no_record:
        record_run("soak", {"seed": a.seed, "summary": summary, "failures": bad, "cycles": rows})
        append_results(f"Soak: {summary['cycles']} kill/recover cycles on the CPU demo worker (bench/soak.py)", text,
                       f"Seed {a.seed}; worker with {a.ballast_mib} MiB of ballast; 1 cycle in {a.flow_every} "
                       "through the heartbeat/recover flows (a "
                       "Prefect test server), the others through NodeRunner; S3 = SeaweedFS on 127.0.0.1. "
                       "\"Kill landed in the moment\": CRIU was still dumping / the runner still restoring / "
                       "the bucket had no manifest yet when the SIGKILL came. " +
                       ("All required zeros hold." if not bad else "FAILED: " + "; ".join(bad)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flow-every", type=int, default=3, help="every Nth cycle goes through Prefect flows")
    ap.add_argument("--ballast-mib", type=int, default=128,
                    help="memory the worker holds besides its sessions (wider windows to kill into)")
    ap.add_argument("--session-epoch", type=int, default=SESSION_EPOCH,
                    help="the sessions are replaced by new ones every N cycles")
    ap.add_argument("--dir", default="/var/tmp", help="where the soak's images, bucket and worker live")
    ap.add_argument("--json", help="also write this run's summary and every cycle here, alone")
    ap.add_argument("--no-record", action="store_true", help="do not touch bench/results or bench/RESULTS.md")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("soak: CRIU needs root")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if not a.verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
    become_subreaper()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped soak still stops what it started
    root = Path(tempfile.mkdtemp(prefix="ckptflow-soak-", dir=a.dir))
    t0 = time.perf_counter()
    soak = Soak(root, a.seed, a.flow_every, a.verbose, a.ballast_mib, a.session_epoch)
    try:
        with ExitStack() as stack:
            from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
            from prefect.testing.utilities import prefect_test_harness

            stack.enter_context(prefect_test_harness(server_startup_timeout=120))
            stack.enter_context(temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}))
            soak.start(stack)
            soak.run(a.cycles)
            summary = soak.summary(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary["seed"] = a.seed
    text = table(summary)
    print(text)
    bad = failures(summary)
    record(a, summary, soak.rows, bad, text)
    if bad:
        print("soak: FAILED: " + "; ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
