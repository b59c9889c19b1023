#!/usr/bin/env bash
# One multi-GPU device call: build with nvcc (sm_90a), the rank_sum tests on one GPU, then for the
# machine's GPU count W and for 2: scripts/gpu_distributed.py (correctness, NCCL control) and
# benchmarks/bench_distributed.py (A-B-B-A vs NCCL), each logging under $OUT. Stage tp: the
# tree-mode linear tests and benchmark on one GPU, then scripts/gpu_tensor_parallel.py on all the
# GPUs (TP = W and 2 vs TP = 1, FSDP2, torch-TP control, step timings).
#   usage: [BUILD=0] [WORLDS="4 2"] [STAGES="tests check bench tp"] bash scripts/gpu_distributed_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rl_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
WORLDS=${WORLDS:-$gpus $([[ $gpus -gt 2 ]] && echo 2)}
STAGES=${STAGES:-tests check bench}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1; nvidia-smi topo -m; git log --oneline -1; } 2>&1 | tee "$OUT/env_multi.txt"
start=$(date +%s)
if [[ ${BUILD:-1} == 1 ]]; then
  TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=$(nproc) python3 setup.py -q build_ext --inplace >/tmp/rl_build.log 2>&1 \
    || { tail -40 /tmp/rl_build.log; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
fi
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has tests; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/test_rank_sum.py tests/test_registry.py \
    tests/test_distributed.py -k "rank_sum or nccl" 2>&1 | tee "$OUT/pytest_multi.log" | tail -4
fi
if has tp; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/test_linear_tree.py 2>&1 | tee "$OUT/pytest_tree.log" | tail -2
  timeout 300 python3 benchmarks/bench_tree_linear.py --device cuda --out "$OUT" --ms 1,64,4096 2>&1 \
    | tee "$OUT/bench_tree_linear.log" | tail -6
  timeout 600 python3 scripts/gpu_tensor_parallel.py --world "$gpus" --out "$OUT" 2>&1 | tee "$OUT/gpu_tp.log" | grep -v Warning
fi
for w in $WORLDS; do
  if has check; then
    timeout 300 python3 scripts/gpu_distributed.py --world "$w" 2>&1 | tee "$OUT/gpu_distributed_w$w.log" | grep -v Warning
  fi
  if has bench; then
    timeout 300 python3 benchmarks/bench_distributed.py --world "$w" --out "$OUT" 2>&1 | tee "$OUT/bench_distributed_w$w.log" | grep -v Warning
  fi
done
echo "total: $(( $(date +%s) - start )) s"
