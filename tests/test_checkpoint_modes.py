"""Checkpoint modes registered by name (ckptflow.modes, runners/modes): the fleet file's
``checkpoint:`` picks the mode and ``checkpoint_params:`` its parameters, checked against the
mode's own model; a node step asks ``mode_runner`` and calls the same methods whatever the mode.

``FileStateMode`` is the example of docs/extending/checkpoint-mode.md: a third mode, registered
here, whose worker's state is one file; it runs through the same registry, loader and runner
lookup as the built-in ones.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
from pydantic import Field

from ckptflow.errors import CheckpointNotFound, ConfigError
from ckptflow.fleet import load_fleet
from ckptflow.models import Manifest, VerifyOutcome, Workload
from ckptflow.modes import MODES, ModeParams, ProcessParams, TemplateSessionsParams, get_mode, mode_of_kind, register_mode
from ckptflow.runners.modes import ModeRunner, ProcessMode, Restored, manifest_runner, mode_runner
from ckptflow.runners.node import NodeRunner
from ckptflow.runners.verify import VerifyResult
from ckptflow.store.local import LocalStore

from conftest import one_workload_fleet as _fleet  # noqa: E402


def _problem(f: Path) -> str:
    with pytest.raises(ConfigError) as e:
        load_fleet(f)
    lines = str(e.value).splitlines()
    assert lines[-1].startswith("  fix:")
    assert len(lines) == 2, lines                    # one problem, one line (and its fix)
    return lines[0]


# --- the fleet file chooses ------------------------------------------------------------------------
def test_the_fleet_files_checkpoint_value_chooses_the_mode_with_its_parameters(tmp_path):
    w = load_fleet(_fleet(tmp_path)).workloads[0]
    assert w.checkpoint == "process" and w.checkpoint_params == ProcessParams()
    with NodeRunner(LocalStore(tmp_path / "store"), criu=object()) as node:
        assert type(mode_runner(node, w)) is ProcessMode
        w = load_fleet(_fleet(tmp_path, checkpoint="template-sessions", checkpoint_params={"min_session_tokens": 64})).workloads[0]
        mode = mode_runner(node, w)
        assert type(mode).__name__ == "TemplateSessionsMode" and mode.runner().min_session_tokens == 64
        w = load_fleet(_fleet(tmp_path, checkpoint="template-sessions")).workloads[0]
        assert mode_runner(node, w).runner().min_session_tokens == 0   # policies.sessions.MIN_TOKENS


def test_the_old_mode_name_two_tier_loads_as_template_sessions(tmp_path):
    """Fleet files in the wild say ``checkpoint: two-tier``: the same mode, parameters and all."""
    new = load_fleet(_fleet(tmp_path, checkpoint="template-sessions", checkpoint_params={"min_session_tokens": 64}))
    old = load_fleet(_fleet(tmp_path, checkpoint="two-tier", checkpoint_params={"min_session_tokens": 64}))
    assert old.workloads[0].checkpoint == new.workloads[0].checkpoint == "template-sessions"
    assert old.workloads[0].checkpoint_params == new.workloads[0].checkpoint_params == TemplateSessionsParams(
        min_session_tokens=64)
    assert get_mode("two-tier") is get_mode("template-sessions")
    f = _fleet(tmp_path, checkpoint="two-tier", tensor_parallel=2)       # refused as the mode it names
    assert "template-sessions is not supported with tensor_parallel > 1 yet" in _problem(f)


def test_an_unknown_mode_is_one_line_naming_the_known_ones(tmp_path):
    f = _fleet(tmp_path, checkpoint="snapshot")
    assert re.fullmatch(rf"{re.escape(str(f))}: workloads\[0\]\.checkpoint \(line \d+\): unknown checkpoint mode "
                        r"'snapshot' \(known: process, template-sessions\)", _problem(f))
    with pytest.raises(KeyError, match="unknown checkpoint mode 'snapshot'"):
        get_mode("snapshot")


def test_a_misspelt_or_foreign_mode_parameter_names_the_key_and_the_modes_parameters(tmp_path):
    f = _fleet(tmp_path, checkpoint="template-sessions", checkpoint_params={"min_sesion_tokens": 64})
    assert re.search(r"workloads\[0\]\.checkpoint_params \(line \d+\): checkpoint mode template-sessions has no parameter "
                     r"'min_sesion_tokens' \(its parameters: min_session_tokens\); did you mean 'min_session_tokens'\?$",
                     _problem(f))
    f = _fleet(tmp_path, checkpoint_params={"min_session_tokens": 64})          # process takes none
    assert _problem(f).endswith("checkpoint mode process has no parameter 'min_session_tokens' (its parameters: none)")
    f = _fleet(tmp_path, checkpoint="template-sessions", checkpoint_params={"min_session_tokens": -1})
    assert _problem(f).endswith("min_session_tokens: Input should be greater than or equal to 0")


def test_what_a_mode_refuses_is_said_at_the_checkpoint_field(tmp_path):
    f = _fleet(tmp_path, checkpoint="template-sessions", tensor_parallel=2)
    assert "workloads[0].checkpoint (line " in _problem(f)
    assert "template-sessions is not supported with tensor_parallel > 1 yet" in _problem(f)
    f = _fleet(tmp_path, checkpoint="template-sessions", find=None, container={"name": "c"})
    assert "a container workload is checkpointed whole and on CPU only for now" in _problem(f)


def test_a_manifests_kind_names_the_mode_that_wrote_it(tmp_path):
    assert mode_of_kind("sessions").name == "template-sessions"
    assert {mode_of_kind(k).name for k in ("heartbeat", "migrate", "scale_template", "session")} == {"process"}
    w = Workload(name="w1", node="n1", find={"pid_file": "/run/w1.pid"})         # declares process now
    m = Manifest(id="20261130T120000Z-0a0b0c0d", workload="w1", node="n1", kind="sessions")
    with NodeRunner(LocalStore(tmp_path / "store"), criu=object()) as node:
        assert type(manifest_runner(node, w, m)).__name__ == "TemplateSessionsMode"


# --- a third mode, registered by name ---------------------------------------------------------------
class FileStateParams(ModeParams):
    """``file-state``: the worker's state is one file."""

    state_file: str = Field(..., description="The file that holds the worker's state.", examples=["/run/w/state"])


