"""Tensors out of a torch engine as ckptflow's content-addressed chunks, and streamed back into
the same tensors: the engine side of ``template/prepare`` (weights written once) and
``template/resume`` (weights loaded back) for engines whose state is torch tensors. vLLM's
worker extension (engines/vllm_worker.py) and the bench engine (demo/llm_worker.py) use it.

The layout is the store's: a chunk is a file named by the sha256 of its bytes, ``ab/abcd…``
under the store's chunk root or flat in a staging directory (``chunk_path``). A tensor's bytes
are cut into ``SLOT``-size chunks; only those whose digest the runner does not hold (``known``)
are written, so a second template of the same weights writes nothing.

Why pinned slots and many threads: on the H200, file → GPU through one pinned buffer ran at
3.75 GiB/s, through 8 threads each with its own pinned buffer and stream at 23.3 GiB/s from page
cache (docs/gpu.md). The pinned memory is the driver's (``HostBuf``: cuMemHostAlloc) and freed
when the call ends: torch's caching host allocator would keep it, and a template's image would
carry it. Every chunk is checked against its name as its pieces pass (sha256 on the CPU threads,
which release the GIL): a torn chunk fails the call, named.

No Prefect and no other ckptflow module: an engine's own process imports this, and torch only
when a call needs it (the numpy engines import ``chunk_path`` and ``THREADS`` without it).

Example (inside an engine process):
    >>> recs, written = export_tensors(model.named_parameters(), Path("/stage"), known=set())   # doctest: +SKIP
    >>> import_tensors(recs, dict(model.named_parameters()), Path("/store/chunks"))              # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SLOT = 64 << 20                   # a chunk of a tensor's bytes
PIECE, RING = 8 << 20, 3          # pinned slots per thread: pinning costs ~1 s/GiB on the H200, so few and small
THREADS = max(4, min(14, (os.cpu_count() or 8) - 2))   # the H200 host's 16 cores: 14 copy-and-hash threads


def chunk_path(root: Path, digest: str) -> Path:
    """Where a chunk is: the store's layout (``ab/abcd…``), or flat (a staging directory)."""
    nested = root / digest[:2] / digest
    return nested if nested.exists() else root / digest


