#!/usr/bin/env bash
# One call on the GPU machine: the backend suites on CUDA, kernel GPU tests, CUDA graphs and
# the kernel benchmark. $OUT (or ./gpu_out) gets summary.txt and logs.tgz (every log, refreshed
# after each suite: the machine returns at most 8 files). Usage:
#   bash scripts/gpu_check.sh [suite ...]      a+b runs suites a and b at once (e.g. fi-fixed+ours)
# suites: torch triton flash_attn flashinfer xformers ours kernels kernels-all bench engine encdec
#         fi-fixed engine-fixed pool-sizing fa-interface fa-backend whisper kernels-paged engine-async
#         fa4 fa4-suite mslk xformers-mslk backends overhead engine-bench engine-bench-fi engine-bench-full (SHAPE=llama3-8b by default), and the
#         FlashInfer build steps below. Each failure is listed in summary.txt as it happens, so a
#         suite cut by its time limit still names them.
#
# overhead: `pagedattn bench overhead --json` (per-layer host time of impl.forward) for this tree and,
# when ${BASE:-.base}/pagedattn exists (an older checkout, e.g. `git archive 6116b13 pagedattn |
# tar -x -C .base`), the same file run against that package: before and after in one call.
#
# FlashInfer's kernels (scripts/fi_jit.py): AOT modules carried in .fi-aot are installed first; fi-record
# (the modules the flashinfer suite needs), fi-build (all of them at once, until FI_BUILD_UNTIL
# seconds into the call), fi-pack (the new ones to $OUT, to carry next time in .fi-aot).
set -uo pipefail
OUT=${OUT:-gpu_out}
LOGS=${LOGS:-/tmp/pagedattn-gpu-logs}
mkdir -p "$OUT" "$LOGS"
[ -f .peers/activate.sh ] && source .peers/activate.sh
# outside the repository: a warm machine keeps it between calls even when .peers is carried anew
export FLASHINFER_WORKSPACE_BASE=${FI_CACHE:-/tmp/pagedattn-fi-cache}
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
suites=${*:-torch triton kernels bench}
summary="$OUT/summary.txt"  # appended to: several invocations in one call share it ($OUT starts empty)

run() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  PAGEDATTN_FAIL_LOG="$LOGS/$name.failures" timeout -s INT -k 30 "$limit" "$@" > "$LOGS/$name.log" 2>&1  # INT: pytest still reports
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s: $(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed|error|fi_jit' "$LOGS/$name.log" | tail -1)" | tee -a "$summary"
  [ -f "$LOGS/$name.failures" ] && grep '^=== ' "$LOGS/$name.failures" | head -20 | tee -a "$summary"  # kept when cut short
  tar czf "$OUT/logs.$BASHPID.tgz" -C "$LOGS" . && mv -f "$OUT/logs.$BASHPID.tgz" "$OUT/logs.tgz"  # suites may run at once
}

[ "${FI_INSTALL:-1}" = 1 ] && for d in .fi-aot .fi-aot2; do  # two folders: all 41 modules (41 MiB) and .peers do not fit one call
  ls $d/fi-aot-*.tar > /dev/null 2>&1 && run "fi-install${d#.fi-aot}" 120 python scripts/fi_jit.py install $d
