"""End-to-end tests against a real testbed (API server + EngineCore processes, real ipc:// sockets,
a byte-capturing relay between them).

The emulated engine-IPC layout is **vLLM 0.33.0** (EngineCoreRequest 22 fields, EngineCoreOutputs 9,
EngineCoreOutput 19); the genuine 0.33.0 bytes in shared/fixtures/vllm-0.33.0 are the reference.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import msgspec
import pytest
from openai import OpenAI

from helpers import FIXTURES, FIXTURES_034, Testbed, parse_zmtp, ready_properties, run_chains
from testbed.protocol import PrefixCacheStats, SchedulerStats
from testbed.truth import read_truth

MODEL = "hopscope-testbed"


@pytest.fixture(scope="module")
def tb(tmp_path_factory):
    t = Testbed("--max-num-seqs", "8", relay=True, workdir=str(tmp_path_factory.mktemp("tb"))).start()
    yield t
    rc = t.stop()
    assert rc == 0, open(t.log_path).read()


@pytest.fixture(scope="module")
def oai(tb):
    return OpenAI(base_url=tb.base_url + "/v1", api_key="EMPTY", max_retries=0)


def wait_truth(tb, pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        recs = read_truth(tb.truth_path)
        if pred(recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.05)


# ------------------------------------------------------------- OpenAI client

def test_models_and_health(tb, oai):
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert httpx.get(tb.base_url + "/health").status_code == 200


def test_openai_chat_streaming(oai):
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream test: say something"}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content and content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 12
    assert usage.prompt_tokens > 0 and usage.prompt_tokens_details.cached_tokens >= 0
    assert len("".join(c.choices[0].delta.content for c in content).encode()) == 12


def test_openai_chat_non_streaming_with_x_request_id(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "plain"}],
                                    max_tokens=7, temperature=0, extra_headers={"X-Request-Id": "my-req-42"})
    assert r.id == "chatcmpl-my-req-42"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    assert len(r.choices[0].message.content) == 7 and r.choices[0].message.role == "assistant"


def test_openai_completions(oai):
    r = oai.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=5, temperature=0)
    assert r.id.startswith("cmpl-") and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    chunks = list(oai.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=5, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text  # greedy: same tokens
    assert chunks[-1].usage.completion_tokens == 5
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_openai_responses_api_streaming_and_not(tb, oai):
    """/v1/responses as the OpenAI SDK reads it (its typed events validate the shapes): the
    response runs as engine request ``<id>_0``, text deltas add up to the non-streamed answer,
    usage and status as vLLM gives them."""
    kw = dict(model=MODEL, instructions="You are terse.", input="responses test: say something",
              max_output_tokens=9, temperature=0)
    whole = oai.responses.create(**kw)
    assert whole.id.startswith("resp_") and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens" and whole.usage.output_tokens == 9
    events = list(oai.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    # vLLM ends every stream with response.completed, its status saying whether it was cut.
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text  # greedy: same tokens
    done = events[-1].response
    assert done.id == events[0].response.id and done.status == "incomplete"
    assert done.usage.output_tokens == 9 and done.usage.input_tokens > 0
    assert done.instructions == "You are terse." and done.model == MODEL
    recs = wait_truth(tb, lambda rs: any(r.get("external_id") == done.id + "_0" for r in rs))
    eng = [r for r in recs if r["type"] == "request" and r.get("external_id") == done.id + "_0"]
    assert len(eng) == 1 and eng[0]["req"].startswith(done.id + "_0-"), eng


def test_responses_text_format_asks_for_structured_output_as_vllm_makes_it(tb, oai):
    """The Responses API's constraint is its ``text.format`` (the Agents SDK's ``output_type``):
    the engine request carries it as the chat API's ``response_format`` would; a Responses body's
    ``response_format`` is no field of that API (none); ``structured_outputs`` beside
    ``text.format`` is refused, as vLLM refuses it."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    kw = dict(model=MODEL, input="responses json test", max_output_tokens=6, temperature=0)
    json_id = oai.responses.create(**kw, text=fmt).id
    obj_id = oai.responses.create(**kw, text={"format": {"type": "json_object"}}).id
    plain_id = oai.responses.create(**kw, extra_body={"response_format": {"type": "json_object"}}).id
    refused = httpx.post(tb.base_url + "/v1/responses", timeout=30,
                         json={**kw, "text": fmt, "structured_outputs": {"json": schema}})
    assert refused.status_code == 400 and "text.format" in refused.text, refused.text
    ids = {json_id + "_0": "json", obj_id + "_0": "json_object", plain_id + "_0": None}
    recs = wait_truth(tb, lambda rs: set(ids) <= {r.get("external_id") for r in rs if r["type"] == "request"})
    got = {r["external_id"]: r.get("structured_output") for r in recs if r["type"] == "request" and r.get("external_id") in ids}
    assert got == ids, got


