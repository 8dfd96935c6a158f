"""Content-addressed chunk files: how numpy engines write and read tensors for the engine
protocol (docs/engines/protocol.md).

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
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ckptflow.engines.weight_chunks import chunk_path


def write_chunk(out_dir: Path, digest: str, data) -> int:
    """``data`` as ``out_dir/<digest>`` through a temporary name of this thread's (a reader never
    sees a partial chunk, two writers of the same chunk never share a file); bytes written."""
    tmp = out_dir / f".{digest}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_dir / digest)
    return len(data)


def export_tensor(name: str, a: np.ndarray, out_dir: Path, chunk_bytes: int, known: set[str],
                  threads: int = 1) -> tuple[dict, int]:
    """Write ``a``'s chunks that are not ``known`` into ``out_dir``; its record and bytes written.
    ``threads`` hash and write chunks in parallel (hashlib and file writes release the GIL)."""
    data = memoryview(np.ascontiguousarray(a)).cast("B")
    offsets = list(range(0, len(data), chunk_bytes))

    def digest(off: int) -> str:
        return hashlib.sha256(data[off:off + chunk_bytes]).hexdigest()

    def write(item: tuple[int, str]) -> int:
        off, d = item
        return write_chunk(out_dir, d, data[off:off + chunk_bytes])

    with ThreadPoolExecutor(max(1, threads)) as ex:
        chunks = list(ex.map(digest, offsets))
        todo = {}
        for off, d in zip(offsets, chunks):
            if d not in known and d not in todo.values():  # the same piece twice is written once
                todo[off] = d
        known.update(todo.values())
        written = sum(ex.map(write, todo.items()))
    return {"name": name, "dtype": str(a.dtype), "shape": list(a.shape), "nbytes": int(a.nbytes),
            "chunks": chunks}, written


def import_tensor(rec: dict, root: Path, threads: int = 1) -> np.ndarray:
    """Rebuild a tensor from its chunks, checking every chunk against its name.

    Raises:
        ValueError: a chunk is missing or torn (names the tensor and the chunk).
    """
    buf = np.empty(rec["nbytes"], dtype=np.uint8)
    starts, off = [], 0
    sizes = []
    for digest in rec["chunks"]:
        p = chunk_path(root, digest)
        try:
            n = p.stat().st_size
        except FileNotFoundError:
            raise ValueError(f"tensor {rec['name']}: chunk {digest[:12]}… is missing") from None
        starts.append(off)
        sizes.append(n)
        off += n
    if off != rec["nbytes"]:
        raise ValueError(f"tensor {rec['name']}: chunks hold {off} bytes, expected {rec['nbytes']}")

    def load(i: int) -> None:
        digest = rec["chunks"][i]
        view = memoryview(buf)[starts[i]:starts[i] + sizes[i]]
        with open(chunk_path(root, digest), "rb") as f:
            f.readinto(view)
        if hashlib.sha256(view).hexdigest() != digest:
            raise ValueError(f"tensor {rec['name']}: chunk {digest[:12]}… is torn")

    with ThreadPoolExecutor(max(1, threads)) as ex:
        list(ex.map(load, range(len(rec["chunks"]))))
    return buf.view(rec["dtype"]).reshape(rec["shape"])
