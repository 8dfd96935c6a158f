"""Shared by the bench scripts: machine description and the RESULTS.md appender."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

BENCH = Path(__file__).parent
REPO = BENCH.resolve().parent   # what a recorded path is relative to (BENCH is moved by tests)
RESULTS_MD = BENCH / "RESULTS.md"


def machine() -> str:
    cpus = os.cpu_count()
    mem = ""
    try:
        kb = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    return f"{platform.node() or 'host'}: {cpus} cores{mem}, kernel {platform.release()}, {platform.machine()}"


def command() -> str:
    return " ".join(shlex.quote(_portable(a)) for a in [Path(sys.executable).name, *sys.argv])


def _portable(arg: str) -> str:
    """``arg`` as a record keeps it: a path inside the repository relative to it, any other
    absolute path by its file name alone (``.../vllm_gpu.json``: a device call's fetched files lie
    in a folder of this machine's, which the repository must not name), in ``--opt=PATH`` too.

        >>> _portable(str(REPO / "bench" / "vllm_gpu.py")), _portable("--out=/tmp/x/r.json"), _portable("--rows")
        ('bench/vllm_gpu.py', '--out=.../r.json', '--rows')
    """
    opt, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not value.startswith("/"):
        return arg
    path = Path(value)
    try:
        portable = str(path.resolve().relative_to(REPO))
    except ValueError:
        portable = f".../{path.name}"
    return f"{opt}{eq}{portable}"


def append_results(title: str, table_md: str, notes: str = "") -> None:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    block = (f"\n## {title} — {stamp}\n\nMachine: {machine()}  \nCommand: `{command()}`\n\n"
             f"{table_md.rstrip()}\n" + (f"\n{notes.rstrip()}\n" if notes else ""))
    if not RESULTS_MD.exists():
        RESULTS_MD.write_text("# Benchmark results\n\nEach section: date, machine, exact command, table.\n")
    with RESULTS_MD.open("a") as f:
        f.write(block)


# The device returns at most 8 files from $OUT (its README): a bench's logs travel as one archive,
# so the results files a run wrote are not the ones left behind (it happened twice).
OUT_FILES_MAX = 8


def logs_to_out(out: Path, archive: str, logs: list[Path], tail_bytes: int) -> None:
    """The last ``tail_bytes`` of each log that exists, as one ``out/archive`` (a .tar.gz)."""
    import io
    import tarfile

    with tarfile.open(out / archive, "w:gz") as tar:
        for src in logs:
            if src.exists():
                with src.open("rb") as f:   # only the tail is read: an engine's log can be large
                    size = f.seek(0, os.SEEK_END)
                    f.seek(max(0, size - tail_bytes))
                    data = f.read()
                info = tarfile.TarInfo(src.name)
                info.size, info.mtime = len(data), int(src.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))


def out_files_over_limit(out: Path) -> list[str]:
    """The files under ``out`` if there are more than the device returns, else []."""
    files = sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.is_file())
    return files if len(files) > OUT_FILES_MAX else []


def record_run(name: str, result: dict) -> dict:
    """Append one run to ``bench/results/<name>.json`` and return it: ``{"runs": [...]}``, every
    run kept with its date, machine and exact command (a file from before runs were kept stays
    as its first run, ``"date": null``). The README cites figures from these runs, never from a
    run that was overwritten."""
    import json

    out = BENCH / "results" / f"{name}.json"
    run = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
           "command": command(), **result}
    runs = runs_of(name)
    runs.append(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    return run


def append_device_run(name: str, fetched: Path, title: str, carry: str, table) -> None:
    """Here, after a device call: the ``NAME.json`` a GPU bench wrote under the device's $OUT is
    appended as a run to bench/results/NAME.json (every run kept) and to RESULTS.md, with the
    device's own machine and commands (``table``: the bench's table of that run; ``{gpu}`` in
    ``title`` becomes the card that run found, so an H100 run is not titled as an H200's)."""
    res = json.loads(fetched.read_text())
    if "runs" in res:
        raise SystemExit(f"--append-results: {fetched} is a results file (it has runs); "
                         f"pass the {name}.json the device run wrote under $OUT")
    record_run(name, res)
    card = str(res.get("gpu") or "the GPU").split(",")[0]
    title = title.format(gpu=card)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmds = "; ".join(f"`{c}`" for c in res.get("commands", []))
    block = (f"\n## {title} — {stamp}\n\nMachine: {res.get('machine')} ({res.get('gpu')}; torch {res.get('torch')})"
             f"  \nCommand (on the device, after `eval \"$(scripts/{carry} env)\"`): {cmds}\n\n"
             f"{table(res)}\n\n{res.get('notes_md', '')}\n")
    with RESULTS_MD.open("a") as f:
        f.write(block)


def runs_of(name: str) -> list[dict]:
    """Every run ``record_run`` kept for ``name`` (oldest first); [] when none."""
    import json

    path = BENCH / "results" / f"{name}.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        return data["runs"]
    return [{"date": None, "note": "written before bench JSON kept every run", **data}]


def md_table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    # a newline in a cell (an error's "fix:" line) would end the table's row
    out += ["| " + " | ".join(str(c).replace("\n", " ") for c in r) + " |" for r in rows]
    return "\n".join(out)
