"""ckptflow's vLLM KV connector: a session's completed KV blocks in a chunk directory, by prefix.

Loaded by vLLM itself (it runs inside the engine, so it imports only vLLM, torch, safetensors
and the standard library)::

    python -m vllm.entrypoints.openai.api_server ... --enable-prefix-caching \\
      --kv-transfer-config '{"kv_connector": "CkptflowConnector",
                             "kv_connector_module_path": "ckptflow.engines.vllm_connector",
                             "kv_role": "kv_both",
                             "kv_connector_extra_config": {"chunk_dir": "/var/lib/ckptflow/kv/chat-a"}}'

What it does, on vLLM's v1 connector interface (vllm/distributed/kv_transfer/kv_connector/v1/
base.py; shaped like vLLM's ExampleConnector, block-wise instead of per prompt):
- Every *full* block of a request (prompt and generated tokens alike) is written once, as
  ``blocks/<key>.safetensors`` with that block of every layer, where ``key`` chains the sha256
  of the previous block's key and this block's token ids: a key names a whole prefix, so two
  sessions sharing a system prompt share its blocks, and a block already on disk is skipped
  (only new blocks move).
- A request that carries ``kv_transfer_params: {"ckptflow_session": NAME}`` leaves
  ``sessions/NAME.json`` (its block keys and token count) when it finishes: what ckptflow
  exports into its store (engines/vllm.py, ``save_sessions``).
- A new request whose prompt starts with blocks found on disk is told to vLLM's scheduler as
  an external prefix-cache hit beyond what the engine's own cache holds; those blocks are
  loaded into the paged KV buffer before the forward pass. So a fresh engine (or one restored
  from a template) continues a session without prefilling it again, and
  ``vllm:external_prefix_cache_hits_total`` counts the tokens it did not recompute.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

from ckptflow.engines.vllm_layout import BLOCKS, SESSION_PARAM, SESSIONS, safe_name as _safe  # noqa: E402


def block_keys(token_ids: list[int], block_size: int, salt: str, n_blocks: int | None = None) -> list[str]:
    """The chained key of each full block of ``token_ids`` (the first ``n_blocks`` of them)."""
    full = len(token_ids) // block_size if n_blocks is None else min(n_blocks, len(token_ids) // block_size)
    keys, prev = [], hashlib.sha256(salt.encode()).digest()
    for b in range(full):
        ids = token_ids[b * block_size:(b + 1) * block_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(ids)}q", *ids)).digest()
        keys.append(prev.hex())
    return keys


@dataclass
class _Load:
    keys: list[str]
    block_ids: list[int]


@dataclass
class CkptflowConnectorMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    stores: list[tuple[str, int]] = field(default_factory=list)   # (key, block id)


@dataclass
class _Tracked:
    request: Any
    keys: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0                  # leading blocks known to be on disk
    load: tuple[int, int] | None = None


class CkptflowConnector(KVConnectorBase_V1):
    """Sessions' KV blocks to and from ``chunk_dir`` (``kv_connector_extra_config``)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        try:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        except TypeError:  # vLLM <= 0.26 passes no kv_cache_config
            super().__init__(vllm_config=vllm_config, role=role)
        self._block_size = vllm_config.cache_config.block_size
        cfg = vllm_config.kv_transfer_config
        self._dir = Path(cfg.get_from_extra_config("chunk_dir", "/tmp/ckptflow-kv"))
        (self._dir / BLOCKS).mkdir(parents=True, exist_ok=True, mode=0o700)
        (self._dir / SESSIONS).mkdir(parents=True, exist_ok=True, mode=0o700)
        m = vllm_config.model_config
        # Blocks of another model, dtype or block size never match, even in a shared directory.
        self._salt = f"{m.model}|{m.dtype}|{self._block_size}"
        self._reqs: dict[str, _Tracked] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    # --- scheduler side --------------------------------------------------------------------
    def _exists(self, key: str) -> bool:
        return (self._dir / BLOCKS / f"{key}.safetensors").exists()

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        prompt = list(request.prompt_token_ids or [])
        # The last prompt token is always computed: its logits start the generation.
        keys = block_keys(prompt[:-1], self._block_size, self._salt)
        n = 0
        while n < len(keys) and self._exists(keys[n]):
            n += 1
        t = _Tracked(request=request, keys=keys[:n], stored=n)
        first = num_computed_tokens // self._block_size
        if n > first:
            t.load = (first, n)
        self._reqs[request.request_id] = t
        return max(0, n * self._block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        t = self._reqs.get(request.request_id)
        if t is not None and num_external_tokens == 0:
            t.load = None

    def _add_stores(self, t: _Tracked, done_tokens: int, meta: CkptflowConnectorMetadata) -> None:
        tokens = list(t.request.all_token_ids)
        full = min(done_tokens, len(tokens)) // self._block_size
        if full <= t.stored:
            return
        if len(t.keys) < full:
            t.keys = block_keys(tokens, self._block_size, self._salt, full)
        for b in range(t.stored, min(full, len(t.block_ids))):
            if not self._exists(t.keys[b]):
                meta.stores.append((t.keys[b], t.block_ids[b]))
        t.stored = min(full, len(t.block_ids))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = CkptflowConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            t = self._reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0])
            if t.load is not None:
                a, b = t.load
                meta.loads.append(_Load(keys=t.keys[a:b], block_ids=t.block_ids[a:b]))
                t.load = None
            self._add_stores(t, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._reqs.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in getattr(cached, "resumed_req_ids", ()):  # preempted: blocks replaced
                t.block_ids = list(new_ids[0]) if new_ids else []
                t.stored = min(t.stored, len(t.block_ids))
            elif new_ids is not None:
                t.block_ids += list(new_ids[0])
            self._add_stores(t, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id], meta)
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        t = self._reqs.pop(request.request_id, None)
        name = (request.kv_transfer_params or {}).get(SESSION_PARAM) if t is not None else None
        if name:
            # The blocks of every earlier step were written by the worker before this step's
            # output reached the scheduler, so every key listed here is on disk.
            keys = t.keys[:t.stored]
            doc = {"session": name, "block_size": self._block_size, "tokens": len(keys) * self._block_size,
                   "blocks": keys}
            path = self._dir / SESSIONS / f"{_safe(name)}.json"
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)
        return False, None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Full CUDA graphs replay attention without calling save_kv_layer: blocks completed by
        # decode steps would be listed in a session but never written (vLLM 0.26 on the H200).
        return True

    # --- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._kv_caches = dict(kv_caches)

    def _layers(self, forward_context: "ForwardContext") -> dict[str, torch.Tensor]:
        out = {}
        for name, layer in forward_context.no_compile_layers.items():
            kv = getattr(layer, "kv_cache", None)
            if kv is None:
                continue
            if isinstance(kv, (list, tuple)):  # vLLM <= 0.26: one per virtual engine
                kv = kv[getattr(forward_context, "virtual_engine", 0)]
            out[name] = kv
        return out

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, CkptflowConnectorMetadata) or not meta.loads:
            return
        layers = self._layers(forward_context) or self._kv_caches
        for load in meta.loads:
            for key, block in zip(load.keys, load.block_ids):
                saved = load_file(str(self._dir / BLOCKS / f"{key}.safetensors"))
                for name, kv in layers.items():
                    _block_view(kv, block).copy_(saved[name].to(kv.device))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, CkptflowConnectorMetadata):
            return
        for key, block in meta.stores:
            # contiguous: a K/V-first block view keeps its strides through the copy, and
            # safetensors refuses those (measured on the H200 with FlashAttention's layout).
            self._pending.setdefault(key, {})[layer_name] = _block_view(kv_layer, block).detach().to("cpu").contiguous()

    def wait_for_save(self):
        for key, layers in self._pending.items():
            path = self._dir / BLOCKS / f"{key}.safetensors"
            if path.exists():
                continue
            tmp = path.with_name(f".{key}.{os.getpid()}.tmp")
            save_file(layers, str(tmp))
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)  # a block on disk is always whole
        self._pending.clear()


def _block_view(kv: torch.Tensor, block: int) -> torch.Tensor:
    """One block of a layer's paged KV buffer, whatever the backend's layout: blocks first
    ([B, ...], vLLM's standardised view), or K/V first ([2, B, ...], FlashAttention's)."""
    if kv.dim() >= 5 and kv.shape[0] == 2:
        return kv[:, block]
    return kv[block]


