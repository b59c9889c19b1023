#!/usr/bin/env bash
# One device-machine call: build with nvcc, run the whole test suite (CUDA parametrization
# included), the status matrix and the benchmarks; logs and results land in $OUT.
#   usage: [BENCHES="rms_norm linear"] bash scripts/gpu_session.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rl_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"

start=$(date +%s)
MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"

python3 -m pytest -q -p no:cacheprovider -o junit_family=xunit2 --junitxml="$OUT/pytest.xml" "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
python3 -m rl_engine_ext.check 2>&1 | tee "$OUT/check.log" | tail -30
for bench in ${BENCHES:-rms_norm linear}; do
  python3 "benchmarks/bench_${bench}.py" --device cuda --out "$OUT" 2>&1 | tee "$OUT/bench_${bench}.log" | tail -60
done
echo "total: $(( $(date +%s) - start )) s"
