"""GPU demo worker (torch): a small transformer from a config, a KV cache per session,
a captured CUDA graph for decode, and the same HTTP API and vLLM metrics as the CPU worker.

Run:  python -m ckptflow.demo.gpu_worker --port 18001 --pid-file /tmp/g.pid --ballast-gib 8

Needs torch (the optional ``ckptflow[gpu]`` extra on GPU nodes); ``--device cpu`` runs the
same code without a graph, for debugging. The ballast stands in for weights and KV blocks so
the GPU footprint can be set (8, 20, 50 GiB in bench/gpu_checkpoint.py).

Extra endpoints:
    POST /v1/ckptflow/prepare  release cached-but-free allocator memory before a checkpoint
                               (the workload's ``prepare_url``).
    POST /v1/peek   {"session_id", "prompt", "max_tokens"}: the tokens a completion *would*
                    produce, computed on a scratch copy of the session's KV (state unchanged).
                    Taken before a checkpoint, it is the uninterrupted reference.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch

from ckptflow.engines.gpuhash import state_sha256
from ckptflow.demo.model import encode
from ckptflow.engines.engine_side import EngineSide, ExportRequest, SessionState
from ckptflow.demo.worker import Metrics, base_args, completion_response, parse_completion, serve

SESSION_CHUNK = 8 << 20     # per-chunk digests of 20 GiB take 16 ms on the H200 (notes/gpu.md)
WEIGHT_CHUNK = 64 << 20
IO_THREADS = 8              # file <-> host copies and hashing in parallel (8 threads: 23 GiB/s measured)


class GpuModel:
    def __init__(self, device: str, seed: int, vocab: int = 256, d: int = 512, heads: int = 8, layers: int = 4,
                 max_len: int = 4096, max_sessions: int = 16):
        self.dev = torch.device(device)
        self.vocab, self.d, self.h, self.L, self.T, self.S = vocab, d, heads, layers, max_len, max_sessions
        self.dh = d // heads
        g = torch.Generator(device="cpu").manual_seed(seed)

        def w(*shape, s=1.0):
            return (torch.randn(*shape, generator=g) * s).to(self.dev)

        s = d ** -0.5
        self.emb, self.pos = w(vocab, d), w(max_len, d, s=0.1)
        self.wqkv = [w(d, 3 * d, s=s) for _ in range(layers)]
        self.wo = [w(d, d, s=s) for _ in range(layers)]
        self.w1 = [w(d, 4 * d, s=s) for _ in range(layers)]
        self.w2 = [w(4 * d, d, s=s / 2) for _ in range(layers)]
        self.out = w(d, vocab, s=s)
        # KV pool: one slot per session; the last slot is the scratch slot of /v1/peek.
        self.k = torch.zeros(layers, max_sessions, heads, max_len, self.dh, device=self.dev)
        self.v = torch.zeros_like(self.k)
        self.tok = torch.zeros(1, dtype=torch.long, device=self.dev)
        self.posi = torch.zeros(1, dtype=torch.long, device=self.dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=self.dev)
        self.ar = torch.arange(max_len, device=self.dev)
        self.logits = torch.zeros(vocab, device=self.dev)
        self.graph = None
        if self.dev.type == "cuda":
            self._capture()

    @staticmethod
    def _norm(x):
        return torch.nn.functional.layer_norm(x, x.shape[-1:])

    def _decode_step(self) -> None:
        """One token for one slot; static shapes and device-side indices, so it can be a graph."""
        x = self.emb[self.tok] + self.pos[self.posi]                    # (1, d)
        for l in range(self.L):
            q, k, v = (self._norm(x) @ self.wqkv[l]).view(1, 3, self.h, self.dh).unbind(1)
            self.k[l][self.slot, :, self.posi, :] = k
            self.v[l][self.slot, :, self.posi, :] = v
            K = self.k[l].index_select(0, self.slot)[0]                 # (h, T, dh)
            V = self.v[l].index_select(0, self.slot)[0]
            att = (q[0].unsqueeze(1) @ K.transpose(1, 2)) * self.dh ** -0.5   # (h, 1, T)
            att = att.masked_fill((self.ar > self.posi).view(1, 1, -1), float("-inf")).softmax(-1)
            x = x + (att @ V).reshape(1, self.d) @ self.wo[l]
            x = x + torch.relu(self._norm(x) @ self.w1[l]) @ self.w2[l]
        self.logits.copy_((self._norm(x) @ self.out)[0])

    def _capture(self) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                self._decode_step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._decode_step()
        self.k.zero_()
        self.v.zero_()

    def prefill(self, slot: int, start: int, toks: list[int]) -> torch.Tensor:
        n = len(toks)
        t = torch.tensor(toks, device=self.dev)
        x = self.emb[t] + self.pos[start:start + n]
        mask = torch.arange(start + n, device=self.dev)[None, :] > (start + torch.arange(n, device=self.dev))[:, None]
        for l in range(self.L):
            q, k, v = (self._norm(x) @ self.wqkv[l]).view(n, 3, self.h, self.dh).unbind(1)
            self.k[l, slot, :, start:start + n] = k.transpose(0, 1)
            self.v[l, slot, :, start:start + n] = v.transpose(0, 1)
            K, V = self.k[l, slot, :, :start + n], self.v[l, slot, :, :start + n]
            att = (q.transpose(0, 1) @ K.transpose(1, 2)) * self.dh ** -0.5
            att = att.masked_fill(mask[None], float("-inf")).softmax(-1)
            x = x + (att @ V).transpose(0, 1).reshape(n, self.d) @ self.wo[l]
            x = x + torch.relu(self._norm(x) @ self.w1[l]) @ self.w2[l]
        return (self._norm(x[-1:]) @ self.out)[0]

    def decode(self, slot: int, pos: int, tok: int) -> torch.Tensor:
        self.tok.fill_(tok)
        self.posi.fill_(pos)
        self.slot.fill_(slot)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._decode_step()
        return self.logits

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class GpuWorker(EngineSide):
    ENGINE = "ckptflow-demo-gpu"
    SESSION_CHUNK, WEIGHT_CHUNK, IO_THREADS = SESSION_CHUNK, WEIGHT_CHUNK, IO_THREADS
    POST_ROUTES = {"/v1/peek": "peek", "/v1/ckptflow/prepare": "prepare"}

    def __init__(self, device: str, seed: int, ballast_gib: float, model_name: str):
        self.model = GpuModel(device, seed)
        self.model_name = model_name
        self.metrics = Metrics(model_name)
        self.sessions: dict[str, dict] = {}     # id -> {"slot", "len", "last"}
        n = int(ballast_gib * 2**30) // 8
        self.ballast = torch.arange(n, dtype=torch.int64, device=self.model.dev)
        self.ballast.mul_(0x9E3779B97F4A7C15 - 2**64).bitwise_xor_(seed)
        self.seed, self.ballast_bytes = seed, int(self.ballast.numel() * 8)
        self.parked_with: dict | None = None
        if self.model.dev.type == "cuda":
            torch.cuda.synchronize()

    def _session(self, sid: str) -> dict:
        if sid not in self.sessions:
            if len(self.sessions) >= self.model.S - 1:
                raise ValueError(f"at most {self.model.S - 1} sessions")
            self.sessions[sid] = {"slot": len(self.sessions), "len": 0, "last": None}
        return self.sessions[sid]

    def _generate(self, slot: int, start: int, last, prompt: list[int], n: int) -> tuple[list[int], int, int]:
        m = self.model
        pos = start
        logits = None
        if prompt:
            logits = m.prefill(slot, pos, prompt)
            pos += len(prompt)
        out = []
        for _ in range(n):
            if logits is None:
                logits = m.decode(slot, pos, 0 if last is None else last)
                pos += 1
            tok = int(torch.argmax(logits))
            out.append(tok)
            logits = m.decode(slot, pos, tok)
            pos += 1
        return out, pos, (out[-1] if out else last)

    @property
    def parked(self) -> bool:
        """Weights released for a template checkpoint (template/prepare), not yet back."""
        return self.ballast is None

    def complete(self, body: dict) -> dict:
        prompt, max_tokens, sid = parse_completion(body)
        self.check_lost(sid)
        if self.parked:
            raise ValueError("engine is parked for a template checkpoint (weights released); retry shortly")
        t0 = time.perf_counter()
        toks_in = encode(prompt)
        if sid is None:
            scratch = self.model.S - 1
            toks, _, _ = self._generate(scratch, 0, None, toks_in, max_tokens)
        else:
            s = self._session(sid)
            if s["len"] + len(toks_in) + max_tokens + 1 > self.model.T:
                raise ValueError(f"session {sid} would exceed {self.model.T} tokens")
            toks, s["len"], s["last"] = self._generate(s["slot"], s["len"], s["last"], toks_in, max_tokens)
        self.metrics.observe(len(toks_in), len(toks), time.perf_counter() - t0,
                             sum(s["len"] for s in self.sessions.values()), self.model.T * (self.model.S - 1),
                             len(self.sessions))
        return completion_response(self.model_name, sid, toks, len(toks_in))

    def peek(self, body: dict) -> dict:
        prompt, max_tokens, sid = parse_completion(body)
        s = self.sessions.get(sid)
        if s is None:
            raise ValueError(f"no session {sid}")
        scratch = self.model.S - 1
        self.model.copy_slot(s["slot"], scratch, s["len"])
        toks, _, _ = self._generate(scratch, s["len"], s["last"], encode(prompt), max_tokens)
        return {"session_id": sid, "tokens": toks}

    def prepare(self, body: dict) -> dict:
        """Before a checkpoint: hand cached-but-free allocator blocks back to the driver, so the
        CUDA checkpoint copies (and CRIU dumps) only memory in use."""
        if self.model.dev.type != "cuda":
            return {"released_bytes": 0}
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        return {"released_bytes": int(before - torch.cuda.memory_reserved()),
                "reserved_bytes": int(torch.cuda.memory_reserved())}

    def session_lengths(self) -> dict[str, int]:
        return {k: s["len"] for k, s in self.sessions.items()}

    def session_digests(self) -> dict[str, str]:
        m = self.model
        out = {}
        for k, s in self.sessions.items():
            kv = torch.stack([m.k[:, s["slot"], :, :s["len"]], m.v[:, s["slot"], :, :s["len"]]])
            out[k] = state_sha256(kv) + f":{s['len']}:{s['last']}"
        return out

    def ballast_digest(self) -> dict:
        if self.ballast is None:
            raise ValueError("engine is parked for a template checkpoint (weights released)")
        return {"digest": state_sha256(self.ballast), "bytes": int(self.ballast.numel() * 8)}

    # --- two-tier protocol (docs/engines/protocol.md; the shared part is engines/engine_side.py) -------
    # The ballast stands in for the weights: the large static tensor that leaves the image. The
    # model's own small tensors and the KV pool stay resident, so the captured decode graph
    # keeps its addresses; the pool is zeroed in the template (no session bytes in a template
    # shared between workloads).
    def template_key(self) -> str:
        m = self.model
        return hashlib.sha256(json.dumps([m.vocab, m.d, m.h, m.L, m.T, m.S, self.seed, self.model_name,
                                          self.ballast_bytes]).encode()).hexdigest()[:16]

    def _kv(self, s: dict) -> list[tuple[str, torch.Tensor]]:
        m = self.model
        # token-major (len, L, H, dh): a session that grew changes only its last chunks
        return [(n, t[:, s["slot"], :, :s["len"]].permute(2, 0, 1, 3).contiguous()) for n, t in (("k", m.k), ("v", m.v))]

    def session_state(self, req: ExportRequest) -> tuple[dict[str, SessionState], float]:
        chosen = {sid: s for sid, s in self.sessions.items() if req.wants(sid)}
        digests = {sid: d for sid, d in self.session_digests().items() if sid in chosen}
        t0 = time.perf_counter()
        host = {sid: [(n, t.cpu()) for n, t in self._kv(s)] for sid, s in chosen.items()}  # the hold
        held = time.perf_counter() - t0
        return ({sid: ({"tokens": s["len"], "digest": digests[sid], "last": s["last"], "slot": s["slot"]},
                       [(n, t.numpy()) for n, t in host[sid]]) for sid, s in chosen.items()}, held)

    def adopt_sessions(self, staged: dict) -> dict[str, str]:
        m = self.model
        for sid, (t, rec) in staged.items():
            slot, n = rec["slot"], rec["tokens"]
            for name, pool in (("k", m.k), ("v", m.v)):
                pool[:, slot, :, :n] = torch.from_numpy(t[name]).to(m.dev).permute(1, 2, 0, 3)
            self.sessions[sid] = {"slot": slot, "len": n, "last": rec["last"]}
        torch.cuda.synchronize()
        return {k: v for k, v in self.session_digests().items() if k in staged}

    def weight_arrays(self) -> dict:
        if self.ballast is not None and self.ballast.numel():
            return {"weights": self.ballast.cpu().numpy()}
        return {}

    def release_weights(self) -> None:
        self.ballast = None
        self.sessions.clear()
        self.model.k.zero_()
        self.model.v.zero_()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the CUDA checkpoint then copies only what is in use

    def adopt_weights(self, weights: dict) -> None:
        host = weights.get("weights")
        self.ballast = (torch.from_numpy(host).to(self.model.dev) if host is not None
                        else torch.zeros(0, dtype=torch.int64, device=self.model.dev))
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--ballast-gib", type=float, default=0.0)
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    w = GpuWorker(a.device, a.seed, a.ballast_gib, a.model_name)
    serve(w, a)


if __name__ == "__main__":
    main()
