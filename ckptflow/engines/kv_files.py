"""Sessions whose KV an engine already keeps on the node as one file per block, named by the
block's chained key: how the engine side of ckptflow's protocol exports them as chunks and
imports them back. Shared by the protocol vLLM serves (its blocks are ckptflow's KV connector's,
engines/vllm_protocol.py) and the one SGLang serves (its pages are HiCache's file storage,
engines/sglang_protocol.py).

Runs inside the engine's API server process: standard library only.

A session is listed by a JSON document ``{"session", "block_size", "tokens", "blocks": [names]}``
in its engine's sessions directory; ``blocks`` are the block files' names in prefix order. An
exported session is a record whose chunks are those files, each named by the sha256 of its bytes,
so a block that did not change since the runner last saw it costs nothing to export again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckptflow.engines.vllm_layout import safe_name
from ckptflow.engines.weight_chunks import THREADS, chunk_path

PIECE = 8 << 20   # a block file is copied and hashed in pieces of this size


def session_digest(chunks: list[str], tokens: int) -> str:
    """A session's digest: its tokens and its chunks in order (each chunk named by its bytes).

        >>> session_digest(["ab" * 32], 16)[:12]
        'a75b3aadc7e3'
    """
    return hashlib.sha256(json.dumps([tokens, chunks]).encode()).hexdigest()


class BlockFiles:
    """One engine's block files and session documents.

    ``block_file(name)`` maps a block's name to its file (and refuses a malformed name with
    ValueError before anything is read or written). ``wait_s``: how long an export waits for a
    listed block whose file is not written yet (an engine that writes blocks behind the request,
    as HiCache does); what is still missing then ends the session's exported prefix.
    """

    def __init__(self, sessions_dir: Path, block_file: Callable[[str], Path], digests: dict[str, str],
                 wait_s: float = 0.0, make_dirs: tuple[Path, ...] = (),
                 listed_when: str = "a request naming it finishes: a turn end") -> None:
        self.sessions_dir = sessions_dir
        self.block_file = block_file
        self.digests = digests            # block name -> sha256 of its file (a name's bytes never change)
        self.wait_s = wait_s
        self.make_dirs = make_dirs
        self.listed_when = listed_when

    def sessions(self) -> dict[str, dict]:
        out = {}
        for f in sorted(self.sessions_dir.glob("*.json")):
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError):
                continue  # being replaced (written through a temporary name)
            out[doc["session"]] = doc
        return out

    def list_session(self, doc: dict) -> None:
        """Write (or replace) a session's document, atomically."""
        self.sessions_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.sessions_dir / f"{safe_name(doc['session'])}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)

    def digest_of(self, name: str) -> str:
        d = self.digests.get(name)
        if d is None:
            d = hashlib.sha256(self.block_file(name).read_bytes()).hexdigest()
            self.digests[name] = d
        return d

    def _present(self, names: list[str]) -> int:
        """How many of ``names``, from the first, have their file (waiting up to ``wait_s``)."""
        deadline = time.monotonic() + self.wait_s
        n = 0
        while n < len(names):
            if self.block_file(names[n]).exists():
                n += 1
            elif time.monotonic() < deadline:
                time.sleep(0.02)
            else:
                break
        return n

    def export(self, body: dict) -> dict:
        out_dir = Path(body["dir"])
        known = {sid: set(ds) for sid, ds in (body.get("known") or {}).items()}
        listed = self.sessions()
        wanted = body.get("sessions")
        missing = sorted(set(wanted or ()) - set(listed))
        if missing:
            raise ValueError(f"no session {missing[0]!r} here (a session is listed when {self.listed_when})")
        t0 = time.perf_counter()
        recs = {}
        for sid, doc in listed.items():
            if wanted is not None and sid not in wanted:
                continue
            names = list(doc["blocks"])
            per_block = max(1, int(doc.get("files_per_block", 1)))
            # An engine that writes blocks as it lists them (wait_s 0) has them all: a missing one
            # fails the export, as reading it does.
            have = self._present(names) // per_block * per_block if self.wait_s > 0 else len(names)
            names = names[:have]
            tokens = doc["tokens"] if have == len(doc["blocks"]) else have // per_block * doc["block_size"]
            chunks, written, total = [], 0, 0
            for name in names:
                src = self.block_file(name)
                d = self.digest_of(name)
                size = src.stat().st_size
                total += size
                if d not in known.get(sid, ()) and not (out_dir / d).exists():
                    tmp = out_dir / f".{d}.{os.getpid()}.tmp"
                    # sendfile in the kernel: no buffer of the engine's process, and the GIL free
                    # for the serving threads meanwhile (this runs inside vLLM's API server)
                    shutil.copyfile(src, tmp)
                    os.replace(tmp, out_dir / d)
                    written += size
                chunks.append(d)
            recs[sid] = {"tokens": tokens, "digest": session_digest(chunks, tokens),
                         "tensors": [{"name": "kv_blocks", "dtype": "uint8", "shape": [total], "nbytes": total,
                                      "chunks": chunks}],
                         "blocks": names, "block_size": doc["block_size"],
                         "written_bytes": written, "total_bytes": total}
            if per_block != 1:
                recs[sid]["files_per_block"] = per_block
        # The blocks were on disk already: the engine was not held.
        return {"sessions": recs, "held_s": 0.0, "turn": True, "seconds": round(time.perf_counter() - t0, 4)}

    def import_(self, body: dict) -> dict:
        """All or nothing: every chunk of every session is checked before any block appears.

        Each chunk is copied to a temporary name beside its block file while it is hashed, on
        THREADS threads (hashing and file I/O release the GIL): a 4,016-token vLLM session of 251
        blocks took 1.36 s on the H200 read, hashed twice and written one after another. A
        missing or torn chunk removes every temporary file and fails the call, naming the first
        such chunk in the sessions' order; only then are the blocks renamed into place.
        """
        root = Path(body["dir"])
        plan: list[tuple[str, str, str]] = []          # (session, block name, chunk digest), in order
        first: dict[str, int] = {}   # block name -> the plan entry that writes it: a shared prefix, once
        sessions = body.get("sessions") or {}
        for sid, rec in sessions.items():
            chunks = [d for t in rec["tensors"] for d in t["chunks"]]
            names = rec["blocks"]
            if len(names) != len(chunks):
                raise ValueError(f"session {sid}: {len(names)} block keys for {len(chunks)} chunks")
            for name, d in zip(names, chunks):
                self.block_file(name)   # a well-formed name, before anything is read or written
                first.setdefault(name, len(plan))
                plan.append((sid, name, d))
        for d in self.make_dirs:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)

        def stage(k: int) -> Path | None:
            sid, name, d = plan[k]
            dst = self.block_file(name)
            tmp = None if first[name] != k or dst.exists() else \
                dst.with_name(f".{dst.name}.{os.getpid()}.{threading.get_ident()}.import")
            h = hashlib.sha256()
            try:
                # A block already on file: its chunk is only checked.
                with open(chunk_path(root, d), "rb") as src, open(tmp or os.devnull, "wb") as out:
                    while piece := src.read(PIECE):
                        h.update(piece)
                        out.write(piece)
                if h.hexdigest() != d:
                    raise ValueError(f"session {sid}: chunk {d[:12]}… is torn")
                if tmp is not None:
                    os.chmod(tmp, 0o600)
            except FileNotFoundError:
                _drop(tmp)
                raise ValueError(f"session {sid}: chunk {d[:12]}… is missing") from None
            except BaseException:   # torn, or the disk full: nothing of this chunk stays
                _drop(tmp)
                raise
            return tmp

        with ThreadPoolExecutor(THREADS) as ex:
            futures = [ex.submit(stage, k) for k in range(len(plan))]
        staged, first_error = [], None
        for f in futures:
            try:
                staged.append(f.result())
            except Exception as e:   # the first in the sessions' order is the one named
                first_error = first_error or e
        if first_error is not None:
            for tmp in staged:
                _drop(tmp)
            raise first_error
        for (_, name, d), tmp in zip(plan, staged):
            if tmp is not None:
                os.replace(tmp, self.block_file(name))   # the engine never sees half a block
            self.digests[name] = d
        digests = {}
        for sid, rec in sessions.items():
            doc = {"session": sid, "block_size": rec["block_size"], "tokens": rec["tokens"], "blocks": rec["blocks"]}
            if rec.get("files_per_block", 1) != 1:
                doc["files_per_block"] = rec["files_per_block"]
            self.list_session(doc)
            digests[sid] = session_digest([d for t in rec["tensors"] for d in t["chunks"]], rec["tokens"])
        return {"imported": sorted(sessions), "digests": digests}


def _drop(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)
