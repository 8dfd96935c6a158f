"""Fleet files: the shipped ones load; each kind of mistake names its file, field path and line."""

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptflow.errors import ConfigError
from ckptflow.fleet import load_fleet

ROOT = Path(__file__).parent.parent
GOOD = """\
fleet: t
nodes:
  - name: n1
    work_pool: n1
    mtbf_hours: 6000
workloads:
  - name: w1
    node: n1
    find: {pid_file: /run/w1.pid}
    engine: vllm
    metrics_url: http://127.0.0.1:8000/metrics
policies:
  - match: {traffic: long_sessions}
    policy: cost-based
"""


def test_shipped_fleets_load():
    local = load_fleet(ROOT / "deployments/local.yaml")
    assert local.workload("demo-chat").kv_capacity_tokens == 65536
    # Relative to the file: the repository's .ckptflow/, wherever the command runs (issue #36).
    assert local.storage.path == str(ROOT.resolve() / ".ckptflow" / "store")
    assert local.workload("demo-chat").find.pid_file == str(ROOT.resolve() / ".ckptflow" / "run" / "demo-chat.pid")
    assert load_fleet(ROOT / "deployments" / "example-every-field.yaml").workloads
    ex = load_fleet(ROOT / "deployments/example-h200-fleet.yaml")
    assert len(ex.nodes) == 8 and all(n.gpus == 8 for n in ex.nodes)
    assert {w.engine.value for w in ex.workloads} == {"vllm", "sglang"}
    assert sum(len(n.maintenance) for n in ex.nodes) == 1


