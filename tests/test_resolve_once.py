"""Resolve once, pass values (issue 24, item 7): a node step opens the fleet file once and its
tasks get typed values (the fleet's scope, the workload as placed now), never the path.

node_step's body runs here without a Prefect server (``.fn``), its tasks replaced by recorders:
what is checked is what the flow hands them and how often the file is opened."""

import inspect

import pytest
import yaml

import ckptflow.flows.node_step as node_step_mod
import ckptflow.tasks.common as common
from ckptflow.errors import ConfigError
from ckptflow.fleet import FleetScope, Storage
from ckptflow.models import Workload
from ckptflow.store import open_fleet_state


def _fleet(tmp_path):
    f = tmp_path / "fleet.yaml"
    def wl(name, port):
        return {"name": name, "node": "a", "engine": "vllm", "health_url": f"http://127.0.0.1:{port}/health",
                "find": {"pid_file": str(tmp_path / f"{name}.pid"), "cmdline_must_contain": "x"}}

    f.write_text(yaml.safe_dump({
        "fleet": "f", "storage": {"kind": "local", "path": str(tmp_path / "store")},
        "nodes": [{"name": "a", "work_pool": "pa"}, {"name": "b", "work_pool": "pb"}],
        "workloads": [wl("chat", 1), wl("api", 2)]}))
    return f


@pytest.fixture
def opened(monkeypatch):
    """How many times the fleet file is opened (tasks.common.open_fleet)."""
    calls = []
    real = common.open_fleet

    def counting(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(node_step_mod, "open_fleet", counting)
    monkeypatch.setattr(common, "open_fleet", counting)
    return calls


@pytest.fixture
def tasks(monkeypatch):
    """Each node-step task replaced by a recorder of the values it was given."""
    got = {}

    def recorder(name):
        def task(*args):
            got[name] = args
            return {"task": name}
        task.with_options = lambda **kw: task  # the node step turns off result persistence for moves
        return task

    for name in ("migrate_out", "migrate_in", "restore_local", "stop_workload", "take_template",
                 "scale_up_in", "scale_down_in", "restore_workload", "cold_start_placed"):
        monkeypatch.setattr(node_step_mod, name, recorder(name))
    return got


@pytest.mark.parametrize("action,task,node", [
    ("restore", "restore_workload", "b"), ("migrate_in", "migrate_in", "b"), ("migrate_out", "migrate_out", "a"),
    ("take_template", "take_template", "a"), ("scale_up_in", "scale_up_in", "b"), ("stop", "stop_workload", "a"),
    ("restore_local", "restore_local", "a"), ("cold_start", "cold_start_placed", "b")])
def test_a_node_step_opens_the_fleet_once_and_hands_its_task_typed_values(tmp_path, opened, tasks, action, task, node):
    f = _fleet(tmp_path)
    open_fleet_state(Storage(kind="local", path=str(tmp_path / "store"))).put_placement("chat", "a", "test")
    node_step_mod.node_step.fn(str(f), action, "chat", node, checkpoint="20261130T000000Z-0000abcd")
    assert opened == [str(f)]
    args = tasks[task]
    assert not any(isinstance(a, str) and a.endswith(".yaml") for a in args)     # no path reaches a task
    w = next(a for a in args if isinstance(a, Workload))
    assert w.name == "chat"
    if action in ("restore", "migrate_in", "scale_up_in", "cold_start"):                        # brought to the target
        assert w.node == "b"
    if action not in ("stop", "cold_start"):
        assert isinstance(args[0], FleetScope) and args[0].storage.path == str(tmp_path / "store")


def test_a_workload_follows_its_placement_and_an_unknown_node_is_named(tmp_path):
    f = _fleet(tmp_path)
    fleet = common.open_fleet(str(f))
    open_fleet_state(fleet.storage).put_placement("api", "b", "migrate")
    fleet = common.open_fleet(str(f))
    assert common.placed(fleet, "api").node == "b"                 # where a migrate left it
    assert common.placed(fleet, "chat", "b").node == "b" and fleet.workload("chat").node == "a"
    with pytest.raises(ConfigError, match="nope"):
        common.placed(fleet, "chat", "nope")


def test_no_move_or_restore_task_takes_the_fleet_file():
    from ckptflow.tasks import move, node

    for mod in (move, node):
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            if fn is None or getattr(fn, "__module__", None) != mod.__name__:
                continue
            assert "fleet_file" not in inspect.signature(fn).parameters, f"{mod.__name__}.{name} takes the file"


def test_cold_start_takes_the_placed_workload_on_any_kind(tmp_path):
    """``cold_start_placed`` gets the workload as the flow placed it (no path, no fleet state),
    from a fleet on a registered object-store kind (the toy) whose placements live there."""
    import os
    import signal

    import toy_tier  # noqa: F401  (registers storage.kind toy; tests/helpers is on sys.path)
    from ckptflow.runners import process
    from ckptflow.tasks.verify import cold_start_placed

    marker = f"{tmp_path}/cold-{os.getpid()}"
    f = tmp_path / "fleet.yaml"
    storage = {"kind": "toy", "path": str(tmp_path / "store" / "{node}"), "options": {"root": str(tmp_path / "objects")}}
    f.write_text(yaml.safe_dump({
        "fleet": "f", "storage": storage,
        "nodes": [{"name": "a", "work_pool": "pa"}, {"name": "b", "work_pool": "pb"}],
        "workloads": [{"name": "chat", "node": "a", "find": {"cmdline_match": marker},
                       "start_command": ["sh", "-c", f"exec sleep 30 # {marker}", marker]}]}))
    open_fleet_state(Storage(**storage)).put_placement("chat", "b", "test")   # in the toy store
    assert common.open_fleet(str(f)).workload("chat").node == "b"
    pids = []
    try:
        row = cold_start_placed.fn(common.placed(common.open_fleet(str(f)), "chat"))
        pids.append(row["pid"])
        assert row["workload"] == "chat" and process.pid_alive(row["pid"])
        assert "fleet_file" not in inspect.signature(cold_start_placed.fn).parameters
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
