"""In-process unit tests: message layouts (byte-exact against vLLM 0.33.0's and 0.34.0's genuine bytes),
tokenizer, KV cache manager, scheduler + numpy model."""

import json

import msgspec
import numpy as np
import pytest

from helpers import FIXTURES, FIXTURES_034
from testbed.kv_cache import KVCacheManager
from testbed.model_numpy import ModelConfig, NumpyModelRunner
from testbed.protocol import (
    AddDecoder,
    AddEncoder,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutput034,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequest034,
    FinishReason,
    PrefillStats,
    SamplingParams,
    StructuredOutputsParams,
    make_outputs_decoder,
    make_request_decoder,
)
from testbed.scheduler import Scheduler
from testbed.tokenizer import ByteTokenizer, IncrementalDetokenizer

needs_fixtures = pytest.mark.skipif(not FIXTURES.exists(), reason="shared/fixtures/vllm-0.33.0 not found")


@needs_fixtures
def test_add_request_bytes_identical_to_vllm_0_33_0():
    """Our EngineCoreRequest struct encodes the fixture's request to the very same 300 bytes."""
    fx = (FIXTURES / "02_add_request.msgpack.bin").read_bytes()
    g = json.loads((FIXTURES / "02_add_request.json").read_text())["msgpack_generic"]
    req = EngineCoreRequest(request_id=g[0], prompt_token_ids=g[1], mm_features=None,
                            sampling_params=SamplingParams(temperature=0.7), pooling_params=None,
                            arrival_time=g[5], lora_request=None, cache_salt=None, data_parallel_rank=None,
                            external_req_id=g[16])
    assert msgspec.msgpack.encode(req) == fx
    back = make_request_decoder().decode(fx)
    assert back.external_req_id == "chatcmpl-abc123def4567890"
    assert back.request_id == back.external_req_id + "-1a2b3c4d"


@needs_fixtures
def test_outputs_step_bytes_identical_to_vllm_0_33_0():
    fx = (FIXTURES / "05_outputs_step.msgpack.bin").read_bytes()
    ours = EngineCoreOutputs(engine_index=0, timestamp=12345.678, outputs=[
        EngineCoreOutput("chatcmpl-abc123def4567890-1a2b3c4d", [101],
                         events=[EngineCoreEvent(EngineCoreEventType.QUEUED, 12345.67),
                                 EngineCoreEvent(EngineCoreEventType.SCHEDULED, 12345.674)],
                         prefill_stats=PrefillStats(37, 5, 32, 32, 0, 0)),
        EngineCoreOutput("chatcmpl-0f1e2d3c4b5a6978-5e6f7a8b", [7]),
        EngineCoreOutput("chatcmpl-99aa88bb77cc66dd-c0ffee00", [9], finish_reason=FinishReason.LENGTH),
    ])
    assert msgspec.msgpack.encode(ours) == fx
    dec = make_outputs_decoder().decode(fx)
    assert dec.outputs[2].finish_reason == FinishReason.LENGTH
    assert dec.outputs[0].prefill_stats.num_cached_tokens == 32


def test_struct_lengths():
    assert len(EngineCoreRequest.__struct_fields__) == 22
    assert len(EngineCoreOutputs.__struct_fields__) == 9
    assert len(EngineCoreOutput.__struct_fields__) == 19
    assert EngineCoreRequest.__struct_fields__[16] == "external_req_id"
    assert EngineCoreOutput.__struct_fields__[11] == "prefill_stats"


def test_tokenizer_roundtrip_and_incremental_utf8():
    tok = ByteTokenizer()
    s = "héllo → wörld"
    ids = tok.encode(s)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == s
    d = IncrementalDetokenizer()
    out = "".join(d.feed([i]) for i in ids) + d.flush()
    assert out == s
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    chat2 = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                     {"role": "user", "content": "more"}])
    assert chat2[: len(chat)] == chat  # the previous prompt is a prefix of the next hop's


def _ecr(rid, prompt, max_tokens=4, **sp):
    return EngineCoreRequest(rid, prompt, None, SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp),
                             None, 0.0, None, None, None, external_req_id=rid)


