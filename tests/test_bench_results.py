"""Bench results keep every run (date, machine, command), the benches append to them instead of
overwriting, and the fleet-tick figures of docs/benchmarks.md come from those runs; the other
figures of README and docs/ are held by tests/test_figures.py."""

import json
import sys
from pathlib import Path

import pytest

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



def test_a_run_records_no_path_of_this_machine(tmp_path, monkeypatch):
    """A device call's fetched results lie in a folder of this machine's: the command a run
    records names the file alone (eight runs named the fetched folder of the machine that appended them), and a
    path inside the repository relative to it."""
    import _common

    fetched = tmp_path / "device" / "12" / "vllm_gpu.json"
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "vllm_gpu.py"), "--append-results", str(fetched),
                                      f"--out={tmp_path}/r.json", "--rows", "s,t"])
    cmd = _common.command()
    assert cmd.endswith(" bench/vllm_gpu.py --append-results .../vllm_gpu.json --out=.../r.json --rows s,t"), cmd
    assert str(tmp_path) not in cmd and str(ROOT) not in cmd


def test_no_stored_run_names_a_path_of_a_machine():
    """What the runs kept (commands, notes, tracebacks) names no folder of this machine's (the
    device's own paths, a model under its $HOME, are what ran there and stay)."""
    import re

    for f in sorted((ROOT / "bench" / "results").glob("*.json")):
        hits = re.findall(r"/(?:work|check)/[^\s\"']+", f.read_text())
        assert not hits, f"{f.name}: {hits[:3]}"

def _runs(name):
    return json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text())["runs"]


def test_the_benchmarks_pages_fleet_tick_figures_are_the_runs_range():
    page = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert all(r["date"] and r["command"] for r in _runs("fleet_tick"))
    for nodes, size in ((250, "5,000 workloads / 250 nodes"), (1000, "20,000 / 1,000")):
        pg = sorted(r["seconds"] for r in _runs("fleet_tick") if r.get("db") == "postgres" and r["nodes"] == nodes)
        assert f"{size} {pg[0]:.1f}–{pg[-1]:.1f} s ({len(pg)} runs)" in page
    assert "9.5 s for 5,000 / 250" not in page


# The benches that overwrote their JSON before they kept every run, and the file each appends to.
RECORDED = {"gpu_checkpoint.py": "gpu_checkpoint", "gpu_tp.py": "gpu_tp", "gpu_two_tier.py": "gpu_two_tier",
            "soak.py": "soak", "vllm_gpu.py": "vllm_gpu", "gpu_pidns_born.py": "gpu_pidns",
            "sglang_gpu.py": "sglang_gpu"}


@pytest.mark.parametrize("script,name", RECORDED.items())
def test_the_bench_appends_runs_and_its_file_keeps_them(script, name):
    src = (ROOT / "bench" / script).read_text()
    assert f'record_run("{name}"' in src or f'append_device_run("{name}"' in src   # the GPU benches, from $OUT
    runs = _runs(name)
    assert runs
    for r in runs:  # dated, or the file from before runs were kept, named by the commit it stood at
        assert (r["date"] and r["command"] and r["machine"]) or (r["date"] is None and r["note"] and r["committed"]), r
    assert sum(r["date"] is None for r in runs) <= 1


@pytest.fixture
def results(tmp_path, monkeypatch):
    """bench/_common writing into tmp_path; the committed results copied there first."""
    import shutil

    import _common

    shutil.copytree(ROOT / "bench" / "results", tmp_path / "results")
    monkeypatch.setattr(_common, "BENCH", tmp_path)
    monkeypatch.setattr(_common, "RESULTS_MD", tmp_path / "RESULTS.md")
    return _common


def test_gpu_checkpoint_keeps_a_run_cut_short_as_one_run(results, monkeypatch):
    import gpu_checkpoint

    monkeypatch.setattr(gpu_checkpoint, "BENCH", results.BENCH)
    monkeypatch.setattr(gpu_checkpoint, "gpu_name", lambda: ("FAKE GPU", "0.0"))
    earlier = results.runs_of("gpu_checkpoint")
    gpu_checkpoint.save(earlier, [{"footprint_gib": 8.0}], "/dev/shm")             # after the first size
    gpu_checkpoint.save(earlier, [{"footprint_gib": 8.0}, {"footprint_gib": 20.0}], "/dev/shm")
    runs = results.runs_of("gpu_checkpoint")
    assert runs[:-1] == earlier == _runs("gpu_checkpoint")
    assert [r["footprint_gib"] for r in runs[-1]["rows"]] == [8.0, 20.0] and runs[-1]["gpu"] == "FAKE GPU"
    assert runs[-1]["date"].endswith("UTC")


