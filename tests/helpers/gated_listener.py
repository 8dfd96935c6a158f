"""A TCP server on 127.0.0.1 that accepts nothing until a gate file exists, then answers each
connection with '<n>\\n' (n counts connections, in memory) after holding it ``hold_s`` seconds
(negative: forever). A client that connects before the gate waits in the accept queue: an
in-flight connection for CRIU; one being held is an established one.

Usage: gated_listener.py PORT PID_FILE GATE [HOLD_S]"""
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from pidio import write_pid_file  # noqa: E402

port, pid_file, gate = int(sys.argv[1]), sys.argv[2], sys.argv[3]
hold_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(8)
write_pid_file(pid_file)
while not os.path.exists(gate):
    time.sleep(0.02)
n = 0
while True:
    c, _ = srv.accept()
    n += 1
    if hold_s < 0:
        while True:
            time.sleep(1)
    time.sleep(hold_s)
    c.sendall(f"{n}\n".encode())
    c.close()
