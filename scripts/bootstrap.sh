#!/usr/bin/env bash
# Installs what rl_engine_ext needs and builds it in place (idempotent; safe to rerun).
#   * torch: kept if already importable (CUDA or ROCm builds on GPU machines); otherwise a CPU
#     build of torch==$TORCH_VERSION (default 2.13.0), installed only from a source that really
#     serves one: pip's configured indexes first (this project's CI machines keep the CPU wheel on
#     disk), then PyTorch's CPU index. The PyPI wheel of the same version is a multi-GB CUDA build
#     on Linux x86-64: if no source offers a CPU build, nothing is installed and the script says
#     how to install a torch yourself.
#   * build/test tools: ninja, pybind11, pytest, hypothesis, matplotlib (benchmark plots),
#     transformers (the model patch's tests and example), peft (LoRA on a patched model's tests;
#     with --no-deps, so pip never resolves torch again: accelerate and psutil are its only
#     requirements that transformers does not bring).
#   * the package: pip install --no-build-isolation -e .  (RL_ENGINE_EXT_NO_NATIVE=1 skips the
#     native build; see setup.py for the CUDA/ROCm arch variables).
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
  "$PY" -m pip install --dry-run --no-deps -q --report "$report" "$@" "torch==$TORCH_VERSION" >/dev/null 2>&1 \
    && "$PY" - "$report" <<'PY'
import json, sys
item = json.load(open(sys.argv[1]))["install"][0]
meta = item["metadata"]
gpu = [r for r in meta.get("requires_dist", []) if r.startswith(("nvidia-", "triton"))]
cpu = meta["version"].endswith("+cpu") or not gpu
print(f"bootstrap: torch {meta['version']} from {item['download_info']['url']}: "
      + ("a CPU build" if cpu else f"NOT a CPU build (requires {gpu[0]}, ...)"))
sys.exit(0 if cpu else 1)
PY
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
missing=()
for mod in ninja pybind11 pytest hypothesis matplotlib setuptools wheel; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
# transformers (pure Python): the Hugging Face model patch's tests and example; the version the
# GPU machine has, so CPU CI and the H100 run the same model code.
"$PY" -c "import transformers" 2>/dev/null || missing+=("transformers==5.17.0")
if [ ${#missing[@]} -gt 0 ]; then
  "$PY" -m pip install -q "${missing[@]}"
fi
# peft (pure Python): tests/test_hf_patch.py's LoRA-after-patch test. --no-deps: its requirements
# include torch; the rest (numpy, packaging, pyyaml, tqdm, safetensors, huggingface_hub,
# transformers) come with transformers above.
peft_missing=()
for spec in psutil:psutil accelerate:accelerate==1.15.0 peft:peft==0.21.2; do
  "$PY" -c "import ${spec%%:*}" 2>/dev/null || peft_missing+=("${spec#*:}")
done
if [ ${#peft_missing[@]} -gt 0 ]; then
  "$PY" -m pip install -q --no-deps "${peft_missing[@]}"
fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -q --no-build-isolation -e .
