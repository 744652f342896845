"""Scheduler scenarios on a real testbed, checked through the ground truth: queueing when there are
more chains than running slots, chunked prefill, client-disconnect aborts, preemption with a tiny
KV pool, KV offload copies, shutdown."""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import pytest

from helpers import Testbed, run_chains
from testbed.truth import read_truth

MODEL = "hopscope-testbed"


def _wait(path, pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        recs = read_truth(path)
        if pred(recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.05)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_queueing_chunked_prefill_abort_and_shutdown(tmp_path):
    tb = Testbed("--max-num-seqs", "1", "--max-num-batched-tokens", "64", "--no-prefix-cache",
                 workdir=str(tmp_path)).start()
    try:
        hops = run_chains(tb.base_url, "--chains", "3", "--hops", "2", "--max-tokens", "12", "--prompt-words", "40",
                          out=str(tmp_path / "c.jsonl"))
        assert not any(h["error"] for h in hops) and all(h["completion_tokens"] == 12 for h in hops)
        assert all(h["cached_tokens"] == 0 for h in hops)  # --no-prefix-cache

        # client goes away mid-stream: the API server aborts the engine request
        with httpx.stream("POST", tb.base_url + "/v1/chat/completions", headers={"X-Request-Id": "leaver"}, json={
                "model": MODEL, "messages": [{"role": "user", "content": "long one"}], "max_tokens": 3000,
                "stream": True}, timeout=30) as r:
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n >= 4:
                    break
        after = httpx.post(tb.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3},
                           timeout=30)  # would wait ~forever behind the leaver with max-num-seqs 1
        assert after.status_code == 200
        ids = {h["id"] for h in hops}
        recs = _wait(tb.truth_path, lambda rs: ids | {"chatcmpl-leaver"} <= {r.get("external_id") for r in rs})
    finally:
        engine_pids = [r["pid"] for r in read_truth(tb.truth_path) if r["type"] == "engine_start"]
        assert tb.stop() == 0
    reqs = {r["external_id"]: r for r in recs if r["type"] == "request"}
    steps = sorted((r for r in recs if r["type"] == "step"), key=lambda r: r["step"])
    assert all(len(s["members"]) <= 1 and s["num_tokens"] <= 64 for s in steps)

    # queueing: some request saw complete steps of others between its QUEUED and SCHEDULED marks
    queued_behind = 0
    for h in hops:
        r = reqs[h["id"]]
        between = [s for s in steps if r["queued_ns"] <= s["start_ns"] and s["end_ns"] <= r["scheduled_ns"]]
        queued_behind += bool(between)
        assert all(m["req"] != r["req"] for s in between for m in s["members"])
    assert queued_behind >= 2
    assert any(s["num_waiting"] > 0 for s in steps)

    # chunked prefill: prompts > 64 tokens are prefilled in 64-token chunks, first token after the last
    for h in hops:
        r = reqs[h["id"]]
        mine = [(s, m) for s in steps for m in s["members"] if m["req"] == r["req"]]
        pre = [(s, m) for s, m in mine if m["kind"] == "prefill"]
        assert r["prompt_tokens"] > 64 and len(pre) == -(-r["prompt_tokens"] // 64)
        assert [m["chunk_start"] for _, m in pre] == [64 * i for i in range(len(pre))]
        assert all(r["req"] not in s["outputs"] for s, _ in pre[:-1])  # partial chunks: no output
        assert r["first_token_ns"] >= pre[-1][0]["start_ns"] and r["first_token_ns"] <= pre[-1][0]["end_ns"]
        assert sum(m["tokens"] for _, m in mine) == r["computed_tokens"] == r["prompt_tokens"] + 11

    leaver = reqs["chatcmpl-leaver"]
    assert leaver["finish_reason"] == "abort" and 0 < leaver["output_tokens"] < 3000

    # shutdown: both processes gone, both wrote their last line
    types = [r["type"] for r in read_truth(tb.truth_path)]
    assert "engine_stop" in types and types[-1] == "frontend_stop"
    for pid in engine_pids:
        assert not _pid_alive(pid)


def test_a_stream_queued_behind_another_writes_no_body_before_its_first_output(tmp_path):
    # As vLLM: the headers at once, the role chunk (and with it the id) only with the first output.
    # A client that gives up before then has seen no id; the server aborts its engine request. A
    # non-streamed request's client that gives up is noticed too (vLLM's with_cancellation).
    tb = Testbed("--max-num-seqs", "1", "--step-sleep-ms", "15", workdir=str(tmp_path)).start()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            runner = ex.submit(lambda: httpx.post(tb.base_url + "/v1/chat/completions", headers={"X-Request-Id": "runner"},
                                                  json={"model": MODEL, "messages": [{"role": "user", "content": "go"}],
                                                        "max_tokens": 160}, timeout=60))
            _wait(tb.truth_path, lambda rs: any(r["type"] == "step" for r in rs))
            with pytest.raises(httpx.ReadTimeout):
                with httpx.stream("POST", tb.base_url + "/v1/chat/completions", headers={"X-Request-Id": "quitter"},
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "me too"}],
                                        "max_tokens": 8, "stream": True}, timeout=httpx.Timeout(30, read=0.4)) as r:
                    assert r.status_code == 200
                    for chunk in r.iter_raw():
                        pytest.fail(f"a body byte before the first output: {chunk!r}")
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(tb.base_url + "/v1/chat/completions", headers={"X-Request-Id": "json-quitter"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "me three"}], "max_tokens": 8},
                           timeout=httpx.Timeout(30, read=0.4))
            assert runner.result().status_code == 200
        quitters = {"chatcmpl-quitter", "chatcmpl-json-quitter"}
        recs = _wait(tb.truth_path, lambda rs: quitters <= {r.get("external_id") for r in rs})
    finally:
        assert tb.stop() == 0
    for q in quitters:
        engine = next(r for r in recs if r["type"] == "request" and r["external_id"] == q)
        assert engine["finish_reason"] == "abort" and engine["scheduled_ns"] is None and engine["output_tokens"] == 0, engine
    http = next(r for r in recs if r["type"] == "http" and r.get("id") == "chatcmpl-quitter")
    assert http["sse_events"] == 0 and http["response_start_ns"] is not None
    http = next(r for r in recs if r["type"] == "http" and r.get("id") == "chatcmpl-json-quitter")
    assert http["status"] == 499, "the handler gave up when its client left (uvicorn drops the answer)"


