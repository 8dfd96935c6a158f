"""Content-addressed chunks on a node: the bytes of the two-tier checkpoints.

An engine exports large tensors (template weights) and session state as files named by the
sha256 of their content into a staging directory the runner made inside the store; the runner
moves them here, checking each name against its bytes. Equal content is stored once (dedup
across sessions, heartbeats and workloads of the same model), and a manifest that names a chunk
is written only after the chunk is here: no manifest without its bytes.

Layout: ``<store>/chunks/<first two hex>/<sha256>``, files 0600, directories 0700.

Example:
    >>> import tempfile, pathlib, hashlib
    >>> cs = ChunkStore(pathlib.Path(tempfile.mkdtemp()))
    >>> d = hashlib.sha256(b"kv").hexdigest()
    >>> with cs.staging() as stage:
    ...     _ = (stage / d).write_bytes(b"kv")
    ...     cs.adopt(stage)
    (1, 2)
    >>> cs.read(d)
    b'kv'
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from ckptflow.errors import ChecksumMismatch

_HEX = set("0123456789abcdef")
REFS_FILE = "chunks.json"   # in a checkpoint's images dir: the chunk digests it names (what GC keeps)


def _threads() -> int:
    return max(1, min(16, (os.cpu_count() or 2) - 1))  # hashlib and file I/O release the GIL


class ChunkStore:
    def __init__(self, store_root: Path | str):
        self.root = Path(store_root) / "chunks"

    def path(self, digest: str) -> Path:
        if len(digest) != 64 or not set(digest) <= _HEX:
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return self.root / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).exists()

    @contextmanager
    def staging(self) -> Iterator[Path]:
        """A private directory on the same filesystem for the engine to write chunks into,
        removed on exit whatever happened (what was not adopted by then is discarded)."""
        base = self.root / ".staging"
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        _sweep(base)
        d = Path(tempfile.mkdtemp(dir=base, prefix=f"{os.getpid()}-"))
        # The engine process may not run as the runner's user; it only ever writes here.
        os.chmod(d, 0o733)
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def adopt(self, staging: Path) -> tuple[int, int]:
        """Move every chunk file of ``staging`` into the store after checking its name against
        its bytes. Returns (chunks adopted, bytes adopted).

        Raises:
            ChecksumMismatch: a file's content does not hash to its name (it is not adopted).
        """
        files = []
        for f in sorted(staging.iterdir()):
            if self.path(f.name).exists():  # dedup: relied on again, so young for collect()
                self.touch([f.name])
            else:
                files.append(f)
        with ThreadPoolExecutor(_threads()) as ex:
            torn = [f.name for f, d in zip(files, ex.map(_sha256, files)) if d != f.name]
        if torn:
            raise ChecksumMismatch(f"chunk {torn[0][:12]}… written by the engine does not match its name",
                                   fix="the export was torn or the disk is failing; retry the heartbeat")
        n = size = 0
        for f in files:
            dest = self.path(f.name)
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(f, 0o600)
            os.replace(f, dest)
            n += 1
            size += dest.stat().st_size
        return n, size

    def read(self, digest: str, verify: bool = True) -> bytes:
        """The chunk's bytes, checked against its name.

        Raises:
            ChecksumMismatch: missing or torn chunk.
        """
        p = self.path(digest)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise ChecksumMismatch(f"chunk {digest[:12]}… is missing from {self.root}",
                                   fix="the checkpoint that names it cannot be restored; use an older one") from None
        if verify and hashlib.sha256(data).hexdigest() != digest:
            raise ChecksumMismatch(f"chunk {digest[:12]}… is torn (its bytes no longer match its name)",
                                   fix="the checkpoint that names it cannot be restored; use an older one")
        return data

    def verify(self, digests: list[str]) -> None:
        """Check that every chunk is present and whole (before a restore touches anything),
        hashing in parallel.

        Raises:
            ChecksumMismatch: a chunk is missing or torn (the first one found).
        """
        todo = list(dict.fromkeys(digests))
        self.present(todo)

        def whole(d: str) -> bool:
            return _sha256(self.path(d)) == d

        with ThreadPoolExecutor(_threads()) as ex:
            for d, ok in zip(todo, ex.map(whole, todo)):
                if not ok:
                    self.read(d)  # raises with the reason

    def present(self, digests: list[str], nbytes: int | None = None) -> None:
        """Check that every chunk is here (no hashing: for bytes the engine hashes as it loads)
        and, given the tensor's ``nbytes``, that the chunks' sizes add up to it (a stat each: a
        truncated or grown chunk is caught before any CRIU call, not after the template runs).

        Raises:
            ChecksumMismatch: a chunk is missing, or the sizes do not add up (the odd one named).
        """
        sizes = {}
        for d in dict.fromkeys(digests):
            try:
                sizes[d] = self.path(d).stat().st_size
            except FileNotFoundError:
                self.read(d)  # raises with the reason
        if nbytes is not None and sum(sizes[d] for d in digests) != nbytes:
            # Every chunk but the last has the common size: the odd one out is the torn one.
            common = max(set(sizes[d] for d in digests[:-1]) or {0}, key=[sizes[d] for d in digests[:-1]].count)
            odd = next((d for d in digests[:-1] if sizes[d] != common), digests[-1])
            raise ChecksumMismatch(f"chunk {odd[:12]}… is torn ({sizes[odd]} bytes): the chunks hold "
                                   f"{sum(sizes[d] for d in digests)} bytes of a {nbytes}-byte tensor",
                                   fix="the checkpoint that names it cannot be restored; use an older one")

    def put(self, digest: str, data: bytes) -> int:
        """Store ``data`` under its digest (a chunk from another tier), checked first; written
        atomically, 0600. Returns the bytes written (0 when the chunk was here).

        Raises:
            ChecksumMismatch: ``data`` does not hash to ``digest`` (nothing written).
        """
        dest = self.path(digest)
        if dest.exists():
            return 0
        if hashlib.sha256(data).hexdigest() != digest:
            raise ChecksumMismatch(f"chunk {digest[:12]}… arrived torn (its bytes do not match its name)",
                                   fix="the copy it came from is damaged; use an older checkpoint")
        dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".in-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o600)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return len(data)

    def touch(self, digests: list[str]) -> None:
        """Mark chunks as relied on now (an export that skips them because they are here, a
        dedup): ``collect`` leaves chunks touched within its grace period alone."""
        for d in dict.fromkeys(digests):
            try:
                os.utime(self.path(d))
            except FileNotFoundError:
                pass

    def collect(self, referenced: set[str], grace_s: float = 3600, now: float | None = None) -> tuple[int, int]:
        """Delete the chunks no checkpoint names (``referenced``) and nobody touched within
        ``grace_s`` (a heartbeat between adopting its chunks and writing its manifest, or
        relying on chunks already here). Returns (chunks deleted, bytes freed)."""
        import time

        now = time.time() if now is None else now
        n = size = 0
        if not self.root.is_dir():
            return 0, 0
        for sub in self.root.iterdir():
            if len(sub.name) != 2 or not set(sub.name) <= _HEX:
                continue  # .staging and anything not ours
            for f in sub.iterdir():
                if f.name in referenced:
                    continue
                st = f.stat()
                if now - st.st_mtime < grace_s:
                    continue
                f.unlink()
                n += 1
                size += st.st_size
        return n, size

    def size(self, digests: list[str]) -> int:
        return sum(self.path(d).stat().st_size for d in dict.fromkeys(digests))


def _sweep(base: Path) -> None:
    """Remove staging directories of runners that died mid-export (named ``<pid>-…``): what
    they staged was never adopted, and nothing else will remove it."""
    for d in base.iterdir():
        try:
            os.kill(int(d.name.split("-", 1)[0]), 0)
            continue
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue  # not ours, or alive under another user
        shutil.rmtree(d, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
