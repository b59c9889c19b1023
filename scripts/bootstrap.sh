#!/usr/bin/env bash
# Installs what rl_engine_ext needs and builds it in place (idempotent; safe to rerun).
#   * torch: kept if already importable (CUDA or ROCm builds on GPU machines); otherwise a CPU
#     build of torch==$TORCH_VERSION (default 2.13.0), installed only from a source that really
#     serves one: pip's configured indexes first (this project's CI machines keep the CPU wheel on
#     disk), then PyTorch's CPU index. The PyPI wheel of the same version is a multi-GB CUDA build
#     on Linux x86-64: if no source offers a CPU build, nothing is installed and the script says
#     how to install a torch yourself.
#   * build/test tools: ninja, pybind11, pytest, pytest-xdist (the README's `pytest -n 2`),
#     hypothesis, matplotlib (benchmark plots),
#     transformers (the model patch's tests and example), peft (LoRA on a patched model's tests;
#     with --no-deps, so pip never resolves torch again: accelerate and psutil are its only
#     requirements that transformers does not bring).
#   * the package, built in place and incrementally: `setup.py build_ext --inplace` (ninja keeps
#     its objects in build/temp.*, so a rerun on an unchanged tree compiles nothing; its [n/N]
#     progress lines are shortened to the file they compile), then an editable install
#     (pip install --no-build-isolation -e .), made again only when it is missing, points at
#     another tree, or no longer fits the torch (version label, torch requirement).
#     RL_ENGINE_EXT_NO_NATIVE=1 skips the native build; see setup.py for the CUDA/ROCm arch variables.
#     With ccache on PATH, torch's build compiles through it; CCACHE_BASEDIR is this tree, so a build
#     of the same sources in another folder under it (scripts/check_packaging.sh's wheel from the
#     sdist) is served from the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# Exit 0 if what pip would install for torch==$TORCH_VERSION (with the extra pip arguments given)
# is a CPU build: a "+cpu" version, or no CUDA runtime packages among its requirements. pip's
# --dry-run resolves from the index's metadata without downloading the wheel.
is_cpu_torch_source() {
  local report
  report=$(mktemp)
  local verdict=1
  "$PY" -m pip install --dry-run --no-deps -q --report "$report" "$@" "torch==$TORCH_VERSION" >/dev/null 2>&1 \
    && "$PY" - "$report" <<'PY' && verdict=0
import json, sys
item = json.load(open(sys.argv[1]))["install"][0]
meta = item["metadata"]
gpu = [r for r in meta.get("requires_dist", []) if r.startswith(("nvidia-", "triton"))]
cpu = meta["version"].endswith("+cpu") or not gpu
print(f"bootstrap: torch {meta['version']} from {item['download_info']['url']}: "
      + ("a CPU build" if cpu else f"NOT a CPU build (requires {gpu[0]}, ...)"))
sys.exit(0 if cpu else 1)
PY
  rm -f "$report"
  return $verdict
}

if "$PY" -c "import torch" 2>/dev/null; then
  echo "bootstrap: keeping the installed torch $("$PY" -c "import torch; print(torch.__version__)")"
elif is_cpu_torch_source; then
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
elif is_cpu_torch_source --index-url "$TORCH_CPU_INDEX"; then
  "$PY" -m pip install -q --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION"
else
  echo "bootstrap: no CPU build of torch==$TORCH_VERSION is reachable (pip's indexes, $TORCH_CPU_INDEX);" \
    "nothing installed. Install the torch you want first (CPU: pip install torch==$TORCH_VERSION" \
    "--index-url $TORCH_CPU_INDEX; CUDA/ROCm: see pytorch.org), then rerun." >&2
  exit 1
fi
# The requirements of each MODULE:REQUIREMENT that is not importable (looked up, not imported).
missing() {
  "$PY" - "$@" <<'PY'
import importlib.util, sys
print(" ".join(spec.split(":", 1)[1] for spec in sys.argv[1:] if importlib.util.find_spec(spec.split(":", 1)[0]) is None))
PY
}
# transformers (pure Python): the Hugging Face model patch's tests and example; the version the
# GPU machine has, so CPU CI and the H100 run the same model code.
read -r -a tools <<< "$(missing ninja:ninja pybind11:pybind11 pytest:pytest xdist:pytest-xdist hypothesis:hypothesis matplotlib:matplotlib \
  setuptools:setuptools wheel:wheel transformers:transformers==5.17.0)"
if [ ${#tools[@]} -gt 0 ]; then
  "$PY" -m pip install -q "${tools[@]}"
fi
# peft (pure Python): tests/test_hf_patch.py's LoRA-after-patch test. --no-deps: its requirements
# include torch; the rest (numpy, packaging, pyyaml, tqdm, safetensors, huggingface_hub,
# transformers) come with transformers above.
read -r -a peft <<< "$(missing psutil:psutil accelerate:accelerate==1.15.0 peft:peft==0.21.2)"
if [ ${#peft[@]} -gt 0 ]; then
  "$PY" -m pip install -q --no-deps "${peft[@]}"
fi

export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true  # NOHASHDIR: the build's -g would hash the folder
echo "bootstrap: building the native library in place (compiles only what changed since the last build)"
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" setup.py -q build_ext --inplace \
  | sed -u -E "s#^(\[[0-9]+/[0-9]+\]) .* -c $PWD/([^ ]+) -o .*#\1 \2#"
version=$("$PY" setup.py -q --version)
# -I: the installed metadata, not a rl_engine_ext.egg-info that `setup.py sdist` left in this tree.
if "$PY" -I - "$version" <<'PY'
import importlib.metadata as md, json, pathlib, sys
from packaging.requirements import Requirement
try:
    dist = md.distribution("rl_engine_ext")
except md.PackageNotFoundError:
    sys.exit(1)
origin = json.loads(dist.read_text("direct_url.json") or "{}")
here = origin.get("dir_info", {}).get("editable") and origin.get("url") == pathlib.Path.cwd().as_uri()
torch_fits = all(Requirement(r).specifier.contains(md.version("torch"), prereleases=True)
                 for r in dist.requires or [] if Requirement(r).name == "torch")
sys.exit(0 if here and dist.version == sys.argv[1] and torch_fits else 1)
PY
then
  echo "bootstrap: rl_engine_ext $version is installed in editable mode from this tree"
else
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
fi
