"""Tensor-parallel GPU demo worker: one process per rank (torch.distributed), the model's
heads and MLP split across ranks, a KV cache shard per session on every rank, an all-reduce
per layer and per decode step. Same HTTP API as the GPU worker, served by rank 0.

Run:  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 USE_LIBUV=0 \\
      python -m ckptflow.demo.tp_worker --port 18001 --pid-file /tmp/tp.pid --world-size 2

Rank 0 is the process the runner finds (pid file); it starts the other ranks as its children,
so one CRIU dump of rank 0's tree holds every rank, and the runner's CUDA lock/checkpoint
covers every process of the tree that holds a GPU. Ranks go to GPU ``rank % device_count``:
with one GPU, ``--backend gloo`` runs two ranks on the same device (a dry run of the
all-ranks path; NCCL refuses two ranks on one GPU).

Rank 0 drives the others SPMD-style: before each model call it writes a command into a
shared-memory ring (engines/shm_ring.py), so every rank runs the same call and meets the same
collectives. Idle ranks wait on that ring on the CPU, never inside NCCL (a rank spinning in a
collective on the GPU cannot be locked by the CUDA driver); NCCL carries tensors only.

Quiesce (the workload's ``prepare_url``): ``POST /v1/ckptflow/prepare {"hold_s": 120}`` waits for
the request in flight, then until every rank is idle on the ring with its GPU work finished,
and holds new commands until ``POST /v1/ckptflow/resume`` (the workload's ``resume_url``) or
until ``hold_s`` passes, so a runner that dies mid-checkpoint cannot wedge the worker.
``GET /v1/ckptflow/ranks`` says what each rank is doing, without waiting.

Extra endpoint:
    POST /v1/allreduce   every rank all-reduces (rank + 1); answers the sum and whether it is
                         world_size * (world_size + 1) / 2 (a working collective).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from ckptflow.demo.gpu_worker import GpuWorker
from ckptflow.engines.gpuhash import state_sha256
from ckptflow.engines.shm_ring import IDLE, RUNNING, Ring
from ckptflow.demo.worker import Metrics, base_args, serve
from ckptflow.settings import settings

PREFILL, DECODE, COPY, DIGEST, ALLREDUCE, BALLAST, EXIT = range(7)
OP_NAMES = dict(enumerate(["PREFILL", "DECODE", "COPY", "DIGEST", "ALLREDUCE", "BALLAST", "EXIT"]))
HOLD_S = 120.0  # default quiesce hold: longer than any measured checkpoint pause of this worker


class TpModel:
    """Rank ``rank``'s shard of a small transformer: heads / world_size attention heads and
    4d / world_size MLP columns; embeddings and the output projection are replicated."""

    def __init__(self, rank: int, world: int, device: torch.device, seed: int, vocab: int = 256, d: int = 512,
                 heads: int = 8, layers: int = 4, max_len: int = 2048, max_sessions: int = 8):
        assert heads % world == 0, "heads must divide by world size"
        self.rank, self.world, self.dev = rank, world, device
        self.vocab, self.d, self.L, self.T, self.S = vocab, d, layers, max_len, max_sessions
        self.h, self.dh = heads // world, d // heads
        g = torch.Generator(device="cpu").manual_seed(seed)

        def w(*shape, s=1.0):
            return torch.randn(*shape, generator=g) * s

        s = d ** -0.5
        hs = slice(rank * self.h * self.dh, (rank + 1) * self.h * self.dh)
        fs = slice(rank * 4 * d // world, (rank + 1) * 4 * d // world)
        self.emb, self.pos = w(vocab, d).to(device), w(max_len, d, s=0.1).to(device)
        self.wq, self.wk, self.wv, self.wo, self.w1, self.w2 = [], [], [], [], [], []
        for _ in range(layers):  # the full layer from the seed, then this rank's slice of it
            qkv, wo, w1, w2 = w(d, 3 * d, s=s), w(d, d, s=s), w(d, 4 * d, s=s), w(4 * d, d, s=s / 2)
            self.wq.append(qkv[:, :d][:, hs].contiguous().to(device))
            self.wk.append(qkv[:, d:2 * d][:, hs].contiguous().to(device))
            self.wv.append(qkv[:, 2 * d:][:, hs].contiguous().to(device))
            self.wo.append(wo[hs, :].contiguous().to(device))
            self.w1.append(w1[:, fs].contiguous().to(device))
            self.w2.append(w2[fs, :].contiguous().to(device))
        self.out = w(d, vocab, s=s).to(device)
        self.k = torch.zeros(layers, max_sessions, self.h, max_len, self.dh, device=device)
        self.v = torch.zeros_like(self.k)

    @staticmethod
    def _norm(x):
        return torch.nn.functional.layer_norm(x, x.shape[-1:])

    def forward(self, slot: int, start: int, toks: torch.Tensor) -> torch.Tensor:
        """Prefill or decode ``toks`` at ``start`` into ``slot``; logits of the last token."""
        n = toks.numel()
        x = self.emb[toks] + self.pos[start:start + n]
        mask = torch.arange(start + n, device=self.dev)[None, :] > (start + torch.arange(n, device=self.dev))[:, None]
        for l in range(self.L):
            xn = self._norm(x)
            q, k, v = ((xn @ w).view(n, self.h, self.dh) for w in (self.wq[l], self.wk[l], self.wv[l]))
            self.k[l, slot, :, start:start + n] = k.transpose(0, 1)
            self.v[l, slot, :, start:start + n] = v.transpose(0, 1)
            K, V = self.k[l, slot, :, :start + n], self.v[l, slot, :, :start + n]
            att = (q.transpose(0, 1) @ K.transpose(1, 2)) * self.dh ** -0.5
            att = att.masked_fill(mask[None], float("-inf")).softmax(-1)
            part = (att @ V).transpose(0, 1).reshape(n, self.h * self.dh) @ self.wo[l]
            dist.all_reduce(part)                     # row-parallel output projection
            x = x + part
            part = torch.relu(self._norm(x) @ self.w1[l]) @ self.w2[l]
            dist.all_reduce(part)                     # row-parallel MLP
            x = x + part
        return (self._norm(x[-1:]) @ self.out)[0]


class Rank:
    """What every rank runs for one command (rank 0 also serves HTTP)."""

    def __init__(self, rank: int, world: int, device: torch.device, seed: int, ballast_gib: float, ring: Ring):
        self.rank, self.world, self.dev, self.ring = rank, world, device, ring
        self.model = TpModel(rank, world, device, seed)
        n = int(ballast_gib * 2**30) // 8
        self.ballast = torch.arange(n, dtype=torch.int64, device=device)
        self.ballast.mul_(0x9E3779B97F4A7C15 - 2**64).bitwise_xor_(seed + rank)
        self.sync()

    def sync(self) -> None:
        # "Idle" must mean no kernel of this rank is still queued on the GPU (NCCL is async).
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def send(self, op: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        self.ring.send(op, a, b, c)

    def run(self, op: int, a: int, b: int, c: int, toks: torch.Tensor | None = None):
        m = self.model
        if op in (PREFILL, DECODE):
            if op == PREFILL:
                if toks is None:
                    toks = torch.zeros(c, dtype=torch.long, device=self.dev)
                dist.broadcast(toks, 0)
            else:
                toks = torch.tensor([c], device=self.dev)
            return m.forward(a, b, toks)
        if op == COPY:
            m.k[:, b, :, :c] = m.k[:, a, :, :c]
            m.v[:, b, :, :c] = m.v[:, a, :, :c]
            return None
        if op in (DIGEST, BALLAST):
            t = torch.stack([m.k[:, a, :, :b], m.v[:, a, :, :b]]).contiguous() if op == DIGEST else self.ballast
            mine = torch.tensor(list(bytes.fromhex(state_sha256(t))), dtype=torch.uint8, device=self.dev)
            every = [torch.zeros_like(mine) for _ in range(self.world)]
            dist.all_gather(every, mine)
            return hashlib.sha256(b"".join(bytes(x.tolist()) for x in every)).hexdigest()
        if op == ALLREDUCE:
            t = torch.full((1024,), float(self.rank + 1), device=self.dev)
            dist.all_reduce(t)
            return float(t[0])
        raise ValueError(f"unknown op {op}")

    def follow(self) -> None:
        """Ranks > 0: wait on the CPU ring, run rank 0's commands until EXIT."""
        while True:
            seq, op, a, b, c = self.ring.recv()
            if op == EXIT:
                return
            self.run(op, a, b, c)
            self.sync()
            self.ring.done(seq)


