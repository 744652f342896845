#!/usr/bin/env bash
# hopscope GPU check: one call, ≤ 5 minutes, on a machine with an NVIDIA GPU,
# python3 + torch (CUDA) + the nvidia-cuda-cupti wheel, and no Rust toolchain.
# Everything it shows goes to $OUT (default ./gpu-out); see docs/gpu.md.
#
# Needs, built beforehand on the build machine (docs/gpu.md "The GPU check"):
#   target/gpu-bundle/  (`cargo xtask gpu-bundle`: the agent, the injection library,
#                        hopscope-gpu-exact and the wheels, one folder to carry)
# or, without the bundle, the separate build outputs:
#   target/release/libhopscope_cupti.so          (cargo build --release -p agent-cupti)
#   target/gpu-exact/release/hopscope-gpu-exact  (cd agent-cupti/gpu-exact && cargo build --release)
#   target/release/hopscope (the agent: steps 6-8), .whl/ (examples/gpu/fetch_wheels.sh: step 7)
#
# Steps (each bounded by `timeout`; a failing step never stops the others):
#   0 facts        GPU, driver, kernel, glibc, python/torch, libcupti/libnvrtc found
#   1 exact-auto   exact-kernel program under the injection, clock chosen by CUPTI version
#   2 exact-calib  same, clock forced to offset calibration
#   3 exact-cb     same, clock forced to the CLOCK_MONOTONIC callback (on CUPTI
#                  12.6u2–13.0 this is expected to FAIL: it shows the zeroed-timestamp bug)
#   3g exact-graphs same, graphs traced per launch (HOPSCOPE_CUPTI_GRAPHS=launch, `--gpu-graphs
#                  launch`): 4 whole-graph kernels, no node kernels
#   4 init-fail    InitializeInjection forced to return 0: does CUDA still work?
#   5 overhead     torch decode-like loop (CUDA graph replay and eager), side by side:
#                  untraced vs hopscope (with a draining listener; graphs per node, and
#                  per launch) vs torch.profiler
#   6 ebpf         if the agent was carried: does the eBPF side load here (also in a pid
#                  namespace of its own, as in a pod)?
#   7 testbed      the torch testbed (CUDA graphs) under `hopscope run` with eBPF + CUPTI and
#                  4 chains x 3 hops: recording, report, Perfetto trace, ground truth, and
#                  the CUPTI step ends against the truth (examples/gpu/check_gpu_steps.py)
#                  (needs the wheels: the bundle's, or .whl from examples/gpu/fetch_wheels.sh)
#   8 nvml         `hopscope record --nvml-period 50` of a CUDA process holding 1 GiB: the
#                  report's NVML samples and peak GPU memory (the real libnvidia-ml path)
#   9 testbed-dp   only if under 200 s so far: the testbed with 2 data-parallel engines on the
#                  one GPU and 2 API server processes (vLLM's default with DP); each engine's
#                  CUPTI step ends against its own truth
#  10 testbed-graphs only if time is left: step 7 with `--gpu-graphs launch`
# Raw CUPTI buffers from step 1 land in $OUT/fixtures (decoder fixtures for CI).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
note() { echo "$*" | tee -a "$SUMMARY"; }
step() { echo; echo "=== $* ($(( $(date +%s) - T0 )) s)"; }
# The whole check keeps inside GPU_CHECK_BUDGET_S (default 300 s): each step's timeout is
# cut to what is left, so the summary and the packing (below) always happen inside the
# device call's limit. GPU_CHECK_STEPS="7 8" runs only those steps (0, the facts, always).
DEADLINE=$(( T0 + ${GPU_CHECK_BUDGET_S:-300} ))
cap() { local t=$1 l=$(( DEADLINE - $(date +%s) )); [ "$l" -lt "$t" ] && t=$l; [ "$t" -lt 1 ] && t=1; echo "$t"; }
want() { [ -z "${GPU_CHECK_STEPS:-}" ] || [[ " $GPU_CHECK_STEPS " == *" $1 "* ]]; }

