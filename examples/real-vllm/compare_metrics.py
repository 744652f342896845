#!/usr/bin/env python3
"""hopscope's report beside vLLM's own metrics for the same requests: the sums of vLLM's
per-request histograms (scraped from /metrics after the run) and of hopscope's figures for the
requests vLLM counted (those joined to an engine request). What each side measures:

  vLLM (engine timestamps; frontend ones for TTFT/E2E)     hopscope (syscalls; docs/attribution.md)
  request_queue_time    QUEUED -> SCHEDULED                queue: hand-over to the engine -> SCHEDULED
                                                           scheduler_queue: QUEUED -> SCHEDULED (engine stamps)
  request_prefill_time  SCHEDULED -> first token           prefill: SCHEDULED -> end of first-token step
  request_decode_time   first token -> last token          decode: first content write -> last byte
                                                           engine_decode: first token -> last output (step ends)
  request_inference_time  SCHEDULED -> last token          inference: prefill + engine_decode
  request_time_per_output_token  decode / (tokens - 1)     tpot: engine_decode / (completion_tokens - 1)
  time_to_first_token   arrival_time -> first token out    ttft: request read -> first content write
  e2e_request_latency   arrival_time -> finished           e2e: request read -> last byte written

and vLLM's token counters beside the sums of the same requests' token counts (equal when every
request vLLM served was recorded): prompt tokens, prompt tokens served from the prefix cache,
generated tokens, prompt tokens computed (the sum of vLLM's request_prefill_kv_computed_tokens:
prompt less cached), preemptions.

    compare_metrics.py REPORT.json VLLM_METRICS.txt [--json]

--json prints the rows as a list: timing rows {metric, vllm_n, vllm_ms, hopscope, n, ms}, token
rows {metric, vllm_tokens, hopscope, tokens}.
"""
import json
import sys

from prometheus_client.parser import text_string_to_metric_families


def engine_decode(q):
    """The engine's first output -> last output (ms): E2E less the phases up to the first token and
    the last output's path (`last_output_ms`), what vLLM's request_decode_time times."""
    p = q["phases_ms"]
    if q.get("last_output_ms") is None or q["e2e_ms"] is None or p["prefill"] is None:
        return None
    before = sum(p[k] or 0.0 for k in ("frontend", "queue", "prefill", "kv_transfer"))
    return q["e2e_ms"] - before - q["last_output_ms"]


def inference(q):
    """SCHEDULED -> the last output (ms): prefill and the engine's decode (vLLM's
    request_inference_time; a KV transfer carved out of the prefill is left out of it)."""
    d = engine_decode(q)
    return None if d is None else q["phases_ms"]["prefill"] + d


def tpot(q):
    """The engine's decode per output token after the first (ms), 0 for one token: vLLM's
    request_time_per_output_token."""
    d, n = engine_decode(q), q["completion_tokens"]
    if d is None or n is None:
        return None
    return d / (n - 1) if n > 1 else 0.0


PAIRS = [
    ("request_queue_time_seconds", "queue", lambda q: q["phases_ms"]["queue"]),
    # The scheduler's part of the queue, from the same engine stamps as vLLM's.
    ("request_queue_time_seconds", "scheduler_queue", lambda q: q.get("scheduler_queue_ms")),
    ("request_prefill_time_seconds", "prefill", lambda q: q["phases_ms"]["prefill"]),
    ("request_decode_time_seconds", "decode", lambda q: q["phases_ms"]["decode"]),
    # The engine's first -> last output: decode without the last output's path, with the first's.
    ("request_decode_time_seconds", "engine_decode", engine_decode),
    ("request_inference_time_seconds", "inference", inference),
    ("request_time_per_output_token_seconds", "tpot", tpot),
    ("time_to_first_token_seconds", "ttft", lambda q: q["ttft_ms"]),
    ("e2e_request_latency_seconds", "e2e", lambda q: q["e2e_ms"]),
]

# vLLM's counters (summed over engines), or a histogram's sum, and the report's per-request counts.
TOKENS = [
    ("prompt_tokens_total", "prompt_tokens", lambda q: q["prompt_tokens"]),
    ("prompt_tokens_cached_total", "cached_tokens", lambda q: q["cached_tokens"]),
    ("generation_tokens_total", "completion_tokens", lambda q: q["completion_tokens"]),
    ("request_prefill_kv_computed_tokens", "computed_tokens",
     lambda q: None if q["prompt_tokens"] is None else q["prompt_tokens"] - (q["cached_tokens"] or 0)),
    ("num_preemptions_total", "preemptions", lambda q: q["preemptions"]),
]


def main() -> int:
    report = json.load(open(sys.argv[1]))
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    totals: dict[str, float] = {}
    for fam in text_string_to_metric_families(open(sys.argv[2]).read()):
        for s in fam.samples:
            if s.name.endswith("_total"):
                totals[s.name] = totals.get(s.name, 0.0) + s.value
            if s.name.endswith("_sum"):
                sums[s.name[:-4]] = sums.get(s.name[:-4], 0.0) + s.value
            elif s.name.endswith("_count"):
                counts[s.name[:-6]] = counts.get(s.name[:-6], 0.0) + s.value
    joined = [q for q in report["requests"] if q["phase_source"] == "ipc" and q["e2e_ms"] is not None]
    rows = []
    for metric, name, get in PAIRS:
        key = f"vllm:{metric}"
        ours = [get(q) for q in joined if get(q) is not None]
        rows.append({
            "metric": key,
            "vllm_n": int(counts[key]) if key in counts else None,
            "vllm_ms": sums[key] * 1e3 if key in sums else None,
            "hopscope": name,
            "n": len(ours),
            "ms": sum(ours),
        })
    for metric, name, get in TOKENS:
        key = f"vllm:{metric}"
        vllm = totals.get(key, sums.get(key))
        rows.append({
            "metric": key,
            "vllm_tokens": int(vllm) if vllm is not None else None,
            "hopscope": name,
            "tokens": sum(get(q) or 0 for q in joined),
        })
    if "--json" in sys.argv[3:]:
        print(json.dumps(rows))
        return 0
    print(f"{'vLLM metric':42} {'n':>3} {'vLLM sum ms':>12}   {'hopscope':15} {'n':>3} {'sum ms':>10} {'diff ms':>9}")
    for r in rows:
        if r.get("vllm_ms", r.get("vllm_tokens")) is None:
            print(f"{r['metric']:42} absent")
            continue
        if "tokens" in r:
            print(f"{r['metric']:42}     {r['vllm_tokens']:>12}   {r['hopscope']:15} {r['tokens']:>14} {r['tokens'] - r['vllm_tokens']:9}")
            continue
        print(f"{r['metric']:42} {r['vllm_n']:>3} {r['vllm_ms']:12.3f}   {r['hopscope']:15} {r['n']:>3} {r['ms']:10.3f} {r['ms'] - r['vllm_ms']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
