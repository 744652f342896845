#!/usr/bin/env bash
# GPU check of the testbed's torch path. Run on the GPU machine from the repo root, with the wheels
# from examples/gpu/fetch_wheels.sh carried in ./.whl:
#   OUT=/some/dir bash examples/gpu/run_gpu_check.sh
# Runs: numpy CPU reference, CUDA fp32 (tokens should match the CPU reference), CUDA bf16 eager,
# CUDA bf16 + CUDA graphs, CUDA with a small KV pool + offload; each with ground truth, a chain
# client and examples/check_truth.py. Leaves $OUT/summary.txt and $OUT/gpu-check.tar.gz.
set -u
OUT=${OUT:-/tmp/testbed-gpu-out}
W=/tmp/testbed-gpu-work
rm -rf "$W"; mkdir -p "$W" "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/examples${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
S="$W/summary.txt"
python3 -c 'import sys,torch;print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")' 2>&1 | tee "$S"

run() {  # run NAME SERVE_ARGS... -- CLIENT_ARGS...
  local name=$1; shift
  local sargs=()
  while [ "$1" != "--" ]; do sargs+=("$1"); shift; done; shift
  local t0=$(date +%s)
  python3 -m testbed.serve --port 0 --port-file "$W/$name.port" --ground-truth "$W/$name.truth.jsonl" "${sargs[@]}" \
    > "$W/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1200); do [ -f "$W/$name.port" ] && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  if [ ! -f "$W/$name.port" ]; then
    echo "== $name: SERVER FAILED TO START" | tee -a "$S"; tail -40 "$W/$name.server.log" | tee -a "$S"; return 1
  fi
  echo "== $name: up in $(( $(date +%s) - t0 )) s (${sargs[*]})" | tee -a "$S"
  timeout 300 python3 examples/chain_client.py --base-url "http://127.0.0.1:$(cat "$W/$name.port")" \
    --out "$W/$name.client.jsonl" "$@" 2>&1 | tail -12 | tee -a "$S"
  kill -INT $pid; wait $pid; echo "$name: server exit $?" | tee -a "$S"
  python3 examples/check_truth.py "$W/$name.truth.jsonl" --client "$W/$name.client.jsonl" 2>&1 | tail -8 | tee -a "$S"
  grep -m5 -i -E "error|traceback" "$W/$name.server.log" | tee -a "$S"
}

run cpu-ref --device cpu -- --chains 1 --hops 5 --max-tokens 64
run cuda-fp32 --device cuda --dtype float32 -- --chains 1 --hops 5 --max-tokens 64
run cuda-eager --device cuda -- --chains 8 --hops 5 --max-tokens 64
run cuda-graphs --device cuda --cuda-graphs -- --chains 8 --hops 5 --max-tokens 64
run cuda-offload --device cuda --cuda-graphs --num-kv-blocks 96 --kv-offload --max-num-seqs 8 -- --chains 8 --hops 3 --max-tokens 64

python3 - "$W" <<'PY' 2>&1 | tee -a "$S"
import json, sys
w = sys.argv[1]
def texts(name):
    try:
        return [json.loads(l).get("text") for l in open(f"{w}/{name}.client.jsonl")]
    except OSError:
        return []
a, b = texts("cpu-ref"), texts("cuda-fp32")
print("cpu numpy vs cuda fp32, hops with identical greedy text:", sum(x == y for x, y in zip(a, b)), "of", len(a))
PY
cp "$S" "$OUT/summary.txt"
tar -C "$W" -czf "$OUT/gpu-check.tar.gz" .
ls -la "$OUT"