done
python -m pagedattn info > "$LOGS/info.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOGS/info.log"
suite() {
  local s=$1
  case $s in
    torch|triton|flash_attn|flashinfer|xformers)
      run "$s" "${LIMIT:-240}" python -m pytest tests/backend tests/gpu $([ "$s" = flashinfer ] && echo tests/backend_flashinfer) \
        $([ "$s" = xformers ] && echo tests/backend_xformers) \
        --backend "$s" --device cuda -q -p no:cacheprovider -n "${WORKERS:-4}" --tb=short -rfEs ;;
    ours)  # every backend on our kernels (and torch), one run: the workers share Triton's compile cache
      run ours "${LIMIT:-430}" python -m pytest tests/backend tests/gpu tests/backend_xformers tests/backend_flash_attn \
        --backend torch,triton,flash_attn,xformers --device cuda -q -p no:cacheprovider -n "${WORKERS:-8}" \
        --tb=short -rfEs --durations=20 ;;
    fi-fixed)  # the flashinfer tests changed since the last full run (planning through set_layers)
      run fi-fixed "${FLIMIT:-150}" python -m pytest tests/backend_flashinfer/test_fi_planning.py \
        tests/backend_flashinfer/test_fi_options.py --backend flashinfer --device cuda -q -p no:cacheprovider \
        -n 4 --tb=short -rfEs ;;
    engine-fixed)  # the engine/model tests changed since the last CUDA run
      run engine-fixed "${ELIMIT:-200}" python -m pytest tests/models/test_whisper.py tests/models/test_gguf_families.py \
        tests/engine/test_encoder_decoder.py --backend triton --device cuda -q \
        -p no:cacheprovider -n 3 --tb=short -rfEs --durations=15 ;;
    fa-interface)  # FlashAttention's API on our kernels (and against Dao-AILab's where installed), the provider tests
      run fa-interface "${KLIMIT:-300}" python -m pytest tests/kernels/test_flash_attn_interface.py \
        tests/kernels/test_flash_attn_dao.py tests/backend_flash_attn --backend flash_attn --device cuda -q \
        -p no:cacheprovider -n "${WORKERS:-12}" --tb=short -rfEs --durations=15 ;;
    fa-backend)  # the flash_attn backend's own tests (providers, FA4 faked), without the interface grid
      run fa-backend "${ELIMIT:-200}" python -m pytest tests/backend_flash_attn --backend flash_attn --device cuda -q \
        -p no:cacheprovider -n 2 --tb=short -rfEs ;;
    whisper) # carry .peers: loading a model needs gguf (the [hf] extra), which the GPU image lacks
      run whisper "${ELIMIT:-200}" python -m pytest tests/models/test_whisper.py --backend torch,triton \
        --device cuda -q -p no:cacheprovider -n 2 --tb=short -rfEs ;;
    pool-sizing)  # alone: it sizes a KV pool to 90% of the free GPU memory, which starves suites beside it
      run pool-sizing 120 python -m pytest tests/engine/test_pool_sizing.py --backend triton --device cuda -q \
        -p no:cacheprovider --tb=short -rfEs ;;
    kernels-paged)  # the paged-attention kernel's own tests (split-KV included) and the merge of states
      run kernels-paged "${KLIMIT:-200}" python -m pytest tests/kernels/test_paged_attention.py \
        tests/kernels/test_merge_attn_states.py --device cuda -q -p no:cacheprovider -n 4 --tb=short -rfEs ;;
    engine-async)  # engine end to end on CUDA, where async scheduling is on by default
      # (and the models, whose Llama-family layers run the fused kernels on CUDA); carry .peers (gguf)
      run engine-async "${ELIMIT:-300}" python -m pytest tests/engine/test_async_scheduling.py \
        tests/engine/test_generate.py tests/engine/test_requests.py tests/models tests/kernels/test_fused_layers.py \
        --backend triton --device cuda -q -p no:cacheprovider -n 4 --tb=short -rfEs --durations=10 ;;
    kernels) run kernels "${KLIMIT:-150}" python -m pytest tests/kernels/test_kernels_gpu.py -q -p no:cacheprovider ;;
    kernels-all) run kernels-all "${KLIMIT:-240}" python -m pytest tests/kernels --device cuda -q -p no:cacheprovider \
        -n "${WORKERS:-6}" --tb=short -rfEs --durations=15 ;;
    xformers-details) XFORMERS_MORE_DETAILS=1 run xformers-details 60 python -c "import xformers.ops.fmha as f; \
        print({op.NAME: op.is_available() for op in (f.cutlass.FwOp, f.triton_splitk.FwOp, f.flash.FwOp)})" ;;
    fi-bg)  # the build in the background (a new session outlives this call on a warm machine)
      setsid nohup python scripts/fi_jit.py build --record fi_jit_record.tsv --seconds "${FI_BG_SECONDS:-1500}" --jobs "${FI_JOBS:-12}" \
        > "$LOGS/fi-build.log" 2>&1 < /dev/null &
      echo $! > /tmp/fi-bg.pid
      echo "fi-bg started pid $!" | tee -a "$summary" ;;
    fi-stop)  # by its pid: `pkill -f` would match the calling shell, whose command line names it
      kill -- -"$(cat /tmp/fi-bg.pid)" 2>/dev/null; echo "fi-stop: $(tail -1 "$LOGS/fi-build.log" | cut -c1-120)" \
        | tee -a "$summary" ;;
    fi-wait)  # until the background build ends, at most FI_WAIT seconds
      end=$((SECONDS + ${FI_WAIT:-300}))
      while kill -0 "$(cat /tmp/fi-bg.pid)" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
      echo "fi-wait: $(kill -0 "$(cat /tmp/fi-bg.pid)" 2>/dev/null && echo still building || echo done) after $SECONDS s;" \
        "$(tail -1 "$LOGS/fi-build.log")" | tee -a "$summary" ;;
    fa4|fa4-suite)  # FA4 carried in parts (.fa4a in one call, .fa4b in the next: see docs/GPU.md), assembled
      # once under /tmp/fa4site; fa4: the probe (FA4 against our interface); fa4-suite: the flash_attn
      # backend suite and the FlashAttention-interface grid with FA4 as the provider
      if [ ! -f /tmp/fa4site/.assembled ]; then
        mkdir -p /tmp/fa4parts && cp .fa4a/* .fa4b/* /tmp/fa4parts/ 2>/dev/null
        if [ -f /tmp/fa4parts/ir.xz.part-aa ] && [ -f /tmp/fa4parts/ir.xz.part-ab ]; then
          FA4=/tmp/fa4site; mkdir -p $FA4 && tar xJf /tmp/fa4parts/small.tar.xz -C $FA4
          cat /tmp/fa4parts/ir.xz.part-* | xz -d > $FA4/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
          xz -dc /tmp/fa4parts/rt.xz > $FA4/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so
          touch $FA4/.assembled
        fi
      fi
      if [ ! -f /tmp/fa4site/.assembled ]; then echo "$s: FA4 parts missing: $(ls /tmp/fa4parts 2>/dev/null)" | tee -a "$summary"
      elif [ "$s" = fa4 ]; then
        PYTHONPATH="/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH" run fa4 "${FA4_LIMIT:-240}" \
          python scripts/fa4_probe.py --out "$LOGS/fa4.json"
      else
        PYTHONPATH="/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH" PAGEDATTN_FLASH_ATTN_PROVIDER=fa4 \
          run fa4-suite "${FA4_LIMIT:-300}" python -m pytest tests/backend tests/gpu tests/backend_flash_attn \
          tests/kernels/test_flash_attn_dao.py --backend flash_attn --device cuda -q -p no:cacheprovider \
          -n "${WORKERS:-6}" --tb=short -rfEs --durations=10
      fi ;;
    mslk|xformers-mslk)  # carry .mslk (mslk-cuda 1.1.0's wheel, 44.5 MB; with .peers it passes 64 MiB)
      if [ ! -d /tmp/mslksite/mslk ] && ls .mslk/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mslksite .mslk/*.whl \
          || echo "mslk: install failed" | tee -a "$summary"
      fi
      if [ "$s" = mslk ]; then
        PYTHONPATH="/tmp/mslksite:$PYTHONPATH" run mslk "${MSLK_LIMIT:-300}" python scripts/mslk_probe.py --out "$LOGS/mslk.json"
        python -c "import json; r = json.load(open('$LOGS/mslk.json')); print('mslk', r.get('mslk'), r.get('import_error', ''), \
          {k: {c: v.get('us', v.get('error', v.get('refused'))) for c, v in o.items() if isinstance(v, dict)} \
          for k, o in r.get('operators', {}).items()})" 2>&1 | cut -c1-3000 | tee -a "$summary"
      else  # the xformers backend suite with MSLK's fmha as its provider (pinned: an error if it does not run)
        PYTHONPATH="/tmp/mslksite:$PYTHONPATH" PAGEDATTN_XFORMERS_PROVIDER=mslk python -m pagedattn info 2>&1 \
          | grep xformers | cut -c1-1500 | tee -a "$summary"
        PYTHONPATH="/tmp/mslksite:$PYTHONPATH" PAGEDATTN_XFORMERS_PROVIDER=mslk run xformers-mslk "${XLIMIT:-300}" \
          python -m pytest tests/backend tests/gpu tests/backend_xformers tests/engine/test_encoder_decoder.py \
          --backend xformers --device cuda -q -p no:cacheprovider -n "${WORKERS:-6}" --tb=short -rfEs --durations=10
      fi ;;
    bench) run bench "${BLIMIT:-300}" python -m pagedattn bench kernels ${BENCH_ARGS:---quick} --out "$LOGS/kernels"  # e.g. BENCH_ARGS="--grid decode --splits 1,4,16,64,128"
      sed -n "/^| case/,$p" "$LOGS/bench.log" | head -80 >> "$summary" ;;
    torch-fp16|torch-bf16|triton-fp16|triton-bf16)
      run "$s" "${LIMIT:-240}" python -m pytest tests/backend tests/gpu --backend "${s%-*}" --dtype "${s#*-}" \
        --device cuda -q -p no:cacheprovider -n 4 ;;
    engine) run engine "${ELIMIT:-300}" python -m pytest tests/engine tests/models --backend triton --device cuda -q \
        -p no:cacheprovider -n "${WORKERS:-4}" --tb=short -rfEs ;;
    encdec) run encdec "${ELIMIT:-200}" python -m pytest tests/engine/test_encoder_decoder.py tests/engine/test_whisper.py \
        --backend xformers,flash_attn --device cuda -q -p no:cacheprovider -n 4 --tb=short -rfEs --durations=15 ;;
    fi-record) FI_JIT_RECORD="$PWD/fi_jit_record.tsv" run fi-record "${LIMIT:-200}" python -m pytest tests/backend \
        tests/gpu tests/backend_flashinfer --backend flashinfer --device cuda -q -p no:cacheprovider -p fi_jit -n 8
      cp fi_jit_record.tsv "$LOGS/" 2>/dev/null ;;
    fi-build) run fi-build 900 python scripts/fi_jit.py build --record fi_jit_record.tsv \
        --seconds $(( ${FI_BUILD_UNTIL:-480} - SECONDS )) ;;
    fi-pack) run fi-pack 150 python scripts/fi_jit.py pack "$OUT" --tag "${FI_TAG:-$(date +%H%M%S)}" \
        --max-parts $(( 6 - $(ls "$OUT" | grep -c fi-aot) )) ;;
    backends) run backends 300 python -m pagedattn bench backends --out "$LOGS/backends.md" ;;
    overhead) run overhead 150 python -m pagedattn bench overhead --json
      tail -1 "$LOGS/overhead.log" >> "$summary"
      if [ -d "${BASE:-.base}/pagedattn" ]; then
        PYTHONPATH="$(cd "${BASE:-.base}" && pwd):$PYTHONPATH" run overhead-base 150 python pagedattn/benchmarks/overhead.py --json
        tail -1 "$LOGS/overhead-base.log" >> "$summary"
      fi ;;
    # engine benchmark: results (JSON, CSV, PNG) under $LOGS/<suite>/ in logs.tgz, its table in summary.txt
    engine-bench|engine-bench-fi|engine-bench-full)
      args=(--quick --backend triton ${SHAPES:+--model-shape "$SHAPES"})  # SHAPES: a comma list (default: all)
      [ "$s" = engine-bench-fi ] && args=(--quick --backend flashinfer)
      [ "$s" = engine-bench-full ] && args=(--model-shape "${SHAPE:-llama3-8b}" --backend triton)
      run "$s" "${LIMIT:-590}" python -m pagedattn bench engine "${args[@]}" --out "$LOGS/$s"
      sed -n '/^shape /,/^wrote /p' "$LOGS/$s.log" >> "$summary" ;;
    *) echo "unknown suite $s" | tee -a "$summary" ;;
  esac
}

for group in $suites; do
  IFS=+ read -ra parts <<< "$group"
  for p in "${parts[@]}"; do suite "$p" & done
  wait
done
cat "$LOGS/info.log"
echo "----"
cat "$summary"