def test_kv_prefix_cache_hits_and_eviction_offload():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, host_capacity_blocks=16)
    from testbed.kv_cache import hash_block

    toks = list(range(20))
    hashes = []
    for i in range(5):
        hashes.append(hash_block(hashes[-1] if hashes else None, toks[i * 4:(i + 1) * 4], None))
    assert kv.get_computed_blocks(hashes, 20) == ([], 0)
    assert kv.allocate_slots("a", 0, 20, hashes)
    kv.cache_full_blocks("a", hashes, 20)
    kv.free("a")
    local, ext = kv.get_computed_blocks(hashes, 20)
    assert len(local) == 4 and ext == 0  # never the whole prompt: last token is recomputed
    # fill the pool with another request: evicts a's blocks, which get offloaded to the host
    other = [hash_block(None, [100 + i], None) for i in range(8)]
    assert kv.allocate_slots("b", 0, 32, other)
    ops = kv.take_ops()
    assert ops and all(o.dir == "d2h" for o in ops)
    kv.free("b")
    local, ext = kv.get_computed_blocks(hashes, 20)
    assert local == [] and ext == 4
    assert kv.allocate_slots("c", 16, 4, hashes, local, ext)
    ops = kv.take_ops()
    assert [o.dir for o in ops].count("h2d") == 4


def _engine(num_blocks=64, budget=64, max_seqs=4, bs=4, caching=True):
    mc = ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_model_len=512)
    runner = NumpyModelRunner(mc, num_blocks, bs)
    kv = KVCacheManager(num_blocks, bs, caching)
    return Scheduler(kv, budget, max_seqs, 512), runner


def _run(sched, runner, max_steps=500):
    outs, steps = {}, []
    while sched.has_work() and len(steps) < max_steps:
        so = sched.schedule()
        steps.append(so)
        plan = sched.build_plan(so)
        sampled, _, _ = runner.execute(plan, so.copy_ops)
        o, _, _ = sched.update_from_output(so, sampled, 0)
        for x in o:
            outs.setdefault(x.request_id, []).append(x)
    return outs, steps


def test_scheduler_chunked_prefill_and_greedy_determinism():
    sched, runner = _engine(budget=8)
    prompt = list(range(40, 70))  # 30 tokens > budget 8: 4 prefill chunks
    sched.add_request(_ecr("r1", prompt), 0)
    outs, steps = _run(sched, runner)
    kinds = [(s.scheduled[0].kind, s.scheduled[0].num_new, s.scheduled[0].start) for s in steps]
    assert kinds[:4] == [("prefill", 8, 0), ("prefill", 8, 8), ("prefill", 8, 16), ("prefill", 6, 24)]
    assert all(k[0] == "decode" for k in kinds[4:])
    toks = [t for o in outs["r1"] for t in o.new_token_ids]
    assert len(toks) == 4 and outs["r1"][-1].finish_reason == FinishReason.LENGTH
    assert outs["r1"][0].prefill_stats.num_prompt_tokens == 30
    # same prompt again, no cache: same greedy tokens
    sched2, runner2 = _engine(budget=64, caching=False)
    sched2.add_request(_ecr("r2", prompt), 0)
    outs2, _ = _run(sched2, runner2)
    toks2 = [t for o in outs2["r2"] for t in o.new_token_ids]
    assert toks == toks2


def test_structured_output_waits_for_its_grammar_and_later_requests_go_past_it():
    import time
    kv = KVCacheManager(64, 4, True)
    sched = Scheduler(kv, 64, 4, 512, grammar_compile_ms=30.0)
    def so():
        p = StructuredOutputsParams(json={"type": "object"})
        p._backend = "xgrammar"
        return p

    sched.add_request(_ecr("s1", [40] * 8, structured_outputs=so()), 0)
    sched.add_request(_ecr("p1", [41] * 8), 0)
    first = sched.schedule()
    assert [s.req.request_id for s in first.scheduled] == ["p1"], "the plain request goes past the compiling one"
    assert [r.request_id for r in sched.waiting] == ["s1"], "the skipped request keeps its place"
    assert sched.requests["s1"].truth["structured_output"] == "json"
    ready = sched.requests["s1"].truth["grammar_ready_ns"]
    time.sleep(max(0.0, (ready - time.monotonic_ns()) / 1e9) + 0.001)
    assert [(s.req.request_id, s.kind) for s in sched.schedule().scheduled] == [("p1", "prefill"), ("s1", "prefill")], \
        "p1 still prefilling, s1 now scheduled"
    # The same constraint again: compiled already, scheduled at once.
    sched.add_request(_ecr("s2", [42] * 8, structured_outputs=so()), 0)
    assert "s2" in [s.req.request_id for s in sched.schedule().scheduled]
    # Nothing but a compiling request waits: the schedule is empty and numbers no step (the
    # engine loop polls until the grammar is ready; the truth's steps stay consecutive).
    lone = Scheduler(KVCacheManager(64, 4, True), 64, 4, 512, grammar_compile_ms=30.0)
    lone.add_request(_ecr("s3", [43] * 8, structured_outputs=StructuredOutputsParams(json={"type": "array"})), 0)
    empty = lone.schedule()
    assert not empty.scheduled and lone.step_counter == 0
    time.sleep(0.035)
    ran = lone.schedule()
    assert [s.req.request_id for s in ran.scheduled] == ["s3"] and ran.step == lone.step_counter == 1


