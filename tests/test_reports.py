"""Reports are true: two-tier bytes in ls, status and the exporter (chunks counted once, templates
in their own row); restores of two-tier checkpoints counted; status shows where a workload runs
after a migrate. CPU only: the store is written as the two-tier runner writes it."""

import hashlib
import json
import os

from ckptflow.fleet import load_fleet
from ckptflow.models import ManifestProbe, ProcessFinder, Workload
from ckptflow.report import checkpoint_bytes, fleet_status
from ckptflow.store.chunks import REFS_FILE, ChunkStore
from ckptflow.store.fleetstate import LocalFleetState
from ckptflow.store.local import LocalStore

from conftest import write_fleet

MIB = 2**20


def _chunks(store, n, seed):
    cs = ChunkStore(store.root)
    out = []
    for i in range(n):
        data = hashlib.sha256(f"{seed}-{i}".encode()).digest() * (MIB // 32)   # 1 MiB each
        d = hashlib.sha256(data).hexdigest()
        cs.put(d, data)
        out.append(d)
    return out


def _commit(store, workload, kind, digests, probe, image=4096):
    p = store.begin(workload, node="local")
    (p.images_dir / "core-1.img").write_bytes(os.urandom(image))
    (p.images_dir / REFS_FILE).write_text(json.dumps(sorted(set(digests))))
    return store.commit(p, kind=kind, probe=probe)


def _two_tier_store(tmp_path):
    """A template with 8 MiB of weights and two session checkpoints of ``chat`` over it: 3 MiB of
    session chunks, the second sharing 2 of them with the first."""
    store = LocalStore(tmp_path / "store")
    weights = _chunks(store, 8, "w")
    tmpl = _commit(store, "template-0123456789abcdef", "template", weights,
                   {"template_source": "chat", "weights_bytes": 8 * MIB, "weight_chunks": weights}, image=2 * MIB)
    s1, s2 = _chunks(store, 2, "s"), _chunks(store, 1, "t")
    bind = {"template": tmpl.id, "template_workload": tmpl.workload}
    first = _commit(store, "chat", "sessions", s1, {**bind, "session_bytes": 2 * MIB, "moved_bytes": 2 * MIB})
    second = _commit(store, "chat", "sessions", s1 + s2, {**bind, "session_bytes": 3 * MIB, "moved_bytes": MIB})
    return store, tmpl, first, second


def test_a_session_checkpoint_counts_the_chunks_it_names():
    from ckptflow.models import Manifest

    m = Manifest(id="20261130T120000Z-0a0b0c0d", workload="chat", node="n", kind="sessions", bytes=3000,
                 probe={"session_bytes": 96 * MIB})
    assert checkpoint_bytes(m) == 96 * MIB + 3000
    assert checkpoint_bytes(m.model_copy(update={"probe": ManifestProbe(), "kind": "heartbeat"})) == 3000


def test_status_and_exporter_count_two_tier_bytes_once_and_templates_in_their_own_row(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ckptflow.report import StoreCollector

    store, tmpl, first, second = _two_tier_store(tmp_path)
    w = Workload(name="chat", node="local", find=ProcessFinder(pid_file=str(tmp_path / "w.pid")),
                 checkpoint="template-sessions")
    fleet = load_fleet(write_fleet(tmp_path / "fleet.yaml", [w], tmp_path / "store"))
    rows = {r["workload"]: r for r in fleet_status(fleet)}
    assert rows["chat"]["bytes"] == first.bytes + second.bytes + 3 * MIB            # s1 counted once
    assert rows[tmpl.workload]["traffic"] == "template" and rows[tmpl.workload]["bytes"] == tmpl.bytes + 8 * MIB
    reg = CollectorRegistry()
    reg.register(StoreCollector(fleet))
    samples = {(s.name, s.labels.get("workload")): s.value
               for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}
    assert samples[("ckptflow_bytes_stored", "chat")] == rows["chat"]["bytes"] > 3 * MIB
    assert samples[("ckptflow_bytes_stored", tmpl.workload)] > 8 * MIB


def test_status_shows_the_node_a_migrate_moved_the_workload_to(tmp_path):
    import yaml

    w = Workload(name="chat", node="node-a", find=ProcessFinder(pid_file=str(tmp_path / "w.pid")))
    f = write_fleet(tmp_path / "fleet.yaml", [w], tmp_path / "store")
    data = yaml.safe_load(f.read_text())
    data["nodes"] = [{"name": "node-a", "work_pool": "a"}, {"name": "node-b", "work_pool": "b"}]
    f.write_text(yaml.safe_dump(data))
    assert fleet_status(load_fleet(f))[0]["node"] == "node-a"
    LocalFleetState(tmp_path / "store").put_placement("chat", "node-b", "20261130T120000Z-0a0b0c0d")
    assert fleet_status(load_fleet(f))[0]["node"] == "node-b"


def test_ls_shows_template_sessions_sizes_with_their_chunks_and_the_template(tmp_path):
    import subprocess
    import sys

    store, tmpl, first, second = _two_tier_store(tmp_path)
    w = Workload(name="chat", node="local", find=ProcessFinder(pid_file=str(tmp_path / "w.pid")),
                 checkpoint="template-sessions")
    fleet = write_fleet(tmp_path / "fleet.yaml", [w], tmp_path / "store")
    out = subprocess.run([sys.executable, "-m", "ckptflow", "ls", str(fleet)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    rows = {line.split("│")[2].strip(): line for line in out.stdout.splitlines() if "│" in line}
    assert "3.0 MiB (0.0 image + 3.0 chunks)" in rows[second.id]
    assert tmpl.workload in rows[tmpl.id] and "10.0 MiB (2.0 image + 8.0 chunks)" in rows[tmpl.id]


def test_status_counts_the_restore_a_migrate_made_on_the_new_node(tmp_path):
    """Issue #36 finding 10: restored on node-b after a migrate, the checkpoint's restore is in
    node-b's copy of the manifest; status read node-a's first and said 0."""
    import shutil

    import yaml

    from ckptflow.models import RestoreHistory

    w = Workload(name="chat", node="node-a", find=ProcessFinder(pid_file=str(tmp_path / "w.pid")))
    f = write_fleet(tmp_path / "fleet.yaml", [w], tmp_path / "store" / "{node}")
    data = yaml.safe_load(f.read_text())
    data["nodes"] = [{"name": "node-a", "work_pool": "a"}, {"name": "node-b", "work_pool": "b"}]
    f.write_text(yaml.safe_dump(data))
    a, b = LocalStore(tmp_path / "store" / "node-a"), LocalStore(tmp_path / "store" / "node-b")
    m = _commit(a, "chat", "migrate", [], {})
    shutil.copytree(a.root / "chat" / m.id, b.root / "chat" / m.id)   # what the pull on node-b wrote
    there = b.get("chat", m.id)
    b.set_state(there, there.state, None, restores=RestoreHistory(seconds=[3.1]))
    row = fleet_status(load_fleet(f))[0]
    assert row["restores"] == [3.1] and row["checkpoints"] == 1
