"""A process whose only state is a counter in memory. SIGUSR1 writes it to argv[2]."""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from pidio import write_atomic, write_pid_file  # noqa: E402

pid_file, out = sys.argv[1], sys.argv[2]
count = 0


def report(*_):
    write_atomic(out, str(count))


signal.signal(signal.SIGUSR1, report)
write_pid_file(pid_file)
while True:
    count += 1
    time.sleep(0.001)
