"""A GPU worker born in its own PID + mount namespace (as a container would start it), CUDA-
checkpointed and CRIU-dumped while it keeps serving, restored as a copy beside it into a new PID
namespace, and the CUDA restore driven from inside the copy's namespaces with the PIDs it sees
there (issue #22 item 4). Every driver call's CUresult is recorded, the asker's own cuInit
included, for each vantage point and each way of dumping/restoring tried.

Usage (GPU node, root; CRIU + criu-ns from the bundle, bench/on_device.sh):
    bench/on_device.sh python3 bench/gpu_pidns_born.py --out $OUT/gpu_pidns_born.json
    python3 bench/gpu_pidns_born.py --cpu --out /tmp/born.json     # plumbing only: CPU worker, no CUDA calls
    python3 bench/gpu_pidns_born.py --record FILE...               # here: each device run appended to
        bench/results/gpu_pidns.json as a run (every run kept, "probe": "born_in_namespace") + bench/RESULTS.md

Layouts (the original, started with `unshare --pid --fork --mount-proc`, stdio opened inside):
  child  sh is PID 1 of the namespace, the worker PID 2 (its own session). Dumped from inside
         its PID + mount namespaces (`criu-ns dump -t HOSTPID`: criu runs there, PID 2), restored
         with `criu-ns restore` (a new PID + mount namespace, criu its PID 1, the copy PID 2 again)
         joined to a new network namespace (the copy listens on the same port).
  init   the worker is PID 1 of its namespace (as runc starts a container's process). Dumped from
         the host (`criu dump -t HOSTPID --external mnt[]`: CRIU dumps the PID and mount namespaces),
         restored with `criu restore --ext-mount-map auto --root <rbind of />` (CRIU makes the new
         PID + mount namespaces itself), joined to a new network namespace.
Vantage points for a process whose host PID is H and in-namespace PID is P:
  host (H), pid (nsenter -p, P), pid+mnt (nsenter -p -m, P), mnt (nsenter -m, H),
  all (nsenter -a: every namespace of the target, P).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS_MD, machine, md_table, record_run  # noqa: E402

PORTS = {"child": 18681, "init": 18682}
ORDER = ["all", "pid+mnt", "pid", "host"]  # vantage points for the copy's CUDA restore, first success stops
T0 = time.time()

_ASK = r"""
import json, os, sys, time
pid, ops, fake = int(sys.argv[1]), [o for o in sys.argv[2].split(",") if o], sys.argv[3] == "fake"
out = {"asker_pid": os.getpid(), "sees_target": os.path.exists(f"/proc/{pid}"),
       "dev_nvidiactl": os.path.exists("/dev/nvidiactl"), "calls": []}
try:
    out["ns"] = {n: os.readlink(f"/proc/self/ns/{n}") for n in ("pid", "mnt", "net")}
except OSError as e:
    out["ns"] = str(e)
if fake:
    out["cuInit"] = "skipped (--cpu)"
    print(json.dumps(out)); sys.exit(0)
from cuda.bindings import driver as d
def name(e):
    try:
        return d.cuGetErrorName(e)[1].decode()
    except Exception:
        return str(int(e))
t = time.perf_counter()
err, = d.cuInit(0)
out["cuInit"] = name(err)
out["cuInit_s"] = round(time.perf_counter() - t, 3)
if int(err) == 0:
    e2, n = d.cuDeviceGetCount()
    out["devices"] = [name(e2), n]
for op in ops:
    t = time.perf_counter()
    if op == "state":
        e, st = d.cuCheckpointProcessGetState(pid)
        res = [name(e), None if st is None else int(st)]
    elif op == "tid":
        e, tid = d.cuCheckpointProcessGetRestoreThreadId(pid)
        res = [name(e), None if tid is None else int(tid)]
    elif op == "lock":
        a = d.CUcheckpointLockArgs(); a.timeoutMs = 10000
        res = name(d.cuCheckpointProcessLock(pid, a)[0])
    elif op == "checkpoint":
        res = name(d.cuCheckpointProcessCheckpoint(pid, None)[0])
    elif op == "restore":
        res = name(d.cuCheckpointProcessRestore(pid, None)[0])
    elif op == "unlock":
        res = name(d.cuCheckpointProcessUnlock(pid, None)[0])
    out["calls"].append([op, res, round(time.perf_counter() - t, 3)])
