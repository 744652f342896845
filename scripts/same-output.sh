#!/bin/bash
# Checks that two hopscope binaries give the same outputs: `report --json`,
# `report` (text) and `trace --no-compress`, compared by md5, on every .hop
# given (files, or directories searched for *.hop under 20 MB). For speed
# work: build the old binary, copy it aside, change things, run this.
#   scripts/same-output.sh OLD_BIN NEW_BIN target/bench/synthetic-20000-g1.hop agent/tests/fixtures target/itest
set -u
[ $# -ge 3 ] || { echo "usage: $0 OLD_BIN NEW_BIN HOP_OR_DIR..." >&2; exit 2; }
old=$1 new=$2; shift 2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
files=$(for a in "$@"; do if [ -d "$a" ]; then find "$a" -name '*.hop' -size -20M; else echo "$a"; fi; done | sort)
n=0 bad=0
for f in $files; do
  n=$((n + 1))
  for mode in json text trace; do
    for b in old new; do
      bin=$old; [ $b = new ] && bin=$new
      case $mode in
        json) "$bin" report --json "$f" > "$tmp/$b" 2>/dev/null ;;
        text) "$bin" report "$f" > "$tmp/$b" 2>/dev/null ;;
        trace) rm -f "$tmp/$b"; "$bin" trace "$f" -o "$tmp/$b" --no-compress > /dev/null 2>&1; touch "$tmp/$b" ;;
      esac
    done
    if ! cmp -s "$tmp/old" "$tmp/new"; then echo "differs: $mode $f"; bad=$((bad + 1)); fi
  done
done
echo "same-output: $n recordings x 3 outputs, $bad differ"
[ $bad -eq 0 ]
