"""The rendered node workers (systemd units, DaemonSets) poll the Prefect server often enough
for a migrate's steps to start within about a second (Prefect's own default is 10 s), and the
variable they set is the one Prefect's worker reads."""

import os
from pathlib import Path
from unittest import mock

import pytest
import yaml

from ckptflow.deploy import WORKER_QUERY_S, render_node_workers
from ckptflow.errors import ConfigError
from ckptflow.fleet import load_fleet

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "deployments" / "example-h200-fleet.yaml"
API = "http://prefect.internal:4200/api"


@pytest.fixture
def example(tmp_path):
    f = tmp_path / EXAMPLE.name
    f.write_text(EXAMPLE.read_text())
    return f


def _unit_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1)[1].split("=", 1) for line in path.read_text().splitlines()
                if line.startswith("Environment="))


def _daemonset_envs(path: Path) -> list[dict[str, str]]:
    return [{e["name"]: e["value"] for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
            for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "DaemonSet"]


def _worker_query_seconds(env: dict[str, str]) -> float:
    """What Prefect's worker makes of that environment (the setting it polls by)."""
    from prefect.settings.models.root import Settings

    with mock.patch.dict(os.environ, {k: v for k, v in env.items() if k.startswith("PREFECT_")}, clear=False):
        return Settings().worker.query_seconds


def test_every_unit_and_daemonset_polls_every_second_by_default(example):
    fleet = load_fleet(example)
    files = render_node_workers(example, ROOT, api_url=API)
    assert len(files["systemd"]) == len(fleet.nodes)
    for unit in files["systemd"]:
        env = _unit_env(unit)
        assert env["PREFECT_WORKER_QUERY_SECONDS"] == "1", unit.name
        assert _worker_query_seconds(env) == WORKER_QUERY_S == 1.0
    envs = _daemonset_envs(files["kubernetes"][0])
    assert len(envs) == len({n.work_pool for n in fleet.nodes})
    for env in envs:
        assert env["PREFECT_WORKER_QUERY_SECONDS"] == "1"
        assert _worker_query_seconds(env) == 1.0


def test_the_poll_interval_is_configurable(example, tmp_path):
    files = render_node_workers(example, ROOT, api_url=API, worker_query_s=2.5, out_dir=tmp_path / "w")
    assert {_unit_env(u)["PREFECT_WORKER_QUERY_SECONDS"] for u in files["systemd"]} == {"2.5"}
    assert {e["PREFECT_WORKER_QUERY_SECONDS"] for e in _daemonset_envs(files["kubernetes"][0])} == {"2.5"}
    assert _worker_query_seconds(_unit_env(files["systemd"][0])) == 2.5


@pytest.mark.parametrize("bad", [0, -1, 61])
def test_a_poll_interval_out_of_range_is_refused_in_one_line(example, tmp_path, bad):
    with pytest.raises(ConfigError, match=f"worker poll interval {bad} s: it must be more than 0 and at most 60 s"):
        render_node_workers(example, ROOT, api_url=API, worker_query_s=bad, out_dir=tmp_path / "w")
    assert not (tmp_path / "w").exists()   # refused before anything was written


# --- where flow results go: the storage kind's result storage -------------------------------------
def _results_envs(prefect_yaml: Path) -> set[str | None]:
    spec = yaml.safe_load(prefect_yaml.read_text())
    return {d["work_pool"]["job_variables"]["env"].get("PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK")
            for d in spec["deployments"]}


def _toy_fleet(tmp_path: Path, nodes: list[str]) -> Path:
    import toy_tier  # noqa: F401  (registers storage.kind toy; tests/helpers is on sys.path)

    f = tmp_path / "toy.yaml"
    f.write_text(yaml.safe_dump({"fleet": "toy-fleet", "storage": {
        "kind": "toy", "path": str(tmp_path / "store" / "{node}"), "options": {"root": str(tmp_path / "objects")}},
        "nodes": [{"name": n, "work_pool": n} for n in nodes]}))
    return f


def test_an_s3_fleets_flow_results_go_to_its_bucket_block(example):
    from ckptflow.deploy import render_prefect_yaml, results_block_name

    fleet = load_fleet(example)
    assert results_block_name(fleet) == f"ckptflow-results-{fleet.fleet}"
    assert _results_envs(render_prefect_yaml(example, ROOT)) == {f"s3-bucket/ckptflow-results-{fleet.fleet}"}


def test_a_kind_registers_where_its_flow_results_go(tmp_path):
    """A storage kind other than s3 gets its own results block by one registration: deploy
    renders its slug and saves what the kind's builder returns, on the fleet's storage."""
    from ckptflow import deploy

    f = _toy_fleet(tmp_path, ["node-a", "node-b"])
    fleet = load_fleet(f)
    assert deploy.results_block_name(fleet) is None                      # none registered yet
    with pytest.raises(ConfigError, match=r"storage.kind toy registers no result storage, and node node-a is another "
                                          r"machine") as e:
        deploy.check_result_storage(fleet)
    assert "register_result_storage('toy'" in e.value.fix
    deploy.check_result_storage(fleet, all_nodes_here=True)              # one machine: its own disk is shared
    saved = []

    class Block:
        def __init__(self, storage):
            self.root = storage.options["root"]

        def save(self, name, overwrite=False):
            saved.append((name, self.root, overwrite))

    deploy.register_result_storage("toy", "toy-results", Block)
    try:
        deploy.check_result_storage(fleet)
        assert _results_envs(deploy.render_prefect_yaml(f, ROOT)) == {"toy-results/ckptflow-results-toy-fleet"}
        assert deploy.save_results_block(fleet) == "ckptflow-results-toy-fleet"
        assert saved == [("ckptflow-results-toy-fleet", str(tmp_path / "objects"), True)]
    finally:
        deploy.RESULT_STORAGE.pop("toy", None)


def test_a_local_fleet_keeps_prefects_default_result_storage(tmp_path):
    from ckptflow.deploy import check_result_storage, render_prefect_yaml

    f = tmp_path / "local.yaml"
    f.write_text(yaml.safe_dump({"fleet": "one-box", "storage": {"kind": "local", "path": str(tmp_path / "s")},
                                 "nodes": [{"name": "node-a", "work_pool": "a"}, {"name": "node-b", "work_pool": "b"}]}))
    check_result_storage(load_fleet(f))                                  # no shared tier: nothing to refuse
    assert _results_envs(render_prefect_yaml(f, ROOT)) == {None}


def _cli_render(fleet_file: Path, *extra: str):
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return subprocess.run([sys.executable, "-m", "ckptflow", "deploy", str(fleet_file), "--render-only", "--api-url",
                           API, *extra], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**base, "COLUMNS": "200"})