class _Rank0Model:
    """What GpuWorker reads of its model (sizes, device, slot copy), driving every rank."""

    def __init__(self, worker: "TpWorker"):
        m = worker.r.model
        self.S, self.T, self.dev = m.S, m.T, m.dev
        self._w = worker

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self._w._call(COPY, src, dst, length)


def _one_at_a_time(fn):
    """Model calls run one request at a time, and not while a checkpoint holds the worker."""
    @functools.wraps(fn)
    def wrapped(self, *a, **k):
        with self.busy:
            return fn(self, *a, **k)
    return wrapped


class TpWorker(GpuWorker):
    """Rank 0: the GPU worker's API (sessions, peek, prepare, metrics) over the sharded model."""

    parked = False  # no template protocol for TP groups yet: its weights never leave
    SPEAKS_PROTOCOL = False  # the fleet file refuses template-sessions with tensor_parallel > 1
    GET_ROUTES = {"/v1/ckptflow/ranks": "rank_states"}
    POST_ROUTES = {"/v1/peek": "peek", "/v1/ckptflow/prepare": "prepare", "/v1/ckptflow/resume": "resume",
                   "/v1/allreduce": "allreduce_check"}

    def __init__(self, rank0: Rank, model_name: str):  # no GpuWorker.__init__: the model is sharded
        self.r = rank0
        self.model = _Rank0Model(self)
        self.model_name = model_name
        self.metrics = Metrics(model_name)
        self.sessions: dict[str, dict] = {}
        self.busy = threading.Lock()     # held by a request, or by a quiesce until resume
        self._hold: threading.Timer | None = None
        self._hold_lock = threading.Lock()
        self.ranks_url: str | None = None

    def _call(self, op: int, a: int = 0, b: int = 0, c: int = 0, toks: torch.Tensor | None = None):
        self.r.ring.publish(RUNNING, op)
        try:
            self.r.send(op, a, b, c)
            return self.r.run(op, a, b, c, toks)
        finally:
            self.r.ring.read_seq = self.r.ring.write_seq
            self.r.ring.publish(IDLE, -1)

    complete = _one_at_a_time(GpuWorker.complete)
    peek = _one_at_a_time(GpuWorker.peek)

    def prepare(self, body: dict) -> dict:
        """Quiesce: no request in flight, every rank idle on the CPU ring with its GPU work done;
        hold new commands until resume (or ``hold_s``)."""
        hold_s = float(body.get("hold_s", HOLD_S))
        t0 = time.perf_counter()
        if not self.busy.acquire(timeout=hold_s):
            raise ValueError(f"a request has held the worker for {hold_s:g} s; not quiesced")
        try:
            self.r.sync()
            self.r.ring.wait_idle(timeout_s=hold_s)
        except BaseException:
            self.busy.release()
            raise
        with self._hold_lock:
            self._hold = threading.Timer(hold_s, self._release)
            self._hold.daemon = True
            self._hold.start()
        return {"quiesced": True, "hold_s": hold_s, "waited_s": round(time.perf_counter() - t0, 4),
                "ranks": self.rank_states()["ranks"], "ranks_url": self.ranks_url}

    def _release(self) -> bool:
        with self._hold_lock:
            if self._hold is None:
                return False
            self._hold.cancel()
            self._hold = None
            self.busy.release()
            return True

    def resume(self, body: dict) -> dict:
        return {"resumed": self._release()}

    def rank_states(self) -> dict:
        now = time.time()
        return {"ranks": [{"rank": s.rank, "pid": s.pid, "running": s.running,
                           "op": OP_NAMES.get(s.op) if s.running else None, "for_s": round(now - s.since, 3),
                           "describe": s.describe(OP_NAMES, now)} for s in self.r.ring.states()]}

    def _generate(self, slot: int, start: int, last, prompt: list[int], n: int) -> tuple[list[int], int, int]:
        pos, logits, out = start, None, []
        if prompt:
            logits = self._call(PREFILL, slot, pos, len(prompt), torch.tensor(prompt, device=self.r.dev))
            pos += len(prompt)
        for _ in range(n):
            if logits is None:
                logits = self._call(DECODE, slot, pos, 0 if last is None else last)
                pos += 1
            tok = int(torch.argmax(logits))
            out.append(tok)
            logits = self._call(DECODE, slot, pos, tok)
            pos += 1
        return out, pos, (out[-1] if out else last)

    @_one_at_a_time
    def allreduce_check(self, body: dict) -> dict:
        got = self._call(ALLREDUCE)
        want = self.r.world * (self.r.world + 1) / 2
        return {"sum": got, "expected": want, "ok": got == want, "world_size": self.r.world}

    @_one_at_a_time
    def session_digests(self) -> dict[str, str]:
        return {k: self._call(DIGEST, s["slot"], s["len"]) + f":{s['len']}:{s['last']}"
                for k, s in self.sessions.items()}

    @_one_at_a_time
    def ballast_digest(self) -> dict:
        return {"digest": self._call(BALLAST), "bytes": int(self.r.ballast.numel() * 8 * self.r.world)}


