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
