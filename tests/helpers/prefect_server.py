"""A real Prefect server on 127.0.0.1 (SQLite under its own PREFECT_HOME), for tests and benches."""

import subprocess
import sys
import time
import urllib.request


def start_prefect_server(env: dict, port: int, log=subprocess.DEVNULL, timeout_s: float = 120) -> subprocess.Popen:
    """Start `prefect server start` in its own process group and wait until /api/health answers."""
    env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log,
                            stderr=subprocess.STDOUT if log is not subprocess.DEVNULL else subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2).read()
            return proc
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"prefect server on port {port} did not become healthy")
            time.sleep(0.3)