MISTAKES = [
    # (what, edit of the parsed GOOD yaml, expected path, expected text)
    ("unknown top-level key", lambda d: d.update(fleets="x"), "fleets", "unknown field 'fleets'; did you mean 'fleet'?"),
    # Issue #36: pydantic's "Extra inputs are not permitted" named no field that was meant.
    ("misspelt workload field", lambda d: d["workloads"][0].update(helth_url="http://127.0.0.1:8000/health"),
     "workloads[0].helth_url", "unknown field 'helth_url'; did you mean 'health_url'?"),
    ("misspelt finder field", lambda d: d["workloads"][0]["find"].update(cmdline_must_contian="vllm"),
     "workloads[0].find.cmdline_must_contian", "unknown field 'cmdline_must_contian'; did you mean "
     "'cmdline_must_contain'?"),
    ("misspelt schedule field", lambda d: d.update(schedules={"heartbeat": {"intervel_s": 60}}),
     "schedules.heartbeat.intervel_s", "unknown field 'intervel_s'; did you mean 'interval_s'?"),
    ("misspelt retention field", lambda d: d.update(retention={"kep": 5}),
     "retention.kep", "unknown field 'kep'; did you mean 'keep'?"),
    ("misspelt container mount field", lambda d: d["workloads"].append(
        {"name": "c1", "node": "n1", "container": {"name": "c1", "mounts": [{"source": "/m", "traget": "/m"}]}}),
     "workloads[1].container.mounts[0].traget", "unknown field 'traget'; did you mean 'target'?"),
    ("unknown field like none", lambda d: d["nodes"][0].update(zzz=1),
     "nodes[0].zzz", "unknown field 'zzz' (fields here: name, work_pool, gpu_class,"),
    ("missing nodes", lambda d: d.pop("nodes"), "nodes", "Field required"),
    ("empty nodes", lambda d: d.update(nodes=[]), "nodes", "at least 1 item"),
    ("workload on undeclared node", lambda d: d["workloads"][0].update(node="n9"), "workloads[0].node",
     "node 'n9' is not declared"),
    ("bad workload name", lambda d: d["workloads"][0].update(name="../../etc"), "workloads[0].name",
     "not a valid name"),
    ("two process finders", lambda d: d["workloads"][0]["find"].update(cmdline_match="vllm"),
     "workloads[0].find", "exactly one of"),
    ("unknown engine", lambda d: d["workloads"][0].update(engine="tgi"), "workloads[0].engine",
     "unknown engine 'tgi' (known: demo, llamacpp, other, sglang, vllm)"),
    ("metrics of an engine without an adapter", lambda d: d["workloads"][0].update(engine="other"),
     "workloads[0].metrics_url", "engine: other has no metrics mapping, so its /metrics cannot be read: "
     "declare the engine (demo, llamacpp, sglang, vllm) or drop metrics_url"),
    ("metrics_url not a string", lambda d: d["workloads"][0].update(metrics_url=8000),
     "workloads[0].metrics_url", "valid string"),
    ("negative MTBF", lambda d: d["nodes"][0].update(mtbf_hours=-1), "nodes[0].mtbf_hours", "greater than 0"),
    ("unknown policy", lambda d: d["policies"][0].update(policy="yolo"), "policies[0].policy",
     "unknown policy 'yolo'"),
    ("duplicate workload", lambda d: d["workloads"].append(dict(d["workloads"][0])), "workloads[1].name",
     "duplicate name 'w1'"),
    ("window ends before it starts", lambda d: d["nodes"][0].update(
        maintenance=[{"start": "2026-12-01T04:00:00Z", "end": "2026-12-01T02:00:00Z"}]),
     "nodes[0].maintenance[0]", "is not after start"),
    ("s3 without bucket", lambda d: d.update(storage={"kind": "s3"}), "storage", "no bucket"),
    ("schedule with both", lambda d: d.update(schedules={"heartbeat": {"interval_s": 60, "cron": "* * * * *"}}),
     "schedules.heartbeat", "exactly one of interval_s or cron"),
    ("a cron of four fields", lambda d: d.update(schedules={"heartbeat": {"cron": "*/5 * * *"}}),
     "schedules.heartbeat", "cron '*/5 * * *' has 4 fields; a cron expression has 5"),
    ("unknown schedule", lambda d: d.update(schedules={"backup": {"interval_s": 60}}), "schedules.backup",
     "heartbeat"),
    ("footprint negative", lambda d: d["workloads"][0].update(gpu_footprint_gib=-5),
     "workloads[0].gpu_footprint_gib", "greater than or equal to 0"),
    ("misspelt policy parameter", lambda d: d["policies"][0].update(params={"min_intervl_s": 60}),
     "policies[0].params.min_intervl_s", "policy cost-based has no parameter 'min_intervl_s' (its parameters: "
     "min_interval_s, max_interval_s, short_request_s, burst_factor, maintenance_lead_s); did you mean 'min_interval_s'?"),
    ("misspelt checkpoint mode parameter", lambda d: d["workloads"][0].update(
        checkpoint="template-sessions", checkpoint_params={"min_sesion_tokens": 64}),
     "workloads[0].checkpoint_params", "checkpoint mode template-sessions has no parameter 'min_sesion_tokens' "
     "(its parameters: min_session_tokens); did you mean 'min_session_tokens'?"),
    ("parameter of another policy", lambda d: d["policies"][0].update(policy="never", params={"interval_s": 60}),
     "policies[0].params.interval_s", "policy never has no parameter 'interval_s' (its parameters: none)"),
    ("policy parameter not a number", lambda d: d["policies"][0].update(params={"max_interval_s": "daily"}),
     "policies[0].params.max_interval_s", "valid number"),
    ("policy bounds crossed", lambda d: d["policies"][0].update(params={"min_interval_s": 600, "max_interval_s": 60}),
     "policies[0].params", "min_interval_s 600 is above max_interval_s 60"),
    ("two tiers for a TP group", lambda d: d["workloads"][0].update(tensor_parallel=2, checkpoint="template-sessions"),
     "workloads[0]", "template-sessions is not supported with tensor_parallel > 1 yet"),
    ("two workloads, one metrics URL", lambda d: d["workloads"].append(
        {"name": "w2", "node": "n1", "find": {"pid_file": "/run/w2.pid"}, "metrics_url": "http://127.0.0.1:8000/metrics"}),
     "workloads[1].metrics_url", "'http://127.0.0.1:8000/metrics' is also the metrics_url of workloads[0] ('w1')"),
    ("two workloads, one health URL via localhost", lambda d: (
        d["workloads"][0].update(health_url="http://127.0.0.1:8000/health"), d["workloads"].append(
            {"name": "w2", "node": "n1", "find": {"pid_file": "/run/w2.pid"}, "health_url": "http://localhost:8000/health"})),
     "workloads[1].health_url", "is also the health_url of workloads[0] ('w1')"),
    ("two workloads, one probe URL", lambda d: (
        d["workloads"][0].update(probe_url="http://10.0.0.5:8000/digests"), d["workloads"].append(
            {"name": "w2", "node": "n9x", "find": {"pid_file": "/run/w2.pid"}, "probe_url": "http://10.0.0.5:8000/digests"}),
        d["nodes"].append({"name": "n9x", "work_pool": "p"})),
     "workloads[1].probe_url", "is also the probe_url of workloads[0] ('w1'): two workloads would act on one worker"),
    ("two workloads, one pid file", lambda d: d["workloads"].append(
        {"name": "w2", "node": "n1", "find": {"pid_file": "/run/w1.pid"}}),
     "workloads[1].find.pid_file", "'/run/w1.pid' is also the find.pid_file of workloads[0] ('w1')"),
    ("one pid file spelt another way", lambda d: d["workloads"].append(
        {"name": "w2", "node": "n1", "find": {"pid_file": "/run/./x/../w1.pid"}}),
     "workloads[1].find.pid_file", "'/run/./x/../w1.pid' is also the find.pid_file of workloads[0] ('w1')"),
    ("misspelt storage placeholder", lambda d: d.update(storage={"path": "/var/lib/ckptflow/{nod}"}),
     "storage.path", "unknown placeholder {nod} in '/var/lib/ckptflow/{nod}' (known: {node})"),
    ("two tiers for llama.cpp", lambda d: d["workloads"][0].update(engine="llamacpp", checkpoint="template-sessions"),
     "workloads[0].checkpoint", "template-sessions is not supported with engine: llamacpp"),
    ("two tiers for a worker that is not a host process", lambda d: d["workloads"][0].update(
        checkpoint="template-sessions", runtime="podman", find=None, container={"name": "c"}),
     "workloads[0].checkpoint", "a container workload is checkpointed whole"),
    # Held-out mistakes of a second trial (each was accepted without a word).
    ("a golden request on the port another workload serves", lambda d: d["workloads"].append(
        {"name": "w2", "node": "n1", "find": {"pid_file": "/run/w2.pid"}, "health_url": "http://127.0.0.1:8001/health",
         "golden": {"url": "http://127.0.0.1:8000/v1/completions", "body": {}}}),
     "workloads[1].golden.url", "'http://127.0.0.1:8000/v1/completions' is on port 8000 of node 'n1', which is the "
     "metrics_url of workloads[0] ('w1'): it would reach that worker"),
    ("a resume_url on another workload's port", lambda d: d["workloads"].append(
        {"name": "w2", "node": "n1", "find": {"pid_file": "/run/w2.pid"}, "resume_url": "http://localhost:8000/resume"}),
     "workloads[1].resume_url", "which is the metrics_url of workloads[0] ('w1')"),
    ("one container for two workloads", lambda d: d["workloads"].extend([
        {"name": "c1", "node": "n1", "container": {"name": "chat-c"}},
        {"name": "c2", "node": "n1", "container": {"name": "chat-c"}}]),
     "workloads[2].container.name", "'chat-c' is also the container.name of workloads[1] ('c1')"),
    ("one pod's container for two workloads", lambda d: d["workloads"].extend([
        {"name": "k1", "node": "n1", "container": {"name": "a", "kubernetes": {"namespace": "s", "pod": "p-0",
                                                                             "container": "vllm"}}},
        {"name": "k2", "node": "n1", "container": {"name": "b", "kubernetes": {"namespace": "s", "pod": "p-0",
                                                                             "container": "vllm"}}}]),
     "workloads[2].container.kubernetes", "'s/p-0/vllm' is also the container.kubernetes of workloads[1] ('k1')"),
    ("a port that is no number", lambda d: d["workloads"][0].update(metrics_url="http://127.0.0.1:8o00/metrics"),
     "workloads[0].metrics_url", "'http://127.0.0.1:8o00/metrics' is not a URL (Port could not be cast"),
    ("a port out of range", lambda d: d["workloads"][0].update(metrics_url="http://127.0.0.1:80000/metrics"),
     "workloads[0].metrics_url", "'http://127.0.0.1:80000/metrics' is not a URL (Port out of range"),
    ("a cmdline_match that is no regular expression", lambda d: d["workloads"][0].update(
        find={"cmdline_match": "sglang.launch_server (.* --port 8001"}),
     "workloads[0].find", "cmdline_match 'sglang.launch_server (.* --port 8001' is not a regular expression"),
    ("a container's health on a port it does not publish", lambda d: d["workloads"].append(
        {"name": "c1", "node": "n1", "container": {"name": "c1", "ports": [{"host": 18111, "container": 8000}]},
         "health_url": "http://127.0.0.1:18101/health"}),
     "workloads[1].health_url", "'http://127.0.0.1:18101/health' is on host port 18101, which container 'c1' does "
     "not publish (ports: 18111)"),
    ("a kubelet_url with a typo'd scheme", lambda d: d["workloads"].append(
        {"name": "k1", "node": "n1", "container": {"name": "a", "kubernetes": {
            "namespace": "s", "pod": "p-0", "container": "vllm", "kubelet_url": "htps://127.0.0.1:10250"}}}),
     "workloads[1].container.kubernetes.kubelet_url", "'htps://127.0.0.1:10250' is not an http(s) URL with a host"),
    ("a namespace that is no DNS label", lambda d: d["workloads"].append(
        {"name": "k1", "node": "n1", "container": {"name": "a", "kubernetes": {
            "namespace": "Serving_NS", "pod": "p-0", "container": "vllm"}}}),
     "workloads[1].container.kubernetes.namespace", "'Serving_NS' is not a Kubernetes namespace name"),
    # Issue #36 item 1: contradictions between workloads and their node.
    ("a container publishes the port another workload serves on", lambda d: d["workloads"].append(
        {"name": "c2", "node": "n1", "container": {"name": "c2", "ports": [{"host": 8000, "container": 8000}]}}),
     "workloads[1].container.ports[0].host",
     "host port 8000 on node 'n1' is also the metrics_url of workloads[0] ('w1'): published here, the restore "
     "could not bind it"),
    ("two containers publish one host port", lambda d: d["workloads"].extend([
        {"name": "c1", "node": "n1", "container": {"name": "c1", "ports": [{"host": 18101, "container": 8000}]}},
        {"name": "c2", "node": "n1", "container": {"name": "c2", "ports": [{"host": 18101, "container": 9000}]}}]),
     "workloads[2].container.ports[0].host",
     "host port 18101 on node 'n1' is also published by workloads[1] ('c1').container.ports[0]"),
    ("more ranks than the node has GPUs", lambda d: (d["nodes"][0].update(gpus=2), d["workloads"][0].update(
        gpu=True, tensor_parallel=4)),
     "workloads[0].tensor_parallel", "tensor_parallel 4 needs 4 GPUs, but its node 'n1' declares gpus: 2"),
    ("two nodes on one work pool", lambda d: d["nodes"].append({"name": "n2", "work_pool": "n1"}),
     "nodes[1].work_pool", "work pool 'n1' is also the work_pool of nodes[0] ('n1'): a node step for either could "
     "run on the other's worker; give node 'n2' a pool of its own"),
    ("a GPU workload on a node that declares no GPU", lambda d: d["workloads"][0].update(gpu=True),
     "workloads[0].gpu", "workloads[0] ('w1') is gpu: true, but its node 'n1' declares no GPU (gpus: 0, "
     "gpu_class: cpu)"),
    ("both places for the chunk key", lambda d: d.update(storage={
        "kind": "s3", "bucket": "b", "encryption_key_env": "K", "encryption_key_block": "chunk-key"}),
     "storage.encryption_key_block", "both encryption_key_env ('K') and encryption_key_block ('chunk-key') are set"),
    ("a slack block with nothing to send with", lambda d: d.update(slack={"channel": "#gpu-oncall"}),
     "slack", "no webhook_url_env, token_env or secret_block is set, so no alert can be sent"),
    ("a bot token without a channel", lambda d: d.update(slack={"token_env": "SLACK_BOT_TOKEN"}),
     "slack.channel", "token_env ('SLACK_BOT_TOKEN') posts as a bot, which needs a channel"),
]


