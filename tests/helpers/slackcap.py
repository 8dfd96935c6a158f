"""A local stand-in for Slack's HTTP API: real request bodies, answered like Slack."""


class SlackCapture:
    """A local HTTP server standing for Slack: records every request body, answers like Slack."""

    def __init__(self, status: int = 200):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[dict] = []
        self.status = status
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    parsed = json.loads(body)
                except ValueError:
                    parsed = {"raw": body.decode(errors="replace")}
                outer.requests.append({"path": self.path, "body": parsed})
                out = b"ok" if outer.status == 200 else b"internal_error"
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T000/B000/XXXX"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
