"""`ckptflow deploy`: prefect.yaml with the project directory named and checked, and what runs
each node's Prefect worker in production (systemd units, a privileged Kubernetes DaemonSet); the
deploy itself, through Prefect's client, against a real test server."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ckptflow.deploy import FLOW_FILES, check_workdir, render_node_workers, render_prefect_yaml
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


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values]}} (Environment= repeats)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[] "), {})
            continue
        k, v = line.split("=", 1)
        section.setdefault(k, []).append(v)
    return out


def test_a_systemd_unit_per_node_runs_its_pool_as_root_in_the_project(example):
    fleet = load_fleet(example)
    files = render_node_workers(example, ROOT, api_url=API)
    units = {p.name: p for p in files["systemd"]}
    assert sorted(units) == sorted(f"ckptflow-prefect-worker-{fleet.fleet}-{n.name}.service" for n in fleet.nodes)
    for n in fleet.nodes:
        u = _unit(units[f"ckptflow-prefect-worker-{fleet.fleet}-{n.name}.service"])
        s = u["Service"]
        assert s["User"] == ["root"] and s["WorkingDirectory"] == [str(ROOT)]
        assert s["ExecStart"] == [f"{ROOT}/.venv/bin/prefect --no-prompt worker start --pool {n.work_pool} "
                                  f"--name {n.name} --type process"]
        env = dict(e.split("=", 1) for e in s["Environment"])
        assert env["PREFECT_API_URL"] == API and env["CKPTFLOW_NODE"] == n.name
        path = env["PATH"].split(":")
        assert path.index("/usr/local/sbin") < path.index(f"{ROOT}/.carry/criu/bin")  # system CRIU first, then a bundle
        assert s["Restart"] == ["always"] and s["KillMode"] == ["process"]
        assert u["Install"]["WantedBy"] == ["multi-user.target"] and "network-online.target" in u["Unit"]["After"]
    analyze = shutil.which("systemd-analyze")
    if analyze and (ROOT / ".venv/bin/prefect").exists():
        out = subprocess.run([analyze, "verify", *map(str, units.values())], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and "ckptflow-prefect-worker" not in out.stdout + out.stderr, out.stderr


def test_a_privileged_daemonset_per_node_pool(example):
    fleet = load_fleet(example)
    (ds_file,) = render_node_workers(example, ROOT, api_url=API, image="registry.internal/ckptflow:0.1.0")["kubernetes"]
    docs = [d for d in yaml.safe_load_all(ds_file.read_text()) if d]
    assert {d["kind"] for d in docs} == {"DaemonSet"} and {d["apiVersion"] for d in docs} == {"apps/v1"}
    by_pool = {d["spec"]["template"]["spec"]["nodeSelector"]["ckptflow.io/work-pool"]: d for d in docs}
    assert sorted(by_pool) == sorted(n.work_pool for n in fleet.nodes) and len(docs) == len(fleet.nodes)
    for n in fleet.nodes:
        d = by_pool[n.work_pool]
        assert d["metadata"]["name"] == f"ckptflow-prefect-worker-{fleet.fleet}-{n.work_pool}"
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        pod = d["spec"]["template"]["spec"]
        assert pod["hostPID"] is True and pod["hostNetwork"] is True
        (c,) = pod["containers"]
        assert c["securityContext"]["privileged"] is True and c["securityContext"]["runAsUser"] == 0
        assert c["image"] == "registry.internal/ckptflow:0.1.0" and c["workingDir"] == str(ROOT)
        assert c["command"] == [f"{ROOT}/.venv/bin/prefect", "--no-prompt", "worker", "start", "--pool", n.work_pool,
                                "--name", n.name, "--type", "process"]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["PREFECT_API_URL"] == API and env["CKPTFLOW_NODE"] == n.name
        vols = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
        mounts = {m["mountPath"]: vols[m["name"]] for m in c["volumeMounts"]}
        store = str(ROOT / fleet.storage.path.replace("{node}", n.name))
        assert mounts["/dev/shm"] == "/dev/shm" and mounts[store] == store


def test_a_node_path_template_mounts_each_nodes_own_store(tmp_path):
    f = tmp_path / "fleet.yaml"
    data = yaml.safe_load(EXAMPLE.read_text())
    data["storage"]["path"] = "/var/lib/ckptflow/{node}"
    f.write_text(yaml.safe_dump(data))
    (ds_file,) = render_node_workers(f, ROOT, api_url=API)["kubernetes"]
    for d in (d for d in yaml.safe_load_all(ds_file.read_text()) if d):
        pod = d["spec"]["template"]["spec"]
        node = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}["CKPTFLOW_NODE"]
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts == {"/dev/shm", f"/var/lib/ckptflow/{node}", str(tmp_path)}   # tmp_path: the fleet file's


def test_a_node_gone_from_the_fleet_loses_its_unit(example):
    units = render_node_workers(example, ROOT, api_url=API)["systemd"]
    data = yaml.safe_load(example.read_text())
    data["nodes"] = [n for n in data["nodes"] if n["name"] != "h200-08"]
    data["workloads"] = [w for w in data["workloads"] if w["node"] != "h200-08"]
    example.write_text(yaml.safe_dump(data))
    again = render_node_workers(example, ROOT, api_url=API)["systemd"]
    assert sorted(p.name for p in units[0].parent.iterdir()) == sorted(p.name for p in again)
    assert len(again) == len(units) - 1 and not (units[0].parent / "ckptflow-prefect-worker-example-h200-h200-08.service").exists()


def test_prefect_yaml_names_the_project_directory(example):
    text = render_prefect_yaml(example, ROOT).read_text()
    assert "{{ $PWD }}" not in text
    doc = yaml.safe_load(text)
    (step,) = doc["pull"]
    assert step["prefect.deployments.steps.set_working_directory"]["directory"] == str(ROOT)
    entry_files = {d["entrypoint"].split(":")[0] for d in doc["deployments"]}
    assert entry_files == set(FLOW_FILES)          # what check_workdir looks for is what the flows need
    assert {d["parameters"]["fleet_file"] for d in doc["deployments"]} == {str(example)}  # outside: absolute


def test_a_fleet_file_inside_the_project_is_named_relative_to_it(tmp_path):
    proj = tmp_path / "proj"
    for f in FLOW_FILES:
        (proj / f).parent.mkdir(parents=True, exist_ok=True)
        (proj / f).write_text("")
    (proj / "deployments").mkdir()
    fleet = proj / "deployments" / "local.yaml"
    fleet.write_text((ROOT / "deployments" / "local.yaml").read_text())
    doc = yaml.safe_load(render_prefect_yaml(fleet, proj).read_text())
    assert {d["parameters"]["fleet_file"] for d in doc["deployments"]} == {"deployments/local.yaml"}


def test_a_directory_without_the_project_is_refused(tmp_path, example):
    with pytest.raises(ConfigError, match=r"does not hold the ckptflow project \(no ckptflow/flows/heartbeat.py\)"):
        check_workdir(tmp_path)
    assert check_workdir(ROOT) == ROOT.resolve()


def _ckptflow(cwd, *args, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return subprocess.run([sys.executable, "-m", "ckptflow", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**base, "COLUMNS": "200", **env})


def test_cli_refuses_a_workdir_without_the_project_in_one_line(tmp_path, example):
    for cwd, extra in ((ROOT, ("--workdir", tmp_path / "nothing-here")), (tmp_path, ())):
        out = _ckptflow(cwd, "deploy", example, "--render-only", *extra)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert lines[0].startswith("error: ") and "does not hold the ckptflow project" in lines[0]
        assert lines[1].startswith("fix: ") and "--workdir" in lines[1] and len(lines) == 2
        assert not (tmp_path / "prefect.example-h200.yaml").exists()
        assert not (tmp_path / "example-h200.workers").exists()


def test_cli_render_only_writes_every_file_and_says_where(tmp_path, example):
    out = _ckptflow(ROOT, "deploy", example, "--render-only", PREFECT_API_URL=API)
    assert out.returncode == 0, out.stderr
    # Every file by its own name: `ckptflow-prefect-worker-<fleet>-<node>.service` named no file (#36).
    assert out.stdout.splitlines() == [
        f"rendered {tmp_path}/prefect.example-h200.yaml",
        *(f"rendered {tmp_path}/example-h200.workers/systemd/ckptflow-prefect-worker-example-h200-h200-0{i}.service" for i in range(1, 9)),
        f"rendered {tmp_path}/example-h200.workers/kubernetes/daemonset.yaml (8 DaemonSets, one per node pool)"]
    assert API in (tmp_path / "example-h200.workers/systemd/ckptflow-prefect-worker-example-h200-h200-03.service").read_text()
    assert "warning" not in out.stderr


# --- deploy itself, through Prefect's client, against a real (test) Prefect server --------------
def _fleet(tmp_path: Path, name: str, schedules: bool = True, node: str | None = None) -> Path:
    data = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    data["fleet"] = name
    node = node or f"{name}-node"
    data["nodes"] = [{**data["nodes"][0], "name": node, "work_pool": f"{name}-pool"}]
    data["workloads"] = [{**w, "node": node} for w in data["workloads"]]
    if not schedules:
        data.pop("schedules", None)
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def _deployments(client, fleet: str) -> dict:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterTags

    found = client.read_deployments(deployment_filter=DeploymentFilter(tags=DeploymentFilterTags(all_=[f"fleet:{fleet}"])))
    return {(d.entrypoint, d.name): d for d in found}


def test_deploy_creates_what_the_rendered_prefect_yaml_says(tmp_path, prefect_harness):
    from prefect.client.orchestration import get_client

    from ckptflow.deploy import deploy, node_deployment

    fleet = _fleet(tmp_path, "dep1")
    out = deploy(fleet, workdir=ROOT, api_url=API)
    spec = yaml.safe_load(out.read_text())
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("dep1-pool")
        # The process worker's own job template, so a deployment's env job variable reaches the run.
        assert pool.type == "process" and "env" in pool.base_job_template["variables"]["properties"]
        assert client.read_global_concurrency_limit_by_name("ckptflow-node-dep1-node").limit == 1
        got = _deployments(client, "dep1")
        assert sorted(got) == sorted((d["entrypoint"], d["name"]) for d in spec["deployments"])
        for d in spec["deployments"]:
            dep = got[(d["entrypoint"], d["name"])]
            assert dep.parameters == d["parameters"] and sorted(dep.tags) == sorted(d["tags"])
            assert (dep.work_pool_name, dep.job_variables) == (d["work_pool"]["name"], d["work_pool"]["job_variables"])
            assert dep.pull_steps == spec["pull"]                       # runs start in the project directory
            assert "fleet_file" in dep.parameter_openapi_schema["properties"]   # read from the flow's code
            limit = dep.global_concurrency_limit.limit if dep.global_concurrency_limit else None
            assert limit == d.get("concurrency_limit")
            want = [s["interval"] for s in d.get("schedules") or []]
            assert [s.schedule.interval.total_seconds() for s in dep.schedules] == want
        heartbeat = got[("ckptflow/flows/heartbeat.py:heartbeat", node_deployment("dep1", "dep1-node"))]
        assert heartbeat.job_variables == {"env": {"CKPTFLOW_NODE_LIMITS": "1"}}
        assert [s.schedule.interval.total_seconds() for s in heartbeat.schedules] == [300]

        # Again: updated in place (same ids, one schedule each); a schedule gone from the fleet file goes.
        deploy(fleet, workdir=ROOT, api_url=API)
        again = _deployments(client, "dep1")
        assert {k: d.id for k, d in again.items()} == {k: d.id for k, d in got.items()}
        hb = ("ckptflow/flows/heartbeat.py:heartbeat", node_deployment("dep1", "dep1-node"))
        assert len(again[hb].schedules) == 1
        deploy(_fleet(tmp_path, "dep1", schedules=False), workdir=ROOT, api_url=API)
        assert _deployments(client, "dep1")[hb].schedules == []


NODE_FLOWS = {"ckptflow/flows/heartbeat.py:heartbeat": "heartbeat", "ckptflow/flows/invalidate.py:invalidate":
              "invalidate", "ckptflow/flows/verify.py:verify": "verify", "ckptflow/flows/node_step.py:node_step":
              "node-step"}


def test_two_fleets_with_a_node_of_the_same_name_keep_their_own_deployments(tmp_path, prefect_harness):
    """Issue #36 finding 9: per-node deployments were named after the node alone, so the second
    fleet's `heartbeat/node-a` replaced the first's, and its schedule then ran the other fleet."""
    from prefect.client.orchestration import get_client

    from ckptflow.deploy import deploy, node_deployment

    files = {name: _fleet(tmp_path, name, node="node-a") for name in ("twin-x", "twin-y")}
    for f in files.values():
        deploy(f, workdir=ROOT, api_url=API, all_nodes_here=True)
    with get_client(sync_client=True) as client:
        ids = set()
        for name, f in files.items():
            got = {entry: d for (entry, _), d in _deployments(client, name).items()}
            assert set(NODE_FLOWS) <= set(got), f"{name}'s node deployments were replaced by the other fleet's"
            for entry, flow in NODE_FLOWS.items():
                d = got[entry]
                assert d.parameters == {"fleet_file": str(f), "node": "node-a"} and d.work_pool_name == f"{name}-pool"
                ids.add(d.id)
                # What run_deployment and `prefect deployment run` look up: this fleet's, by its name.
                assert client.read_deployment_by_name(node_deployment(name, "node-a", flow)).id == d.id
        assert len(ids) == 2 * len(NODE_FLOWS)


def test_deploy_to_a_server_that_is_not_there_is_one_line(tmp_path):
    from conftest import free_port

    api = f"http://127.0.0.1:{free_port()}/api"
    out = _ckptflow(ROOT, "deploy", _fleet(tmp_path, "dep2"), "--api-url", API, PREFECT_API_URL=api)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 2, out.stderr
    assert lines[0].startswith(f"error: deploy of prefect.dep2.yaml to {api} failed at work pool dep2-pool: ")
    assert "Connection refused" in lines[0], lines[0]
    assert lines[1] == "fix: check PREFECT_API_URL points at your Prefect server"


# --- the node workers' Prefect API URL is explicit, and never loopback on another machine -------
LOOPBACK = "http://127.0.0.1:4200/api"


def test_a_loopback_api_url_is_refused_for_nodes_on_other_machines(example):
    with pytest.raises(ConfigError) as e:
        render_node_workers(example, ROOT, api_url=LOOPBACK)
    assert str(e.value).startswith(f"--api-url {LOOPBACK} is a loopback address: on node h200-01 (and 7 more) "
                                   "it would name that node itself, not the Prefect server")
    assert "--api-url http://<the Prefect server" in e.value.fix
    assert not (example.parent / "example-h200.workers").exists()
    # Every node on this machine (a one-box fleet, said so): loopback is right there.
    render_node_workers(example, ROOT, api_url=LOOPBACK, all_nodes_here=True)
    # The fix keeps the port and path the operator used (the trial's server ran on 4299).
    with pytest.raises(ConfigError) as e:
        render_node_workers(example, ROOT, api_url="http://127.0.0.1:4299/api")
    assert "as the nodes reach it>:4299/api" in e.value.fix


def test_cli_refuses_the_shells_loopback_url_for_remote_nodes_before_writing_anything(tmp_path, example):
    out = _ckptflow(ROOT, "deploy", example, "--render-only", PREFECT_API_URL=LOOPBACK)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 2, out.stderr
    assert lines[0] == (f"error: this shell's PREFECT_API_URL {LOOPBACK} is a loopback address: on node h200-01 "
                        "(and 7 more) it would name that node itself, not the Prefect server")
    assert not (tmp_path / "prefect.example-h200.yaml").exists()
    # Taken explicitly: written into every unit, and said where it came from when it was not.
    out = _ckptflow(ROOT, "deploy", example, "--render-only", "--api-url", API, PREFECT_API_URL=LOOPBACK)
    assert out.returncode == 0, out.stderr
    assert _unit(tmp_path / "example-h200.workers/systemd/ckptflow-prefect-worker-example-h200-h200-01.service")[
        "Service"]["Environment"].count(f"PREFECT_API_URL={API}") == 1
    out = _ckptflow(ROOT, "deploy", example, "--render-only", PREFECT_API_URL=API)
    assert f"note: the node workers reach Prefect at {API} (this shell's PREFECT_API_URL" in out.stderr


def _names_resolving_to_loopback() -> list[str]:
    """Names a real lookup maps to loopback here, no DNS involved: glibc reads a bare number as
    an IPv4 address (2130706433 is 127.0.0.1) on any Linux; this machine's own name where
    /etc/hosts maps it to 127.0.0.1 or 127.0.1.1 (the trial's `--api-url http://vm:4200/api`)."""
    import ipaddress
    import socket

    names = ["2130706433"]
    host = socket.gethostname()
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        addrs = set()
    if addrs and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        names.append(host)
    return names


@pytest.mark.parametrize("name", _names_resolving_to_loopback())
def test_a_name_that_resolves_to_loopback_is_refused_for_remote_nodes(example, name):
    from ckptflow.deploy import is_loopback

    url = f"http://{name}:4200/api"
    assert is_loopback(url)
    out = _ckptflow(ROOT, "deploy", example, "--render-only", "--api-url", url)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 2, out.stderr
    assert lines[0].startswith(f"error: --api-url {url} is a loopback address ({name} resolves to 127.0.")
    assert lines[0].endswith(" here): on node h200-01 (and 7 more) it would name that node itself, "
                             "not the Prefect server")
    assert lines[1].startswith("fix: pass --api-url http://<the Prefect server, as the nodes reach it>:4200/api")
    assert not (example.parent / "example-h200.workers").exists()


def test_is_loopback_without_dns_in_its_examples_and_a_name_that_does_not_resolve_is_not():
    import doctest

    from ckptflow import deploy

    for fn in (deploy.is_loopback, deploy.loopback_addresses):
        runner = doctest.DocTestRunner()
        for t in doctest.DocTestFinder().find(fn):
            runner.run(t)
        assert runner.summarize(verbose=False).failed == 0
    assert deploy.is_loopback("http://localhost.:4200/api") and deploy.is_loopback("http://[::1]:4200/api")
    assert not deploy.is_loopback("http://ckptflow-no-such-host.invalid:4200/api")
    assert not deploy.is_loopback(API)


def test_a_resolver_that_never_answers_costs_the_timeout_not_a_hang(monkeypatch):
    import socket
    import threading
    import time

    from ckptflow import deploy

    release = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: release.wait(30) and [])
    monkeypatch.setattr(deploy, "_RESOLVE_TIMEOUT_S", 0.2)
    t0 = time.monotonic()
    try:
        assert not deploy.is_loopback("http://prefect.example:4200/api")
    finally:
        release.set()
    assert time.monotonic() - t0 < 2


