"""Bench results keep every run (date, machine, command), and the README's figures that item 11
of issue 23 named come from those runs."""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def test_record_run_appends_and_keeps_an_old_single_run_file(tmp_path, monkeypatch):
    import _common

    monkeypatch.setattr(_common, "BENCH", tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.json").write_text(json.dumps({"seconds": 9.5}))    # before runs were kept
    monkeypatch.setattr(sys, "argv", ["bench/x.py", "--nodes", "250"])
    _common.record_run("x", {"seconds": 5.0})
    _common.record_run("x", {"seconds": 20.7})
    runs = json.loads((tmp_path / "results" / "x.json").read_text())["runs"]
    assert [r["seconds"] for r in runs] == [9.5, 5.0, 20.7]
    assert runs[0]["date"] is None and runs[1]["date"].endswith("UTC")
    assert runs[2]["command"].endswith("bench/x.py --nodes 250") and "cores" in runs[2]["machine"]


def _runs(name):
    return json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text())["runs"]


def test_the_readmes_fleet_tick_figures_are_the_runs_range():
    readme = (ROOT / "README.md").read_text()
    big = sorted(r["seconds"] for r in _runs("fleet_tick") if r["nodes"] == 250)
    assert all(r["date"] and r["command"] for r in _runs("fleet_tick"))
    assert f"5,000 / 250 {big[0]:.1f}–{big[-1]:.1f} s ({len(big)} runs, median {big[len(big) // 2]:.1f} s" in readme
    assert "9.5 s for 5,000 / 250" not in readme


def test_the_readmes_llamacpp_and_s3_figures_come_from_bench_json():
    readme = (ROOT / "README.md").read_text()
    last = _runs("llamacpp_cpu")[-1]
    assert (f"checkpoint is {last['checkpoint_bytes'] / 2**20:.1f} MiB, dumped in {last['dump_s']:.2f} s and "
            f"restored (CRIU and checksums) in {last['restore_s']:.2f} s") in " ".join(readme.split())
    assert f"a {last['session_tokens']}-token session exported" in " ".join(readme.split())
    from _common import runs_of

    s3 = runs_of("s3_store")[-1]
    assert f"{s3['second_heartbeat_byte_ratio'] * 100:.1f} % of the image" in " ".join(readme.split())
    assert not re.search(r"\b7 % of its image", readme)
