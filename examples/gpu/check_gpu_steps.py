#!/usr/bin/env python3
"""Compare hopscope's CUPTI step ends with the torch testbed's own truth.

    python3 examples/gpu/check_gpu_steps.py REPORT.json TRUTH.jsonl [--tolerance-us 50]

REPORT.json is `hopscope report --json` of a recording of the testbed on a GPU (scripts/gpu-check.sh
step 7); TRUTH.jsonl its `--ground-truth` file. Every truth step that sampled tokens (non-empty
`outputs`) ended with the sampled ids copied into pinned host memory and an event synchronize;
`sample_end_ns` is taken right after that synchronize returned. hopscope's `gpu_steps[].end_ns` is
the return of the synchronize that waited for the step-end copy (CUPTI), on the same clock
(CLOCK_MONOTONIC). Steps with no outputs (partial prefill chunks) end with a plain stream
synchronize and no copy: hopscope cannot see their end and they are not expected.

Prints one summary line per figure and exits 0 when every expected step was found within the
tolerance and no extra GPU step appeared, 1 otherwise. Standard library only.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    r = (len(s) - 1) * p / 100.0
    lo, hi = int(r), min(int(r) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (r - lo)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("truth")
    ap.add_argument("--tolerance-us", type=float, default=50.0)
    a = ap.parse_args()
    rep = json.load(open(a.report))
    truth = [json.loads(l) for l in open(a.truth) if l.strip()]
    steps = [t for t in truth if t.get("type") == "step"]
    want = sorted(t["sample_end_ns"] for t in steps if t.get("outputs") and t.get("sample_end_ns"))
    silent = sum(1 for t in steps if not t.get("outputs"))
    if "gpu_steps" not in rep:
        print("gpu steps: FAIL the report has no gpu_steps (hopscope too old?)")
        return 1
    got = sorted(s["end_ns"] for s in rep["gpu_steps"])
    print(f"gpu steps: truth {len(steps)} steps, {len(want)} with outputs (expected), {silent} without; hopscope {len(got)}")
    if not want:
        print("gpu steps: FAIL no truth steps with outputs (was the testbed on the GPU?)")
        return 1
    # Nearest hopscope step for each truth step; each hopscope step used once.
    used: set[int] = set()
    deltas: list[float] = []
    missing = 0
    tol_ns = a.tolerance_us * 1000.0
    for t in want:
        i = bisect.bisect_left(got, t)
        best = None
        for j in (i - 1, i):
            if 0 <= j < len(got) and j not in used and (best is None or abs(got[j] - t) < abs(got[best] - t)):
                best = j
        if best is None or abs(got[best] - t) > max(tol_ns, 1e6):
            missing += 1
            continue
        used.add(best)
        deltas.append((got[best] - t) / 1000.0)
    extra = len(got) - len(used)
    absd = [abs(d) for d in deltas]
    within = sum(1 for d in absd if d <= a.tolerance_us)
    print(f"gpu steps: matched {len(deltas)}/{len(want)}, missing {missing}, extra {extra}")
    if deltas:
        print(f"gpu steps: end - truth sample_end (us): p50 {pct(deltas, 50):.1f}, p99 {pct(deltas, 99):.1f}, "
              f"min {min(deltas):.1f}, max {max(deltas):.1f}; |delta| <= {a.tolerance_us:g} us: {within}/{len(deltas)}")
    tokens = [s.get("tokens") for s in rep["gpu_steps"]]
    print(f"gpu steps: with a token count (reshape_and_cache grid): {sum(1 for x in tokens if x is not None)}/{len(tokens)}; "
          f"graph kernels in {sum(1 for s in rep['gpu_steps'] if s.get('graph_kernels'))} steps")
    ok = missing == 0 and extra == 0 and within == len(deltas)
    print(f"gpu steps: {'PASS' if ok else 'FAIL'} (every step with outputs within {a.tolerance_us:g} us, none extra)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
