"""Two processes on the command ring, the way the tensor-parallel worker's ranks talk.

Rank 0 (this process) sends command n = 1, 2, 3, … every few ms; rank 1 (its child) adds each n
to a sum it publishes on the ring. SIGUSR1 to rank 0 writes "sent sum" to argv[2] once rank 1 is
idle: an intact channel always has sum == sent * (sent + 1) / 2.
"""
import ctypes
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
from ckptflow.engines.shm_ring import Ring  # noqa: E402
from pidio import write_atomic, write_pid_file  # noqa: E402

ADD = 1

if sys.argv[1] == "--rank1":
    ctypes.CDLL("libc.so.6").prctl(1, 9)  # PR_SET_PDEATHSIG: dies with rank 0
    ring, total = Ring.attach(sys.argv[2], 1), 0
    while True:
        seq, op, a, _, _ = ring.recv()
        total += a
        ring.done(seq, value=total)

pid_file, out = sys.argv[1], sys.argv[2]
path = f"/dev/shm/ckptflow-ring-test-{os.getpid()}"
ring = Ring.create(path, 2)
subprocess.Popen([sys.executable, __file__, "--rank1", path], stdin=subprocess.DEVNULL)
while ring.states()[1].pid == 0:
    time.sleep(0.01)
os.unlink(path)  # mapped by both: from now on only CRIU's ghost file keeps it
sent = 0


def report(*_):
    ring.wait_idle(timeout_s=10)
    write_atomic(out, f"{sent} {int(ring.states()[1].value)}")


signal.signal(signal.SIGUSR1, report)
write_pid_file(pid_file)
while True:
    sent += 1
    ring.send(ADD, sent)
    time.sleep(0.002)
