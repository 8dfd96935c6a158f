"""The seams' names: which engine adapters, GPU backends and storage kinds are registered.

A fleet file picks each by name (``engine: vllm``, ``gpu_backend: cuda``, ``storage.kind: s3``).
The names live here, at the bottom of the package (docs/ARCHITECTURE.md), so that ``models.py``
and ``fleet.py`` validate them without importing an implementation; each implementation adds
itself when its module is imported (``engines.adapter.register``, ``runners.gpu.register_backend``,
``store.register_tier``). A registry knows the modules of its built-in implementations and imports
them on its first lookup: the one place ckptflow imports its own modules by name.

Example:
    >>> ENGINES.known()
    ['demo', 'llamacpp', 'other', 'sglang', 'vllm']
    >>> ENGINES.check("tgi")
    Traceback (most recent call last):
    ...
    ValueError: unknown engine 'tgi' (known: demo, llamacpp, other, sglang, vllm)
"""

from __future__ import annotations

import importlib
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names of one seam's implementations, each with what registered it (a class, an instance).

    ``entries`` is the live dict (a seam module may expose it under its old name); ``loaded()``
    is the same dict once the built-in modules have been imported."""

    def __init__(self, what: str, builtins: tuple[str, ...] = ()) -> None:
        self.what = what
        self.entries: dict[str, T] = {}
        self._builtins = builtins
        self._loaded = not builtins

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` as ``name`` (a later registration of a name replaces it)."""
        self.entries[name] = entry
        return entry

    def loaded(self) -> dict[str, T]:
        """Every registered entry, the built-in modules imported first (once)."""
        if not self._loaded:
            self._loaded = True  # first: a built-in module's own lookups must not import it again
            for module in self._builtins:
                importlib.import_module(module)
        return self.entries

    def get(self, name: str) -> T | None:
        return self.loaded().get(name)

    def known(self) -> list[str]:
        return sorted(self.loaded())

    def unknown(self, name: object) -> str:
        """The one line that refuses ``name``, naming the known ones."""
        return f"unknown {self.what} {name!r} (known: {', '.join(self.known())})"

    def check(self, name: str) -> str:
        """``name`` if it is registered.

        Raises:
            ValueError: :meth:`unknown`'s line.
        """
        if name not in self.loaded():
            raise ValueError(self.unknown(name))
        return name


# A new built-in implementation is one more module in its tuple.
ENGINES: Registry[Any] = Registry("engine", builtins=(
    "ckptflow.engines.adapter", "ckptflow.engines.demo", "ckptflow.engines.llamacpp", "ckptflow.engines.vllm",
    "ckptflow.engines.sglang"))
GPU_BACKENDS: Registry[Any] = Registry("GPU backend", builtins=("ckptflow.runners.gpu",))
STORAGE_KINDS: Registry[Any] = Registry("storage kind", builtins=("ckptflow.store",))
