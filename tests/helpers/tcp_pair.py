"""A two-process tree holding an established loopback connection between its processes, as a
TP vLLM's ranks (gloo) or a GPU vLLM's TCPStore do: the child counts the lines the parent sends it
over that connection; the parent serves each HTTP GET on its port with the child's count, so a
copy answers only if the internal connection came back with it."""
import os
import socket
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port, pid_file = int(sys.argv[1]), sys.argv[2]
inner = socket.socket()
inner.bind(("127.0.0.1", 0))
inner.listen(1)
if os.fork() == 0:  # the child: the connection's far end, inside the same tree
    conn, _ = inner.accept()
    n, buf = 0, b""
    while data := conn.recv(4096):
        buf += data
        while b"\n" in buf:
            _, buf = buf.split(b"\n", 1)
            n += 1
            conn.sendall(f"{n}\n".encode())
    sys.exit(0)
link = socket.create_connection(inner.getsockname()).makefile("rwb")


class Count(BaseHTTPRequestHandler):
    def do_GET(self):
        link.write(b"tick\n"); link.flush()
        body = link.readline()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


srv = HTTPServer(("127.0.0.1", port), Count)
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(pid_file + ".tmp", pid_file)
srv.serve_forever()