def test_sse_bytes_and_event_framing(tb):
    """Raw SSE: every event is `data: <json>\\n\\n`, [DONE] last."""
    with httpx.stream("POST", tb.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "raw"}], "max_tokens": 4,
        "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-2]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 4
    assert all(o["object"] == "chat.completion.chunk" for o in objs)


# ------------------------------------------------------------------- wire

def _types(v):
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _assert_same_shape(ours, ref, path="$"):
    """Same array lengths, same element types per position, recursively (maps: same keys)."""
    assert _types(ours) == _types(ref), f"{path}: {_types(ours)} != {_types(ref)} ({ours!r} vs {ref!r})"
    if isinstance(ref, list) and ref and not all(isinstance(x, int) for x in ref):
        assert len(ours) == len(ref), f"{path}: length {len(ours)} != {len(ref)}"
        for i, (a, b) in enumerate(zip(ours, ref)):
            _assert_same_shape(a, b, f"{path}[{i}]")
    elif isinstance(ref, list):
        assert all(isinstance(x, int) for x in ours), f"{path}: not an int array"
    elif isinstance(ref, dict):
        assert set(ours) == set(ref), f"{path}: keys {sorted(ours)} != {sorted(ref)}"
        for k in ref:
            _assert_same_shape(ours[k], ref[k], f"{path}.{k}")


