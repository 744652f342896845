#!/usr/bin/env bash
# vLLM 0.34.0's Rust frontend (`vllm-rs`, VLLM_USE_RUST_FRONTEND's server: hyper/axum HTTP, the
# `zeromq` crate's ZMTP) traced by `hopscope run`, in front of the testbed's engine speaking vLLM
# 0.34.0's engine IPC (rust_frontend.py): streamed chat, whole answers, a stream without usage,
# Responses API turns with long instructions (hyper writes two 4 KiB+ events in one writev).
# Writes OUT/rsfe.hop, the clients' marks, the engine's truth, the report (text and JSON) and the
# Perfetto trace. tests/tests/real_vllm.rs runs it and checks what it wrote.
#
#   sudo examples/real-vllm/rust_frontend.sh [OUT]     (root: eBPF)
#
# VENV (default target/real-vllm/venv, made by install.sh with vllm-rs beside it) makes the tiny
# model's tokenizer and chat template once (make_tiny_model.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-target/real-vllm/rsfe-out}
VENV=${VENV:-target/real-vllm/venv}
VLLM_RS=${VLLM_RS:-$VENV/../vllm-rs-0.34.0/vllm-rs}
MODEL=${MODEL:-target/real-vllm/tiny}
PORT=${PORT:-18820}
BIN=${HOPSCOPE_BIN:-target/release/hopscope}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
[ -x "$BIN" ] || cargo build --release -q -p hopscope
[ -x "$VLLM_RS" ] || examples/real-vllm/install.sh "$VENV"
[ -f "$MODEL/tokenizer.json" ] || "$VENV/bin/python" examples/real-vllm/make_tiny_model.py "$MODEL"
if curl -sf "127.0.0.1:$PORT/v1/models" >/dev/null; then
  echo "something already serves port $PORT: stop it or set PORT" >&2
  exit 1
fi
rm -f "$OUT"/rsfe.*
"$BIN" run --quiet -o "$OUT/rsfe.hop" -- "$PY" examples/real-vllm/rust_frontend.py --vllm-rs "$VLLM_RS" \
  --model "$MODEL" --served-model-name tiny --port "$PORT" --max-num-seqs 4 \
  --ground-truth "$OUT/rsfe.truth.jsonl" > "$OUT/rsfe.server.log" 2>&1 &
hp=$!
for _ in $(seq 240); do
  curl -sf "127.0.0.1:$PORT/v1/models" >/dev/null && break
  kill -0 $hp 2>/dev/null || { echo "the Rust frontend did not start: $OUT/rsfe.server.log" >&2; exit 1; }
  sleep 0.5
done
curl -sf "127.0.0.1:$PORT/v1/models" >/dev/null || { echo "the Rust frontend not serving after 120 s: $OUT/rsfe.server.log" >&2; kill -INT $hp; exit 1; }
client() {
  "$PY" examples/chain_client.py --base-url "http://127.0.0.1:$PORT" --model tiny --quiet --append \
    --out "$OUT/rsfe.client.jsonl" "$@"
}
client --chains 2 --hops 3 --max-tokens 16 --stagger-ms 20   # streamed chat, usage asked
client --no-stream --chains 1 --hops 2 --max-tokens 16       # whole answers
client --no-usage --chains 1 --hops 2 --max-tokens 16        # a stream without usage
# The Responses API with ~3.7 KB of instructions, echoed in its first events.
client --api responses --system-words 500 --prompt-words 20 --chains 1 --hops 2 --max-tokens 16
kill -INT $hp
wait $hp || true
"$BIN" report "$OUT/rsfe.hop" | tee "$OUT/rsfe.report.txt"
"$BIN" report "$OUT/rsfe.hop" --json > "$OUT/rsfe.report.json"
"$BIN" trace "$OUT/rsfe.hop" -o "$OUT/rsfe.pftrace"