BUNDLE="${HOPSCOPE_BUNDLE:-$PWD/target/gpu-bundle}"
if [ -d "$BUNDLE" ]; then
  INJ="${HOPSCOPE_CUPTI_SO:-$BUNDLE/libhopscope_cupti.so}"
  EXACT="${HOPSCOPE_GPU_EXACT:-$BUNDLE/hopscope-gpu-exact}"
  AGENT="${HOPSCOPE_BIN:-$BUNDLE/hopscope}"
  WHL="$BUNDLE/wheels"
else
  INJ="${HOPSCOPE_CUPTI_SO:-$PWD/target/release/libhopscope_cupti.so}"
  EXACT="${HOPSCOPE_GPU_EXACT:-$PWD/target/gpu-exact/release/hopscope-gpu-exact}"
  AGENT="${HOPSCOPE_BIN:-$PWD/target/release/hopscope}"
  WHL="$PWD/.whl"
fi
PY="${PYTHON:-python3}"

step "0 facts"
note "date: $(date -u +%FT%TZ)"
if [ -d "$BUNDLE" ]; then note "artifacts: bundle $BUNDLE"; else note "artifacts: separate build outputs (no $BUNDLE)"; fi
note "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4 | tr '\n' ';')"
note "kernel: $(uname -r); glibc: $(ldd --version 2>&1 | head -1)"
note "python: $($PY -c 'import sys,torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)"
SITE=$($PY -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
find_lib() { for d in $SITE; do ls -1 "$d"/nvidia/*/lib/$1 2>/dev/null; done | sort -V | tail -1; }
CUPTI_LIB="${HOPSCOPE_CUPTI_LIB:-$(find_lib 'libcupti.so.1[0-9]')}"
NVRTC_LIB=$(find_lib 'libnvrtc.so.1[0-9]')
note "libcupti: ${CUPTI_LIB:-none}; libnvrtc: ${NVRTC_LIB:-none}"
for f in "$INJ" "$EXACT"; do
  if [ ! -f "$f" ]; then note "MISSING $f: build it first (docs/gpu.md)"; fi
done
note "artifacts need $(objdump -T "$INJ" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1) (libhopscope_cupti)"

# cudarc (dynamic loading) looks for libnvrtc.so / .so.<major> on the loader
# path; the wheel's copy is not there. Give it a stable name, and the wheel
# lib dirs (nvrtc-builtins, libcupti's neighbours).
LIBDIR="$OUT/.lib"; mkdir -p "$LIBDIR"
[ -n "$NVRTC_LIB" ] && ln -sf "$NVRTC_LIB" "$LIBDIR/libnvrtc.so"
NVDIRS=$(for d in $SITE; do ls -d "$d"/nvidia/*/lib 2>/dev/null; done | tr '\n' ':')
export LD_LIBRARY_PATH="$LIBDIR:${NVDIRS}${LD_LIBRARY_PATH:-}"

run_exact() { # step, name, extra env...
  want "$1" || return 0
  local name=$2; shift 2
  step "$name"
  env CUDA_INJECTION64_PATH="$INJ" HOPSCOPE_CUPTI_LIB="$CUPTI_LIB" HOPSCOPE_CUPTI_FLUSH_MS=100 HOPSCOPE_GPU_REPORT_MS=200 \
      HOPSCOPE_CUPTI_LOG=1 "$@" timeout "$(cap 60)" "$EXACT" --out "$OUT/$name"
  local rc=$?
  note "$name: rc=$rc ($( [ $rc = 0 ] && echo PASS || echo FAIL)) report $OUT/$name/exact.json"
  grep -h '"check"' "$OUT/$name/exact.json" 2>/dev/null | sed 's/^/    /' | cut -c1-400 >>"$SUMMARY"
}
run_exact 1 exact-auto HOPSCOPE_CUPTI_DUMP_DIR="$OUT/fixtures"
run_exact 2 exact-calib HOPSCOPE_CUPTI_CLOCK=calibrate
run_exact 3 exact-cb HOPSCOPE_CUPTI_CLOCK=callback
run_exact 3g exact-graphs HOPSCOPE_CUPTI_GRAPHS=launch

if want 4; then
step "4 init-fail"
env CUDA_INJECTION64_PATH="$INJ" HOPSCOPE_CUPTI_LIB="$CUPTI_LIB" HOPSCOPE_CUPTI_FORCE_INIT_FAILURE=1 \
    timeout "$(cap 60)" "$EXACT" --out "$OUT/init-fail" >"$OUT/init-fail.log" 2>&1
note "init-fail: rc=$? status $(grep -o '"status":"[a-z_]*"' "$OUT/init-fail/exact.json" 2>/dev/null) (\"ran\" = CUDA kept working after InitializeInjection returned 0); $(grep -m1 hopscope-cupti "$OUT/init-fail.log")"

fi

if want 5; then
step "5 overhead"
BENCH="$OUT/.bench.py"; DRAIN="$OUT/.drain.py"
cat >"$BENCH" <<'EOF'
# A decode-like loop: 16 bf16 4096x4096 layers for 8 tokens, then a small
# pinned D2H copy and a sync per step (vLLM's step end). Prints steps/s.
import json, sys, time, torch
mode, workload, secs, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
L, D, B = 16, 4096, 8
ws = [torch.randn(D, D, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(L)]
x = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
def fwd():
    h = x
    for w in ws:
        h = torch.nn.functional.gelu(h @ w)
    return h
if workload == "graph":
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fwd()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): y = fwd()
    run = lambda: (g.replay(), y)[1]
else:
    run = fwd
tok = torch.empty(B, 1, dtype=torch.bfloat16).pin_memory()
def step():
    h = run()
    tok.copy_(h[:, :1], non_blocking=True)
    torch.cuda.current_stream().synchronize()
def loop(t):
    n, end = 0, time.perf_counter() + t
    while time.perf_counter() < end:
        step(); n += 1
    return n
def report(n, t):
    r = {"mode": mode, "workload": workload, "steps": n, "secs": round(t, 3), "steps_per_s": round(n / t, 2)}
    print(json.dumps(r), flush=True); open(out, "a").write(json.dumps(r) + "\n")
loop(2.0)  # warm up
if mode == "profiler":
    import os
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        t = time.perf_counter(); n = loop(secs); t = time.perf_counter() - t
        report(n, t)
        os._exit(0)  # skip Kineto's post-processing: the figure is taken
t = time.perf_counter(); n = loop(secs); t = time.perf_counter() - t
report(n, t)
# hopscope: a normal exit runs the injection's exit flush.
EOF
cat >"$DRAIN" <<'EOF'
# A stand-in agent: accepts the injected processes, reads every frame fast,
# counts records by tag and keeps each process's last counters.
import json, os, signal, socket, struct, sys, threading
path, out = sys.argv[1], sys.argv[2]
TAGS = {1: "hello", 2: "device", 3: "name", 4: "kernel", 5: "memcpy", 6: "memset", 7: "sync", 8: "api", 9: "counters", 10: "calibration", 11: "goodbye"}
NAMES = {1: "records_decoded", 2: "records_sent", 3: "dropped_queue_full", 4: "dropped_no_agent", 5: "dropped_send_error", 6: "cupti_dropped", 7: "buffer_pool_exhausted", 8: "bad_timestamp_zero", 9: "bad_timestamp_reversed", 10: "bad_timestamp_future", 11: "bad_timestamp_past", 12: "bad_record_size", 13: "unknown_kind", 14: "name_truncated", 15: "connects", 16: "callback_panics", 17: "cupti_errors"}
counts, last, hello, lock = {}, {}, {}, threading.Lock()
def serve(c, k):
    buf = bytearray()
    while True:
        b = c.recv(1 << 20)
        if not b: break
        buf += b; i = 0
        while len(buf) - i >= 4:
            n = struct.unpack_from("<I", buf, i)[0]
            if len(buf) - i < 4 + n: break
            t = buf[i + 4]
            with lock:
                counts[TAGS.get(t, str(t))] = counts.get(TAGS.get(t, str(t)), 0) + 1
                if t == 9:
                    m = struct.unpack_from("<H", buf, i + 5)[0]
                    last[k] = {NAMES.get(a, str(a)): v for a, v in (struct.unpack_from("<HQ", buf, i + 7 + 10 * j) for j in range(m))}
                if t == 1:
                    pid, ppid, ver, clock = struct.unpack_from("<IIIB", buf, i + 11)
                    hello[k] = {"pid": pid, "cupti_version": ver, "clock": {1: "callback", 2: "calibrated"}.get(clock)}
            i += 4 + n
        del buf[:i]
def stop(*_):
    with lock:
        json.dump({"frames": counts, "hello": list(hello.values()), "counters": list(last.values())}, open(out, "w"), indent=1)
    os._exit(0)
signal.signal(signal.SIGTERM, stop); signal.signal(signal.SIGINT, stop)
s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(16); k = 0
while True:
    c, _ = s.accept(); k += 1
    threading.Thread(target=serve, args=(c, k), daemon=True).start()
EOF
RES="$OUT/overhead.jsonl"; : >"$RES"
for workload in graph eager; do
  SOCK="/tmp/hs-gpu-$$-$workload.sock"; rm -f "$SOCK"
  $PY "$DRAIN" "$SOCK" "$OUT/drain-$workload.json" & DP=$!
  sleep 0.5
  # GPU_CHECK_OVERHEAD_MODES adds variants that tell CUPTI's cost from the library's:
  # hopscope-noapi (no API records: HOPSCOPE_CUPTI_API=0), hopscope-noagent (no listener:
  # records decoded, then dropped and counted), hopscope-kernel (kernel records alone);
  # by default also hopscope-graphlaunch (`--gpu-graphs launch`: a CUDA graph's launch as
  # one record, CUPTI's GRAPH_TRACE, in place of its nodes').
  for mode in ${GPU_CHECK_OVERHEAD_MODES:-untraced hopscope hopscope-graphlaunch profiler}; do
    case $mode in
      hopscope) inj=(CUDA_INJECTION64_PATH="$INJ" HOPSCOPE_GPU_SOCKET="$SOCK") ;;
      hopscope-noapi) inj=(CUDA_INJECTION64_PATH="$INJ" HOPSCOPE_GPU_SOCKET="$SOCK" HOPSCOPE_CUPTI_API=0) ;;
      hopscope-noagent) inj=(CUDA_INJECTION64_PATH="$INJ" HOPSCOPE_GPU_SOCKET="/tmp/hs-gpu-$$-none.sock") ;;
      hopscope-kernel) inj=(CUDA_INJECTION64_PATH="$INJ" HOPSCOPE_GPU_SOCKET="$SOCK" HOPSCOPE_CUPTI_API=0 HOPSCOPE_CUPTI_KINDS=kernel) ;;
      hopscope-graphlaunch) inj=(CUDA_INJECTION64_PATH="$INJ" HOPSCOPE_GPU_SOCKET="$SOCK" HOPSCOPE_CUPTI_GRAPHS=launch) ;;
      *) inj=() ;;
    esac
    env "${inj[@]}" HOPSCOPE_CUPTI_LOG=1 timeout "$(cap 60)" $PY "$BENCH" $mode $workload 6 "$RES"
  done
  kill -TERM $DP 2>/dev/null; wait $DP 2>/dev/null
  note "drain-$workload: $(tr -d '\n ' <"$OUT/drain-$workload.json" 2>/dev/null | cut -c1-600)"