@pytest.mark.skipif(not FIXTURES.exists(), reason="vLLM 0.33.0 fixtures not found")
def test_ipc_bytes_side_by_side_with_vllm_0_33_0(tb):
    """The testbed's ZeroMQ bytes, captured by a relay on the Unix socket, against the genuine
    vLLM 0.33.0 bytes: same framing (greeting, READY, frame flags/size forms), same array lengths,
    same positions, same element types."""
    xid = "wire-" + "x" * 90  # long ids make a multi-output step frame > 255 bytes (8-byte size form)

    def one(i):
        return httpx.post(tb.base_url + "/v1/chat/completions", headers={"X-Request-Id": f"{xid}-{i}"}, json={
            "model": MODEL, "messages": [{"role": "user", "content": f"wire test {i} " + "lorem ipsum " * 30}],
            "max_tokens": 4, "temperature": 0}, timeout=60).json()

    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        resps = list(ex.map(one, range(3)))
    assert [r["id"] for r in resps] == [f"chatcmpl-{xid}-{i}" for i in range(3)]
    time.sleep(0.3)

    # ---------------- output channel: engine PUSH -> API server PULL
    out_e2a, _ = tb.relays["out.sock"].snapshot()
    fx_stream = (FIXTURES / "stream.output.engine_to_client.zmtp.bin").read_bytes()
    ours, ref = parse_zmtp(out_e2a), parse_zmtp(fx_stream)
    assert ours.greeting[0] == ref.greeting[0] == 0xFF and ours.greeting[9] == ref.greeting[9] == 0x7F
    assert ours.greeting[10:12] == ref.greeting[10:12] == b"\x03\x01"
    assert ours.greeting[12:33] == ref.greeting[12:33]  # mechanism NULL + as-server
    assert ours.commands[0].body == ref.commands[0].body  # READY Socket-Type=PUSH, byte for byte
    assert ours.commands[0].flags == ref.commands[0].flags == 0x04
    fx_step = (FIXTURES / "05_outputs_step.msgpack.bin").read_bytes()
    fx_msg = msgspec.msgpack.decode(fx_step)
    fx_first, fx_decode, fx_finished = fx_msg[1]
    seen = {"first": False, "decode": False, "finished": False, "long": False}
    wire_ids = {f"chatcmpl-{xid}-{i}" for i in range(3)}
    for m in ours.messages:
        assert len(m) == 1, "one frame per EngineCoreOutputs (no aux buffers)"
        fr = m[0]
        assert fr.flags == (0x02 if len(fr.body) > 255 else 0x00)
        msg = msgspec.msgpack.decode(fr.body)
        assert len(msg) == len(fx_msg) == 9
        # scheduler_stats (2): the fixture was captured with stats logging off (nil); the testbed
        # logs stats, as vLLM does by default: a map with SchedulerStats' fields by name.
        _assert_same_shape(msg[:1] + msg[3:], fx_msg[:1] + fx_msg[3:])
        assert fx_msg[2] is None
        assert list(msg[2]) == list(SchedulerStats.__struct_fields__)
        assert list(msg[2]["prefix_cache_stats"]) == list(PrefixCacheStats.__struct_fields__)
        assert 0.0 <= msg[2]["kv_cache_usage"] <= 1.0 and msg[2]["step_counter"] >= 1
        assert abs(msg[3] - time.monotonic()) < 120  # time.monotonic() seconds
        for o in msg[1]:
            assert len(o) == 19
            if not any(o[0].startswith(w) for w in wire_ids):
                continue
            if len(fr.body) > 255:
                seen["long"] = True
                assert fr.flags == 0x02 and fr.header_len == 9
            if o[11] is not None:
                _assert_same_shape(o, fx_first)
                assert [e["type"] for e in o[7]][:2] == [1, 2]  # QUEUED, SCHEDULED
                seen["first"] = True
            elif o[5] is not None:
                _assert_same_shape(o, fx_finished)
                assert o[5] == 1  # LENGTH
                seen["finished"] = True
            else:
                _assert_same_shape(o, fx_decode)
                seen["decode"] = True
    assert all(seen.values()), seen
    fx_flags = [f.flags for m in ref.messages for f in m]
    assert 0x02 in fx_flags and 0x00 in fx_flags  # the reference uses both size forms, as we do

    # ---------------- input channel: API server ROUTER -> engine DEALER
    in_e2a, in_a2e = tb.relays["in.sock"].snapshot()
    down, up = parse_zmtp(in_a2e), parse_zmtp(in_e2a)
    assert ready_properties(down.commands[0]) == {"Socket-Type": b"ROUTER", "Identity": b""}
    assert ready_properties(up.commands[0]) == {"Socket-Type": b"DEALER", "Identity": b"\x00\x00"}
    ready = msgspec.msgpack.decode(up.messages[0][0].body)  # engine's first message: ready map
    assert set(ready) >= {"max_model_len", "num_gpu_blocks"}
    fx_add_wire = (FIXTURES / "02_add_request.zmtp.bin").read_bytes()
    fx_add = msgspec.msgpack.decode((FIXTURES / "02_add_request.msgpack.bin").read_bytes())
    adds = [m for m in down.messages if m[0].body == b"\x00"]
    assert adds
    matched = 0
    for m in adds:
        assert len(m) == 2
        head = bytes([m[0].flags, len(m[0].body)]) + m[0].body
        assert head == fx_add_wire[:3] == b"\x01\x01\x00"
        assert m[1].flags == (0x02 if len(m[1].body) > 255 else 0x00)
        req = msgspec.msgpack.decode(m[1].body)
        assert len(req) == len(fx_add) == 22
        if req[16] not in {f"chatcmpl-{xid}-{i}" for i in range(3)}:
            continue
        matched += 1
        assert m[1].flags == fx_add_wire[3] == 0x02 and m[1].header_len == 9
        _assert_same_shape([x for i, x in enumerate(req) if i != 3], [x for i, x in enumerate(fx_add) if i != 3])
        assert isinstance(req[3], dict) and req[3]["stop"] == [] and req[3]["skip_reading_prefix_cache"] is False
        assert re.fullmatch(re.escape(req[16]) + r"-[0-9a-f]{8}", req[0])
        assert abs(req[5] - time.time()) < 120  # arrival_time is wall clock
    assert matched == 3


