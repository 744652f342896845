#!/usr/bin/env python3
"""Multi-hop agent-chain load generator for an OpenAI-compatible server (the testbed or vLLM).

N hops x M concurrent chains. A chain is an agent task: hop 1 sends a system prompt + a task
description (``--prompt-words`` words) + the first instruction; every later hop re-sends all
previous messages, the previous answer and the next instruction (plan -> write -> review ->
refactor -> test, cycling), so the prompt grows and its prefix is shared with the previous hop.

Per hop it records, on CLOCK_MONOTONIC (time.monotonic_ns(), the clock eBPF uses): send, response
headers, first chunk (role), first content chunk, every content chunk, [DONE]; the chunk id
(``chatcmpl-…``), usage (with cached tokens when the server reports them) and finish reason, as
one JSON line per hop in ``--out``. Prints a summary table. With ``--no-stream`` it asks for whole
answers (``"stream": false``, what many agent frameworks send for tool-calling steps): send,
headers and the answer's arrival only.

Knobs: ``--chains`` more than the server's ``--max-num-seqs`` creates queueing; ``--salt`` puts a
random nonce at the very start of every hop's prompt (prefix-cache misses); ``--prompt-words`` makes
long prompts; ``--traceparent`` sends a W3C traceparent (one trace id per chain, a span per hop);
``x-session-id`` is always sent (one per chain).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import random
import sys
import time
import uuid
from typing import Any, Optional

import httpx

PHASES = [
    ("plan", "Plan: break the task into small numbered steps and list the files you will touch."),
    ("write", "Write: implement the plan. Show the complete code for every file."),
    ("review", "Review: read the code you wrote and list every bug, edge case and missing test."),
    ("refactor", "Refactor: fix the problems from the review and simplify the code; show the result."),
    ("test", "Test: write unit tests for the final code and explain how to run them."),
]

WORDS = (
    "service request latency queue token cache prefix block engine scheduler batch decode prefill "
    "kernel stream socket buffer memory thread process worker client server response header chunk "
    "payload protocol message channel timeout retry backoff metric trace span parent child session "
    "agent chain hop context window budget policy eviction offload host device copy graph capture "
    "profile report timeline interval phase attribution frontend backend handler router dealer push pull"
).split()

SYSTEM = "You are a careful senior software engineer working as an autonomous coding agent."


def task_text(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(max(1, n_words))]
    return "Task: build a small tool that handles " + " ".join(words) + "."


def traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"


# The answer an agent step asks for with --json-schema-hops.
STEP_SCHEMA = {"type": "object", "properties": {"thought": {"type": "string"}, "next_step": {"type": "string"}},
               "required": ["thought", "next_step"]}


def hop_list(text: str) -> list[int]:
    """`--json-schema-hops`: `all` (an empty list) or hop numbers, comma-separated."""
    return [] if text == "all" else [int(h) for h in text.split(",") if h]


class FirstHopsSignal:
    """`--signal-file`: the file appears once every chain's first hop has its
    response headers (or has failed). The server has sent headers for a
    streamed hop only once the request is in its engine, so another client
    started with `--start-after` on it sends after these first hops are
    queued, however long either client took to start."""

    def __init__(self, path: str, chains: int) -> None:
        self.path, self.left = path, chains

    def first_hop_over(self) -> None:
        self.left -= 1
        if self.left == 0:
            with open(self.path + ".tmp", "w") as f:
                f.write(f"{time.monotonic_ns()}\n")
            os.replace(self.path + ".tmp", self.path)  # whole when it appears


def warm_up() -> None:
    """What httpx (httpcore) imports on its first request: ~90 ms, ten times
    that for a niced client on a loaded machine."""
    for module in ("anyio._backends._asyncio", "anyio.streams.tls", "anyio.to_thread"):
        try:
            importlib.import_module(module)
        except ImportError:  # another httpcore backend: it pays on its first request
            pass


async def wait_for_file(path: str, timeout_s: float) -> None:
    """`--start-after`: poll for another client's signal file."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"chain_client: {path} did not appear within {timeout_s:.0f} s "
                             "(is the client started with --signal-file on it running?)")
        await asyncio.sleep(0.005)


