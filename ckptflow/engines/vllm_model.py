"""A seeded random Llama for vLLM, written with ``transformers`` (no weights are downloaded).

Runs inside the vLLM virtualenv (it needs torch + transformers, not ckptflow)::

    .ckptflow/vllm/<version>/bin/python ckptflow/engines/vllm_model.py OUT_DIR --seed 1234

Prints one JSON line: ``{"path", "model_id", "revision", "vocab_size"}``; the revision is the
sha256 of the safetensors file, so two runs with one seed give one revision.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

# The shape tried on 2 cores: serves in well under a minute, sessions of ~2,000 tokens.
SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def build(out: Path, seed: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**SHAPE, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # a half-written model is never served
    h = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        h.update(f.read_bytes())
    return {"path": str(out), "model_id": f"ckptflow/random-llama-{seed}", "revision": h.hexdigest()[:16],
            "vocab_size": SHAPE["vocab_size"]}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args()
    print(json.dumps(build(a.out, a.seed)))
