#!/usr/bin/env bash
# ember's GPU benchmark passes, one part per call (each step bounded in time), logs under $OUT (default ./bench_out):
#   bash benches/run_gpu.sh decode        # bitwise replay check, batch-1 latency (Qwen3-0.6B with a step profile,
#                                         # Llama-3.1-8B), the GEMV and step benches
#   bash benches/run_gpu.sh throughput    # the nano-vllm throughput workload, Qwen3-0.6B config
#   bash benches/run_gpu.sh headline      # decode, then throughput: the pass behind the README's figures
#   bash benches/run_gpu.sh serve         # the offline workload, then `ember serve` + `ember bench serve` at 8, 32, inf
#   bash benches/run_gpu.sh serve_dp      # two GPUs: one engine core against two (--data-parallel-size 2), rate inf
#   [PYC=1] [STAMP_AB=1] bash benches/run_gpu.sh startup [MODEL ...]   # cold then warm start-up, fresh processes
#   bash benches/run_gpu.sh flash         # the flash backend's kernels, GPU tests and time to first token
#   bash benches/run_gpu.sh fusion        # fusion passes on / off, batch-1 decode with a step profile
#   [CONFIGS=..] [AB_OPTION=.. AB_VALUES=".."] bash benches/run_gpu.sh ab   # batch-1 A/B of a backend option
#   [TP=2] bash benches/run_gpu.sh moe_sweep [CONFIG]  # the MoE kernels' launch table for CONFIG (default
#                                         # qwen3-30b-a3b); TP=N: a rank's shape at N ranks
#   bash benches/run_gpu.sh moe           # MoE kernel tests, the MoE layer bench, Qwen3-30B-A3B batch-1 latency
#   bash benches/run_gpu.sh moe_throughput   # the nano-vllm throughput workload, Qwen3-30B-A3B config
#   bash benches/run_gpu.sh fp8           # fp8 weights and KV cache: batch-1 latency beside bf16, throughput, the
#                                         # fp8 decode attention and GEMV benches, accuracy against bf16 (< 9 min)
#   bash benches/run_gpu.sh fp8_gemv      # the fp8 GEMV's variants, its one-row launch shapes (written), Llama-3.1-8B
#                                         # batch-1 latency in bf16, fp8, fp8 rounding inside the GEMV (< 9 min)
#   bash benches/run_gpu.sh gemv_rows     # the GEMV's launch shapes at 2, 4, 5, 8 rows, bf16 and e4m3, and the
#                                         # crossover after them (written), then Llama-3.1-8B speculative decoding
#                                         # (k 4) and batch-4 latency (< 9 min)
#   bash benches/run_gpu.sh gemv_tp       # the GEMV's launch shapes and crossover for tensor-parallel shards of
#                                         # Llama-3.1-8B and -70B (written; one GPU, < 9 min)
#   bash benches/run_gpu.sh fallback [qwen3|llama|pythia]   # native vs the transformers fallback, throughput + batch 1
#   [TOKENIZER=folder] bash benches/run_gpu.sh structured   # structured output: GPU tests, host grammar work, throughput
#                                         # unconstrained / one JSON schema / 64 schemas, bitmask in and after the graph
#   bash benches/run_gpu.sh tp2_collectives   # 2 GPUs: the all-reduce bench (NCCL vs one-shot), ranks' sampling
#   bash benches/run_gpu.sh tp2_tests [1|2]  # 2 GPUs: the TP GPU tests (in two parts that each fit a call)
#   [PYC=1] bash benches/run_gpu.sh tp2_startup   # 2 GPUs: cold and warm start-up at TP=1 and TP=2
#   bash benches/run_gpu.sh tp2           # 2 GPUs: Llama-3.1-8B batch 1 and nano-vllm throughput, TP=1 against TP=2
#   bash benches/run_gpu.sh tp2_sampling  # 2 GPUs: shard-local sampling's test, TP=2 throughput with it and without
#   bash benches/run_gpu.sh structured_tp2  # 2 GPUs: structured output's TP=2 test, one-schema throughput TP=2 and TP=1
#   [SPEC_MODEL=folder] bash benches/run_gpu.sh spec_tp2  # 2 GPUs: n-gram speculation's TP=2 test; with a real
#                                         # checkpoint instead, its real acceptance at TP=2 against plain decoding
#   bash benches/run_gpu.sh tp4           # 4 GPUs: Llama-3.1-70B TP=4 cold and warm start-up, batch 1, throughput
#   bash benches/run_gpu.sh moe_tp2       # 2 GPUs: the sharded-experts GPU test, Mixtral-8x7B TP=2 batch 1, throughput
#   bash benches/run_gpu.sh moe_ep2       # 2 GPUs: the expert-parallel GPU test, Mixtral-8x7B throughput TP=2 with
#                                         # expert parallelism and without (< 10 min)
# Each part's own switches are described above its function.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}
filter() { grep -v -i "deprecat\|_warn_once\|warnings.warn\|PytestBenchmarkWarning\|warner(\|warn("; }
# run NAME LIMIT_S CMD...: the command's output, filtered, on the terminal and in $OUT/NAME.log
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | filter | tee "$OUT/$name.log"; }
# quiet NAME LIMIT_S CMD...: the output only in $OUT/NAME.log, and the exit status
quiet() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$?"; }

part_decode() {
  run bitwise 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
    "tests/gpu/test_graphs_engine_gpu.py::test_full_replay_bitwise_equals_compiled_without_graphs"
  run latency_qwen3 110 python3 -m ember bench latency --config qwen3-0.6b --batch-size 1 --input-len 32 \
    --output-len 256 --num-iters 3 --profile 20 --json "$OUT/latency_qwen3.json"
  run gemv 60 python3 -m pytest -q -p no:cacheprovider benches/bench_gemv.py --benchmark-only -s
  run step 130 python3 -m pytest -q -p no:cacheprovider --benchmark-only -s \
    "benches/bench_step.py::test_step[eager-1-decode]" "benches/bench_step.py::test_step[eager-8-decode]" \
    "benches/bench_step.py::test_step[full-1-decode]" "benches/bench_step.py::test_step[full-8-decode]"
  run latency_llama8b 90 python3 -m ember bench latency --config llama-3.1-8b --batch-size 1 --input-len 32 \
    --output-len 128 --num-iters 2 --json "$OUT/latency_llama8b.json"
  echo "== summary"
  grep -h "passed\|failed" "$OUT/bitwise.log" | tail -1
  grep -h "decode \|TPOT\|host \|start-up" "$OUT"/latency_qwen3.log "$OUT"/latency_llama8b.log
  grep -h "step " "$OUT/step.log"
}