class FileStateMode(ModeRunner):
    """Checkpoints a copy of the state file (a manifest of kind ``session``); restores it back."""

    params: FileStateParams

    def checkpoint(self, w: Workload, context=None) -> Manifest:
        store = self.node.store
        pending = store.begin(w.name, node=w.node)
        shutil.copyfile(self.params.state_file, pending.images_dir / "state")
        return store.commit(pending, kind="session", timings={"pause": 0.0})

    def restore(self, w: Workload, tier=None) -> Restored:
        m = next((m for m in self.node.store.valid(w.name) if m.kind == "session"), None)
        if m is None:
            raise CheckpointNotFound(f"workload {w.name} has no file-state checkpoint")
        self.node.store.verify_bytes(m)
        shutil.copyfile(self.node.store.images_dir(m) / "state", self.params.state_file)
        return Restored(m, pid=0, timings={}, bytes=m.bytes, files=len(m.files))

    def verify(self, w: Workload, m: Manifest) -> VerifyResult:
        held = hashlib.sha256((self.node.store.images_dir(m) / "state").read_bytes()).hexdigest()
        ok = any(f.sha256 == held for f in m.files)
        return VerifyResult(VerifyOutcome.verified if ok else VerifyOutcome.verify_failed, "state file digest")


@pytest.fixture
def file_state_mode():
    register_mode("file-state", FileStateParams, runner=f"{__name__}:FileStateMode", kinds=("session",),
                  summary="the worker's state is one file")
    yield MODES["file-state"]
    del MODES["file-state"]


