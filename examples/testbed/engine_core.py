"""The EngineCore process (shaped like vLLM V1's EngineCoreProc).

Three threads, as in vLLM:
* input thread: DEALER (identity = engine index, u16 LE) connected to the API server's ROUTER.
  It first sends the ready message (a msgpack map modelled on vLLM's EngineCoreReadyResponse),
  then receives ``[type byte, msgpack]`` frames, decodes them and queues them for the core loop;
* main thread: the busy loop — drain inputs, then ``step()``: schedule → run the model on the
  batch (KV copies, forward, sample; on CUDA the sampled ids land in pinned host memory and the
  stream is synchronised) → update requests → hand the step's EngineCoreOutputs to the output
  thread. One EngineCoreOutputs per step, holding only the requests that got new tokens;
* output thread: PUSH connected to the API server's PULL; encodes and sends each step's message,
  then appends the step's (and finished requests') ground-truth lines.

With ``--api-server-count`` N each engine has N DEALERs and N PUSHes, one pair per engine client
(vLLM: per API server process), and sends each step's outputs as one message per client whose
requests got tokens (the stats ride on the first), as vLLM's scheduler groups them by
``client_index``.

With ``--data-parallel-size`` > 1 each engine also talks to the DP coordinator (coordinator.py), as
vLLM's DPEngineCoreProc: the input thread subscribes to its START_DP_WAVE publishes (XSUB), and
the output thread PUSHes it the engine's request counts after every step that changed them and,
from engine 0, ``wave_complete`` when the engine runs out of work.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Optional

import msgspec
import zmq

from .config import EngineConfig
from .kv_cache import KVCacheManager
from .protocol import (
    ENGINE_CORE_DEAD,
    AddDecoder,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    SchedulerStats,
    engine_identity,
    make_abort_decoder,
    make_encoder,
    output_class,
)
from .scheduler import Request, Scheduler
from .truth import TruthWriter

_SHUTDOWN = object()
_COORD = object()  # output-queue tag: a message for the DP coordinator


def _set_comm(name: str) -> None:
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def build_runner(cfg: EngineConfig):
    host_blocks = cfg.kv_offload_blocks if cfg.kv_offload else 0
    if cfg.device == "cpu":
        from .model_numpy import NumpyModelRunner

        return NumpyModelRunner(cfg.model, cfg.num_kv_blocks, cfg.block_size, host_blocks)
    from .model_torch import TorchModelRunner

    return TorchModelRunner(cfg.model, cfg.num_kv_blocks, cfg.block_size, host_blocks,
                            device="cuda" if cfg.device == "cuda" else "cpu", dtype=cfg.dtype,
                            cuda_graphs=cfg.cuda_graphs, max_num_seqs=cfg.max_num_seqs)


class EngineCoreProc:
    def __init__(self, cfg: EngineConfig, input_addrs: "str | list[str]", output_addrs: "str | list[str]",
                 parent_pid: Optional[int] = None, coord_addrs: Optional[tuple[str, str]] = None):
        self.cfg = cfg
        # one (input, output) address pair per engine client (API server), client_index order
        self.input_addrs = [input_addrs] if isinstance(input_addrs, str) else list(input_addrs)
        self.output_addrs = [output_addrs] if isinstance(output_addrs, str) else list(output_addrs)
        self.parent_pid = parent_pid
        # (the coordinator's back publish, its back output) when data-parallel
        self.coord_addrs = coord_addrs
        self.current_wave = 0
        self.engines_running = False
        self.stepped_in_wave = False
        self.last_counts = (0, 0)
        self.truth = TruthWriter(cfg.ground_truth)
        self.runner = build_runner(cfg)
        self.gpu_double = None
        if cfg.cupti_test_double:
            from .cupti_double import CuptiDoubleGpu

            self.gpu_double = CuptiDoubleGpu(cfg.model.n_layers, cfg.cuda_graphs)
        self.kv = KVCacheManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                 cfg.kv_offload_blocks if cfg.kv_offload else 0)
        self.sched = Scheduler(self.kv, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len,
                               cfg.log_stats, cfg.allow_eos, cfg.grammar_compile_ms, cfg.scheduling_policy,
                               output_class(cfg.vllm_wire))
        self.input_queue: "queue.Queue[Any]" = queue.Queue()
        self.output_queue: "queue.Queue[Any]" = queue.Queue()
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self.truth.write({"type": "engine_start", "pid": os.getpid(), "ns": time.monotonic_ns(),
                          "device": getattr(self.runner, "device", cfg.device), "config": cfg.to_dict(),
                          "cupti_test_double_init": self.gpu_double.init_rc if self.gpu_double else None})

    # ----------------------------------------------------------- IO threads
    def _ready_payload(self) -> bytes:
        dtype = getattr(self.runner, "dtype_name", "float32")
        ready: dict[str, Any] = {
            "max_model_len": self.cfg.max_model_len,
            "num_gpu_blocks": self.cfg.num_kv_blocks,
            "dp_stats_address": None,
            "dtype": dtype,
        }
        if self.cfg.vllm_wire == "0.34.0":
            # Every field of 0.34.0's EngineCoreReadyResponse (a dataclass: all by name, in its
            # order): its Rust frontend requires them.
            c = self.cfg
            ready = {
                "max_model_len": c.max_model_len, "num_gpu_blocks": c.num_kv_blocks, "block_size": c.block_size,
                "dp_stats_address": None, "dtype": dtype, "vllm_version": "0.34.0", "world_size": 1,
                "data_parallel_size": max(1, c.data_parallel_size), "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1, "decode_context_parallel_size": 1, "data_parallel_rank": c.engine_index,
                "max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
                "instance_id": f"testbed-{os.getpid()}", "supports_lora": False, "max_loras": 0,
                "mamba_block_size": None, "kv_cache_size_tokens": c.num_kv_blocks * c.block_size,
                "kv_cache_max_concurrency": None, "kv_events_config": None, "weight_transfer_backend": None,
                "enable_sleep_mode": False, "supports_draft_weight_updates": False,
                "effective_attention_block_size": c.block_size, "coord_store_port": 0,
                "coordinator_input_address": None, "coordinator_output_address": None, "vllm_config": None,
                "prefix_hash_config": None, "cache_config_info": None, "config_hash": None,
                "enable_expert_parallel": False,
            }
        return msgspec.msgpack.encode(ready)

    def process_input_socket(self) -> None:
        socks = []
        for addr in self.input_addrs:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, engine_identity(self.cfg.engine_index))
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            socks.append(sock)
        add_dec = AddDecoder()
        abort_dec = make_abort_decoder()
        coord = None
        if self.coord_addrs is not None:
            # vLLM: an XSUB to the coordinator's publish socket, subscribed to everything.
            coord = self.ctx.socket(zmq.XSUB)
            coord.setsockopt(zmq.LINGER, 0)
            coord.connect(self.coord_addrs[0])
            coord.send(b"\x01")
        try:
            # vLLM: "Send initial message to each input socket - this is required before the
            # front-end ROUTER socket can send input messages back to us."
            for sock in socks:
                sock.send(self._ready_payload())
            poller = zmq.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            if coord is not None:
                poller.register(coord, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(500))
                if not ready:
                    if self.parent_pid is not None and os.getppid() != self.parent_pid:
                        self.input_queue.put(_SHUTDOWN)
                        return
                    continue
                if coord is not None and coord in ready:
                    frames = coord.recv_multipart(copy=True)
                    if frames[0] == EngineCoreRequestType.START_DP_WAVE.value:
                        self.input_queue.put((EngineCoreRequestType.START_DP_WAVE,
                                              msgspec.msgpack.decode(frames[1]), time.monotonic_ns()))
                for sock in socks:
                    if sock not in ready:
                        continue
                    frames = sock.recv_multipart(copy=True)
                    t_ns = time.monotonic_ns()
                    rtype = EngineCoreRequestType(frames[0])
                    if rtype == EngineCoreRequestType.ADD:
                        self.input_queue.put((rtype, add_dec.decode(frames[1:]), t_ns))
                    elif rtype == EngineCoreRequestType.ABORT:
                        self.input_queue.put((rtype, abort_dec.decode(frames[1]), t_ns))
                    elif rtype == EngineCoreRequestType.UTILITY:
                        self.input_queue.put((rtype, msgspec.msgpack.decode(frames[1]), t_ns))
        except Exception:
            traceback.print_exc()
            self.input_queue.put(_SHUTDOWN)
        finally:
            for sock in socks:
                sock.close(linger=0)
            if coord is not None:
                coord.close(linger=0)

    def process_output_socket(self) -> None:
        socks = []
        for addr in self.output_addrs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 4000)
            sock.connect(addr)
            socks.append(sock)
        coord = None
        if self.coord_addrs is not None:
            # vLLM: the coordinator is the last output socket (client_index -1).
            coord = self.ctx.socket(zmq.PUSH)
            coord.setsockopt(zmq.SNDHWM, 0)
            coord.setsockopt(zmq.LINGER, 0)
            coord.connect(self.coord_addrs[1])
        enc = make_encoder()
        try:
            while True:
                item = self.output_queue.get()
                if item is _SHUTDOWN:
                    break
                if isinstance(item, bytes):  # raw frame (ENGINE_CORE_DEAD), to every client
                    for sock in socks:
                        sock.send(item)
                    continue
                if item[0] is _COORD:
                    if coord is not None:
                        coord.send(enc.encode(item[1]), copy=False)
                    continue
                msgs, step_rec, first_reqs, finished = item
                t_send = None
                # vLLM: one message per client, sent one after the other.
                for client, msg in msgs:
                    socks[client].send(enc.encode(msg), copy=False)
                    if t_send is None:
                        t_send = time.monotonic_ns()
                if step_rec is not None:
                    step_rec["output_send_ns"] = t_send
                    self.truth.write(step_rec)
                for r in first_reqs:
                    r.truth["first_output_send_ns"] = t_send
                for r in finished:
                    r.truth["finished_send_ns"] = t_send
                    r.truth["engine"] = self.cfg.engine_index
                    self.truth.write(r.truth)
        finally:
            for sock in socks:
                sock.close(linger=4000)
            if coord is not None:
                coord.close(linger=0)

    # ------------------------------------------------------------ core loop
    def _handle(self, item: Any) -> bool:
        if item is _SHUTDOWN:
            return False
        rtype, obj, t_ns = item
        if rtype == EngineCoreRequestType.ADD:
            assert isinstance(obj, EngineCoreRequest)
            if self.coord_addrs is not None:
                # vLLM DPEngineCoreProc.add_request: a request of an older, finished wave asks
                # the coordinator to start the next one.
                if obj.current_wave > self.current_wave:
                    self.current_wave = obj.current_wave
                elif obj.current_wave < self.current_wave and not self.engines_running:
                    self._to_coordinator(EngineCoreOutputs(engine_index=self.cfg.engine_index,
                                                           start_wave=self.current_wave))
                self.engines_running = True
            self.sched.add_request(obj, t_ns)
        elif rtype == EngineCoreRequestType.START_DP_WAVE:
            new_wave, exclude = obj
            if exclude != self.cfg.engine_index and new_wave >= self.current_wave:
                self.current_wave = new_wave
                self.engines_running = True
        elif rtype == EngineCoreRequestType.ABORT:
            aborted = self.sched.abort_requests(list(obj))
            if aborted:
                self.output_queue.put(([], None, [], aborted))
        elif rtype == EngineCoreRequestType.UTILITY:
            # [client_index, call_id, method, args] -> UtilityOutput [call_id, failure, [type, value]]
            try:
                client, call_id, _method, _args = obj
            except Exception:
                client, call_id = 0, 0
            client = client if 0 <= client < len(self.output_addrs) else 0
            self.output_queue.put(([(client, EngineCoreOutputs(engine_index=self.cfg.engine_index,
                                                               utility_output=[call_id, None, [None, None]]))],
                                   None, [], []))
        return True

    def _process_input_queue(self) -> bool:
        if not self.sched.has_work():
            while True:
                try:
                    item = self.input_queue.get(timeout=1.0)
                    break
                except queue.Empty:
                    if self._stop.is_set():
                        return False
            if not self._handle(item):
                return False
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return True
            if not self._handle(item):
                return False

    def step(self) -> None:
        t0 = time.monotonic_ns()
        so = self.sched.schedule()
        if not so.scheduled:
            time.sleep(0.001)  # all that waits is held for its grammar (or, never yet seen, does not fit)
            return
        plan = self.sched.build_plan(so)
        t_sched = time.monotonic_ns()
        sampled, copies, marks = self.runner.execute(plan, so.copy_ops)
        if self.gpu_double is not None:
            self.gpu_double.step(so.num_tokens, all(s.kind == "decode" for s in so.scheduled), copies, marks,
                                 len(sampled))
        if self.cfg.step_sleep_ms > 0:
            time.sleep(self.cfg.step_sleep_ms / 1000.0)
        t_model = time.monotonic_ns()
        outputs, first, finished = self.sched.update_from_output(so, sampled, t_model)
        by_id: dict[str, Request] = {s.req.request_id: s.req for s in so.scheduled}
        copy_recs = []
        for c in copies:
            rec = {"req": c.req_id, "dir": c.dir, "start_ns": c.start_ns, "end_ns": c.end_ns,
                   "bytes": c.bytes, "blocks": c.blocks}
            copy_recs.append(rec)
            r = by_id.get(c.req_id)
            if r is not None:
                r.truth["kv_copies"].append({k: rec[k] for k in ("start_ns", "end_ns", "bytes", "dir")})
        # As vLLM (Scheduler.update_from_output): one message per client whose requests got
        # tokens, in the order of their first output; the step's stats ride on the first, or on
        # client 0's message, which is then sent even when no request got tokens this step (a
        # partial prefill chunk).
        stats = self.sched.make_stats(self.kv.usage)
        per_client: dict[int, list] = {}
        for o in outputs:
            per_client.setdefault(by_id[o.request_id].client_index, []).append(o)
        msgs = [(c, EngineCoreOutputs(engine_index=self.cfg.engine_index, outputs=outs))
                for c, outs in per_client.items()]
        if stats is not None:
            if not msgs:
                msgs.append((0, EngineCoreOutputs(engine_index=self.cfg.engine_index)))
            msgs[0][1].scheduler_stats = stats
        # The step ends when its output is built: the (first) message's own timestamp (what the
        # engine tells and hopscope reads), not a second clock read after it, which a thread
        # switch between the two put 1.8 ms later on a loaded VM.
        t_end = round(msgs[0][1].timestamp * 1e9) if msgs else time.monotonic_ns()
        step_rec = None
        if self.truth.enabled:
            step_rec = {
                "type": "step",
                "engine": self.cfg.engine_index,
                "step": so.step,
                "start_ns": t0,
                "end_ns": t_end,
                "schedule_end_ns": t_sched,
                "copies_end_ns": marks.get("copies_end_ns"),
                "forward_end_ns": marks.get("forward_end_ns"),
                "sample_end_ns": marks.get("sample_end_ns"),
                "num_tokens": so.num_tokens,
                "members": [{"req": s.req.request_id, "tokens": s.num_new, "kind": s.kind,
                             "chunk_start": s.start} for s in so.scheduled],
                "outputs": [o.request_id for o in outputs],
                "preempted": so.preempted,
                "kv_copies": copy_recs,
                "num_running": len(self.sched.running),
                "num_waiting": len(self.sched.waiting),
                "kv_usage": round(self.kv.usage, 4),
                "device": getattr(self.runner, "device", "cpu"),
            }
        if step_rec is not None and len(msgs) > 1:
            step_rec["messages"] = len(msgs)
        self.output_queue.put((msgs, step_rec, first, finished))

    def _to_coordinator(self, msg: EngineCoreOutputs) -> None:
        self.output_queue.put((_COORD, msg))

    def _maybe_publish_request_counts(self) -> None:
        """vLLM: the engine's (running, waiting) counts for the coordinator's load balancing, when
        they changed; a SchedulerStats with nothing else filled (no KV usage)."""
        counts = (len(self.sched.running), len(self.sched.waiting))
        if counts != self.last_counts:
            self.last_counts = counts
            self._to_coordinator(EngineCoreOutputs(
                engine_index=self.cfg.engine_index,
                scheduler_stats=SchedulerStats(num_running_reqs=counts[0], num_waiting_reqs=counts[1],
                                               step_counter=self.sched.step_counter,
                                               current_wave=self.current_wave)))

    def _maybe_end_wave(self) -> None:
        """Out of work after stepping: the wave ends (vLLM decides it across ranks, idle ones running
        dummy batches meanwhile; here engine 0 tells when it is done)."""
        if self.engines_running and self.stepped_in_wave and not self.sched.has_work():
            self.engines_running = self.stepped_in_wave = False
            if self.cfg.engine_index == 0:
                self._to_coordinator(EngineCoreOutputs(engine_index=0, wave_complete=self.current_wave))
            self.current_wave += 1

    def run(self) -> None:
        tin = threading.Thread(target=self.process_input_socket, name="EngineCoreInput", daemon=True)
        tout = threading.Thread(target=self.process_output_socket, name="EngineCoreOutput", daemon=True)
        tout.start()
        tin.start()
        try:
            while self._process_input_queue():
                if self.sched.has_work():
                    self.step()
                    self.stepped_in_wave = True
                if self.coord_addrs is not None:
                    self._maybe_publish_request_counts()
                    self._maybe_end_wave()
        except Exception:
            traceback.print_exc()
            self.output_queue.put(ENGINE_CORE_DEAD)
            raise
        finally:
            self._stop.set()
            self.output_queue.put(_SHUTDOWN)
            tout.join(timeout=5)
            tin.join(timeout=2)
            self.truth.write({"type": "engine_stop", "pid": os.getpid(), "ns": time.monotonic_ns(),
                              "steps": self.sched.step_counter, "preemptions": self.sched.num_preemptions,
                              "evictions": self.kv.num_evictions, "offloaded_blocks": self.kv.num_offloaded_blocks,
                              "onloaded_blocks": self.kv.num_onloaded_blocks,
                              "cupti_test_double_unplaced": self.gpu_double.unplaced if self.gpu_double else None})
            self.truth.close()
            self.ctx.term()


def run_engine_core(cfg: EngineConfig, input_addr: "str | list[str]", output_addr: "str | list[str]",
                    parent_pid: Optional[int] = None, coord_addrs: Optional[tuple[str, str]] = None) -> None:
    """Process entry point (multiprocessing 'spawn' target)."""
    _set_comm(f"EngineCore_DP{cfg.engine_index}")

    def _term(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server shuts us down
    try:
        EngineCoreProc(cfg, input_addr, output_addr, parent_pid, coord_addrs).run()
    except SystemExit:
        pass
    except Exception:
        traceback.print_exc()
        sys.exit(1)