def test_vllm_gpu_records_the_fetched_device_json_as_a_run(results, monkeypatch, tmp_path, capsys):
    import vllm_gpu

    device = {k: v for k, v in _runs("vllm_gpu")[0].items() if k not in ("date", "note", "committed")}
    fetched = tmp_path / "fetched.json"
    fetched.write_text(json.dumps(device))
    monkeypatch.setattr(sys, "argv", ["bench/vllm_gpu.py", "--append-results", str(fetched)])
    vllm_gpu.main()
    runs = results.runs_of("vllm_gpu")
    assert len(runs) == len(_runs("vllm_gpu")) + 1
    assert runs[-1]["rows"] == device["rows"] and runs[-1]["machine"] == device["machine"]   # the device's
    assert runs[-1]["command"].endswith(f"--append-results .../{fetched.name}") and runs[-1]["date"]
    assert "| c | two tiers" in (tmp_path / "RESULTS.md").read_text()
    # The results file itself is refused: appended, it would nest every run inside a new one.
    monkeypatch.setattr(sys, "argv", ["bench/vllm_gpu.py", "--append-results", str(tmp_path / "results" / "vllm_gpu.json")])
    with pytest.raises(SystemExit, match="is a results file"):
        vllm_gpu.main()
    assert len(results.runs_of("vllm_gpu")) == len(runs)


def test_gpu_pidns_born_records_each_device_run_with_its_own_date(results, monkeypatch, tmp_path):
    import gpu_pidns_born

    monkeypatch.setattr(gpu_pidns_born, "RESULTS_MD", tmp_path / "RESULTS.md")
    paths = []
    for n in (1, 2):
        run = {"date": f"2030-01-0{n} 00:00 UTC", "machine": "device", "command": "python3 bench/gpu_pidns_born.py",
               "cpu_plumbing_only": True, "versions": {"criu": "4.2", "driver": None},
               "layouts": {"init": {"steps": [{"step": "host", "pid": 7, "got": {"cuInit": "CUDA_SUCCESS"}}]}}}
        paths.append(tmp_path / f"born{n}.json")
        paths[-1].write_text(json.dumps(run))
    gpu_pidns_born.record(paths)
    runs = results.runs_of("gpu_pidns")
    assert runs[:-2] == _runs("gpu_pidns")
    assert [(r["date"], r["machine"], r["probe"]) for r in runs[-2:]] == [
        ("2030-01-01 00:00 UTC", "device", "born_in_namespace"), ("2030-01-02 00:00 UTC", "device", "born_in_namespace")]


def test_soak_appends_its_run_and_writes_json_alone_only_where_asked(results, tmp_path):
    import argparse

    import soak

    old = _runs("soak")[-1]
    rows, summary = old["cycles"][:3], dict(old["summary"])
    ci = argparse.Namespace(json=str(tmp_path / "ci.json"), no_record=True, seed=7, ballast_mib=64, flow_every=3)
    soak.record(ci, summary, rows, [], "table")                        # the CI check: its file alone
    assert results.runs_of("soak") == _runs("soak") and not (tmp_path / "RESULTS.md").exists()
    alone = json.loads((tmp_path / "ci.json").read_text())
    assert alone["cycles"] == rows and alone["summary"] == summary and alone["seed"] == 7
    full = argparse.Namespace(json=None, no_record=False, seed=0, ballast_mib=128, flow_every=3)
    soak.record(full, summary, rows, [], "table")
    runs = results.runs_of("soak")
    assert runs[:-1] == _runs("soak") and runs[-1]["cycles"] == rows and runs[-1]["summary"] == summary
    assert runs[-1]["date"] and runs[-1]["seed"] == 0
    assert "kill/recover cycles" in (tmp_path / "RESULTS.md").read_text()
