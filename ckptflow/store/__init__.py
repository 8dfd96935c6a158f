"""Checkpoint images and manifests. No Prefect here."""

from __future__ import annotations

from pathlib import Path

from ckptflow.errors import ConfigError


def open_store(storage):
    """Open the store a fleet file's ``storage:`` section names."""
    from ckptflow.store.local import LocalStore

    kind = getattr(storage.kind, "value", storage.kind)
    if kind == "local":
        return LocalStore(Path(storage.path))
    raise ConfigError(f"storage.kind {kind!r} is not supported by this version",
                      fix="use storage.kind: local")