def test_the_fleet_file_sets_the_poll_and_the_cli_flag_overrides_it(example, tmp_path):
    text = example.read_text()
    assert "\nworker_query_seconds: 1\n" in text          # the example documents the field
    example.write_text(text.replace("\nworker_query_seconds: 1\n", "\nworker_query_seconds: 4\n"))
    files = render_node_workers(example, ROOT, api_url=API, out_dir=tmp_path / "f")
    assert {_unit_env(u)["PREFECT_WORKER_QUERY_SECONDS"] for u in files["systemd"]} == {"4"}
    assert {e["PREFECT_WORKER_QUERY_SECONDS"] for e in _daemonset_envs(files["kubernetes"][0])} == {"4"}

    out = _cli_render(example, "--worker-query-seconds", "0.5")
    assert out.returncode == 0, out.stderr
    (workers,) = example.parent.glob("*.workers")
    units = sorted((workers / "systemd").glob("ckptflow-prefect-worker-*.service"))
    assert len(units) == len(load_fleet(example).nodes)
    assert {_unit_env(u)["PREFECT_WORKER_QUERY_SECONDS"] for u in units} == {"0.5"}
    assert {e["PREFECT_WORKER_QUERY_SECONDS"] for e in _daemonset_envs(workers / "kubernetes" / "daemonset.yaml")} \
        == {"0.5"}
    assert _worker_query_seconds(_unit_env(units[0])) == 0.5


def test_a_bad_poll_in_the_fleet_file_or_on_the_command_line_is_refused_in_one_line(example, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(example.read_text().replace("\nworker_query_seconds: 1\n", "\nworker_query_seconds: 0\n"))
    with pytest.raises(ConfigError, match=r"worker_query_seconds \(line \d+\): Input should be greater than 0"):
        load_fleet(bad)
    out = _cli_render(example, "--worker-query-seconds", "0")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[0] == "error: worker poll interval 0 s: it must be more than 0 and at most 60 s", lines
    assert lines[1].startswith("fix: pass --worker-query-seconds of about 1") and len(lines) == 2
    assert not list(example.parent.glob("*.workers")) and not list(example.parent.glob("prefect.*.yaml"))


# --- per-node deployments are named after their fleet and node ------------------------------------
def test_per_node_deployment_names_hold_the_fleet(tmp_path):
    """Issue #36 finding 9: two fleets that both have a node-a rendered `heartbeat/node-a` twice, and
    the second deploy replaced the first fleet's. A name never collides with another fleet's, even
    where names joined by '-' would (fleet gpu, node a-1 and fleet gpu-a, node 1)."""
    from ckptflow.deploy import render_prefect_yaml

    def node_deployments(fleet: str, node: str) -> set[tuple[str, str]]:
        d = tmp_path / fleet
        d.mkdir()
        f = d / "fleet.yaml"
        f.write_text(yaml.safe_dump({"fleet": fleet, "storage": {"kind": "local", "path": str(d / "store")},
                                     "nodes": [{"name": node, "work_pool": f"{fleet}-pool"}]}))
        spec = yaml.safe_load(render_prefect_yaml(f, ROOT).read_text())
        return {(x["entrypoint"], x["name"]) for x in spec["deployments"] if "node" in x["parameters"]}

    x, y = node_deployments("fleet-x", "node-a"), node_deployments("fleet-y", "node-a")
    assert len(x) == len(y) == 4 and not x & y
    assert not node_deployments("gpu", "a-1") & node_deployments("gpu-a", "1")
    assert {name for _, name in y} == {"fleet-y:node-a"}


def test_the_naming_and_mount_examples_run():
    import doctest

    from ckptflow import deploy

    runner = doctest.DocTestRunner()
    for fn in (deploy.node_deployment, deploy.fleet_file_mount):
        for t in doctest.DocTestFinder().find(fn):
            runner.run(t)
    res = runner.summarize(verbose=False)
    assert res.failed == 0 and res.attempted >= 6