done
$PY - "$RES" <<'EOF' | tee -a "$SUMMARY"
import json, sys
rs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for w in ("graph", "eager"):
    by = {r["mode"]: r["steps_per_s"] for r in rs if r["workload"] == w}
    base = by.get("untraced")
    if not base: print(f"overhead {w}: no untraced figure"); continue
    print(f"overhead {w}: untraced {base}/s; " + "; ".join(f"{m} {by[m]}/s = {by[m]/base:.3f}x" for m in by if m != "untraced"))
EOF
fi

step "6 ebpf"
# Steps 6-9 need tracefs (as CI mounts it); a bare device machine has it unmounted.
if [ -x "$AGENT" ] && ! mountpoint -q /sys/kernel/tracing && [ "$(id -u)" = 0 ]; then
  mount -t tracefs nodev /sys/kernel/tracing && note "tracefs: mounted /sys/kernel/tracing"
fi
if ! want 6; then
  :
elif [ -x "$AGENT" ]; then
  timeout "$(cap 30)" "$AGENT" record --pid $$ --duration 2s -o "$OUT/ebpf-probe.hop" >"$OUT/ebpf.log" 2>&1
  note "ebpf: rc=$? $(tail -2 "$OUT/ebpf.log" | tr '\n' ' ' | cut -c1-300)"
  # The pid-namespace translation (a sidecar sharing a pod's namespace) on this kernel.
  if command -v unshare >/dev/null; then
    timeout "$(cap 30)" unshare --pid --fork --mount-proc --kill-child "$AGENT" doctor >"$OUT/ebpf-pidns.log" 2>&1
    note "ebpf in a pid namespace: rc=$? $(grep -E 'pid namespace|ebpf load' "$OUT/ebpf-pidns.log" | tr '\n' ' ' | cut -c1-300)"
  fi