def _prio(rid, prompt, priority, arrival):
    return EngineCoreRequest(rid, prompt, None, SamplingParams(max_tokens=8, temperature=0.0), None, arrival, None,
                             None, None, priority=priority, external_req_id=rid)


def test_the_priority_policy_takes_the_waiting_queue_by_priority_then_arrival():
    kv = KVCacheManager(64, 4, False)
    sched = Scheduler(kv, 64, 1, 512, scheduling_policy="priority")
    sched.add_request(_prio("low", [40] * 8, 5, 1.0), 0)
    sched.add_request(_prio("low2", [41] * 8, 5, 2.0), 0)
    sched.add_request(_prio("high", [42] * 8, -1, 3.0), 0)
    sched.add_request(_prio("mid", [43] * 8, 0, 0.5), 0)
    assert [r.request_id for r in sched.waiting] == ["high", "mid", "low", "low2"]
    assert [s.req.request_id for s in sched.schedule().scheduled] == ["high"], "one slot: the lowest value first"
    assert sched.requests["high"].truth["priority"] == -1
    fcfs = Scheduler(KVCacheManager(64, 4, False), 64, 1, 512)
    for r in ("low", "high"):
        fcfs.add_request(_prio(r, [40] * 8, 5 if r == "low" else -1, 1.0), 0)
    assert [s.req.request_id for s in fcfs.schedule().scheduled] == ["low"], "fcfs ignores priorities"
    with pytest.raises(ValueError):
        Scheduler(KVCacheManager(4, 4, False), 64, 1, 512, scheduling_policy="lifo")


def test_the_priority_policy_preempts_the_least_important_even_if_scheduled_this_step():
    # 5 blocks of 4: A (priority 5) prefills 8 tokens in step 1; B (priority 0) comes and
    # prefills in step 2; in step 3 B's decode needs a 6th block: A, decoding already in
    # that step, is the one preempted (its tokens taken back), not B, the last running.
    for policy, victim in (("priority", "a"), ("fcfs", "b")):
        sched = Scheduler(KVCacheManager(5, 4, False), 64, 4, 512, scheduling_policy=policy)
        runner = NumpyModelRunner(ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_model_len=512), 5, 4)
        def step():
            so = sched.schedule()
            sampled, _, _ = runner.execute(sched.build_plan(so), so.copy_ops)
            sched.update_from_output(so, sampled, 0)
            return so
        sched.add_request(_prio("a", list(range(40, 48)), 5, 1.0), 0)
        assert [s.req.request_id for s in step().scheduled] == ["a"]
        sched.add_request(_prio("b", list(range(50, 58)), 0, 2.0), 0)
        assert [s.req.request_id for s in step().scheduled] == ["a", "b"]
        third = step()
        assert third.preempted == [victim], policy
        survivor = "b" if victim == "a" else "a"
        assert [s.req.request_id for s in third.scheduled] == [survivor], policy
        assert sched.requests[victim].truth["preempted_ns"], policy


def test_structured_outputs_params_encode_as_vllms_dataclass():
    # vLLM 0.32.0's MsgpackEncoder writes StructuredOutputsParams (a dataclass) with every field
    # by name, in this order, inside the SamplingParams map (seen with vLLM's own encoder).
    so = StructuredOutputsParams(choice=["yes", "no"])
    so._backend, so._backend_was_auto = "xgrammar", True
    sp = msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(max_tokens=32, structured_outputs=so)))
    assert list(sp["structured_outputs"]) == ["json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                                              "disable_additional_properties", "whitespace_pattern", "structural_tag",
                                              "_backend", "_backend_was_auto"]
    assert sp["structured_outputs"]["choice"] == ["yes", "no"] and sp["structured_outputs"]["_backend"] == "xgrammar"
    assert "structured_outputs" not in msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(max_tokens=32)))


