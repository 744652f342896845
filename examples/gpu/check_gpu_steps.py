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
tolerance and no extra GPU step appeared, 1 otherwise. With several engines (the testbed's
`--data-parallel-size`) each engine's steps are compared with the GPU steps hopscope gave that
engine's process (`gpu_steps[].engine_pid`). Standard library only.
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


def match(want: list[int], got: list[int], tol_ns: float) -> tuple[list[float], int, int]:
    """Nearest hopscope step for each truth step, each used once: (deltas in us, missing, extra)."""
    used: set[int] = set()
    deltas: list[float] = []
    missing = 0
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
    return deltas, missing, len(got) - len(used)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("truth")
    ap.add_argument("--tolerance-us", type=float, default=50.0)
    a = ap.parse_args()
    rep = json.load(open(a.report))
    truth = [json.loads(l) for l in open(a.truth) if l.strip()]
    steps = [t for t in truth if t.get("type") == "step"]
    silent = sum(1 for t in steps if not t.get("outputs"))
    if "gpu_steps" not in rep:
        print("gpu steps: FAIL the report has no gpu_steps (hopscope too old?)")
        return 1
    # Data parallelism (--data-parallel-size): each engine's steps against the GPU steps
    # hopscope gave that engine's process (engine_start lines carry pid and engine index).
    engines = sorted({t.get("engine", 0) for t in steps})
    pid_of = {t["config"].get("engine_index", 0): t["pid"] for t in truth if t.get("type") == "engine_start"}
    n_want = sum(1 for t in steps if t.get("outputs") and t.get("sample_end_ns"))
    print(f"gpu steps: truth {len(steps)} steps on {len(engines)} engine(s), {n_want} with outputs (expected), "
          f"{silent} without; hopscope {len(rep['gpu_steps'])}")
    if not n_want:
        print("gpu steps: FAIL no truth steps with outputs (was the testbed on the GPU?)")
        return 1
    tol_ns = a.tolerance_us * 1000.0
    deltas: list[float] = []
    missing = extra = 0
    for e in engines:
        want = sorted(t["sample_end_ns"] for t in steps if t.get("engine", 0) == e and t.get("outputs") and t.get("sample_end_ns"))
        mine = rep["gpu_steps"] if len(engines) == 1 else [s for s in rep["gpu_steps"] if s.get("engine_pid") == pid_of.get(e)]
        d, m, x = match(want, sorted(s["end_ns"] for s in mine), tol_ns)
        if len(engines) > 1:
            print(f"gpu steps: engine {e} (pid {pid_of.get(e)}): truth {len(want)}, hopscope {len(mine)}, matched {len(d)}, missing {m}, extra {x}")
        deltas += d
        missing += m
        extra += x
    if len(engines) > 1:
        unowned = sum(1 for s in rep["gpu_steps"] if s.get("engine_pid") not in pid_of.values())
        extra += unowned
        print(f"gpu steps: {unowned} GPU steps of no engine")
    absd = [abs(d) for d in deltas]
    within = sum(1 for d in absd if d <= a.tolerance_us)
    print(f"gpu steps: matched {len(deltas)}/{n_want}, missing {missing}, extra {extra}")
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
