"""No secret — Slack webhook, S3 keys, chunk key — in logs, artifacts, manifests or the bucket."""

import base64
import logging
import os
import signal

import pytest
import yaml

from conftest import SlackCapture, write_fleet
from ckptflow.models import CheckpointState
from ckptflow.store.local import LocalStore

pytestmark = [pytest.mark.criu, pytest.mark.fault]


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


def test_no_secret_leaks_anywhere(tmp_path, prefect_harness, demo_worker, s3, monkeypatch):
    from prefect.client.orchestration import get_client

    from ckptflow.flows.heartbeat import heartbeat
    from ckptflow.flows.recover import recover
    from ckptflow.flows.verify import verify

    slack = SlackCapture(status=500)                       # errors get logged: they must not carry the URL
    webhook = slack.url.replace("XXXX", "SeCrEtWeBhOoKtOkEn42")
    key = base64.b64encode(os.urandom(32)).decode()
    monkeypatch.setenv("CKPTFLOW_TEST_SLACK_WEBHOOK", webhook)
    monkeypatch.setenv("CKPTFLOW_TEST_CHUNK_KEY", key)
    secrets = ["SeCrEtWeBhOoKtOkEn42", s3.SECRET, key]
    try:
        w = demo_worker("chat")
        fleet = write_fleet(tmp_path / "fleet.yaml", [w.workload], tmp_path / "store", slack=True)
        data = yaml.safe_load(fleet.read_text())
        data["storage"].update(kind="s3", bucket=s3.bucket("ckpt-sec"), endpoint_url=s3.endpoint,
                               encryption_key_env="CKPTFLOW_TEST_CHUNK_KEY")
        fleet.write_text(yaml.safe_dump(data))
        ckpt = heartbeat(str(fleet))[0]["checkpoint"]
        store = LocalStore(tmp_path / "store")
        store.set_state(store.get("chat", ckpt), CheckpointState.complete, None, golden="2" * 64)
        keep = _Keep()
        logging.getLogger("ckptflow").addHandler(keep)
        try:
            verify(str(fleet))                             # fails -> Slack -> 500 -> logged
        finally:
            logging.getLogger("ckptflow").removeHandler(keep)
        os.kill(w.pid, signal.SIGKILL)
        recover(str(fleet), "chat")
        assert len(slack.requests) >= 1
    finally:
        slack.close()

    with get_client(sync_client=True) as c:
        logs = " ".join(keep.lines) + " ".join(l.message for l in c.read_logs(limit=200))
        arts = " ".join(str(a.data) for a in c.read_artifacts(limit=200))
    files = " ".join(p.read_text(errors="replace") for p in (tmp_path / "store").rglob("*")
                     if p.is_file() and "images" not in p.parts)
    bucket = " ".join(s3.client.get_object(Bucket="ckpt-sec", Key=o["Key"])["Body"].read().decode()
                      for o in s3.client.list_objects_v2(Bucket="ckpt-sec", Prefix="ckptflow/manifests/")["Contents"])
    assert "slack webhook answered 500" in logs and "golden output digest differs" in arts
    for where, text in (("logs", logs), ("artifacts", arts), ("store files", files), ("bucket manifests", bucket)):
        for secret in secrets:
            assert secret not in text, f"a secret leaked into {where}"
