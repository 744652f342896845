#!/usr/bin/env python3
"""Check a testbed ground-truth file (``--ground-truth``) for self-consistency and summarise it.

    python examples/check_truth.py TRUTH.jsonl [--client CLIENT.jsonl] [--json]

Checks: steps ordered and non-overlapping; step tokens = sum of member tokens; every finished
request's marks ordered (engine_arrive <= queued <= scheduled <= first_token <= finished); the
tokens each request computed = the sum of its step memberships; HTTP marks ordered and interleaved
with the engine's on the same clock (http_arrive <= submit <= engine_arrive, first_token <=
first_sse_write <= done); with a chain-client file, client send <= http_arrive and the server's
writes precede the client's reads. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check(truth: list[dict], client: list[dict] | None = None) -> tuple[list[str], dict]:
    errs: list[str] = []
    steps = sorted((r for r in truth if r["type"] == "step"), key=lambda r: r["step"])
    reqs = [r for r in truth if r["type"] == "request"]
    https = {r["id"]: r for r in truth if r["type"] == "http" and r.get("id")}
    for a, b in zip(steps, steps[1:]):
        if not (a["start_ns"] < a["end_ns"] <= b["start_ns"]):
            errs.append(f"steps {a['step']} and {b['step']} overlap or are unordered")
    per_req: dict[str, int] = {}
    for s in steps:
        if s["num_tokens"] != sum(m["tokens"] for m in s["members"]):
            errs.append(f"step {s['step']}: num_tokens != sum(member tokens)")
        for m in s["members"]:
            per_req[m["req"]] = per_req.get(m["req"], 0) + m["tokens"]
        for c in s.get("kv_copies", []):
            if not (s["start_ns"] <= c["start_ns"] <= c["end_ns"] <= s["end_ns"]):
                errs.append(f"step {s['step']}: kv copy outside the step")
    by_ext = {}
    for r in reqs:
        by_ext[r["external_id"]] = r
        if r["finish_reason"] == "abort":
            continue
        marks = [r["engine_arrive_ns"], r["queued_ns"], r["scheduled_ns"], r["first_token_ns"], r["finished_ns"]]
        if None in marks or marks != sorted(marks):
            errs.append(f"{r['req']}: engine marks out of order {marks}")
        if per_req.get(r["req"], 0) != r["computed_tokens"]:
            errs.append(f"{r['req']}: computed_tokens {r['computed_tokens']} != steps {per_req.get(r['req'], 0)}")
    for hid, h in https.items():
        ext = (h.get("external_ids") or [hid])[0]
        r = by_ext.get(ext)
        if r is None or r["finish_reason"] == "abort" or not h.get("submit_ns"):
            continue
        if not (h["http_arrive_ns"] <= h["submit_ns"] <= r["engine_arrive_ns"]):
            errs.append(f"{hid}: http_arrive <= submit <= engine_arrive violated")
        if h.get("first_sse_write_ns") and not (r["first_token_ns"] <= h["first_sse_write_ns"] <= h["done_ns"]):
            errs.append(f"{hid}: first_token <= first_sse_write <= done violated")
    for c in client or []:
        h = https.get(c.get("id"))
        if h is None:
            continue
        if not (c["send_ns"] <= h["http_arrive_ns"]):
            errs.append(f"{c['id']}: client send after server arrival")
        if h.get("first_sse_write_ns") and c.get("first_content_ns") and h["first_sse_write_ns"] > c["first_content_ns"]:
            errs.append(f"{c['id']}: server first write after client first content")
    durs = [(s["end_ns"] - s["start_ns"]) / 1e6 for s in steps]
    decode_only = [(s["end_ns"] - s["start_ns"]) / 1e6 for s in steps if all(m["kind"] == "decode" for m in s["members"])]
    summary = {
        "steps": len(steps),
        "requests": len(reqs),
        "http": len(https),
        "step_ms_median": round(statistics.median(durs), 3) if durs else None,
        "decode_step_ms_median": round(statistics.median(decode_only), 3) if decode_only else None,
        "preempted_requests": sum(1 for r in reqs if r["preempted_ns"]),
        "kv_copies": sum(len(s.get("kv_copies", [])) for s in steps),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in reqs),
        "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
        "devices": sorted({s.get("device", "?") for s in steps}),
        "errors": len(errs),
    }
    return errs, summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("truth")
    p.add_argument("--client", default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    errs, summary = check(load(a.truth), load(a.client) if a.client else None)
    if a.json:
        print(json.dumps({"summary": summary, "errors": errs[:50]}))
    else:
        for e in errs[:50]:
            print("FAIL", e)
        print(json.dumps(summary))
    sys.exit(1 if errs else 0)


if __name__ == "__main__":
    main()
