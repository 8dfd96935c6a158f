#!/usr/bin/env bash
# Build and install CRIU >= 4.2 from Debian's own source tarball (sid/forky suites).
# Why: Debian 12's criu 3.17 fails `criu check` on kernels >= 6.x here, and Debian 13's 4.1
# cannot dump AF_INET sockets on kernels >= 6.16 (upstream bug #2705). See README "CRIU".
# apt verifies the tarball's hash against the signed index; the system's apt state is untouched
# (temporary Dir::State::Lists / Dir::Cache / sources).
set -euo pipefail

PREFIX=${CRIU_PREFIX:-/usr/local}
if [ "$(id -u)" != 0 ]; then
  echo "install-criu: must run as root (apt-get and installing into $PREFIX). Re-run with sudo." >&2
  exit 1
fi

DEPS="build-essential pkg-config python3 python3-protobuf xz-utils protobuf-c-compiler \
libprotobuf-c-dev libprotobuf-dev protobuf-compiler libnl-3-dev libnet1-dev libcap-dev \
libbsd-dev libgnutls28-dev libnftables-dev uuid-dev iproute2 nftables"
missing=$(dpkg-query -W -f='${Package} ${Status}\n' $DEPS 2>/dev/null | awk '$4!="installed"{print $1}'; \
          for p in $DEPS; do dpkg-query -W "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$(echo "$missing" | tr -d '[:space:]')" ]; then
  echo "install-criu: apt-get install build dependencies"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $DEPS >/dev/null
fi

work=$(mktemp -d /tmp/criu-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
# The Debian archive this machine's apt is configured with (its main suite, not -security or
# -updates), as apt itself reports it: no host is written here.
debian_archive() {
  apt-get indextargets --format '$(ORIGIN) $(REPO_URI) $(RELEASE)' 2>/dev/null \
    | awk '$1 == "Debian" && $3 !~ /-(security|updates|backports)$/ { print $2; exit }'
}
mirror=$(debian_archive)
if [ -z "$mirror" ]; then  # the origin is known once the lists are there
  apt-get update -qq
  mirror=$(debian_archive)
fi
if [ -z "$mirror" ]; then
  echo "install-criu: none of this machine's apt sources is a Debian archive ('apt-get indextargets' lists none);" \
       "add one to /etc/apt/sources.list.d/, or install CRIU >= 4.2 on PATH yourself" >&2
  exit 1
fi
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/src"
cat > "$work/src.sources" <<SRC
Types: deb-src
URIs: $mirror
Suites: sid forky
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
apt_opts=(-o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
          -o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$work/none"
          -o "Dir::Etc::sourcelist=$work/src.sources" -o "APT::Sandbox::User=root")
mkdir -p "$work/none"
echo "install-criu: fetch criu source from $mirror (sid/forky)"
apt-get "${apt_opts[@]}" update -qq
(cd "$work/src" && apt-get "${apt_opts[@]}" source --download-only --tar-only criu >/dev/null)
tarball=$(ls "$work"/src/criu_*.orig.tar.* | sort -V | tail -1)
tar -C "$work" -xf "$tarball" --exclude="*/test/*"
srcdir=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'criu-[0-9]*' | head -1)
echo "install-criu: build $(basename "$srcdir")"
make -C "$srcdir" -j"$(nproc)" PREFIX="$PREFIX" PLUGINDIR="$PREFIX/lib/criu" SKIP_PIP_INSTALL=1 criu >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; exit 1; }
make -C "$srcdir" PREFIX="$PREFIX" PLUGINDIR="$PREFIX/lib/criu" SKIP_PIP_INSTALL=1 install-criu >>"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; exit 1; }
# criu-ns is a script in the source tree; install it too (restore into a fresh PID namespace).
if [ -f "$srcdir/scripts/criu-ns" ]; then
  install -m 0755 "$srcdir/scripts/criu-ns" "$PREFIX/sbin/criu-ns"
fi
hash -r
echo "install-criu: installed $("$PREFIX/sbin/criu" --version | head -1)"
