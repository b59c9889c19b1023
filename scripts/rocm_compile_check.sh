#!/usr/bin/env bash
# The ROCm build as far as a machine without a ROCm PyTorch can take it (CI): a copy of the
# sources hipified by torch's own hipify with the arguments torch.utils.cpp_extension uses when
# setup.py builds the ROCm extension (rocm wheel: scripts/build_wheel.sh rocm), then every
# hipified kernel (csrc/hip/**/*.hip, torch-free) compiled with hipcc for the wheel's architectures.
# Not run here: the hipified launchers and bindings (they need a ROCm libtorch) and the kernels
# on an AMD GPU.
#   HIP_ARCHS: default "gfx90a;gfx940". The wheel targets gfx90a;gfx942; Debian's LLVM 15 hipcc
#   does not know gfx942, so its CDNA3 sibling gfx940 (the same instruction set) stands in.
#   HIP_OPT: default -O3 (the wheel's). CI passes -O0: the same front end, and for each
#   architecture the AMDGPU back end's instruction selection, register allocation and
#   shared-memory limits, without the optimizer's passes; 5x less compile time (attention/simt
#   for gfx940: -O1 70 s, -O0 14 s; the whole check 715 -> 289 CPU s).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HIP_ARCHS=${HIP_ARCHS:-gfx90a;gfx940}
HIP_OPT=${HIP_OPT:--O3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r csrc "$work/"
"$PY" - "$work" <<'PY'
import glob, os, sys
from torch.utils.hipify import hipify_python

root = sys.argv[1]
sources = sorted(glob.glob(os.path.join(root, "csrc", "**", "*.cpp"), recursive=True)
                 + glob.glob(os.path.join(root, "csrc", "**", "*.cu"), recursive=True))
result = hipify_python.hipify(project_directory=root, output_directory=root, header_include_dirs=[],
                              includes=[os.path.join(root, "*")], extra_files=sources, show_detailed=False,
                              show_progress=False, is_pytorch_extension=True, hipify_extra_files_only=True)
kernels = sorted(glob.glob(os.path.join(root, "csrc", "hip", "**", "*.hip"), recursive=True))
cu = glob.glob(os.path.join(root, "csrc", "cuda", "**", "*.cu"), recursive=True)
assert len(kernels) == len(cu), f"hipify produced {len(kernels)} kernel files for {len(cu)} .cu sources"
print(f"hipified {len(result)} files: {len(kernels)} kernel sources")
PY
HIP_PLATFORM=amd cmake -S cmake -B "$work/build" -G Ninja -DRL_ALIGN_GPU=hip -DCMAKE_CXX_COMPILER="$(command -v hipcc)" \
  -DRL_ALIGN_CSRC="$work/csrc" -DRL_ALIGN_KERNEL_GLOB='hip/*.hip' -DRL_ALIGN_HIP_ARCHS="$HIP_ARCHS" -DRL_ALIGN_HIP_OPT="$HIP_OPT" >/dev/null
HIP_PLATFORM=amd cmake --build "$work/build"