def test_vllm_0_34_0_wire_side_by_side_with_its_genuine_bytes(tmp_path):
    """``--vllm-wire 0.34.0``: an ADD of 23 fields whose prompt ids travel as vLLM 0.34.0's packed
    int32 array (inline under 64 ids, else in a third frame), outputs of 20 fields; the same
    shapes as the bytes vLLM 0.34.0's own encoder made, and the engine reads the ids back."""
    t = Testbed("--vllm-wire", "0.34.0", relay=True, workdir=str(tmp_path)).start()
    try:
        usage = {}
        for name, prompt in (("short", "hi"), ("long", "lorem ipsum " * 30)):
            r = httpx.post(t.base_url + "/v1/completions", headers={"X-Request-Id": f"w034-{name}"}, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=60).json()
            usage[r["id"]] = r["usage"]["prompt_tokens"]
        time.sleep(0.3)
        _, in_a2e = t.relays["in.sock"].snapshot()
        out_e2a, _ = t.relays["out.sock"].snapshot()
    finally:
        assert t.stop() == 0, open(t.log_path).read()
    raw = lambda code, data: (code, bytes(data))  # noqa: E731
    fx = {n: msgspec.msgpack.decode((FIXTURES_034 / f"add_{n}.frame0.bin").read_bytes(), ext_hook=raw)
          for n in ("short", "long")}
    # A completion's engine requests are `<its id>-<prompt index>`.
    of = lambda ext: next(k for k in usage if ext.startswith(k + "-"))  # noqa: E731
    adds = [m for m in parse_zmtp(in_a2e).messages if m[0].body == b"\x00"]
    seen = {}
    for m in adds:
        req = msgspec.msgpack.decode(m[1].body, ext_hook=raw)
        assert len(req) == len(fx["short"]) == 23
        n = usage[of(req[16])]
        dtype, shape, data = req[1]
        assert (dtype, shape) == ("<i4", [n])
        if n * 4 < 256:
            assert len(m) == 2 and data[0] == 3 and len(data[1]) == 4 * n, "inline, ext 3"
            ref = fx["short"]
        else:
            assert len(m) == 3 and data == 1 and len(m[2].body) == 4 * n, "the ids in frame 1 after the msgpack"
            ref = fx["long"]
        # Sampling params and trace headers aside (these requests asked for other things).
        _assert_same_shape([x for i, x in enumerate(req) if i not in (3, 13, 14, 22)],
                           [x for i, x in enumerate(ref) if i not in (3, 13, 14, 22)])
        seen[of(req[16])] = len(m)
    assert seen == {"cmpl-w034-short": 2, "cmpl-w034-long": 3}, seen
    fx_out = msgspec.msgpack.decode((FIXTURES_034 / "outputs.frame0.bin").read_bytes())
    assert len(fx_out[1][0]) == 20
    outs = [o for m in parse_zmtp(out_e2a).messages for o in msgspec.msgpack.decode(m[0].body)[1]]
    assert outs and all(len(o) == 20 for o in outs)
    # The engine read the packed ids: its truth's prompt lengths are the API's usage.
    recs = read_truth(t.truth_path)
    got = {of(r["external_id"]): r["prompt_tokens"] for r in recs if r["type"] == "request"}
    assert got == usage