async def run_hop(client: httpx.AsyncClient, args, chain: int, hop: int, phase: str, messages: list,
                  session_id: str, trace_id: Optional[str], previous_id: Optional[str] = None) -> dict[str, Any]:
    headers = {"x-session-id": session_id} if args.session_header else {}
    if args.connection_per_hop:
        headers["Connection"] = "close"  # the next hop opens a new connection
    if trace_id is not None:
        headers["traceparent"] = traceparent(trace_id)
    if args.request_id_prefix:
        headers["X-Request-Id"] = f"{args.request_id_prefix}-c{chain}-h{hop}-{uuid.uuid4().hex[:8]}"
    # Members in openai-python 1.x's order (`messages` first, then `model` and
    # the parameters): behind a long prompt a tracer finds the model only in
    # the body's last bytes, as it must for agents built on that SDK.
    responses = args.api == "responses"
    messages_api = args.api == "messages"
    if messages_api:
        # The Anthropic SDK's `messages.create` order: max_tokens, messages, model, …, system
        # (Claude Code's and Anthropic SDK agents' requests to vLLM's /v1/messages).
        headers["anthropic-version"] = "2023-06-01"
        body: dict[str, Any] = {"max_tokens": args.max_tokens, "messages": messages[1:], "model": args.model,
                                "system": messages[0]["content"]}
    elif responses:
        # `responses.create`'s order: input, instructions, max_output_tokens, model, …
        body: dict[str, Any] = {"input": messages[1:], "instructions": messages[0]["content"],
                                "max_output_tokens": args.max_tokens, "model": args.model}
        if previous_id is not None:
            # The turn before is the server's to remember: only the new message goes.
            body["input"] = messages[-1:]
            body["previous_response_id"] = previous_id
    else:
        body = {"messages": messages, "model": args.model, "max_tokens": args.max_tokens}
    structured = args.json_schema_hops is not None and (not args.json_schema_hops or hop in args.json_schema_hops)
    if structured and not responses and not messages_api:
        # An agent step that wants a machine-readable answer: the server holds
        # the output to this schema (vLLM compiles a grammar for it first).
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "step", "schema": STEP_SCHEMA}}
    if args.seed is not None:
        body["seed"] = args.seed
    if args.priority is not None:
        # vLLM's extra body parameter, used under --scheduling-policy priority.
        body["priority"] = args.priority
    if args.stop:
        # Stop strings: vLLM's detokenizer holds back the last len(longest)-1
        # characters of the text while streaming, in case one is starting.
        body["stop_sequences" if messages_api else "stop"] = args.stop
    body["stream"] = args.stream
    if args.stream and args.usage and not responses and not messages_api:
        body["stream_options"] = {"include_usage": True}
    body["temperature"] = args.temperature
    if structured and responses:
        # The Responses API's form (the OpenAI Agents SDK's `output_type`):
        # the schema under `text.format`, after `temperature` as the SDK sends it.
        body["text"] = {"format": {"type": "json_schema", "name": "step", "schema": STEP_SCHEMA, "strict": True}}
    if responses or messages_api:
        kind = args.api if args.stream else f"{args.api}_whole"
    else:
        kind = "stream" if args.stream and args.usage else "stream_no_usage" if args.stream else "whole"
    rec: dict[str, Any] = {
        "kind": kind, "chain": chain, "hop": hop, "phase": phase, "session_id": session_id, "session_header": args.session_header,
        "previous_response_id": previous_id, "structured_output": "json" if structured else None,
        "priority": args.priority,
        "traceparent": headers.get("traceparent"), "x_request_id": headers.get("X-Request-Id"),
        "prompt_chars": sum(len(m["content"]) for m in messages),
        "send_ns": None, "headers_ns": None, "first_chunk_ns": None, "first_content_ns": None,
        "chunk_ns": [], "done_ns": None, "id": None, "usage": None, "finish_reason": None,
        "content_chunks": 0, "error": None, "stop": args.stop,
        # Chat chunks after the role's with empty content before the first content: outputs
        # whose text the server held back (vLLM's detokenizer, for stop strings).
        "empty_chunks_before_content": 0,
    }
    text_parts: list[str] = []

    signal = args.first_hops_signal if hop == 1 else None

    async def exchange() -> None:
        nonlocal signal
        path = {"responses": "/v1/responses", "messages": "/v1/messages"}.get(args.api, "/v1/chat/completions")
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            rec["headers_ns"] = time.monotonic_ns()
            if signal is not None:
                signal, s = None, signal
                s.first_hop_over()
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                rec["error"] = (await resp.aread()).decode(errors="replace")[:500]
                rec["done_ns"] = time.monotonic_ns()
                return
            if args.stream:
                await read_events(resp, rec, args.api, text_parts)
            else:
                whole = json.loads(await resp.aread())
                rec["done_ns"] = time.monotonic_ns()
                answer(rec, whole, args.api, text_parts)

    try:
        rec["send_ns"] = time.monotonic_ns()
        if args.deadline_ms:
            # An agent's step deadline: the hop is abandoned (its connection
            # closed) whatever has arrived by then.
            await asyncio.wait_for(exchange(), args.deadline_ms / 1000.0)
        else:
            await exchange()
        if rec["done_ns"] is None:
            rec["done_ns"] = time.monotonic_ns()
    except Exception as e:  # keep going: a failed hop is data
        rec["error"] = repr(e)
        rec["done_ns"] = time.monotonic_ns()
    if signal is not None:  # failed before its headers: no one waits for it in vain
        signal.first_hop_over()
    rec["text"] = "".join(text_parts)
    s, f, d = rec["send_ns"], rec["first_content_ns"], rec["done_ns"]
    rec["ttft_ms"] = (f - s) / 1e6 if f and s else None
    gaps = [(b - a) / 1e6 for a, b in zip(rec["chunk_ns"], rec["chunk_ns"][1:])]
    rec["avg_itl_ms"] = sum(gaps) / len(gaps) if gaps else None
    rec["total_ms"] = (d - s) / 1e6 if d and s else None
    usage = rec["usage"] or {}
    rec["completion_tokens"] = usage.get("completion_tokens", rec["content_chunks"])
    rec["prompt_tokens"] = usage.get("prompt_tokens")
    rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return rec


