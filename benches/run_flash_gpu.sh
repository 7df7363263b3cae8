#!/usr/bin/env bash
# The flash backend's GPU pass in one go (each part bounded in time), logs under $OUT (default ./bench_out):
#   bash benches/run_flash_gpu.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
filter() { grep -v -i "deprecat\|_warn_once\|warnings.warn\|PytestBenchmarkWarning\|warner("; }
echo "== bench"
timeout "${BENCH_S:-300}" python3 -m pytest -q -p no:cacheprovider benches/bench_flash.py --benchmark-only -s 2>&1 \
    | filter > "$OUT/flash_bench.log"
grep -B2 -A80 "ember benchmark summary" "$OUT/flash_bench.log" | grep -v "^test_\|^Name\|^---\|^Legend\|OPS:\|Outliers" \
    || tail -40 "$OUT/flash_bench.log"
echo "== gpu tests"
# kernel tests in 4 processes (compiling in parallel); the engine tests alone (each engine takes half the memory)
timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 tests/gpu/test_flash_gpu.py 2>&1 \
    | filter | tee "$OUT/flash_tests.log" | grep -v "^\.*$" | tail -25
timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_flash_engine_gpu.py 2>&1 \
    | filter | tee "$OUT/flash_engine_tests.log" | tail -15
echo "== time to first token, 16k prompt, Qwen3-0.6B config (eager)"
for backend in "flash 64" "triton_unified 16"; do
    set -- $backend
    timeout "${E2E_S:-100}" python3 -m ember bench latency --config qwen3-0.6b --batch-size 1 --input-len 16384 \
        --output-len 2 --num-iters 3 --max-model-len 16448 --max-num-batched-tokens 16384 --enforce-eager \
        --attention-backend "$1" --block-size "$2" 2>&1 | filter > "$OUT/ttft_$1.log"
    echo "$1 block $2: $(grep -i "ttft\|first" "$OUT/ttft_$1.log" | head -3 | tr '\n' ' ')"
done
