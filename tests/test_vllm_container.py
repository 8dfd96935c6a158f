"""vLLM in a podman container (runc + CRIU underneath), checkpointed through the container runtime.

The image is small (system libraries, /bin/sh, lscpu: ckptflow.engines.vllm_container); vLLM's
virtualenv, its Python and the model are bind-mounted read-only at their node paths. A long
session runs on the container and on an uninterrupted reference vLLM (a host process with the
same flags); the container is heartbeat-checkpointed, SIGKILLed, recovered, and its next turn
must equal the reference's token for token, with vLLM's own prefix-cache counter showing the
session's KV came back with the container (not computed again).
"""

from __future__ import annotations

import os
import random
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from conftest import free_port
from ckptflow.engines import vllm
from ckptflow.engines import vllm_container as vc

pytestmark = [pytest.mark.criu, pytest.mark.slow]


@pytest.fixture(scope="module")
def base_image(vllm_install):
    """Fails, not skips, when podman is missing: scripts/setup.sh installs it."""
    return vc.base_image(vllm_install)


@pytest.fixture(scope="module")
def ref(vllm_install, vllm_model, io_uring_off, tmp_path_factory):
    """The uninterrupted reference: a host process with the container's flags (--enforce-eager)."""
    srv = vllm.start_server(vllm_install, vllm_model.path, port=free_port(), run_dir=tmp_path_factory.mktemp("ref"),
                            name="ref", extra=vc.EAGER)
    yield srv
    try:
        vllm.kill_tree(srv.pid)
    except (OSError, ValueError):
        pass


def _podman(*args):
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=120)


class Chat:
    """A conversation held as token ids (as in tests/test_vllm.py)."""

    def __init__(self, seed: int, n: int = 1800):
        self.rnd = random.Random(seed)
        self.tokens = [self.rnd.randrange(3, 4000) for _ in range(n)]

    def turn(self, url: str, n: int = 16, user: int = 12) -> dict:
        prompt = self.tokens + [self.rnd.randrange(3, 4000) for _ in range(user)]
        before = vllm.metrics_text(url)
        out = vllm.complete(url, prompt, n)
        after = vllm.metrics_text(url)
        out["hits"] = (vllm.counter(after, "vllm:prefix_cache_hits_total")
                       - vllm.counter(before, "vllm:prefix_cache_hits_total"))
        out["n_prompt"] = len(prompt)
        self.tokens = prompt + out["token_ids"]
        return out

    def copy(self) -> "Chat":
        c = Chat.__new__(Chat)
        c.tokens = list(self.tokens)
        c.rnd = random.Random()
        c.rnd.setstate(self.rnd.getstate())
        return c


def _shm(pid: int) -> list[str]:
    """The container's own /dev/shm, seen from the host through its init's root."""
    return sorted(os.listdir(f"/proc/{pid}/root/dev/shm"))


def test_kill_then_recover_the_vllm_container_continues_like_the_reference(tmp_path, vllm_install, vllm_model,
                                                                           base_image, ref, io_uring_off):
    from ckptflow.runners.container import Podman
    from ckptflow.runners.node import NodeRunner
    from ckptflow.store.local import LocalStore

    port = free_port()
    w = vc.container_workload("chat", base_image, vllm_install, vllm_model, host_port=port,
                              container_name=f"ckt-vllm-{secrets.token_hex(3)}")
    assert w.criu.link_remap and w.criu.ext_unix_sk and w.criu.file_locks  # engine: vllm (what the conf says)
    conf = vc.write_criu_config(tmp_path / "runc-criu.conf")
    pm = Podman(w.container)
    name, url = w.container.name, f"http://127.0.0.1:{port}"
    try:
        vc.start(w, criu_conf=conf)
        c0 = pm.inspect(name)
        assert c0.running
        shm0 = _shm(c0.pid)
        assert any(n.startswith("psm_") for n in shm0), shm0   # vLLM's rings: in the container's tmpfs
        chats = {url: Chat(11), ref.url: Chat(11)}
        for _ in range(2):
            a, b = chats[url].turn(url), chats[ref.url].turn(ref.url)
            assert a["token_ids"] == b["token_ids"], "the container and the reference diverged before any restore"
        at_ckpt = chats[url].copy()

        store = LocalStore(tmp_path / "store")
        with NodeRunner(store) as node:
            m = node.checkpoint(w)                       # heartbeat through the podman runtime: it serves on
            assert m.kind == "heartbeat" and [f.path for f in m.files] == ["container.json", "container.tar"]
            assert m.fingerprint.engine == "vllm" and m.fingerprint.container_runtime.startswith("podman ")
            assert pm.inspect(name).running and pm.inspect(name).pid == c0.pid
            # Work after the heartbeat is lost with the container; the reference never sees it.
            chats[url].turn(url, n=8)
            _podman("kill", "--signal", "KILL", name)
            deadline = time.time() + 30
            while pm.inspect(name).running:
                assert time.time() < deadline, "podman never saw the container die"
                time.sleep(0.1)
            res = node.restore(w)
            assert res.manifest.id == m.id
        c1 = pm.inspect(name)
        assert c1.running and c1.pid == res.pid != c0.pid and c1.name == name
        shm1 = _shm(c1.pid)
        assert any(n.startswith("psm_") for n in shm1), shm1          # the rings came back in its own tmpfs

        chats[url] = at_ckpt
        got, want = chats[url].turn(url, n=32), chats[ref.url].turn(ref.url, n=32)
        assert got["token_ids"] == want["token_ids"] and len(set(got["token_ids"])) > 1
        # The session's KV came back with the container: vLLM served it from its own prefix cache.
        assert got["hits"] >= 0.9 * got["n_prompt"], got
        print(f"\nvLLM container: checkpoint {m.bytes / 2**30:.2f} GiB in {m.timings['dump']:.1f} s, restore "
              f"{res.timings}, next turn {got['hits']:.0f} of {got['n_prompt']} prompt tokens from the prefix cache")
    finally:
        _podman("rm", "--force", "--time", "0", name)
    # Nothing of the container's shared memory is in the node's /dev/shm (its own tmpfs, gone with it).
    assert not (set(shm0) | set(shm1)) & set(os.listdir("/dev/shm"))