def test_a_client_started_after_anothers_signal_sends_once_those_first_hops_are_queued(tmp_path):
    # Integration tests order two agents' first hops this way, whatever their start-ups take: the
    # waiting client is started first, the signalling one 0.3 s later, and still the engine queues
    # the signaller's two first hops (one a JSON hop held for its grammar) before the waiter's.
    tb = Testbed("--grammar-compile-ms", "300", workdir=str(tmp_path)).start()
    signal = tmp_path / "first.started"
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            waiter = ex.submit(run_chains, tb.base_url, "--chains", "1", "--hops", "1", "--max-tokens", "4",
                               "--request-id-prefix", "waiter", "--start-after", str(signal))
            time.sleep(0.3)
            assert not signal.exists()
            first = ex.submit(run_chains, tb.base_url, "--chains", "2", "--hops", "2", "--max-tokens", "4",
                              "--json-schema-hops", "1", "--request-id-prefix", "first", "--signal-file", str(signal))
            first_recs, waiter_recs = first.result(timeout=60), waiter.result(timeout=60)
        recs = _wait(tb.truth_path, lambda rs: sum(r["type"] == "request" and r["finish_reason"] is not None
                                                   for r in rs) >= 5)
    finally:
        assert tb.stop() == 0
    assert not any(r["error"] for r in first_recs + waiter_recs), first_recs + waiter_recs
    signalled = int(signal.read_text())
    first_hops = [r for r in first_recs if r["hop"] == 1]
    assert max(r["headers_ns"] for r in first_hops) <= signalled < waiter_recs[0]["send_ns"]
    queued = {r["external_id"]: r["queued_ns"] for r in recs if r["type"] == "request"}
    waiter_q = next(q for x, q in queued.items() if "waiter-c0-h1" in x)
    for c in (0, 1):
        assert next(q for x, q in queued.items() if f"first-c{c}-h1" in x) < waiter_q, queued