def host_tensor(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over ``nbytes`` of host memory at ``ptr`` (pinned by the driver: the
    caller frees it, after dropping the tensor)."""
    import ctypes

    import numpy as np
    import torch

    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)))


class HostBuf:
    """Page-locked host memory from the driver (cuMemHostAlloc), freed when asked: torch's
    caching host allocator would keep it, and a template's image would carry it."""

    def __init__(self):
        self.ptr, self.n, self.t = 0, 0, None

    def ensure(self, nbytes: int) -> torch.Tensor:
        if self.n < nbytes:
            from cuda.bindings import driver as cu

            from ckptflow.engines.vmm import cuda_ok

            self.free()
            self.ptr = int(cuda_ok(cu.cuMemHostAlloc(nbytes, 0)))
            self.n = nbytes
            self.t = host_tensor(self.ptr, nbytes)
        return self.t

    def free(self) -> None:
        if self.ptr:
            from cuda.bindings import driver as cu

            self.t = None
            cu.cuMemFreeHost(self.ptr)
            self.ptr, self.n = 0, 0


def stream_in(items: list[tuple], dst: torch.Tensor | None, slots: HostBuf,
              ready: dict[int, Callable[[], torch.cuda.Event]] | None = None) -> int:
    """Copy ``items`` = (source, source offset, destination offset, length, sha256 or None[,
    destination]) into the flat GPU tensor ``dst`` (or the item's own destination tensor):
    THREADS workers, each with RING pinned PIECE-size slots and its own stream, taking items in
    list order; an item's digest is checked as its pieces pass (a torn one fails the call).
    ``source``: a Path, or an open fd read at the offset. ``ready``: per destination tensor (by
    ``id``), what returns the event its copies must follow (memory still being mapped and zeroed
    beside the stream): asked once per worker, at its first item into that tensor.

    Raises:
        ValueError: an item is short or torn (names the digest).
    """
    import torch

    buf = slots.ensure(THREADS * RING * PIECE)
    lock, stop = threading.Lock(), threading.Event()
    todo = iter(items)
    moved = [0] * THREADS
    ready = ready or {}
    # A thread starts on device 0: the copies must run on the destination's device (a tensor-
    # parallel rank's), or its stream and events would not order them.
    device = (dst if dst is not None else items[0][5]).device if items else torch.device("cuda")

    def worker(i: int) -> None:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()
            try:
                _work(i, stream)
            except BaseException:
                stop.set()      # the other threads take no more items
                raise
            finally:
                stream.synchronize()   # no copy in flight from a slot once the caller frees it

    def _work(i: int, stream) -> None:
        ring = [buf[(RING * i + k) * PIECE:(RING * i + k + 1) * PIECE] for k in range(RING)]
        events: list[torch.cuda.Event | None] = [None] * RING
        waited: set[int] = set()
        k = 0
        with torch.cuda.stream(stream):
            while not stop.is_set():
                with lock:
                    item = next(todo, None)
                if item is None:
                    break
                src, src_off, dst_off, n, digest = item[:5]
                into = item[5] if len(item) > 5 else dst
                if id(into) in ready and id(into) not in waited:
                    stream.wait_event(ready[id(into)]())
                    waited.add(id(into))
                h = hashlib.sha256() if digest is not None else None
                fd = src if isinstance(src, int) else os.open(src, os.O_RDONLY)
                try:
                    for p in range(0, n, PIECE):
                        m = min(PIECE, n - p)
                        if events[k] is not None:
                            events[k].synchronize()
                        view = memoryview(ring[k].numpy())[:m]
                        if os.preadv(fd, [view], src_off + p) != m:
                            raise ValueError(f"chunk {str(digest)[:12]}…: short read")
                        if h is not None:
                            h.update(view)
                        into[dst_off + p:dst_off + p + m].copy_(ring[k][:m], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(stream)
                        events[k] = ev
                        k = (k + 1) % RING
                finally:
                    if not isinstance(src, int):
                        os.close(fd)
                if h is not None and h.hexdigest() != digest:
                    raise ValueError(f"chunk {digest[:12]}… is torn")
                moved[i] += n

    with ThreadPoolExecutor(THREADS) as ex:
        for f in [ex.submit(worker, i) for i in range(THREADS)]:
            f.result()
    return sum(moved)


def flat_bytes(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 view (no copy): what its chunks are cut from and loaded
    back into. A view that is not contiguous but covers its whole storage (a transpose, as FP8
    layers keep their weights) is its storage's bytes, in the storage's order.

    Raises:
        ValueError: ``t`` is a view over part of its storage with gaps (its chunks would be a
            copy's, not the tensor), named.
    """
    import torch

    if t.is_contiguous():
        return t.detach().reshape(-1).view(torch.uint8)
    storage = t.untyped_storage()
    if t.storage_offset() == 0 and t.numel() * t.element_size() == storage.nbytes():
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    raise ValueError(f"tensor {name} is not contiguous and does not cover its storage: its chunks would be "
                     "a copy's")


def record(name: str, t: torch.Tensor, chunks: list[str]) -> dict:
    """A tensor's record in the protocol's shape (docs/engines/protocol.md)."""
    return {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "nbytes": t.numel() * t.element_size(), "chunks": chunks}


def export_tensors(named: Iterable[tuple[str, torch.Tensor]], out_dir: Path, known: set[str],
                   threads: int = THREADS, slots: HostBuf | None = None) -> tuple[list[dict], int]:
    """Write each tensor's bytes as SLOT-size chunks into ``out_dir`` (flat, named by sha256;
    those in ``known`` or already there are not written). A GPU tensor's pieces go through
    pinned slots on a stream per thread (``slots``: an engine's own, kept; else allocated and
    freed here); a CPU tensor's bytes are hashed and written where they are. Returns the
    tensors' records (in the order given) and the bytes written.

    Raises:
        ValueError: a tensor is not contiguous (named).
    """
    import torch

    tensors = [(n, t) for n, t in named]
    flats = [flat_bytes(n, t) for n, t in tensors]
    work = [(i, off, min(SLOT, f.numel() - off)) for i, f in enumerate(flats) for off in range(0, f.numel(), SLOT)]
    digests: dict[tuple[int, int], str] = {}
    written, lock, stop, todo = [0], threading.Lock(), threading.Event(), iter(work)
    on_gpu = next((f.device for f in flats if f.is_cuda), None)
    own = on_gpu is not None and slots is None
    if own:
        slots = HostBuf()
    buf = slots.ensure(threads * PIECE) if on_gpu is not None else None

    def pieces(src: torch.Tensor, off: int, n: int, slot, stream):
        """The bytes of ``src[off:off + n]`` on the host, a piece at a time."""
        for p in range(off, off + n, PIECE):
            m = min(PIECE, off + n - p)
            if src.is_cuda:
                with torch.cuda.stream(stream):
                    slot[:m].copy_(src[p:p + m], non_blocking=True)
                stream.synchronize()
                yield memoryview(slot[:m].numpy())
            else:
                yield memoryview(src[p:p + m].numpy())

    def one(j: int, off: int, n: int, slot, stream) -> None:
        # Hashed first, written only when the runner lacks it: a second template of the same
        # weights reads them once and writes nothing.
        h = hashlib.sha256()
        for view in pieces(flats[j], off, n, slot, stream):
            h.update(view)
        d = digests[(j, off)] = h.hexdigest()
        if d in known or (out_dir / d).exists():
            return
        tmp = out_dir / f".t{os.getpid()}-{threading.get_ident()}-{j}-{off}.tmp"   # ranks share out_dir
        try:
            again = hashlib.sha256()
            with open(tmp, "wb") as f:
                for view in pieces(flats[j], off, n, slot, stream):
                    again.update(view)
                    f.write(view)
            if again.hexdigest() != d:
                raise ValueError(f"tensor {tensors[j][0]} changed while it was written out")
            with lock:   # two equal chunks (equal tensors) written at once: one file, counted once
                if (out_dir / d).exists():
                    tmp.unlink()
                    return
                os.replace(tmp, out_dir / d)
                written[0] += n
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def worker(i: int) -> None:
        slot = buf[i * PIECE:(i + 1) * PIECE] if buf is not None else None
        with torch.cuda.device(on_gpu) if on_gpu is not None else nullcontext():
            stream = torch.cuda.Stream() if on_gpu is not None else None
            try:
                while not stop.is_set():
                    with lock:
                        item = next(todo, None)
                    if item is None:
                        return
                    one(*item, slot, stream)
            except BaseException:
                stop.set()
                raise

    try:
        with ThreadPoolExecutor(threads) as ex:
            for f in [ex.submit(worker, i) for i in range(threads)]:
                f.result()
    finally:
        if own:
            slots.free()
    recs = [record(n, t, [digests[(j, off)] for off in range(0, flats[j].numel(), SLOT)])
            for j, (n, t) in enumerate(tensors)]
    return recs, written[0]


def import_tensors(records: list[dict], tensors: dict[str, torch.Tensor], root: Path, threads: int = THREADS) -> int:
    """Load each record's chunks (under ``root``: the store's layout or flat) into the tensor of
    its name, every chunk checked against its name as it passes. All records are matched against
    the tensors first (name, dtype, shape), so a record of another model touches nothing; a torn
    or missing chunk fails the call after the copies began (the tensors are then not to be used:
    an engine stays parked, and the runner kills it). Returns the bytes loaded.

    Raises:
        ValueError: a record names no tensor, or another dtype or shape; a chunk is missing,
            short or torn (named).
    """
    for rec in records:
        t = tensors.get(rec["name"])
        if t is None:
            raise ValueError(f"the checkpoint's tensor {rec['name']} is not in this engine")
        got = record(rec["name"], t, [])
        if (got["dtype"], got["shape"]) != (rec["dtype"], list(rec["shape"])):
            raise ValueError(f"tensor {rec['name']}: the checkpoint holds {rec['dtype']} {rec['shape']}, this engine "
                             f"{got['dtype']} {got['shape']}")
        if rec["nbytes"] != got["nbytes"] or len(rec["chunks"]) != -(-got["nbytes"] // SLOT):
            raise ValueError(f"tensor {rec['name']}: the checkpoint's record holds {len(rec['chunks'])} chunk(s) for "
                             f"{rec['nbytes']} bytes; this engine's tensor is {got['nbytes']} bytes in "
                             f"{-(-got['nbytes'] // SLOT)} chunk(s) of {SLOT}")
    items = []
    for rec in records:
        flat = flat_bytes(rec["name"], tensors[rec["name"]])
        for k, d in enumerate(rec["chunks"]):
            off = k * SLOT
            path = chunk_path(root, d)
            if not path.exists():
                raise ValueError(f"chunk {d[:12]}… of tensor {rec['name']} is missing under {root}")
            items.append((path, 0, off, min(SLOT, rec["nbytes"] - off), d, flat))
    if any(it[5].is_cuda for it in items):
        slots = HostBuf()
        try:
            return stream_in(items, None, slots)
        finally:
            slots.free()
    return _read_in(items, threads)


def _read_in(items: list[tuple], threads: int) -> int:
    """``stream_in`` for CPU tensors: each chunk read straight into the tensor's bytes."""
    def one(item: tuple) -> int:
        src, src_off, dst_off, n, digest, into = item
        view = memoryview(into[dst_off:dst_off + n].numpy())
        with open(src, "rb") as f:
            f.seek(src_off)
            if f.readinto(view) != n:
                raise ValueError(f"chunk {digest[:12]}…: short read")
        if hashlib.sha256(view).hexdigest() != digest:
            raise ValueError(f"chunk {digest[:12]}… is torn")
        return n

    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(one, items))