async def read_events(resp: httpx.Response, rec: dict[str, Any], api: str, text_parts: list[str]) -> None:
    """A streamed answer's events into the hop's record, each stamped when its line arrived."""
    async for line in resp.aiter_lines():
        t = time.monotonic_ns()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            rec["done_ns"] = t
            return
        ev = json.loads(data)
        if rec["first_chunk_ns"] is None:
            rec["first_chunk_ns"] = t
        if api == "responses":
            responses_event(rec, ev, t, text_parts)
            continue
        if api == "messages":
            messages_event(rec, ev, t, text_parts)
            continue
        rec["id"] = ev.get("id", rec["id"])
        if ev.get("usage"):
            rec["usage"] = ev["usage"]
        for ch in ev.get("choices") or []:
            delta = ch.get("delta") or {}
            content = delta.get("content")
            if content == "" and "role" not in delta and rec["first_content_ns"] is None and not ch.get("finish_reason"):
                rec["empty_chunks_before_content"] += 1
            if content:
                if rec["first_content_ns"] is None:
                    rec["first_content_ns"] = t
                rec["chunk_ns"].append(t)
                rec["content_chunks"] += 1
                text_parts.append(content)
            if ch.get("finish_reason"):
                rec["finish_reason"] = ch["finish_reason"]


def answer(rec: dict[str, Any], body: dict[str, Any], api: str, text_parts: list[str]) -> None:
    """A non-streamed answer into the hop's record: its id, text, usage and finish reason (no
    chunk times: the whole answer arrives at once)."""
    rec["id"] = body.get("id")
    if api == "messages":
        for block in body.get("content") or []:
            if block.get("type") == "text":
                text_parts.append(block.get("text", ""))
        messages_event(rec, {"type": "message_delta", "delta": {"stop_reason": body.get("stop_reason")},
                             "usage": body.get("usage")}, rec["done_ns"], [])
        return
    if api == "responses":
        for item in body.get("output") or []:
            for part in item.get("content") or []:
                if part.get("type") == "output_text":
                    text_parts.append(part.get("text", ""))
        responses_event(rec, {"type": "response.completed", "response": body}, rec["done_ns"], [])
        return
    rec["usage"] = body.get("usage")
    for ch in body.get("choices") or []:
        text_parts.append((ch.get("message") or {}).get("content") or "")
        rec["finish_reason"] = ch.get("finish_reason")


def responses_event(rec: dict[str, Any], ev: dict[str, Any], t: int, text_parts: list[str]) -> None:
    """One Responses API event into the hop's record, in chat's terms: the response's id, text
    deltas as content chunks, the completed response's usage (input/output tokens) and status
    (completed: stop; incomplete for max_output_tokens: length)."""
    kind = ev.get("type", "")
    response = ev.get("response") or {}
    if kind == "response.created":
        rec["id"] = response.get("id")
    elif kind == "response.output_text.delta" and ev.get("delta"):
        if rec["first_content_ns"] is None:
            rec["first_content_ns"] = t
        rec["chunk_ns"].append(t)
        rec["content_chunks"] += 1
        text_parts.append(ev["delta"])
    elif kind in ("response.completed", "response.incomplete"):
        u = response.get("usage") or {}
        rec["usage"] = {"prompt_tokens": u.get("input_tokens"), "completion_tokens": u.get("output_tokens"),
                        "prompt_tokens_details": u.get("input_tokens_details")}
        rec["finish_reason"] = "stop" if response.get("status") == "completed" else "length"
        rec["done_ns"] = t


