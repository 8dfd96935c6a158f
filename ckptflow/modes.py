"""Checkpoint modes: how a workload is checkpointed, chosen by name in the fleet file.

A workload names its mode and, if it wants, the mode's parameters; each mode's parameters are
a pydantic model, so a misspelt key is an error that names its line instead of a default
silently used::

    workloads:
      - name: chat-a
        checkpoint: process                    # ProcessParams: no parameters (the default)
      - name: agent-b
        checkpoint: template-sessions          # TemplateSessionsParams
        checkpoint_params: {min_session_tokens: 64}

Modes are registered by name (``register_mode("template-sessions", TemplateSessionsParams, runner=...)``)
in ``registry.CHECKPOINT_MODES`` (``MODES`` is its dict), which the workload model checks ``checkpoint:``
against; an unknown one is refused in the line every seam's registry gives, naming the known ones. A
mode may keep an old name as an alias (``two-tier``, which fleet files in the wild still say, is
``template-sessions``). ``runner`` is where the mode's implementation lives (``"module:Class"``, a
``runners.modes.ModeRunner``), imported only when a node step uses it, so this module stays pure
and importable by the models. docs/extending/checkpoint-mode.md walks through adding one.

Example:
    >>> sorted(MODES)
    ['process', 'template-sessions']
    >>> get_mode("template-sessions").parse({"min_session_tokens": 64})
    TemplateSessionsParams(min_session_tokens=64)
    >>> get_mode("two-tier").name      # the old name, an alias
    'template-sessions'
    >>> get_mode("snapshot")
    Traceback (most recent call last):
    ...
    KeyError: "unknown checkpoint mode 'snapshot' (known: process, template-sessions)"
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from ckptflow.registry import CHECKPOINT_MODES, Entry

DEFAULT_MODE = "process"


class ModeParams(BaseModel):
    """Parameters of one checkpoint mode (a workload's ``checkpoint_params:``). Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ProcessParams(ModeParams):
    """``process``: the whole worker, CRIU (+ its GPU backend), any engine (no parameters)."""


class TemplateSessionsParams(ModeParams):
    """``template-sessions`` (alias ``two-tier``): a template of the initialised engine plus the
    sessions it exports."""

    min_session_tokens: int | None = Field(
        None, ge=0, description="Sessions shorter than this are left out of a session checkpoint (they restart "
        "fresh after a restore, unannounced); default policies.sessions.MIN_TOKENS (0: every session is kept).",
        examples=[64])


# Why a declared workload cannot use a mode (None: it can). It gets the workload's fields
# validated so far, as a mapping: a field that failed its own check is absent.
Refusal = Callable[[Mapping[str, Any]], "str | None"]


@dataclass(frozen=True, slots=True)
class CheckpointModeSpec(Entry):
    """A registered mode: its name in fleet files, its parameters' model (``name``, ``params`` and
    ``parse`` are the registry's ``Entry``'s), where its runner lives, the manifest kinds it writes,
    and what it refuses."""

    runner: str                     # "module:Class" of its runners.modes.ModeRunner
    kinds: tuple[str, ...]          # CheckpointKind values its heartbeats write
    refuse: Refusal
    summary: str = ""

    def load(self) -> type:
        """The mode's runner class (imported now)."""
        module, _, cls = self.runner.partition(":")
        return getattr(importlib.import_module(module), cls)


# The registry's own dicts (registry.CHECKPOINT_MODES, which models.py validates names against).
MODES: dict[str, CheckpointModeSpec] = CHECKPOINT_MODES.entries
MODE_ALIASES: dict[str, str] = CHECKPOINT_MODES.aliases  # an old name -> the registered name


def register_mode(name: str, params: type[ModeParams], *, runner: str, kinds: tuple[str, ...],
                  refuse: Refusal | None = None, summary: str = "",
                  aliases: tuple[str, ...] = ()) -> CheckpointModeSpec:
    """Register a checkpoint mode under ``name``: what a workload's ``checkpoint:`` names
    (``aliases``: older names that mean the same mode)."""
    spec = CheckpointModeSpec(name, params, runner, kinds, refuse or (lambda w: None), summary)
    return CHECKPOINT_MODES.add(name, spec, aliases)


def canonical_mode(name: str) -> str:
    """The registered name ``name`` stands for (itself unless it is an alias)."""
    return CHECKPOINT_MODES.canonical(name)


def unknown_mode(name: object) -> str:
    """The line that refuses mode ``name`` (``registry.Registry.unknown``'s)."""
    return CHECKPOINT_MODES.unknown(name)


def get_mode(name: str) -> CheckpointModeSpec:
    """The registered mode called ``name`` (or an alias of it).

    Raises:
        KeyError: no mode of that name (the workload model checks names first).
    """
    return CHECKPOINT_MODES.lookup(name)


def mode_of_kind(kind: str) -> CheckpointModeSpec:
    """The mode whose heartbeats write manifests of ``kind`` (``process`` for any other kind:
    a whole-process image is what every older manifest holds)."""
    return next((s for s in MODES.values() if kind in s.kinds), MODES[DEFAULT_MODE])


# --- the built-in modes ---------------------------------------------------------------------------
def _template_sessions_refusal(w: Mapping[str, Any]) -> str | None:
    if w.get("container") is not None:
        return ("a container workload is checkpointed whole and on CPU only for now: "
                "drop checkpoint: template-sessions and gpu: true, or run it as a process")
    if w.get("runtime") not in (None, "process"):   # the template is a CRIU image of a host process
        return (f"checkpoint: template-sessions runs only under the process runtime, not runtime: {w.get('runtime')}: "
                "use checkpoint: process, which the runtime does its own way")
    if (w.get("tensor_parallel") or 1) > 1:
        return ("checkpoint: template-sessions is not supported with tensor_parallel > 1 yet (no "
                "templates for TP groups); use checkpoint: process for this workload")
    engine = getattr(w.get("engine"), "value", w.get("engine"))
    if engine == "llamacpp":
        return ("checkpoint: template-sessions is not supported with engine: llamacpp (llama-server has no template hooks; "
                "its sessions are carried by the process checkpoint): use checkpoint: process")
    return None


register_mode("process", ProcessParams, runner="ckptflow.runners.modes:ProcessMode",
              kinds=("heartbeat", "migrate", "scale_template"),
              summary="the whole worker: CRIU plus the node's GPU backend, any engine")
register_mode("template-sessions", TemplateSessionsParams,
              runner="ckptflow.runners.template_sessions:TemplateSessionsMode", kinds=("sessions",),
              refuse=_template_sessions_refusal, aliases=("two-tier",),
              summary="a template of the initialised engine plus the sessions it exports, bytes in proportion to "
                      "what changed (the engine must speak ckptflow's protocol, docs/engines/protocol.md)")
