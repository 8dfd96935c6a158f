"""Hashes of tensor bytes for the GPU engines: a keyed per-chunk hash computed on the device, and a
cryptographic hash of a whole state for bit-exactness.

``KeyedChunkHash`` is NH (the inner hash of UMAC) over the 64-bit words of a chunk, two lanes with
independent keys: each word's two 32-bit halves are added to key words mod 2^32 and multiplied
as 64-bit products summed mod 2^64. Position is bound by the key (a permutation of words inside a
chunk changes it, unlike a plain sum); two lanes make a 128-bit value; for any two different
chunks of equal length the chance that they collide under a random key is at most 2^-64. It is
a handful of elementwise kernels per chunk, so it keeps up with the stream into GPU memory where
sha256 on the host did not (11 GiB/s of 29, notes/gpu.md). The key comes from a 64-bit seed that
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

import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch

LANES = 2
MASK32 = 0xFFFFFFFF
PIECE = 64 << 20


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
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        # (lane, half) -> key words in [0, 2^32), kept as int64 so the adds need no masking of signs.
        self.key = torch.randint(0, 2**32, (LANES, 2, self.words), generator=g, dtype=torch.int64).to(device)

    def rows(self, rows: torch.Tensor) -> list[str]:
        """One 32-hex-digit value per row of a (n, bytes) uint8 tensor."""
        if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] % 8:
            raise ValueError(f"rows must be (n, 8k) uint8, got {tuple(rows.shape)} {rows.dtype}")
        n = rows.shape[1] // 8
        if n > self.words:
            raise ValueError(f"a row of {rows.shape[1]} bytes is longer than the key ({self.words * 8} bytes)")
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
