"""SGLang's HTTP server as a ckptflow workload: how it is launched, its health, its real metric
names, a greedy token-id golden request, and what CRIU needs for its process tree.

Measured with SGLang 0.5.17 on the H200 (bench/sglang_gpu.py, docs/engines/sglang.md): the whole
tree checkpointed and restored through NodeRunner, and the next 32 tokens of a 4,080-token session
equal to the engine's before the kill, 4,079 of them served from the restored radix cache. SGLang
does not serve on CPU from registry packages (its CPU kernels are a source build), so CI tests
this module on the answers recorded from that run (tests/data/sglang/).

A fleet file declares it like this (``engine: sglang`` turns on the CRIU options its tree needs,
``SGLANG_CRIU`` in ckptflow.models):

    workloads:
      - name: chat-sglang
        node: gpu-node-01
        engine: sglang
        gpu: true
        traffic: long_sessions
        find: {pid_file: /run/ckptflow/chat-sglang.pid, cmdline_must_contain: sglang.launch_server}
        health_url: http://127.0.0.1:30000/health
        tcp_established: true
        golden: {url: http://127.0.0.1:30000/generate, field: output_ids,
                 body: {input_ids: [1, 17, 42, 99], sampling_params: {max_new_tokens: 8, temperature: 0}}}

What ckptflow relies on:
- The tree: the API server (tokenizer manager, uvloop), multiprocessing's resource tracker,
  ``sglang::scheduler`` (the GPU process: weights, KV pool, CUDA graphs) and ``sglang::detokenizer``,
  joined by ZMQ IPC sockets; torch.distributed's TCPStore connects the scheduler to itself over TCP
  (``tcp_established: true``). As for vLLM, ``kernel.io_uring_disabled=2`` before the engine starts
  (uvloop maps an io_uring ring otherwise) and its output goes to a file.
- ``POST /generate`` with ``input_ids`` and ``temperature: 0`` is deterministic; its
  ``meta_info.cached_tokens`` and ``/metrics``'s ``sglang:cached_tokens_total`` (with
  ``--enable-metrics``) show whether a session's prefix came from the radix cache.
- SGLang serves its control endpoints (``/release_memory_occupation``, ``/update_weights_from_disk``,
  ``/flush_cache``, ``/pause_generation``) on the serving port; start it with ``--admin-api-key``
  where inference clients reach that port, so they need a key they do not have.
"""

from __future__ import annotations

import json
from pathlib import Path

from ckptflow.engines.adapter import EngineAdapter, register
from ckptflow.models import GoldenRequest
from ckptflow.policies.load import metric_names

ENGINE = "sglang"
CMDLINE = "sglang.launch_server"
# The release measured on the H200: the newest one pinned to torch 2.11 (scripts/carry-sglang.sh).
VERSION = "0.5.17"
PLUGIN_DIST = "ckptflow"   # whose entry point (sglang.srt.plugins) SGLang loads: engines/sglang_protocol.py
KV_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


@register
class SglangAdapter(EngineAdapter):
    """SGLang's HTTP server: its metric names (read from a live 0.5.17 server), a token-id greedy
    golden request on its native ``/generate``. Its two-tier calls go to ckptflow's protocol, which
    SGLang serves when ckptflow's plugin is loaded (engines/sglang_protocol.py) and it runs with
    ``protocol_args``: sessions are HiCache's file pages, the template the engine with its memory
    released."""

    name = ENGINE
    summary = "SGLang's HTTP server: its metric names, a token-id golden request, the protocol through ckptflow's plugin"
    metrics = metric_names(ENGINE)
    protocol_missing_fix = (f"start SGLang with ckptflow's plugin ({PLUGIN_DIST} installed, or `python -m "
                            "ckptflow.engines.sglang_protocol --entry-point DIR` with DIR on its PYTHONPATH) and "
                            "engines/sglang.protocol_args's flags and environment (docs/engines/sglang.md); or use "
                            "checkpoint: process")

    def golden_request(self, base: str, **kw: object) -> GoldenRequest:
        return GoldenRequest(url=base.rstrip("/") + "/generate", field="output_ids", body=golden_body())


ADAPTER = SglangAdapter()


def golden_body(prompt: tuple[int, ...] = (1, 17, 42, 99), max_new_tokens: int = 8) -> dict:
    """Token ids in, token ids out, greedy: no tokenizer involved (``--skip-tokenizer-init``)."""
    return {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}


def server_args(model: str, port: int, *, python: str = "python3", mem_fraction: float = 0.2,
                context_length: int = 8192, served_name: str = "m") -> list[str]:
    """The command line measured on the H200. ``--attention-backend triton`` and ``--sampling-backend
    pytorch``: the FlashAttention-3 and flashinfer kernels are not carried to that machine
    (scripts/carry-sglang.sh); a node with them installed may drop both flags."""
    return [python, "-m", CMDLINE, "--model-path", model, "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16",
            "--context-length", str(context_length), "--random-seed", "0", "--mem-fraction-static", str(mem_fraction),
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--cuda-graph-max-bs-decode", "8",
            "--enable-metrics"]


def protocol_args(kv_dir: Path, *, page_size: int = 64, hicache_gib: int = 1) -> tuple[list[str], dict[str, str]]:
    """The flags and environment that make SGLang serve ckptflow's engine protocol through its
    plugin: HiCache written through to files in ``kv_dir`` (the sessions) and fetched back before a
    request runs, and the memory saver (the template releases weights, KV and graphs).
    ``hicache_gib``: HiCache's host pool, pinned memory the template's image carries whole (each
    GiB is ~0.9 s of the H200's CRIU restore); the sessions live in the files, so it need only
    hold the pages on their way to and from them.

        >>> flags, env = protocol_args(Path("/var/lib/ckptflow/kv/chat-s"))
        >>> env, flags[:2]
        ({'SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR': '/var/lib/ckptflow/kv/chat-s'}, ['--enable-memory-saver', '--page-size'])
    """
    flags = ["--enable-memory-saver", "--page-size", str(page_size), "--enable-hierarchical-cache",
             "--hicache-storage-backend", "file", "--hicache-size", str(hicache_gib),
             "--hicache-write-policy", "write_through", "--hicache-storage-prefetch-policy", "wait_complete",
             # HiCache fetches a prefix from file only from 256 tokens on by default: a session of a
             # page or more comes back from its pages.
             "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": page_size})]
    return flags, {KV_DIR_ENV: str(kv_dir)}
