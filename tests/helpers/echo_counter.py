"""TCP server on 127.0.0.1: for each line on a connection, replies '<n> <line>' (n counts lines)."""
import os
import socket
import sys

port, pid_file = int(sys.argv[1]), sys.argv[2]
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(1)
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(pid_file + ".tmp", pid_file)
conn, _ = srv.accept()
n = 0
buf = b""
while True:
    data = conn.recv(4096)
    if not data:
        break
    buf += data
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        n += 1
        conn.sendall(f"{n} ".encode() + line + b"\n")
