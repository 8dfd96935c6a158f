"""Typed errors keep their type, fields and fix across a process boundary (a node step's error
reaches the fleet flow pickled through Prefect's result storage)."""

import inspect
import pickle

import cloudpickle
import pytest

from ckptflow import errors

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass)
           if issubclass(c, errors.CkptflowError) and c.__module__ == errors.__name__]


def _make(cls):
    if issubclass(cls, errors.CriuError):
        return cls("criu dump failed", cmd=["criu", "dump", "-t", "42"], log_tail="Error (criu/cr-dump.c:1): boom",
                   returncode=1, fix="free space on the checkpoint volume")
    if issubclass(cls, errors.IncompatibleCheckpoint):
        return cls({"driver": ("580.65", "590.1")}, checkpoint="20261129T081500Z-1a2b3c4d")
    if issubclass(cls, errors.HeartbeatFailed):  # its rows are what the CLI's table prints
        return cls("workload chat: no live process", [{"workload": "chat", "ok": False, "gone": True}],
                   fix="start it again")
    return cls(f"{cls.__name__} happened", fix="do the thing")


def test_every_error_class_is_covered():
    assert len(CLASSES) >= 18 and errors.CriuError in CLASSES and errors.IncompatibleCheckpoint in CLASSES


@pytest.mark.parametrize("dumps,loads", [(pickle.dumps, pickle.loads), (cloudpickle.dumps, pickle.loads)],
                         ids=["pickle", "cloudpickle"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_error_survives_pickle_with_type_fields_and_fix(cls, dumps, loads):
    e = _make(cls)
    got = loads(dumps(e))
    assert type(got) is cls
    assert str(got) == str(e) and got.args == e.args
    assert got.fix == e.fix and got.fix
    assert got.retryable == e.retryable
    assert vars(got) == vars(e)  # cmd, log_tail, returncode, differences, ...
    if isinstance(e, errors.CriuError):
        assert got.log_tail.endswith("boom") and got.cmd[:2] == ["criu", "dump"] and got.returncode == 1
    if isinstance(e, errors.IncompatibleCheckpoint):
        assert got.differences == {"driver": ("580.65", "590.1")}
    if isinstance(e, errors.HeartbeatFailed):
        assert got.rows == [{"workload": "chat", "ok": False, "gone": True}] and got.message == e.message