# structured: needs llguidance (docs/structured_output.md says which wheel to carry) and a tokenizer folder in
# TOKENIZER (default .bench_tokenizer): a bundled config has none, and the grammar needs a real vocabulary
part_structured() {
  local tok=${TOKENIZER:-.bench_tokenizer} args="--config qwen3-0.6b --structured-output json --num-schemas 64"
  run structured_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_structured_gpu.py
  run grammar_host 60 python3 benches/grammar_host.py --tokenizer "$tok"
  # one process: unconstrained, one schema with decode steps split and whole ("split off"), 64 schemas; GPU idle a step
  run structured_split 240 python3 -m ember bench throughput $args --tokenizer "$tok" \
    --json "$OUT/structured_split.json"
  echo "== summary"
  grep -h "passed\|failed" "$OUT/structured_tests.log" | tail -1
  grep -h "rows,\|schema" "$OUT/grammar_host.log"
  grep -h "unconstrained\|schema\|split off\|vocabulary" "$OUT/structured_split.log"
}

part_throughput() {
  run throughput_qwen3 100 python3 -m ember bench throughput --config qwen3-0.6b --json "$OUT/throughput_qwen3.json"
  echo "== summary"
  grep -h "output \|host \|start-up" "$OUT"/throughput_qwen3.log
}

# serve, serve_dp: the server, whose engine core runs in a process of its own, against the offline engine, Qwen3-0.6B
# config with random weights, nano-vllm's workload (random token prompts, input and output lengths U[100, 1024]).
#   serve: `ember bench throughput` (256 prompts), then `ember serve` with `ember bench serve` at request rates 8, 32
#   and inf (the inf run sends the same 256 requests as the offline run); about 5 minutes on one GPU.
#   serve_dp (two GPUs): 512 requests at rate inf through `ember serve` with one engine core, then with
#   --data-parallel-size 2, against offline on one GPU.
# Switches: WHEELS=/path/to/wheels installs the server's packages first, offline (fastapi, uvicorn,
# prometheus_client, aiohttp, pyzmq, msgspec and their dependencies; httptools and uvloop too where the folder has
# them: uvicorn's fast HTTP parser and event loop, on which the front end's share of a step depends). PORT (default
# 8000), COUNTS (requests per rate, default 64,128,256), DP_COUNT (default 512), MODEL, WORKLOAD and
# BENCH_SERVE_ARGS (a CPU dry run on a tiny model of vocabulary 320: MODEL="--model tiny/folder --device cpu"
# WORKLOAD="--input-len 4:8 --output-len 4:8" COUNTS=8,8,8 DP_COUNT=16 BENCH_SERVE_ARGS="--max-token-id 319").
# Each run prints the front end's and the engine core's busy time per step.
serve_setup() {
  if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --find-links "$WHEELS" fastapi uvicorn prometheus_client aiohttp pyzmq msgspec \
      || { echo "installing the server's packages from $WHEELS failed"; return 1; }
    for optional in httptools uvloop; do
      python3 -m pip install -q --no-index --find-links "$WHEELS" "$optional" >/dev/null 2>&1 \
        && echo "installed $optional from $WHEELS" || echo "no $optional in $WHEELS (uvicorn uses its fallback)"
    done
  fi
  python3 - <<'PY'
import importlib.util
from ember.config import package_version
print("packages: " + ", ".join(f"{n} {package_version(n)}" for n in
                               ("uvicorn", "fastapi", "pyzmq", "msgspec", "httptools", "uvloop")))
missing = [m for m in ("fastapi", "uvicorn", "zmq", "msgspec", "aiohttp", "prometheus_client")
           if importlib.util.find_spec(m) is None]
if missing:
    raise SystemExit(f"missing {missing}: set WHEELS to a folder of wheels to install them from")
PY
}

# serve_run NAME COUNTS RATES OFFLINE_JSON [ember serve flags...]: a server, `ember bench serve` against it, SIGTERM
serve_run() {
  local name=$1 counts=$2 rates=$3 offline=$4 port=${PORT:-8000} server
  shift 4
  python3 -m ember serve ${MODEL:---config qwen3-0.6b} --port "$port" "$@" > "$OUT/$name.server.log" 2>&1 &
  server=$!
  python3 - "$port" "$server" <<'PY' || { tail -20 "$OUT/$name.server.log"; kill -TERM "$server"; return 1; }
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 420
while time.time() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        sys.exit(0)
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit("the server exited during start-up")
        time.sleep(0.5)
sys.exit("the server did not start within 420 s")
PY
  grep "ember serve:" "$OUT/$name.server.log"
  local plot=""
  python3 -c "import matplotlib" 2>/dev/null && plot="--plot $OUT/$name.png"
  timeout 400 python3 -m ember bench serve --base-url "http://127.0.0.1:$port" --request-rate "$rates" \
    --num-prompts "$counts" $(serve_workload) ${BENCH_SERVE_ARGS:-} --compare-offline "$offline" \
    --json "$OUT/$name.json" $plot 2>&1 | filter | tee "$OUT/$name.log"
  python3 - "$port" > "$OUT/$name.metrics.txt" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
print("\n".join(l for l in text.splitlines() if l.startswith(("ember_num", "ember_kv", "ember_prompt", "ember_engine",
                                                             "ember_frontend", "ember_generation", "ember_request"))))
PY
  kill -TERM "$server"
  wait "$server"
  echo "$name: server exited with $? after SIGTERM"
}

serve_workload() { echo "${WORKLOAD:---input-len 100:1024 --output-len 100:1024} --seed 0"; }

part_serve() {
  serve_setup || return 1
  local counts=${COUNTS:-64,128,256}
  run offline 300 python3 -m ember bench throughput ${MODEL:---config qwen3-0.6b} --num-prompts "${counts##*,}" \
    $(serve_workload) --json "$OUT/offline.json"
  serve_run serve "$counts" 8,32,inf "$OUT/offline.json"
  echo "== summary"
  grep -h "output \|offline \|busy " "$OUT"/offline.log "$OUT"/serve.log
}

