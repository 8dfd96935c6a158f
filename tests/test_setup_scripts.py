"""The setup scripts use only the package sources this machine is configured with."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "scripts").glob("*.sh")) + [REPO / ".ci" / "run"]


def test_no_script_names_a_package_host():
    hosts = {}
    for s in SCRIPTS:
        for m in re.finditer(r"https?://([A-Za-z0-9.-]+)", s.read_text()):
            if m.group(1) not in ("127.0.0.1", "localhost"):
                hosts.setdefault(s.name, set()).add(m.group(1))
    assert hosts == {}


def _archive(tmp_path: Path, indextargets: str) -> subprocess.CompletedProcess:
    """install-criu.sh's own lookup of the Debian archive, run against a stand-in apt-get that
    answers ``indextargets`` as apt does (and ``update`` with nothing new)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apt-get").write_text(f"#!/bin/sh\n[ \"$1\" = indextargets ] && printf '%s' '{indextargets}'\nexit 0\n")
    (fake / "apt-get").chmod(0o755)
    text = (REPO / "scripts" / "install-criu.sh").read_text()
    lookup = text[text.index("debian_archive() {"):text.index('mkdir -p "$work/lists/partial"')]
    return subprocess.run(["bash", "-c", f"set -euo pipefail\n{lookup}\necho \"$mirror\""], capture_output=True,
                          text=True, env={"PATH": f"{fake}:/usr/bin:/bin"})


def test_install_criu_takes_the_debian_archive_from_apt_itself(tmp_path):
    out = _archive(tmp_path, "Debian http://mirror.internal/debian-security/ bookworm-security\n"
                             "Other http://vendor.example/apt/ stable\n"
                             "Debian http://mirror.internal/debian/ bookworm\n")
    assert out.returncode == 0 and out.stdout.strip() == "http://mirror.internal/debian/"


def test_install_criu_without_a_debian_archive_says_so_in_one_line(tmp_path):
    out = _archive(tmp_path, "Other http://vendor.example/apt/ stable\n")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "none of this machine's apt sources is a Debian archive" in out.stderr
