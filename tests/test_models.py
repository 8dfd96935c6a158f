import pytest
from pydantic import ValidationError

from ckptflow.models import Manifest, ProcessFinder, Workload


@pytest.mark.parametrize("bad", ["../../etc", "..", "a/b", "A", "", "x" * 64, ".hidden", "a..b"])
def test_workload_names_cannot_escape_their_directory(bad):
    with pytest.raises(ValidationError) as e:
        Workload(name=bad, node="n", find=ProcessFinder(pid_file="/x"))
    assert "not a valid name" in str(e.value)


def test_finder_needs_exactly_one_way():
    with pytest.raises(ValidationError, match="exactly one of"):
        ProcessFinder(pid_file="/a", cmdline_match="b")
    with pytest.raises(ValidationError, match="exactly one of"):
        ProcessFinder()


@pytest.mark.parametrize("bad", ["../x", "20261129T000000Z-zzzzzzzz", "latest"])
def test_checkpoint_ids_are_validated(bad):
    with pytest.raises(ValidationError, match="not a checkpoint id"):
        Manifest(id=bad, workload="w", node="n")


def test_enums_keep_the_strings_stored_manifests_and_alerts_hold():
    """Manifests on disk and in S3 are JSON written before these fields were enums: they load,
    and they are written back with the same strings."""
    import json

    from ckptflow.alerts import AlertKind
    from ckptflow.models import CheckpointKind, CheckpointState, CopyTier, VerifyOutcome

    assert [k.value for k in CheckpointKind] == ["heartbeat", "migrate", "template", "sessions", "session"]
    assert [k.value for k in AlertKind] == ["restore_failed", "verify_failed", "invalidated", "worker_gone"]
    assert [k.value for k in VerifyOutcome] == ["verified", "verify_failed", "skipped", "unverified"]
    assert {v.value for v in VerifyOutcome} - {"skipped", "unverified"} <= {s.value for s in CheckpointState}
    old = {"id": "20261129T081500Z-1a2b3c4d", "workload": "w", "node": "n", "kind": "migrate",
           "state": "verify_failed", "copies": [{"tier": "s3", "location": "s3://b/p", "at": "2026-11-29T08:15:00Z"}]}
    m = Manifest.model_validate_json(json.dumps(old))
    assert m.kind is CheckpointKind.migrate and m.copies[0].tier is CopyTier.s3
    again = json.loads(m.model_dump_json())
    assert (again["kind"], again["state"], again["copies"][0]["tier"]) == ("migrate", "verify_failed", "s3")
    assert m.kind == "migrate" and f"{m.kind}" == "migrate"   # still compares and formats as the string
    with pytest.raises(ValidationError):
        Manifest.model_validate({**old, "kind": "snapshot"})
