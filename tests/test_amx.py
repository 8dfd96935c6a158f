"""Restores on every CPU: AMX asked of the process itself, refused before a dump, kept off by
ckptflow's launch helpers; the CPU's features in the fingerprint and its gate.

The torch tests run a real bf16 worker from vLLM's virtualenv (torch 2.13 CPU) through real
CRIU. On a CPU with AMX, oneDNN enables AMX in that worker and CRIU 4.2 cannot carry it: before
this, its restore died of SIGILL (every vLLM CPU restore test failed on such a machine). On a
CPU without AMX the refusal cannot happen and its test says so by skipping; the rest runs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HELPERS
from ckptflow.errors import UnsupportedWorkload
from ckptflow.models import Fingerprint, Manifest, ProcessFinder, Workload
from ckptflow.policies import compat
from ckptflow.runners import xcomp

AMX = xcomp.cpu_has_amx()
NO_AMX = "this CPU has no AMX (no amx_tile in /proc/cpuinfo): nothing can enable it here"
root = pytest.mark.skipif(os.geteuid() != 0, reason="ptrace of another process and CRIU need root")


def _wait(cond, timeout=60.0, what="condition"):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --- asking a process: the query leaves it as it was ---------------------------------------------
ASK_AMX = r"""
import ctypes, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
ok = libc.syscall(158, 0x1023, 18) == 0 if sys.argv[1] == "amx" else False   # ARCH_REQ_XCOMP_PERM
count = [0, 0]
def spin(i):
    while True:
        count[i] += 1
        if i: time.sleep(0.0005)                       # one thread in and out of a syscall
for i in (0, 1):
    threading.Thread(target=spin, args=(i,), daemon=True).start()
print("granted" if ok else "plain", flush=True)
for line in sys.stdin:                                  # the main thread waits in read(2)
    print(count[0] > 0 and count[1] > 0, sum(count), flush=True)