def test_scheduler_preempts_when_pool_is_exhausted():
    sched, runner = _engine(num_blocks=10, budget=64, max_seqs=4, bs=4)  # 40 token slots
    for i in range(3):
        sched.add_request(_ecr(f"r{i}", [60 + i] * 10, max_tokens=12), 0)
    outs, steps = _run(sched, runner)
    assert any(s.preempted for s in steps)
    for i in range(3):
        toks = [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        assert len(toks) == 12
        evs = [e.type for o in outs[f"r{i}"] for e in (o.events or [])]
        assert evs[0] == EngineCoreEventType.QUEUED
    all_events = [e.type for r in outs.values() for o in r for e in (o.events or [])]
    assert EngineCoreEventType.PREEMPTED in all_events


def test_stop_token_ids_finish_with_stop():
    sched, runner = _engine()
    sched.add_request(_ecr("probe", [65, 66, 67, 68, 69], max_tokens=6), 0)
    outs, _ = _run(sched, runner)
    toks = [t for o in outs["probe"] for t in o.new_token_ids]
    sched2, runner2 = _engine()
    sched2.add_request(_ecr("s", [65, 66, 67, 68, 69], max_tokens=6, stop_token_ids=[toks[2]]), 0)
    outs2, _ = _run(sched2, runner2)
    last = outs2["s"][-1]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason == toks[2]
    assert len([t for o in outs2["s"] for t in o.new_token_ids]) == toks.index(toks[2]) + 1


def test_seeded_sampling_is_reproducible():
    def gen(seed):
        sched, runner = _engine()
        ecr = EngineCoreRequest("x", [70, 71, 72], None, SamplingParams(max_tokens=8, temperature=1.0, seed=seed),
                                None, 0.0, None, None, None)
        sched.add_request(ecr, 0)
        outs, _ = _run(sched, runner)
        return [t for o in outs["x"] for t in o.new_token_ids]

    assert gen(7) == gen(7)
    assert np.array(gen(7)).shape == (8,)


def test_scheduler_stats_count_prefix_lookups_and_reset():
    """SchedulerStats as vLLM's make_stats(): queues, KV usage, prefix-cache tokens since last."""
    sched, runner = _engine(budget=64, bs=4)
    prompt = list(range(40, 60))  # 20 tokens: 5 blocks, 4 cacheable (the last token is recomputed)
    sched.add_request(_ecr("a", prompt, max_tokens=2), 0)
    sched.add_request(_ecr("b", prompt[:12] + [99] * 8, max_tokens=2), 0)
    first = sched.make_stats(0.0)
    assert (first.num_running_reqs, first.num_waiting_reqs, first.prefix_cache_stats.queries) == (0, 2, 0)
    _run(sched, runner)
    st = sched.make_stats(0.25)
    # Both looked up in the first step, before either was cached: 40 tokens queried, 0 hit.
    assert (st.prefix_cache_stats.requests, st.prefix_cache_stats.queries, st.prefix_cache_stats.hits) == (2, 40, 0)
    assert st.kv_cache_usage == 0.25 and st.step_counter == sched.step_counter
    sched.add_request(_ecr("c", prompt, max_tokens=2), 0)
    _run(sched, runner)
    again = sched.make_stats(0.0)
    assert (again.prefix_cache_stats.requests, again.prefix_cache_stats.queries, again.prefix_cache_stats.hits) == (1, 20, 16)
    off, _ = _engine()
    off.log_stats = False
    assert off.make_stats(0.5) is None


def test_dp_coordinator_relays_load_and_waves_like_vllms(tmp_path):
    """The DP coordinator process, driven over its three sockets as vLLM's engines and API server
    drive it: an engine's request counts reach the front-end's publishes, a front-end's
    first-request notice wakes the other engines with START_DP_WAVE, engine 0's wave_complete moves
    the wave on and pauses the engines."""
    import multiprocessing
    import zmq

    from testbed.coordinator import CoordinatorAddrs, run_coordinator
    from testbed.protocol import EngineCoreRequestType, SchedulerStats

    addrs = CoordinatorAddrs(str(tmp_path), "t")
    proc = multiprocessing.get_context("spawn").Process(target=run_coordinator, args=(2, addrs, None, 20),
                                                        daemon=True)
    proc.start()
    ctx = zmq.Context()
    front = ctx.socket(zmq.XSUB)
    engine_in = ctx.socket(zmq.XSUB)
    engine_out = ctx.socket(zmq.PUSH)
    try:
        front.connect(addrs.front_publish)
        front.send(b"\x01")
        engine_in.connect(addrs.back_publish)
        engine_in.send(b"\x01")
        engine_out.connect(addrs.back_output)
        enc = msgspec.msgpack.Encoder()

        def publish_where(pred, what):
            for _ in range(100):
                if front.poll(5000):
                    counts, wave, running = msgspec.msgpack.decode(front.recv())
                    if pred(counts, wave, running):
                        return counts, wave, running
            raise AssertionError(f"no publish with {what}")

        engine_out.send(enc.encode(EngineCoreOutputs(engine_index=1, scheduler_stats=SchedulerStats(
            num_running_reqs=2, num_waiting_reqs=1))))
        counts, wave, running = publish_where(lambda c, w, r: c[1] == [1, 2], "engine 1's counts")
        assert (counts[0], wave, running) == ([0, 0], 0, False)
        # A request reached engine 1 while paused: the coordinator wakes the others.
        front.send(msgspec.msgpack.encode((1, 0)))
        assert engine_in.poll(5000), "no START_DP_WAVE"
        ty, body = engine_in.recv_multipart()
        assert ty == EngineCoreRequestType.START_DP_WAVE.value and msgspec.msgpack.decode(body) == [0, 1]
        publish_where(lambda c, w, r: r and w == 0, "the engines running")
        engine_out.send(enc.encode(EngineCoreOutputs(engine_index=0, wave_complete=0)))
        publish_where(lambda c, w, r: not r and w == 1, "wave 1, paused")
    finally:
        for s in (front, engine_in, engine_out):
            s.close(linger=0)
        ctx.term()
        proc.terminate()
        proc.join(timeout=5)


def test_add_request_frames_identical_to_vllm_0_34_0():
    """``--vllm-wire 0.34.0``: the ADD frames (packed ids inline, and in a frame of their own) are
    the very bytes vLLM 0.34.0's frontend sent for the same requests; the engine reads them back."""
    fx = json.loads((FIXTURES_034 / "fixtures.json").read_text())["adds"]
    so = StructuredOutputsParams(json={"type": "object", "properties": {"city": {"type": "string"}}})
    # vLLM's instance holds both from construction (its frontend then sets them, as the testbed's).
    so._backend, so._backend_was_auto = None, False
    short = EngineCoreRequest034(
        request_id=fx[0]["request_id"], prompt_token_ids=list(range(101, 106)), mm_features=None,
        sampling_params=SamplingParams(max_tokens=24), pooling_params=None, arrival_time=fx[0]["arrival_time"],
        lora_request=None, cache_salt=None, data_parallel_rank=None, external_req_id=fx[0]["external_req_id"])
    long_ = EngineCoreRequest034(
        request_id=fx[1]["request_id"], prompt_token_ids=[(i * 7919) % 32000 for i in range(300)], mm_features=None,
        sampling_params=SamplingParams(max_tokens=64, structured_outputs=so),
        pooling_params=None, arrival_time=fx[1]["arrival_time"], lora_request=None, cache_salt=None,
        data_parallel_rank=None, priority=-3, trace_headers={"traceparent": fx[1]["traceparent"]},
        external_req_id=fx[1]["external_req_id"], block_hashes=[b"\x11" * 32, b"\x22" * 32])
    enc = AddEncoder("0.34.0")
    for name, req, n in (("add_short", short, 1), ("add_long", long_, 2)):
        frames = [bytes(f) for f in enc.encode(req)]
        assert frames == [(FIXTURES_034 / f"{name}.frame{i}.bin").read_bytes() for i in range(n)], name
        back = AddDecoder().decode(frames)
        assert back.prompt_token_ids == req.prompt_token_ids and back.priority == req.priority
    # 0.33.0's wire: one frame, the ids a list, read by the same decoder.
    one = AddEncoder("0.33.0").encode(msgspec.structs.replace(short, block_hashes=None))
    assert len(one) == 1 and AddDecoder().decode(one).prompt_token_ids == short.prompt_token_ids


def test_outputs_step_bytes_identical_to_vllm_0_34_0():
    fx = (FIXTURES_034 / "outputs.frame0.bin").read_bytes()
    ours = EngineCoreOutputs(engine_index=0, timestamp=54321.125, outputs=[
        EngineCoreOutput034("chatcmpl-0340long000000000-5e6f7a8b", [17],
                            events=[EngineCoreEvent(EngineCoreEventType.QUEUED, 54321.0),
                                    EngineCoreEvent(EngineCoreEventType.SCHEDULED, 54321.0625)],
                            prefill_stats=PrefillStats(300, 44, 256, 256, 0, 0), watermarking=True),
        EngineCoreOutput034("chatcmpl-0340other00000000-9c0d1e2f", [5, 6], finish_reason=FinishReason.LENGTH),
    ])
    assert msgspec.msgpack.encode(ours) == fx
    # The API server's decoder (0.33.0's struct) ignores the trailing field, as msgspec does.
    assert make_outputs_decoder().decode(fx).outputs[1].finish_reason == FinishReason.LENGTH
