#!/usr/bin/env bash
# Fusion passes on the GPU in one go: the fused op's bf16 checks, then batch-1 decode latency with the passes on and
# off (step profile: launches per step), logs under $OUT (default ./bench_out):
#   bash benches/run_fusion_gpu.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | grep -v -i "deprecat\|_warn_once\|warn(" | tee "$OUT/$name.log"; }
LATENCY="python3 -m ember bench latency --batch-size 1 --input-len 32 --output-len 256 --num-iters 3 --profile 10 -v"
[ -n "${SKIP_OP_CHECK:-}" ] || run fused_op 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_fused_linear_gpu.py tests/gpu/test_fusion_model_gpu.py
run qwen3_fused 130 $LATENCY --config qwen3-0.6b --json "$OUT/qwen3_fused.json"
run qwen3_unfused 130 $LATENCY --config qwen3-0.6b --disable-fusion all --json "$OUT/qwen3_unfused.json"
[ -n "${SKIP_LLAMA:-}" ] || run llama1b_fused 120 $LATENCY --config llama-3.2-1b --json "$OUT/llama1b_fused.json"
[ -n "${SKIP_LLAMA:-}" ] || run llama1b_unfused 120 $LATENCY --config llama-3.2-1b --disable-fusion all --json "$OUT/llama1b_unfused.json"
echo "== summary"
grep -h "passed\|failed" "$OUT/fused_op.log" | tail -1
for f in qwen3_fused qwen3_unfused llama1b_fused llama1b_unfused; do
  echo "-- $f"; [ -f "$OUT/$f.log" ] && grep -h "fusion passes\|decode \|TPOT\|roofline\|launches/step" "$OUT/$f.log" | head -8
done
