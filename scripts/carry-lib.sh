# Shared by scripts/carry-vllm.sh and scripts/carry-sglang.sh (sourced, not run): carry an engine,
# the packages it imports that a GPU machine's image lacks, the CRIU bundle and ckptflow's runner
# wheels to a machine with no package index, in parts of <= 58 MiB (a device call carries <= 64 MiB,
# the working tree included). The caller sets NAME (parts in .whl/$NAME-carry, staged in
# $HOME/$NAME-parts), SITE (where the wheels are installed), PYVER, and defines fetch_wheels DIR.
PART_MB=58
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64
           manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 linux_x86_64)

download() {  # DEST SPEC...: wheels for the GPU machine's Python, never for this one's
  local dest=$1; shift
  local plat=()
  for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" "${plat[@]}" -d "$dest" "$@"
}

pack() {
  local outdir=.whl/$NAME-carry stage
  [ -x .carry/criu/bin/criu ] || ./scripts/criu-bundle.sh
  [ -d .carry/py/pydantic ] || ./scripts/carry-wheels.sh "$PYVER"
  stage=$(mktemp -d)
  mkdir -p "$stage/wheels"
  fetch_wheels "$stage/wheels"
  cp -a .carry/criu "$stage/criu"
  cp -a .carry/py "$stage/py"
  rm -rf "$outdir" && mkdir -p "$outdir"
  tar -C "$stage" -cf - wheels criu py | gzip -6 | split -b "${PART_MB}M" -d -a 2 --numeric-suffixes=1 - "$outdir/part-"
  rm -rf "$stage"
  (cd "$outdir" && sha256sum part-* > MANIFEST)
  echo "carry-$NAME: $(ls "$outdir"/part-* | wc -l) parts in $outdir ($(du -sh "$outdir" | cut -f1)):"
  cat "$outdir/MANIFEST"
}

stage() {  # PART: copy one carried part out of the tree (the next call removes it from the tree)
  mkdir -p "$HOME/$NAME-parts"
  cp "$1" "$HOME/$NAME-parts/"
  echo "carry-$NAME: staged $(basename "$1"); have: $(ls "$HOME/$NAME-parts" | tr '\n' ' ')"
}

install() {
  local parts=$HOME/$NAME-parts carry=$HOME/$NAME-carry manifest=.whl/$NAME-carry/MANIFEST have t0
  have=$(ls "$parts" | wc -l)
  echo "carry-$NAME: $have parts staged"
  if [ -f "$manifest" ]; then (cd "$parts" && sha256sum -c --quiet "$OLDPWD/$manifest"); fi
  rm -rf "$carry" "$SITE" && mkdir -p "$carry"
  cat "$parts"/part-* | gzip -dc | tar -C "$carry" -xf -
  t0=$SECONDS
  python3 -m pip install -q --disable-pip-version-check --no-deps --no-index --target "$SITE" "$carry"/wheels/*.whl
  echo "carry-$NAME: installed $(ls "$carry"/wheels | wc -l) wheels into $SITE in $((SECONDS - t0)) s"
  rm -rf "$parts"
  "$carry/criu/bin/criu" --version | head -1
}

env_common() {
  local carry=$HOME/$NAME-carry
  echo "export PYTHONPATH=$SITE:$PWD:$carry/py\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export CKPTFLOW_CRIU=$carry/criu/bin/criu PATH=$carry/criu/bin:\$PATH"
  echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
  echo "export DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1"
}

carry_main() {  # the command line of the script that sourced this file
  case "${1:-}" in
    pack) pack ;;
    stage) stage "$2" ;;
    install) install ;;
    env) env_ ;;
    *) echo "usage: $0 pack | stage PART | install | env" >&2; exit 2 ;;
  esac
}