"""


@pytest.fixture
def asker():
    procs = []

    def start(mode: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", ASK_AMX, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        p.first = p.stdout.readline().strip()
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _alive_and_counting(p: subprocess.Popen) -> int:
    p.stdin.write("?\n")
    p.stdin.flush()
    ok, total = p.stdout.readline().split()
    assert ok == "True"
    return int(total)


@root
def test_asking_a_process_leaves_its_threads_registers_and_blocked_syscalls_as_they_were(asker):
    p = asker("plain")
    before = _alive_and_counting(p)
    masks = {xcomp.xcomp_perm(p.pid) for _ in range(50)}
    assert len(masks) == 1 and None not in masks            # answered, and the same every time
    assert not (masks.pop() >> xcomp.XFEATURE_XTILEDATA) & 1
    after = _alive_and_counting(p)                           # its read(2) was restarted, not failed
    assert after > before and p.poll() is None
    assert not xcomp.uses_amx(p.pid) and xcomp.amx_holder([p.pid]) is None


@root
def test_a_process_that_enabled_amx_is_seen_as_one(asker):
    p = asker("amx")
    if not AMX:
        assert p.first == "plain"                            # the kernel refused: nothing to see
        assert not xcomp.uses_amx(p.pid)
        pytest.skip(NO_AMX)
    assert p.first == "granted"
    assert xcomp.uses_amx(p.pid) and xcomp.amx_holder([os.getpid(), p.pid]) == p.pid
    _alive_and_counting(p)


def test_a_process_that_cannot_be_asked_is_not_called_an_amx_user():
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert xcomp.xcomp_perm(gone.pid) is None and not xcomp.uses_amx(gone.pid)


def test_the_launch_cap_is_set_only_on_amx_cpus_and_never_over_the_users_own():
    assert xcomp.amx_cap_env({}, cpu_flags={"avx512f"}) == {}
    assert xcomp.amx_cap_env({}, cpu_flags={"amx_tile"}) == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    assert xcomp.amx_cap_env({"ONEDNN_MAX_CPU_ISA": "AVX2"}, cpu_flags={"amx_tile"}) == {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_vllms_launch_environment_carries_the_cap_on_this_cpu():
    from ckptflow.engines import vllm

    assert ("ONEDNN_MAX_CPU_ISA" in vllm.CPU_ENV) == AMX


# --- a real torch worker through real CRIU ---------------------------------------------------------
class Bf16Worker:
    def __init__(self, python: Path, tmp_path: Path, env: dict[str, str], name: str = "bf16"):
        self.python, self.env = python, env
        self.pid_file, self.out = tmp_path / f"{name}.pid", tmp_path / f"{name}.out"
        self.proc = subprocess.Popen([str(python), str(HELPERS / "bf16_worker.py"), str(self.pid_file), str(self.out)],
                                     env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}.log", "ab"))
        _wait(self.pid_file.exists, what="the bf16 worker's pid file")
        self.workload = Workload(name=name, node="n", find=ProcessFinder(pid_file=str(self.pid_file),
                                                                          cmdline_must_contain="bf16_worker.py"))

    @property
    def pid(self) -> int:
        return int(self.pid_file.read_text())

    def state(self, pid: int | None = None) -> tuple[int, str]:
        self.out.unlink(missing_ok=True)
        os.kill(pid or self.pid, signal.SIGUSR1)
        _wait(self.out.exists, 30, "the bf16 worker's answer")
        steps, digest = self.out.read_text().split()
        return int(steps), digest

    def reference(self, steps: int) -> tuple[int, str]:
        out = subprocess.run([str(self.python), str(HELPERS / "bf16_worker.py"), "--ref", str(steps)], env=self.env,
                             capture_output=True, text=True, timeout=300, check=True).stdout.split()
        return int(out[0]), out[1]

    def kill(self) -> None:
        for pid in {self.proc.pid, *([self.pid] if self.pid_file.exists() else [])}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


@pytest.fixture
def bf16(vllm_install, tmp_path):
    workers = []

    def start(env: dict[str, str], name: str = "bf16") -> Bf16Worker:
        w = Bf16Worker(vllm_install.python, tmp_path, env, name)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.kill()


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != xcomp.ONEDNN_ISA_CAP[0]}


@root
def test_a_worker_that_used_amx_is_refused_before_the_dump_with_the_cause_and_the_fix(bf16, criu, tmp_path):
    """What failed on an AMX Xeon: the dump went through and the restored worker died of SIGILL."""
    if not AMX:
        pytest.skip(NO_AMX)
    w = bf16(_plain_env())
    steps, _ = w.state()
    assert xcomp.uses_amx(w.pid)                              # oneDNN asked for AMX: torch computes bf16 on it
    with pytest.raises(UnsupportedWorkload) as e:
        criu.dump(w.workload, tmp_path / "img", leave_running=False)
    msg = str(e.value)
    assert f"PID {w.pid}" in msg and "AMX" in msg and "SIGILL" in msg
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in e.value.fix
    assert not list((tmp_path / "img").glob("*.img"))        # nothing frozen, nothing written
    assert w.state()[0] > steps                               # and it computes on, untouched


@root
def test_a_worker_started_with_the_launch_cap_is_killed_restored_and_computes_on_like_a_reference(bf16, store,
                                                                                                  tmp_path):
    from ckptflow.runners.node import NodeRunner

    w = bf16(xcomp.amx_cap_env(_plain_env()))
    w.state()
    assert not xcomp.uses_amx(w.pid)
    with NodeRunner(store) as node:
        m = node.checkpoint(w.workload, leave_running=False)  # the heartbeat's dump, the worker then gone
        w.proc.wait(timeout=30)
        pid = node.restore(w.workload, manifest=m).pid
    steps, digest = w.state(pid)
    time.sleep(0.5)
    later, _ = w.state(pid)
    assert later > steps                                     # alive after the restore, no SIGILL
    assert (steps, digest) == w.reference(steps)             # and its state is an uninterrupted one's
    assert m.fingerprint.cpu_features == xcomp.isa_features()


# --- the CPU's features: recorded, gated as a subset, swept by invalidate ------------------------
def test_the_node_fingerprint_records_this_cpus_instruction_set_features():
    from ckptflow.runners.fingerprint import node_fingerprint

    fp = node_fingerprint()
    assert fp.cpu_features == xcomp.isa_features() and fp.cpu_features
    if os.uname().machine == "x86_64":
        assert "sse2" in fp.cpu_features and ("amx_tile" in fp.cpu_features) == AMX
        assert not {"hypervisor", "xsaves", "fpu"} & set(fp.cpu_features)


SPR = ["amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512f", "sse2"]
ICX = ["avx2", "avx512f", "sse2"]


def test_a_restore_onto_a_cpu_lacking_a_feature_the_checkpoint_had_is_refused_naming_them():
    c = compat.diff(Fingerprint(cpu_features=SPR), Fingerprint(cpu_features=ICX), groups=("host",))
    assert not c.ok and c.reason() == "cpu_features: this CPU lacks amx_bf16, amx_tile, avx512_bf16"
    assert compat.diff(Fingerprint(cpu_features=ICX), Fingerprint(cpu_features=SPR), groups=("host",)).ok
    assert compat.diff(Fingerprint(cpu_features=SPR), Fingerprint(cpu_features=list(reversed(SPR))),
                       groups=("host",)).ok
    # Not recorded (an older manifest) while this node knows them: refused, as every gated field.
    assert "cpu_features" in compat.diff(Fingerprint(), Fingerprint(cpu_features=ICX), groups=("host",)).differences
    assert compat.diff(Fingerprint(cpu_features=SPR), Fingerprint(cpu_features=ICX), overrides={"cpu_features"},
                       groups=("host",)).ok


def test_invalidate_sweeps_a_checkpoint_no_node_has_the_cpu_for():
    m = Manifest(id="20261201T120000Z-0a0b0c0d", workload="w", node="spr", fingerprint=Fingerprint(cpu_features=SPR))
    [(stale, why)] = compat.stale([m], {"icx-1": Fingerprint(cpu_features=ICX)}, gpu=False)
    assert stale is m and "this CPU lacks amx_bf16, amx_tile, avx512_bf16" in why
    assert compat.stale([m], {"icx-1": Fingerprint(cpu_features=ICX), "spr-2": Fingerprint(cpu_features=SPR)},
                        gpu=False) == []


def test_the_modules_examples_run():
    import doctest

    for mod in (xcomp, compat):
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert res.attempted and not res.failed, mod.__name__


@root
def test_asking_a_child_whose_parent_waits_on_it_does_not_hang(asker):
    """bench/vllm_gpu.py on the H200: the launcher reaps its engine from a thread (Popen.wait), and
    a ptrace stop is reported to the parent's waitpid too; asked from the launcher's own process,
    the query never saw its stop and waited for ever."""
    import threading

    p = asker("plain")
    waiter = threading.Thread(target=p.wait, daemon=True)
    waiter.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    assert xcomp.xcomp_perm(p.pid) is not None
    assert time.perf_counter() - t0 < xcomp.QUERY_TIMEOUT_S / 2
    assert waiter.is_alive() and p.poll() is None           # the parent's wait saw no stop of ours
    _alive_and_counting(p)


@root
def test_a_tree_whose_amx_permission_is_declared_unused_is_let_through_and_only_then(asker):
    """vLLM's CPU worker holds the permission whatever it computes: torch asks for it when it probes the
    CPU (``torch.cpu._is_amx_tile_supported``). Served in float32 it never runs AMX, and its workload
    says so (``criu.amx_unused``, set by engines.vllm's helpers on AMX CPUs)."""
    from ckptflow.runners.criu import refuse_uncarriable

    if not AMX:
        pytest.skip(NO_AMX)
    p = asker("amx")
    find = ProcessFinder(pid_file="/nonexistent.pid")
    with pytest.raises(UnsupportedWorkload, match=rf"PID {p.pid} \(python[^)]*\) has AMX enabled"):
        refuse_uncarriable(Workload(name="w", node="n", find=find), [p.pid])
    refuse_uncarriable(Workload(name="w", node="n", find=find, criu={"amx_unused": True}), [p.pid])


def test_vllms_helpers_serve_float32_and_declare_the_permission_unused_exactly_on_amx_cpus():
    from ckptflow.engines import vllm

    assert vllm.CPU_DTYPE == ("float32" if AMX else "bfloat16")
    assert vllm.VLLM_CRIU.model_copy(update={"amx_unused": vllm.CPU_AMX}).amx_unused == AMX
