"""AMX in a process, asked of the process itself: which dynamically enabled x86 state it may use.

Why this exists: AMX's tile registers are an XSAVE feature the kernel enables per process, on
request (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); oneDNN, and so torch's bf16
matmuls on the CPU, asks for it the first time it picks an AMX kernel. CRIU 4.2 saves neither that
permission nor the tile state (its XSAVE area is a fixed 4 KiB; upstream criu issue #1448), so a
restored process that used AMX dies: of SIGILL at its next tile instruction (vLLM's CPU worker,
``exit code: -4``), or inside the restore when a thread was mid-kernel (``Unable to detach``).

The permission is visible only to the process itself (``ARCH_GET_XCOMP_PERM``; no /proc file
shows it), so :func:`xcomp_perm` asks there: it stops one thread with ptrace, runs that one
syscall in it and puts registers and memory back, as CRIU's own parasite does for its dump. The
runner refuses such a tree before it freezes anything (``criu.refuse_uncarriable``) unless its
workload declares the permission unused (``criu.amx_unused``: torch asks for it whenever it probes
the CPU, so holding it does not mean running AMX). What keeps a worker off AMX: the oneDNN cap
(:data:`ONEDNN_ISA_CAP`, :func:`amx_cap_env`) and, for vLLM on the CPU, float32 (its bf16
attention has AMX kernels of its own); ckptflow's vLLM helpers do both on AMX CPUs.

Example:
    >>> amx_cap_env({"PATH": "/bin"}, cpu_flags={"avx512f"})          # no AMX: nothing to cap
    {'PATH': '/bin'}
    >>> amx_cap_env({}, cpu_flags={"amx_tile", "avx512_bf16"})
    {'ONEDNN_MAX_CPU_ISA': 'AVX512_CORE_BF16'}
    >>> amx_cap_env({"ONEDNN_MAX_CPU_ISA": "AVX2"}, cpu_flags={"amx_tile"})   # the user's own cap stays
    {'ONEDNN_MAX_CPU_ISA': 'AVX2'}
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

XFEATURE_XTILEDATA = 18  # the bit of AMX's tile data in an XSAVE feature mask
ARCH_GET_XCOMP_PERM = 0x1022
SYS_ARCH_PRCTL = 158  # x86-64
# oneDNN's strongest ISA below AMX: bf16 stays on AVX-512 (one would-be AMX kernel measured
# ~2x slower on the CPU; a GPU worker's CPU does no bf16 matmuls worth the name).
ONEDNN_ISA_CAP = ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

_PTRACE_GETREGS, _PTRACE_SETREGS, _PTRACE_SINGLESTEP, _PTRACE_DETACH = 12, 13, 9, 17
_PTRACE_SEIZE, _PTRACE_INTERRUPT = 0x4206, 0x4207
_WALL = 0x40000000
_SCRATCH_BELOW_SP = 4096  # well below the red zone (128 B) and any frame the thread is building


class _Regs(ctypes.Structure):  # struct user_regs_struct, x86-64
    _fields_ = [(n, ctypes.c_ulonglong) for n in (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi",
        "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs")]


@lru_cache(maxsize=1)
def _libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.ptrace.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    lib.ptrace.restype = ctypes.c_long
    return lib


def _ptrace(req: int, tid: int, addr: int = 0, data: int = 0) -> None:
    if _libc().ptrace(req, tid, ctypes.c_void_p(addr), ctypes.c_void_p(data)) == -1:
        e = ctypes.get_errno()
        raise OSError(e, f"ptrace({req:#x}, {tid}): {os.strerror(e)}")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (``flags`` on x86, ``Features`` on
    Arm; empty where it lists none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# The flags of instructions a user process runs (code dispatched once at start-up, as glibc's
# string functions and oneDNN's kernels are, keeps running them after a restore): the ones a
# restore onto another CPU needs. The rest of /proc/cpuinfo (virtualisation, bugs, kernel-only
# features like xsaves, power management) says nothing about what a restored process executes.
ISA_PREFIXES = ("sse", "ssse3", "avx", "fma", "f16c", "bmi", "adx", "aes", "pclmulqdq", "sha", "vaes",
                "vpclmulqdq", "gfni", "movbe", "popcnt", "abm", "amx", "xsave", "rdrand", "rdseed", "clflushopt",
                "clwb", "cx16", "erms", "fsrm", "movdir", "serialize", "lahf_lm", "rdpid", "rtm", "hle",
                "tsxldtrk", "3dnowprefetch", "cldemote", "fsgsbase")
ISA_EXCLUDE = frozenset({"xsaves", "xsaveerptr"})  # the kernel's own, or not an instruction a process runs


def isa_features(flags: frozenset[str] | set[str] | None = None, machine: str | None = None) -> list[str]:
    """The CPU features a restored process may depend on, sorted (what the fingerprint records).

    Example:
        >>> isa_features({"fpu", "vmx", "avx2", "avx512f", "amx_tile", "xsaves", "hypervisor"}, "x86_64")
        ['amx_tile', 'avx2', 'avx512f']
    """
    flags = cpu_flags() if flags is None else flags
    if (machine or platform.machine()) == "aarch64":
        return sorted(flags)  # every listed Arm feature (asimd, sve, ...) is an instruction-set one
    return sorted(f for f in flags if f.startswith(ISA_PREFIXES) and f not in ISA_EXCLUDE)


def cpu_has_amx(flags: frozenset[str] | set[str] | None = None) -> bool:
    return "amx_tile" in (cpu_flags() if flags is None else flags)


def amx_cap_env(env: Mapping[str, str], cpu_flags: frozenset[str] | set[str] | None = None) -> dict[str, str]:
    """``env`` with oneDNN held below AMX where this CPU has AMX (a worker started so can be
    checkpointed; see the module docstring). A cap the caller set is left as it is."""
    out = dict(env)
    if cpu_has_amx(cpu_flags):
        out.setdefault(*ONEDNN_ISA_CAP)
    return out


def _syscall_insn(pid: int, mem: int) -> int:
    """Address of a ``syscall`` instruction in the process (its vDSO has several)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith("[vdso]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            at = os.pread(mem, hi - lo, lo).find(b"\x0f\x05")
            if at >= 0:
                return lo + at
    raise OSError(errno.ENOENT, f"PID {pid}: no syscall instruction found in its vDSO")


def _stop(tid: int) -> int:
    """Wait for the seized thread's next stop; returns a signal to hand back at detach (0: none)."""
    _, status = os.waitpid(tid, _WALL)
    if not os.WIFSTOPPED(status):
        raise ProcessLookupError(errno.ESRCH, f"thread {tid} ended while stopped for a query")
    sig = os.WSTOPSIG(status)
    # A group-stop or our own trap is not the thread's; any other signal was on its way to it.
    return 0 if (status >> 16) or sig == signal.SIGTRAP else sig


def _arch_prctl_in(pid: int, code: int) -> tuple[int, int]:
    """Run ``arch_prctl(code, &scratch)`` inside ``pid`` (one of its threads), ``scratch`` 8 bytes
    below its stack, read back after. Returns (return value, scratch)."""
    tid = pid if Path(f"/proc/{pid}/task/{pid}").exists() else int(sorted(os.listdir(f"/proc/{pid}/task"))[0])
    _ptrace(_PTRACE_SEIZE, tid)
    pending = 0
    saved = _Regs()
    mem = None
    scratch_at, scratch_old = 0, b""
    try:
        _ptrace(_PTRACE_INTERRUPT, tid)
        pending = _stop(tid)
        _ptrace(_PTRACE_GETREGS, tid, 0, ctypes.addressof(saved))
        mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
        regs = _Regs.from_buffer_copy(saved)
        regs.rip = _syscall_insn(pid, mem)
        regs.rax, regs.rdi = SYS_ARCH_PRCTL, code
        regs.orig_rax = 2**64 - 1  # not in a syscall: the kernel must not restart the interrupted one over ours
        scratch_at = (saved.rsp - _SCRATCH_BELOW_SP) & ~0xF
        scratch_old = os.pread(mem, 8, scratch_at)
        os.pwrite(mem, bytes(8), scratch_at)
        regs.rsi = scratch_at
        _ptrace(_PTRACE_SETREGS, tid, 0, ctypes.addressof(regs))
        for _ in range(8):  # a signal arriving first stops it before the step: hand it back later
            _ptrace(_PTRACE_SINGLESTEP, tid)
            sig = _stop(tid)
            if not sig:
                break
            pending = pending or sig
        _ptrace(_PTRACE_GETREGS, tid, 0, ctypes.addressof(regs))
        ret = ctypes.c_longlong(regs.rax).value
        return ret, int.from_bytes(os.pread(mem, 8, scratch_at), "little")
    finally:
        # Whatever failed above, the thread gets back its memory and registers, then goes on.
        try:
            if mem is not None and scratch_at:
                os.pwrite(mem, scratch_old, scratch_at)
            if saved.rip:
                _ptrace(_PTRACE_SETREGS, tid, 0, ctypes.addressof(saved))
        finally:
            if mem is not None:
                os.close(mem)
            try:
                _ptrace(_PTRACE_DETACH, tid, 0, pending)
            except OSError:
                pass  # it ended meanwhile


QUERY_TIMEOUT_S = 10  # one query takes ~1 ms; a thread that never stops (a zombie leader) must not hold a dump


def _perms_here(pids: list[int]) -> dict[int, int | None]:
    out: dict[int, int | None] = {}
    for pid in pids:
        try:
            ret, mask = _arch_prctl_in(pid, ARCH_GET_XCOMP_PERM)
            out[pid] = mask if ret == 0 else None
        except OSError:
            out[pid] = None
    return out


def xcomp_perms(pids: list[int]) -> dict[int, int | None]:
    """The XSAVE features each of ``pids`` may use (``ARCH_GET_XCOMP_PERM`` asked inside it);
    None where that cannot be asked: not x86-64, not root, traced by another, gone, or no answer
    within QUERY_TIMEOUT_S.

    Asked from a child process of ours, never from this one: a ptrace stop of a process is also
    reported to its parent's ``waitpid``. Where the caller is the worker's parent with a thread
    waiting on it (a launcher reaping its engine), that thread took the stop and the query waited
    for ever (seen on the H200 in bench/vllm_gpu.py). The child is nobody's parent."""
    if platform.machine() != "x86_64" or not pids:
        return {p: None for p in pids}
    try:
        r = subprocess.run([sys.executable, "-m", __name__, *map(str, pids)], capture_output=True, text=True,
                           timeout=QUERY_TIMEOUT_S)
        answers = json.loads(r.stdout) if r.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        answers = {}
    return {p: answers.get(str(p)) for p in pids}


def xcomp_perm(pid: int) -> int | None:
    """The XSAVE features ``pid`` may use, or None (see :func:`xcomp_perms`)."""
    return xcomp_perms([pid])[pid]


def _has_amx(mask: int | None) -> bool:
    return mask is not None and bool(mask >> XFEATURE_XTILEDATA & 1)


def uses_amx(pid: int) -> bool:
    """Whether ``pid`` has AMX's tile data enabled (it asked for it, or inherited the permission)."""
    return _has_amx(xcomp_perm(pid))


def amx_holder(pids: list[int]) -> int | None:
    """The first of ``pids`` that has AMX enabled, or None (always None on a CPU without AMX)."""
    if not cpu_has_amx():
        return None
    perms = xcomp_perms(pids)
    return next((p for p in pids if _has_amx(perms[p])), None)


if __name__ == "__main__":  # the asking child of xcomp_perms: PIDs in, {pid: mask or null} out
    print(json.dumps(_perms_here([int(a) for a in sys.argv[1:]])))
