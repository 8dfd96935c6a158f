"""Every CKPTFLOW_* variable ckptflow reads goes through one settings model."""

import re
from pathlib import Path

import pytest

from ckptflow.errors import ConfigError
from ckptflow.settings import Settings, settings

ROOT = Path(__file__).parent.parent


def test_defaults_and_values():
    s = settings({})
    assert (s.node, s.node_limits, s.criu, s.criu_network_lock, s.criu_ghost_limit) == (None, False, None,
                                                                                        "nftables", "256M")
    s = settings({"CKPTFLOW_NODE": "gpu-7", "CKPTFLOW_NODE_LIMITS": "1", "CKPTFLOW_CRIU": "/opt/criu",
                  "CKPTFLOW_TEST_SLACK_WEBHOOK": "a fleet file's own variable: ignored"})
    assert (s.node, s.node_limits, s.criu) == ("gpu-7", True, "/opt/criu")


def test_empty_is_unset():
    assert settings({"CKPTFLOW_NODE": "", "CKPTFLOW_NODE_LIMITS": ""}) == settings({})


def test_a_bad_value_names_its_variable():
    with pytest.raises(ConfigError, match=r"CKPTFLOW_NODE_LIMITS='maybe': Input should be a valid boolean"):
        settings({"CKPTFLOW_NODE_LIMITS": "maybe"})


def test_read_from_the_environment_at_each_call(monkeypatch):
    from ckptflow.fleet import Fleet, Node
    from ckptflow.tasks.common import this_node

    fleet = Fleet(fleet="f", nodes=[Node(name="a", work_pool="a"), Node(name="b", work_pool="b")])
    monkeypatch.setenv("CKPTFLOW_NODE", "b")
    assert this_node(fleet) == "b"
    monkeypatch.setenv("CKPTFLOW_NODE", "a")
    assert this_node(fleet) == "a"


def test_every_variable_read_in_the_package_is_a_field():
    """A new CKPTFLOW_* variable in ckptflow/ needs its field here, with its meaning."""
    fields = {f.validation_alias for f in Settings.model_fields.values()}
    used = set()
    for path in (ROOT / "ckptflow").rglob("*.py"):
        used |= set(re.findall(r"[\"'](CKPTFLOW_[A-Z0-9_]+)[\"']", path.read_text()))
    written_only = {"CKPTFLOW_CHUNK_KEY"}  # an example value of storage.encryption_key_env
    assert used - written_only <= fields, sorted(used - written_only - fields)
