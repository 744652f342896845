"""Continuous-batching scheduler shaped like vLLM V1's (vllm/v1/core/sched/scheduler.py).

Each step:
  1. RUNNING requests first, in order: each gets ``min(num_tokens - num_computed_tokens, budget)``
     new tokens (1 for a decode, a chunk for a chunked prefill). If the KV pool cannot hold them,
     the lowest-priority running request (the last one) is preempted (recompute: its blocks are
     freed, ``num_computed_tokens`` goes back to 0, it returns to the front of the waiting queue,
     PREEMPTED event) until the request fits or preempts itself.
  2. If nothing was preempted, WAITING requests in FCFS order while ``len(running) <
     max_num_seqs`` and budget remains: prefix-cache lookup (device, then host when offloading),
     then a (possibly chunked) prefill of the rest. SCHEDULED event when it (re)enters RUNNING.
With ``scheduling_policy="priority"`` (vLLM's ``--scheduling-policy priority``) the waiting queue
is ordered by (priority, arrival time), a lower value first, preempted requests going back in by
that order too, and the running request preempted is the one of the highest (priority, arrival
time), not the last.
The token budget is ``max_num_batched_tokens``; a prompt longer than the budget is prefilled in
chunks over several steps; a partial chunk produces no output, as in vLLM.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec
import numpy as np

from .kv_cache import KVCacheManager, hash_block
from .model_numpy import BatchPlan, SeqPlan
from .protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    PrefillStats,
    PrefixCacheStats,
    SamplingParams,
    SchedulerStats,
)
from .tokenizer import EOS_ID


class RequestStatus(enum.Enum):
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED = 4


class Request:
    def __init__(self, ecr: EngineCoreRequest, block_size: int, max_model_len: int, max_pool_tokens: int,
                 arrive_ns: int):
        self.request_id = ecr.request_id
        self.external_id = ecr.external_req_id
        self.client_index = ecr.client_index  # the engine client (API server) it came from
        self.priority = ecr.priority  # under the priority policy: lower first
        self.prompt_token_ids = list(ecr.prompt_token_ids or [])
        self.sp = ecr.sampling_params or SamplingParams()
        self.cache_salt = ecr.cache_salt
        self.arrival_time = ecr.arrival_time
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.events: list[EngineCoreEvent] = []
        self.block_size = block_size
        self.block_hashes: list[int] = []
        self.num_cached_tokens = -1
        self.num_local_cached_tokens = 0
        self.num_external_cached_tokens = 0
        self.prefill_stats_sent = False
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: Any = None
        self.skip_cache = bool(self.sp.skip_reading_prefix_cache)
        self.grammar_ready_ns = 0  # when its structured-output grammar is compiled
        max_tokens = self.sp.max_tokens if self.sp.max_tokens is not None else max_model_len
        # never grow beyond the model length or the whole KV pool (a lone request always fits)
        self.max_tokens = max(1, min(max_tokens, max_model_len - len(self.prompt_token_ids),
                                     max_pool_tokens - len(self.prompt_token_ids)))
        self.rng = np.random.default_rng(self.sp.seed) if self.sp.seed is not None else None
        self.truth: dict[str, Any] = {
            "type": "request",
            "req": self.request_id,
            "external_id": self.external_id,
            "engine_arrive_ns": arrive_ns,
            "queued_ns": None,
            "scheduled_ns": None,
            "preempted_ns": [],
            "rescheduled_ns": [],
            "first_token_ns": None,
            "finished_ns": None,
            "prompt_tokens": len(self.prompt_token_ids),
            "priority": self.priority,
            "cached_tokens": None,
            "local_cached_tokens": None,
            "external_cached_tokens": None,
            "computed_tokens": 0,
            "output_tokens": 0,
            "finish_reason": None,
            "kv_copies": [],
        }
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def update_block_hashes(self) -> None:
        bs = self.block_size
        n_full = len(self.all_token_ids) // bs
        while len(self.block_hashes) < n_full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block(parent, self.all_token_ids[i * bs:(i + 1) * bs], self.cache_salt))

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)
        self.update_block_hashes()

    def take_events(self) -> Optional[list[EngineCoreEvent]]:
        if not self.events:
            return None
        ev, self.events = self.events, []
        return ev


@dataclass
class ScheduledReq:
    req: Request
    num_new: int
    start: int  # num_computed_tokens before this step
    kind: str  # "prefill" | "decode"


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledReq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    copy_ops: list = field(default_factory=list)
    num_tokens: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, log_stats: bool = True, allow_eos: bool = False,
                 grammar_compile_ms: float = 0.0, scheduling_policy: str = "fcfs",
                 output_cls: type = EngineCoreOutput):
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {scheduling_policy!r}: fcfs or priority")
        self.by_priority = scheduling_policy == "priority"
        self.output_cls = output_cls  # the wire's EngineCoreOutput (vLLM 0.34.0's has one more field)
        self.kv = kv
        # Structured output: as vLLM, a request whose grammar is still compiling waits in the
        # queue while later ones are scheduled past it; a constraint compiled before is ready at
        # once (xgrammar's compiler cache), one compiling for another request when that is done.
        self.grammar_compile_ns = int(grammar_compile_ms * 1e6)
        self.grammar_ready: dict[bytes, int] = {}
        self.block_size = kv.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.log_stats = log_stats
        self.allow_eos = allow_eos
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_counter = 0
        self.num_preemptions = 0
        # Prefix-cache lookups since the last make_stats() (vLLM's PrefixCacheStats).
        self.prefix_requests = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ------------------------------------------------------------ requests
    def add_request(self, ecr: EngineCoreRequest, arrive_ns: int) -> Request:
        req = Request(ecr, self.block_size, self.max_model_len, self.kv.num_blocks * self.block_size, arrive_ns)
        t_ns = time.monotonic_ns()
        req.truth["queued_ns"] = t_ns
        so = req.sp.structured_outputs
        if so is not None:
            key = msgspec.msgpack.encode(so)
            req.grammar_ready_ns = self.grammar_ready.setdefault(key, t_ns + self.grammar_compile_ns)
            req.truth["structured_output"] = so.kind()
            req.truth["grammar_ready_ns"] = req.grammar_ready_ns
        if self.log_stats:
            req.events.append(EngineCoreEvent(EngineCoreEventType.QUEUED, t_ns / 1e9))
        self.requests[req.request_id] = req
        if self.by_priority:
            self._insert_by_priority(req)
        else:
            self.waiting.append(req)
        return req

    def _insert_by_priority(self, req: Request) -> None:
        """Into the waiting queue after every request of a lower or equal (priority, arrival)."""
        key = (req.priority, req.arrival_time)
        i = len(self.waiting)
        while i > 0 and (self.waiting[i - 1].priority, self.waiting[i - 1].arrival_time) > key:
            i -= 1
        self.waiting.insert(i, req)

    def abort_requests(self, ids: list[str]) -> list[Request]:
        done = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.status == RequestStatus.FINISHED:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                try:
                    self.waiting.remove(req)
                except ValueError:
                    pass
            self._finish(req, FinishReason.ABORT)
            done.append(req)
        return done

    def make_stats(self, kv_cache_usage: float) -> Optional[SchedulerStats]:
        """vLLM's Scheduler.make_stats(): None unless stats logging is on; resets the prefix counts."""
        if not self.log_stats:
            return None
        pcs = PrefixCacheStats(requests=self.prefix_requests, queries=self.prefix_queries,
                               hits=self.prefix_hits)
        self.prefix_requests = self.prefix_queries = self.prefix_hits = 0
        return SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                              step_counter=self.step_counter, current_wave=0,
                              kv_cache_usage=float(kv_cache_usage), prefix_cache_stats=pcs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step=self.step_counter + 1)
        budget = self.max_num_batched_tokens
        t_ns = time.monotonic_ns()
        scheduled_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            ok = False
            while True:
                ok = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, num_new)
                if ok:
                    break
                if self.by_priority:
                    # The least important may be one scheduled already this
                    # step (before i): vLLM takes its tokens back too.
                    victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    at = self.running.index(victim)
                    self.running.remove(victim)
                    if at < i:
                        i -= 1
                    if victim.request_id in scheduled_ids:
                        scheduled_ids.discard(victim.request_id)
                        gone = next(x for x in out.scheduled if x.req is victim)
                        out.scheduled.remove(gone)
                        budget += gone.num_new
                else:
                    victim = self.running.pop()
                    if victim.request_id in scheduled_ids:  # cannot happen: scheduled ones precede i
                        raise RuntimeError("preempting a scheduled request")
                self._preempt(victim, t_ns)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if not ok:
                break
            out.scheduled.append(ScheduledReq(req, num_new, req.num_computed_tokens, self._kind(req, num_new)))
            scheduled_ids.add(req.request_id)
            budget -= num_new
            i += 1

        if not out.preempted:
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if req.grammar_ready_ns > t_ns:
                    skipped.append(self.waiting.popleft())
                    continue
                local, ext = [], 0
                if req.num_computed_tokens == 0 and not req.skip_cache:
                    local, ext = self.kv.get_computed_blocks(req.block_hashes, req.num_tokens)
                num_computed = (len(local) + ext) * self.block_size
                if req.num_computed_tokens == 0 and not req.skip_cache:
                    # vLLM counts device-cache hits here; connector (host) hits go elsewhere.
                    self.prefix_requests += 1
                    self.prefix_queries += req.num_tokens
                    self.prefix_hits += len(local) * self.block_size
                num_new = min(req.num_tokens - num_computed, budget)
                if not self.kv.allocate_slots(req.request_id, num_computed, num_new, req.block_hashes, local, ext):
                    break
                self.waiting.popleft()
                req.num_computed_tokens = num_computed
                if req.num_cached_tokens < 0:  # first scheduling: prefill stats
                    req.num_cached_tokens = num_computed
                    req.num_local_cached_tokens = len(local) * self.block_size
                    req.num_external_cached_tokens = ext * self.block_size
                    req.truth["cached_tokens"] = num_computed
                    req.truth["local_cached_tokens"] = req.num_local_cached_tokens
                    req.truth["external_cached_tokens"] = req.num_external_cached_tokens
                if req.status == RequestStatus.PREEMPTED:
                    req.truth["rescheduled_ns"].append(t_ns)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if req.truth["scheduled_ns"] is None:
                    req.truth["scheduled_ns"] = t_ns
                if self.log_stats:
                    req.events.append(EngineCoreEvent(EngineCoreEventType.SCHEDULED, t_ns / 1e9))
                out.scheduled.append(ScheduledReq(req, num_new, num_computed, "prefill"))
                budget -= num_new
            if self.by_priority:
                for req in skipped:
                    self._insert_by_priority(req)
            else:
                self.waiting.extendleft(reversed(skipped))

        out.copy_ops = self.kv.take_ops()
        out.num_tokens = sum(s.num_new for s in out.scheduled)
        if out.scheduled:
            # A schedule with nothing in it (every waiting request held for its grammar) runs no
            # step and takes no number: the truth's steps stay consecutive.
            self.step_counter = out.step
        return out

    def _kind(self, req: Request, num_new: int) -> str:
        if num_new == 1 and req.num_computed_tokens >= len(req.prompt_token_ids) and req.output_token_ids:
            return "decode"
        return "prefill"

    def _preempt(self, req: Request, t_ns: int) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.truth["preempted_ns"].append(t_ns)
        self.num_preemptions += 1
        if self.log_stats:
            req.events.append(EngineCoreEvent(EngineCoreEventType.PREEMPTED, t_ns / 1e9))
        if self.by_priority:
            self._insert_by_priority(req)
        else:
            self.waiting.appendleft(req)

    # --------------------------------------------------------- model input
    def build_plan(self, so: SchedulerOutput) -> BatchPlan:
        plan = BatchPlan()
        bs = self.block_size
        for s in so.scheduled:
            req = s.req
            blocks = self.kv.req_blocks[req.request_id]
            row = len(plan.token_ids)
            toks = req.all_token_ids[s.start:s.start + s.num_new]
            plan.token_ids.extend(toks)
            for p in range(s.start, s.start + s.num_new):
                plan.positions.append(p)
                plan.slot_mapping.append(blocks[p // bs] * bs + p % bs)
            needs_logits = s.start + s.num_new >= req.num_tokens
            sp = req.sp
            allow_eos = (self.allow_eos and not sp.ignore_eos and len(req.output_token_ids) >= sp.min_tokens)
            plan.seqs.append(SeqPlan(req.request_id, row, s.num_new, s.start, blocks, needs_logits,
                                     sp.temperature, sp.top_k, sp.top_p, allow_eos, req.rng))
        return plan

    # ------------------------------------------------------------- outputs
    def update_from_output(self, so: SchedulerOutput, sampled: dict[str, int], step_end_ns: int
                           ) -> tuple[list[EngineCoreOutput], list[Request], list[Request]]:
        """Apply a step's results. Returns (outputs, requests with their first token, finished)."""
        outputs: list[EngineCoreOutput] = []
        first: list[Request] = []
        finished: list[Request] = []
        for s in so.scheduled:
            req = s.req
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += s.num_new
            req.truth["computed_tokens"] += s.num_new
            self.kv.cache_full_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
            tok = sampled.get(req.request_id)
            if tok is None:
                continue  # partial prefill chunk: no output
            req.append_output(tok)
            if req.truth["first_token_ns"] is None:
                req.truth["first_token_ns"] = step_end_ns
                first.append(req)
            self._check_stop(req, tok)
            prefill_stats = None
            if not req.prefill_stats_sent:
                req.prefill_stats_sent = True
                nc = max(req.num_cached_tokens, 0)
                prefill_stats = PrefillStats(
                    num_prompt_tokens=len(req.prompt_token_ids),
                    num_computed_tokens=len(req.prompt_token_ids) - nc,
                    num_cached_tokens=nc,
                    num_local_cached_tokens=req.num_local_cached_tokens,
                    num_external_cached_tokens=req.num_external_cached_tokens,
                    num_cache_creation_tokens=0,
                )
            outputs.append(self.output_cls(
                request_id=req.request_id,
                new_token_ids=[tok],
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                events=req.take_events(),
                prefill_stats=prefill_stats,
            ))
            if req.finish_reason is not None:
                self.running.remove(req)
                self._finish(req, req.finish_reason)
                finished.append(req)
        return outputs, first, finished

    def _check_stop(self, req: Request, tok: int) -> None:
        sp = req.sp
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if tok == EOS_ID and not sp.ignore_eos:
                req.finish_reason = FinishReason.STOP
                return
            if sp.stop_token_ids and tok in sp.stop_token_ids:
                req.finish_reason = FinishReason.STOP
                req.stop_reason = tok
                return
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = FinishReason.LENGTH

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.cache_full_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
        self.kv.free(req.request_id)
        req.truth["finished_ns"] = time.monotonic_ns()
        req.truth["output_tokens"] = len(req.output_token_ids)
        req.truth["finish_reason"] = str(reason)
        self.requests.pop(req.request_id, None)