def _die_with_parent() -> None:
    # A rank must not outlive rank 0 (a killed worker leaves no orphan holding GPU memory).
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    p = base_args(__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--ballast-gib", type=float, default=0.0, help="Per rank.")
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--ring", help="(ranks > 0) the command ring rank 0 created")
    a = p.parse_args(argv)
    stacks = settings().tp_stacks  # $CKPTFLOW_TP_STACKS: kill -USR1 <rank> writes its Python stacks there
    if stacks:
        import faulthandler

        faulthandler.register(signal.SIGUSR1, open(os.path.join(stacks, f"rank{a.rank}.stack"), "w"),
                              all_threads=True)
    if a.rank == 0:
        a.master_port = a.master_port or _free_port()
        ring_path = f"/dev/shm/ckptflow-tp-{os.getpid()}-{a.master_port}"
        ring = Ring.create(ring_path, a.world_size)
        for r in range(1, a.world_size):
            cmd = [sys.executable, "-m", "ckptflow.demo.tp_worker", *(argv if argv is not None else sys.argv[1:]),
                   "--rank", str(r), "--master-port", str(a.master_port), "--ring", ring_path]
            subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    else:
        ring = Ring.attach(a.ring, a.rank)
    if a.device == "cuda":
        dev = torch.device("cuda", a.rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(a.backend, init_method=f"tcp://127.0.0.1:{a.master_port}", rank=a.rank,
                            world_size=a.world_size)
    rank = Rank(a.rank, a.world_size, dev, a.seed, a.ballast_gib, ring)
    if a.rank > 0:
        rank.follow()
        return
    w = TpWorker(rank, a.model_name)
    w.ranks_url = f"http://{a.host}:{a.port}/v1/ckptflow/ranks"
    try:
        w.allreduce_check({})  # every rank connected and agreeing before the pid file says "ready"
    finally:
        # Every rank has mapped the ring by now: unlinked, it leaves nothing in /dev/shm and CRIU
        # carries it inside the image (a ghost file).
        os.unlink(ring_path)
    try:
        serve(w, a, threaded=True)
    finally:
        rank.send(EXIT)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # no watchdog abort during a CUDA lock
    main()