def test_preemption_and_kv_offload_with_tiny_pool(tmp_path):
    # 16 blocks x 16 tokens = 256 KV slots: three ~30-token prompts are admitted together, but growing
    # by 100 tokens each (9 blocks) they cannot all stay
    tb = Testbed("--num-kv-blocks", "16", "--block-size", "16", "--kv-offload", "--kv-offload-blocks", "64",
                 "--max-num-seqs", "3", workdir=str(tmp_path)).start()
    try:
        def one(i):
            return httpx.post(tb.base_url + "/v1/chat/completions", headers={"X-Request-Id": f"tiny-{i}"}, json={
                "model": MODEL, "messages": [{"role": "user", "content": f"{i} preempt me"}],
                "max_tokens": 100, "temperature": 0}, timeout=120).json()

        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            resps = list(ex.map(one, range(3)))
        assert all(r["usage"]["completion_tokens"] == 100 for r in resps)
        assert all(len(r["choices"][0]["message"]["content"]) == 100 for r in resps)
        ids = {f"chatcmpl-tiny-{i}" for i in range(3)}
        recs = _wait(tb.truth_path, lambda rs: ids <= {r.get("external_id") for r in rs if r["type"] == "request"})
    finally:
        assert tb.stop() == 0
    reqs = [r for r in recs if r["type"] == "request" and r["external_id"] in ids]
    steps = sorted((r for r in recs if r["type"] == "step"), key=lambda r: r["step"])
    preempted = [r for r in reqs if r["preempted_ns"]]
    assert preempted, "expected a preemption with a 16-block pool"
    for r in preempted:
        assert len(r["rescheduled_ns"]) == len(r["preempted_ns"])
        assert all(r["scheduled_ns"] < p <= q <= r["finished_ns"] for p, q in zip(r["preempted_ns"], r["rescheduled_ns"]))
        # recompute: never fewer tokens than a straight run (equal when the resume hit the cache
        # for everything but the last token)
        assert r["computed_tokens"] >= r["prompt_tokens"] - r["cached_tokens"] + r["output_tokens"] - 1
    assert any(s["preempted"] for s in steps)
    per_req: dict[str, int] = {}
    for s in steps:
        for m in s["members"]:
            per_req[m["req"]] = per_req.get(m["req"], 0) + m["tokens"]
    for r in reqs:
        assert per_req[r["req"]] == r["computed_tokens"]
        assert r["output_tokens"] == 100
    copies = [c for s in steps for c in s["kv_copies"]]
    dirs = {c["dir"] for c in copies}
    assert "d2h" in dirs and "h2d" in dirs, dirs
    for c in copies:
        assert c["start_ns"] <= c["end_ns"] and c["bytes"] > 0
    for s in steps:
        for c in s["kv_copies"]:
            assert s["start_ns"] <= c["start_ns"] <= c["end_ns"] <= s["end_ns"]
    assert any(r["kv_copies"] for r in reqs)
    stop = [r for r in read_truth(tb.truth_path) if r["type"] == "engine_stop"][0]
    assert stop["preemptions"] >= 1 and stop["offloaded_blocks"] >= 1 and stop["onloaded_blocks"] >= 1


