"""A deterministic random-weight llama model in GGUF, for llama-server tests and benches.

No weights are ever downloaded: the tensors are seeded random numbers, the vocabulary is the
one llama.cpp's own tree ships for its tokenizer tests (``models/ggml-vocab-llama-spm.gguf``,
32,000 SentencePiece tokens), and the file is written with the tree's ``gguf-py``. The same
seed and size give the same bytes, so two servers (or one before and after a checkpoint)
serve the same model, and at temperature 0 the same tokens.

    python -m ckptflow.engines.llamacpp_model model.gguf                 # tiny: ~79 MB, f32
    python -m ckptflow.engines.llamacpp_model model-3b.gguf --size 3b    # ~6 GB, f16 (GPU runs)

Example:
    >>> spec = build_model(Path("m.gguf"), seed=1234)          # doctest: +SKIP
    >>> spec.revision
    'seed-1234-...'
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

# Each size is a llama shape (head dim 32..128, GQA 2:1..4:1). tiny runs in CI on 2 cores;
# the larger ones are for the H200, where the GPU path should move GiBs, not MBs.
SIZES: dict[str, dict] = {
    "tiny": dict(dim=256, layers=4, heads=8, kv_heads=4, ff=1024, dtype="f32"),     # 79 MB
    "1b": dict(dim=2048, layers=16, heads=32, kv_heads=8, ff=5632, dtype="f16"),    # 2.2 GiB
    "3b": dict(dim=3072, layers=28, heads=24, kv_heads=8, ff=8192, dtype="f16"),    # 5.6 GiB
    "8b": dict(dim=4096, layers=32, heads=32, kv_heads=8, ff=14336, dtype="f16"),   # 13.5 GiB
}
BUILDER_VERSION = 1  # bump when the bytes for a given (seed, shape) change


class ModelSpec(BaseModel):
    """The shape and seed of one generated model; its ``revision`` names the bytes."""

    seed: int = Field(1234, ge=0, description="Seed of every tensor.", examples=[1234])
    dim: int = Field(256, gt=0, description="Embedding width (llama.embedding_length).")
    layers: int = Field(4, gt=0, description="Transformer blocks.")
    heads: int = Field(8, gt=0, description="Attention heads.")
    kv_heads: int = Field(4, gt=0, description="Key/value heads (grouped-query attention).")
    ff: int = Field(1024, gt=0, description="Feed-forward width.")
    ctx: int = Field(4096, gt=0, description="Trained context length written into the file.")
    dtype: Literal["f32", "f16"] = Field("f32", description="Storage type of the 2-D tensors.")
    vocab_size: int = Field(32000, gt=0, description="Taken from the vocabulary file.")

    @property
    def revision(self) -> str:
        """What a fingerprint records as the model revision: same string, same bytes."""
        shape = f"v{BUILDER_VERSION}:{self.dim}:{self.layers}:{self.heads}:{self.kv_heads}:{self.ff}:" \
                f"{self.ctx}:{self.dtype}:{self.vocab_size}"
        return f"seed-{self.seed}-{hashlib.sha256(shape.encode()).hexdigest()[:12]}"

    @property
    def model_id(self) -> str:
        return f"ckptflow-random-llama-{self.dim}x{self.layers}"

    def tensors(self) -> list[tuple[str, tuple[int, ...], float]]:
        """(name, numpy shape, std) in file order. numpy shapes are ggml's ne reversed."""
        hd = self.dim // self.heads
        out: list[tuple[str, tuple[int, ...], float]] = [
            ("token_embd.weight", (self.vocab_size, self.dim), 1.0)]
        for i in range(self.layers):
            b = f"blk.{i}"
            out += [(f"{b}.attn_norm.weight", (self.dim,), 0.0),
                    (f"{b}.attn_q.weight", (self.heads * hd, self.dim), self.dim ** -0.5),
                    (f"{b}.attn_k.weight", (self.kv_heads * hd, self.dim), self.dim ** -0.5),
                    (f"{b}.attn_v.weight", (self.kv_heads * hd, self.dim), self.dim ** -0.5),
                    (f"{b}.attn_output.weight", (self.dim, self.heads * hd), self.dim ** -0.5),
                    (f"{b}.ffn_norm.weight", (self.dim,), 0.0),
                    (f"{b}.ffn_gate.weight", (self.ff, self.dim), self.dim ** -0.5),
                    (f"{b}.ffn_up.weight", (self.ff, self.dim), self.dim ** -0.5),
                    (f"{b}.ffn_down.weight", (self.dim, self.ff), self.ff ** -0.5)]
        out += [("output_norm.weight", (self.dim,), 0.0),
                ("output.weight", (self.vocab_size, self.dim), self.dim ** -0.5)]
        return out


