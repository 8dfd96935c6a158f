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


def test_no_module_reads_a_ckptflow_variable_past_the_model():
    """os.environ.get("CKPTFLOW_X") elsewhere would read a typo as "unset"; the model refuses it."""
    direct = re.compile(r"""(os\.environ(\.get)?\(|os\.environ\[|os\.getenv\()\s*["']CKPTFLOW_""")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "ckptflow").rglob("*.py")
                 if p.name != "settings.py" and direct.search(p.read_text())]
    assert offenders == []


def test_the_criu_runner_takes_its_network_lock_and_ghost_limit_from_the_model(monkeypatch):
    from ckptflow.runners.criu import CriuRunner
    from ckptflow.settings import NetworkLock

    with pytest.raises(ConfigError, match=r"CKPTFLOW_CRIU_NETWORK_LOCK='nftable': Input should be 'nftables', "
                                          r"'iptables' or 'skip'"):
        settings({"CKPTFLOW_CRIU_NETWORK_LOCK": "nftable"})
    monkeypatch.setenv("CKPTFLOW_CRIU_NETWORK_LOCK", "skip")
    monkeypatch.setenv("CKPTFLOW_CRIU_GHOST_LIMIT", "512M")
    with CriuRunner(criu_bin="/bin/true") as r:
        assert r.network_lock is NetworkLock.skip and r.ghost_limit == "512M"
        args = r._common(Path("/img"), Path("/img/dump.log"), tcp_established=True)
        assert args[args.index("--network-lock") + 1] == "skip"
    monkeypatch.setenv("CKPTFLOW_CRIU_NETWORK_LOCK", "iptable")
    with pytest.raises(ConfigError, match="CKPTFLOW_CRIU_NETWORK_LOCK='iptable'"):
        CriuRunner(criu_bin="/bin/true")
