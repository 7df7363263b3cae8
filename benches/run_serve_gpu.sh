#!/bin/bash
# The server against the offline engine on one GPU, Qwen3-0.6B config with random weights, nano-vllm's workload
# (random token prompts, input and output lengths U[100, 1024]): `ember bench throughput` first, then `ember serve`
# with `ember bench serve` at request rates 8, 32 and inf (the inf run sends the same 256 requests as the offline
# run). Results under $OUT (default bench_out/).
set -u
OUT=${OUT:-bench_out}
PORT=${PORT:-8000}
COUNTS=${COUNTS:-64,128,256}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
WORKLOAD="--input-len 100:1024 --output-len 100:1024 --seed 0"

python -m ember bench throughput --config qwen3-0.6b --num-prompts 256 $WORKLOAD --json "$OUT/offline.json"

python -m ember serve --config qwen3-0.6b --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
python - "$PORT" <<'PY'
import sys, time, urllib.request
deadline = time.time() + 300
while time.time() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
        break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit("the server did not start")
PY
python -m ember bench serve --base-url "http://127.0.0.1:$PORT" --request-rate 8,32,inf --num-prompts "$COUNTS" \
    $WORKLOAD --compare-offline "$OUT/offline.json" --json "$OUT/serve.json" --plot "$OUT/serve.png"
python - "$PORT" > "$OUT/metrics.txt" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
print("\n".join(l for l in text.splitlines() if l.startswith(("ember_num", "ember_kv", "ember_prompt",
                                                             "ember_generation", "ember_request"))))
PY
kill -TERM "$SERVER"
wait "$SERVER"
echo "server exited with $? after SIGTERM"
tail -3 "$OUT/server.log"