else
  note "ebpf: skipped ($AGENT not carried)"
fi

step "7 testbed"
# The torch testbed on the GPU under `hopscope run` (eBPF + CUPTI injection), with a chain:
# recording, report and Perfetto trace, and the testbed's own ground truth beside them.
# Needs the wheels the image lacks ($WHL: the bundle's, or .whl) and the agent +
# injection library carried.
TB_DEVICE="${TESTBED_DEVICE:-cuda}"   # cpu: dry-run this step on a machine without a GPU
TB_ARGS="${TESTBED_ARGS:---cuda-graphs}"
# testbed_under_hopscope NAME RUN_S WAIT_S CLIENT_S "SERVE_ARGS" CLIENT_ARGS...: the testbed under
# `hopscope run` (eBPF + the injection) and the chain client against it; writes $OUT/NAME.hop,
# NAME.truth.jsonl, NAME.client.jsonl and NAME-{agent,client}.log; notes as "NAME: …".
testbed_under_hopscope() {
  local name=$1 run_s=$2 wait_s=$3 client_s=$4 serve_args=$5 w="/tmp/$1-work"
  shift 5
  rm -rf "$w"; mkdir -p "$w"
  PYTHONPATH="$PWD/examples:/tmp/tb-site" PYTHONUNBUFFERED=1 timeout "$(cap "$run_s")" "$AGENT" run --quiet \
      -o "$OUT/$name.hop" --cupti-lib "$INJ" ${AGENT_EXTRA:-} -- \
      $PY -m testbed.serve --device "$TB_DEVICE" $serve_args --port 0 --port-file "$w/port" \
      --ground-truth "$OUT/$name.truth.jsonl" >"$OUT/$name-agent.log" 2>&1 &
  local apid=$!
  for _ in $(seq $(( wait_s * 10 ))); do [ -f "$w/port" ] && break; kill -0 $apid 2>/dev/null || break; sleep 0.1; done
  if [ -f "$w/port" ]; then
    PYTHONPATH="/tmp/tb-site" timeout "$(cap "$client_s")" $PY examples/chain_client.py --base-url "http://127.0.0.1:$(cat "$w/port")" \
      "$@" --out "$OUT/$name.client.jsonl" >"$OUT/$name-client.log" 2>&1
    note "$name: client rc=$? $(tail -1 "$OUT/$name-client.log" | cut -c1-200)"
  else
    note "$name: server did not come up (see $name-agent.log)"
  fi
  kill -INT $apid 2>/dev/null; wait $apid; note "$name: hopscope rc=$?"
}
if ! want 7; then
  :
