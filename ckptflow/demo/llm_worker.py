"""A vLLM-shaped GPU engine for the two-tier bench: bf16 weights read from a safetensors file,
a paged KV pool taking a fraction of free GPU memory, CUDA graphs for several batch sizes,
sessions holding a few of the pool's blocks; it speaks protocol v1 (docs/engines/protocol.md).

Run (GPU node):
    python -m ckptflow.demo.llm_worker --weights /dev/shm/w.safetensors --write-weights --layers 43
    python -m ckptflow.demo.llm_worker --port 18001 --pid-file /tmp/e.pid \
        --weights /dev/shm/w.safetensors --kv-fraction 0.9

Shape (what matters for checkpoints, not for language): d_model 4096, 32 heads, ``--layers``
blocks of 12·d² bf16 parameters (43 layers = 16.1 GiB), vocabulary of bytes. KV blocks hold
16 tokens of every layer (11 MiB at 43 layers), so a block is one chunk of a session export and
full blocks never change. Weights and pool live in VMM ranges (ckptflow/engines/vmm.py): the
template releases both and maps them back at the same addresses, so the captured graphs replay.

Fast paths, all in this file: file -> GPU through reused pinned slots, one CUDA stream per
thread, every chunk's sha256 checked on the way (cold start reads the safetensors file the same
way, so the cold-start baseline is not a straw man); a template resume given the sessions too
streams weights and session blocks in one pass (one work list), then checks both on the GPU; a
session export copies only blocks whose on-GPU keyed hash (engines/gpuhash.py) changed into pinned
memory while holding the model (the pause), then a child process with no CUDA hashes and writes
them from that memory (engines/chunkwriter.py) while serving goes on (threaded server, one model
lock). A turn-boundary export (``"turn": true``) holds only the sessions it names (each session's
lock, which a completion holds for its whole turn) and copies on a side CUDA stream, one piece in
flight, while the other sessions decode.

Locks: a completion (and peek) takes its session's turn lock, then ``lock`` (the model: one
completion at a time); an export, import, resume or prepare takes ``export_lock`` (the pinned
staging: one at a time), then ``lock``, or for a turn export the named sessions' turn locks (in
sorted order) instead. Nothing that holds a turn lock or ``lock`` waits for ``export_lock``, so
the two orders cannot deadlock. ``meta_lock`` is innermost and held for microseconds: the
``sessions``, ``turn_done``, ``turn_locks`` and ``hashers`` dicts. ``fp_cache`` is touched only
under ``export_lock``, ``free_blocks`` only under ``lock``; a turn export touches neither lock's
state but its own sessions' blocks, which their turn locks keep still.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from ckptflow.engines.chunkwriter import ChunkWriterGone
from ckptflow.engines.gpuhash import SCHEME, KeyedChunkHash, gpu_checkable, state_sha256
from ckptflow.demo.model import encode
from ckptflow.engines.engine_side import (EngineSide, ExportRequest, ImportRequest, PrepareRequest, ResumeRequest,
                                    sessions_between_turns)
from ckptflow.demo.worker import Metrics, base_args, completion_response, parse_completion, serve
from ckptflow.engines.weight_chunks import (PIECE, RING, SLOT, THREADS, HostBuf, chunk_path, export_tensors,
                                             host_tensor, stream_in)

D, HEADS, VOCAB, MAX_LEN, BLOCK = 4096, 32, 256, 4096, 16
DH = D // HEADS
GRAPH_BATCHES = (1, 2, 4)   # each graph's scratch stays in the template image: 8 added 0.5 GiB
RUN_BLOCKS = 512            # consecutive KV blocks fingerprinted in one launch, in place (5.5 GiB at 43 layers)
# The one-pass resume's work list (``--stream-order``): "weights-first" (the 64 MiB weight chunks,
# then the ~11 MiB session blocks: largest first, and the pool's mapping and zeroing, done beside
# the stream, is long over when the first block is reached) or "interleave" (session blocks spread
# among the weight chunks). Measured on the H200 (bench/gpu_two_tier.py rows S/SB vs SI/SBI): equal
# at a 20 GiB pool, weights first 0.08 s faster at 105 GiB (interleaved blocks wait for the pool).
STREAM_ORDERS = ("weights-first", "interleave")
# A turn export's device -> host copy in pieces, one in flight. The copy engine serves one stream's
# queue until it is empty: while a turn export's copies were queued back to back (one 1 GiB copy,
# or 16 MiB pieces two in flight), a decoding session's own small copy (each token's argmax) waited
# for all of them, and its step took as long as the whole export's copy (23 ms for 1 GiB, against
# 4 ms; bench/gpu_copy_interference.py on the H200). With one piece in flight the queue empties
# after each piece and the decoder's copy goes next: its step stays at 4.7 ms at most, the export's
# copy takes 21.7 ms instead of 19.8.
TURN_COPY_PIECE = 16 << 20
# How long a turn export waits for its sessions' turns in flight to end before it gives up on them
# (the turn-end loop looks every 2 s: a session it saw idle that started a turn since is not at its end).
TURN_WAIT_S = 1.0


def _tensor_names(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    names = [("emb", (VOCAB, D)), ("pos", (MAX_LEN, D))]
    for l in range(layers):
        names += [(f"l{l}.wqkv", (D, 3 * D)), (f"l{l}.wo", (D, D)), (f"l{l}.w1", (D, 4 * D)), (f"l{l}.w2", (4 * D, D))]
    return names + [("out", (D, VOCAB))]


def write_weights(path: Path, layers: int, seed: int) -> None:
    """A safetensors file (the format: 8-byte header length, JSON header, raw little-endian data)."""
    names = _tensor_names(layers)
    header, off = {}, 0
    for n, shape in names:
        nbytes = 2 * int(torch.Size(shape).numel())
        header[n] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator(device="cuda").manual_seed(seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for n, shape in names:
            scale = 0.1 if n == "pos" else shape[0] ** -0.5
            t = (torch.randn(shape, generator=g, device="cuda") * scale).to(torch.bfloat16)
            f.write(t.view(torch.uint8).cpu().numpy().tobytes())
    os.replace(tmp, path)


def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


class SharedHostBuf(HostBuf):
    """Page-locked host memory that a child process with no CUDA hashes and writes from
    (``writer``: ckptflow.engines.chunkwriter): a memfd both map, registered with the driver
    (cuMemHostRegister), so that an export's host part takes nothing from the serving thread."""

    def __init__(self):
        super().__init__()
        self.writer = None

    def ensure(self, nbytes: int) -> torch.Tensor:
        if self.n < nbytes:
            from cuda.bindings import driver as cu

            from ckptflow.engines.chunkwriter import ChunkWriter
            from ckptflow.engines.vmm import cuda_ok

            self.free()
            writer = ChunkWriter(nbytes)
            try:
                cuda_ok(cu.cuMemHostRegister(writer.address, nbytes, 0))
            except BaseException:
                writer.close()
                raise
            self.writer, self.ptr, self.n = writer, writer.address, nbytes
            self.t = host_tensor(self.ptr, nbytes)
        return self.t

    def free(self) -> None:
        if self.writer is not None:
            from cuda.bindings import driver as cu

            from ckptflow.engines.vmm import cuda_ok

            self.t = None
            try:
                cuda_ok(cu.cuMemHostUnregister(self.ptr))   # before the unmap: pages left pinned are not freed
            finally:
                self.writer.close()
                self.writer, self.ptr, self.n = None, 0, 0


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 2**20