def test_a_one_box_fleet_keeps_its_loopback_url(tmp_path):
    f = tmp_path / "local.yaml"
    f.write_text((ROOT / "deployments" / "local.yaml").read_text())
    unit, = render_node_workers(f, ROOT, api_url=LOOPBACK)["systemd"]
    assert f"PREFECT_API_URL={LOOPBACK}" in unit.read_text()


def test_daemonset_mounts_what_the_fleet_files_workloads_name(tmp_path):
    f = tmp_path / "fleet.yaml"
    data = yaml.safe_load(EXAMPLE.read_text())
    data["storage"]["path"] = "/var/lib/ckptflow/{node}"
    data["workloads"][0]["find"] = {"pid_file": "/run/vllm/g0.pid"}
    data["workloads"][0]["start_command"] = [
        "sh", "-c", "exec /usr/bin/env vllm serve /models/llama-70b --port 8000 > /var/log/vllm/g0.log 2>&1"]
    data["workloads"][1]["find"] = {"pid_file": "/run/vllm/g1.pid"}
    data["workloads"][1]["start_command"] = ["llama-server", "--slot-save-path=/srv/slots/g1", "-m", "/models/q.gguf"]
    f.write_text(yaml.safe_dump(data))
    (ds_file,) = render_node_workers(f, ROOT, api_url=API)["kubernetes"]
    pods = {d["metadata"]["labels"]["ckptflow.io/work-pool"]: d["spec"]["template"]["spec"]
            for d in yaml.safe_load_all(ds_file.read_text()) if d}
    pool = data["nodes"][0]["work_pool"]
    pod = pods[pool]
    vols = {v["name"]: v["hostPath"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: vols[m["name"]]["path"] for m in pod["containers"][0]["volumeMounts"]}
    assert set(mounts) == {"/dev/shm", "/var/lib/ckptflow/h200-01", "/run/vllm", "/models", "/var/log/vllm",
                           "/srv/slots", str(tmp_path)}                       # tmp_path: the fleet file's
    assert all(mounts[p] == p for p in mounts)                               # the same path on the host
    assert "# pid file of vllm-n01-g0" in ds_file.read_text()
    other = next(p for name, p in pods.items() if name != pool)               # no workload of those: none
    assert {m["mountPath"] for m in other["containers"][0]["volumeMounts"]} == {
        "/dev/shm", f"/var/lib/ckptflow/{next(n['name'] for n in data['nodes'] if n['work_pool'] != pool)}",
        str(tmp_path)}


def test_every_entrypoint_loads_its_flow_and_deployments_made_before_the_split_still_do(example):
    """One module per flow (flows/drain.py, flows/scale.py); a deployment made while drain and
    scale-up/-down lived in flows/migrate.py names that file, and loads the same flows."""
    from prefect.flows import load_flow_from_entrypoint

    doc = yaml.safe_load(render_prefect_yaml(example, ROOT).read_text())
    entries = {d["entrypoint"] for d in doc["deployments"]}
    old = {"ckptflow/flows/migrate.py:drain", "ckptflow/flows/migrate.py:scale_up",
           "ckptflow/flows/migrate.py:scale_down"}
    assert not entries & old
    for entry in sorted(entries | old):
        flow = load_flow_from_entrypoint(f"{ROOT}/{entry}")
        assert flow.name == entry.rsplit(":", 1)[1].replace("_", "-"), entry


def test_a_two_tier_workload_gets_a_turn_end_exporter_unit_on_its_node(tmp_path, example):
    data = yaml.safe_load(example.read_text())
    w = data["workloads"][0]
    w["checkpoint"] = "template-sessions"
    w["engine"] = "demo"  # a worker that serves the protocol (a vLLM is refused at load: it serves none)
    w["gpu"] = False
    f = tmp_path / "tt.yaml"
    f.write_text(yaml.safe_dump(data))
    fleet = load_fleet(f)
    files = render_node_workers(f, ROOT, api_url=API)
    assert [p.name for p in files["turns"]] == [f"ckptflow-turns-{fleet.fleet}-{w['name']}.service"]
    s = _unit(files["turns"][0])["Service"]
    assert s["ExecStart"] == [f"{ROOT}/.venv/bin/ckptflow turns {f} {w['name']} --every 2"]
    env = dict(e.split("=", 1) for e in s["Environment"])
    assert env["CKPTFLOW_NODE"] == fleet.workload(w["name"]).node
    # Back to a process workload: its exporter unit goes with the next render.
    w["checkpoint"] = "process"
    f.write_text(yaml.safe_dump(data))
    assert render_node_workers(f, ROOT, api_url=API)["turns"] == []
    assert not files["turns"][0].exists()


def test_two_fleets_with_a_node_named_alike_render_units_of_different_names(tmp_path, example):
    # New-user trial: both fleets' `local` node rendered ckptflow-prefect-worker-local.service,
    # and installing the second into /etc/systemd/system replaced the first fleet's worker.
    names, dss = [], []
    for fleet_name in ("fleet-a", "fleet-b"):
        data = yaml.safe_load(example.read_text())
        data["fleet"] = fleet_name
        f = tmp_path / f"{fleet_name}.yaml"
        f.write_text(yaml.safe_dump(data))
        files = render_node_workers(f, ROOT, api_url=API, out_dir=tmp_path / fleet_name)
        names.append({p.name for p in files["systemd"]})
        dss.append([d for d in yaml.safe_load_all(files["kubernetes"][0].read_text()) if d])
    node = yaml.safe_load(example.read_text())["nodes"][0]["name"]
    assert f"ckptflow-prefect-worker-fleet-a-{node}.service" in names[0]
    assert names[0].isdisjoint(names[1]) and len(names[0]) == len(names[1])
    # The same for their DaemonSets in one namespace (#36): other names, and selectors that do
    # not match the other fleet's pods (a DaemonSet of one would otherwise count the other's).
    (a, b) = ({d["metadata"]["name"] for d in ds} for ds in dss)
    assert a.isdisjoint(b) and len(a) == len(b) == len(yaml.safe_load(example.read_text())["nodes"])
    for mine, theirs in (dss, dss[::-1]):
        for d in mine:
            sel = d["spec"]["selector"]["matchLabels"]
            assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
            assert not any(sel.items() <= o["spec"]["template"]["metadata"]["labels"].items() for o in theirs)
