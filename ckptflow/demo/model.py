"""A tiny deterministic transformer (numpy, CPU) with a KV cache per session.

Weights come from a seed, tokens are bytes (vocabulary 256), sampling uses a per-session
RNG seeded from the session id. Everything that decides the next token lives in process
memory (KV cache, RNG state, token history), so a restored worker continues a session
token for token exactly like an uninterrupted one, and any lost or corrupted page shows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    d_model: int = 96
    n_heads: int = 4
    n_layers: int = 2
    max_len: int = 8192
    seed: int = 1234
    temperature: float = 0.8


@dataclass
class Session:
    id: str
    tokens: list[int] = field(default_factory=list)
    # Per layer: K and V as (n_heads, len, d_head) grown in place.
    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)
    rng: np.random.Generator | None = None

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(np.asarray(self.tokens, dtype=np.int32).tobytes())
        for a in (*self.k, *self.v):
            h.update(np.ascontiguousarray(a).tobytes())
        if self.rng is not None:
            h.update(repr(self.rng.bit_generator.state).encode())
        return h.hexdigest()


class TinyTransformer:
    """Pre-norm decoder; float64 so results do not depend on BLAS summation order."""

    def __init__(self, cfg: ModelConfig = ModelConfig()):
        self.cfg = cfg
        r = np.random.default_rng(cfg.seed)
        d, V = cfg.d_model, cfg.vocab
        s = 1.0 / np.sqrt(d)
        self.emb = r.normal(0, 1.0, (V, d))
        self.pos = r.normal(0, 0.1, (cfg.max_len, d))
        self.layers = []
        for _ in range(cfg.n_layers):
            self.layers.append({
                "wq": r.normal(0, s, (d, d)), "wk": r.normal(0, s, (d, d)),
                "wv": r.normal(0, s, (d, d)), "wo": r.normal(0, s, (d, d)),
                "w1": r.normal(0, s, (d, 4 * d)), "w2": r.normal(0, s / 2, (4 * d, d)),
            })
        self.out = r.normal(0, s, (d, V))

    def new_session(self, sid: str) -> Session:
        seed = int.from_bytes(hashlib.sha256(sid.encode()).digest()[:8], "little")
        H, dh = self.cfg.n_heads, self.cfg.d_model // self.cfg.n_heads
        return Session(id=sid,
                       k=[np.zeros((H, 0, dh)) for _ in self.layers],
                       v=[np.zeros((H, 0, dh)) for _ in self.layers],
                       rng=np.random.default_rng(seed))

    @staticmethod
    def _norm(x: np.ndarray) -> np.ndarray:
        return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)

    def _forward(self, s: Session, toks: list[int]) -> np.ndarray:
        """Run ``toks`` through the model, appending to the session's KV cache.

        Returns the logits of the last position.
        """
        cfg = self.cfg
        H, dh = cfg.n_heads, cfg.d_model // cfg.n_heads
        start = len(s.tokens)
        if start + len(toks) > cfg.max_len:
            raise ValueError(f"session {s.id} would exceed max_len {cfg.max_len}")
        n = len(toks)
        x = self.emb[toks] + self.pos[start:start + n]
        for i, L in enumerate(self.layers):
            h = self._norm(x)
            q = (h @ L["wq"]).reshape(n, H, dh).transpose(1, 0, 2)
            k = (h @ L["wk"]).reshape(n, H, dh).transpose(1, 0, 2)
            v = (h @ L["wv"]).reshape(n, H, dh).transpose(1, 0, 2)
            s.k[i] = np.concatenate([s.k[i], k], axis=1)
            s.v[i] = np.concatenate([s.v[i], v], axis=1)
            att = q @ s.k[i].transpose(0, 2, 1) / np.sqrt(dh)
            total = start + n
            mask = np.arange(total)[None, :] > (start + np.arange(n))[:, None]
            att = np.where(mask[None], -np.inf, att)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = (att @ s.v[i]).transpose(1, 0, 2).reshape(n, cfg.d_model)
            x = x + o @ L["wo"]
            x = x + np.maximum(self._norm(x) @ L["w1"], 0) @ L["w2"]
        s.tokens.extend(toks)
        return self._norm(x[-1]) @ self.out

    def generate(self, s: Session, prompt: list[int], max_tokens: int) -> list[int]:
        """Prefill ``prompt`` into the session, then sample ``max_tokens`` new tokens."""
        logits = self._forward(s, prompt) if prompt else None
        out: list[int] = []
        for _ in range(max_tokens):
            if logits is None:
                logits = self._forward(s, [0])
            p = np.exp((logits - logits.max()) / self.cfg.temperature)
            p /= p.sum()
            tok = int(s.rng.choice(self.cfg.vocab, p=p))
            out.append(tok)
            logits = self._forward(s, [tok])
        return out


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")
