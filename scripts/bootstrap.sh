#!/usr/bin/env bash
# Installs what rl_engine_ext needs and builds it in place (idempotent; safe to rerun).
#   * torch: kept if already importable (CUDA or ROCm builds on GPU machines); otherwise the
#     CPU wheel torch==2.13.0 (never a plain `torch`, which would pull a multi-GB CUDA build).
#   * build/test tools: ninja, pybind11, pytest, hypothesis, matplotlib (benchmark plots),
#     transformers (the model patch's tests and example).
#   * the package: pip install --no-build-isolation -e .  (RL_ENGINE_EXT_NO_NATIVE=1 skips the
#     native build; see setup.py for the CUDA/ROCm arch variables).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
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
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -q --no-build-isolation -e .