# The Anthropic Messages API's stop reasons in chat's words.
STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def messages_event(rec: dict[str, Any], ev: dict[str, Any], t: int, text_parts: list[str]) -> None:
    """One Anthropic Messages API event into the hop's record, in chat's terms: the message's id,
    text deltas as content chunks, the usage (its input_tokens leave the cached prompt tokens out:
    the prompt is their sum) and stop reason of message_delta, the end at message_stop."""
    kind = ev.get("type", "")
    if kind == "message_start":
        rec["id"] = (ev.get("message") or {}).get("id")
    elif kind == "content_block_delta" and (ev.get("delta") or {}).get("text"):
        if rec["first_content_ns"] is None:
            rec["first_content_ns"] = t
        rec["chunk_ns"].append(t)
        rec["content_chunks"] += 1
        text_parts.append(ev["delta"]["text"])
    elif kind == "message_delta":
        u = ev.get("usage") or {}
        read = u.get("cache_read_input_tokens")
        prompt = (u.get("input_tokens") or 0) + (read or 0) + (u.get("cache_creation_input_tokens") or 0)
        rec["usage"] = {"prompt_tokens": prompt, "completion_tokens": u.get("output_tokens"),
                        "prompt_tokens_details": {"cached_tokens": read} if read is not None else None}
        reason = (ev.get("delta") or {}).get("stop_reason")
        rec["finish_reason"] = STOP_REASONS.get(reason, reason)
    elif kind == "message_stop":
        rec["done_ns"] = t


async def run_chain(client: httpx.AsyncClient, args, chain: int, out_f) -> list[dict]:
    rng = random.Random(args.task_seed + (0 if args.shared_task else chain))
    session_id = f"chain-{chain}-{uuid.uuid4().hex[:8]}"
    trace_id = uuid.uuid4().hex if args.traceparent else None
    task = task_text(rng, args.prompt_words)
    system = SYSTEM
    if args.system_words:  # an agent's long system prompt (the Responses API's `instructions`)
        system += " Rules: " + " ".join(rng.choice(WORDS) for _ in range(args.system_words)) + "."
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    results = []
    if args.stagger_ms or args.delay_ms:
        await asyncio.sleep((args.delay_ms + chain * args.stagger_ms) / 1000.0)
    for hop in range(1, args.hops + 1):
        phase, instruction = PHASES[(hop - 1) % len(PHASES)]
        user = (task + "\n\n" + instruction) if hop == 1 else instruction
        messages.append({"role": "user", "content": user})
        send_msgs = messages
        if args.salt:  # a fresh nonce at the very start: nothing of this prompt is in the prefix cache
            send_msgs = [{"role": "system", "content": f"[nonce {uuid.uuid4().hex}] " + system}] + messages[1:]
        previous_id = results[-1]["id"] if args.previous_response and results else None
        rec = await run_hop(client, args, chain, hop, phase, send_msgs, session_id, trace_id, previous_id)
        results.append(rec)
        if out_f is not None:
            out_f.write(json.dumps(rec) + "\n")
            out_f.flush()
        messages.append({"role": "assistant", "content": rec.get("text", "")})
        if args.think_ms:
            await asyncio.sleep(args.think_ms / 1000.0)
    return results


def fmt(v: Optional[float]) -> str:
    return f"{v:9.1f}" if v is not None else "        -"


def print_table(results: list[dict], file=sys.stdout) -> None:
    print(f"{'chain':>5} {'hop':>3} {'phase':<8} {'TTFT ms':>9} {'ITL ms':>9} {'total ms':>9} "
          f"{'tokens':>6} {'prompt':>6} {'cached':>6}  id", file=file)
    for r in sorted(results, key=lambda r: (r["chain"], r["hop"])):
        print(f"{r['chain']:>5} {r['hop']:>3} {r['phase']:<8} {fmt(r['ttft_ms'])} {fmt(r['avg_itl_ms'])} "
              f"{fmt(r['total_ms'])} {r['completion_tokens'] or 0:>6} {r['prompt_tokens'] or 0:>6} "
              f"{r['cached_tokens'] if r['cached_tokens'] is not None else '-':>6}  {r['id'] or r['error']}",
              file=file)