def _ln(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


class LlmEngine(EngineSide):
    """The protocol's four calls are its own (VMM ranges, pinned staging, GPU fingerprints); the
    requests, the engine's answer and the routes are engines/engine_side.py's."""

    ENGINE = "ckptflow-demo-llm"
    POST_ROUTES = {"/v1/peek": "peek", "/v1/ckptflow/prepare": "prepare"}

    def __init__(self, weights: Path, kv_fraction: float, kv_gib: float | None, model_name: str, seed: int,
                 stream_order: str = "weights-first"):
        from ckptflow.engines.vmm import Region

        t0 = time.perf_counter()
        self.dev = torch.device("cuda")
        torch.cuda.init()
        self.lock = threading.RLock()            # model state: one request at a time touches it
        self.export_lock = threading.Lock()      # the pinned staging: one export/import at a time
        self.meta_lock = threading.Lock()        # the sessions/turn_done/hashers dicts (see the module docstring)
        self.turn_locks: dict[str, threading.Lock] = {}   # session -> held for a turn, or a turn export
        self.turn_done: dict[str, torch.cuda.Event] = {}  # session -> recorded after its last turn's kernels
        self.slots, self.staging = HostBuf(), SharedHostBuf()
        self.model_name, self.seed, self.weights_path = model_name, seed, weights
        if stream_order not in STREAM_ORDERS:
            raise ValueError(f"stream order {stream_order!r}: one of {', '.join(STREAM_ORDERS)}")
        self.stream_order = stream_order
        header, data_off = read_header(weights)
        self.layout = {n: h for n, h in header.items() if n != "__metadata__"}
        self.layers = sum(1 for n in self.layout if n.endswith(".wqkv"))
        self.weights_bytes = max(h["data_offsets"][1] for h in self.layout.values())
        self.wregion = Region(self.weights_bytes)
        self.wflat = self.wregion.tensor()
        fd = os.open(weights, os.O_RDONLY)
        try:
            items = [(fd, data_off + o, o, min(SLOT, self.weights_bytes - o), None)
                     for o in range(0, self.weights_bytes, SLOT)]
            stream_in(items, self.wflat, self.slots)
        finally:
            os.close(fd)
        self.load_s = time.perf_counter() - t0
        self.w = {n: self.wflat[h["data_offsets"][0]:h["data_offsets"][1]].view(torch.bfloat16).view(h["shape"])
                  for n, h in self.layout.items()}
        self.block_bytes = self.layers * 2 * BLOCK * D * 2
        free, _ = torch.cuda.mem_get_info()
        pool_bytes = int(kv_gib * 2**30) if kv_gib else int((free - (6 << 30)) * kv_fraction)
        self.nblocks = pool_bytes // self.block_bytes
        self.pregion = Region(self.nblocks * self.block_bytes)
        self.pool_u8 = self.pregion.tensor()
        self.pool_u8.zero_()
        self.pool = self.pool_u8.view(torch.bfloat16).view(self.nblocks, self.layers, 2, BLOCK, HEADS, DH)
        self.flat = self.pool.view(-1, HEADS, DH)     # row = ((block * L + layer) * 2 + kv) * BLOCK + offset
        self.free_blocks = list(range(self.nblocks - 1, 0, -1))   # block 0 stays zero: the padding block
        self.sessions: dict[str, dict] = {}      # id -> {"len", "last", "blocks": [ids]}
        self.fp_cache: dict[str, dict[int, tuple[int, str]]] = {}   # id -> block index -> (fingerprint, sha)
        self.parked, self.parked_with = False, None
        self.ar = torch.arange(MAX_LEN, device=self.dev)
        # One key per engine configuration, not per process: sessions exported by one engine are
        # checked and digested the same in a template restored from another of the same model.
        self.fp_seed = (seed ^ 0x5EED) & (2**62 - 1)
        self.hashers: dict[int, KeyedChunkHash] = {}   # key seed -> hash (its key is dropped when parked)
        self.metrics = Metrics(model_name)
        self.side = torch.cuda.Stream()          # turn exports fingerprint and copy here
        t1 = time.perf_counter()
        self._capture_graphs()
        self.graph_s = time.perf_counter() - t1
        self.start_s = time.perf_counter() - t0

    # --- model --------------------------------------------------------------------------------
    def _attend(self, q, l: int, table: torch.Tensor, n_ctx: int | None, mask) -> torch.Tensor:
        """q (B, n, H, dh) against the blocks in ``table`` (B, MB) of layer ``l``."""
        B, MB = table.shape
        K = self.pool[:, l, 0].index_select(0, table.reshape(-1)).view(B, MB * BLOCK, HEADS, DH)
        V = self.pool[:, l, 1].index_select(0, table.reshape(-1)).view(B, MB * BLOCK, HEADS, DH)
        if n_ctx is not None:
            K, V = K[:, :n_ctx], V[:, :n_ctx]
        att = torch.einsum("bnhd,bthd->bhnt", q, K) * DH ** -0.5
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return torch.einsum("bhnt,bthd->bnhd", att, V)

    def _rows(self, blk: torch.Tensor, off: torch.Tensor, l: int, kv: int) -> torch.Tensor:
        return ((blk * self.layers + l) * 2 + kv) * BLOCK + off

    def _forward(self, tok, pos, table, n_ctx=None) -> torch.Tensor:
        """tok/pos (B, n); table (B, MB): writes K/V at ``pos``, returns the last position's logits."""
        B, n = tok.shape
        w = self.w
        x = w["emb"][tok] + w["pos"][pos]                                   # (B, n, D)
        blk = table.gather(1, pos // BLOCK)
        off = pos % BLOCK
        span = n_ctx if n_ctx is not None else MAX_LEN
        mask = (self.ar[:span].view(1, 1, 1, span) > pos.view(B, 1, n, 1))
        for l in range(self.layers):
            q, k, v = (_ln(x) @ w[f"l{l}.wqkv"]).view(B, n, 3, HEADS, DH).unbind(2)
            self.flat.index_copy_(0, self._rows(blk, off, l, 0).reshape(-1), k.reshape(-1, HEADS, DH))
            self.flat.index_copy_(0, self._rows(blk, off, l, 1).reshape(-1), v.reshape(-1, HEADS, DH))
            o = self._attend(q, l, table, n_ctx, mask)
            x = x + o.reshape(B, n, D) @ w[f"l{l}.wo"]
            x = x + torch.relu(_ln(x) @ w[f"l{l}.w1"]) @ w[f"l{l}.w2"]
        return _ln(x[:, -1]) @ w["out"]                                     # (B, VOCAB)

    def _capture_graphs(self) -> None:
        mb = MAX_LEN // BLOCK
        self.gbuf = {}
        pool = torch.cuda.graph_pool_handle()
        for B in sorted(GRAPH_BATCHES, reverse=True):  # largest first, the smaller ones reuse its pool
            buf = {"tok": torch.zeros(B, 1, dtype=torch.long, device=self.dev),
                   "pos": torch.zeros(B, 1, dtype=torch.long, device=self.dev),
                   "table": torch.zeros(B, mb, dtype=torch.long, device=self.dev)}
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                buf["logits"] = self._forward(buf["tok"], buf["pos"], buf["table"])
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                buf["logits"] = self._forward(buf["tok"], buf["pos"], buf["table"])
            buf["graph"] = g
            self.gbuf[B] = buf
        self.pool_u8[:self.block_bytes].zero_()   # warm-up and capture wrote into the padding block
        torch.cuda.synchronize()

    def _ensure_blocks(self, s: dict, upto: int) -> None:
        while len(s["blocks"]) * BLOCK < upto:
            if not self.free_blocks:
                raise ValueError("KV pool is full")
            s["blocks"].append(self.free_blocks.pop())

    def _table(self, s: dict) -> torch.Tensor:
        mb = MAX_LEN // BLOCK
        return torch.tensor([s["blocks"] + [0] * (mb - len(s["blocks"]))], device=self.dev)

    def _step(self, s: dict, tok: int) -> torch.Tensor:
        """Feed one token through the batch-1 graph; the logits after it."""
        self._ensure_blocks(s, s["len"] + 1)
        g = self.gbuf[1]
        g["tok"].fill_(tok)
        g["pos"].fill_(s["len"])
        g["table"].copy_(self._table(s))
        g["graph"].replay()
        s["len"] += 1
        return g["logits"][0]

    def _generate(self, s: dict, prompt: list[int], n: int) -> list[int]:
        logits = None
        if prompt:
            start = s["len"]
            self._ensure_blocks(s, start + len(prompt))
            pos = torch.arange(start, start + len(prompt), device=self.dev).view(1, -1)
            tok = torch.tensor([prompt], device=self.dev)
            table = torch.tensor([s["blocks"]], device=self.dev)
            logits = self._forward(tok, pos, table, n_ctx=len(s["blocks"]) * BLOCK)[0]
            s["len"] += len(prompt)
        out = []
        for _ in range(n):
            if logits is None:
                logits = self._step(s, 0 if s["last"] is None else s["last"])
            tok = int(torch.argmax(logits))
            out.append(tok)
            s["last"] = tok
            logits = self._step(s, tok)
        return out

    # --- serving ------------------------------------------------------------------------------
    def _turn_lock(self, sid: str) -> threading.Lock:
        with self.meta_lock:
            return self.turn_locks.setdefault(sid, threading.Lock())

    def _turn(self, sid: str | None):
        """Session ``sid``'s turn lock (a no-op for a request without a session): a completion
        holds it for its whole turn, a turn export while it fingerprints and copies the session."""
        return nullcontext() if sid is None else self._turn_lock(sid)

    def complete(self, body: dict) -> dict:
        prompt, max_tokens, sid = parse_completion(body)
        self.check_lost(sid)
        toks_in = encode(prompt)
        with self._turn(sid), self.lock:
            if self.parked:
                raise ValueError("engine is parked for a template checkpoint (weights released); retry shortly")
            t0 = time.perf_counter()
            if sid is None:
                s = {"len": 0, "last": None, "blocks": []}
                try:
                    toks = self._generate(s, toks_in, max_tokens)
                finally:
                    self.free_blocks += s["blocks"]
            else:
                with self.meta_lock:
                    s = self.sessions.setdefault(sid, {"len": 0, "last": None, "blocks": []})
                if s["len"] + len(toks_in) + max_tokens + 1 > MAX_LEN:
                    raise ValueError(f"session {sid} would exceed {MAX_LEN} tokens")
                try:
                    toks = self._generate(s, toks_in, max_tokens)
                finally:
                    # The turn's last kernels (the last token's K/V) may still run when the turn
                    # lock is let go: a turn export on its side stream waits for this event.
                    done = torch.cuda.Event()
                    done.record()
                    with self.meta_lock:
                        self.turn_done[sid] = done
            with self.meta_lock:
                held = sum(s["len"] for s in self.sessions.values())
            self.metrics.observe(len(toks_in), len(toks), time.perf_counter() - t0, held,
                                 (self.nblocks - 1) * BLOCK, len(self.sessions))
        return completion_response(self.model_name, sid, toks, len(toks_in))

    def peek(self, body: dict) -> dict:
        """The tokens the next completion would give, state unchanged (the reference)."""
        prompt, max_tokens, sid = parse_completion(body)
        with self._turn(sid), self.lock:
            s = self.sessions.get(sid)
            if s is None:
                raise ValueError(f"no session {sid}")
            nb = len(s["blocks"])
            last = self.pool[s["blocks"][-1]].clone() if nb else None
            trial = {"len": s["len"], "last": s["last"], "blocks": list(s["blocks"])}
            try:
                toks = self._generate(trial, encode(prompt), max_tokens)
            finally:
                self.free_blocks += trial["blocks"][nb:]
                if last is not None:
                    self.pool[s["blocks"][-1]] = last
            torch.cuda.synchronize()
        return {"session_id": sid, "tokens": toks}

    def prepare(self, body: dict) -> dict:
        # A whole-process checkpoint follows: the export staging's writer process and memfd stay
        # out of its image (the next export starts them again).
        with self.export_lock, self.lock:
            torch.cuda.synchronize()
            self.staging.free()
            torch.cuda.empty_cache()
        return {"reserved_bytes": int(torch.cuda.memory_reserved())}

    def _hasher(self, key: int | None = None) -> KeyedChunkHash:
        key = self.fp_seed if key is None else int(key)
        with self.meta_lock:
            h = self.hashers.get(key)
        if h is None:
            # Built on the default stream and finished before any stream uses its key.
            with torch.cuda.stream(torch.cuda.default_stream(self.dev)):
                h = KeyedChunkHash(key, max(self.block_bytes, SLOT), self.dev)
                torch.cuda.default_stream(self.dev).synchronize()
            with self.meta_lock:
                h = self.hashers.setdefault(key, h)
        return h

    def _fingerprints(self, blocks: list[int], key: int | None = None) -> list[str]:
        """A keyed 128-bit hash per block, on the GPU (telling changed blocks apart in ms), on the
        current stream. Runs of consecutive blocks (what a session's allocation mostly is) are
        hashed in place, one launch per run; scattered blocks are gathered 8 at a time."""
        h = self._hasher(key)
        pool = self.pool_u8.view(self.nblocks, self.block_bytes)
        if h.impl != "fused":   # the reference makes int64 temporaries: 8 blocks ~0.5 GiB of them
            out = []
            for i in range(0, len(blocks), 8):
                out += h.rows(pool.index_select(0, torch.tensor(blocks[i:i + 8], device=self.dev)))
            return out
        out: list[str | None] = [None] * len(blocks)
        scattered: list[int] = []
        i = 0
        while i < len(blocks):
            j = i + 1
            while j < len(blocks) and blocks[j] == blocks[j - 1] + 1 and j - i < RUN_BLOCKS:
                j += 1
            if j - i == 1:
                scattered.append(i)
            else:
                out[i:j] = h.rows(pool[blocks[i]:blocks[i] + (j - i)])
            i = j
        for g in range(0, len(scattered), 8):
            at = scattered[g:g + 8]
            got = h.rows(pool.index_select(0, torch.tensor([blocks[x] for x in at], device=self.dev)))
            for x, v in zip(at, got):
                out[x] = v
        return out  # type: ignore[return-value]

    def _weight_fingerprints(self, key: int | None = None) -> list[str]:
        """The same per 64 MiB chunk of the weights (the chunks of the weights' export)."""
        return self._hasher(key).chunks(self.wflat[:self.weights_bytes], SLOT)

    @staticmethod
    def _check(what: str, want: list[str] | None, got: list[str], chunks: list[str]) -> None:
        """Chunks are checked on the GPU after the copy: each one's fingerprint against the one
        recorded at export (sha256 on 14 threads held the stream at 11 GiB/s of 29)."""
        if want is None:
            return
        bad = [c for c, a, b in zip(chunks, want, got) if a != b]
        if bad:
            raise ValueError(f"{what}: chunk {bad[0][:12]}… is torn ({len(bad)} of {len(chunks)} differ)")

    def _digest(self, s: dict, fps: list[int]) -> str:
        return hashlib.sha256(json.dumps([fps, s["len"], s["last"]]).encode()).hexdigest()

    def session_lengths(self) -> dict[str, int]:
        with self.meta_lock:
            return {k: s["len"] for k, s in self.sessions.items()}

    def session_digests(self) -> dict[str, str]:
        with self.lock:
            return {k: self._digest(s, self._fingerprints(s["blocks"])) for k, s in self.sessions.items()}

    def ballast_digest(self) -> dict:
        """sha256 of what a restore must bring back (the benches' bit-exact check): the weights'
        bytes, then per session its id, length, last token and KV blocks' bytes in order."""
        with self.lock:
            if self.parked:
                raise ValueError("engine is parked for a template checkpoint (weights released)")
            top = hashlib.sha256(state_sha256(self.wflat[:self.weights_bytes]).encode())
            pool, n = self.pool_u8.view(self.nblocks, self.block_bytes), self.weights_bytes
            for sid in sorted(self.sessions):
                s = self.sessions[sid]
                top.update(json.dumps([sid, s["len"], s["last"]]).encode())
                for i in range(0, len(s["blocks"]), 64):   # 64 blocks: 0.7 GiB copied at a time
                    top.update(state_sha256(pool.index_select(0, torch.tensor(s["blocks"][i:i + 64], device=self.dev))).encode())
                n += len(s["blocks"]) * self.block_bytes
            return {"digest": top.hexdigest(), "bytes": n}

    # --- two-tier protocol --------------------------------------------------------------------
    def template_key(self) -> str:
        return hashlib.sha256(json.dumps([self.layout, self.nblocks, self.model_name, self.seed,
                                          os.path.getsize(self.weights_path)], sort_keys=True).encode()).hexdigest()[:16]

    def engine_extra(self) -> dict:
        return {"weights_gib": round(self.weights_bytes / 2**30, 2),
                "pool_gib": round(self.nblocks * self.block_bytes / 2**30, 2),
                "load_s": round(self.load_s, 3), "graph_s": round(self.graph_s, 3), "start_s": round(self.start_s, 3),
                "chunk_hash": next((h.impl for h in self.hashers.values()), None)}

    def _plan(self, only, known: dict[str, set[str]]) -> tuple[list, dict]:
        """Per session: its blocks' fingerprints; the blocks to copy are those whose fingerprint
        changed since this engine exported them, or whose chunk the runner does not hold. The
        caller holds the sessions (the model lock, or their turn locks) and ``export_lock``."""
        plan, snap = [], {}
        with self.meta_lock:   # a completion may add a session meanwhile (turn exports)
            chosen = [(sid, s) for sid, s in self.sessions.items() if only is None or sid in only]
        for sid, s in chosen:
            fps = self._fingerprints(s["blocks"])
            cache = self.fp_cache.get(sid, {})
            shas: list[str | None] = []
            for i, (b, fp) in enumerate(zip(s["blocks"], fps)):
                hit = cache.get(i)
                if hit and hit[0] == fp and hit[1] in known.get(sid, ()):
                    shas.append(hit[1])
                else:
                    shas.append(None)
                    plan.append((sid, i, b, fp))
            snap[sid] = {"tokens": s["len"], "last": s["last"], "blocks": list(s["blocks"]), "fps": fps,
                         "shas": shas, "digest": self._digest(s, fps)}
        return plan, snap

    @contextmanager
    def _hold(self, req: ExportRequest):
        """What an export holds while it fingerprints and copies, and the stream it does it on:
        the model (every session stops) on the current stream; or, for a turn export, only the
        named sessions' turn locks (a turn in flight that ends within TURN_WAIT_S first, else the
        export fails naming that session; new turns wait) on the side stream. Either way it first waits for the held sessions' kernels still queued (the last
        token of the turn just ended: the GPU is still serving it, so that is no hold)."""
        if not req.turn:
            with self.lock:
                torch.cuda.current_stream().synchronize()
                yield torch.cuda.current_stream()
            return
        with sessions_between_turns({sid: self._turn_lock(sid) for sid in req.only or ()}, TURN_WAIT_S):
            with self.meta_lock:
                done = [self.turn_done[sid] for sid in req.only or () if sid in self.turn_done]
            for ev in done:
                ev.synchronize()
            with torch.cuda.stream(self.side):
                yield self.side

    def _copy_out(self, plan: list, buf: torch.Tensor, stream: torch.cuda.Stream, piece: int | None = None) -> None:
        """The planned blocks into pinned ``buf`` in plan order, a run of consecutive blocks in
        one copy (or in ``piece``-byte copies, one in flight), on ``stream``; returns
        once they are there."""
        bb, pool = self.block_bytes, self.pool_u8
        spans, j = [], 0
        while j < len(plan):
            k = j + 1
            while k < len(plan) and plan[k][2] == plan[k - 1][2] + 1:
                k += 1
            dst, src, n = j * bb, plan[j][2] * bb, (k - j) * bb
            step = piece or n
            spans += [(dst + o, src + o, min(step, n - o)) for o in range(0, n, step)]
            j = k
        prev: torch.cuda.Event | None = None   # the piece in flight
        with torch.cuda.stream(stream):
            for dst, src, n in spans:
                if prev is not None:
                    prev.synchronize()
                buf[dst:dst + n].copy_(pool[src:src + n], non_blocking=True)
                if piece:
                    prev = torch.cuda.Event()
                    prev.record(stream)
        stream.synchronize()

    def export_sessions(self, req: ExportRequest) -> dict:
        """Changed blocks out as chunks. Held while fingerprinting and copying to pinned memory:
        the model, or (``req.turn``) only the named sessions; hashing and writing come after,
        serving on. The answer's ``held_s`` is that hold (for a turn export: of those sessions
        alone, the others decoding meanwhile), ``phases`` the engine's own split: ``wait`` (for
        the hold: a turn in flight, or the model, then for the held sessions' queued kernels),
        ``plan`` (fingerprints), ``copy``, ``pin`` (staging grown outside the hold), ``write``
        (sha256 and files). A turn export copies in TURN_COPY_PIECE pieces."""
        out_dir, known, only = req.dir, req.known, req.only
        t_all = time.perf_counter()
        held = 0.0
        ph = dict.fromkeys(("wait", "plan", "copy", "pin", "write"), 0.0)
        with self.export_lock:
            while True:
                t0 = time.perf_counter()
                with self._hold(req) as stream:  # the hold: fingerprints, then only the changed blocks to pinned memory
                    t1 = time.perf_counter()
                    ph["wait"] += t1 - t0
                    plan, snap = self._plan(only, known)
                    t2 = time.perf_counter()
                    ph["plan"] += t2 - t1
                    need = len(plan) * self.block_bytes
                    if self.staging.n >= need:
                        buf = self.staging.t
                        if plan:
                            self._copy_out(plan, buf, stream, TURN_COPY_PIECE if req.turn else None)
                        t3 = time.perf_counter()
                        ph["copy"] += t3 - t2
                        held += t3 - t1
                        break
                    held += time.perf_counter() - t1
                t0 = time.perf_counter()
                self.staging.ensure(need + need // 4)  # pinning is slow: outside the hold, then plan again
                ph["pin"] += time.perf_counter() - t0

            # Serving goes on meanwhile; the staging's writer process hashes and writes.
            t0 = time.perf_counter()
            written = {sid: 0 for sid in snap}
            bb = self.block_bytes
            try:
                got = self.staging.writer.write(out_dir, [(j * bb, bb) for j in range(len(plan))]) if plan else []
            except ChunkWriterGone:
                self.staging.free()   # the next export pins a new staging and starts another writer
                raise
            for j, (d, n) in enumerate(got):
                sid, i, _, fp = plan[j]
                snap[sid]["shas"][i] = d
                self.fp_cache.setdefault(sid, {})[i] = (fp, d)
                written[sid] += n
            ph["write"] = time.perf_counter() - t0
        res = {}
        for sid, sn in snap.items():
            res[sid] = {"tokens": sn["tokens"], "last": sn["last"], "digest": sn["digest"], "blocks": sn["blocks"],
                        "tensors": [{"name": "blocks", "dtype": "uint8", "shape": [len(sn["blocks"]), self.block_bytes],
                                     "nbytes": len(sn["blocks"]) * self.block_bytes, "chunks": sn["shas"],
                                     "fingerprints": sn["fps"], "fingerprint_key": self.fp_seed,
                                     "fingerprint_scheme": SCHEME}],
                        "written_bytes": written[sid], "total_bytes": len(sn["blocks"]) * self.block_bytes}
        return {"sessions": res, "held_s": round(held, 4), **({"turn": True} if req.turn else {}),
                "copied_bytes": len(plan) * self.block_bytes,
                "phases": {k: round(v, 4) for k, v in ph.items()}, "seconds": round(time.perf_counter() - t_all, 4)}

    def _session_items(self, root: Path, recs: dict[str, dict]) -> tuple[list, set[int]]:
        """Stream items of every session block (into the pool), and the blocks they take."""
        items, taken = [], set()
        for rec in recs.values():
            gpu_checked = gpu_checkable(rec["tensors"][0])   # other records: sha256 on the way in
            for b, d in zip(rec["blocks"], rec["tensors"][0]["chunks"]):
                items.append((chunk_path(root, d), 0, b * self.block_bytes, self.block_bytes,
                              None if gpu_checked else d, self.pool_u8))
                taken.add(b)
        return items, taken

    def _check_sessions(self, recs: dict[str, dict]) -> dict[str, list[str]]:
        """Every imported block's fingerprint against its record's (all sessions, before any
        exists); the fingerprints under this engine's key, per session.

        Raises:
            ValueError: a torn block, naming the session and its chunk.
        """
        got = {sid: self._fingerprints(rec["blocks"]) for sid, rec in recs.items()}
        for sid, rec in recs.items():
            t = rec["tensors"][0]
            if gpu_checkable(t):
                mine = t["fingerprint_key"] == self.fp_seed
                self._check(f"session {sid}", t["fingerprints"],
                            got[sid] if mine else self._fingerprints(rec["blocks"], t["fingerprint_key"]), t["chunks"])
        return got

    def _adopt_sessions(self, recs: dict[str, dict], taken: set[int], got: dict[str, list[str]]) -> dict[str, str]:
        """The checked sessions become the engine's; their digests."""
        self.free_blocks = [b for b in self.free_blocks if b not in taken]
        digests = {}
        for sid, rec in recs.items():
            s = {"len": rec["tokens"], "last": rec["last"], "blocks": list(rec["blocks"])}
            with self.meta_lock:
                self.sessions[sid] = s
                self.turn_done.pop(sid, None)
            fps = got[sid]
            self.fp_cache[sid] = {i: (fp, d) for i, (fp, d) in enumerate(zip(fps, rec["tensors"][0]["chunks"]))}
            digests[sid] = self._digest(s, fps)
        return digests

    def import_sessions(self, req: ImportRequest) -> dict:
        with self.export_lock, self.lock:
            items, taken = self._session_items(req.dir, req.sessions)
            stream_in(items, self.pool_u8, self.slots)
            got = self._check_sessions(req.sessions)   # every block checked before any session exists
            digests = self._adopt_sessions(req.sessions, taken, got)
        return {"imported": sorted(req.sessions), "digests": digests}

    def prepare_template(self, req: PrepareRequest) -> dict:
        """Weights out as 64 MiB chunks (those the runner lacks), then weights, KV pool, sessions
        and pinned memory released: the CUDA checkpoint then holds context, graphs and scratch."""
        out_dir, known, release = req.dir, req.known, req.release
        with self.export_lock, self.lock:
            t0 = time.perf_counter()
            self.slots.ensure(THREADS * RING * PIECE)   # the engine's own slots: pinning them again costs ~1 s/GiB
            [out], written = export_tensors([("weights", self.wflat)], out_dir, set(known), slots=self.slots)
            chunks = out["chunks"]
            export_s = time.perf_counter() - t0
            wfps = self._weight_fingerprints()
            if release:
                self.parked = True
                with self.meta_lock:
                    self.sessions.clear()
                    self.turn_done.clear()
                self.fp_cache.clear()
                self.hashers.clear()     # the keys are rebuilt from their seed after resume
                self.free_blocks = list(range(self.nblocks - 1, 0, -1))
                torch.cuda.synchronize()
                self.wregion.release()
                self.pregion.release()
                self.slots.free()
                self.staging.free()
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info()
                stats = {"gpu_used_gib": round((total - free) / 2**30, 3),
                         "torch_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 3), "rss_gib": round(_rss_gib(), 3)}
        rec = {"name": "weights", "dtype": "uint8", "shape": [self.weights_bytes], "nbytes": self.weights_bytes,
               "chunks": chunks, "fingerprints": wfps, "fingerprint_key": self.fp_seed, "fingerprint_scheme": SCHEME}
        if release:
            self.park(out_dir, [rec])
        return {"tensors": [rec], "written_bytes": written, "total_bytes": self.weights_bytes,
                "phases": {"export": round(export_s, 4), **(stats if release else {})}}

    def warm_template(self) -> dict:
        """Pinned transfer slots ahead of a resume (0.12-0.16 s of it on the H200): host memory
        only, so a standby can hold them beside the live worker's device memory."""
        t0 = time.perf_counter()
        with self.lock:
            self.wregion._current()   # an HTTP handler thread has no current context (the pinned alloc needs one)
            self.slots.ensure(THREADS * RING * PIECE)
        return {"pinned_bytes": THREADS * RING * PIECE, "seconds": round(time.perf_counter() - t0, 4)}

    def _map_pool(self) -> tuple[torch.cuda.Event, float]:
        """The pool's range backed again and zeroed (block 0 pads every table; fresh memory may
        hold NaN patterns that a masked attention weight of 0 would still multiply), on a stream
        of its own: the event the pool's copies and kernels must follow, and the host seconds."""
        t0 = time.perf_counter()
        self.pregion.map()
        zs = torch.cuda.Stream()
        with torch.cuda.stream(zs):
            self.pool_u8.zero_()
            ev = torch.cuda.Event()
            ev.record(zs)
        return ev, time.perf_counter() - t0

    def resume_template(self, req: ResumeRequest) -> dict:
        """Map the ranges back at their addresses, zero the pool, stream the weights in (checked).

        With ``req.sessions``: one pass. The weights' chunks and every session block go through
        one ``stream_in`` work list (weights first, see STREAM_ORDERS) while the pool is
        mapped and zeroed on another thread (the blocks' copies wait for it); then the weights
        and every block are checked on the GPU, then the sessions exist. A torn chunk fails the
        call, named, before any session exists, and the engine stays parked (a retry may come).
        Phases: ``map`` (weights' range), ``pinned``, ``stream`` (the one pass), ``pool`` (the
        pool's map and zero, beside it), ``weights_checked``, ``sessions_checked``, ``sessions``.

        Raises:
            ValueError: a chunk is short or torn (named).
        """
        root, recs = req.dir, req.sessions
        ph = {}
        with self.export_lock, self.lock:
            t0 = time.perf_counter()
            if recs is None:
                self.wregion.map()
                self.pregion.map()
                ph["map"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                self.pool_u8.zero_()
                ph["zero_pool"] = time.perf_counter() - t0
            else:
                self.wregion.map()
                ph["map"] = time.perf_counter() - t0
                side = ThreadPoolExecutor(1)
                pool = side.submit(self._map_pool)
            try:
                t0 = time.perf_counter()
                self.slots.ensure(THREADS * RING * PIECE)
                ph["pinned"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                items, off = [], 0
                for rec in req.tensors:
                    for d in rec["chunks"]:
                        n = min(SLOT, rec["nbytes"] - off)
                        items.append((chunk_path(root, d), 0, off, n, None if gpu_checkable(rec) else d))
                        off += n
                if recs is None:
                    loaded = stream_in(items, self.wflat, self.slots)
                    ph["weights"] = time.perf_counter() - t0
                else:
                    blocks, taken = self._session_items(root, recs)
                    items = _order(items, blocks, self.stream_order)
                    loaded = stream_in(items, self.wflat, self.slots,
                                       ready={id(self.pool_u8): lambda: pool.result()[0]})
                    ph["stream"] = time.perf_counter() - t0
            finally:
                if recs is not None:
                    zeroed, ph["pool"] = pool.result()   # never leave with the pool half mapped
                    side.shutdown()
                    torch.cuda.current_stream().wait_event(zeroed)
            t0 = time.perf_counter()
            for rec in req.tensors:
                if gpu_checkable(rec):
                    self._check("weights", rec["fingerprints"], self._weight_fingerprints(rec["fingerprint_key"]),
                                rec["chunks"])
            ph["checked" if recs is None else "weights_checked"] = time.perf_counter() - t0
            out = {}
            if recs is not None:
                t0 = time.perf_counter()
                got = self._check_sessions(recs)   # every block checked before any session exists
                ph["sessions_checked"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = {"imported": sorted(recs), "digests": self._adopt_sessions(recs, taken, got)}
                ph["sessions"] = time.perf_counter() - t0
            self.parked = False
        return {"loaded_bytes": loaded, **out, "phases": {k: round(v, 4) for k, v in ph.items()}}


def _order(weights: list[tuple], blocks: list[tuple], how: str) -> list[tuple]:
    """The one-pass work list (STREAM_ORDERS): weights first, or blocks spread among them."""
    if how == "weights-first":
        return weights + blocks
    out, every = [], max(1, len(weights) // max(1, len(blocks)))
    per = max(1, -(-len(blocks) // max(1, len(weights))))
    bi = 0
    for i, w in enumerate(weights):
        out.append(w)
        if (i + 1) % every == 0:
            out += blocks[bi:bi + per]
            bi += per
    return out + blocks[bi:]


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--weights", required=True, help="safetensors file (bf16)")
    p.add_argument("--write-weights", action="store_true", help="write --weights (--layers, --seed) and exit")
    p.add_argument("--layers", type=int, default=43, help="with --write-weights: 43 layers = 16.1 GiB")
    p.add_argument("--kv-fraction", type=float, default=0.9, help="of free GPU memory after weights, for the pool")
    p.add_argument("--kv-gib", type=float, default=None, help="pool size instead of --kv-fraction")
    p.add_argument("--stream-order", default="weights-first", choices=STREAM_ORDERS,
                   help="a resume given the sessions: the one-pass work list's order")
    a = p.parse_args(argv)
    if a.write_weights:
        write_weights(Path(a.weights), a.layers, a.seed)
        return
    e = LlmEngine(Path(a.weights), a.kv_fraction, a.kv_gib, a.model_name, a.seed, a.stream_order)
    serve(e, a, threaded=True)


if __name__ == "__main__":
    main()
