"""The real GPU path: driver API + CRIU on a torch worker. Runs only where a GPU is.

On CI (no GPU) every test here is skipped with the reason; the same tests and
bench/gpu_checkpoint.py ran on the H200 (bench/RESULTS.md).
"""

import os
import signal

import pytest

from conftest import free_port


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch not installed (GPU nodes: pip install 'ckptflow[gpu]')"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    from ckptflow.runners.cuda import CudaRunner

    ok, why = CudaRunner().available()
    return None if ok else why


_WHY = _gpu_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.criu,
              pytest.mark.skipif(_WHY is not None, reason=f"GPU-only: {_WHY}")]


@pytest.fixture
def gpu_worker(tmp_path):
    from ckptflow.demo import launch

    port, pid_file = free_port(), tmp_path / "g.pid"
    proc = launch.start_gpu_worker(port, pid_file, ballast_gib=1)
    w = launch.gpu_workload("gpu-test", port, pid_file)
    yield w, port
    proc.kill()
    try:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def test_gpu_heartbeat_then_restore_is_bit_exact(tmp_path, gpu_worker):
    from ckptflow.demo.launch import http_json, session_digests
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    w, port = gpu_worker
    base = f"http://127.0.0.1:{port}"
    http_json(f"{base}/v1/completions", {"prompt": "a long session " * 60, "max_tokens": 32, "session_id": "s"})
    want = http_json(f"{base}/v1/peek", {"prompt": "go on", "max_tokens": 48, "session_id": "s"})["tokens"]
    digests, ballast = session_digests(port), http_json(f"{base}/v1/ballast/digest")
    node = NodeRunner(LocalStore(tmp_path / "store"))
    m = node.checkpoint(w)
    assert m.gpu_footprint_bytes > 2**30
    assert {"lock", "cuda_checkpoint", "dump", "cuda_restore", "unlock", "pause"} <= set(m.timings)
    assert session_digests(port) == digests  # still serving, same state
    os.kill(m.pid, signal.SIGKILL)
    res = node.restore(w)
    assert {"restore", "cuda_restore", "unlock"} <= set(res.timings)
    assert session_digests(port) == digests
    assert http_json(f"{base}/v1/ballast/digest") == ballast
    got = http_json(f"{base}/v1/completions", {"prompt": "go on", "max_tokens": 48, "session_id": "s"})
    assert got["choices"][0]["tokens"] == want


def test_restore_refused_without_enough_gpu_memory(tmp_path, gpu_worker):
    from ckptflow.errors import NotEnoughGpuMemory
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    w, port = gpu_worker
    node = NodeRunner(LocalStore(tmp_path / "store"))
    m = node.checkpoint(w)
    os.kill(m.pid, signal.SIGKILL)
    huge = node.store.set_state(m, m.state)
    assert m.gpu_footprints and sum(m.gpu_footprints.values()) == m.gpu_footprint_bytes  # per GPU, by UUID
    huge = huge.model_copy(update={"gpu_footprint_bytes": 10 * 2**40,
                                   "gpu_footprints": {u: 10 * 2**40 for u in m.gpu_footprints}})
    logs_before = set(node.criu.log_dir.glob("restore-*.log"))
    with pytest.raises(NotEnoughGpuMemory, match="needed"):
        node.restore(w, manifest=huge)
    assert set(node.criu.log_dir.glob("restore-*.log")) == logs_before  # no CRIU call was made


def test_gpu_verify_checks_bytes_and_skips_the_sandbox_leaving_the_original_alone(tmp_path, gpu_worker):
    # Measured on the H200: the driver cannot restore CUDA state into a copy under another PID
    # (CUDA_ERROR_NOT_INITIALIZED), so a GPU checkpoint is verified by fingerprint and bytes only,
    # reported "skipped" (never "verify_failed": that would alert on a good checkpoint).
    from ckptflow.demo.launch import http_json, session_digests
    from ckptflow.runners.node import NodeRunner
    from ckptflow.runners.verify import verify_checkpoint
    from ckptflow.store.local import LocalStore

    w, port = gpu_worker
    base = f"http://127.0.0.1:{port}"
    http_json(f"{base}/v1/completions", {"prompt": "a session to verify " * 40, "max_tokens": 16, "session_id": "s"})
    node = NodeRunner(LocalStore(tmp_path / "store"))
    m = node.checkpoint(w)
    res = verify_checkpoint(node, w, m)
    assert res.state == "skipped" and "restore in place" in res.reason and "checksum" in res.timings
    assert session_digests(port) == m.probe.sessions            # the original serves on, untouched
    pages = max(node.store.images_dir(m).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 8)
    assert verify_checkpoint(node, w, m).state == "verify_failed"    # bad bytes still fail it
