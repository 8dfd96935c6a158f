"""A toy shared tier: an "object store" that is a directory, with a client of its own.

It is what a GCS or Azure Blob tier looks like, minus the cloud: a client implementing
ckptflow.store.objects.ObjectStore (six calls on keys), a ChunkedTier on it (chunks, dedup,
AES-256-GCM, the push lease / prune lock come from there), and one ``register_tier`` call that
makes ``storage: {kind: toy, options: {root: ...}}`` open it, and keeps the fleet state there
(``objects=``: store.fleetstate's ObjectFleetState on the same client). docs/extending/storage-tier.md
walks through it; tests/test_tier_contract.py runs the shared tier suite on it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Iterator

from ckptflow.errors import ConfigError, StorageUnavailable
from ckptflow.store import register_tier
from ckptflow.store.objects import ChunkedTier, load_key

PIECE = 1 << 20


class DirObjects:
    """Objects as files under ``root`` (a key's slashes are directories). Writes are atomic
    (temporary file, then rename), as an object store's PUT is: a reader sees the old object or
    the new one. ``calls`` counts each call by name (tests read it)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.calls: dict[str, int] = {}

    @property
    def location(self) -> str:
        return f"toy://{self.root}"

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad object key {key!r}")
        return self.root / key

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def put(self, key: str, body: bytes, check: bool = False) -> None:
        self._count("put")
        p = self._path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}")
            tmp.write_bytes(body)
            os.replace(tmp, p)
        except OSError as e:  # a full or read-only disk: the store refuses, a retry may help
            raise StorageUnavailable(f"toy put {key} failed: {e}", fix=f"check {self.root}") from e

    def get(self, key: str) -> bytes | None:
        self._count("get")
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def stream(self, key: str) -> Iterator[bytes]:
        self._count("stream")
        with open(self._path(key), "rb") as fh:
            while piece := fh.read(PIECE):
                yield piece

    def exists(self, key: str) -> bool:
        self._count("exists")
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._count("delete")
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str) -> list[tuple[str, int]]:
        self._count("list")
        base = self._path(prefix.rsplit("/", 1)[0]) if "/" in prefix else self.root
        if not base.is_dir():
            return []
        out = []
        for p in base.rglob("*"):
            key = p.relative_to(self.root).as_posix()
            if p.is_file() and not p.name.startswith(".") and key.startswith(prefix):
                out.append((key, p.stat().st_size))
        return sorted(out)


class ToyTier(ChunkedTier):
    """The toy tier: its copies are labelled ``toy`` in manifests."""

    label = "the toy store"

    def __init__(self, root: Path | str, key: bytes | None = None, threads: int = 4, chunk: int = 8 << 20):
        super().__init__(DirObjects(root), copy_tier="toy", threads=threads, key=key, chunk=chunk)


def toy_objects(storage) -> DirObjects:
    """``storage: {kind: toy, options: {root: DIR}}`` -> the toy client there (no chunk key:
    what the fleet state is opened on)."""
    root = storage.options.get("root")
    if not root:
        raise ConfigError("storage.kind is toy but storage.options.root is not set",
                          fix="set storage: {kind: toy, options: {root: /some/dir}}")
    return DirObjects(root)


def open_toy(storage, key: bytes | None) -> ToyTier:
    """``storage: {kind: toy, options: {root: DIR}}`` -> the toy tier there."""
    return ToyTier(toy_objects(storage).root, key=key if key is not None else load_key(storage))


# The client opener makes the fleet state (placements, alerts, fingerprints) live in the toy
# store too, through store.fleetstate.ObjectFleetState: no fleet state of the toy's own.
register_tier("toy", open_toy, objects=toy_objects)
