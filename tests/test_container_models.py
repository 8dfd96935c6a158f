"""The fleet file's container workloads: what is accepted, and the one line a mistake gets."""

from pathlib import Path

import pytest
import yaml

from ckptflow.errors import ConfigError
from ckptflow.fleet import load_fleet

ROOT = Path(__file__).resolve().parents[1]


def _fleet(tmp_path, workload: dict) -> Path:
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump({"fleet": "t", "nodes": [{"name": "n1", "work_pool": "n1"}],
                                 "workloads": [{"name": "w", "node": "n1", **workload}]}, sort_keys=False))
    return f


def test_a_container_workload_loads_with_its_defaults(tmp_path):
    w = load_fleet(_fleet(tmp_path, {"container": {"name": "chat-c", "ports": [{"host": 18101, "container": 8000}]}})
                   ).workload("w")
    c = w.container
    assert w.find is None and c.runtime.value == "podman" and c.oci_runtime == "runc"
    assert c.ulimits == {"nofile": "20000:20000", "nproc": "32768:32768"}
    assert c.publish_args() == ["--publish", "127.0.0.1:18101:8000"]
    pods = load_fleet(ROOT / "deployments" / "example-pods-fleet.yaml").workload("chat-pod")
    assert pods.container.kubernetes.pod == "chat-pod-0" and pods.container.kubernetes.kubelet_url.endswith(":10250")


@pytest.mark.parametrize("workload, where, says", [
    ({}, "workloads[0]", "give exactly one of find (a process) or container"),
    ({"find": {"pid_file": "w.pid"}, "container": {"name": "c"}}, "workloads[0]", "give exactly one of find"),
    ({"container": {"name": "../etc"}}, "workloads[0].container.name", "is not a container name"),
    ({"container": {"name": "c", "ports": [{"host": 70000, "container": 80}]}}, "workloads[0].container.ports[0].host",
     "less than or equal to 65535"),
    ({"container": {"name": "c", "runtime": "docker"}}, "workloads[0].container.runtime", "'podman'"),
    ({"container": {"name": "c"}, "gpu": True}, "workloads[0]", "CPU only for now"),
    ({"container": {"name": "c", "imagee": "x"}}, "workloads[0].container.imagee",
     "unknown field 'imagee'; did you mean 'image'?"),
])
def test_a_bad_container_declaration_names_the_field_and_line(tmp_path, workload, where, says):
    with pytest.raises(ConfigError) as e:
        load_fleet(_fleet(tmp_path, workload))
    line = next(x for x in str(e.value).splitlines() if where + " (line" in x)
    assert says in line, str(e.value)