print(json.dumps(out))
"""


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def run(cmd: list[str], timeout: float = 120, to_file: Path | None = None, **kw) -> dict:
    """``to_file``: stdout/stderr into that file, not pipes (criu-ns restore -d leaves criu
    running with them: a pipe would never reach EOF)."""
    t = time.perf_counter()
    if to_file is not None:
        with open(to_file, "w") as f:
            try:
                rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f, timeout=timeout,
                                    close_fds=True, **kw).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        return {"rc": rc, "s": round(time.perf_counter() - t, 3),
                "out": to_file.read_text(errors="replace").strip()[-600:]}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, close_fds=True, **kw)
        return {"rc": r.returncode, "s": round(time.perf_counter() - t, 3),
                "out": (r.stdout + r.stderr).strip()[-600:]}
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "s": round(time.perf_counter() - t, 3)}


def ask(pid: int, enter: list[str], ops: str, fake: bool) -> dict:
    r = run([*enter, sys.executable, "-c", _ASK, str(pid), ops, "fake" if fake else "real"], timeout=45)
    try:
        return json.loads(r["out"].strip().splitlines()[-1])
    except (IndexError, ValueError, KeyError):
        return {"error": r.get("out", r["rc"]), "rc": r["rc"]}


def vantage(name: str, h: int, p: int) -> tuple[list[str], int]:
    t = ["nsenter", "-t", str(h)]
    return {"host": ([], h), "pid": ([*t, "-p"], p), "pid+mnt": ([*t, "-p", "-m"], p),
            "mnt": ([*t, "-m"], h), "all": ([*t, "-a"], p)}[name]


def ns_pid(h: int) -> int:
    for line in Path(f"/proc/{h}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return h


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(x) for x in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def fds(pid: int) -> list[str]:
    out = []
    try:
        for fd in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
            try:
                out.append(f"{fd}->{os.readlink(f'/proc/{pid}/fd/{fd}')}")
            except OSError:
                pass
    except OSError as e:
        out.append(str(e))
    return out


def unix_names(pid: int) -> list[str]:
    """Bound unix socket paths (abstract ones start with @) in the process's network namespace:
    where a driver channel keyed by PID would show."""
    try:
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    except OSError:
        return []
    return sorted({ln.split()[7] for ln in lines if len(ln.split()) > 7})[:40]


def http(port: int, path: str, body: dict | None = None, netns_of: int | None = None, timeout: float = 30):
    """GET/POST on 127.0.0.1:port, from the host or from inside ``netns_of``'s network namespace."""
    if netns_of is None:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    code = ("import json,sys,urllib.request as u;b=sys.argv[2];"
            "r=u.Request(sys.argv[1],data=b.encode() if b else None,headers={'Content-Type':'application/json'});"
            "print(u.urlopen(r,timeout=float(sys.argv[3])).read().decode())")
    r = run(["nsenter", "-t", str(netns_of), "-n", sys.executable, "-c", code, f"http://127.0.0.1:{port}{path}",
             json.dumps(body) if body is not None else "", str(timeout)], timeout=timeout + 10)
    if r["rc"] != 0:
        raise RuntimeError(r.get("out", r["rc"]))
    return json.loads(r["out"].splitlines()[-1])


def try_http(*a, **kw):
    try:
        return http(*a, **kw)
    except Exception as e:  # noqa: BLE001 - recorded, this is a probe
        return {"error": str(e)[-300:]}