@pytest.mark.parametrize("what,edit,path,text", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_mistake_names_file_path_and_expectation(tmp_path, what, edit, path, text):
    data = yaml.safe_load(GOOD)
    edit(data)
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_fleet(f)
    msg = str(e.value)
    assert f"{f}: {path}" in msg, msg
    assert text in msg, msg
    assert "(line " in msg


def test_what_the_new_checks_must_not_refuse(tmp_path):
    """Right both ways: a GPU node that names its class but not its count, the control pool shared
    with a node's (the default), a webhook with a channel, a secret block alone, one chunk key."""
    data = yaml.safe_load(GOOD)
    data["nodes"] += [{"name": "g1", "work_pool": "g1", "gpu_class": "H200-141GB"},
                      {"name": "g2", "work_pool": "g2", "gpus": 8}]
    data["control_pool"] = "n1"
    data["workloads"] += [{"name": "a", "node": "g1", "find": {"pid_file": "/run/a.pid"}, "gpu": True},
                          {"name": "b", "node": "g2", "find": {"pid_file": "/run/b.pid"}, "gpu": True}]
    data["storage"] = {"kind": "s3", "bucket": "b", "encryption_key_block": "chunk-key"}
    for slack in ({"webhook_url_env": "HOOK", "channel": "#oncall"}, {"secret_block": "slack-hook"},
                  {"token_env": "TOKEN", "channel": "#oncall"}):
        data["slack"] = slack
        f = tmp_path / "fleet.yaml"
        f.write_text(yaml.safe_dump(data, sort_keys=False))
        fleet = load_fleet(f)
        assert [w.name for w in fleet.workloads] == ["w1", "a", "b"] and fleet.slack.model_dump(exclude_none=True) == slack


def test_the_same_host_port_on_two_nodes_and_a_containers_own_health_url_are_no_clash(tmp_path):
    data = yaml.safe_load(GOOD)
    data["nodes"].append({"name": "n2", "work_pool": "n2", "gpus": 8})
    data["workloads"] += [
        {"name": "c1", "node": "n1", "container": {"name": "c1", "ports": [{"host": 18101, "container": 8000}]},
         "health_url": "http://127.0.0.1:18101/health"},                       # its own published port
        {"name": "c2", "node": "n2", "container": {"name": "c2", "ports": [{"host": 18101, "container": 8000}]}},
        {"name": "g8", "node": "n2", "find": {"pid_file": "/run/g8.pid"}, "gpu": True, "tensor_parallel": 8}]
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    assert [w.name for w in load_fleet(f).workloads] == ["w1", "c1", "c2", "g8"]


def test_the_same_loopback_url_and_pid_file_on_two_nodes_are_two_workers(tmp_path):
    data = yaml.safe_load(GOOD)
    data["nodes"].append({"name": "n2", "work_pool": "n2"})
    data["workloads"].append({"name": "w2", "node": "n2", "find": {"pid_file": "/run/w1.pid"}, "engine": "vllm",
                              "metrics_url": "http://127.0.0.1:8000/metrics"})
    data["storage"] = {"path": "/var/lib/ckptflow/{node}"}
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    assert [w.node for w in load_fleet(f).workloads] == ["n1", "n2"]


def test_not_yaml_and_missing_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("fleet: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_fleet(f)
    with pytest.raises(ConfigError, match="fleet file not found"):
        load_fleet(tmp_path / "nope.yaml")


def test_a_relative_missing_file_names_the_directory_it_was_read_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_fleet("fleets/nope.yaml")
    # a Prefect worker's directory is rarely the one the user thinks of: say which it was
    assert f"fleet file not found (a relative path is read from {tmp_path})" in e.value.message
    with pytest.raises(ConfigError) as e:
        load_fleet(tmp_path / "nope.yaml")
    assert e.value.message == f"{tmp_path / 'nope.yaml'}: fleet file not found"


def test_a_missing_field_points_at_the_mapping_that_lacks_it(tmp_path):
    """A missing key has no line of its own; the line given is where to add it, said as such (a
    missing top-level ``fleet:`` read 'fleet (line 4)', the line of the first key, as if it were bad)."""
    f = tmp_path / "fleet.yaml"
    lines = GOOD.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("fleet:"))
    f.write_text("# a comment\n" + "\n".join(ln for i, ln in enumerate(lines) if i != first) + "\n")
    with pytest.raises(ConfigError) as e:
        load_fleet(f)
    start = 1 + next(i for i, ln in enumerate(f.read_text().splitlines()) if ln and not ln.startswith("#"))
    assert f"{f}: fleet: Field required (add it to the top-level mapping at line {start})" in e.value.message
    assert "fleet (line" not in e.value.message


def test_line_number_points_at_the_field(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text(GOOD.replace("metrics_url: http://127.0.0.1:8000/metrics", "metrics_url: 8000"))
    with pytest.raises(ConfigError, match=r"workloads\[0\]\.metrics_url \(line 11\)"):
        load_fleet(f)


@pytest.mark.fault
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(
                        st.sampled_from(["fleet", "nodes", "workloads", "name", "node", "find", "policies",
                                         "storage", "kind", "x"]), c, max_size=4), max_leaves=12))
