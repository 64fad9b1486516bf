#!/usr/bin/env bash
# TransformerEngine (TE) on the GPU machine, which has no internet (see docs/fp8.md,
# "Getting TE onto the GPU machine"). Each step is a sub-command:
#
#   here (reaches PyPI):  bash scripts/gpu_te_setup.sh fetch
#       downloads TE $TE_VERSION for CUDA 13 / Python 3.12 into $TE_DIR (default .whl/te):
#       parts/   the core wheel (transformer_engine_cu13, ~276 MB) split into pieces that fit
#                one device call (64 MiB a call, working tree included)
#       rest/    the meta wheel, the torch extension's sdist, small dependencies, SHA256SUMS
#   there, once per carried piece (consecutive calls, the machine stays warm ~30 s):
#       bash scripts/gpu_te_setup.sh receive      copies $TE_DIR/parts/* to $TE_STAGE (/tmp)
#   there, in the call that carries the last piece and rest/:
#       bash scripts/gpu_te_setup.sh install      reassembles and checks the core wheel, installs
#                everything into $TE_SITE (/tmp/te-site, used through PYTHONPATH) and builds the
#                torch extension from the sdist (or installs rest/transformer_engine_torch-*.whl,
#                a wheel built there before); the built wheel is copied to $OUT.
#   then: bash scripts/gpu_te_setup.sh test     the TE GPU tests (TESTS=... for others), log and
#                the trace report (SHARDC_TE_REPORT) in $OUT
#   e.g. the last call's command, from the repository root there:
#       export TE_DIR=$PWD/.whl/te; bash scripts/gpu_te_setup.sh receive &&
#       bash scripts/gpu_te_setup.sh install && bash scripts/gpu_te_setup.sh test
set -euo pipefail
TE_VERSION="${TE_VERSION:-2.20.2}"
TE_DIR="$(realpath -m "${TE_DIR:-.whl/te}")"
TE_STAGE="${TE_STAGE:-/tmp/te-stage}"
TE_SITE="${TE_SITE:-/tmp/te-site}"
PY="${PYTHON:-python3}"
PARTS="${TE_PARTS:-5}"

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

download_wheels() {  # the device's Python (3.12, x86-64), never this machine's
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${PLATFORMS[@]}" -d "$1" "${@:2}"
}

fetch_sdist() {  # pip cannot fetch it alone: its metadata step needs CUDA; read the index
  local name=transformer-engine-torch file="transformer_engine_torch-$TE_VERSION.tar.gz"
  local index="${PIP_INDEX_URL:-https://pypi.org/simple}" url sum
  url=$(curl -fsSL "$index/$name/" | grep -o "href=\"[^\"]*/$file#sha256=[0-9a-f]*\"" | head -1 \
        | sed 's/^href="//; s/"$//')
  [ -n "$url" ] || { echo "no $file in $index/$name/" >&2; exit 1; }
  sum="${url##*#sha256=}"
  curl -fsSL -o "$1/$file" "${url%%#*}"
  echo "$sum  $file" | (cd "$1" && sha256sum -c -)
}

