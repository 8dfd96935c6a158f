"""Hashes of tensor bytes for the GPU engines: a keyed per-chunk hash computed on the device, and a
cryptographic hash of a whole state for bit-exactness.

``KeyedChunkHash`` is NH (the inner hash of UMAC) over the 64-bit words of a chunk, two lanes with
independent keys: each word's two 32-bit halves are added to key words mod 2^32 and multiplied
as 64-bit products summed mod 2^64. Position is bound by the key (a permutation of words inside a
chunk changes it, unlike a plain sum); two lanes make a 128-bit value; for any two different
chunks of equal length the chance that they collide under a random key is at most 2^-64. On a GPU it
is one fused kernel (compiled with NVRTC when first used, checked against the torch reference
before it is trusted): the torch reference's dozen elementwise passes with int64 temporaries
hashed 16 GiB of weights at 22.8 GiB/s on the H200 and halved the stream into GPU memory
(bench/results/gpu_two_tier.json, 2026-12-01), where sha256 on the host had held it at
11 GiB/s of 29 (notes/gpu.md). The key comes from a 64-bit seed that
the export record carries beside the values: it defends against corruption, not against someone
who can write the store (the store's sha256 of each chunk does that).

``state_sha256`` is what the benches compare for "bit-exact": sha256 of every 64 MiB piece of
the bytes (host copies hashed on threads), then sha256 over those digests and the length.

Example:
    >>> import torch                                                    # doctest: +SKIP
    >>> h = KeyedChunkHash(seed=7, max_bytes=1 << 20, device="cpu")     # doctest: +SKIP
    >>> rows = torch.zeros((2, 4096), dtype=torch.uint8)                # doctest: +SKIP
    >>> h.rows(rows)[0] == h.rows(rows)[1]                              # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ckptflow.engines.adapter import GPU_FINGERPRINT_SCHEME as SCHEME
from ckptflow.engines.adapter import gpu_checkable  # noqa: F401  (the engines' import point)

log = logging.getLogger(__name__)

LANES = 2
MASK32 = 0xFFFFFFFF
PIECE = 64 << 20
THREADS_PER_BLOCK = 256
WORDS_PER_THREAD = 512    # a 64 MiB row: 64 blocks of 256 threads

# One row of 64-bit words per blockIdx.y, the last row possibly shorter; every thread sums both
# lanes over a strided share of the row, warps reduce, one atomicAdd per warp and lane (sums are
# mod 2^64 in any order). Key words are the reference's, as uint32, laid out [lane][half][word].
_NH128 = r"""
extern "C" __global__ void nh128(const unsigned long long* __restrict__ data, long long total_words,
                                 long long row_words, const unsigned int* __restrict__ key, long long key_words,
                                 unsigned long long* __restrict__ out) {
  const long long row = blockIdx.y, start = row * row_words;
  long long n = total_words - start;
  if (n > row_words) n = row_words;
  const unsigned long long* d = data + start;
  const unsigned int *k00 = key, *k01 = key + key_words, *k10 = key + 2 * key_words, *k11 = key + 3 * key_words;
  unsigned long long s0 = 0, s1 = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const unsigned long long w = d[i];
    const unsigned int lo = (unsigned int)w, hi = (unsigned int)(w >> 32);
    s0 += (unsigned long long)(lo + k00[i]) * (unsigned long long)(hi + k01[i]);
    s1 += (unsigned long long)(lo + k10[i]) * (unsigned long long)(hi + k11[i]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    s0 += __shfl_down_sync(0xffffffffu, s0, o);
    s1 += __shfl_down_sync(0xffffffffu, s1, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(out + 2 * row, s0);
    atomicAdd(out + 2 * row + 1, s1);
  }
}
"""
_kernels: dict[int, object] = {}     # device index -> CUfunction, or the reason it is not used
_build_lock = threading.Lock()


def _cu(res):
    err, *rest = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        raise RuntimeError(f"{err!r}")
    return rest[0] if len(rest) == 1 else (rest or None)


def _build(device: torch.device):
    """The fused kernel for ``device`` (a CUfunction), or a string saying why there is none."""
    try:
        from cuda.bindings import driver as cu
        from cuda.bindings import nvrtc

        prog = _cu(nvrtc.nvrtcCreateProgram(_NH128.encode(), b"nh128.cu", 0, [], []))
        major, minor = torch.cuda.get_device_capability(device)
        opts = [f"--gpu-architecture=compute_{major}{minor}".encode()]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err[0]) != 0:
            size = _cu(nvrtc.nvrtcGetProgramLogSize(prog))
            buf = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, buf)
            return f"nvrtc: {buf.decode(errors='replace').strip()[:300]}"
        ptx = b" " * _cu(nvrtc.nvrtcGetPTXSize(prog))
        _cu(nvrtc.nvrtcGetPTX(prog, ptx))
        _current(device)
        module = _cu(cu.cuModuleLoadData(ptx))
        return _cu(cu.cuModuleGetFunction(module, b"nh128"))
    except Exception as e:  # no NVRTC here, or a driver that refuses: the reference still works
        return f"{type(e).__name__}: {e}"


def _current(device: torch.device) -> None:
    """HTTP handler threads start without a current context: make torch's primary one current."""
    from cuda.bindings import driver as cu

    torch.cuda.init()
    if not int(_cu(cu.cuCtxGetCurrent())):
        _cu(cu.cuCtxSetCurrent(_cu(cu.cuDevicePrimaryCtxRetain(_cu(cu.cuDeviceGet(device.index or 0))))))


def _s64(v: int) -> int:
    """A 64-bit constant as the int64 torch multiplies with (two's complement)."""
    return v - 2**64 if v >= 2**63 else v


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` copies the sign)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def key_words(seed: int, shape: tuple[int, ...], device: str | torch.device) -> torch.Tensor:
    """The key: word i is the top 32 bits of splitmix64(seed + (i + 1) * golden), computed where it
    is used in integer ops that wrap alike on every device. A host generator's 32 M words and the
    copy to the GPU took ~0.3 s, on the restore's critical path: the keys are dropped before a
    template is dumped and rebuilt from their seed after it comes back."""
    n = 1
    for d in shape:
        n *= d
    z = (torch.arange(1, n + 1, dtype=torch.int64, device=device) * _s64(0x9E3779B97F4A7C15)
         + _s64(int(seed) % 2**64))
    z = (z ^ _lsr(z, 30)) * _s64(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _s64(0x94D049BB133111EB)
    z = z ^ _lsr(z, 31)
    return _lsr(z, 32).view(shape)


class KeyedChunkHash:
    """NH-128 of equal-length byte rows (a multiple of 8 bytes each) on the rows' device.

    Args:
        seed: the key's seed (recorded with the values so another process can recompute them).
        max_bytes: the longest row; the key holds 4 int32 words per 8 bytes of it.
        device: where rows live (the key is made there once).
    """

    def __init__(self, seed: int, max_bytes: int, device: str | torch.device):
        if max_bytes % 8:
            raise ValueError(f"max_bytes {max_bytes} is not a multiple of 8")
        self.seed, self.words = int(seed), max_bytes // 8
        # (lane, half) -> key words in [0, 2^32), kept as int64 so the adds need no masking of signs.
        self.key = key_words(self.seed, (LANES, 2, self.words), device)
        self.device = torch.device(device)
        self.key32 = None
        self.impl = "torch"     # or "fused", once the kernel matched the reference on this device
        if self.device.type == "cuda":
            self._use_fused()

    def _use_fused(self) -> None:
        """Take the fused kernel when it builds and equals the reference on a random row; keep
        the reference (and say why in the log) otherwise."""
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", idx)
        with _build_lock:
            if idx not in _kernels:
                _kernels[idx] = _build(self.device)
        fn = _kernels[idx]
        if isinstance(fn, str):
            log.warning("gpuhash: fused NH kernel unavailable, using the torch reference: %s", fn)
            return
        # The same words as int32 (values >= 2^31 wrapped to their two's complement): uint32 in the kernel.
        self.key32 = (self.key - ((self.key >> 31) << 32)).to(torch.int32).contiguous()
        # Checked as chunks() uses it: rows of several blocks each, the last row short.
        row = min(self.words, 1 << 19) * 8
        probe = torch.randint(0, 256, (2 * row + 8000,), dtype=torch.uint8, device=self.device)
        want = [self._torch_rows(probe[o:o + row].view(1, -1))[0] for o in range(0, probe.numel(), row)]
        self._fn = fn
        try:
            got = self._fused(probe, row)
        except Exception as e:  # a launch the driver refuses: the reference still works
            log.error("gpuhash: fused NH kernel failed on device %s (%s); using the reference", idx, e)
            got = None
        if got != want:
            if got is not None:
                log.error("gpuhash: fused NH kernel differs from the reference on device %s; using the reference", idx)
            self.key32 = None
            return
        self.impl = "fused"
        self.key = None    # the reference's int64 key (4x the memory) is not needed any more

    def _fused(self, flat: torch.Tensor, row_bytes: int) -> list[str]:
        """NH-128 of each ``row_bytes`` piece of the contiguous uint8 ``flat`` (a multiple of 8
        bytes; the last piece may be shorter), in one launch on the current stream."""
        from cuda.bindings import driver as cu

        total, row = flat.numel() // 8, row_bytes // 8
        nrows = -(-total // row)
        out = torch.zeros((nrows, LANES), dtype=torch.int64, device=self.device)
        gx = max(1, min(1024, -(-min(row, total) // (THREADS_PER_BLOCK * WORDS_PER_THREAD))))
        _current(self.device)
        args = ((flat.data_ptr(), total, row, self.key32.data_ptr(), self.words, out.data_ptr()),
                (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_longlong,
                 ctypes.c_void_p))
        stream = cu.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        _cu(cu.cuLaunchKernel(self._fn, gx, nrows, 1, THREADS_PER_BLOCK, 1, 1, 0, stream, args, 0))
        return [f"{x & (2**64 - 1):016x}{y & (2**64 - 1):016x}" for x, y in out.tolist()]

    def rows(self, rows: torch.Tensor) -> list[str]:
        """One 32-hex-digit value per row of a (n, bytes) uint8 tensor."""
        if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] % 8:
            raise ValueError(f"rows must be (n, 8k) uint8, got {tuple(rows.shape)} {rows.dtype}")
        n = rows.shape[1] // 8
        if n > self.words:
            raise ValueError(f"a row of {rows.shape[1]} bytes is longer than the key ({self.words * 8} bytes)")
        if not rows.shape[0]:
            return []
        if self.key32 is not None:
            return self._fused(rows.contiguous().view(-1), rows.shape[1])
        return self._torch_rows(rows)

    def _torch_rows(self, rows: torch.Tensor) -> list[str]:
        """The reference: elementwise torch ops (any device; the CPU tests pin it)."""
        n = rows.shape[1] // 8
        if self.key is None:
            raise RuntimeError("the reference key was dropped once the fused kernel was taken")
        w = rows.contiguous().view(torch.int64)
        lo = w & MASK32
        hi = (w >> 32) & MASK32          # arithmetic shift: the mask drops the sign copies
        lanes = []
        for lane in range(LANES):
            a = (lo + self.key[lane, 0, :n]) & MASK32
            b = (hi + self.key[lane, 1, :n]) & MASK32
            lanes.append((a * b).sum(-1))   # products < 2^64 wrap in int64: the sum is mod 2^64
        vals = torch.stack(lanes, -1).tolist()
        return [f"{x & (2**64 - 1):016x}{y & (2**64 - 1):016x}" for x, y in vals]

    def flat(self, t: torch.Tensor) -> str:
        """The value of one chunk given as any contiguous tensor of ≤ max_bytes bytes; a length
        that is not a multiple of 8 is padded with zeros (the length is hashed too)."""
        b = t.reshape(-1).view(torch.uint8)
        pad = (-b.numel()) % 8
        if pad:
            b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
        return self.rows(b.view(1, -1))[0] + f":{t.numel() * t.element_size()}"

    def chunks(self, t: torch.Tensor, chunk_bytes: int) -> list[str]:
        """``flat`` of each ``chunk_bytes`` piece of contiguous ``t`` (the last may be shorter),
        all in one launch where the fused kernel runs and the pieces are whole words."""
        b = t.reshape(-1).view(torch.uint8)
        n = b.numel()
        if self.key32 is None or n % 8 or chunk_bytes % 8 or chunk_bytes > self.words * 8:
            return [self.flat(b[o:o + chunk_bytes]) for o in range(0, n, chunk_bytes)]
        vals = self._fused(b, chunk_bytes)
        return [f"{v}:{min(chunk_bytes, n - o)}" for v, o in zip(vals, range(0, n, chunk_bytes))]


def state_sha256(t: torch.Tensor, threads: int = 8) -> str:
    """sha256 over the sha256 of each 64 MiB piece of ``t``'s bytes, and their count: a
    cryptographic hash of the whole state (a permutation anywhere changes it)."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    n = flat.numel()

    def one(off: int) -> bytes:
        return hashlib.sha256(flat[off:off + PIECE].cpu().numpy()).digest()   # the buffer, no copy

    with ThreadPoolExecutor(threads) as ex:
        parts = list(ex.map(one, range(0, n, PIECE)))
    top = hashlib.sha256(f"ckptflow-state-v1:{n}:{PIECE}:".encode())
    for p in parts:
        top.update(p)
    return top.hexdigest()