def test_any_malformed_fleet_gives_a_config_error(tmp_path, doc):
    f = tmp_path / "fuzz.yaml"
    f.write_text(yaml.safe_dump(doc))
    try:
        load_fleet(f)
    except ConfigError as e:
        assert str(f) in str(e)


@pytest.mark.parametrize("field", ["metrics_url", "health_url", "probe_url", "prepare_url"])
@pytest.mark.parametrize("url", ["127.0.0.1:8000/metrics", "localhost:8000/metrics", "http:///metrics",
                                 "ftp://127.0.0.1/metrics"])
def test_url_without_scheme_or_host_is_refused_naming_field_and_line(tmp_path, field, url):
    f = tmp_path / "fleet.yaml"
    f.write_text(GOOD.replace("metrics_url: http://127.0.0.1:8000/metrics", f"{field}: {url}"))
    with pytest.raises(ConfigError) as e:
        load_fleet(f)
    assert f"{f}: workloads[0].{field} (line 11): {url!r} is not an http(s) URL with a host" in str(e.value)


def test_golden_url_is_checked_too(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text(GOOD.replace("    engine: vllm\n",
                              "    engine: vllm\n    golden: {url: '127.0.0.1:8000/v1/completions', body: {}}\n"))
    with pytest.raises(ConfigError, match=r"workloads\[0\]\.golden\.url \(line 11\)"):
        load_fleet(f)


def test_every_mistake_is_reported_in_one_run(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text(GOOD.replace("node: n1", "node: n9").replace("engine: vllm", "engine: tgi")
                 .replace("http://127.0.0.1:8000/metrics", "127.0.0.1:8000/metrics").replace("cost-based", "yolo"))
    with pytest.raises(ConfigError) as e:
        load_fleet(f)
    msg = str(e.value)
    assert msg.splitlines()[0] == f"{f}: 4 problems"
    for where, text in (("workloads[0].node (line 8)", "node 'n9' is not declared"),   # cross-field
                        ("workloads[0].engine (line 10)", "unknown engine 'tgi' (known: demo, llamacpp, other, sglang, vllm)"),   # schema
                        ("workloads[0].metrics_url (line 11)", "is not an http(s) URL"),    # URL
                        ("policies[0].policy (line 14)", "unknown policy 'yolo'")):
        assert f"{f}: {where}: " in msg and text in msg, (where, msg)


@pytest.mark.parametrize("where,text", [("line 4", GOOD.replace("    work_pool: n1", "\twork_pool: n1")),
                                        ("line 10", GOOD.replace("    engine: vllm", "  \tengine: vllm"))])
def test_a_tab_in_the_indentation_is_named(tmp_path, where, text):
    f = tmp_path / "fleet.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_fleet(f)
    assert str(e.value).splitlines()[0] == f"{f}: tabs are not allowed for indentation, {where}"


def test_policy_params_are_typed_per_policy(tmp_path):
    from ckptflow.policies.cadence import CostBasedParams, FixedParams, NeverParams

    f = tmp_path / "fleet.yaml"
    f.write_text(GOOD + "    params: {min_interval_s: '300', burst_factor: 2}\n"
                 "  - match: {labels: {tier: batch}}\n    policy: never\n"
                 "  - policy: fixed\n    params: {interval_s: 1800}\n")
    fleet = load_fleet(f)
    cost, never, fixed = (r.params for r in fleet.policies)
    assert isinstance(cost, CostBasedParams) and cost.min_interval_s == 300.0 and cost.burst_factor == 2.0
    assert cost.max_interval_s == 7 * 86400  # defaults kept for what the rule does not give
    assert isinstance(never, NeverParams) and isinstance(fixed, FixedParams) and fixed.interval_s == 1800
    w = fleet.workloads[0].model_copy(update={"traffic": "short_requests"})
    assert fleet.policy_choice(w).policy == "fixed"        # the catch-all rule
    f.write_text(GOOD)
    fleet = load_fleet(f)
    assert fleet.policy_choice(w).policy == "cost-based"   # no rule matches: the default policy
    assert fleet.policy_choice(w).params == CostBasedParams()


def test_an_unknown_storage_kind_names_the_registered_ones_and_how_to_add_one(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text("fleet: t\nstorage: {kind: gcs}\nnodes: [{name: n1, work_pool: p}]\n")
    with pytest.raises(ConfigError) as e:
        load_fleet(f)
    assert str(e.value).startswith(f"{f}: storage.kind (line 2): unknown storage kind 'gcs' (known: local, s3")
    assert "ckptflow.store.register_tier" in str(e.value)


def test_relative_paths_are_the_fleet_files_directorys_wherever_the_command_runs(tmp_path, monkeypatch):
    """Issue #36: `cd /tmp && ckptflow heartbeat /abs/deployments/local.yaml` found no demo worker:
    relative paths followed the working directory."""
    d = tmp_path / "fleets"
    d.mkdir()
    data = yaml.safe_load(GOOD)
    data["storage"] = {"kind": "local", "path": "../state/{node}"}
    data["workloads"][0]["find"] = {"pid_file": "run/w1.pid"}
    data["workloads"].append({"name": "c1", "node": "n1", "container": {
        "name": "c1", "rootfs": "images/c1.tar",
        "mounts": [{"source": "./models", "target": "/models"}, {"source": "hf-cache", "target": "/cache"},
                   {"source": "/abs", "target": "/a"}],
        "kubernetes": {"namespace": "s", "pod": "p", "container": "c", "kubelet_ca": "pki/ca.crt"}}})
    f = d / "f.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    for cwd in (tmp_path, d, Path("/")):
        monkeypatch.chdir(cwd)
        fleet = load_fleet(f)
        assert fleet.storage.path == f"{tmp_path}/state/{{node}}"
        assert fleet.workload("w1").find.pid_file == f"{d}/run/w1.pid"
        c = fleet.workload("c1").container
        assert c.rootfs == f"{d}/images/c1.tar" and c.kubernetes.kubelet_ca == f"{d}/pki/ca.crt"
        assert [m.source for m in c.mounts] == [f"{d}/models", "hf-cache", "/abs"]   # a bare name: a named volume
        assert c.kubernetes.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"


def test_a_relative_path_given_to_load_fleet_resolves_the_same(tmp_path, monkeypatch):
    (tmp_path / "deployments").mkdir()
    (tmp_path / "deployments" / "f.yaml").write_text(GOOD.replace("/run/w1.pid", "../run/w1.pid"))
    monkeypatch.chdir(tmp_path)
    assert load_fleet("deployments/f.yaml").workload("w1").find.pid_file == f"{tmp_path.resolve()}/run/w1.pid"


def _field_paths(model, prefix=()) -> set[tuple]:
    """Every field of a fleet file, as its path of field names (list items and dict values folded)."""
    import types
    import typing

    from pydantic import BaseModel

    def models_in(t):
        origin = typing.get_origin(t)
        if origin is None:
            return [t] if isinstance(t, type) and issubclass(t, BaseModel) else []
        return [m for a in typing.get_args(t) for m in models_in(a)]

    out: set[tuple] = set()
    for name, f in model.model_fields.items():
        out.add(prefix + (name,))
        for sub in models_in(f.annotation):
            if sub.__name__ not in ("PolicyParams", "ModeParams"):   # typed per policy / mode: below
                out |= _field_paths(sub, prefix + (name,))
    return out


def _keys_in(data, prefix=()) -> set[tuple]:
    out: set[tuple] = set()
    if isinstance(data, dict):
        for k, v in data.items():
            out.add(prefix + (k,))
            out |= _keys_in(v, prefix + (k,))
    elif isinstance(data, list):
        for v in data:
            out |= _keys_in(v, prefix)
    return out


def test_the_every_field_example_sets_every_field_the_fleet_file_has(tmp_path):
    """A config error's fix points at it (issue #36: it pointed at an example without checkpoint:,
    criu:, golden: and more). A field added to the models and not to the example fails here."""
    from ckptflow.fleet import EVERY_FIELD, Fleet
    from ckptflow.modes import MODES
    from ckptflow.registry import CADENCE_POLICIES

    data = yaml.safe_load((ROOT / EVERY_FIELD).read_text())
    keys = {tuple(k for k in path if k not in ("heartbeat", "invalidate", "verify", "recover", "prune"))
            for path in _keys_in(data)}
    want = _field_paths(Fleet)
    want |= {("policies", "params", p) for name in CADENCE_POLICIES.known()
             for p in CADENCE_POLICIES.lookup(name).params.model_fields}
    want |= {("workloads", "checkpoint_params", p) for spec in MODES.values() for p in spec.params.model_fields}
    missing = sorted(".".join(p) for p in want - keys)
    assert not missing, f"{EVERY_FIELD} does not set: {', '.join(missing)}"
    load_fleet(ROOT / EVERY_FIELD)
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / EVERY_FIELD).read_text() + "\nfleets: x\n")
    with pytest.raises(ConfigError) as e:
        load_fleet(bad)
    assert e.value.fix == f"see {EVERY_FIELD} for every field"