def test_a_registered_mode_is_chosen_in_the_fleet_file_and_runs(tmp_path, file_state_mode):
    state = tmp_path / "state"
    state.write_text("turn 1")
    w = load_fleet(_fleet(tmp_path, checkpoint="file-state", checkpoint_params={"state_file": str(state)})).workloads[0]
    assert w.checkpoint_params == FileStateParams(state_file=str(state))
    f = _fleet(tmp_path, checkpoint="snapshot")
    assert _problem(f).endswith("(known: file-state, process, template-sessions)")
    f = _fleet(tmp_path, checkpoint="file-state")
    assert re.search(r"workloads\[0\]\.checkpoint_params \(line \d+\): state_file: Field required$", _problem(f))

    with NodeRunner(LocalStore(tmp_path / "store"), criu=object()) as node:   # no CRIU call in this mode
        mode = mode_runner(node, w)
        assert isinstance(mode, FileStateMode)
        m = mode.checkpoint(w)
        state.write_text("turn 2, then the worker died")
        r = mode.restore(w)
        assert state.read_text() == "turn 1" and r.summary()["checkpoint"] == m.id and r.summary()["files"] == 1
        assert manifest_runner(node, w, m).verify(w, m).state == VerifyOutcome.verified


@pytest.mark.criu
def test_the_process_mode_checkpoints_and_restores_through_the_node_runner(tmp_path, demo_worker):
    w = demo_worker("pm")
    with NodeRunner(LocalStore(tmp_path / "store")) as node:
        mode = mode_runner(node, w.workload)
        m = mode.checkpoint(w.workload)
        assert m.kind == "heartbeat" and w.complete("still serving", 4, "s")
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait(timeout=10)
        got = mode.restore(w.workload).summary()
    assert got["checkpoint"] == m.id and got["files"] == len(m.files) and got["bytes"] == m.bytes
    assert set(got) == {"checkpoint", "pid", "timings", "bytes", "downloaded_bytes", "copies", "skipped", "created",
                        "files", "sessions"}


def test_the_modes_modules_examples_run():
    import doctest

    import ckptflow.modes

    res = doctest.testmod(ckptflow.modes, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted > 0


def test_a_registered_mode_runs_through_the_real_heartbeat_and_restore_tasks(tmp_path, file_state_mode, monkeypatch):
    """The contract goes through the callers, not around them: the heartbeat task calls
    ``mode.checkpoint(w, context)`` and the restore task ``mode.restore(w, tier=...)``; a toy whose
    ``checkpoint`` took only ``w`` passed the test above and raised TypeError here (#33 item 6)."""
    import logging
    from contextlib import contextmanager

    from ckptflow.fleet import FleetScope, Node, PolicyChoice, Storage
    from ckptflow.models import Fingerprint
    from ckptflow.policies.cadence import WorkloadFacts
    from ckptflow.tasks import node as node_tasks

    state = tmp_path / "state"
    state.write_text("turn 1")
    w = load_fleet(_fleet(tmp_path, checkpoint="file-state", checkpoint_params={"state_file": str(state)})).workloads[0]
    store = LocalStore(tmp_path / "store")

    @contextmanager
    def runner(scope, node):       # the node's runner, without CRIU: this mode calls none
        with NodeRunner(store, criu=object(), node_fp=Fingerprint()) as r:
            yield r

    monkeypatch.setattr(node_tasks, "node_runner", runner)
    monkeypatch.setattr(node_tasks, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(node_tasks, "collect_facts", lambda w, *a, **k: WorkloadFacts(   # no process to look at
        name=w.name, traffic="long_sessions", tokens_since_ckpt=0, seconds_since_ckpt=60.0))
    scope = FleetScope(fleet="t", storage=Storage(path=str(tmp_path / "store")))
    row = node_tasks.checkpoint_batch(scope, Node(name="n1", work_pool="n1"), [PolicyChoice(workload=w)],
                                         force=True)[0]
    assert row["ok"] and row["checkpoint"], row
    assert store.get("w1", row["checkpoint"]).kind == "session"
    state.write_text("turn 2, then the worker died")
    got = node_tasks.restore_workload.fn(scope, w)
    assert got["checkpoint"] == row["checkpoint"] and state.read_text() == "turn 1"
