"""The GPU engines' hashes (engines/gpuhash.py), run on torch's CPU build (the vLLM install's):
the keyed chunk hash is the NH-128 its docstring defines, computed here again in exact integer
arithmetic, and it tells apart what the weighted int32 sums it replaced did not (a permutation of
words); the state hash is sha256 of the bytes, so a permutation anywhere changes it."""

import hashlib
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, torch
from ckptflow.engines.gpuhash import KeyedChunkHash, state_sha256
g = torch.Generator().manual_seed(1)
rows = torch.randint(0, 256, (3, 4096), generator=g, dtype=torch.uint8)
h = KeyedChunkHash(seed=11, max_bytes=8192, device="cpu")
swapped = rows.clone(); w = swapped[0].view(torch.int64); w[[3, 100]] = w[[100, 3]].clone()
flipped = rows.clone(); flipped[1, 777] ^= 1
# the old fingerprint: int32 words times fixed weights, summed; a swap of two words with equal
# weights keeps it, and a swap of the two halves of one 64-bit word is the same kind of move
halves = rows.clone(); i32 = halves[2].view(torch.int32); i32[[10, 11]] = i32[[11, 10]].clone()
big = torch.arange(3 * (1 << 22), dtype=torch.int64)        # 96 MiB: two pieces of state_sha256
big_swapped = big.clone(); big_swapped[[5, (1 << 23) + 7]] = big_swapped[[(1 << 23) + 7, 5]].clone()
print(json.dumps({
    "rows": rows.numpy().tobytes().hex(), "key": h.key.tolist(),
    "base": h.rows(rows), "again": KeyedChunkHash(seed=11, max_bytes=8192, device="cpu").rows(rows),
    "swapped": h.rows(swapped), "flipped": h.rows(flipped), "halves": h.rows(halves),
    "other_key": KeyedChunkHash(seed=12, max_bytes=8192, device="cpu").rows(rows),
    "flat": h.flat(rows[0]), "flat_short": h.flat(rows[0, :4093]), "impl": h.impl,
    "chunks": h.chunks(rows.reshape(-1), 4096), "chunks_short": h.chunks(rows.reshape(-1)[:10000], 4096),
    "flats_short": [h.flat(rows.reshape(-1)[o:min(o + 4096, 10000)]) for o in range(0, 10000, 4096)],
    "state_rows": state_sha256(rows), "state_big": state_sha256(big), "state_big_swapped": state_sha256(big_swapped),
}))
"""


@pytest.fixture(scope="module")
def r(vllm_install) -> dict:
    """The script's results, run once: torch's import costs seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(vllm_install.python), "-c", _SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _nh128(row: bytes, key) -> str:
    """NH over 64-bit words, two lanes: sum of (lo + k0) mod 2^32 * (hi + k1) mod 2^32, mod 2^64."""
    words = struct.unpack(f"<{len(row) // 8}Q", row)
    out = ""
    for lane in key:
        acc = sum(((x & 0xFFFFFFFF) + k0) % 2**32 * (((x >> 32) + k1) % 2**32)
                  for x, k0, k1 in zip(words, lane[0], lane[1]))
        out += f"{acc % 2**64:016x}"
    return out


def _splitmix_key(seed: int, n: int) -> list[int]:
    """gpuhash.key_words in plain integers: top 32 bits of splitmix64(seed + (i + 1) * golden)."""
    out = []
    for i in range(1, n + 1):
        z = (seed + i * 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        out.append((z ^ (z >> 31)) >> 32)
    return out


def test_the_key_is_splitmix64_of_the_seed_so_every_device_makes_the_same(r):
    flat = [k for lane in r["key"] for half in lane for k in half]
    assert flat == _splitmix_key(11, 2 * 2 * 1024)


def test_the_keyed_chunk_hash_is_nh128_and_tells_permutations_and_flips_apart(r):
    raw = bytes.fromhex(r["rows"])
    rows = [raw[i * 4096:(i + 1) * 4096] for i in range(3)]
    assert r["base"] == [_nh128(row, r["key"]) for row in rows]          # the function its docstring names
    assert r["again"] == r["base"]                                       # the seed makes the key
    assert len(set(r["base"])) == 3 and all(len(v) == 32 for v in r["base"])
    assert r["swapped"][0] != r["base"][0] and r["swapped"][1:] == r["base"][1:]
    assert r["flipped"][1] != r["base"][1] and r["flipped"][0] == r["base"][0]
    assert r["halves"][2] != r["base"][2]
    assert all(a != b for a, b in zip(r["other_key"], r["base"]))         # keyed
    assert r["flat"] == r["base"][0] + ":4096"
    assert r["flat_short"] == _nh128(rows[0][:4093] + b"\0" * 3, r["key"]) + ":4093"
    # chunks() is flat() of each piece: all at once (the fused kernel on a GPU), the last one short
    assert r["impl"] == "torch"
    assert r["chunks"] == [v + ":4096" for v in r["base"]]
    assert r["chunks_short"] == r["flats_short"] and r["chunks_short"][-1].endswith(":1808")


def test_the_state_hash_is_sha256_of_the_bytes_and_a_permutation_changes_it(r):
    raw = bytes.fromhex(r["rows"])
    assert r["state_rows"] == hashlib.sha256(f"ckptflow-state-v1:{len(raw)}:{64 << 20}:".encode()
                                             + hashlib.sha256(raw).digest()).hexdigest()
    assert r["state_big"] != r["state_big_swapped"]
