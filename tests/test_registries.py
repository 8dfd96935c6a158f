"""Every seam registers by name in one kind of registry (ckptflow/registry.py): the same lookup, the
same way of loading the built-ins, and the same line for an unknown name, whichever seam it is and
whether the fleet loader or the seam's own lookup refuses it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ckptflow import registry
from ckptflow.errors import ConfigError
from ckptflow.fleet import load_fleet
from ckptflow.registry import (CADENCE_POLICIES, CHECKPOINT_MODES, ENGINES, GPU_BACKENDS, RESULT_STORAGES, SEAMS,
                               STORAGE_KINDS, WORKLOAD_RUNTIMES, Entry, Registry)

# unknown <what> '<name>' (known: a, b, c)
UNKNOWN = re.compile(r"unknown (?P<what>[A-Za-z ]+) '(?P<name>[^']*)' \(known: (?P<known>[^)]*)\)")

FLEET = {"fleet": "t", "nodes": [{"name": "n1", "work_pool": "n1"}],
         "workloads": [{"name": "w1", "node": "n1", "find": {"pid_file": "/run/w1.pid"}}],
         "policies": [{"policy": "cost-based"}]}


def _same_line(reg: Registry, name: str, text: str) -> None:
    """``text`` holds ``reg``'s line for ``name``: the shape every seam gives, naming every known one."""
    m = UNKNOWN.search(text)
    assert m, text
    assert (m["what"], m["name"], m["known"]) == (reg.what, name, ", ".join(reg.known())), text
    assert m[0] == reg.unknown(name)


def test_every_seam_has_a_registry_and_each_seam_module_reads_it():
    from ckptflow import deploy, modes, store
    from ckptflow.engines import adapter
    from ckptflow.policies import cadence
    from ckptflow.runners import gpu
    from ckptflow.runners.runtime import WorkloadRuntime

    assert all(isinstance(reg, Registry) for reg in SEAMS)
    assert {r.what for r in SEAMS} == {"engine", "GPU backend", "storage kind", "checkpoint mode", "policy",
                                       "result storage", "workload runtime"}
    assert {name for name, v in vars(registry).items() if isinstance(v, Registry)} == {
        "ENGINES", "GPU_BACKENDS", "STORAGE_KINDS", "CHECKPOINT_MODES", "CADENCE_POLICIES", "RESULT_STORAGES",
        "WORKLOAD_RUNTIMES"}
    assert all(issubclass(c, WorkloadRuntime) for c in WORKLOAD_RUNTIMES.loaded().values())
    # the seams' old names for their dicts are the registries' own
    assert adapter.ADAPTERS is ENGINES.entries and gpu.BACKENDS is GPU_BACKENDS.entries
    assert modes.MODES is CHECKPOINT_MODES.entries and modes.MODE_ALIASES is CHECKPOINT_MODES.aliases
    assert cadence.POLICIES is CADENCE_POLICIES.entries and deploy.RESULT_STORAGE is RESULT_STORAGES.entries
    assert set(store.tier_kinds()) == set(STORAGE_KINDS.known())
    # the entries that take parameters from the fleet file are the registry's Entry
    assert all(isinstance(e, Entry) for reg in (CHECKPOINT_MODES, CADENCE_POLICIES) for e in reg.loaded().values())


def test_each_seams_registration_lands_in_its_registry(monkeypatch):
    from pydantic import BaseModel

    from ckptflow import deploy, modes, store
    from ckptflow.engines.adapter import EngineAdapter, register
    from ckptflow.policies import cadence
    from ckptflow.runners.gpu import NoGpu, register_backend
    from ckptflow.runners.runtime import register_runtime
    from ckptflow.runners.runtime.process import ProcessRuntime

    for reg in SEAMS:  # each registry as it was, after the test
        monkeypatch.setattr(reg, "entries", dict(reg.loaded()))
        monkeypatch.setattr(reg, "aliases", dict(reg.aliases))

    @register
    class ToyAdapter(EngineAdapter):
        name = "toy"

    @register_backend("toy")
    class ToyBackend(NoGpu):
        pass

    store.register_tier("toy", None)
    modes.register_mode("toy", modes.ProcessParams, runner="x:Y", kinds=("session",), aliases=("old-toy",))

    @cadence.register("toy", cadence.NeverParams)
    def decide_toy(f, params, cost):
        raise AssertionError("not called")

    deploy.register_result_storage("toy", "toy-results", lambda st: None)

    @register_runtime("toy")
    class ToyRuntime(ProcessRuntime):
        pass

    assert all("toy" in reg and reg.get("toy") is reg.lookup("toy") is not None for reg in SEAMS)
    assert CHECKPOINT_MODES.check("old-toy") == "toy" and modes.get_mode("old-toy") is CHECKPOINT_MODES.lookup("toy")
    assert "old-toy" not in CHECKPOINT_MODES.known()                      # an alias is not listed as known
    assert isinstance(CADENCE_POLICIES.lookup("toy").parse(None), BaseModel)


