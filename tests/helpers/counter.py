"""A process whose only state is a counter in memory. SIGUSR1 writes it to argv[2]."""
import os
import signal
import sys
import time

pid_file, out = sys.argv[1], sys.argv[2]
count = 0


def report(*_):
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(count))
    os.replace(tmp, out)


signal.signal(signal.SIGUSR1, report)
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(pid_file + ".tmp", pid_file)
while True:
    count += 1
    time.sleep(0.001)
