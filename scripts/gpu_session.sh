#!/usr/bin/env bash
# One device-machine call: build with nvcc, then the stages named in STAGES (default: all), each
# logging under $OUT:
#   tests     the whole test suite, CUDA parametrization included, as TEST_PROCS (default 4)
#             pytest-xdist workers side by side on the GPU          (pytest.log/.xml)
#   check     python -m rl_engine_ext.check --json                        (check.json)
#   cpu_only  a CPU-only build (no CUDA kernels) in a copy of the tree, and tests/test_registry.py
#             against it: every op on CUDA tensors through the shim's references (cpu_only.log)
#   bench     the benchmarks named in BENCHES (default: every benchmarks/bench_*.py)
#   usage: [BUILD=0] [STAGES="tests check"] [BENCHES="rms_norm linear"] [TEST_PROCS=4] bash scripts/gpu_session.sh [pytest args...]
# The tests stage needs pytest-xdist (and its dependency execnet) installed on the machine.
# Run one after another, the CUDA suite outlasts one 10-minute device call; side by side it fits.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/rl_out}
STAGES=${STAGES:-tests check cpu_only bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"

start=$(date +%s)
if [[ ${BUILD:-1} == 1 ]]; then  # BUILD=0: a later call on a still-warm machine, already built
  RL_ENGINE_EXT_DEBUG_INFO=${RL_ENGINE_EXT_DEBUG_INFO:-1} MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
fi

has() { [[ " $STAGES " == *" $1 "* ]]; }
if has tests; then
  # TEST_PROCS pytest-xdist workers side by side on the one GPU (the suite is bound by host-side
  # references and small launches); the tests marked gpu_memory_heavy run one at a time
  # (tests/conftest.py), so the workers together stay within the GPU's memory.
  procs=${TEST_PROCS:-4}
  OMP_NUM_THREADS=$(( $(nproc) / procs > 0 ? $(nproc) / procs : 1 )) python3 -m pytest -q -p no:cacheprovider \
    -n "$procs" --durations=5 -o junit_family=xunit2 --junitxml="$OUT/pytest.xml" "$@" >"$OUT/pytest.log" 2>&1
  rc=$?
  echo "pytest -n $procs: exit $rc: $(tail -1 "$OUT/pytest.log")"
  grep -h "^FAILED\|^ERROR" "$OUT/pytest.log" | head -40
  echo "tests: $(( $(date +%s) - start )) s since the build started"
fi
if has check; then
  python3 -m rl_engine_ext.check --json >"$OUT/check.json" 2>"$OUT/check.err"
  echo "check: exit $? ($(python3 -c "import json;d=json.load(open('$OUT/check.json'));print(len(d['cases']),'cases, passed:',d['passed'])"))"
fi
if has cpu_only; then
  copy=/tmp/rl_cpu_only && rm -rf "$copy" && mkdir -p "$copy"
  tar cf - --exclude=./build --exclude=./.git --exclude='*.so' . | (cd "$copy" && tar xf -)
  (cd "$copy" && RL_ENGINE_EXT_CPU_ONLY=1 MAX_JOBS=16 python3 setup.py -q build_ext --inplace >"$OUT/cpu_only_build.log" 2>&1 \
    && PYTHONPATH="$copy" python3 -c "import rl_engine_ext as r; print('cpu-only build:', r.__file__, 'native cuda kernel:', r.has_native_kernel('rms_norm', 'cuda'))" \
    && RL_ENGINE_EXT_CPU_ONLY=1 PYTHONPATH="$copy" python3 -m pytest -q -p no:cacheprovider tests/test_registry.py \
       -k "not fallback_without_native" 2>&1 | tee "$OUT/cpu_only.log" | tail -5) || echo "cpu_only stage FAILED (see $OUT)"
fi
if has bench; then
  for bench in ${BENCHES:-$(cd benchmarks && ls bench_*.py | sed 's/bench_\(.*\)\.py/\1/')}; do
    python3 "benchmarks/bench_${bench}.py" --device cuda --out "$OUT" 2>&1 | tee "$OUT/bench_${bench}.log" | tail -40
  done
fi
echo "total: $(( $(date +%s) - start )) s"
