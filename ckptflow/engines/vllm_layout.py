"""Where ckptflow's vLLM connector keeps its files: shared by the connector (imported by vLLM in
its own environment) and ckptflow's side (engines/vllm.py). Standard library only.

    <chunk_dir>/blocks/<key>.safetensors     one full KV block of every layer, key = chained sha256
    <chunk_dir>/sessions/<name>.json         {"session", "block_size", "tokens", "blocks": [keys]}
"""

from __future__ import annotations

SESSION_PARAM = "ckptflow_session"   # kv_transfer_params key naming a request's session
BLOCKS = "blocks"
SESSIONS = "sessions"


def safe_name(name: str) -> str:
    """A session name as a file name: no path separators, bounded length."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:200]