part_serve_dp() {
  serve_setup || return 1
  local count=${DP_COUNT:-512} gpus
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  case "${MODEL:-}" in *"--device cpu"*) gpus=2 ;; esac      # the CPU dry run: two core processes
  if [ "$gpus" -lt 2 ]; then echo "== serve_dp needs 2 GPUs; this machine has $gpus"; return 1; fi
  run offline_dp 300 python3 -m ember bench throughput ${MODEL:---config qwen3-0.6b} --num-prompts "$count" \
    $(serve_workload) --json "$OUT/offline_dp.json"
  serve_run serve_dp1 "$count" inf "$OUT/offline_dp.json"
  serve_run serve_dp2 "$count" inf "$OUT/offline_dp.json" --data-parallel-size 2
  echo "== summary"
  grep -h "output \|offline \|busy " "$OUT"/offline_dp.log "$OUT"/serve_dp1.log "$OUT"/serve_dp2.log
  python3 - "$OUT" <<'PY'
import json, sys
runs = {n: json.load(open(f"{sys.argv[1]}/{n}.json"))["runs"][0] for n in ("serve_dp1", "serve_dp2")}
one, two = runs["serve_dp1"]["output_tok_s"], runs["serve_dp2"]["output_tok_s"]
print(f"data parallel: 1 core {one:,.0f} output tok/s, 2 cores {two:,.0f} output tok/s ({two / one:.2f}x)")
PY
}

# startup [MODEL ...] (default: the Qwen3-0.6B and Llama-3.1-8B configs): each start in a fresh process; cold starts
# from empty ember and Triton caches, warm from the ones the cold start filled. Prints benches/startup.py's JSON
# line per start (with --step-times: each run's time before its first launch, its steps, its full collections).
# PYC=1 lets Python cache bytecode (under a prefix of its own) as an installed Python does; an image that sets
# PYTHONDONTWRITEBYTECODE compiles every imported module in every process. With it a first start ("bytecode")
# writes the bytecode, so that the cold start after it finds bytecode and empty ember/Triton caches, and a second
# warm start ("warm2") follows. STAMP_AB=1 adds, per model, a cold start that traces every decoder layer
# (EMBER_HOOKS=layer_stamp=off) beside the default one that traces three and stamps the rest (JSON "traced_layers").
bytecode_kept() {
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$(mktemp -d)}
}

part_startup() {
  local models=${*:-qwen3-0.6b llama-3.1-8b} labels="cold warm" cache model label
  if [ "${PYC:-0}" = 1 ]; then
    bytecode_kept
    labels="cold warm warm2"
    cache=$(mktemp -d)
    echo "== bytecode (writes it: not a start-up figure)"
    EMBER_CACHE=$cache/ember TRITON_CACHE_DIR=$cache/triton timeout 280 python3 benches/startup.py \
      --model "${1:-qwen3-0.6b}" --label bytecode > "$OUT/startup_bytecode.log" 2>&1
    grep -h "STARTUP" "$OUT/startup_bytecode.log" | cut -c1-200
    rm -rf "$cache"
  fi
  for model in $models; do
    cache=$(mktemp -d)
    for label in $labels; do
      echo "== $model $label"
      EMBER_CACHE=$cache/ember TRITON_CACHE_DIR=$cache/triton timeout 280 python3 benches/startup.py \
        --model "$model" --label "$label" --step-times > "$OUT/startup_${model}_$label.log" 2>&1
      grep -h "start-up\|captured\|STARTUP" "$OUT/startup_${model}_$label.log" | cut -c1-600
    done
    rm -rf "$cache"
    if [ "${STAMP_AB:-0}" = 1 ]; then
      cache=$(mktemp -d)
      echo "== $model cold_whole_trace"
      EMBER_CACHE=$cache/ember TRITON_CACHE_DIR=$cache/triton EMBER_HOOKS=layer_stamp=off timeout 280 \
        python3 benches/startup.py --model "$model" --label cold_whole_trace \
        > "$OUT/startup_${model}_cold_whole_trace.log" 2>&1
      grep -h "start-up\|captured\|STARTUP" "$OUT/startup_${model}_cold_whole_trace.log" | cut -c1-600
      rm -rf "$cache"
    fi
  done
}

# flash: BENCH_S, TESTS_S, E2E_S bound the bench, each test file and each time-to-first-token run.
part_flash() {
  echo "== bench"
  timeout "${BENCH_S:-300}" python3 -m pytest -q -p no:cacheprovider benches/bench_flash.py --benchmark-only -s 2>&1 \
    | filter > "$OUT/flash_bench.log"
  grep -B2 -A80 "ember benchmark summary" "$OUT/flash_bench.log" \
    | grep -v "^test_\|^Name\|^---\|^Legend\|OPS:\|Outliers" || tail -40 "$OUT/flash_bench.log"
  echo "== gpu tests"
  # kernel tests in 4 processes (compiling in parallel); the engine tests alone (each engine takes half the memory)
  timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 tests/gpu/test_flash_gpu.py 2>&1 \
    | filter | tee "$OUT/flash_tests.log" | grep -v "^\.*$" | tail -25
  timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_flash_engine_gpu.py 2>&1 \
    | filter | tee "$OUT/flash_engine_tests.log" | tail -15
  echo "== time to first token, 16k prompt, Qwen3-0.6B config (eager)"
  local backend
  for backend in "flash 64" "triton_unified 16"; do
    set -- $backend
    timeout "${E2E_S:-100}" python3 -m ember bench latency --config qwen3-0.6b --batch-size 1 --input-len 16384 \
      --output-len 2 --num-iters 3 --max-model-len 16448 --max-num-batched-tokens 16384 --enforce-eager \
      --attention-backend "$1" --block-size "$2" 2>&1 | filter > "$OUT/ttft_$1.log"
    echo "$1 block $2: $(grep -i "ttft\|first" "$OUT/ttft_$1.log" | head -3 | tr '\n' ' ')"
  done
}