def import_gguf(gguf_py: Path | None = None):
    """The llama.cpp tree's own gguf-py (installed beside llama-server by the install script)."""
    if gguf_py is None:
        from ckptflow.engines.llamacpp import require_install

        gguf_py = require_install().gguf_py
    if str(gguf_py) not in sys.path:
        sys.path.insert(0, str(gguf_py))
    import gguf  # noqa: PLC0415 - only importable once the path is known

    return gguf


def _tensor(spec: ModelSpec, index: int, shape: tuple[int, ...], std: float):
    import numpy as np

    if std == 0.0:  # RMS-norm gains: 1, as a trained model's start
        return np.ones(shape, dtype=np.float32)
    # One generator per tensor, seeded by (seed, index): any tensor can be made alone, in any order.
    rng = np.random.default_rng([spec.seed, index])
    out = np.empty(shape, dtype=np.float16 if (spec.dtype == "f16" and len(shape) > 1) else np.float32)
    flat = out.reshape(-1)
    step = 1 << 24  # bounded float32 scratch, so an 8b model does not need 2x its size in RAM
    for i in range(0, flat.size, step):
        n = min(step, flat.size - i)
        flat[i:i + n] = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
    return out


def build_model(out: Path, spec: ModelSpec | None = None, *, seed: int | None = None, size: str = "tiny",
                vocab: Path | None = None, gguf_py: Path | None = None) -> ModelSpec:
    """Write the model to ``out`` (temp file, then rename) and return its spec.

    Raises:
        RunnerUnavailable: llama.cpp is not installed (no gguf-py, no vocabulary).
    """
    gguf = import_gguf(gguf_py)
    if vocab is None:
        from ckptflow.engines.llamacpp import require_install

        vocab = require_install().vocab
    if spec is None:
        spec = ModelSpec(**SIZES[size], **({"seed": seed} if seed is not None else {}))
    reader = gguf.GGUFReader(vocab)
    tok = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    spec = spec.model_copy(update={"vocab_size": len(tok["tokenizer.ggml.tokens"].data)})

    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    try:
        w.add_name(spec.model_id)
        w.add_context_length(spec.ctx)
        w.add_embedding_length(spec.dim)
        w.add_block_count(spec.layers)
        w.add_feed_forward_length(spec.ff)
        w.add_head_count(spec.heads)
        w.add_head_count_kv(spec.kv_heads)
        w.add_rope_dimension_count(spec.dim // spec.heads)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(spec.vocab_size)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if spec.dtype == "f16" else gguf.LlamaFileType.ALL_F32)
        for key, field in tok.items():  # the tokenizer exactly as the tree ships it
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
            else:
                w.add_key_value(key, field.contents(), vtype)
        import numpy as np

        tensors = spec.tensors()
        for name, shape, std in tensors:
            dt = np.float16 if (spec.dtype == "f16" and len(shape) > 1) else np.float32
            w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (_, shape, std) in enumerate(tensors):
            w.write_tensor_data(_tensor(spec, i, shape, std))
        w.close()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return spec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckptflow.engines.llamacpp_model",
                                 description="Write a deterministic random-weight llama GGUF.")
    ap.add_argument("out", type=Path, help="output .gguf path")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="tiny (~79 MB, CI) or a GPU size: 1b ~2.2 GiB, 3b ~5.6 GiB, 8b ~13.5 GiB")
    ap.add_argument("--gguf-py", type=Path, help="llama.cpp's gguf-py (default: the installed tree's)")
    ap.add_argument("--vocab", type=Path, help="vocabulary GGUF (default: the tree's ggml-vocab-llama-spm.gguf)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    spec = build_model(a.out, seed=a.seed, size=a.size, vocab=a.vocab, gguf_py=a.gguf_py)
    print(f"{a.out}: {spec.model_id} revision {spec.revision}, {a.out.stat().st_size / 2**20:.0f} MiB "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
