"""A CPU process with "device memory" for FakeGpuBackend (tests/test_gpu_backend_contract.py).

Its device memory is the file <root>/<device>/<pid>.mem: an 8-byte counter, then ballast. While
its state (<root>/state/<pid>, absent = running) says running it adds 1 to the counter every few
ms, wherever the file is now (a restore may have moved it to another device); told "locked" it
finishes the step in flight and acknowledges (<root>/state/<pid>.ack), like a driver's lock.

    python fake_gpu_worker.py ROOT PID_FILE SIZE_BYTES
"""
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from pidio import write_atomic, write_pid_file  # noqa: E402

root, pid_file, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
pid = os.getpid()
device = sorted(d for d in os.listdir(root) if d.startswith("FAKE-"))[0]
with open(f"{root}/{device}/{pid}.mem.tmp", "wb") as f:
    f.write((0).to_bytes(8, "little") + b"\x5a" * (size - 8))
os.replace(f"{root}/{device}/{pid}.mem.tmp", f"{root}/{device}/{pid}.mem")
write_pid_file(pid_file)
state_file, ack_file = f"{root}/state/{pid}", f"{root}/state/{pid}.ack"
while True:
    try:
        with open(state_file) as f:
            state = f.read().strip()
    except FileNotFoundError:
        state = "running"
    if state == "running":
        for path in glob.glob(f"{root}/FAKE-*/{pid}.mem"):
            try:
                with open(path, "r+b") as f:
                    n = int.from_bytes(f.read(8), "little")
                    f.seek(0)
                    f.write((n + 1).to_bytes(8, "little"))
            except FileNotFoundError:
                pass  # moved by a checkpoint between the glob and the open
    elif state == "locked" and not os.path.exists(ack_file) and not os.path.exists(f"{root}/busy"):
        write_atomic(ack_file, "locked")
    time.sleep(0.005)
