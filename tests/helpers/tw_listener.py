"""A listener whose port carries a TIME_WAIT connection, as NCCL's bootstrap listeners do after
init: it accepted a connection and closed it first. Counts in memory; SIGUSR1 writes the count."""
import os
import signal
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from pidio import write_atomic, write_pid_file  # noqa: E402

pid_file, out = sys.argv[1], sys.argv[2]
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen()
c = socket.create_connection(srv.getsockname())
a, _ = srv.accept()
a.close()                     # this side closes first: its end waits in TIME_WAIT on srv's port
time.sleep(0.05)
c.close()
count = 0


def report(*_):
    write_atomic(out, f"{count} {srv.getsockname()[1]}")


signal.signal(signal.SIGUSR1, report)
write_pid_file(pid_file)
while True:
    count += 1
    time.sleep(0.001)
