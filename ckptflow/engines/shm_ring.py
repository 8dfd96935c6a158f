"""A one-writer, many-reader command ring in shared memory: how tensor-parallel ranks wait.

Why: a rank that waits for its next command inside an NCCL collective runs a kernel that spins
on the GPU until rank 0 sends, and the CUDA driver can never lock such a process
(``cuCheckpointProcessLock`` → ``CUDA_ERROR_NOT_READY``, measured on two H200s). vLLM's workers
wait on a CPU-side shared-memory ring buffer instead and enter NCCL only with work; so do ours.

The ring is a file in /dev/shm that every rank maps. Rank 0 unlinks it once every rank has
mapped it: nothing is left in /dev/shm when the worker dies, and CRIU carries the unlinked file
in the image as a ghost file (a few KiB), so a restore on another node finds it.

Each rank also publishes what it is doing (idle at sequence N, or running op X since t), which
the worker reports from its quiesce endpoint and the runner quotes when a CUDA lock times out.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "ring")
    >>> w = Ring.create(path, world=2)
    >>> r = Ring.attach(path, rank=1)
    >>> w.send(3, 1, 2, 3)
    1
    >>> r.recv(timeout_s=1)
    (1, 3, 1, 2, 3)
    >>> r.done(1); w.idle_ranks() == [1]
    True
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass

MAGIC = 0x636B7074666C6F77  # "ckptflow"
MAX_RANKS = 16
SLOTS = 64
_HDR = struct.Struct("<QQI")            # magic, write_seq, world
_RANK = struct.Struct("<QIiIdd")        # read_seq, state, op, pid, since (wall clock), value
_SLOT = struct.Struct("<Qqqqq")         # seq, op, a, b, c
HDR_SIZE, RANK_SIZE, SLOT_SIZE = 64, 64, 64
SIZE = HDR_SIZE + MAX_RANKS * RANK_SIZE + SLOTS * SLOT_SIZE
IDLE, RUNNING = 0, 1


@dataclass
class RankState:
    """What one rank is doing, as it published it."""
    rank: int
    pid: int
    read_seq: int
    running: bool
    op: int
    since: float
    value: float = 0.0   # a number the rank publishes about itself (tests, metrics)

    def describe(self, names: dict[int, str] | None = None, now: float | None = None) -> str:
        age = (now or time.time()) - self.since
        if self.running:
            op = (names or {}).get(self.op, str(self.op))
            return f"rank {self.rank} (PID {self.pid}): running {op} for {age:.1f} s"
        return f"rank {self.rank} (PID {self.pid}): idle on the CPU ring after command {self.read_seq}"


class Ring:
    def __init__(self, mm: mmap.mmap, rank: int):
        self.mm, self.rank = mm, rank
        self.read_seq = self._rank(rank)[0]

    # --- open -------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str, world: int) -> "Ring":
        if world > MAX_RANKS:
            raise ValueError(f"at most {MAX_RANKS} ranks")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        _HDR.pack_into(mm, 0, MAGIC, 0, world)
        ring = cls(mm, 0)
        ring.publish(IDLE, -1)
        return ring

    @classmethod
    def attach(cls, path: str, rank: int) -> "Ring":
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        if _HDR.unpack_from(mm, 0)[0] != MAGIC:
            raise ValueError(f"{path} is not a ckptflow ring")
        ring = cls(mm, rank)
        ring.publish(IDLE, -1)
        return ring

    # --- state ------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return _HDR.unpack_from(self.mm, 0)[2]

    @property
    def write_seq(self) -> int:
        return _HDR.unpack_from(self.mm, 0)[1]

    def _rank(self, r: int) -> tuple:
        return _RANK.unpack_from(self.mm, HDR_SIZE + r * RANK_SIZE)

    def publish(self, state: int, op: int, value: float | None = None) -> None:
        if value is None:
            value = self._rank(self.rank)[5]
        _RANK.pack_into(self.mm, HDR_SIZE + self.rank * RANK_SIZE, self.read_seq, state, op, os.getpid(),
                        time.time(), value)

    def states(self) -> list[RankState]:
        out = []
        for r in range(self.world):
            seq, st, op, pid, since, value = self._rank(r)
            out.append(RankState(r, pid, seq, st == RUNNING, op, since, value))
        return out

    def idle_ranks(self) -> list[int]:
        """Ranks > 0 that have finished every command sent so far."""
        ws = self.write_seq
        return [s.rank for s in self.states()[1:] if not s.running and s.read_seq == ws]

    # --- rank 0 -----------------------------------------------------------------------
    def send(self, op: int, a: int = 0, b: int = 0, c: int = 0, timeout_s: float = 300) -> int:
        seq = self.write_seq + 1
        # The slot is reused SLOTS commands later: wait until every rank has read that far.
        _poll(lambda: min((s.read_seq for s in self.states()[1:]), default=seq) > seq - SLOTS, timeout_s,
              "a rank to catch up with the command ring")
        _SLOT.pack_into(self.mm, HDR_SIZE + MAX_RANKS * RANK_SIZE + (seq % SLOTS) * SLOT_SIZE, seq, op, a, b, c)
        # x86 keeps stores in order, so a reader that sees write_seq also sees the slot.
        struct.pack_into("<Q", self.mm, 8, seq)
        return seq

    def wait_idle(self, timeout_s: float) -> None:
        """Return once every rank > 0 is idle after the last command (no collective in flight)."""
        _poll(lambda: len(self.idle_ranks()) == self.world - 1, timeout_s, "every rank to finish its command")

    # --- ranks > 0 --------------------------------------------------------------------
    def recv(self, timeout_s: float | None = None) -> tuple[int, int, int, int, int]:
        """Wait on the CPU for the next command: (seq, op, a, b, c); marks this rank running."""
        want = self.read_seq + 1
        _poll(lambda: self.write_seq >= want, timeout_s, "the next command")
        seq, op, a, b, c = _SLOT.unpack_from(self.mm, HDR_SIZE + MAX_RANKS * RANK_SIZE + (want % SLOTS) * SLOT_SIZE)
        if seq != want:
            raise RuntimeError(f"rank {self.rank}: command ring overrun (wanted {want}, slot holds {seq})")
        self.publish(RUNNING, op)
        return seq, op, a, b, c

    def done(self, seq: int, value: float | None = None) -> None:
        self.read_seq = seq
        self.publish(IDLE, -1, value)


def _poll(ready, timeout_s: float | None, what: str) -> None:
    # Spin briefly (a decode step's command must not wait a scheduler tick), then sleep: an idle
    # rank costs well under 1 % of a core.
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    n = 0
    while not ready():
        n += 1
        if n < 2000:
            os.sched_yield()
        else:
            time.sleep(0.0005 if n < 20000 else 0.005)
        if deadline is not None and n % 64 == 0 and time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