# fusion: SKIP_OP_CHECK=1 skips the fused op's bf16 checks, SKIP_LLAMA=1 the Llama-3.2-1B runs.
part_fusion() {
  local latency="python3 -m ember bench latency --batch-size 1 --input-len 32 --output-len 256 --num-iters 3 \
    --profile 10 -v" f
  [ -n "${SKIP_OP_CHECK:-}" ] || run fused_op 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/gpu/test_fused_linear_gpu.py tests/gpu/test_fusion_model_gpu.py
  run qwen3_fused 130 $latency --config qwen3-0.6b --json "$OUT/qwen3_fused.json"
  run qwen3_unfused 130 $latency --config qwen3-0.6b --disable-fusion all --json "$OUT/qwen3_unfused.json"
  [ -n "${SKIP_LLAMA:-}" ] || run llama1b_fused 120 $latency --config llama-3.2-1b --json "$OUT/llama1b_fused.json"
  [ -n "${SKIP_LLAMA:-}" ] || run llama1b_unfused 120 $latency --config llama-3.2-1b --disable-fusion all \
    --json "$OUT/llama1b_unfused.json"
  echo "== summary"
  [ -f "$OUT/fused_op.log" ] && grep -h "passed\|failed" "$OUT/fused_op.log" | tail -1
  for f in qwen3_fused qwen3_unfused llama1b_fused llama1b_unfused; do
    echo "-- $f"
    [ -f "$OUT/$f.log" ] && grep -h "fusion passes\|decode \|TPOT\|roofline\|launches/step" "$OUT/$f.log" | head -8
  done
}

