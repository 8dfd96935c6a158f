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

    assert [k.value for k in CheckpointKind] == ["heartbeat", "migrate", "scale_template", "engine_template",
                                                 "sessions", "session"]
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


# --- manifests written before the probe was typed: one flat dict ------------------------------
TMPL_ID, SESS_ID = "20261120T100000Z-0a0b0c0d", "20261120T110000Z-1a2b3c4d"
OLD_SESSIONS = {  # a two-tier session checkpoint as ckptflow wrote it into a bucket before, byte for byte in shape
    "id": SESS_ID, "workload": "chat", "node": "n1", "created": "2026-11-20T11:00:00Z", "kind": "sessions",
    "files": [{"path": "sessions.json", "size": 4, "sha256": "9" * 64}], "bytes": 4, "state": "complete",
    "probe": {"tokens_total": 812.0, "session_decisions": {"a": "grew by 300 tokens"},
              "template": TMPL_ID, "template_workload": "template-0123456789abcdef", "moved_bytes": 1024,
              "session_bytes": 4096, "changed_sessions": ["a"], "restores": [3.25, 2.5],
              "s3_chunk_size": 4194304, "s3_chunks": {"sessions.json": ["ab" * 32]}, "s3_outside_chunks": ["cd" * 32]},
    "copies": [{"tier": "node", "location": "n1", "at": "2026-11-20T11:00:01Z"}]}
OLD_TEMPLATE_PROBE = {"template_source": "chat", "weights_bytes": 8388608, "weight_chunks": ["ef" * 32],
                      "base_url": "http://127.0.0.1:18001"}
OLD_CONTAINER_PROBE = {"sessions": {"s1": "d1"}, "golden": "7" * 64, "restores": [1.5],
                       "container": {"name": "chat-c", "id": "abc123", "image": "localhost/chat:1",
                                     "ports": [{"host": 18101, "container": 8000, "host_ip": "127.0.0.1"}]}}


def test_an_old_flat_manifest_loads_with_its_binding_chunk_map_and_restores(tmp_path):
    import json

    from ckptflow.models import RemoteChunks, TemplateBinding
    from ckptflow.report import checkpoint_bytes
    from ckptflow.store.local import MANIFEST, LocalStore

    store = LocalStore(tmp_path / "store")
    d = store.root / "chat" / SESS_ID
    (d / "images").mkdir(parents=True)
    (d / MANIFEST).write_text(json.dumps(OLD_SESSIONS))
    m = store.get("chat", SESS_ID)
    assert m.probe.template == TemplateBinding(id=TMPL_ID, workload="template-0123456789abcdef")
    assert m.probe.chunk_maps == {"s3": RemoteChunks(chunk_size=4194304, chunks={"sessions.json": ["ab" * 32]},
                                                     outside_chunks=["cd" * 32])}
    assert m.probe.restores.seconds == [3.25, 2.5]
    assert (m.probe.export.total_bytes, m.probe.export.moved_bytes, m.probe.export.changed) == (4096, 1024, ["a"])
    assert m.probe.export.decisions == {"a": "grew by 300 tokens"} and m.probe.tokens_total == 812.0
    assert checkpoint_bytes(m) == 4096 + 4                                       # what status counts
    # The next restore adds to its history; the manifest is then written in the typed shape only.
    again = store.set_state(m, m.state, None, restores=m.probe.restores.adding(1.0))
    assert again.probe.restores.seconds == [3.25, 2.5, 1.0]
    written = json.loads((d / MANIFEST).read_text())["probe"]
    assert written["template"] == {"id": TMPL_ID, "workload": "template-0123456789abcdef"}
    assert not {"template_workload", "s3_chunks", "session_bytes"} & set(written)
    assert store.get("chat", SESS_ID) == again


def test_old_template_container_and_engine_probes_load_into_their_models():
    t = Manifest(id=TMPL_ID, workload="template-0123456789abcdef", node="n1", kind="template", probe=OLD_TEMPLATE_PROBE)
    assert t.kind == "engine_template"
    assert (t.probe.source.workload, t.probe.source.base_url) == ("chat", "http://127.0.0.1:18001")
    assert (t.probe.weights.bytes, t.probe.weights.chunks) == (8388608, ["ef" * 32])
    c = Manifest(id=SESS_ID, workload="chat", node="n1", probe=OLD_CONTAINER_PROBE)
    assert c.probe.container.name == "chat-c" and c.probe.container.ports[0].host == 18101
    assert (c.probe.sessions, c.probe.restores.seconds, c.probe.template) == ({"s1": "d1"}, [1.5], None)
    # An engine adapter's own keys (llama.cpp's slot checkpoint) stay readable as they were.
    s = Manifest(id=SESS_ID, workload="chat", node="n1", kind="session",
                 probe={"engine": "llamacpp", "slot": 0, "n_saved": 41, "n_written": 9000})
    assert (s.probe.engine, s.probe.slot, s.probe.n_saved) == ("llamacpp", 0, 41)


def test_an_old_template_kind_loads_as_the_template_it_was(tmp_path):
    """Manifests stored before the split say kind "template" for both: the scale-up checkpoint of
    a warm worker (a whole-process image, no template source) and template-sessions' engine
    template (its probe names the worker it was captured from, flat or typed)."""
    import json

    from ckptflow.models import CheckpointKind
    from ckptflow.store.local import MANIFEST, LocalStore

    scale = {"id": SESS_ID, "workload": "chat", "node": "n1", "created": "2026-11-20T11:00:00Z", "kind": "template",
             "files": [{"path": "pages-1.img", "size": 4, "sha256": "9" * 64}], "bytes": 4, "state": "complete",
             "probe": {"sessions": {"s1": "d1"}, "golden": "7" * 64}}
    engine = {**scale, "id": TMPL_ID, "workload": "template-0123456789abcdef", "probe": OLD_TEMPLATE_PROBE}
    store = LocalStore(tmp_path / "store")
    for raw in (scale, engine, {**engine, "id": "20261120T120000Z-2a2b2c2d", "probe": {"source": {"workload": "chat"}}}):
        d = store.root / raw["workload"] / raw["id"]
        (d / "images").mkdir(parents=True)
        (d / MANIFEST).write_text(json.dumps(raw))
    assert store.get("chat", SESS_ID).kind == CheckpointKind.scale_template
    assert [m.kind for m in store.list("template-0123456789abcdef")] == [CheckpointKind.engine_template] * 2
    # Written again, each says which one it is; an old "template" never comes back out.
    m = store.get("template-0123456789abcdef", TMPL_ID)
    store.set_state(m, m.state, None)
    assert json.loads((store.root / m.workload / TMPL_ID / MANIFEST).read_text())["kind"] == "engine_template"
    assert Manifest(id=SESS_ID, workload="w", node="n", kind="template").kind == CheckpointKind.scale_template


def test_a_malformed_probe_names_the_field():
    with pytest.raises(ValidationError) as e:
        Manifest(id=SESS_ID, workload="chat", node="n1", probe={"template": TMPL_ID})   # no template_workload
    assert ("probe", "template", "workload") in [err["loc"] for err in e.value.errors()]
