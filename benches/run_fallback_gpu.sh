#!/usr/bin/env bash
# The transformers fallback against ember's native models on one GPU, each part in one device call (native and
# fallback on the same machine): nano-vllm's throughput workload and batch-1 decode latency, logs and JSON under
# $OUT (default ./bench_out):
#   bash benches/run_fallback_gpu.sh qwen3      (Qwen3-0.6B config, native / fallback)
#   bash benches/run_fallback_gpu.sh llama      (Llama-3.2-1B config, native / fallback)
#   bash benches/run_fallback_gpu.sh pythia     (Pythia-1B config, GPT-NeoX: no native file, fallback only)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | grep -v -i "deprecat\|_warn_once\|warn(" | tee "$OUT/$name.log"; }
THROUGHPUT="python3 -m ember bench throughput --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --seed 0 -v"
LATENCY="python3 -m ember bench latency --batch-size 1 --input-len 32 --output-len 256 --num-iters 3 -v"
case "${1:-}" in
  qwen3) CONFIG=qwen3-0.6b; IMPLS="ember transformers" ;;
  llama) CONFIG=llama-3.2-1b; IMPLS="ember transformers" ;;
  pythia) CONFIG=pythia-1b; IMPLS="transformers" ;;
  *) echo "usage: $0 qwen3|llama|pythia" >&2; exit 2 ;;
esac
for impl in $IMPLS; do
  run "${CONFIG}_${impl}_throughput" 240 $THROUGHPUT --config "$CONFIG" --model-impl "$impl" --json "$OUT/${CONFIG}_${impl}_throughput.json"
  run "${CONFIG}_${impl}_latency" 150 $LATENCY --config "$CONFIG" --model-impl "$impl" --json "$OUT/${CONFIG}_${impl}_latency.json"
done
echo "== summary"
for impl in $IMPLS; do
  for kind in throughput latency; do
    f="$OUT/${CONFIG}_${impl}_${kind}.log"
    echo "-- ${CONFIG} ${impl} ${kind}"; [ -f "$f" ] && grep -h "runs through the transformers\|pieces\|fusion passes\|output  \|decode  \|TPOT\|start-up" "$f" | head -8
  done
done