# ab: batch-1 decode of each config in CONFIGS (default "qwen3-0.6b llama-3.2-1b") with the triton_unified option
# AB_OPTION at each of AB_VALUES, interleaved twice, each with a step profile; first the kernel checks
# (SKIP_KERNEL_CHECK=1 skips them). Default: `single_segment_tiles` 0 against ON_TILES (8). BATCH_SIZE, INPUT_LEN,
# OUTPUT_LEN (default 1, 32, 256) set the workload; JSON=1 adds each run's JSON. For example:
#   CONFIGS="llama-3.1-8b" AB_OPTION=short_decode_len AB_VALUES="256 0" bash benches/run_gpu.sh ab
#   AB_OPTION=split_kv AB_VALUES="on off" SKIP_KERNEL_CHECK=1 bash benches/run_gpu.sh ab          # 3D vs 2D decode
#   INPUT_LEN=256 OUTPUT_LEN=64 AB_OPTION=short_decode_len AB_VALUES="320 0" SKIP_KERNEL_CHECK=1 \
#     bash benches/run_gpu.sh ab        # contexts of 256-320 tokens: where the short-context bound should lie
part_ab() {
  local option=${AB_OPTION:-single_segment_tiles} values=${AB_VALUES:-"0 ${ON_TILES:-8}"} config round value name f
  local latency="python3 -m ember bench latency --batch-size ${BATCH_SIZE:-1} --input-len ${INPUT_LEN:-32} \
    --output-len ${OUTPUT_LEN:-256} --num-iters 3 --profile 20"
  [ -n "${SKIP_KERNEL_CHECK:-}" ] || quiet kernels 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/gpu/test_triton_unified_gpu.py -k "single_segment or 2d_and_3d"
  for config in ${CONFIGS:-qwen3-0.6b llama-3.2-1b}; do
    for round in 1 2; do
      for value in $values; do
        name="${config}_${option}-${value}_r${round}"
        quiet "$name" 150 $latency --config "$config" --attention-backend-option "$option=$value" \
          ${JSON:+--json "$OUT/$name.json"}
      done
    done
  done
  echo "== summary"
  [ -f "$OUT/kernels.log" ] && grep -h "passed\|failed" "$OUT/kernels.log" | tail -1
  for f in "$OUT"/*_"$option"-*_r*.log; do
    echo "-- $(basename "$f" .log): $(grep -h 'decode  ' "$f" | head -1 | cut -c1-60)"
    grep -h "host  .*busy\|profile over\|unified_attention\|reduce_segments" "$f" | cut -c1-120
  done
}

# Tensor parallel. Every rank runs with NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
# Each command is timed to its exit, and a worker process left behind afterwards is reported (and killed).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# timed NAME LIMIT_S CMD...: `quiet`, then the seconds to its exit and the workers it left
timed() {
  local name=$1 start=$SECONDS left
  quiet "$@"
  echo "   $name exited after $((SECONDS - start)) s"
  left=$(for pid in $(pgrep "^ember-rank"); do   # workers (named ember-rank<r>) of the same visible devices
    [ -z "${CUDA_VISIBLE_DEVICES+set}" ] && echo $pid && continue
    tr '\0' '\n' < /proc/$pid/environ 2>/dev/null | grep -qx "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" && echo $pid
  done | tr '\n' ' ')
  if [ -n "$left" ]; then echo "   $name LEFT WORKERS: $left"; kill -9 $left 2>/dev/null; fi
}

# tp2_collectives (at most 4 min): the all-reduce sweep, 8 KiB to 8 MiB, eagerly and in graphs, then the three ways
# ranks can agree on sampled tokens (benches/tp_sampling.py).
part_tp2_collectives() {
  timed all_reduce 120 python3 benches/all_reduce_graph.py --ranks 2
  cat "$OUT/all_reduce.log" | filter | grep -v "^\[W\|Warning" | tail -20
  run tp_sampling 120 python3 benches/tp_sampling.py --ranks 2
}

# tp2_tests [1|2] (at most 8 min each): the two-GPU tests, verbose and unbuffered (`-s`: a test's figures print as
# it ends), with each test's time (a test still running after 300 s prints every thread's stack). Each engine runs in
# a process of its own (about a minute a test on H200s), so the 14 tests come in two parts: 1, logits and tokens
# against one rank and the one-shot all-reduce (7 tests); 2, sharded experts, expert parallelism, sampling,
# structured output and n-gram speculation (7 tests; the structured test needs jsonschema, installed here from .whl
# where there is one); no argument runs both in one call.
part_tp2_tests() {
  local sel=""
  case "${1:-}" in
    1) sel="logits or float32_tokens_of_two_ranks_under or engine_core or symmetric" ;;
    2) sel="experts or expert_parallelism or shard_local or structured or ngram" ;;
  esac
  [ -d .whl ] && python3 -m pip install -q --no-index --find-links .whl jsonschema 2>&1 | grep -v WARNING | tail -1
  timed tp_gpu_tests${1:-} 470 python3 -m pytest -v -s -m gpu -p no:cacheprovider --durations=0 \
    -o faulthandler_timeout=300 ${sel:+-k "$sel"} tests/gpu/test_tensor_parallel_gpu.py
  grep -h "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|assert\|{'\|s call" "$OUT/tp_gpu_tests${1:-}.log" | tail -30
}

# tp2_startup (at most 4 min): Llama-3.1-8B started cold, then warm, at TP=1 and at TP=2 (fresh caches; phases).
part_tp2_startup() {
  local cache tp
  if [ "${PYC:-0}" = 1 ]; then     # as for startup; the imports a start makes are compiled once first
    bytecode_kept
    python3 -c "import torch, transformers, sympy, torch._dynamo, torch._inductor.compile_fx; import ember.llm" \
      2>/dev/null
  fi
  for tp in 1 2; do
    cache=$(mktemp -d)
    export EMBER_CACHE=$cache/ember TRITON_CACHE_DIR=$cache/triton
    timed startup_tp${tp}_cold 70 python3 benches/startup.py --model llama-3.1-8b --tensor-parallel-size $tp \
      --label cold --num-prompts 4
    timed startup_tp${tp}_warm 45 python3 benches/startup.py --model llama-3.1-8b --tensor-parallel-size $tp \
      --label warm --num-prompts 4
    unset EMBER_CACHE TRITON_CACHE_DIR
    rm -rf "$cache"
  done
  grep -h "start-up\|STARTUP" "$OUT"/startup_tp*_*.log | cut -c1-400
}

# tp2 (at most 7 min): Llama-3.1-8B config, batch 1 (input 32, output 256) and the nano-vllm throughput workload,
# TP=1 against TP=2 in the same run, TP=2 with NCCL alone and with the one-shot all-reduce for small messages.
part_tp2() {
  local lat="python3 -m ember bench latency --config llama-3.1-8b --batch-size 1 --input-len 32 --output-len 256 \
    --num-iters 3" thr="python3 -m ember bench throughput --config llama-3.1-8b" f
  timed lat_tp1 65 $lat --tensor-parallel-size 1
  timed lat_tp2 75 $lat --tensor-parallel-size 2 --no-symm-mem-all-reduce --profile 20
  timed lat_tp2_symm 75 $lat --tensor-parallel-size 2 --symm-mem-all-reduce --profile 20
  timed thr_tp1 60 $thr --tensor-parallel-size 1
  timed thr_tp2 75 $thr --tensor-parallel-size 2 --no-symm-mem-all-reduce --profile 20
  timed thr_tp2_symm 60 $thr --tensor-parallel-size 2 --symm-mem-all-reduce
  echo "== summary"
  for f in lat_tp1 lat_tp2 lat_tp2_symm thr_tp1 thr_tp2 thr_tp2_symm; do
    echo "-- $f"; grep -h "decode \|TPOT\|output \|host \|start-up\|Error" "$OUT/$f.log" | head -6
    grep -h "profile over\|  dev " "$OUT/$f.log" | head -9 | cut -c1-110
  done
}

# structured_tp2 (at most 6 min, 2 GPUs, llguidance and TOKENIZER as for structured): structured output's two-rank
# GPU test (split steps' tail graphs broadcast rank 0's bitmask; tokens against one rank's), then the one-schema
# throughput bench at TP=2 (split and whole) and at TP=1, the same workload, in separate runs.
part_structured_tp2() {
  local tok=${TOKENIZER:-.bench_tokenizer} f
  local thr="python3 -m ember bench throughput --config llama-3.1-8b --structured-output json --tokenizer $tok"
  timed structured_tp_test 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
    -k structured
  timed structured_tp2 100 $thr --tensor-parallel-size 2 --json "$OUT/structured_tp2.json"
  timed structured_tp1 100 $thr --json "$OUT/structured_tp1.json"
  echo "== summary"
  grep -h "passed\|failed\|assert" "$OUT/structured_tp_test.log" | tail -3
  for f in structured_tp2 structured_tp1; do
    echo "-- $f"; grep -h "unconstrained\|schema\|split off\|Error" "$OUT/$f.log" | head -6
  done
}

# spec_tp2 (at most 6 min, 2 GPUs): n-gram speculation's two-rank GPU test (float32, FULL and PIECEWISE graphs, async
# and sync, tokens against one rank's). With SPEC_MODEL (a real checkpoint folder with a chat template and heads
# divisible by 2, e.g. Llama-3.1-8B-Instruct) instead the real-acceptance bench at TP=2 (at most 5 min; a call each).
part_spec_tp2() {
  if [ -z "${SPEC_MODEL:-}" ]; then
    timed spec_tp_test 330 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
      -k ngram
    echo "== summary"
    grep -h "passed\|failed\|assert\|accepted" "$OUT/spec_tp_test.log" | tail -6
  else
    timed spec_real_tp2 300 python3 benches/spec_real.py --model "$SPEC_MODEL" --tensor-parallel-size 2 \
      --batch-sizes 1 20 -k 4 --json "$OUT/spec_real_tp2.json"
    echo "== summary"
    grep -h "batch\|mismatched\|Error" "$OUT/spec_real_tp2.log" | head -8
  fi
}

# tp2_sampling (at most 5 min): shard-local sampling's GPU test (FULL graphs, tokens against the gathered logits'
# and one rank's), then the nano-vllm throughput workload at TP=2 with shard-local sampling and with the logits
# gathered for every step (--no-shard-local-sampling), in the same run.
part_tp2_sampling() {
  local thr="python3 -m ember bench throughput --config llama-3.1-8b --tensor-parallel-size 2" f
  timed tp_sampling_test 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
    -k shard_local
  timed thr_tp2_local 75 $thr --json "$OUT/thr_tp2_local.json"
  timed thr_tp2_gather 75 $thr --no-shard-local-sampling --json "$OUT/thr_tp2_gather.json"
  echo "== summary"
  grep -h "passed\|failed\|assert" "$OUT/tp_sampling_test.log" | tail -3
  for f in thr_tp2_local thr_tp2_gather; do
    echo "-- $f"; grep -h "decode \|TPOT\|output \|host \|start-up\|Error" "$OUT/$f.log" | head -6
  done
}

# tp4 (at most 9 min): Llama-3.1-70B config (random bf16 weights), TP=4: cold then warm start-up by phase (fresh
# caches, 16 prompts), then batch 1 and the nano-vllm throughput workload on the warm caches.
part_tp4() {
  local cache=$(mktemp -d) f
  export EMBER_CACHE=$cache/ember TRITON_CACHE_DIR=$cache/triton
  timed startup_70b_cold 170 python3 benches/startup.py --model llama-3.1-70b --tensor-parallel-size 4 \
    --label cold --num-prompts 16 --step-times
  timed startup_70b_warm 100 python3 benches/startup.py --model llama-3.1-70b --tensor-parallel-size 4 \
    --label warm --num-prompts 16 --step-times
  timed lat_70b_tp4 100 python3 -m ember bench latency --config llama-3.1-70b --tensor-parallel-size 4 \
    --batch-size 1 --input-len 32 --output-len 128 --num-iters 2 --profile 20 --json "$OUT/lat_70b_tp4.json"
  timed thr_70b_tp4 160 python3 -m ember bench throughput --config llama-3.1-70b --tensor-parallel-size 4 \
    --json "$OUT/thr_70b_tp4.json"
  unset EMBER_CACHE TRITON_CACHE_DIR
  rm -rf "$cache"
  echo "== summary"
  grep -h "start-up\|STARTUP\|SHUTDOWN" "$OUT"/startup_70b_cold.log "$OUT"/startup_70b_warm.log | cut -c1-600
  for f in lat_70b_tp4 thr_70b_tp4; do
    echo "-- $f"; grep -h "decode \|TPOT\|output \|host \|start-up\|Error" "$OUT/$f.log" | head -6
  done
}

# moe_sweep [CONFIG]: measures and writes ember/kernels/moe_configs.json (one config per call: ~5-8 minutes each);
# TP=N sweeps a rank's shape at N ranks (intermediate / N), the entry a rank's layer looks up.
part_moe_sweep() {
  local name=moe_sweep_"${1:-qwen3-30b-a3b}"_tp"${TP:-1}"
  run "$name" 590 python3 benches/moe_sweep.py --configs "${1:-qwen3-30b-a3b}" --tensor-parallel-size "${TP:-1}" \
    --write
  tail -3 "$OUT/$name.log"
}

# moe_tp2 (2 GPUs, at most 9 min): the sharded-experts GPU test (a Mixtral-shaped model, fp32 tokens of two ranks
# against one under FULL graphs), then the Mixtral-8x7B config (random bf16 weights, about 47 GB a rank; one H100
# cannot hold it whole) at TP=2: batch 1 and the nano-vllm throughput workload.
part_moe_tp2() {
  local f
  timed moe_tp2_test 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
    -k sharded_experts
  timed lat_mixtral_tp2 150 python3 -m ember bench latency --config mixtral-8x7b --tensor-parallel-size 2 \
    --batch-size 1 --input-len 32 --output-len 256 --num-iters 3 --json "$OUT/lat_mixtral_tp2.json"
  timed thr_mixtral_tp2 230 python3 -m ember bench throughput --config mixtral-8x7b --tensor-parallel-size 2 \
    --json "$OUT/thr_mixtral_tp2.json"
  echo "== summary"
  grep -h "passed\|failed" "$OUT/moe_tp2_test.log" | tail -1
  for f in lat_mixtral_tp2 thr_mixtral_tp2; do
    echo "-- $f"; grep -h "decode \|TPOT\|output \|host \|start-up\|Error" "$OUT/$f.log" | head -6
  done
}

# moe_ep2 (2 GPUs, at most 10 min): the expert-parallel GPU test (fp32 tokens of two ranks, each 4 whole experts,
# against one under FULL graphs), then the Mixtral-8x7B config's nano-vllm throughput at TP=2 with
# --enable-expert-parallel and without, on the same machine.
part_moe_ep2() {
  local f
  timed moe_ep2_test 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
    -k expert_parallelism
  timed thr_mixtral_ep2 220 python3 -m ember bench throughput --config mixtral-8x7b --tensor-parallel-size 2 \
    --enable-expert-parallel --json "$OUT/thr_mixtral_ep2.json"
  timed thr_mixtral_tp2 220 python3 -m ember bench throughput --config mixtral-8x7b --tensor-parallel-size 2 \
    --json "$OUT/thr_mixtral_tp2.json"
  echo "== summary"
  grep -h "passed\|failed" "$OUT/moe_ep2_test.log" | tail -1
  for f in thr_mixtral_ep2 thr_mixtral_tp2; do
    echo "-- $f"; grep -h "output \|start-up\|Error" "$OUT/$f.log" | head -6
  done
}

# moe: the MoE kernel GPU tests (not the model parity tests: tests/gpu/run_parts.sh 5), the MoE layer alone against
# its floor and a loop over experts, then batch-1 decode of the Qwen3-30B-A3B config with a step profile.
part_moe() {
  run moe_kernels 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_moe_gpu.py \
    -k "kernels_match or alignment or cuda_graph"
  run moe_layer 200 python3 -m pytest -q -p no:cacheprovider benches/bench_moe.py --benchmark-only -s
  run latency_qwen3_moe 180 python3 -m ember bench latency --config qwen3-30b-a3b --batch-size 1 --input-len 32 \
    --output-len 256 --num-iters 3 --profile 20 --json "$OUT/latency_qwen3_moe.json"
  echo "== summary"
  grep -h "passed\|failed" "$OUT/moe_kernels.log" | tail -1
  grep -h "^suite\|layer=" "$OUT/moe_layer.log" | cut -c1-220
  grep -h "decode \|TPOT\|host \|start-up" "$OUT/latency_qwen3_moe.log"
}

part_moe_throughput() {
  run throughput_qwen3_moe 560 python3 -m ember bench throughput --config qwen3-30b-a3b \
    --json "$OUT/throughput_qwen3_moe.json"
  echo "== summary"
  grep -h "output \|host \|start-up" "$OUT"/throughput_qwen3_moe.log
}

# fp8, one call of under 9 minutes (the steps' limits add up to 530 s): batch-1 decode of the Llama-3.1-8B config in
# bf16 then with online fp8 weights, Llama-3.2-1B with fp8 weights; nano-vllm's throughput workload on the Qwen3-0.6B
# config with an fp8 KV cache and on the Llama-3.1-8B config with fp8 weights and an fp8 KV cache; ragged decode
# attention over an fp8 cache; the fp8 GEMV against copy bandwidth and the many-row path (its crossover, written
# to $OUT/gemv_fp8_crossover.json: copy it to ember/kernels/ to route by it); and the teacher-forced accuracy of the
# default model against its bf16 run (FP8_MODEL=folder names the model where ember cannot fetch its default).
# fp8_gemv, one call of under 9 minutes (the steps' limits add up to 510 s): the fp8 GEMV's variants beside the bf16
# GEMV (activations rounded before the GEMV or inside it, CUDA or tensor cores, one-row launch shapes), the one-row
# launch-shape sweep of e4m3 weights (written to ember/kernels/gemv_fp8_shapes.json, so the latencies after it route
# by it, and copied to $OUT: copy it to ember/kernels/ to keep it), then Llama-3.1-8B batch-1 latency in bf16, with
# fp8 weights, and with fp8 weights rounding the activations inside every GEMV program (EMBER_FP8_ROW_PREPASS=0).
part_fp8_gemv() {
  local lat="--batch-size 1 --input-len 32 --output-len 128 --num-iters 2"
  run fp8_gemv_modes 150 python3 benches/experiments/fp8_gemv_modes.py --rows 1 4 --shapes
  run fp8_gemv_shapes 150 python3 benches/gemv_sweep.py shapes --fp8 --configs llama-3.2-1b llama-3.1-8b --write
  cp ember/kernels/gemv_fp8_shapes.json "$OUT/" 2>/dev/null
  run fp8g_llama8b_bf16 70 python3 -m ember bench latency --config llama-3.1-8b $lat
  run fp8g_llama8b_fp8 70 python3 -m ember bench latency --config llama-3.1-8b $lat --quantization fp8
  run fp8g_llama8b_fp8_in_gemv 70 env EMBER_FP8_ROW_PREPASS=0 python3 -m ember bench latency --config llama-3.1-8b \
    $lat --quantization fp8
  echo "== summary"
  grep -h "gate_up\|down" "$OUT/fp8_gemv_modes.log" | grep "M= 1"
  grep -h "best" "$OUT/fp8_gemv_shapes.log"
  grep -h "formats\|decode \|TPOT" "$OUT"/fp8g_*.log
}

# gemv_rows, one call of under 9 minutes (the steps' limits add up to 530 s): the GEMV's launch shapes at 2, 4, 5
# and 8 rows for the Llama-3.1-8B and Qwen3-0.6B projections, bf16 then e4m3 weights (benches/gemv_row_shapes.py
# estimates about 3 and 2 minutes), written as the row_shapes of ember/kernels/gemv_shapes.json and
# gemv_fp8_shapes.json (each rewritten after every weight shape, so a sweep cut short keeps what it measured); then
# the GEMV/cuBLAS crossover again over the configs of the stored table (it sends the 8B's projections above one or
# two rows to cuBLAS, measured with the constants: with the new shapes the GEMV may keep more rows), written to
# gemv_crossover.json; the three tables are copied to $OUT (copy them to ember/kernels/ to keep them). Then, routed
# by them, Llama-3.1-8B speculative decoding (verify steps of 5 tokens) and batch-4 decode.
part_gemv_rows() {
  local sweep="python3 benches/gemv_sweep.py shapes --rows 2 4 5 8 --configs llama-3.1-8b qwen3-0.6b --write"
  run gemv_rows_bf16 200 $sweep
  run gemv_rows_fp8 110 $sweep --fp8
  run gemv_rows_crossover 75 python3 benches/gemv_sweep.py crossover --configs qwen3-0.6b llama-3.2-1b llama-3.1-8b \
    --write
  cp ember/kernels/gemv_shapes.json ember/kernels/gemv_fp8_shapes.json ember/kernels/gemv_crossover.json "$OUT/" \
    2>/dev/null
  run gemv_rows_spec 90 python3 benches/spec_decode.py --model llama-3.1-8b --batch-sizes 1 -k 4 \
    --acceptance-length 3.0 --prompt-len 256 --output-len 128
  run gemv_rows_latency_b4 55 python3 -m ember bench latency --config llama-3.1-8b --batch-size 4 --input-len 32 \
    --output-len 128 --num-iters 2
  echo "== summary"
  grep -h "best\|wrote" "$OUT/gemv_rows_bf16.log" "$OUT/gemv_rows_fp8.log"
  grep -h "GEMV up to\|wrote" "$OUT/gemv_rows_crossover.log"
  tail -n 15 "$OUT/gemv_rows_spec.log"
  grep -h "decode \|TPOT" "$OUT/gemv_rows_latency_b4.log"
}

# gemv_tp (one GPU, at most 9 min): the GEMV's one-row launch shapes and the GEMV/cuBLAS crossover for each
# tensor-parallel rank's shard of Llama-3.1-8B (TP 2, 4) and Llama-3.1-70B (TP 4, 8: a rank's shapes, on one GPU),
# merged into the stored tables (written after every shape), which land in $OUT.
part_gemv_tp() {
  run gemv_tp_shapes 330 python3 benches/gemv_sweep.py shapes --configs llama-3.1-8b llama-3.1-70b \
    --tensor-parallel-sizes 2 4 8 --write
  run gemv_tp_crossover 180 python3 benches/gemv_sweep.py crossover --configs llama-3.1-8b llama-3.1-70b \
    --tensor-parallel-sizes 2 4 8 --write
  cp ember/kernels/gemv_shapes.json ember/kernels/gemv_crossover.json "$OUT/" 2>/dev/null
  echo "== summary"
  grep -h "best\|TMA (\|wrote" "$OUT/gemv_tp_shapes.log" | cut -c1-160
  grep -h "GEMV up to\|wrote" "$OUT/gemv_tp_crossover.log"
}

part_fp8() {
  local lat="--batch-size 1 --input-len 32 --output-len 128 --num-iters 2"
  run latency_llama8b_bf16 70 python3 -m ember bench latency --config llama-3.1-8b $lat \
    --json "$OUT/latency_llama8b_bf16.json"
  run latency_llama8b_fp8 70 python3 -m ember bench latency --config llama-3.1-8b $lat --quantization fp8 \
    --json "$OUT/latency_llama8b_fp8.json"
  run latency_llama1b_fp8 50 python3 -m ember bench latency --config llama-3.2-1b $lat --quantization fp8 \
    --json "$OUT/latency_llama1b_fp8.json"
  run throughput_qwen3_fp8kv 75 python3 -m ember bench throughput --config qwen3-0.6b --kv-cache-dtype fp8 \
    --json "$OUT/throughput_qwen3_fp8kv.json"
  run throughput_llama8b_fp8 120 python3 -m ember bench throughput --config llama-3.1-8b --quantization fp8 \
    --kv-cache-dtype fp8 --json "$OUT/throughput_llama8b_fp8.json"
  run decode_fp8 55 python3 -m pytest -q -p no:cacheprovider benches/bench_flash.py -k ragged_decode_fp8 \
    --benchmark-only -s
  run gemv_fp8 40 python3 benches/gemv_sweep.py crossover --fp8 --configs qwen3-0.6b llama-3.1-8b \
    --rows 1 2 4 8 12 16 --write
  cp ember/kernels/gemv_fp8_crossover.json "$OUT/" 2>/dev/null
  run accuracy_fp8 50 python3 benches/experiments/fp8_accuracy.py --device cuda ${FP8_MODEL:+--model "$FP8_MODEL"}
  echo "== summary"
  grep -h "formats\|decode \|TPOT" "$OUT"/latency_llama8b_bf16.log "$OUT"/latency_llama8b_fp8.log \
    "$OUT"/latency_llama1b_fp8.log
  grep -h "formats\|output \|start-up" "$OUT"/throughput_qwen3_fp8kv.log "$OUT"/throughput_llama8b_fp8.log
  grep -h "suite=decode_fp8" "$OUT/decode_fp8.log" | cut -c1-200
  grep -h "M=1 \|GEMV up to" "$OUT/gemv_fp8.log"
  grep -h "agreement\|tokens;" "$OUT/accuracy_fp8.log"
}

# fallback: one bundled config natively and through the transformers fallback in one call (the same machine):
# nano-vllm's throughput workload and batch-1 decode, with -v for the compile's pieces and fusion matches.
# qwen3 (default) = Qwen3-0.6B, llama = Llama-3.2-1B, pythia = Pythia-1B (GPT-NeoX: no native file, fallback only).
part_fallback() {
  local config impls impl kind
  case "${1:-qwen3}" in
    qwen3) config=qwen3-0.6b; impls="ember transformers" ;;
    llama) config=llama-3.2-1b; impls="ember transformers" ;;
    pythia) config=pythia-1b; impls="transformers" ;;
    *) echo "fallback takes qwen3, llama or pythia" >&2; return 2 ;;
  esac
  for impl in $impls; do
    run "${config}_${impl}_throughput" 240 python3 -m ember bench throughput --config "$config" --model-impl "$impl" \
      -v --json "$OUT/${config}_${impl}_throughput.json"
    run "${config}_${impl}_latency" 150 python3 -m ember bench latency --config "$config" --model-impl "$impl" \
      --batch-size 1 --input-len 32 --output-len 256 --num-iters 3 -v --json "$OUT/${config}_${impl}_latency.json"
  done
  echo "== summary"
  for impl in $impls; do
    for kind in throughput latency; do
      echo "-- $config $impl $kind"
      grep -h "runs through the transformers\|packed\|rotary embedding\|token count\|compiled the model\|fusion passes\|output \|decode \|TPOT\|start-up" \
        "$OUT/${config}_${impl}_${kind}.log" | cut -c1-240
    done
  done
}

part=${1:-}
[ $# -gt 0 ] && shift
case "$part" in
  decode|throughput|headline|serve|serve_dp|startup|flash|fusion|ab|moe|moe_sweep|moe_throughput|fp8|fp8_gemv|\
  gemv_rows|gemv_tp|fallback|structured|structured_tp2|spec_tp2|tp2|tp2_collectives|tp2_tests|tp2_startup|tp2_sampling|tp4|moe_tp2|moe_ep2) mkdir -p "$OUT" ;;
esac
case "$part" in
  decode) part_decode ;;
  throughput) part_throughput ;;
  headline) part_decode; part_throughput ;;
  serve) part_serve ;;
  serve_dp) part_serve_dp ;;
  startup) part_startup "$@" ;;
  flash) part_flash ;;
  fusion) part_fusion ;;
  ab) part_ab ;;
  moe) part_moe ;;
  moe_sweep) part_moe_sweep "$@" ;;
  moe_throughput) part_moe_throughput ;;
  fp8) part_fp8 ;;
  fp8_gemv) part_fp8_gemv ;;
  gemv_rows) part_gemv_rows ;;
  gemv_tp) part_gemv_tp ;;
  fallback) part_fallback "$@" ;;
  structured) part_structured ;;
  tp2) part_tp2 ;;
  tp2_collectives) part_tp2_collectives ;;
  tp2_tests) part_tp2_tests "$@" ;;
  tp2_startup) part_tp2_startup ;;
  tp2_sampling) part_tp2_sampling ;;
  structured_tp2) part_structured_tp2 ;;
  spec_tp2) part_spec_tp2 ;;
  tp4) part_tp4 ;;
  moe_tp2) part_moe_tp2 ;;
  moe_ep2) part_moe_ep2 ;;
  *) echo "usage: bash benches/run_gpu.sh decode|throughput|headline|serve|serve_dp|startup [MODEL ...]|flash|fusion|ab|" \
          "moe|moe_sweep [CONFIG]|moe_throughput|fp8|fp8_gemv|gemv_rows|fallback [qwen3|llama|pythia]|structured|" \
          "tp2_collectives|tp2|tp2_sampling|structured_tp2|spec_tp2|tp4|moe_tp2|moe_ep2" >&2
     exit 2 ;;
esac