async def amain(args) -> list[dict]:
    out_f = open(args.out, "a" if args.append else "w") if args.out else None
    limits = httpx.Limits(max_connections=max(10, args.chains * 2), max_keepalive_connections=max(10, args.chains))
    args.first_hops_signal = FirstHopsSignal(args.signal_file, args.chains) if args.signal_file else None
    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(args.timeout),
                                     limits=limits) as client:
            if args.start_after:
                # Ready to send when the file appears: the client built, and
                # what httpx imports on its first request imported.
                warm_up()
                await wait_for_file(args.start_after, 60.0)
                t0 = time.monotonic()
            chains = await asyncio.gather(*[run_chain(client, args, c, out_f) for c in range(args.chains)])
    finally:
        if out_f is not None:
            out_f.close()
    results = [r for ch in chains for r in ch]
    if not args.quiet:
        print_table(results)
        errors = sum(1 for r in results if r["error"])
        print(f"{len(results)} hops in {time.monotonic() - t0:.2f} s, {errors} errors")
    return results


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="hopscope-testbed")
    p.add_argument("--chains", type=int, default=1, help="concurrent chains (M)")
    p.add_argument("--hops", type=int, default=5, help="hops per chain (N)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--api", choices=["chat", "responses", "messages"], default="chat",
                   help="/v1/chat/completions, the Responses API (/v1/responses: the OpenAI Agents SDK's), or "
                        "the Anthropic Messages API (/v1/messages: Claude Code's and Anthropic SDK agents')")
    p.add_argument("--prompt-words", type=int, default=120, help="words in the hop-1 task description")
    p.add_argument("--system-words", type=int, default=0, help="words added to the system prompt")
    p.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="a stop string sent with every hop (repeatable; not on the Responses API)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed sent to the server")
    p.add_argument("--task-seed", type=int, default=1, help="seed for the generated task text")
    p.add_argument("--shared-task", action="store_true", help="all chains get the same task text")
    p.add_argument("--salt", action="store_true", help="random nonce at the start of every prompt")
    p.add_argument("--traceparent", action="store_true", help="send a W3C traceparent per hop")
    p.add_argument("--request-id-prefix", default=None, help="send X-Request-Id: PREFIX-c<chain>-h<hop>-<hex>")
    p.add_argument("--stagger-ms", type=float, default=0.0, help="delay chain i's start by i*STAGGER")
    p.add_argument("--think-ms", type=float, default=0.0, help="pause between hops")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="ask for whole answers (\"stream\": false): no chunk times, the answer at once")
    p.add_argument("--no-usage", dest="usage", action="store_false",
                   help="stream without stream_options.include_usage (the OpenAI SDK's default): no usage chunk")
    p.add_argument("--previous-response", action="store_true",
                   help="with --api responses: each later hop sends only its new message and the previous hop's "
                        "id as previous_response_id (the server keeps the conversation)")
    p.add_argument("--no-session-header", dest="session_header", action="store_false",
                   help="send no x-session-id header (a chain is then known by traceparent, "
                        "previous_response_id or the connection)")
    p.add_argument("--connection-per-hop", action="store_true",
                   help="close the connection after each hop (Connection: close): every hop on a new one")
    p.add_argument("--json-schema-hops", type=hop_list, default=None, metavar="all|H,H,...",
                   help="these hops ask for a JSON answer (chat: response_format json_schema; "
                        "responses: text.format json_schema)")
    p.add_argument("--priority", type=int, default=None,
                   help="send this request priority (vLLM's extra body field; lower goes first under the "
                        "server's --scheduling-policy priority)")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="wait this long before the first chain starts (after --start-after's file)")
    p.add_argument("--signal-file", default=None, metavar="FILE",
                   help="create FILE once every chain's first hop has its response headers (a streamed hop is "
                        "then in the server's engine)")
    p.add_argument("--start-after", default=None, metavar="FILE",
                   help="start only once FILE exists (another client's --signal-file; up to 60 s): orders two "
                        "clients' first hops whatever their start-up times")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds without a byte before a hop is abandoned")
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="abandon a hop this long after sending it, even mid-stream (an agent's step deadline)")
    p.add_argument("--out", default=None, help="JSONL output, one line per hop")
    p.add_argument("--append", action="store_true")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv=None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.api == "messages" and args.json_schema_hops is not None:
        parser.error("--json-schema-hops is for --api chat or responses")
    if args.api != "responses" and args.previous_response:
        parser.error("--previous-response needs --api responses")
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