def _fleet_problem(tmp_path: Path, edit) -> str:
    data = yaml.safe_load(yaml.safe_dump(FLEET))
    edit(data)
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_fleet(f)
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and lines[1].startswith("  fix:"), lines   # one problem, one line (and its fix)
    return lines[0]


@pytest.mark.parametrize("reg,where,edit", [
    (ENGINES, "workloads[0].engine", lambda d: d["workloads"][0].update(engine="nope")),
    (GPU_BACKENDS, "nodes[0].gpu_backend", lambda d: d["nodes"][0].update(gpu_backend="nope")),
    (STORAGE_KINDS, "storage.kind", lambda d: d.update(storage={"kind": "nope"})),
    (CHECKPOINT_MODES, "workloads[0].checkpoint", lambda d: d["workloads"][0].update(checkpoint="nope")),
    (CADENCE_POLICIES, "policies[0].policy", lambda d: d["policies"][0].update(policy="nope")),
    (WORKLOAD_RUNTIMES, "workloads[0].runtime", lambda d: d["workloads"][0].update(runtime="nope")),
], ids=lambda v: v.what if isinstance(v, Registry) else "")
def test_the_fleet_loader_refuses_an_unknown_name_of_every_seam_in_the_same_line(tmp_path, reg, where, edit):
    line = _fleet_problem(tmp_path, edit)
    assert re.match(rf"{re.escape(str(tmp_path / 'fleet.yaml'))}: {re.escape(where)} \(line \d+\): unknown ", line)
    _same_line(reg, "nope", line)


def test_each_seams_own_lookup_refuses_an_unknown_name_in_the_same_line():
    from ckptflow.engines.adapter import get_adapter
    from ckptflow.fleet import Storage
    from ckptflow.modes import get_mode
    from ckptflow.policies.cadence import get_policy
    from ckptflow.runners.gpu import get_backend
    from ckptflow.runners.runtime import get_runtime
    from ckptflow.store import has_shared_tier

    for reg, lookup, error in [
        (ENGINES, get_adapter, ConfigError),
        (GPU_BACKENDS, get_backend, ConfigError),
        (STORAGE_KINDS, lambda n: has_shared_tier(Storage.model_construct(kind=n)), ConfigError),
        (CHECKPOINT_MODES, get_mode, KeyError),
        (CADENCE_POLICIES, get_policy, KeyError),
        (RESULT_STORAGES, RESULT_STORAGES.lookup, KeyError),   # deploy's results_env / save_results_block
        (WORKLOAD_RUNTIMES, get_runtime, ConfigError),          # NodeRunner.runtime_for, runners.runtime.runtime_for
    ]:
        with pytest.raises(error) as e:
            lookup("nope")
        _same_line(reg, "nope", e.value.args[0])
        with pytest.raises(ValueError) as v:
            reg.check("nope")
        assert str(v.value) == reg.unknown("nope")


def test_a_first_lookup_from_many_threads_at_once_sees_every_builtin(tmp_path, monkeypatch):
    # The heartbeat's node tasks start together and each looks its workload's runtime up: a thread
    # that arrived while another was still importing the built-ins once got "known: " (none).
    import sys
    import threading
    import time

    from ckptflow.registry import Registry

    reg = Registry("thing", builtins=("ckptflow_slow_builtin",))
    (tmp_path / "ckptflow_slow_builtin.py").write_text(
        "import time, sys\ntime.sleep(0.3)\nsys.modules['__registry_under_test__'].add('slow', object())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "__registry_under_test__", reg)
    seen: list[list[str]] = []
    threads = [threading.Thread(target=lambda: seen.append(reg.known())) for _ in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert seen == [["slow"]] * 8

