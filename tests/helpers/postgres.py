"""A throwaway PostgreSQL cluster on 127.0.0.1 (Debian's binaries), for Prefect's database in
the fleet-mode tests: initdb into a temp dir, start, create the database, stop at the end."""

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name)]
    if not found or not found[-1]:
        raise RuntimeError(f"PostgreSQL's {name} not found: run ./scripts/setup.sh (installs Debian's postgresql)")
    return found[-1]


class Postgres:
    """``Postgres(port).start()``; ``.url`` is Prefect's connection URL; ``.stop()`` removes it all."""

    def __init__(self, port: int):
        # Its own temp dir: pytest's tmp dirs are root-only, and the server runs as postgres.
        self.root, self.port = Path(tempfile.mkdtemp(prefix="ckptflow-pg-")), port
        self.data = self.root / "data"
        self.url = f"postgresql+asyncpg://prefect@127.0.0.1:{port}/prefect"

    def _run(self, *cmd: str) -> subprocess.CompletedProcess:
        # initdb and the server refuse to run as root: run them as the package's postgres user.
        pre = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run([*pre, *cmd], check=True, capture_output=True, text=True, cwd="/")

    def start(self) -> "Postgres":
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self._run(_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "prefect", "--no-sync")
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60",
                  "-o", f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off",
                  "start")
        self._run(_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "prefect", "prefect")
        return self

    def sql(self, query: str) -> str:
        return self._run(_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "prefect", "-d", "prefect",
                         "-tAc", query).stdout.strip()

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
