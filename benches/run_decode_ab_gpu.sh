#!/usr/bin/env bash
# Batch-1 decode A/B of a triton_unified backend option on the GPU: the kernel checks, then the decode latency of
# each config with the option at each value, interleaved twice, each with a step profile (every kernel's share of
# the critical path). Default: `single_segment_tiles` 0 (off) against 8 (contexts up to 256 keys, in 32-key tiles,
# in one program).
# BATCH_SIZE, INPUT_LEN and OUTPUT_LEN (default 1, 32, 256) set the workload. Logs under $OUT (default ./bench_out;
# JSON=1 adds each run's JSON):
#   bash benches/run_decode_ab_gpu.sh                  # Qwen3-0.6B and Llama-3.2-1B configs
#   CONFIGS="llama-3.1-8b" bash benches/run_decode_ab_gpu.sh
#   AB_OPTION=split_kv AB_VALUES="on off" SKIP_KERNEL_CHECK=1 bash benches/run_decode_ab_gpu.sh   # 3D vs 2D decode
#   INPUT_LEN=256 OUTPUT_LEN=64 AB_OPTION=short_decode_len AB_VALUES="320 0" SKIP_KERNEL_CHECK=1 \
#     bash benches/run_decode_ab_gpu.sh        # contexts of 256-320 tokens: where the short-context bound should lie
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
CONFIGS=${CONFIGS:-"qwen3-0.6b llama-3.2-1b"}
AB_OPTION=${AB_OPTION:-single_segment_tiles}
AB_VALUES=${AB_VALUES:-"0 ${ON_TILES:-8}"}
LATENCY="python3 -m ember bench latency --batch-size ${BATCH_SIZE:-1} --input-len ${INPUT_LEN:-32} \
  --output-len ${OUTPUT_LEN:-256} --num-iters 3 --profile 20"
run() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$?"; }
[ -n "${SKIP_KERNEL_CHECK:-}" ] || run kernels 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_triton_unified_gpu.py -k "single_segment or 2d_and_3d"
for config in $CONFIGS; do
  for round in 1 2; do
    for value in $AB_VALUES; do
      name="${config}_${AB_OPTION}-${value}_r${round}"
      run "$name" 150 $LATENCY --config "$config" --attention-backend-option "$AB_OPTION=$value" \
        ${JSON:+--json "$OUT/$name.json"}
    done
  done
done
echo "== summary"
[ -f "$OUT/kernels.log" ] && grep -h "passed\|failed" "$OUT/kernels.log" | tail -1
for f in "$OUT"/*_"$AB_OPTION"-*_r*.log; do
  echo "-- $(basename "$f" .log): $(grep -h 'decode  ' "$f" | head -1 | cut -c1-60)"
  grep -h "host  .*busy\|profile over\|unified_attention\|reduce_segments" "$f" | cut -c1-120
done
