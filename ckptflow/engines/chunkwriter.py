"""An export's host part (sha256 and a content-addressed file per chunk) in a child process.

An engine copies the chunks it exports into page-locked host memory, then hashes and writes
them while it serves on. Done on threads of the engine's own process, that host part costs the
engine's decoding thread time (the GIL, which it takes again after every CUDA call): 8 ms per
GiB exported on the H200 (bench/gpu_copy_interference.py, ``host 1``); done in a process with
no CUDA and its own GIL, nothing measurable (``host-proc 1``). So the staging memory is a memfd
that both processes map (the engine registers it with CUDA as pinned memory) and the child
writes the spans it is sent.

Example:
    >>> import pathlib, tempfile
    >>> w = ChunkWriter(1 << 16)
    >>> w.view[:5] = b"hello"
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> [(dig[:12], n) for dig, n in w.write(d, [(0, 5)])]
    [('2cf24dba5fb0', 5)]
    >>> w.write(d, [(0, 5)])[0][1]    # already there: not written again
    0
    >>> w.close()
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ckptflow.engines.weight_chunks import THREADS


class ChunkWriterError(OSError):
    """The writer process failed a request (names the directory), or died: an I/O failure of the
    export, answered as any other (one line, HTTP 4xx)."""


class ChunkWriterGone(ChunkWriterError):
    """The writer process died or stopped answering: no request will reach it again."""


class ChunkWriter:
    """``nbytes`` of shared memory (``view``, ``address``) and the process that writes spans of it.

    ``write(out_dir, [(offset, length), ...])`` writes each span as ``out_dir/<sha256>`` (through
    a temporary name, so a reader never sees a partial chunk; a chunk already there is not
    written again) and returns ``[(sha256, bytes written), ...]`` in span order. One request at
    a time; ``close`` ends the process and unmaps the memory (drop ``view``'s users first).
    """

    def __init__(self, nbytes: int, threads: int = THREADS):
        self.nbytes = nbytes
        self.fd = os.memfd_create("ckptflow-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.mm = mmap.mmap(self.fd, nbytes)
        self.view = memoryview(self.mm)
        self._lock = threading.Lock()
        pkg_root = str(Path(__file__).resolve().parent.parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (pkg_root, os.environ.get("PYTHONPATH"))))}
        try:
            # Its own session, and it exits when the engine does: a child left in the engine's
            # process group keeps the engine's PID number taken (as that group's ID) after the
            # engine is killed, and CRIU cannot restore the engine into it ("Can't fork for <pid>:
            # File exists").
            self.proc = subprocess.Popen([sys.executable, "-m", "ckptflow.engines.chunkwriter", str(self.fd),
                                          str(threads), str(os.getpid())],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(self.fd,),
                                         text=True, bufsize=1, env=env, start_new_session=True)
        except BaseException:
            self._unmap()
            raise

    @property
    def address(self) -> int:
        """The mapping's address in this process (to register it with CUDA)."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    def write(self, out_dir: Path, spans: list[tuple[int, int]]) -> list[tuple[str, int]]:
        for off, n in spans:
            if off < 0 or n < 0 or off + n > self.nbytes:
                raise ValueError(f"span ({off}, {n}) is outside the {self.nbytes}-byte staging")
        with self._lock:
            try:
                self.proc.stdin.write(json.dumps({"dir": str(out_dir), "spans": spans}) + "\n")
                line = self.proc.stdout.readline()
            except (BrokenPipeError, ValueError) as e:
                raise ChunkWriterGone(f"the chunk writer process is gone ({e}); the export failed") from e
            try:
                got = json.loads(line) if line.endswith("\n") else None
            except json.JSONDecodeError:
                got = None
        if got is None:   # no answer, or half of one: it died on the way
            try:
                code = self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                code = "none yet"
            raise ChunkWriterGone(f"the chunk writer process died (exit {code}); the export failed")
        if "error" in got:
            raise ChunkWriterError(got["error"])
        return [(d, n) for d, n in got["written"]]

    def close(self) -> None:
        """End the process (EOF on its input, then kill after 5 s) and unmap the memory."""
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._unmap()

    def _unmap(self) -> None:
        self.view.release()
        self.mm.close()
        os.close(self.fd)


def _die_with(parent: int) -> None:
    """Exit once ``parent`` (the engine) is gone. Not PR_SET_PDEATHSIG: that fires when the
    *thread* that started this process ends, and an engine's request threads end after each call."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _serve(fd: int, threads: int) -> None:
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from ckptflow.engines.chunkfiles import write_chunk

    mm = mmap.mmap(fd, 0)
    view = memoryview(mm)

    def one(out_dir: Path, span: list[int]) -> tuple[str, int]:
        off, n = span
        chunk = view[off:off + n]
        d = hashlib.sha256(chunk).hexdigest()
        return d, 0 if (out_dir / d).exists() else write_chunk(out_dir, d, chunk)

    with ThreadPoolExecutor(threads) as ex:
        for line in sys.stdin:
            req = json.loads(line)
            out_dir = Path(req["dir"])
            try:
                if not out_dir.is_dir():
                    raise FileNotFoundError(f"export directory {out_dir} does not exist")
                got = list(ex.map(lambda s: one(out_dir, s), req["spans"]))
                print(json.dumps({"written": got}), flush=True)
            except OSError as e:
                print(json.dumps({"error": f"writing chunks into {out_dir}: {e}"}), flush=True)


if __name__ == "__main__":
    _die_with(int(sys.argv[3]))
    _serve(int(sys.argv[1]), int(sys.argv[2]))