def test_data_parallel_engines_share_the_load_abort_their_own_requests_and_stop(tmp_path):
    tb = Testbed("--data-parallel-size", "2", "--max-num-seqs", "2", workdir=str(tmp_path)).start()
    try:
        hops = run_chains(tb.base_url, "--chains", "4", "--hops", "2", "--max-tokens", "12",
                          out=str(tmp_path / "c.jsonl"))
        assert not any(h["error"] for h in hops) and all(h["completion_tokens"] == 12 for h in hops)
        # a stop string: the API server aborts the engine request on the engine that runs it
        r = httpx.post(tb.base_url + "/v1/completions", json={
            "model": MODEL, "prompt": "stop here", "max_tokens": 2000, "stop": [" "], "seed": 1}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
        ids = {h["id"] for h in hops}
        recs = _wait(tb.truth_path, lambda rs: len([x for x in rs if x["type"] == "request"]) >= len(ids) + 1)
    finally:
        engine_pids = [x["pid"] for x in read_truth(tb.truth_path) if x["type"] == "engine_start"]
        assert tb.stop() == 0
    assert len(engine_pids) == 2
    reqs = [x for x in recs if x["type"] == "request"]
    by_engine = {e: [x for x in reqs if x["engine"] == e] for e in (0, 1)}
    assert by_engine[0] and by_engine[1], "concurrent chains are spread over both engines"
    stopped = [x for x in reqs if x["finish_reason"] in ("abort", "stop") and x["external_id"].startswith("cmpl-")]
    assert len(stopped) == 1 and stopped[0]["output_tokens"] < 2000, "the abort reached the request's own engine"
    steps = [x for x in recs if x["type"] == "step"]
    for e in (0, 1):
        mine = {x["req"] for x in by_engine[e]}
        own = [s for s in steps if s["engine"] == e]
        # each engine numbers its own steps and runs only its own requests
        assert [s["step"] for s in own] == list(range(1, len(own) + 1))
        assert all(m["req"] in mine for s in own for m in s["members"] if m["req"] in {x["req"] for x in reqs})
    types = [x["type"] for x in read_truth(tb.truth_path)]
    assert types.count("engine_stop") == 2 and types[-1] == "frontend_stop"
    for pid in engine_pids:
        assert not _pid_alive(pid)


def test_two_api_server_processes_get_each_step_as_one_message_each(tmp_path):
    """--api-server-count 2: two API server processes (as vLLM's run_multi_api_server: the first
    process serves no HTTP) share the listening socket, each its own engine client, and a step
    whose requests came from both is sent as two messages (vLLM groups a step's outputs by
    client_index), the step's truth line saying so."""
    tb = Testbed("--api-server-count", "2", "--max-num-seqs", "8", workdir=str(tmp_path)).start()
    try:
        # Which process accepts a connection is the kernel's choice (both wait on one listening
        # socket), so a round of concurrent chains can land on one process alone (it did, in CI,
        # with 4 chains). Rounds repeat until some step carried both clients' requests: each round
        # fails to split with probability about 2**-7, the test only once 6 rounds in a row have.
        done = 0
        for _ in range(6):
            hops = run_chains(tb.base_url, "--chains", "8", "--hops", "2", "--max-tokens", "12",
                              out=str(tmp_path / "c.jsonl"))
            assert not any(h["error"] for h in hops) and all(h["completion_tokens"] == 12 for h in hops)
            done += len(hops)
            recs = _wait(tb.truth_path, lambda rs: len([x for x in rs if x["type"] == "request"]) >= done)
            if any(s.get("messages") == 2 for s in recs if s["type"] == "step"):
                break
    finally:
        assert tb.stop() == 0
    steps = [x for x in recs if x["type"] == "step"]
    split = [s for s in steps if s.get("messages") == 2]
    assert split, "some step carried requests of both clients (6 rounds of 8 concurrent chains)"
    assert all(s.get("messages", 1) <= 2 for s in steps)
    main = next(x["pid"] for x in recs if x["type"] == "frontend_start")
    served_by = {x["pid"] for x in recs if x["type"] == "http" and x["id"] is not None}
    assert len(served_by) == 2 and main not in served_by, f"requests served by {served_by}, main {main}"
    for pid in served_by:
        assert not _pid_alive(pid), "API servers stop with the testbed"