def test_stop_string_aborts_engine_request(tb):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stop-string probe 123"}],
            "max_tokens": 24, "temperature": 0, "cache_salt": "probe-a"}
    full = httpx.post(tb.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    text = full["choices"][0]["message"]["content"]
    stop = text[10:12]
    body.update(stop=[stop], cache_salt="probe-b", stream=True)
    body["max_tokens"] = 200
    with httpx.stream("POST", tb.base_url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "stopper"},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    got = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert got == text[: text.index(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"][0]["stop_reason"] == stop
    time.sleep(0.3)
    _, in_a2e = tb.relays["in.sock"].snapshot()
    aborts = [m for m in parse_zmtp(in_a2e).messages if m[0].body == b"\x01"]
    ids = [i for m in aborts for i in msgspec.msgpack.decode(m[1].body)]
    assert any(i.startswith("chatcmpl-stopper-") for i in ids)
    recs = wait_truth(tb, lambda rs: any(r.get("external_id") == "chatcmpl-stopper" and r["type"] == "request"
                                         for r in rs))
    rec = [r for r in recs if r["type"] == "request" and r.get("external_id") == "chatcmpl-stopper"][0]
    assert rec["finish_reason"] == "abort" and rec["output_tokens"] < 200



def test_held_back_text_goes_out_as_empty_content_chunks_as_vllm_sends_them(tb):
    """vLLM's detokenizer holds back the last len(longest stop) - 1 characters while streaming, and
    its chat stream (no parser) still sends each such output, with empty content: a tracer sees
    the stream's first content only after them."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hold-back probe"}], "max_tokens": 12,
            "temperature": 0, "cache_salt": "probe-hold", "stop": ["\u00a7" * 6], "stream": True}
    with httpx.stream("POST", tb.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0].get("role") == "assistant" and deltas[0]["content"] == "", deltas[0]
    first = next(i for i, d in enumerate(deltas) if d.get("content"))
    empty = [d for d in deltas[1:first] if d == {"content": ""}]
    assert empty and len(empty) == first - 1, deltas[:first + 1]
    # The held text comes out whole: 12 tokens of one byte each, nothing lost.
    assert sum(len(d.get("content") or "") for d in deltas) == 12, deltas
    # The completions stream too (vLLM sends an output with token ids and no text yet).
    body = {"model": MODEL, "prompt": "hold-back probe", "max_tokens": 12, "temperature": 0,
            "cache_salt": "probe-hold-cmpl", "stop": ["\u00a7" * 6], "stream": True}
    with httpx.stream("POST", tb.base_url + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    first = next(i for i, t in enumerate(texts) if t)
    assert first >= 1 and all(t == "" for t in texts[:first]), texts
    assert sum(len(t) for t in texts) == 12, texts


# ----------------------------------------------------------- ground truth

def test_ground_truth_consistency_and_prefix_growth(tb, tmp_path):
    out = str(tmp_path / "client.jsonl")
    hops = run_chains(tb.base_url, "--chains", "3", "--hops", "4", "--max-tokens", "16", "--prompt-words", "60",
                      "--task-seed", "77", "--traceparent", out=out)
    assert len(hops) == 12 and not any(h["error"] for h in hops)
    ids = {h["id"] for h in hops}
    recs = wait_truth(tb, lambda rs: ids <= {r.get("external_id") for r in rs if r["type"] == "request"}
                      and ids <= {r.get("id") for r in rs if r["type"] == "http"})
    reqs = {r["external_id"]: r for r in recs if r["type"] == "request"}
    https = {r["id"]: r for r in recs if r["type"] == "http" and r.get("id")}
    steps = sorted((r for r in recs if r["type"] == "step"), key=lambda r: r["step"])

    # steps: ordered, non-overlapping, token budget respected, tokens add up
    for a, b in zip(steps, steps[1:]):
        assert a["start_ns"] < a["end_ns"] <= b["start_ns"] and b["step"] == a["step"] + 1
    for s in steps:
        assert s["num_tokens"] == sum(m["tokens"] for m in s["members"]) <= 2048
        assert len(s["members"]) <= 8
    per_req_tokens: dict[str, int] = {}
    for s in steps:
        for m in s["members"]:
            per_req_tokens[m["req"]] = per_req_tokens.get(m["req"], 0) + m["tokens"]

    for h in hops:
        r, w = reqs[h["id"]], https[h["id"]]
        assert r["req"].startswith(h["id"] + "-")
        # engine marks ordered
        assert r["engine_arrive_ns"] <= r["queued_ns"] <= r["scheduled_ns"] <= r["first_token_ns"] <= r["finished_ns"]
        # frontend marks ordered, and interleaved with the engine's on the same clock
        assert h["send_ns"] <= w["http_arrive_ns"] <= w["submit_ns"] <= r["engine_arrive_ns"]
        assert r["first_token_ns"] <= w["first_sse_write_ns"] <= w["done_ns"]
        assert w["first_sse_write_ns"] <= h["first_content_ns"] and w["done_ns"] <= h["done_ns"]
        assert w["x_session_id"] == h["session_id"] and w["traceparent"] == h["traceparent"]
        # tokens add up
        assert r["output_tokens"] == h["completion_tokens"] == 16
        assert r["prompt_tokens"] == h["prompt_tokens"] and r["cached_tokens"] == h["cached_tokens"]
        assert not r["preempted_ns"]
        assert r["computed_tokens"] == per_req_tokens[r["req"]]
        assert r["computed_tokens"] == r["prompt_tokens"] - r["cached_tokens"] + r["output_tokens"] - 1
        assert len(w["content_write_ns"]) == h["content_chunks"]
        assert w["content_write_ns"] == sorted(w["content_write_ns"])

    # prefix-cache hits grow over the hops of each chain
    for c in range(3):
        cached = [h["cached_tokens"] for h in sorted(hops, key=lambda h: h["hop"]) if h["chain"] == c]
        assert all(b > a for a, b in zip(cached, cached[1:])), cached
        assert cached[-1] > 0


def test_anthropic_messages_api_streaming_and_not(tb):
    """/v1/messages as vLLM's Python frontend serves it (the Anthropic SDK's shapes): the message
    runs as its chat completion ``chatcmpl-<base>``, the stream's events in vLLM's order, text
    deltas adding up to the whole answer, the stop reason and usage Anthropic's."""
    body = {"max_tokens": 9, "messages": [{"role": "user", "content": [{"type": "text", "text": "messages test"}]}],
            "model": MODEL, "system": "You are terse.", "temperature": 0}
    whole = httpx.post(tb.base_url + "/v1/messages", json=body, timeout=30).json()
    assert whole["id"].startswith("chatcmpl-") and whole["type"] == "message", whole
    assert (whole["stop_reason"], whole["usage"]["output_tokens"]) == ("max_tokens", 9), whole
    events = []
    with httpx.stream("POST", tb.base_url + "/v1/messages", json={**body, "stream": True}, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == name, (name, ev)
                events.append(ev)
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop"], types
    assert set(types[2:-3]) == {"content_block_delta"}, types
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == whole["content"][0]["text"]  # greedy: same tokens
    mid = events[0]["message"]["id"]
    done = events[-2]
    assert done["delta"]["stop_reason"] == "max_tokens" and done["usage"]["output_tokens"] == 9, done
    # Prompt token details on (the testbed's default): the cached tokens apart, as vLLM's.
    assert done["usage"]["input_tokens"] + done["usage"]["cache_read_input_tokens"] == whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"]
    recs = wait_truth(tb, lambda rs: any(r.get("external_id") == mid for r in rs))
    eng = [r for r in recs if r["type"] == "request" and r.get("external_id") == mid]
    assert len(eng) == 1 and eng[0]["req"].startswith(mid + "-"), eng
    assert httpx.post(tb.base_url + "/v1/messages", json={**body, "max_tokens": None}, timeout=30).status_code == 400
