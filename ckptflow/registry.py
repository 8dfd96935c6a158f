"""The seams' names: which engine adapters, GPU backends, storage kinds, checkpoint modes, cadence
policies, result storages and workload runtimes are registered.

A fleet file picks each by name (``engine: vllm``, ``gpu_backend: cuda``, ``storage.kind: s3``,
``checkpoint: template-sessions``, ``policy: cost-based``, ``runtime: podman``, by default the one a
workload's ``find:`` or ``container:`` declares); ``ckptflow deploy`` picks a kind's
result storage by ``storage.kind``. The names live here, at the bottom of the package
(docs/ARCHITECTURE.md), so that ``models.py`` and ``fleet.py`` validate them without importing an
implementation; each implementation adds itself when its module is imported, through its seam's
own function:

=====================  ==============================  ============================================
registry               what a name picks               registered with
=====================  ==============================  ============================================
``ENGINES``            an engine adapter               ``engines.adapter.register``
``GPU_BACKENDS``       a GPU backend class             ``runners.gpu.register_backend``
``STORAGE_KINDS``      a storage tier kind             ``store.register_tier``
``CHECKPOINT_MODES``   a checkpoint mode (an Entry)    ``modes.register_mode``
``CADENCE_POLICIES``   a cadence policy (an Entry)     ``policies.cadence.register``
``RESULT_STORAGES``    a kind's Prefect results block  ``deploy.register_result_storage``
``WORKLOAD_RUNTIMES``  what a worker runs under        ``runners.runtime.register_runtime``
=====================  ==============================  ============================================

A registry knows the modules of its built-in implementations and imports them on its first
lookup: the one place ckptflow imports its own modules by name. An unknown name is refused by
every seam in the same line, :meth:`Registry.unknown`'s. An entry that takes parameters from the
fleet file (a mode's ``checkpoint_params:``, a policy rule's ``params:``) is an :class:`Entry`: its
name and its parameters' pydantic model, which :meth:`Entry.parse` validates.

Example:
    >>> ENGINES.known()
    ['demo', 'llamacpp', 'other', 'sglang', 'vllm']
    >>> ENGINES.check("tgi")
    Traceback (most recent call last):
    ...
    ValueError: unknown engine 'tgi' (known: demo, llamacpp, other, sglang, vllm)
    >>> CHECKPOINT_MODES.check("two-tier")          # an alias: the name it stands for
    'template-sessions'
    >>> CADENCE_POLICIES.lookup("fixed").parse({"interval_s": 60})
    FixedParams(interval_s=60.0)
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

T = TypeVar("T")
# Every registry's first load, one at a time. Re-entrant: a built-in module's own lookups (same
# thread) get the entries registered so far; another thread's first lookup waits for all of them
# (the heartbeat's node tasks look up at once). One lock for all registries, not one each: threads
# making first lookups in different registries at once got _DeadlockError from the import system
# (ckptflow.policies.cadence, in 3 of 40 tries of a scratch script; no deterministic test found).
_LOAD_LOCK = threading.RLock()


@dataclass(frozen=True, slots=True)
class Entry:
    """A registered implementation that takes parameters: its name and its parameters' model
    (pydantic, ``extra="forbid"``, so a misspelt key is an error). A seam's entry type adds what
    implements it (``modes.CheckpointModeSpec``: where its runner lives; ``policies.cadence.Policy``:
    its decision function)."""

    name: str
    params: type[BaseModel]

    def parse(self, params: Mapping[str, Any] | BaseModel | None) -> BaseModel:
        """``params`` as this entry's model (None: its defaults; another model: its fields as set).

        Raises:
            pydantic.ValidationError: an unknown key, or a value of the wrong type or range.
        """
        if params is None:
            params = {}  # its defaults; a model with a required field refuses no parameters
        if isinstance(params, self.params):
            return params
        if isinstance(params, BaseModel):
            params = params.model_dump(exclude_unset=True)
        return self.params.model_validate(params)


class Registry(Generic[T]):
    """Names of one seam's implementations, each with what registered it (a class, an instance,
    an :class:`Entry`), and the older names (aliases) that still stand for one of them.

    ``entries`` is the live dict (a seam module may expose it under its old name); ``loaded()``
    is the same dict once the built-in modules have been imported."""

    def __init__(self, what: str, builtins: tuple[str, ...] = ()) -> None:
        self.what = what
        self.entries: dict[str, T] = {}
        self.aliases: dict[str, str] = {}  # an old name -> the registered name (fleet files keep working)
        self._builtins = builtins
        self._loaded = not builtins  # every built-in module imported
        self._loading = False

    def add(self, name: str, entry: T, aliases: Iterable[str] = ()) -> T:
        """Register ``entry`` as ``name``, and ``aliases`` as older names for it (a later
        registration of a name replaces it)."""
        self.entries[name] = entry
        self.aliases.update({a: name for a in aliases})
        return entry

    def loaded(self) -> dict[str, T]:
        """Every registered entry, the built-in modules imported first (once)."""
        if not self._loaded:
            with _LOAD_LOCK:
                if not self._loading:
                    self._loading = True  # first: a built-in module's own lookups must not import it again
                    try:
                        for module in self._builtins:
                            importlib.import_module(module)
                    except BaseException:
                        self._loading = False
                        raise
                    self._loaded = True
        return self.entries

    def canonical(self, name: str) -> str:
        """The registered name ``name`` stands for (itself unless it is an alias)."""
        self.loaded()  # the built-ins register their aliases
        return self.aliases.get(name, name)

    def get(self, name: str) -> T | None:
        """The entry registered as ``name`` (or an alias of it); None if there is none."""
        return self.loaded().get(self.canonical(name))

    def lookup(self, name: str) -> T:
        """The entry registered as ``name`` (or an alias of it).

        Raises:
            KeyError: :meth:`unknown`'s line.
        """
        entry = self.get(name)
        if entry is None:
            raise KeyError(self.unknown(name))
        return entry

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.canonical(name) in self.loaded()

    def known(self) -> list[str]:
        """The registered names, sorted (aliases left out)."""
        return sorted(self.loaded())

    def unknown(self, name: object) -> str:
        """The one line that refuses ``name``, naming the known ones."""
        return f"unknown {self.what} {name!r} (known: {', '.join(self.known())})"

    def check(self, name: str) -> str:
        """The registered name ``name`` stands for (``name`` itself unless it is an alias).

        Raises:
            ValueError: :meth:`unknown`'s line.
        """
        if name not in self:
            raise ValueError(self.unknown(name))
        return self.canonical(name)


# A new built-in implementation is one more module in its tuple (a module may register several).
ENGINES: Registry[Any] = Registry("engine", builtins=(
    "ckptflow.engines.adapter", "ckptflow.engines.demo", "ckptflow.engines.llamacpp", "ckptflow.engines.vllm",
    "ckptflow.engines.sglang"))
GPU_BACKENDS: Registry[Any] = Registry("GPU backend", builtins=("ckptflow.runners.gpu",))
STORAGE_KINDS: Registry[Any] = Registry("storage kind", builtins=("ckptflow.store",))
CHECKPOINT_MODES: Registry[Any] = Registry("checkpoint mode", builtins=("ckptflow.modes",))
CADENCE_POLICIES: Registry[Any] = Registry("policy", builtins=("ckptflow.policies.cadence",))
# deploy.py holds Prefect's side of a storage kind (the store package imports no Prefect), so only
# deploy looks here, and the built-in (s3) is registered there.
RESULT_STORAGES: Registry[Any] = Registry("result storage", builtins=("ckptflow.deploy",))
# What a worker runs under (a host process, a podman container, a pod through its kubelet): each finds,
# dumps, restores, verifies, stops and cold starts its workloads its own way (ckptflow/runners/runtime/).
WORKLOAD_RUNTIMES: Registry[Any] = Registry("workload runtime", builtins=(
    "ckptflow.runners.runtime.process", "ckptflow.runners.runtime.podman", "ckptflow.runners.runtime.pod"))

# Every seam's registry, for whoever lists them (tests, docs).
SEAMS: tuple[Registry[Any], ...] = (ENGINES, GPU_BACKENDS, STORAGE_KINDS, CHECKPOINT_MODES, CADENCE_POLICIES,
                                    RESULT_STORAGES, WORKLOAD_RUNTIMES)
