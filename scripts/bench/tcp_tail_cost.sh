#!/usr/bin/env bash
# Per-run cost of the sendto/recvfrom exit programs on SIZE-byte TCP
# transfers, with a TCP tail of TAIL bytes (docs/benchmarks.md, "TCP tail").
# usage (root, after `cargo build --release -p hopscope`): scripts/bench/tcp_tail_cost.sh TAIL SIZE
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${HOPSCOPE_BIN:-$here/../../target/release/hopscope}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sysctl -q kernel.bpf_stats_enabled=1
"$bin" run -q --nvml-period 0 --capture-tail-bytes "$1" -o "$tmp/c.hop" -- python3 "$here/tcp_tail_load.py" "$2" 2>/dev/null &
agent=$!
sleep 0.6
# The programs are gone once the run ends: keep the last listing that has them.
while kill -0 $agent 2>/dev/null; do
  bpftool prog show -j 2>/dev/null > "$tmp/p.json" || true
  if grep -q sys_exit_sendto "$tmp/p.json"; then cp "$tmp/p.json" "$tmp/progs.json"; fi
  sleep 0.1
done
python3 - "$tmp/progs.json" "$1" "$2" <<'PY'
import json, sys
for p in json.load(open(sys.argv[1])):
    n = p.get("name", "")
    if ("sendto" in n or "recvf" in n) and "exit" in n and p.get("run_cnt"):
        print(f"tail={sys.argv[2]} size={sys.argv[3]} {n} {p['run_cnt']} runs {p['run_time_ns'] / p['run_cnt']:.1f} ns/run")
PY
