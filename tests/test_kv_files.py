"""A session import into an engine's block files (engines/kv_files.py): what vLLM's and SGLang's
protocols do after a template restore. All or nothing, every chunk checked, on several threads."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from ckptflow.engines.kv_files import BlockFiles


def _files(tmp_path: Path) -> BlockFiles:
    blocks, sessions = tmp_path / "kv" / "blocks", tmp_path / "kv" / "sessions"

    def block_file(name: str) -> Path:
        if not name.isalnum():
            raise ValueError(f"not a block key: {name!r}")
        return blocks / f"{name}.bin"

    return BlockFiles(sessions, block_file, {}, make_dirs=(blocks, sessions))


def _store(tmp_path: Path, blobs: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
    """Chunks in the store's layout (``ab/abcd…``); block name -> digest."""
    root = tmp_path / "chunks"
    names = {}
    for name, data in blobs.items():
        d = hashlib.sha256(data).hexdigest()
        (root / d[:2]).mkdir(parents=True, exist_ok=True)
        (root / d[:2] / d).write_bytes(data)
        names[name] = d
    return root, names


def _rec(names: list[str], digests: dict[str, str], tokens: int) -> dict:
    return {"tokens": tokens, "block_size": 16, "blocks": names,
            "tensors": [{"name": "kv_blocks", "chunks": [digests[n] for n in names]}]}


def test_two_sessions_sharing_a_prefix_are_imported_every_block_as_its_chunk(tmp_path):
    blobs = {f"b{i}": os.urandom(3 * (8 << 20) // 2 + i) for i in range(6)}   # pieces cross the 8 MiB copy size
    root, dg = _store(tmp_path, blobs)
    f = _files(tmp_path)
    out = f.import_({"dir": str(root), "sessions": {
        "a": _rec(["b0", "b1", "b2", "b3"], dg, 64), "b": _rec(["b0", "b1", "b4", "b5"], dg, 64)}})
    assert out["imported"] == ["a", "b"]
    for name, data in blobs.items():
        assert f.block_file(name).read_bytes() == data and f.digests[name] == dg[name]
    assert {s: d["blocks"] for s, d in f.sessions().items()} == {"a": ["b0", "b1", "b2", "b3"],
                                                                 "b": ["b0", "b1", "b4", "b5"]}
    assert not [p.name for p in f.block_file("b0").parent.iterdir() if p.name.startswith(".")]   # no temporaries


@pytest.mark.parametrize("spoil, says", [("torn", "is torn"), ("missing", "is missing")])
def test_a_bad_chunk_is_named_and_nothing_appears(tmp_path, spoil, says):
    blobs = {f"b{i}": os.urandom(1 << 20) for i in range(8)}
    root, dg = _store(tmp_path, blobs)
    bad = root / dg["b6"][:2] / dg["b6"]
    if spoil == "torn":
        bad.write_bytes(b"x" + bad.read_bytes()[1:])
    else:
        bad.unlink()
    f = _files(tmp_path)
    with pytest.raises(ValueError) as e:
        f.import_({"dir": str(root), "sessions": {"a": _rec([f"b{i}" for i in range(4)], dg, 64),
                                                  "b": _rec([f"b{i}" for i in range(4, 8)], dg, 64)}})
    assert str(e.value) == f"session b: chunk {dg['b6'][:12]}… {says}"
    blocks = f.block_file("b0").parent
    assert list(blocks.iterdir()) == [] and f.sessions() == {}     # all or nothing, no temporaries left


def test_an_unreadable_chunk_leaves_no_temporary_behind(tmp_path):
    """Not a bad chunk but an I/O error (here a directory where a chunk should be): the blocks
    staged before it are removed too, and the error is the caller's."""
    blobs = {f"b{i}": os.urandom(1 << 20) for i in range(6)}
    root, dg = _store(tmp_path, blobs)
    bad = root / dg["b4"][:2] / dg["b4"]
    bad.unlink()
    bad.mkdir()
    f = _files(tmp_path)
    with pytest.raises(IsADirectoryError):
        f.import_({"dir": str(root), "sessions": {"a": _rec([f"b{i}" for i in range(6)], dg, 96)}})
    assert list(f.block_file("b0").parent.iterdir()) == [] and f.sessions() == {}


def test_a_block_already_on_file_is_checked_and_kept(tmp_path):
    blobs = {"b0": os.urandom(4096), "b1": os.urandom(4096)}
    root, dg = _store(tmp_path, blobs)
    f = _files(tmp_path)
    f.block_file("b0").parent.mkdir(parents=True)
    f.block_file("b0").write_bytes(blobs["b0"])
    ino = f.block_file("b0").stat().st_ino
    f.import_({"dir": str(root), "sessions": {"a": _rec(["b0", "b1"], dg, 32)}})
    assert f.block_file("b0").stat().st_ino == ino and f.block_file("b1").read_bytes() == blobs["b1"]
    (root / dg["b0"][:2] / dg["b0"]).write_bytes(b"torn")       # the chunk is still checked
    with pytest.raises(ValueError, match="is torn"):
        f.import_({"dir": str(root), "sessions": {"a": _rec(["b0", "b1"], dg, 32)}})


def test_a_malformed_block_name_is_refused_before_anything_is_read(tmp_path):
    root, dg = _store(tmp_path, {"b0": b"x"})
    f = _files(tmp_path)
    with pytest.raises(ValueError, match="not a block key"):
        f.import_({"dir": str(root), "sessions": {"a": {**_rec(["b0"], dg, 16), "blocks": ["../etc"]}}})
    assert not f.block_file("b0").parent.exists()
