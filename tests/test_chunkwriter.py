"""The export writer process (ckptflow/engines/chunkwriter.py): a real child process writing spans
of memory shared with it as content-addressed chunk files."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from ckptflow.engines.chunkwriter import ChunkWriter, ChunkWriterError, ChunkWriterGone


@pytest.fixture
def writer():
    w = ChunkWriter(1 << 20, threads=4)
    yield w
    w.close()


def test_spans_become_files_named_by_their_sha256(writer, tmp_path):
    data = os.urandom(1 << 20)
    writer.view[:] = data
    spans = [(0, 1000), (1000, 300_000), (500_000, 524_288), (1_024_288, 0)]
    got = writer.write(tmp_path, spans)
    assert [d for d, _ in got] == [hashlib.sha256(data[o:o + n]).hexdigest() for o, n in spans]
    assert [n for _, n in got] == [n for _, n in spans]
    for (off, n), (d, _) in zip(spans, got):
        assert (tmp_path / d).read_bytes() == data[off:off + n]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temporary left


def test_a_chunk_already_there_is_not_written_again(writer, tmp_path):
    writer.view[:4] = b"abcd"
    (d, n), = writer.write(tmp_path, [(0, 4)])
    before = (tmp_path / d).stat().st_mtime_ns
    assert writer.write(tmp_path, [(0, 4)]) == [(d, 0)]
    assert (tmp_path / d).stat().st_mtime_ns == before


def test_the_writer_sees_what_the_parent_wrote_after_it_started(writer, tmp_path):
    writer.view[10:13] = b"one"
    (a, _), = writer.write(tmp_path, [(10, 3)])
    writer.view[10:13] = b"two"
    (b, _), = writer.write(tmp_path, [(10, 3)])
    assert (tmp_path / a).read_bytes() == b"one" and (tmp_path / b).read_bytes() == b"two"


def test_a_span_outside_the_staging_is_refused_by_name(writer, tmp_path):
    with pytest.raises(ValueError, match=r"span \(1048000, 1000\) is outside the 1048576-byte staging"):
        writer.write(tmp_path, [(1_048_000, 1000)])


def test_a_missing_directory_is_named_and_the_writer_goes_on(writer, tmp_path):
    with pytest.raises(ChunkWriterError, match="export directory .*nowhere does not exist") as e:
        writer.write(tmp_path / "nowhere", [(0, 10)])
    assert not isinstance(e.value, ChunkWriterGone)   # the engine keeps its staging and writer
    writer.view[:2] = b"ok"
    (d, n), = writer.write(tmp_path, [(0, 2)])
    assert (tmp_path / d).read_bytes() == b"ok" and n == 2


def test_a_writer_killed_mid_answer_is_named_gone(writer, tmp_path, monkeypatch):
    """Half a line back (the process killed as it answered): one line, not a JSON error."""
    import io

    writer.proc.kill()
    writer.proc.wait()
    monkeypatch.setattr(writer.proc, "stdin", io.StringIO())
    monkeypatch.setattr(writer.proc, "stdout", io.StringIO('{"written": [["ab'))
    with pytest.raises(ChunkWriterGone, match=r"died \(exit -9\); the export failed"):
        writer.write(tmp_path, [(0, 10)])


def test_a_dead_writer_fails_the_export_instead_of_hanging(writer, tmp_path):
    writer.proc.kill()
    writer.proc.wait()
    with pytest.raises(ChunkWriterGone, match="chunk writer process") as e:
        writer.write(tmp_path, [(0, 10)])
    assert isinstance(e.value, OSError)   # the engine answers it as any I/O failure: 4xx, one line


def test_requests_from_several_threads_are_answered_each_its_own(writer, tmp_path):
    data = os.urandom(1 << 20)
    writer.view[:] = data
    out: dict[int, list] = {}

    def go(k: int) -> None:
        out[k] = writer.write(tmp_path, [(k * 4096, 4096)])

    threads = [threading.Thread(target=go, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(8):
        assert out[k][0][0] == hashlib.sha256(data[k * 4096:(k + 1) * 4096]).hexdigest()


def test_close_ends_the_child():
    w = ChunkWriter(4096)
    proc = w.proc
    w.close()
    assert proc.poll() is not None


def test_the_module_example_runs():
    import doctest

    import ckptflow.engines.chunkwriter as mod

    res = doctest.testmod(mod)
    assert res.attempted > 0 and res.failed == 0


def test_the_writer_outlives_the_thread_that_started_it(tmp_path):
    """An engine starts its writer on a request's thread, which ends with the request."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("w", ChunkWriter(4096)))
    t.start()
    t.join()
    w = box["w"]
    try:
        time.sleep(0.5)
        w.view[:3] = b"abc"
        assert w.write(tmp_path, [(0, 3)])[0][1] == 3
    finally:
        w.close()


def test_the_writer_dies_with_its_engine_and_never_holds_the_engines_pid(tmp_path):
    """A writer left in the engine's process group would keep the engine's PID number taken after
    a kill, and a restore in place could not have it back."""
    import subprocess
    import sys

    code = ("import sys, time; from ckptflow.engines.chunkwriter import ChunkWriter; w = ChunkWriter(4096); "
            "print(w.proc.pid, flush=True); time.sleep(60)")
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = int(engine.stdout.readline())
    assert os.getsid(child) == os.getpgid(child) == child and os.getpgid(engine.pid) == engine.pid
    engine.kill()
    engine.wait()

    def running() -> bool:   # a zombie (exited, its new parent not yet reaping) has ended
        try:
            return Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not running()
