"""Start and talk to a demo worker the way a node's supervisor would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from ckptflow.models import GoldenRequest, ProcessFinder, TrafficClass, Workload
from ckptflow.runners.engine import wait_url

# One BLAS thread: fewer threads for CRIU to freeze, and the 2-core CI stays responsive.
_WORKER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def demo_workload(name: str, port: int, pid_file: Path, *, node: str = "local",
                  traffic: TrafficClass = TrafficClass.long_sessions) -> Workload:
    return Workload(name=name, node=node,
                    find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="ckptflow.demo.worker"),
                    engine="vllm", engine_version="demo", model_id="ckptflow-demo-tiny",
                    model_revision="seed-1234", health_url=f"http://127.0.0.1:{port}/health",
                    metrics_url=f"http://127.0.0.1:{port}/metrics",
                    probe_url=f"http://127.0.0.1:{port}/v1/sessions/digests", traffic=traffic,
                    kv_capacity_tokens=65536,
                    golden=GoldenRequest(url=f"http://127.0.0.1:{port}/v1/completions",
                                         body={"prompt": "ckptflow golden request", "max_tokens": 16},
                                         field="choices.0.tokens"),
                    start_command=[sys.executable, "-m", "ckptflow.demo.worker", "--port", str(port),
                                   "--pid-file", str(pid_file)])


def require_free_port(port: int, host: str = "127.0.0.1") -> None:
    """Refuse early, naming the port, when something already listens there (the worker would
    exit at bind and the caller would only see it never became healthy).

    Raises:
        ConfigError: the port is taken.
    """
    import errno
    import socket

    from ckptflow.errors import ConfigError

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is no owner
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:   # not taken: an address this machine does not have
                raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                                  fix="use an address of this machine (127.0.0.1, or one `ip -brief addr` lists)") from None
            raise ConfigError(f"port {port} on {host} is taken by another process",
                              fix=f"stop it (see `ss -ltnp 'sport = :{port}'`), e.g. an earlier demo's worker") from None


def start_worker(port: int, pid_file: Path, *, ballast_mib: int = 0, seed: int = 1234,
                 timeout_s: float = 30, module: str = "ckptflow.demo.worker",
                 extra: list[str] | None = None, isolated: bool = False) -> subprocess.Popen:
    """Start a detached demo worker (own session, stdio on /dev/null) and wait until healthy.

    ``isolated``: as PID 1 of its own PID and mount namespaces (runners/isolate.py); ``pid_file``
    then holds its host PID."""
    pid_file.unlink(missing_ok=True)
    size = ["--ballast-mib", str(ballast_mib)] if module == "ckptflow.demo.worker" else []
    inner = pid_file.with_name(pid_file.name + ".ns") if isolated else pid_file  # the worker writes 1 there
    argv = [sys.executable, "-m", module, "--port", str(port), "--pid-file", str(inner),
            "--seed", str(seed), *size, *(extra or [])]
    if isolated:
        from ckptflow.runners.isolate import isolated_argv

        argv = isolated_argv(argv, pid_file)
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, env={**os.environ, **_WORKER_ENV})
    wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s, proc=proc)
    return proc


def start_gpu_worker(port: int, pid_file: Path, *, ballast_gib: float, seed: int = 1234,
                     timeout_s: float = 300, isolated: bool = False) -> subprocess.Popen:
    """Start the torch GPU demo worker (needs torch and a GPU); ``isolated`` as start_worker."""
    return start_worker(port, pid_file, seed=seed, timeout_s=timeout_s, module="ckptflow.demo.gpu_worker",
                        extra=["--ballast-gib", str(ballast_gib)], isolated=isolated)


def gpu_workload(name: str, port: int, pid_file: Path, footprint_gib: float | None = None) -> Workload:
    w = demo_workload(name, port, pid_file)
    return w.model_copy(update={"gpu": True, "gpu_footprint_gib": footprint_gib,
                                "prepare_url": f"http://127.0.0.1:{port}/v1/ckptflow/prepare",
                                "find": ProcessFinder(pid_file=str(pid_file),
                                                      cmdline_must_contain="ckptflow.demo.gpu_worker")})


def start_tp_worker(port: int, pid_file: Path, *, world_size: int, backend: str, ballast_gib: float,
                    seed: int = 1234, timeout_s: float = 300) -> subprocess.Popen:
    """Start the tensor-parallel demo worker (rank 0 starts the other ranks as its children).
    The ranks inherit this process's environment: set the NCCL variables here first."""
    return start_worker(port, pid_file, seed=seed, timeout_s=timeout_s, module="ckptflow.demo.tp_worker",
                        extra=["--world-size", str(world_size), "--backend", backend,
                               "--ballast-gib", str(ballast_gib)])


def tp_workload(name: str, port: int, pid_file: Path, world_size: int, footprint_gib: float | None = None) -> Workload:
    # Ranks talk over loopback TCP (gloo, NCCL's bootstrap and socket transport): established
    # connections inside the dumped tree.
    return gpu_workload(name, port, pid_file, footprint_gib).model_copy(update={
        "tensor_parallel": world_size, "tcp_established": True,
        "resume_url": f"http://127.0.0.1:{port}/v1/ckptflow/resume",
        "find": ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="ckptflow.demo.tp_worker")})


def wait_healthy(url: str, timeout_s: float = 30, proc: subprocess.Popen | None = None) -> float:
    """Poll ``url`` until it answers 200; return the seconds it took."""
    return wait_url(url, timeout_s, proc)


def http_json(url: str, body: dict | None = None, timeout_s: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def complete(port: int, prompt: str, max_tokens: int, session_id: str | None = None) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens}
    if session_id:
        body["session_id"] = session_id
    return http_json(f"http://127.0.0.1:{port}/v1/completions", body)["choices"][0]["tokens"]


def complete_status(port: int, prompt: str, max_tokens: int, session_id: str | None = None,
                    timeout_s: float = 120) -> tuple[int, dict]:
    """(HTTP status, body) of one completion, an error answer included (a lost session's 410)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, **({"session_id": session_id} if session_id else {})}
    try:
        return 200, http_json(f"http://127.0.0.1:{port}/v1/completions", body, timeout_s)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def session_digests(port: int) -> dict[str, str]:
    return http_json(f"http://127.0.0.1:{port}/v1/sessions/digests")["sessions"]
