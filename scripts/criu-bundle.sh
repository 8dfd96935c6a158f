#!/usr/bin/env bash
# Build a relocatable CRIU bundle from the CRIU installed here (scripts/install-criu.sh), for GPU
# nodes that run another distribution (Ubuntu 22.04/24.04) and often have no route to a mirror.
#
#   ./scripts/criu-bundle.sh [OUT_DIR]        # default: .carry/criu
#   tar -C .carry -czf criu-bundle.tgz criu   # copy it to the node, unpack anywhere
#   export CKPTFLOW_CRIU=/where/criu/bin/criu # the runner, `fingerprint` and `doctor` use it
# Unpacked as .carry/criu in the project directory or as /opt/ckptflow/criu, it is found without
# CKPTFLOW_CRIU when `criu` is not on PATH (ckptflow/runners/criu.py: find_criu; `ckptflow doctor`).
#
# Layout: bin/criu, bin/criu-ns, bin/ip, bin/ss are wrappers that set LD_LIBRARY_PATH to lib/ for the
# real binary alone (in libexec/), so the bundle's libraries never leak into the worker or the
# node's other tools. glibc (libc, libm, ld.so) is the node's own: build the bundle on the
# oldest glibc you target (Debian 12 has 2.36; Ubuntu 22.04 has 2.35: build there or on
# Debian 11 if 22.04 is a target). plugins/ is empty on purpose: CRIU's cuda plugin fails on
# these drivers, ckptflow drives the CUDA driver API itself.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.carry/criu}
CRIU=$(command -v criu || true)
[ -n "$CRIU" ] || { echo "criu-bundle: no criu on PATH: run ./scripts/install-criu.sh first" >&2; exit 2; }
CRIU=$(readlink -f "$CRIU")
NS=$(command -v criu-ns || true)
IP=$(command -v ip || true)
SS=$(command -v ss || true)  # the runner frees TIME_WAIT ports of a dead worker with `ss -K`

rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp"/{bin,libexec,lib,plugins}
libs() {  # non-glibc shared libraries of a binary
  ldd "$1" | awk '/=>/ {print $3}' | grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' || true
}
copy_bin() {
  local src=$1 name=$2
  install -m 0755 "$src" "$OUT.tmp/libexec/$name"
  for l in $(libs "$src"); do cp -nL "$l" "$OUT.tmp/lib/"; done
  cat > "$OUT.tmp/bin/$name" <<'W'
#!/bin/sh
# Relocatable wrapper (scripts/criu-bundle.sh): the bundle's libraries for this binary only.
here=$(dirname "$(readlink -f "$0")")/..
LD_LIBRARY_PATH="$here/lib" exec "$here/libexec/NAME" "$@"
W
  sed -i "s/NAME/$name/" "$OUT.tmp/bin/$name"
  chmod 0755 "$OUT.tmp/bin/$name"
}
copy_bin "$CRIU" criu
[ -n "$IP" ] && copy_bin "$(readlink -f "$IP")" ip
[ -n "$SS" ] && copy_bin "$(readlink -f "$SS")" ss
if [ -n "$NS" ]; then
  # criu-ns is Python that execs `criu` from PATH: put the bundle's wrapper first for it.
  install -m 0755 "$NS" "$OUT.tmp/libexec/criu-ns"
  cat > "$OUT.tmp/bin/criu-ns" <<'W'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
PATH="$here:$PATH" exec python3 "$here/../libexec/criu-ns" "$@"
W
  chmod 0755 "$OUT.tmp/bin/criu-ns"
fi
"$CRIU" --version | head -1 > "$OUT.tmp/VERSION"
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "criu-bundle: $OUT ($(du -sh "$OUT" | cut -f1), $(cat "$OUT/VERSION")); found as .carry/criu or /opt/ckptflow/criu, else set CKPTFLOW_CRIU=$OUT/bin/criu"
