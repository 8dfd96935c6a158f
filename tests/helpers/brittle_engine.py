"""An HTTP engine whose /health always answers and whose completions die once a flag file
exists, the way a restored CPU vLLM died of SIGILL on its first completion while /health said
200 (issue #36). Usage: brittle_engine.py PORT PID_FILE FLAG_FILE"""
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port, pid_file, flag = int(sys.argv[1]), sys.argv[2], sys.argv[3]


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, doc):
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"ok": True})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if os.path.exists(flag):
            os._exit(132)  # what a worker killed by SIGILL reports
        self._send(200, {"choices": [{"tokens": [1, 2, 3]}]})


srv = HTTPServer(("127.0.0.1", port), H)
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(pid_file + ".tmp", pid_file)
srv.serve_forever()
