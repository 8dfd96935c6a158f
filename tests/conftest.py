import os
import signal
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from seaweed import SeaweedS3  # noqa: E402
from slackcap import SlackCapture  # noqa: E402,F401  (tests import it from here)

HELPERS = Path(__file__).parent / "helpers"


def _criu_usable() -> str | None:
    if os.geteuid() != 0:
        return "not root: CRIU needs root"
    from ckptflow.errors import CkptflowError
    from ckptflow.runners.criu import CriuRunner

    r = CriuRunner()
    try:
        r.check()
    except CkptflowError as e:
        return str(e).splitlines()[0]
    finally:
        r.close()
    return None


_CRIU_PROBLEM = _criu_usable()


# --- the quick loop: `pytest -m "not slow"` (tests/README.md) ---------------------------------
# Slow is decided here, from what a test starts, so no test file needs a marker of its own:
# a fixture that starts a server or an engine, a file that is end-to-end as a whole, or one test
# that dumps a big image. Measured figures are in tests/README.md.
SLOW_FIXTURES = {
    "prefect_harness": "starts a Prefect server (PostgreSQL + API)",
    "s3": "starts SeaweedFS",
    "vllm_install": "starts vLLM", "vllm_model": "starts vLLM",
    "llama_install": "starts llama.cpp",
    "demo_image": "builds and runs containers",
}
SLOW_FILES = {
    "tests/test_demo.py": "the whole demo, end to end",
    "tests/test_soak.py": "a soak run of heartbeats, faults and restores",
    "tests/faults/test_faults.py": "fault injection on 0.5-1 GiB CRIU images",
    "tests/faults/test_prefect_restart.py": "restarts a Prefect server",
    "tests/faults/test_security.py": "a Prefect server and SeaweedFS",
}
SLOW_TESTS = {
    "tests/test_criu.py::test_512mib_process_round_trip": "a 512 MiB CRIU image",
    # `ckptflow simulate` over every policy and seed in a subprocess: 120-240 s each on the
    # shared 2-core machine (tests/README.md), half the rest of the quick loop together
    "tests/test_cli.py::test_simulate_json_has_every_policy": "the what-if simulator over every policy",
    "tests/test_cli.py::test_simulate_profile_two_tier_costs_less_and_a_wrong_profile_is_named":
        "the what-if simulator over every policy, two profiles",
    "tests/test_cli.py::test_simulate_table_prices_bytes_and_says_why_never_differs":
        "the what-if simulator over every policy, its table",
}


def slow_reason(nodeid: str, fixturenames) -> str | None:
    """Why a test is slow (None: it belongs to the quick loop)."""
    path = nodeid.split("::")[0]
    if path in SLOW_FILES:
        return SLOW_FILES[path]
    if nodeid.split("[")[0] in SLOW_TESTS:
        return SLOW_TESTS[nodeid.split("[")[0]]
    return next((why for f, why in SLOW_FIXTURES.items() if f in fixturenames), None)


def pytest_collection_modifyitems(config, items):
    for item in items:
        why = slow_reason(item.nodeid, item.fixturenames)
        if why is not None and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow(reason=why))
    if _CRIU_PROBLEM is None:
        return
    if os.environ.get("CKPTFLOW_REQUIRE_CRIU") == "1":
        # CI must run the real-CRIU tests: a missing CRIU is a failure there, not a skip.
        raise pytest.UsageError(f"CKPTFLOW_REQUIRE_CRIU=1 but CRIU is unusable: {_CRIU_PROBLEM}")
    skip = pytest.mark.skip(reason=f"real-CRIU test skipped: {_CRIU_PROBLEM} (run ./scripts/setup.sh as root)")
    for item in items:
        if "criu" in item.keywords:
            item.add_marker(skip)


def tear_pages(images: Path, offset: int = 4096) -> Path:
    """Flip one byte of the largest pages image under ``images``: a checkpoint whose checksum fails."""
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    return pages


ONE_WORKLOAD = {"fleet": "t", "nodes": [{"name": "n1", "work_pool": "n1"}],
                "workloads": [{"name": "w1", "node": "n1", "find": {"pid_file": "/run/w1.pid"}}]}