fetch() {
  local dl="$TE_DIR/dl" core
  rm -rf "$TE_DIR/parts" "$TE_DIR/rest"
  mkdir -p "$dl" "$TE_DIR/parts" "$TE_DIR/rest"
  download_wheels "$dl" "transformer_engine_cu13==$TE_VERSION"
  download_wheels "$TE_DIR/rest" "transformer_engine==$TE_VERSION"
  # TE's Python code needs what the device image lacks: pydantic's stack and nvdlfw-inspect
  # (imported by transformer_engine.debug); nvidia-cudnn-frontend is optional and left out.
  download_wheels "$TE_DIR/rest" pydantic
  local pd_core
  pd_core=$(unzip -p "$TE_DIR"/rest/pydantic-*.whl '*/METADATA' \
            | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
  download_wheels "$TE_DIR/rest" "pydantic-core==$pd_core" annotated-types typing-inspection \
      typing-extensions nvdlfw-inspect
  fetch_sdist "$TE_DIR/rest"
  core=$(cd "$dl" && ls transformer_engine_cu13-"$TE_VERSION"-*.whl)
  (cd "$dl" && sha256sum "$core") > "$TE_DIR/rest/SHA256SUMS"
  split -n "$PARTS" -d -a 2 "$dl/$core" "$TE_DIR/parts/$core.part"
  rm -rf "$dl"
  ls -la "$TE_DIR/parts" "$TE_DIR/rest"
  echo "carry each of $TE_DIR/parts/* in its own call (receive), the last with $TE_DIR/rest (install)"
}

receive() {
  mkdir -p "$TE_STAGE"
  cp -v "$TE_DIR"/parts/*.part* "$TE_STAGE/"
  ls -la "$TE_STAGE"
}

build_torch_extension() {  # C++ only (no CUDA kernels): a few minutes on 16 cores
  local sdist="$TE_DIR/rest/transformer_engine_torch-$TE_VERSION.tar.gz"
  mkdir -p "$TE_STAGE/built"
  # FORCE_BUILD: setup.py would otherwise try to download a prebuilt wheel (no network there).
  # NCCL_EP off: expert-parallel kernels need NCCL headers the image may lack; shardc uses none.
  NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_WITH_NCCL_EP=0 NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS:-90}" \
  MAX_JOBS="${MAX_JOBS:-16}" PYTHONPATH="$TE_SITE${PYTHONPATH:+:$PYTHONPATH}" \
      "$PY" -m pip wheel -q --no-build-isolation --no-deps --no-index "$sdist" \
      -w "$TE_STAGE/built"
  if [ -n "${OUT:-}" ]; then
    cp -v "$TE_STAGE"/built/transformer_engine_torch-*.whl "$OUT/"
  fi
}

install() {
  local part core
  part=$(ls "$TE_STAGE"/*.part00)
  core="${part%.part00}"
  cat "$core".part* > "$core"
  (cd "$TE_STAGE" && sha256sum -c "$TE_DIR/rest/SHA256SUMS")
  # A prebuilt torch-extension wheel in rest/ (from an earlier build there) installs with the rest.
  local wheels=("$TE_DIR"/rest/*.whl "$core")
  local prebuilt
  prebuilt=$(ls "$TE_DIR"/rest/transformer_engine_torch-*.whl 2>/dev/null || true)
  if [ -z "$prebuilt" ]; then
    build_torch_extension
    wheels+=("$TE_STAGE"/built/transformer_engine_torch-*.whl)
  fi
  # One pip call for all: the wheels share the folder transformer_engine/, and a later
  # `pip install --target --upgrade` would replace the whole folder with its own files.
  rm -rf "$TE_SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$TE_SITE" "${wheels[@]}"
  PYTHONPATH="$TE_SITE" "$PY" -c 'from importlib.metadata import version
import torch, transformer_engine.pytorch as te
print("TE", version("transformer_engine"), "torch", torch.__version__, "fp8", te.is_fp8_available())'
}

run_tests() {  # there, after install; from the repository root (the checkout carried there)
  local out="${OUT:-out/gpu_te}"
  mkdir -p "$out"
  SHARDC_TE_REPORT="$out/te_report.jsonl" PYTHONUNBUFFERED=1 \
  PYTHONPATH="$PWD:$TE_SITE${PYTHONPATH:+:$PYTHONPATH}" \
      "$PY" -m pytest -q -m gpu -rA --tb=short -p no:logging ${TESTS:-tests/gpu/test_te_gpu.py} \
      2>&1 | tee "$out/te_tests.log"
}

case "${1:-}" in
  fetch) fetch ;;
  receive) receive ;;
  install) install ;;
  test) run_tests ;;
  *) echo "usage: $0 fetch|receive|install|test (see the comment at the top)" >&2; exit 2 ;;
esac
