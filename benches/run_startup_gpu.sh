#!/usr/bin/env bash
# Start-up, cold then warm, for each model given (default: the Qwen3-0.6B and Llama-3.1-8B configs), each start in
# a fresh process; cold starts from empty ember and Triton caches, warm from the ones the cold start filled:
#   [PYC=1] bash benches/run_startup_gpu.sh [MODEL ...]
# PYC=1 lets Python cache bytecode (under a prefix of its own) as an installed Python does; an image that sets
# PYTHONDONTWRITEBYTECODE compiles every imported module in every process (5-6 s of a Qwen3-0.6B start on an H100
# host). With it, a first start on caches of its own ("bytecode") writes the bytecode, so that the cold start after
# it finds bytecode and empty ember/Triton caches, as on an installed Python; a second warm start ("warm2") follows.
# STAMP_AB=1 adds, per model, a cold start that traces every decoder layer (EMBER_STAMP_LAYERS=0) on fresh caches,
# beside the default cold start that traces three and stamps the rest (JSON "traced_layers").
# Prints benches/startup.py's JSON line per start (with --step-times: each run's time before its first launch, in its
# steps, and its full garbage collections) and the runner's start-up split; logs under $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
MODELS=${*:-qwen3-0.6b llama-3.1-8b}
LABELS="cold warm"
if [ "${PYC:-0}" = 1 ]; then
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$(mktemp -d)}
  LABELS="cold warm warm2"
  cache=$(mktemp -d)
  echo "== bytecode (writes it: not a start-up figure)"
  EMBER_CACHE=$cache/ember TRITON_CACHE_DIR=$cache/triton timeout 280 python3 benches/startup.py \
    --model "${1:-qwen3-0.6b}" --label bytecode > "$OUT/startup_bytecode.log" 2>&1
  grep -h "STARTUP" "$OUT/startup_bytecode.log" | cut -c1-200
  rm -rf "$cache"
fi
for model in $MODELS; do
  cache=$(mktemp -d)
  export EMBER_CACHE=$cache/ember TRITON_CACHE_DIR=$cache/triton
  for label in $LABELS; do
    echo "== $model $label"
    timeout 280 python3 benches/startup.py --model "$model" --label "$label" --step-times \
      > "$OUT/startup_${model}_$label.log" 2>&1
    grep -h "start-up\|captured\|STARTUP" "$OUT/startup_${model}_$label.log" | cut -c1-600
  done
  rm -rf "$cache"
  if [ "${STAMP_AB:-0}" = 1 ]; then
    cache=$(mktemp -d)
    echo "== $model cold_whole_trace"
    EMBER_CACHE=$cache/ember TRITON_CACHE_DIR=$cache/triton EMBER_STAMP_LAYERS=0 timeout 280 python3 benches/startup.py \
      --model "$model" --label cold_whole_trace > "$OUT/startup_${model}_cold_whole_trace.log" 2>&1
    grep -h "start-up\|captured\|STARTUP" "$OUT/startup_${model}_cold_whole_trace.log" | cut -c1-600
    rm -rf "$cache"
  fi
done