def start_original(layout: str, port: int, tmp: Path, cpu: bool, ballast: float) -> subprocess.Popen:
    if cpu:
        worker = [sys.executable, "-m", "ckptflow.demo.worker", "--ballast-mib", "64"]
    else:
        worker = [sys.executable, "-m", "ckptflow.demo.gpu_worker", "--ballast-gib", str(ballast)]
    worker += ["--port", str(port), "--pid-file", str(tmp / f"{layout}.pid"), "--seed", "1234"]
    # stdio opened inside the new mount namespace (a host-side /dev/null is on a mount the
    # namespace's CRIU cannot look up); close_fds: no inherited descriptors of the caller.
    script = {"child": 'setsid "$@" </dev/null >/dev/null 2>&1 & wait',
              "init": 'exec setsid "$@" </dev/null >/dev/null 2>&1'}[layout]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen(["setsid", "unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script, "sh", *worker],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True, cwd=str(ROOT), env=env)


def worker_pid(proc: subprocess.Popen, timeout: float) -> int:
    end = time.time() + timeout
    while time.time() < end:
        for p in descendants(proc.pid):  # the python process itself, not unshare/sh/setsid before exec
            if cmdline(p).startswith(f"{sys.executable} -m ckptflow.demo."):
                return p
        if proc.poll() is not None:
            raise RuntimeError(f"unshare exited {proc.returncode}")
        time.sleep(0.1)
    raise RuntimeError("no worker process appeared")


def wait_health(port: int, timeout: float, netns_of: int | None = None) -> float:
    t, end = time.perf_counter(), time.time() + timeout
    while time.time() < end:
        try:
            http(port, "/health", netns_of=netns_of, timeout=3)
            return round(time.perf_counter() - t, 2)
        except Exception:  # noqa: BLE001
            time.sleep(0.3)
    raise RuntimeError(f"port {port} not healthy after {timeout} s")


def state_of(port: int, netns_of: int | None = None) -> dict:
    return {"sessions": try_http(port, "/v1/sessions/digests", netns_of=netns_of),
            "ballast": try_http(port, "/v1/ballast/digest", netns_of=netns_of)}


def gpu_apps() -> str:
    if not shutil.which("nvidia-smi"):
        return "no nvidia-smi"
    return run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"], timeout=30).get("out", "")


def kill_tree(pid: int) -> None:
    for p in [*reversed(descendants(pid)), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def probe_layout(layout: str, proc: subprocess.Popen, tmp: Path, a, out: dict, save) -> None:
    port, fake = PORTS[layout], a.cpu
    res = out["layouts"][layout] = {"port": port, "steps": []}

    def step(name, **kw):
        res["steps"].append({"step": name, **kw})
        log(f"{layout}: {name}: {json.dumps(kw)[:400]}")
        save()

    h = worker_pid(proc, 60)
    res["original_start_s"] = wait_health(port, a.start_timeout)
    p = ns_pid(h)
    res["original"] = {"host_pid": h, "ns_pid": p, "nspid": Path(f"/proc/{h}/status").read_text().split("NSpid:")[1].split("\n")[0].split(),
                       "parent_cmd": cmdline(int(Path(f"/proc/{h}/stat").read_text().rsplit(")", 1)[1].split()[1]))[:80]}
    http(port, "/v1/completions", {"prompt": "hello " * 50, "max_tokens": 8, "session_id": "s0"})
    res["original"]["state_before"] = before = state_of(port)
    res["original"]["fds"] = fds(h)
    res["original"]["unix_before"] = unix_names(h)
    res["original"]["gpu_apps"] = gpu_apps()
    for v in ("host", "pid", "pid+mnt", "mnt"):
        enter, pid = vantage(v, h, p)
        step(f"original: state from {v}", pid=pid, got=ask(pid, enter, "state", fake))

    # CUDA lock + checkpoint of the original: from inside its namespaces (as an agent in the
    # pod would), else from the host.
    ck_from = None
    for v in ("pid+mnt", "host"):
        enter, pid = vantage(v, h, p)
        got = ask(pid, enter, "lock,checkpoint,state", fake)
        step(f"original: lock,checkpoint from {v}", pid=pid, got=got)
        ok = {c[0]: c[1] for c in got.get("calls", [])}
        if fake or (ok.get("lock") == "CUDA_SUCCESS" and ok.get("checkpoint") == "CUDA_SUCCESS"):
            ck_from = v
            break
        ask(pid, enter, "unlock", fake)  # a lock that succeeded before a failed checkpoint
    if ck_from is None:
        step("original: no CUDA checkpoint from any vantage point: stop", ok=False)
        return
    res["original"]["unix_checkpointed"] = unix_names(h)
    res["original"]["fds_checkpointed"] = fds(h)
    res["original"]["gpu_apps_checkpointed"] = gpu_apps()

    img = tmp / f"img-{layout}"
    img.mkdir()
    plug = tmp / "plugins"
    plug.mkdir(exist_ok=True)
    if layout == "child":
        dump = ["criu-ns", "dump", "-t", str(h), "-D", str(img), "-L", str(plug), "--leave-running",
                "-o", "dump.log", "--network-lock", "skip"]
    else:
        dump = ["criu", "dump", "-t", str(h), "-D", str(img), "-L", str(plug), "--leave-running",
                "-o", "dump.log", "--network-lock", "skip", "--external", "mnt[]"]
    r = run(dump, timeout=120)
    r["log_errors"] = _errors(img / "dump.log")
    step("CRIU dump --leave-running", cmd=" ".join(dump), **r)
    dumped = r["rc"] == 0

    # The original back: CUDA restore + unlock from where it was checkpointed.
    enter, pid = vantage(ck_from, h, p)
    step(f"original: restore,unlock from {ck_from}", pid=pid, got=ask(pid, enter, "restore,unlock,state", fake))
    res["original"]["state_after"] = after = state_of(port)
    res["original"]["continues_equal"] = after == before
    if not dumped:
        return

    res["copy"] = copy_once(layout, "copy", img, plug, tmp, port, h, after, fake, step)
    if a.second_copy == "always" or (a.second_copy == "auto" and not fake and not res["copy"].get("restored_from")):
        # Second variant: the original gone (its PIDs and driver state free), a fresh copy.
        kill_tree(proc.pid)
        for _ in range(50):
            if not Path(f"/proc/{h}").exists():
                break
            time.sleep(0.1)
        step("original killed (SIGKILL), gone", gone=not Path(f"/proc/{h}").exists())
        res["copy_original_killed"] = copy_once(layout, "copy2 (original killed)", img, plug, tmp, port, h, after,
                                                fake, step)


def copy_once(layout, tag, img, plug, tmp, port, h, after, fake, step) -> dict:
    ns = f"ckptflow-born-{layout}"
    run(["ip", "netns", "del", ns], timeout=10)
    run(["ip", "netns", "add", ns], timeout=10)
    run(["ip", "-n", ns, "link", "set", "lo", "up"], timeout=10)
    pidfile = tmp / f"{tag.split()[0]}-{layout}.pid"
    log_name = f"restore-{tag.split()[0]}.log"
    if layout == "child":
        rst = ["criu-ns", "restore", "-d", "-D", str(img), "-L", str(plug), "-o", log_name,
               "--network-lock", "skip", "--join-ns", f"net:/var/run/netns/{ns}", "--pidfile", str(pidfile)]
    else:
        # CRIU rebuilds the dumped mount namespace under --root: an rbind of / made in a private
        # mount namespace of criu's own, so nothing changes in the host's mount table.
        rootbind = tmp / f"rootbind-{tag.split()[0]}"
        rootbind.mkdir()
        rst = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               'mount --rbind / "$0" && exec "$@"', str(rootbind),
               "criu", "restore", "-d", "-D", str(img), "-L", str(plug), "-o", log_name,
               "--network-lock", "skip", "--join-ns", f"net:/var/run/netns/{ns}", "--pidfile", str(pidfile),
               "--ext-mount-map", "auto", "--root", str(rootbind)]
    r = run(rst, timeout=120, to_file=tmp / f"{log_name}.out")
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.1)
    r["log_errors"] = _errors(img / log_name)
    step(f"{tag}: CRIU restore", cmd=" ".join(rst), **{k: v for k, v in r.items() if k != "out"},
         out=r.get("out", "")[-300:])
    copy: dict = {}
    try:
        c = int(pidfile.read_text().strip())
        q = ns_pid(c)
    except (OSError, ValueError) as e:
        step(f"{tag}: no process", error=str(e))
        _cleanup(ns)
        return copy
    copy.update(host_pid=c, ns_pid=q, nspid=Path(f"/proc/{c}/status").read_text().split("NSpid:")[1].split("\n")[0].split(),
                ns={n: os.readlink(f"/proc/{c}/ns/{n}") for n in ("pid", "mnt", "net")},
                original_ns=({n: os.readlink(f"/proc/{h}/ns/{n}") for n in ("pid", "mnt", "net")}
                             if Path(f"/proc/{h}").exists() else "gone"),
                fds=fds(c), unix=unix_names(c))
    try:
        for v in ("host", "pid", "pid+mnt", "mnt", "all"):
            enter, pid = vantage(v, c, q)
            step(f"{tag}: state,tid from {v}", pid=pid, got=ask(pid, enter, "state,tid", fake))
        restored_from = None
        for v in ORDER:
            enter, pid = vantage(v, c, q)
            got = ask(pid, enter, "restore,unlock,state", fake)
            step(f"{tag}: restore,unlock from {v}", pid=pid, got=got)
            calls = got.get("calls", [])
            if fake or (calls and calls[0][1] == "CUDA_SUCCESS"):
                restored_from = v
                break
        copy["restored_from"] = restored_from
        copy["gpu_apps"] = gpu_apps()
        copy["health"] = try_http(port, "/health", netns_of=c, timeout=10)
        if "error" not in copy["health"]:
            copy["state"] = state_of(port, netns_of=c)
            copy["state_equal_to_checkpoint"] = copy["state"] == after
            copy["completion"] = try_http(port, "/v1/completions", {"prompt": "and then", "max_tokens": 4,
                                                                     "session_id": "s0"}, netns_of=c)
        copy["original_health_meanwhile"] = try_http(port, "/health", timeout=10)
        step(f"{tag}: answers", health=copy["health"], equal=copy.get("state_equal_to_checkpoint"),
             completion=str(copy.get("completion"))[:200], original=copy["original_health_meanwhile"])
    finally:
        criu_init = int(Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[1]) if Path(f"/proc/{c}").exists() else None
        kill_tree(c)
        if layout == "child" and criu_init and "criu" in cmdline(criu_init):
            kill_tree(criu_init)
        _cleanup(ns)
    return copy


def _errors(log_path: Path) -> list[str]:
    try:
        return [ln.strip()[:240] for ln in log_path.read_text(errors="replace").splitlines()
                if "Error" in ln and "RLIMIT_NOFILE" not in ln][:6]
    except OSError:
        return []


def _cleanup(ns: str) -> None:
    time.sleep(0.3)
    run(["ip", "netns", "del", ns], timeout=10)


def probe(a) -> dict:
    out = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "cpu_plumbing_only": a.cpu,
           "versions": {"criu": run(["criu", "--version"], timeout=10).get("out", "")[:60],
                        "driver": run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                      timeout=30).get("out", "") if shutil.which("nvidia-smi") else None},
           "layouts": {}}
    dest = Path(a.out)

    def save():
        dest.write_text(json.dumps(out, indent=1) + "\n")

    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-born-", dir="/dev/shm"))
    layouts = a.layouts.split(",")
    procs = {l: start_original(l, PORTS[l], tmp, a.cpu, a.ballast_gib) for l in layouts}  # start together
    try:
        for l in layouts:
            try:
                probe_layout(l, procs[l], tmp, a, out, save)
            except Exception as e:  # noqa: BLE001 - the next layout still runs; the error is a row
                out["layouts"].setdefault(l, {})["error"] = f"{type(e).__name__}: {e}"[-600:]
                log(f"{l}: error {e}")
            finally:
                kill_tree(procs[l].pid)
            save()
    finally:
        for pr in procs.values():
            kill_tree(pr.pid)
        save()
        shutil.rmtree(tmp, ignore_errors=True)
    out["seconds"] = round(time.time() - T0, 1)
    save()
    return out


