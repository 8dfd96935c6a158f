"""What an SRE reads after a failure is true: the failed-restore alert and the restore artifact
name the checkpoint tried, the fallback, the cause's first line and the fix; a worker that died
mid-dump is not told to run as root. CPU only: CRIU stands in as a fake that fails like CRIU."""

import subprocess
import sys

import pytest

from conftest import write_fleet
from ckptflow.alerts import failure
from ckptflow.errors import CriuError
from ckptflow.models import EngineProbe, Fingerprint, ProcessFinder, Workload
from ckptflow.store.local import LocalStore

LOG = ("(00.010) 4242: inet: Restored\n"
       "(00.020) Error (criu/files-reg.c:2175): File /var/log/w.log has bad size 46 (expect 0)\n"
       "(00.021) Error (criu/cr-restore.c:2311): Restoring FAILED.")


def _restore_error():
    return CriuError("criu restore failed", cmd=["criu", "restore", "-D", "/img"], log_tail=LOG, returncode=1,
                     fix="a file the process had open changed size since the dump")


def test_failure_says_reason_cause_and_fix():
    f = failure(_restore_error())
    assert f["reason"] == "criu restore failed (exit 1)"
    assert f["cause"] == "Error (criu/files-reg.c:2175): File /var/log/w.log has bad size 46 (expect 0)"
    assert f["fix"] == "a file the process had open changed size since the dump"


def _node_and_workload(tmp_path, criu):
    from ckptflow.runners.fingerprint import workload_fingerprint
    from ckptflow.runners.node import NodeRunner

    w = Workload(name="chat", node="n", find=ProcessFinder(pid_file=str(tmp_path / "gone.pid")))
    fp = Fingerprint(arch="x86_64", kernel="6.18", glibc="2.36", criu="4.2.1")
    node = NodeRunner(LocalStore(tmp_path / "store"), criu=criu, node_fp=fp)
    return node, w, workload_fingerprint(w, fp)


def test_a_failed_restore_names_the_checkpoint_it_tried(tmp_path):
    class FailingCriu:
        def restore(self, *a, **k):
            raise _restore_error()

    node, w, fp = _node_and_workload(tmp_path, FailingCriu())
    p = node.store.begin("chat", node="n")
    (p.images_dir / "core-1.img").write_bytes(b"x" * 4096)
    m = node.store.commit(p, fingerprint=fp, pid=4242)
    with pytest.raises(CriuError) as e:
        node.restore(w)
    assert e.value.checkpoint == m.id
    assert failure(e.value)["checkpoint"] == m.id


def test_a_worker_that_died_mid_dump_is_not_told_to_run_as_root(tmp_path, monkeypatch):
    from ckptflow.runners import node as node_mod

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    class DiesUnderCriu:  # what CRIU says when the task it seized is gone
        def dump(self, *a, **k):
            raise CriuError("criu dump failed", cmd=["criu", "dump", "-t", str(dead.pid)], returncode=1,
                            log_tail=f"(00.001) Error (compel/src/lib/infect.c:129): Unable to interrupt task: "
                                     f"{dead.pid} (Operation not permitted)", fix="run as root")

    node, w, _ = _node_and_workload(tmp_path, DiesUnderCriu())
    monkeypatch.setattr(node_mod.process, "resolve", lambda w: type("P", (), {"pid": dead.pid})())
    monkeypatch.setattr(node_mod, "probe", lambda w: EngineProbe())
    with pytest.raises(CriuError) as e:
        node.checkpoint(w)
    assert f"the worker (PID {dead.pid}) exited during the dump" in str(e.value)
    assert "root" not in e.value.fix and "recover" in e.value.fix
    assert "Unable to interrupt task" in e.value.log_tail                # CRIU's own words are kept
    assert node.store.list("chat") == []                                 # nothing half-written


def test_the_restore_failed_alert_and_artifact_say_what_happened(tmp_path, prefect_harness, slack, monkeypatch):
    from ckptflow.flows import recover as recover_mod

    w = Workload(name="chat", node="local", find=ProcessFinder(pid_file=str(tmp_path / "w.pid")))
    fleet = write_fleet(tmp_path / "fleet.yaml", [w], tmp_path / "store", slack=True)
    tried = "20261130T120000Z-0a0b0c0d"

    def run_step(node, action, *a, **k):
        e = _restore_error()
        e.checkpoint = tried
        raise e

    artifacts = []
    monkeypatch.setattr(recover_mod, "run_step", run_step)
    monkeypatch.setattr(recover_mod, "create_markdown_artifact", lambda key, markdown: artifacts.append(markdown))
    with pytest.raises(CriuError):
        recover_mod.recover(str(fleet), "chat")
    [req] = slack.requests
    blocks = req["body"]["blocks"]
    fields = [f["text"] for f in blocks[1]["fields"]]
    assert f"*Checkpoint*\n{tried}" in fields
    assert "*Fallback*\nnone: the restore broke, so no cold start was tried over what it left" in fields
    sections = [b["text"]["text"] for b in blocks if b["type"] == "section" and "text" in b]
    assert "*Reason*\ncriu restore failed (exit 1)" in sections
    assert "*Cause*\nError (criu/files-reg.c:2175): File /var/log/w.log has bad size 46 (expect 0)" in sections
    assert "*Fix*\na file the process had open changed size since the dump" in sections
    [md] = artifacts
    assert f"| checkpoint tried | `{tried}` |" in md
    assert "| cause | Error (criu/files-reg.c:2175): File /var/log/w.log has bad size 46 (expect 0) |" in md
    assert "| fix | a file the process had open changed size since the dump |" in md
    assert "| fallback | none: the restore broke" in md