def one_workload_fleet(tmp_path: Path, **workload) -> Path:
    """A fleet file of one node and one workload, ``workload``'s keys set on it (None drops a key's value)."""
    import yaml

    data = yaml.safe_load(yaml.safe_dump(ONE_WORKLOAD))
    data["workloads"][0].update(workload)
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    return f


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_pid_file(pid_file: Path, must_contain: str) -> None:
    try:
        pid = int(pid_file.read_text())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return
    if must_contain in cmd:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def store(tmp_path):
    from ckptflow.store.local import LocalStore

    return LocalStore(tmp_path / "store")


@pytest.fixture
def criu():
    from ckptflow.runners.criu import CriuRunner

    r = CriuRunner()
    yield r
    r.close()


class DemoWorker:
    def __init__(self, tmp_path: Path, name: str = "w", ballast_mib: int = 0):
        from ckptflow.demo import launch

        self.port = free_port()
        self.pid_file = tmp_path / f"{name}.pid"
        self.proc = launch.start_worker(self.port, self.pid_file, ballast_mib=ballast_mib)
        self.workload = launch.demo_workload(name, self.port, self.pid_file)

    @property
    def pid(self) -> int:
        return int(self.pid_file.read_text())

    def complete(self, prompt, n, sid=None):
        from ckptflow.demo import launch

        return launch.complete(self.port, prompt, n, sid)

    def digests(self):
        from ckptflow.demo import launch

        return launch.session_digests(self.port)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        kill_pid_file(self.pid_file, "ckptflow.demo.worker")


@pytest.fixture
def demo_worker(tmp_path):
    workers = []

    def start(name="w", ballast_mib=0):
        w = DemoWorker(tmp_path, name, ballast_mib)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop()


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        # The flow heartbeat thread adds ~1 s to every sync flow; tests don't need it.
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield


def write_fleet(path: Path, workloads, store_root: Path, slack: bool = False) -> Path:
    import yaml

    node: dict = {"name": "local", "work_pool": "local"}
    gpu = [w for w in workloads if w.gpu]
    if gpu:   # a fleet file refuses a GPU workload on a node that declares no GPU
        node.update(gpu_class="test-gpu", gpus=max(w.tensor_parallel or 1 for w in gpu))
    data = {"fleet": "test", "storage": {"kind": "local", "path": str(store_root)}, "nodes": [node],
            "workloads": [w.model_dump(mode="json", exclude_none=True) for w in workloads]}
    if slack:
        data["slack"] = {"webhook_url_env": "CKPTFLOW_TEST_SLACK_WEBHOOK"}
        data["prefect_ui_url"] = "http://127.0.0.1:4200"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def slack(monkeypatch):
    cap = SlackCapture()
    monkeypatch.setenv("CKPTFLOW_TEST_SLACK_WEBHOOK", cap.url)
    yield cap
    cap.close()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    srv = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    yield srv
    srv.stop()


# --- vLLM (scripts/install-vllm.sh): shared by the process and the container tests ------------
_VLLM_WHY = "vLLM is not installed: run ./scripts/setup.sh (it runs scripts/install-vllm.sh)"


@pytest.fixture(scope="session")
def vllm_install():
    from ckptflow.engines import vllm

    inst = vllm.find_install()
    if inst is None:
        # CI installs it through setup.sh: missing there is a broken setup, never a skip.
        if os.environ.get("CI") or os.environ.get("CKPTFLOW_REQUIRE_CRIU") == "1":
            pytest.fail(_VLLM_WHY)
        pytest.skip(_VLLM_WHY)
    return inst


@pytest.fixture(scope="session")
def io_uring_off():
    """The node setting a checkpointable vLLM needs, put back as it was at the end."""
    from ckptflow.engines import vllm

    with vllm.io_uring_off():
        yield


@pytest.fixture(scope="session")
def vllm_model(vllm_install, tmp_path_factory):
    from ckptflow.engines import vllm

    return vllm.build_model(vllm_install, tmp_path_factory.mktemp("vllm-model") / "tiny-llama", seed=1234)