def _short(got: dict) -> str:
    if "error" in got:
        return "asker failed: " + str(got["error"])[-160:]
    calls = "; ".join(f"{c[0]} {c[1][0] + ' ' + str(c[1][1]) if isinstance(c[1], list) else c[1]}"
                      for c in got.get("calls", []))
    return f"cuInit {got.get('cuInit')}" + (f"; {calls}" if calls else "")


LAYOUT_NAMES = {"child": "child: worker PID 2 (sh is 1); criu-ns dump / criu-ns restore",
                "init": "init: worker PID 1; host criu dump --external mnt[] / criu restore --root rbind"}


def record(paths: list[Path]) -> None:
    """Each device run's JSON appended to bench/results/gpu_pidns.json as a run of its own (its
    date, machine and command are the device's), and one bench/RESULTS.md entry with every
    driver call's result."""
    runs = [json.loads(p.read_text()) for p in paths]
    for r in runs:
        record_run("gpu_pidns", {"probe": "born_in_namespace", **r})
    rows, notes = [], []
    for n, run_ in enumerate(runs, 1):
        for l, r in run_["layouts"].items():
            for s in r.get("steps", []):
                got = s.get("got")
                if isinstance(got, dict):
                    what = _short(got)
                elif "health" in s:
                    what = (f"health {json.dumps(s['health'])}; digests equal to the checkpoint: {s.get('equal')}; "
                            f"completion: {'tokens' in str(s.get('completion'))}; original meanwhile "
                            f"{json.dumps(s.get('original'))}")
                elif "rc" in s:
                    what = f"rc {s.get('rc')}, {s.get('s')} s" + (f"; {s['log_errors'][0]}" if s.get("log_errors") else "")
                else:
                    what = json.dumps({k: v for k, v in s.items() if k != "step"})[:200]
                rows.append([n, l, s["step"], s.get("pid", ""), what])
            if "error" in r:
                rows.append([n, l, "probe stopped", "", r["error"][:200]])
            o = r.get("original", {})
            notes.append(f"- run {n}, {LAYOUT_NAMES.get(l, l)}: original NSpid {o.get('nspid')}, driver socket "
                         f"{o.get('unix_before')}; continued with equal digests after its own CUDA restore: "
                         f"{o.get('continues_equal')}.")
            for key in ("copy", "copy_original_killed"):
                c = r.get(key)
                if c:
                    notes.append(f"  - {key}: NSpid {c.get('nspid')}, namespaces {c.get('ns')}, driver socket "
                                 f"{c.get('unix')}; CUDA restore succeeded from: {c.get('restored_from')}; "
                                 f"nvidia-smi after: {c.get('gpu_apps', '').replace(chr(10), '; ')}; digests equal to "
                                 f"the checkpoint: {c.get('state_equal_to_checkpoint')}.")
    table = md_table(["run", "layout", "step (vantage point)", "PID asked about", "result (asker's cuInit; calls)"], rows)
    cmds = "; ".join(f"`bench/on_device.sh {r['command']}` ({r['date']})" for r in runs)
    block = (f"\n## GPU worker born in its own PID + mount namespace: a copy beside it, CUDA restore from inside "
             f"(bench/gpu_pidns_born.py) — {runs[0]['date']}\n\nMachine: {runs[0]['machine']} "
             f"({runs[0]['versions'].get('driver')}; CRIU {runs[0]['versions'].get('criu')}), kind nvidia-h200  \n"
             f"Command: {cmds}\n\n{table.rstrip()}\n\n" + "\n".join(notes) + "\n")
    with RESULTS_MD.open("a") as f:
        f.write(block)
    print(block)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU demo worker, no CUDA calls (namespace plumbing only)")
    ap.add_argument("--layouts", default="child,init")
    ap.add_argument("--second-copy", choices=("auto", "always", "never"), default="auto",
                    help="a second copy with the original killed: auto = when the first copy's CUDA restore failed")
    ap.add_argument("--ballast-gib", type=float, default=0.5)
    ap.add_argument("--start-timeout", type=float, default=180)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "gpu_pidns_born.json"))
    ap.add_argument("--record", type=Path, nargs="+", help="merge device runs' JSON into the results here")
    ap.add_argument("--restore-order", default=",".join(ORDER), help="vantage points tried for the copy's CUDA restore")
    a = ap.parse_args()
    ORDER[:] = a.restore_order.split(",")
    if a.record:
        record(a.record)
        return 0
    probe(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
