"""An HTTP relay in front of a worker that holds back the answer to one path: the request
reaches the real engine (which does its work), the caller waits until the test releases it.
Lets a test kill a runner while a protocol call is in flight, deterministically."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HoldProxy:
    def __init__(self, upstream: str, hold_path: str):
        self.upstream, self.hold_path = upstream.rstrip("/"), hold_path
        self.in_flight, self.release = threading.Event(), threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _relay(self, body: bytes | None) -> None:
                req = urllib.request.Request(proxy.upstream + self.path, data=body,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        code, data = r.status, r.read()
                except urllib.error.HTTPError as e:
                    code, data = e.code, e.read()
                if self.path.split("?")[0] == proxy.hold_path:
                    proxy.in_flight.set()
                    proxy.release.wait(60)
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._relay(None)

            def do_POST(self):
                self._relay(self.rfile.read(int(self.headers.get("Content-Length", 0))))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
