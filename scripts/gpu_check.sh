#!/usr/bin/env bash
# One call on the GPU machine: the backend suites on CUDA, kernel GPU tests, CUDA graphs and
# the kernel benchmark. Logs go to $OUT (or ./gpu_out). Usage:
#   bash scripts/gpu_check.sh [suite ...]      suites: torch triton flashinfer kernels bench engine
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
[ -f .peers/activate.sh ] && source .peers/activate.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
suites=${*:-torch triton kernels bench}
summary="$OUT/summary.txt"
: > "$summary"

run() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s: $(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed|error' "$OUT/$name.log" | tail -1)" | tee -a "$summary"
}

python -m pagedattn.cli info > "$OUT/info.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/info.log"
for s in $suites; do
  case $s in
    torch|triton|flashinfer)
      run "$s" "${LIMIT:-240}" python -m pytest tests/backend tests/gpu $([ "$s" = flashinfer ] && echo tests/flashinfer) \
        --backend "$s" --device cuda -q -p no:cacheprovider -n 4 ;;
    kernels) run kernels 150 python -m pytest tests/kernels/test_kernels_gpu.py -q -p no:cacheprovider ;;
    bench) run bench 200 python -m pagedattn.cli bench kernels --out "$OUT/bench.json" ;;
    torch-fp16|torch-bf16|triton-fp16|triton-bf16)
      run "$s" "${LIMIT:-240}" python -m pytest tests/backend tests/gpu --backend "${s%-*}" --dtype "${s#*-}" \
        --device cuda -q -p no:cacheprovider -n 4 ;;
    engine) run engine 300 python -m pytest tests/engine tests/models --backend triton --device cuda -q \
        -p no:cacheprovider -n 4 ;;
    engine-bench) run engine-bench 170 python -m pagedattn.benchmarks.engine_gpu --backend triton ;;
  esac
done
cat "$OUT/info.log"
echo "----"
cat "$summary"