elif [ -x "$AGENT" ] && [ -f "$INJ" ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tb-site "$WHL"/*.whl \
    >"$OUT/testbed-pip.log" 2>&1 || note "testbed: wheel install failed (see testbed-pip.log)"
  testbed_under_hopscope testbed 240 90 120 "$TB_ARGS" --chains 4 --hops 3 --max-tokens 64 --traceparent
  "$AGENT" report "$OUT/testbed.hop" >"$OUT/testbed.report.txt" 2>&1
  "$AGENT" report "$OUT/testbed.hop" --json >"$OUT/testbed.report.json" 2>>"$OUT/testbed.report.txt"
  "$AGENT" trace "$OUT/testbed.hop" -o "$OUT/testbed.pftrace" --layout streamed >>"$OUT/testbed.report.txt" 2>&1
  # The same trace laid out whole: its flow line should match the streamed one's (real CUPTI step ends).
  "$AGENT" trace "$OUT/testbed.hop" -o "$OUT/testbed.whole.pftrace" --layout whole >>"$OUT/testbed.report.txt" 2>&1
  grep -h "hopscope: flows:" "$OUT/testbed.report.txt" | sed 's/^/testbed trace: /' | tee -a "$SUMMARY"
  $PY - "$OUT/testbed.report.json" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
reqs = [q for q in r["requests"] if q["path"].startswith("/v1/")]
print(f"testbed: {len(reqs)} requests, gpu={r['recording']['gpu']}, gpus={[g['name'] for g in r['recording'].get('gpus', [])]}")
# How each injected process traced (its hello): CUPTI version, clock, graphs, the kinds CUPTI took.
for c in r["recording"].get("cupti", []):
    print(f"testbed cupti: {c['cupti_version']} clock={c['clock']} graphs={c['graphs']} traced={','.join(c['traced'])} pids={c['pids']}")
print("testbed: phase sources", sorted({q["phase_source"] for q in reqs}))
for k in r["kernels"][:5]:
    print(f"testbed kernel: {k['gpu_ms']:.2f} ms x{k['count']} {k['name'][:90]}")
# Per hop: which kernels its share of the GPU steps was made of (requests[].kernels).
for q in [q for q in reqs if q.get("kernels")][:2]:
    print(f"testbed hop {q['chain'][:12]}#{q['hop']} gpu_ms={q['gpu_ms']}: " + "; ".join(f"{k['gpu_ms']:.2f} {k['name'][:40]}" for k in q["kernels"][:4]))
print(f"testbed: {sum(1 for q in reqs if q.get('kernels'))} of {len(reqs)} requests list kernels")
print("testbed drops:", {k: v for k, v in r["recording"]["drops"].items() if v and k.startswith(("gpu_", "kernel_ringbuf", "zmtp_desync"))})
PYEOF
  # CUPTI step ends against the testbed's own (issue #5: within 50 µs).
  $PY examples/gpu/check_gpu_steps.py "$OUT/testbed.report.json" "$OUT/testbed.truth.jsonl" --tolerance-us 50 2>&1 | tee -a "$SUMMARY"
else
  note "testbed: skipped (needs $AGENT, $INJ and the wheels in $WHL: cargo xtask gpu-bundle)"
fi

step "8 nvml"
# The real NVML path (source::nvml): a CUDA process holding 1 GiB, recorded with
# --nvml-period 50; the report must show the samples and that process's memory.
if ! want 8; then
  :
elif [ -x "$AGENT" ]; then
  "$AGENT" doctor --no-load 2>&1 | grep -E "^(ok|warn|FAIL) +nvml" | tee -a "$SUMMARY"
  $PY -c "import torch, time; x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); time.sleep(8)" \
    >"$OUT/nvml-holder.log" 2>&1 &
  HOLDER=$!
  sleep 3   # CUDA context + allocation
  timeout "$(cap 30)" "$AGENT" record --pid $HOLDER --nvml-period 50 --duration 4s --quiet -o "$OUT/nvml.hop" >"$OUT/nvml.log" 2>&1
  RC=$?
  note "nvml: record rc=$RC $(grep -i nvml "$OUT/nvml.log" | tr '\n' ' ' | cut -c1-300)"
  wait $HOLDER
  if [ $RC -ne 0 ]; then
    note "nvml: FAIL (no recording; holder: $(tail -1 "$OUT/nvml-holder.log" | cut -c1-200))"
  elif ! "$AGENT" report "$OUT/nvml.hop" --json >"$OUT/nvml.report.json" 2>>"$OUT/nvml.log"; then
    note "nvml: FAIL (report failed, see nvml.log)"
  else
  $PY - "$OUT/nvml.report.json" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
s, d = r["summary"], r["recording"]["drops"]
peak = s.get("peak_gpu_mem_bytes")
print(f"nvml: {s['gpu_samples']} samples (4 s at 50 ms per GPU: ~80 per GPU), peak traced-process memory "
      f"{peak} bytes ({'OK' if peak and peak >= 1 << 30 else 'FAIL'}: the holder has >= 1 GiB)")
print("nvml counters:", {k: v for k, v in d.items() if k.startswith("nvml_")})
# PCIe and NVLink (GPM, Hopper+) peaks per GPU: a number, not null, says the real path gave it
# (one GPU has no NVLink peer, so 0 MiB/s is expected there; null NVLink on a Hopper is a FAIL).
for g in r["recording"].get("nvml_gpus", []):
    nvl = (g.get("nvlink_tx_peak_kib_s"), g.get("nvlink_rx_peak_kib_s"))
    hopper = any(m in g["name"] for m in ("H100", "H200", "H800", "H20", "GH200", "B100", "B200", "GB200"))
    verdict = "OK" if None not in nvl else ("FAIL: a Hopper or newer has GPM" if hopper else "none (no GPM before Hopper)")
    print(f"nvml gpu {g['device']} {g['name']}: PCIe peak tx/rx {g.get('pcie_tx_peak_kib_s')}/{g.get('pcie_rx_peak_kib_s')} KiB/s, "
          f"NVLink peak tx/rx {nvl[0]}/{nvl[1]} KiB/s ({verdict})")
PYEOF
  fi
else
  note "nvml: skipped ($AGENT not carried)"
fi

step "9 testbed-dp"
# Data parallelism as vLLM deploys it by default: two testbed engines (EngineCore_DP0/1)
# sharing the GPU behind two API server processes (vLLM's --api-server-count defaults to the
# data-parallel size), each step sent as one message per API server; each engine's CUPTI steps
# must be told apart and match that engine's truth (docs/attribution.md "Data parallelism").
# Last and optional: only when the steps above left time (the whole check stays under 5 minutes).
if ! want 9; then
  :
elif [ $(( DEADLINE - $(date +%s) )) -lt 100 ]; then
  note "testbed-dp: skipped (no time left: $(( $(date +%s) - T0 )) s elapsed)"
elif [ -x "$AGENT" ] && [ -f "$INJ" ] && [ -d /tmp/tb-site ]; then
  testbed_under_hopscope testbed-dp 80 45 40 "$TB_ARGS --data-parallel-size 2 --api-server-count 2" --chains 4 --hops 2 --max-tokens 32
  "$AGENT" report "$OUT/testbed-dp.hop" --json >"$OUT/testbed-dp.report.json" 2>"$OUT/testbed-dp.report.txt"
  "$AGENT" trace "$OUT/testbed-dp.hop" -o "$OUT/testbed-dp.pftrace" >>"$OUT/testbed-dp.report.txt" 2>&1
  $PY examples/gpu/check_gpu_steps.py "$OUT/testbed-dp.report.json" "$OUT/testbed-dp.truth.jsonl" --tolerance-us 50 2>&1 \
    | sed 's/^/testbed-dp: /' | tee -a "$SUMMARY"
else
  note "testbed-dp: skipped (needs $AGENT, $INJ and step 7's wheels)"
fi

step "10 testbed-graphs"
# The testbed again with its CUDA graphs traced per launch (`--gpu-graphs launch`): the
# CUPTI step ends (pinned copies outside the graphs) must still match the truth, the
# kernels name the graphs. Last and optional, as step 9.
if ! want 10; then
  :
elif [ $(( DEADLINE - $(date +%s) )) -lt 100 ]; then
  note "testbed-graphs: skipped (no time left: $(( $(date +%s) - T0 )) s elapsed)"
elif [ -x "$AGENT" ] && [ -f "$INJ" ] && [ -d /tmp/tb-site ]; then
  AGENT_EXTRA="--gpu-graphs launch" testbed_under_hopscope testbed-graphs 80 45 40 "$TB_ARGS" --chains 4 --hops 2 --max-tokens 32
  "$AGENT" report "$OUT/testbed-graphs.hop" --json >"$OUT/testbed-graphs.report.json" 2>"$OUT/testbed-graphs.report.txt"
  $PY -c 'import json,sys; r=json.load(open(sys.argv[1])); print("testbed-graphs kernels:", [(k["name"][:40], k["count"]) for k in r["kernels"][:6]]); print("testbed-graphs cupti (graphs must say launch: CUPTI took GRAPH_TRACE):", [(c["graphs"], c["clock"], c["pids"]) for c in r["recording"].get("cupti", [])])' \
    "$OUT/testbed-graphs.report.json" 2>&1 | tee -a "$SUMMARY"
  # Step 7's recording (per node) against this one (per launch): a warning, one [CUDA graph] row.
  if [ -f "$OUT/testbed.hop" ]; then
    "$AGENT" diff "$OUT/testbed.hop" "$OUT/testbed-graphs.hop" >"$OUT/testbed-graphs.diff.txt" 2>&1
    grep -E "^WARNING: BEFORE traced CUDA graphs|^  \[CUDA graph\]" "$OUT/testbed-graphs.diff.txt" | cut -c1-200 | sed 's/^/testbed-graphs diff: /' | tee -a "$SUMMARY"
  fi
  $PY examples/gpu/check_gpu_steps.py "$OUT/testbed-graphs.report.json" "$OUT/testbed-graphs.truth.jsonl" --tolerance-us 50 2>&1 \
    | sed 's/^/testbed-graphs: /' | tee -a "$SUMMARY"
else
  note "testbed-graphs: skipped (needs $AGENT, $INJ and step 7's wheels)"
fi

note "total: $(( $(date +%s) - T0 )) s"
echo; echo "===== summary ($SUMMARY)"; cat "$SUMMARY"

# The device tool brings back at most 8 files of 16 MiB each, two folders down: with
# GPU_CHECK_PACK=1 everything but the summary and the log goes into results.tar.gz
# (reports, JSON, logs, CUPTI fixtures) and recordings.tar.gz (.hop, .pftrace), the
# latter split in 15 MiB parts (recordings.tar.gz.0, .1, …; `cat` them back together).
if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
  (
    cd "$OUT" || exit 1
    rm -rf .lib
    find . -type f \( -name '*.hop' -o -name '*.pftrace' \) -printf '%P\n' >.recordings.list
    tar czf recordings.tar.gz -T .recordings.list
    find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name gpu-check.log ! -name recordings.tar.gz \
      ! -name .recordings.list ! -name .results.list -printf '%P\n' >.results.list
    tar czf results.tar.gz --exclude-from=.recordings.list -T .results.list
    split -b 15m -d -a 1 recordings.tar.gz recordings.tar.gz.
    xargs -a .results.list rm -rf
    rm -f recordings.tar.gz .recordings.list .results.list
    ls -la
  ) 2>&1 | sed 's/^/pack: /'
fi
