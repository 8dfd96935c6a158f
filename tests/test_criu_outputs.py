"""A worker's log that grows after its checkpoint never breaks the restore (issue 23, item 4).

CRIU records a regular file's size at the dump and refuses to restore when it changed
(`File … has bad size 46 (expect 0)`, measured with a worker started `> worker.log`). The
runner records the files the tree writes and hands them back to the restored tree opened for
appending (`--inherit-fd`), for logs opened with `>` and `>>` alike; a sandbox copy writes to
/dev/null instead of the original's log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptflow.models import ProcessFinder, Workload

pytestmark = pytest.mark.criu

# Prints a line every 20 ms: a counter that lives in memory only, so a restored copy continues
# from the checkpointed value.
WORKER = r"""
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
i = 0
while True:
    print(f"tick {i}", flush=True)
    i += 1
    time.sleep(0.02)
"""


def _start(tmp_path: Path, redirect: str) -> tuple[Workload, Path]:
    pid_file, log = tmp_path / "w.pid", tmp_path / "w.log"
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    subprocess.Popen(["/bin/sh", "-c", f"exec {sys.executable} {script} {pid_file} </dev/null {redirect}{log} 2>&1"],
                     start_new_session=True)
    deadline = time.time() + 10
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.time() < deadline
        time.sleep(0.02)
    time.sleep(0.2)
    return Workload(name="w", node="local", find=ProcessFinder(pid_file=str(pid_file), cmdline_must_contain="w.py")), log


def _ticks(log: Path) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("tick ")]


@pytest.mark.parametrize("redirect", [">", ">>"], ids=["truncate", "append"])
def test_a_log_that_grew_after_the_dump_does_not_break_the_restore(tmp_path, criu, redirect):
    from ckptflow.runners.process import pid_alive

    w, log = _start(tmp_path, redirect)
    pid = int(Path(w.find.pid_file).read_text())
    img = tmp_path / "img"
    try:
        before = max(_ticks(log))
        criu.dump(w, img, leave_running=True)
        after_dump = max(_ticks(log))                         # it ran on once the dump let it go
        time.sleep(0.3)                                       # the worker writes on: the log grows
        grown = log.stat().st_size
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            time.sleep(0.02)
        with open(log, "a") as f:                             # and something else appends too
            f.write("operator: restarting\n")
        assert criu.restore(img, old_pid=pid) == pid
        time.sleep(0.3)
        text = log.read_text()
        assert text.startswith(log.read_text()[:grown])       # nothing written before is lost
        after = text[grown:].split("operator: restarting\n", 1)[1]
        ticks = [int(x.split()[1]) for x in after.splitlines() if x.startswith("tick ")]
        # The restored worker continues from its checkpointed counter, appending after the rest.
        assert ticks and before <= ticks[0] <= after_dump + 1, (before, ticks[:3], after_dump)
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks)))
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_sandbox_copy_writes_nothing_into_the_originals_log(tmp_path, criu):
    w, log = _start(tmp_path, ">")
    pid = int(Path(w.find.pid_file).read_text())
    img = tmp_path / "img"
    copy = None
    try:
        criu.dump(w, img, leave_running=True)
        time.sleep(0.2)
        copy = criu.restore_beside(img)
        time.sleep(0.5)
        ticks = _ticks(log)
        # One writer only: the original's ticks stay one sequence, without the copy's repeats.
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks)))
        assert os.readlink(f"/proc/{copy.pid}/fd/1") == "/dev/null"
    finally:
        if copy is not None:
            copy.stop()
        os.kill(pid, signal.SIGKILL)
