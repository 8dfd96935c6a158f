"""The engine side of the two-tier protocol (docs/engines/protocol.md) for numpy engines.

Tensors leave the process as content-addressed chunks: each tensor is cut into fixed-size
pieces named by their sha256, and only pieces whose digest the runner does not already hold
are written. Session state is laid out token-major, so a session that grew by N tokens
changes only its last chunk and the new ones: the bytes of a session heartbeat follow what
changed, not what the session holds.

Example:
    >>> import numpy as np, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> rec, written = export_tensor("x", np.arange(4096, dtype=np.float64), d, 8192, known=set())
    >>> len(rec["chunks"]), written
    (4, 32768)
    >>> rec2, written2 = export_tensor("x", np.arange(4097, dtype=np.float64), d, 8192, set(rec["chunks"]))
    >>> written2            # only the new last chunk
    8
    >>> bool((import_tensor(rec2, d) == np.arange(4097)).all())
    True
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np


def export_tensor(name: str, a: np.ndarray, out_dir: Path, chunk_bytes: int, known: set[str]) -> tuple[dict, int]:
    """Write ``a``'s chunks that are not ``known`` into ``out_dir``; its record and bytes written."""
    data = memoryview(np.ascontiguousarray(a)).cast("B")
    chunks, written = [], 0
    for off in range(0, len(data), chunk_bytes):
        piece = data[off:off + chunk_bytes]
        digest = hashlib.sha256(piece).hexdigest()
        chunks.append(digest)
        if digest in known:
            continue
        known.add(digest)  # the same piece twice in one export is written once
        tmp = out_dir / f".{digest}.tmp"
        with open(tmp, "wb") as f:
            f.write(piece)
        os.replace(tmp, out_dir / digest)
        written += len(piece)
    return {"name": name, "dtype": str(a.dtype), "shape": list(a.shape), "nbytes": int(a.nbytes),
            "chunks": chunks}, written


def chunk_path(root: Path, digest: str) -> Path:
    """Where a chunk is: the store's layout (``ab/abcd…``), or flat (a staging directory)."""
    nested = root / digest[:2] / digest
    return nested if nested.exists() else root / digest


def import_tensor(rec: dict, root: Path) -> np.ndarray:
    """Rebuild a tensor from its chunks, checking every chunk against its name.

    Raises:
        ValueError: a chunk is missing or torn (names the tensor and the chunk).
    """
    buf = bytearray(rec["nbytes"])
    off = 0
    for digest in rec["chunks"]:
        try:
            piece = chunk_path(root, digest).read_bytes()
        except FileNotFoundError:
            raise ValueError(f"tensor {rec['name']}: chunk {digest[:12]}… is missing") from None
        if hashlib.sha256(piece).hexdigest() != digest:
            raise ValueError(f"tensor {rec['name']}: chunk {digest[:12]}… is torn")
        buf[off:off + len(piece)] = piece
        off += len(piece)
    if off != rec["nbytes"]:
        raise ValueError(f"tensor {rec['name']}: chunks hold {off} bytes, expected {rec['nbytes']}")
    return np.frombuffer(bytes(buf), dtype=rec["dtype"]).reshape(rec["shape"]).copy()
