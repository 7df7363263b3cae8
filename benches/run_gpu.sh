#!/usr/bin/env bash
# The GPU benchmark pass in one go (each part bounded in time), logs under $OUT (default ./bench_out):
#   bash benches/run_gpu.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | grep -v -i "deprecat\|_warn_once" | tee "$OUT/$name.log"; }
run bitwise 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
    "tests/gpu/test_graphs_engine_gpu.py::test_full_replay_bitwise_equals_compiled_without_graphs"
run latency_qwen3 110 python3 -m ember bench latency --config qwen3-0.6b --batch-size 1 --input-len 32 \
    --output-len 256 --num-iters 3 --profile 20 --json "$OUT/latency_qwen3.json"
run throughput_qwen3 100 python3 -m ember bench throughput --config qwen3-0.6b --json "$OUT/throughput_qwen3.json"
run gemv 60 python3 -m pytest -q -p no:cacheprovider benches/bench_gemv.py --benchmark-only -s
run step 130 python3 -m pytest -q -p no:cacheprovider --benchmark-only -s \
    "benches/bench_step.py::test_step[eager-1-decode]" "benches/bench_step.py::test_step[eager-8-decode]" \
    "benches/bench_step.py::test_step[full-1-decode]" "benches/bench_step.py::test_step[full-8-decode]"
run latency_llama8b 90 python3 -m ember bench latency --config llama-3.1-8b --batch-size 1 --input-len 32 \
    --output-len 128 --num-iters 2 --json "$OUT/latency_llama8b.json"
echo "== summary"
grep -h "passed\|failed" "$OUT/bitwise.log" | tail -1
grep -h "decode \|TPOT\|host \|output \|start-up" "$OUT"/latency_qwen3.log "$OUT"/throughput_qwen3.log "$OUT"/latency_llama8b.log
grep -h "step " "$OUT/step.log"
