"""The API server process: FastAPI app + an AsyncLLM-like ZeroMQ client of the engine.

* ``AsyncEngineClient`` binds the input ROUTER and the output PULL on ``ipc://`` paths (the
  engines, started by launcher.py, connect to them: ``--data-parallel-size N``: N of them,
  ``EngineCore_DP<i>``, each its own DEALER identity on the one ROUTER and PUSH to the one PULL,
  as vLLM's DP client; each request goes to the engine with the fewest requests in flight; a DP
  coordinator process as vLLM's, coordinator.py; ``--api-server-count N``: N API server
  processes, each its own client with its own ROUTER/PULL pair and ``client_index``, see
  serve.py), waits for the engines' ready messages, then runs an output-handler task that
  decodes every EngineCoreOutputs, detokenises incrementally, applies stop strings (aborting the
  engine request, as vLLM's output processor does) and feeds per-request queues.
* Endpoints: ``/v1/chat/completions``, ``/v1/completions`` (streaming SSE and plain JSON),
  ``/v1/responses``, ``/v1/messages`` (Anthropic's, as vLLM's Python frontend serves it),
  ``/v1/models``, ``/health``, ``/version``.
* Request ids as vLLM: ``chatcmpl-<base>`` / ``cmpl-<base>`` with base = ``X-Request-Id`` header,
  else the body's ``request_id``, else 16 random hex; the engine request id is
  ``<external id>-<8 hex>`` with ``external_req_id`` = the external id (for chat = the SSE id; for
  completions prompt i is ``cmpl-<base>-<i>``).
* SSE as vLLM: every event is yielded as its own string (Starlette turns each into one ASGI body
  message, uvicorn into one ``transport.write``).
* Ground truth (``--ground-truth``): one ``{"type": "http"}`` line per HTTP request, see README.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import msgspec
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import EMULATED_VLLM_VERSION, __version__
from .config import EngineConfig
from .coordinator import CoordinatorAddrs
from .launcher import Engines, client_ipc_names, coordinator_addrs
from .protocol import (
    ENGINE_CORE_DEAD,
    AddEncoder,
    EngineCoreRequest,
    EngineCoreRequestType,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    make_encoder,
    make_outputs_decoder,
    random_uuid,
    request_class,
)
from .tokenizer import ByteTokenizer, IncrementalDetokenizer
from .truth import TruthWriter


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@dataclass
class Delta:
    text: str
    num_tokens: int
    finish_reason: Optional[str]
    stop_reason: Any = None


@dataclass
class RequestState:
    engine_id: str
    external_id: str
    prompt_len: int
    stop: list[str]
    include_stop: bool
    detok: IncrementalDetokenizer
    queue: "asyncio.Queue[Delta]" = field(default_factory=asyncio.Queue)
    text: str = ""
    sent: int = 0
    holdback: int = 0
    num_output_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False
    truth: Optional[dict] = None


class EngineDeadError(RuntimeError):
    pass


class AsyncEngineClient:
    """One engine client (vLLM: one API server process's AsyncMPClient): its own input ROUTER and
    output PULL, ``client_index`` in every request, every engine of the testbed behind them. With
    ``engines`` it also watches the engine processes (it runs in the process that started them)."""

    def __init__(self, cfg: EngineConfig, ipc_dir: str, ipc_names: tuple[str, str], client_index: int = 0,
                 engines: Optional[Engines] = None):
        self.cfg = cfg
        self.ipc_dir = ipc_dir
        self.ipc_names = ipc_names
        self.client_index = client_index
        self.engines = engines
        self.n_engines = max(1, cfg.data_parallel_size)
        self.states: dict[str, RequestState] = {}
        self.encoder = make_encoder()
        self.add_encoder = AddEncoder(cfg.vllm_wire)
        # per engine identity: its requests in flight (routing); per engine request: its engine
        self.inflight: dict[bytes, int] = {}
        self.engine_of: dict[str, bytes] = {}
        self.ready: dict = {}
        self.dead = False
        self._output_task: Optional[asyncio.Task] = None
        self._monitor_task: Optional[asyncio.Task] = None
        # data parallel: our XSUB to the coordinator's publishes, and the wave state it publishes
        # (vLLM's DPLBAsyncMPClient)
        self.coord: Optional[CoordinatorAddrs] = coordinator_addrs(ipc_dir, ipc_names) if self.n_engines > 1 else None
        self.coord_sock = None
        self._coord_task: Optional[asyncio.Task] = None
        self.current_wave = 0
        self.engines_running = False

    async def start(self, timeout_s: float = 120.0) -> None:
        """Binds this client's sockets, then waits for every engine's ready message on them."""
        self.ctx = zmq.asyncio.Context()
        names = client_ipc_names(self.ipc_names, self.client_index)
        self.input_addr = f"ipc://{self.ipc_dir}/{names[0]}"
        self.output_addr = f"ipc://{self.ipc_dir}/{names[1]}"
        self.input_sock = self.ctx.socket(zmq.ROUTER)
        self.input_sock.setsockopt(zmq.RCVHWM, 0)
        self.input_sock.setsockopt(zmq.SNDHWM, 0)
        self.input_sock.bind(self.input_addr)
        self.output_sock = self.ctx.socket(zmq.PULL)
        self.output_sock.setsockopt(zmq.RCVHWM, 0)
        self.output_sock.bind(self.output_addr)
        if self.coord is not None:
            self.coord_sock = self.ctx.socket(zmq.XSUB)
            self.coord_sock.setsockopt(zmq.LINGER, 0)
            self.coord_sock.connect(self.coord.front_publish)
            await self.coord_sock.send(b"\x01")
        deadline = time.monotonic() + timeout_s
        # every engine's ready message: only then can we route to it
        while len(self.inflight) < self.n_engines:
            if await self.input_sock.poll(200):
                ident, payload = await self.input_sock.recv_multipart()
                self.inflight[ident] = 0
                self.ready = msgspec.msgpack.decode(payload)
                continue
            if self.engines is not None and (gone := self.engines.dead()):
                raise RuntimeError(f"engine process {', '.join(gone)} during startup")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.n_engines - len(self.inflight)} of {self.n_engines} engines "
                                   f"did not connect to API server {self.client_index} in time")
        self._output_task = asyncio.create_task(self._output_loop(self.output_sock), name="output_handler")
        if self.coord_sock is not None:
            self._coord_task = asyncio.create_task(self._coord_loop(), name="dp_stats")
        if self.engines is not None:
            self._monitor_task = asyncio.create_task(self._monitor(), name="engine_monitor")

    async def _monitor(self) -> None:
        """Like vLLM's engine-death monitor: fail waiting requests if an engine process dies."""
        assert self.engines is not None
        while not (gone := self.engines.dead()):
            await asyncio.sleep(1.0)
        self.fail(f"engine process {', '.join(gone)}")

    def fail(self, why: str) -> None:
        """The engines are gone: every waiting request ends with an error."""
        self.dead = True
        for st in list(self.states.values()):
            st.queue.put_nowait(Delta("", 0, "error", why))
        self.states.clear()

    async def _coord_loop(self) -> None:
        """vLLM's DP stats task: the coordinator's load/wave publishes ([[waiting, running]…], wave,
        running). Routing here stays by requests in flight; only the wave state is used."""
        while True:
            _counts, wave, running = msgspec.msgpack.decode(await self.coord_sock.recv())
            if wave > self.current_wave or (wave == self.current_wave and not running):
                self.current_wave, self.engines_running = wave, running

    async def shutdown(self) -> None:
        """Closes this client's sockets (the engines are stopped by whoever started them)."""
        for task in (self._output_task, self._monitor_task, self._coord_task):
            if task is not None:
                task.cancel()
        for sock in (getattr(self, "input_sock", None), getattr(self, "output_sock", None), self.coord_sock):
            if sock is not None:
                sock.close(linger=0)
        if hasattr(self, "ctx"):
            self.ctx.term()

    # ------------------------------------------------------------- requests
    async def add_request(self, ecr: EngineCoreRequest, state: RequestState) -> tuple[int, int]:
        """Sends the ADD; returns the clock just before and just after the send: the hand-over to
        ZMQ happened in between (a truth mark is a bracket, not an instant)."""
        if self.dead:
            raise EngineDeadError("engine core is dead")
        self.states[ecr.request_id] = state
        # vLLM's DP load balancing: the engine with the fewest requests (ties: the lowest index)
        ident = min(self.inflight, key=lambda i: (self.inflight[i], i))
        self.inflight[ident] += 1
        if self.coord_sock is not None:
            ecr.current_wave = self.current_wave
        ecr.client_index = self.client_index
        self.engine_of[ecr.request_id] = ident
        frames = self.add_encoder.encode(ecr)
        t_submit = time.monotonic_ns()
        await self.input_sock.send_multipart([ident, EngineCoreRequestType.ADD.value, *frames], copy=False)
        t_sent = time.monotonic_ns()
        if self.coord_sock is not None and not self.engines_running:
            # vLLM: after the ADD, tell the coordinator to wake the other engines.
            self.engines_running = True
            await self.coord_sock.send(msgspec.msgpack.encode((int.from_bytes(ident, "little"), self.current_wave)))
        return t_submit, t_sent

    def _done(self, engine_id: str) -> None:
        ident = self.engine_of.pop(engine_id, None)
        if ident is not None:
            self.inflight[ident] -= 1

    async def abort(self, engine_ids: list[str]) -> None:
        per_engine: dict[bytes, list[str]] = {}
        for i in engine_ids:
            st = self.states.pop(i, None)
            if st is not None:
                st.finished = True
            ident = self.engine_of.get(i)
            if ident is not None:
                per_engine.setdefault(ident, []).append(i)
                self._done(i)
        if self.dead:
            return
        for ident, ids in per_engine.items():
            await self.input_sock.send_multipart([ident, EngineCoreRequestType.ABORT.value,
                                                  self.encoder.encode(ids)], copy=False)

    async def _output_loop(self, sock) -> None:
        dec = make_outputs_decoder()
        try:
            while True:
                frames = await sock.recv_multipart(copy=True)
                t_recv = time.monotonic_ns()
                if frames[0] == ENGINE_CORE_DEAD:
                    raise EngineDeadError("engine reported ENGINE_CORE_DEAD")
                outs = dec.decode(frames[0])
                to_abort: list[str] = []
                for o in outs.outputs:
                    st = self.states.get(o.request_id)
                    if st is None or st.finished:
                        continue
                    if st.truth is not None and "first_output_recv_ns" not in st.truth:
                        st.truth["first_output_recv_ns"] = t_recv
                    if o.prefill_stats is not None:
                        st.cached_tokens = o.prefill_stats.num_cached_tokens
                    text = st.detok.feed(o.new_token_ids)
                    st.num_output_tokens += len(o.new_token_ids)
                    finish = str(o.finish_reason) if o.finish_reason is not None else None
                    stop_reason = o.stop_reason
                    if finish is not None:
                        text += st.detok.flush()
                    prev = len(st.text)
                    st.text += text
                    if st.stop:
                        for s in st.stop:
                            idx = st.text.find(s, max(0, prev - len(s) + 1))
                            if idx != -1:
                                st.text = st.text[: idx + len(s) if st.include_stop else idx]
                                if finish is None:
                                    to_abort.append(o.request_id)
                                finish, stop_reason = "stop", s
                                break
                    # as vLLM, hold back the last len(longest stop)-1 characters while streaming,
                    # since they may turn out to be the start of a stop string
                    limit = len(st.text) if finish is not None else max(st.sent, len(st.text) - st.holdback)
                    delta = st.text[st.sent:limit]
                    st.sent = limit
                    st.queue.put_nowait(Delta(delta, len(o.new_token_ids), finish, stop_reason))
                    if finish is not None:
                        st.finished = True
                        self.states.pop(o.request_id, None)
                        if o.request_id not in to_abort:  # abort() still routes those
                            self._done(o.request_id)
                if to_abort:
                    await self.abort(to_abort)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # engine died or bad message: fail every waiting request
            self.fail(repr(e))


# ---------------------------------------------------------------------- app

def _error(msg: str, code: int = 400, typ: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": typ, "param": None, "code": code}}, status_code=code)


def _base_request_id(request: Request, body_request_id: Optional[str]) -> str:
    default = body_request_id or random_uuid()
    return request.headers.get("X-Request-Id", default)


def _truth(request: Request) -> Optional[dict]:
    return request.scope.get("testbed.truth")


async def _read_body(request: Request, rec: Optional[dict]) -> Optional[Any]:
    """The request's JSON (None when it is not JSON), the truth stamped when it was read."""
    try:
        body = await request.json()
    except Exception:
        return None
    if rec is not None:
        rec["body_read_ns"] = time.monotonic_ns()
        rec["x_session_id"] = request.headers.get("x-session-id")
        rec["traceparent"] = request.headers.get("traceparent")
    return body


def _usage(prompt_tokens: int, completion_tokens: int, cached: int, details: bool) -> dict:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                         "completion_tokens": completion_tokens}
    if details:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


class TruthMiddleware:
    """Pure ASGI middleware: creates the per-request truth record and stamps every body write."""

    def __init__(self, app, writer: TruthWriter):
        self.app = app
        self.writer = writer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.writer.enabled:
            await self.app(scope, receive, send)
            return
        t_asgi = time.monotonic_ns()
        rec: dict[str, Any] = {
            "type": "http", "pid": os.getpid(), "id": None, "path": scope.get("path"),
            "method": scope.get("method"),
            "http_arrive_ns": scope.get("testbed.arrive_ns") or t_asgi, "asgi_start_ns": t_asgi,
            "submit_ns": None, "response_start_ns": None, "first_sse_write_ns": None,
            "content_write_ns": [], "done_ns": None, "status": None, "stream": False,
            "_kinds": [], "_n": 0,
        }
        scope["testbed.truth"] = rec

        async def send_wrapper(message):
            t = time.monotonic_ns()
            mark = None  # a mark also stamped once the write returned (its bracket's end)
            mt = message["type"]
            if mt == "http.response.start":
                rec["response_start_ns"] = t
                rec["status"] = message.get("status")
            elif mt == "http.response.body":
                body = message.get("body", b"")
                if body:
                    k = rec["_n"]
                    rec["_n"] = k + 1
                    kinds = rec["_kinds"]
                    kind = kinds[k] if k < len(kinds) else "body"
                    if kind == "content":
                        if rec["first_sse_write_ns"] is None:
                            rec["first_sse_write_ns"] = t
                            mark = "first_sse_sent_ns"
                        rec["content_write_ns"].append(t)
                    elif kind == "done":
                        rec["done_ns"] = t
                        mark = "done_sent_ns"
                    elif kind == "body":  # non-streaming JSON
                        rec["done_ns"] = t
                        mark = "done_sent_ns"
                if not message.get("more_body", False):
                    rec["body_end_ns"] = t
                    if rec["done_ns"] is None:
                        rec["done_ns"] = t
                        mark = "done_sent_ns"
            await send(message)
            if mark is not None:
                rec[mark] = time.monotonic_ns()

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            rec["app_exit_ns"] = time.monotonic_ns()
            kinds = rec.pop("_kinds")
            rec.pop("_n")
            rec["sse_events"] = len(kinds)
            self.writer.write(rec)


def _install_timed_protocol() -> Any:
    """uvicorn httptools protocol that stamps the time the request's first bytes were received
    (data_received), which is as early as the application can see an HTTP request."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except Exception:
        return "auto"

    class TimedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
        _testbed_rx_ns = 0

        def data_received(self, data: bytes) -> None:
            self._testbed_rx_ns = time.monotonic_ns()
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["testbed.arrive_ns"] = self._testbed_rx_ns or time.monotonic_ns()  # type: ignore

    return TimedHttpToolsProtocol


def build_app(client: AsyncEngineClient, cfg: EngineConfig, truth: TruthWriter,
              enable_request_id_headers: bool = False, prompt_tokens_details: bool = True,
              forward_trace_headers: bool = False) -> Any:
    app = FastAPI(title="hopscope testbed (vLLM-shaped)", version=__version__)
    tok = ByteTokenizer()
    model_name = cfg.model_name
    max_model_len = cfg.max_model_len
    # a prompt must fit the model and the whole KV pool, or the engine could never schedule it
    max_prompt_len = min(max_model_len, cfg.num_kv_blocks * cfg.block_size)

    @app.get("/health")
    async def health() -> Response:
        if client.dead:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": EMULATED_VLLM_VERSION, "testbed": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": model_name, "parent": None, "max_model_len": max_model_len, "permission": []}]}

    def _tokenized(rec: Optional[dict], rid: str, prompts: list[list[int]]) -> Optional[JSONResponse]:
        """Stamps the request's id and tokenisation in the truth; the error for a prompt too long."""
        if rec is not None:
            rec["id"] = rid
            rec["tokenize_end_ns"] = time.monotonic_ns()
        for p in prompts:
            if len(p) >= max_prompt_len:
                return _error(f"This model's maximum context length is {max_prompt_len} tokens. However, your "
                              f"request has {len(p)} input tokens.")
        return None

    def _sampling_params(body: dict, prompt_len: int, default_max: Optional[int], stream: bool,
                         structured: Any = "from-body") -> SamplingParams:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
        max_tokens = max(1, min(int(max_tokens), max_model_len - prompt_len))
        stop = body.get("stop")
        return SamplingParams(
            n=1,
            presence_penalty=float(body.get("presence_penalty") or 0.0),
            frequency_penalty=float(body.get("frequency_penalty") or 0.0),
            temperature=float(body["temperature"]) if body.get("temperature") is not None else 1.0,
            top_p=float(body["top_p"]) if body.get("top_p") is not None else 1.0,
            top_k=int(body.get("top_k") or 0),
            seed=body.get("seed"),
            stop=stop,
            stop_token_ids=body.get("stop_token_ids"),
            ignore_eos=bool(body.get("ignore_eos", False)),
            max_tokens=max_tokens,
            min_tokens=int(body.get("min_tokens") or 0),
            include_stop_str_in_output=bool(body.get("include_stop_str_in_output", False)),
            skip_reading_prefix_cache=None,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=_structured_outputs(body) if structured == "from-body" else structured,
        )

    def _structured_outputs(body: dict) -> Optional[StructuredOutputsParams]:
        """The constraint vLLM's OpenAI server makes of a request (``to_sampling_params``).

        ``response_format`` json_schema / json_object / structural_tag, vLLM's own
        ``structured_outputs`` body field, the older ``guided_*`` fields, and a required or named
        ``tool_choice`` (vLLM holds the arguments to the tools' JSON schema). The backend is what
        vLLM's ``auto`` picks for these: xgrammar.
        """
        so = None
        rf = body.get("response_format") or {}
        if isinstance(rf, dict) and rf.get("type") == "json_schema":
            so = StructuredOutputsParams(json=(rf.get("json_schema") or {}).get("schema") or {})
        elif isinstance(rf, dict) and rf.get("type") == "json_object":
            so = StructuredOutputsParams(json_object=True)
        elif isinstance(rf, dict) and rf.get("type") == "structural_tag":
            so = StructuredOutputsParams(structural_tag=json.dumps(rf))
        elif isinstance(body.get("structured_outputs"), dict):
            so = StructuredOutputsParams(**{k: v for k, v in body["structured_outputs"].items()
                                            if k in ("json", "regex", "choice", "grammar", "json_object",
                                                     "structural_tag")})
        elif any(body.get(f"guided_{k}") is not None for k in ("json", "regex", "choice", "grammar")):
            k = next(k for k in ("json", "regex", "choice", "grammar") if body.get(f"guided_{k}") is not None)
            so = StructuredOutputsParams(**{k: body[f"guided_{k}"]})
        elif body.get("tools") and (body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict)):
            so = StructuredOutputsParams(json={"type": "array", "items": [t.get("function", {}) for t in body["tools"]]})
        if so is not None:
            so._backend, so._backend_was_auto = "xgrammar", True
        return so

    def _responses_structured_outputs(body: dict) -> Optional[StructuredOutputsParams]:
        """The Responses API's constraint as vLLM makes it (``extract_structured_outputs``): its
        ``text.format`` (``json_schema`` with the schema under ``schema``, or ``json_object``:
        the chat API's ``response_format`` of the same constraint), else vLLM's own
        ``structured_outputs`` field; never ``response_format`` or tools."""
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(fmt, dict):
            so = body.get("structured_outputs")
            return _structured_outputs({"structured_outputs": so}) if isinstance(so, dict) else None
        if body.get("structured_outputs") is not None:
            raise ValueError("Cannot specify both structured_outputs and text.format")
        if fmt.get("type") == "json_object" or (fmt.get("type") == "json_schema" and fmt.get("schema") is not None):
            return _structured_outputs({"response_format": {"type": fmt["type"], "json_schema": {"schema": fmt.get("schema")}}})
        return None

    async def _submit(request: Request, external_id: str, prompt_ids: list[int], sp: SamplingParams,
                      body: dict, rec: Optional[dict]) -> RequestState:
        engine_id = f"{external_id}-{random_uuid()[:8]}"
        trace_headers = None
        if forward_trace_headers:
            th = {k: v for k, v in request.headers.items() if k.lower() in ("traceparent", "tracestate")}
            trace_headers = th or None
        ecr = request_class(cfg.vllm_wire)(
            request_id=engine_id,
            prompt_token_ids=prompt_ids,
            mm_features=None,
            sampling_params=sp,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=body.get("cache_salt"),
            data_parallel_rank=None,
            client_index=0,
            current_wave=0,
            priority=int(body.get("priority") or 0),
            trace_headers=trace_headers,
            external_req_id=external_id,
        )
        st = RequestState(engine_id, external_id, len(prompt_ids), list(sp.stop or []),
                          sp.include_stop_str_in_output, IncrementalDetokenizer(sp.skip_special_tokens), truth=rec)
        if st.stop and not sp.include_stop_str_in_output:
            st.holdback = max(len(x) for x in st.stop) - 1
        t_submit, t_sent = await client.add_request(ecr, st)
        if rec is not None:
            if rec["submit_ns"] is None:
                rec["submit_ns"] = t_submit
                rec["submit_sent_ns"] = t_sent
            rec.setdefault("engine_request_ids", []).append(engine_id)
            rec.setdefault("external_ids", []).append(external_id)
        return st

    async def _start_chat(request: Request, rec: Optional[dict], body: dict, rid: str,
                          messages: list[dict], stream: bool) -> RequestState | JSONResponse:
        """A chat's way into the engine, which the Messages API shares as vLLM's does: its
        messages tokenised (stamped in the truth), its sampling params, its engine request
        submitted; the error response when the prompt is too long or the engine is dead."""
        prompt_ids = tok.apply_chat_template(messages)
        if (err := _tokenized(rec, rid, [prompt_ids])) is not None:
            return err
        sp = _sampling_params(body, len(prompt_ids), None, stream)
        try:
            return await _submit(request, rid, prompt_ids, sp, body, rec)
        except EngineDeadError as e:
            return _error(str(e), 500, "InternalServerError")

    async def _collect(st: RequestState) -> tuple[str, Optional[str], Any]:
        finish, stop_reason = None, None
        while finish is None:
            d = await st.queue.get()
            finish, stop_reason = d.finish_reason, d.stop_reason
        return st.text, finish, stop_reason

    async def _next_merged(st: RequestState) -> Delta:
        d = await st.queue.get()
        while d.finish_reason is None and not st.queue.empty():  # consumer lagged: merge as vLLM
            n = st.queue.get_nowait()
            d = Delta(d.text + n.text, d.num_tokens + n.num_tokens, n.finish_reason, n.stop_reason)
        return d

    async def _disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _unless_gone(request: Request, states: list[RequestState], work: Any) -> Any:
        """``await work``, or None once the client has disconnected (``work`` cancelled, the
        engine requests of ``states`` aborted): vLLM's ``with_cancellation`` on its handlers. A
        non-streamed answer is written only at the end, so nothing else notices a client that
        left. A cancelled handler aborts them too."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            _abort_later(states)
            raise
        finally:
            gone.cancel()
        if task in done:
            return task.result()
        task.cancel()
        _abort_later(states)
        return None

    def _abort_later(states: list[RequestState]) -> None:
        ids = [s.engine_id for s in states if not s.finished]
        if ids:
            asyncio.get_running_loop().create_task(client.abort(ids))

    def _finish_truth(rec: Optional[dict], states: list[RequestState], finish: Any) -> None:
        if rec is None:
            return
        rec["prompt_tokens"] = sum(s.prompt_len for s in states)
        rec["completion_tokens"] = sum(s.num_output_tokens for s in states)
        rec["cached_tokens"] = sum(s.cached_tokens for s in states)
        rec["finish_reason"] = finish

    # ------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        rec = _truth(request)
        body = await _read_body(request, rec)
        if body is None:
            return _error("invalid JSON body")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error("messages must be a non-empty list")
        if body.get("n", 1) != 1:
            return _error("only n=1 is supported by the testbed")
        rid = f"chatcmpl-{_base_request_id(request, body.get('request_id'))}"
        stream = bool(body.get("stream", False))
        so = body.get("stream_options") or {}
        include_usage = bool(so.get("include_usage", False))
        continuous_usage = bool(so.get("continuous_usage_stats", False)) and include_usage
        st = await _start_chat(request, rec, body, rid, messages, stream)
        if isinstance(st, Response):
            return st
        created = int(time.time())
        headers = {}
        if enable_request_id_headers:
            headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        if rec is not None:
            rec["stream"] = stream

        if not stream:
            got = await _unless_gone(request, [st], _collect(st))
            if got is None:
                return Response(status_code=499)  # never sent: the client is gone
            text, finish, stop_reason = got
            _finish_truth(rec, [st], finish)
            usage = _usage(st.prompt_len, st.num_output_tokens, st.cached_tokens, prompt_tokens_details)
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                                     "annotations": None, "audio": None, "function_call": None,
                                                     "tool_calls": [], "reasoning_content": None},
                             "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}],
                "service_tier": None, "system_fingerprint": None, "usage": usage,
                "prompt_logprobs": None, "kv_transfer_params": None}, headers=headers)

        kinds = rec["_kinds"] if rec is not None else []

        def chunk(choices: list, usage: Optional[dict] = None) -> str:
            c: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": model_name, "choices": choices}
            if usage is not None:
                c["usage"] = usage
            return f"data: {_dumps(c)}\n\n"

        async def gen() -> AsyncIterator[str]:
            finish = None
            role_sent = False
            try:
                while finish is None:
                    d = await _next_merged(st)
                    if not role_sent:
                        # vLLM sends the role chunk with the first output, not before: a request
                        # still queued or prefilling has sent no body (and no id) yet.
                        role_sent = True
                        kinds.append("role")
                        cu = (_usage(st.prompt_len, 0, st.cached_tokens, prompt_tokens_details)
                              if continuous_usage else None)
                        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}], cu)
                    finish = d.finish_reason
                    if d.text == "" and finish is None and d.num_tokens == 0:
                        continue
                    # An output whose text is held back (a stop string may be starting) still
                    # goes out, with empty content, as vLLM's chat stream sends it (no parser).
                    choice: dict[str, Any] = {"index": 0, "delta": {"content": d.text}, "logprobs": None,
                                              "finish_reason": finish}
                    if finish is not None:
                        choice["stop_reason"] = d.stop_reason
                    cu = (_usage(st.prompt_len, st.num_output_tokens, st.cached_tokens, prompt_tokens_details)
                          if continuous_usage else None)
                    kinds.append("content" if d.text else "finish" if finish is not None else "empty")
                    yield chunk([choice], cu)
                if include_usage:
                    kinds.append("usage")
                    yield chunk([], _usage(st.prompt_len, st.num_output_tokens, st.cached_tokens,
                                           prompt_tokens_details))
                _finish_truth(rec, [st], finish)
                kinds.append("done")
                yield "data: [DONE]\n\n"
            finally:
                if finish is None:
                    _abort_later([st])

        return StreamingResponse(gen(), media_type="text/event-stream", headers=headers)

    # ------------------------------------------------------- completions
    @app.post("/v1/completions")
    async def completions(request: Request):
        rec = _truth(request)
        body = await _read_body(request, rec)
        if body is None:
            return _error("invalid JSON body")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [tok.encode(prompt, add_bos=True)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [tok.encode(p, add_bos=True) for p in prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            return _error("prompt must be a string, a list of strings or token ids")
        if body.get("n", 1) != 1:
            return _error("only n=1 is supported by the testbed")
        rid = f"cmpl-{_base_request_id(request, body.get('request_id'))}"
        if (err := _tokenized(rec, rid, prompts)) is not None:
            return err
        stream = bool(body.get("stream", False))
        so = body.get("stream_options") or {}
        include_usage = bool(so.get("include_usage", False))
        states: list[RequestState] = []
        try:
            for i, p in enumerate(prompts):
                sp = _sampling_params(body, len(p), 16, stream)
                states.append(await _submit(request, f"{rid}-{i}", p, sp, body, rec))
        except EngineDeadError as e:
            return _error(str(e), 500, "InternalServerError")
        created = int(time.time())
        if rec is not None:
            rec["stream"] = stream

        def usage_all() -> dict:
            return _usage(sum(s.prompt_len for s in states), sum(s.num_output_tokens for s in states),
                          sum(s.cached_tokens for s in states), prompt_tokens_details)

        if not stream:
            results = await _unless_gone(request, states, asyncio.gather(*[_collect(s) for s in states]))
            if results is None:
                return Response(status_code=499)  # never sent: the client is gone
            _finish_truth(rec, states, [r[1] for r in results])
            return JSONResponse({
                "id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": i, "text": r[0], "logprobs": None, "finish_reason": r[1],
                             "stop_reason": r[2], "prompt_logprobs": None} for i, r in enumerate(results)],
                "service_tier": None, "system_fingerprint": None, "usage": usage_all(),
                "kv_transfer_params": None})

        kinds = rec["_kinds"] if rec is not None else []

        def chunk(choices: list, usage: Optional[dict] = None) -> str:
            c: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                 "model": model_name, "choices": choices}
            if usage is not None:
                c["usage"] = usage
            return f"data: {_dumps(c)}\n\n"

        async def gen() -> AsyncIterator[str]:
            done = [False] * len(states)
            finishes: list[Any] = [None] * len(states)
            pending = {asyncio.ensure_future(_next_merged(s)): i for i, s in enumerate(states)}
            try:
                while pending:
                    finished_set, _ = await asyncio.wait(pending.keys(), return_when=asyncio.FIRST_COMPLETED)
                    for fut in finished_set:
                        i = pending.pop(fut)
                        d = fut.result()
                        if d.finish_reason is not None:
                            done[i] = True
                            finishes[i] = d.finish_reason
                        else:
                            pending[asyncio.ensure_future(_next_merged(states[i]))] = i
                        # A held-back output (no text yet, tokens made) still goes out with
                        # empty text, as vLLM's completions stream sends it.
                        if d.text == "" and d.finish_reason is None and d.num_tokens == 0:
                            continue
                        kinds.append("content" if d.text else "finish" if d.finish_reason is not None else "empty")
                        yield chunk([{"index": i, "text": d.text, "logprobs": None,
                                      "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}])
                if include_usage:
                    kinds.append("usage")
                    yield chunk([], usage_all())
                _finish_truth(rec, states, finishes)
                kinds.append("done")
                yield "data: [DONE]\n\n"
            finally:
                if not all(done):
                    for fut in list(pending.keys()):
                        fut.cancel()
                    _abort_later(states)

        return StreamingResponse(gen(), media_type="text/event-stream")

    # ---------------------------------------------------------- responses
    # Responses kept for a later turn's `previous_response_id` (the newest 4096).
    stored: dict[str, list[dict]] = {}

    @app.post("/v1/responses")
    async def responses(request: Request):
        """The Responses API as vLLM serves it (non-harmony models, no built-in tools): the
        response ``resp_<uuid>`` runs as engine request ``resp_<uuid>_0`` (turn 0 of vLLM's
        tool loop; ``-<8 hex>`` after it as every engine id); the stream is ``event: <type>``
        + ``data: <json>`` per event, created / in_progress / item and part added / text
        deltas / text, part and item done / completed, each event's ``response`` echoing the
        request's instructions; no ``[DONE]``."""
        rec = _truth(request)
        body = await _read_body(request, rec)
        if body is None:
            return _error("invalid JSON body")
        inp = body.get("input")
        instructions = body.get("instructions")
        if isinstance(inp, str):
            messages = [{"role": "user", "content": inp}]
        elif isinstance(inp, list) and inp and all(isinstance(m, dict) for m in inp):
            messages = [{"role": m.get("role", "user"), "content": m.get("content") or ""} for m in inp]
        else:
            return _error("input must be a string or a non-empty list of messages")
        # A later turn sent with the id of the one before (vLLM with its response store
        # on): that turn's conversation, its answer included, comes first.
        previous = body.get("previous_response_id")
        if previous:
            if previous not in stored:
                return _error(f"Response with id '{previous}' not found.", 404, "NotFoundError")
            messages = stored[previous] + messages
        if instructions:
            messages = [{"role": "system", "content": instructions}] + [m for m in messages if m["role"] != "system"]
        turn = [m for m in messages if m["role"] != "system"]
        store = body.get("store", True) is not False

        def remember(text: str) -> None:
            if store:
                stored[rid] = turn + [{"role": "assistant", "content": text}]
                while len(stored) > 4096:
                    stored.pop(next(iter(stored)))
        rid = body.get("request_id") or f"resp_{random_uuid()}"
        prompt_ids = tok.apply_chat_template(messages)
        if (err := _tokenized(rec, rid, [prompt_ids])) is not None:
            return err
        stream = bool(body.get("stream", False))
        try:
            structured = _responses_structured_outputs(body)
        except ValueError as e:
            return _error(str(e))
        sp = _sampling_params({**body, "max_tokens": body.get("max_output_tokens")}, len(prompt_ids), None, stream,
                              structured)
        try:
            st = await _submit(request, f"{rid}_0", prompt_ids, sp, body, rec)
        except EngineDeadError as e:
            return _error(str(e), 500, "InternalServerError")
        created = int(time.time())
        msg_id = f"msg_{random_uuid()}"
        if rec is not None:
            rec["stream"] = stream
            rec["previous_response_id"] = previous

        def usage() -> dict:
            return {"input_tokens": st.prompt_len, "input_tokens_details": {"cached_tokens": st.cached_tokens},
                    "output_tokens": st.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": st.prompt_len + st.num_output_tokens}

        def message(text: str, status: str) -> dict:
            return {"id": msg_id, "content": [{"annotations": [], "text": text, "type": "output_text",
                                                 "logprobs": None}] if status == "completed" else [],
                    "role": "assistant", "status": status, "type": "message"}

        def response(status: str, output: list, finish: Any = None) -> dict:
            incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
            return {"id": rid, "created_at": created, "incomplete_details": incomplete,
                    "instructions": instructions, "metadata": None, "model": model_name, "object": "response",
                    "output": output, "parallel_tool_calls": True, "temperature": sp.temperature,
                    "tool_choice": "auto", "tools": [], "top_p": sp.top_p, "background": False,
                    "max_output_tokens": sp.max_tokens, "previous_response_id": previous, "status": status,
                    "usage": usage() if status != "in_progress" else None, "user": None}

        def final_status(finish: Any) -> str:
            return "incomplete" if finish == "length" else "completed"

        if not stream:
            got = await _unless_gone(request, [st], _collect(st))
            if got is None:
                return Response(status_code=499)  # never sent: the client is gone
            text, finish, _ = got
            _finish_truth(rec, [st], finish)
            remember(text)
            return JSONResponse(response(final_status(finish), [message(text, "completed")], finish))

        kinds = rec["_kinds"] if rec is not None else []
        seq = [0]

        def event(kind: str, truth_kind: str, **fields: Any) -> str:
            kinds.append(truth_kind)
            ev = {**fields, "sequence_number": seq[0], "type": kind}
            seq[0] += 1
            return f"event: {kind}\ndata: {_dumps(ev)}\n\n"

        async def gen() -> AsyncIterator[str]:
            finish = None
            try:
                yield event("response.created", "role", response=response("in_progress", []))
                yield event("response.in_progress", "other", response=response("in_progress", []))
                yield event("response.output_item.added", "other", item=message("", "in_progress"), output_index=0)
                yield event("response.content_part.added", "other", content_index=0, item_id=msg_id, output_index=0,
                            part={"annotations": [], "text": "", "type": "output_text", "logprobs": None})
                while finish is None:
                    d = await _next_merged(st)
                    finish = d.finish_reason
                    if d.text:
                        yield event("response.output_text.delta", "content", content_index=0, delta=d.text,
                                    item_id=msg_id, logprobs=[], output_index=0)
                yield event("response.output_text.done", "other", content_index=0, item_id=msg_id, logprobs=[],
                            output_index=0, text=st.text)
                yield event("response.content_part.done", "other", content_index=0, item_id=msg_id, output_index=0,
                            part={"annotations": [], "text": st.text, "type": "output_text", "logprobs": None})
                yield event("response.output_item.done", "other", item=message(st.text, "completed"), output_index=0)
                _finish_truth(rec, [st], finish)
                remember(st.text)
                yield event("response.completed", "usage",
                            response=response(final_status(finish), [message(st.text, "completed")], finish))
            finally:
                if finish is None:
                    _abort_later([st])

        return StreamingResponse(gen(), media_type="text/event-stream")

    # ------------------------------------------------ anthropic messages
    @app.post("/v1/messages")
    async def anthropic_messages(request: Request):
        """The Anthropic Messages API as vLLM's Python frontend serves it (its
        ``entrypoints/anthropic``): the request runs as a chat completion (``chatcmpl-<base>``,
        the message's id), the stream is ``event: <type>`` + ``data: <json>`` per event:
        message_start with the first output, a text block's start, text deltas, its stop,
        message_delta (stop reason, usage), message_stop. ``input_tokens`` leave out the cached
        prompt tokens (``cache_read_input_tokens``) when prompt token details are on."""
        rec = _truth(request)
        body = await _read_body(request, rec)
        if body is None:
            return _error("invalid JSON body")

        def text_of(content: Any) -> Optional[str]:
            if isinstance(content, str):
                return content
            if isinstance(content, list) and all(isinstance(b, dict) for b in content):
                return "".join(b.get("text") or "" for b in content if b.get("type") == "text")
            return None
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            return _error("messages must be a non-empty list")
        messages = [{"role": m.get("role", "user"), "content": text_of(m.get("content"))} for m in msgs]
        system = text_of(body.get("system")) if body.get("system") is not None else None
        if any(m["content"] is None for m in messages) or (body.get("system") is not None and system is None):
            return _error("content must be a string or a list of text blocks")
        if system:
            messages = [{"role": "system", "content": system}] + messages
        if not isinstance(body.get("max_tokens"), int):
            return _error("max_tokens is required")
        rid = f"chatcmpl-{_base_request_id(request, body.get('request_id'))}"
        stream = bool(body.get("stream", False))
        st = await _start_chat(request, rec, body, rid, messages, stream)
        if isinstance(st, Response):
            return st
        if rec is not None:
            rec["stream"] = stream

        def usage(output_tokens: int) -> dict:
            if not prompt_tokens_details:
                return {"input_tokens": st.prompt_len, "output_tokens": output_tokens}
            return {"input_tokens": max(0, st.prompt_len - st.cached_tokens), "output_tokens": output_tokens,
                    "cache_read_input_tokens": st.cached_tokens}

        def stop(finish: Any, stop_reason: Any) -> tuple[Optional[str], Optional[str]]:
            if finish == "length":
                return "max_tokens", None
            if isinstance(stop_reason, str):
                return "stop_sequence", stop_reason
            return "end_turn", None

        if not stream:
            got = await _unless_gone(request, [st], _collect(st))
            if got is None:
                return Response(status_code=499)  # never sent: the client is gone
            text, finish, stop_reason = got
            _finish_truth(rec, [st], finish)
            reason, sequence = stop(finish, stop_reason)
            return JSONResponse({"id": rid, "type": "message", "role": "assistant",
                                 "content": [{"type": "text", "text": text}], "model": model_name,
                                 "stop_reason": reason, "stop_sequence": sequence,
                                 "usage": usage(st.num_output_tokens)})

        kinds = rec["_kinds"] if rec is not None else []

        def event(kind: str, truth_kind: str, **fields: Any) -> str:
            kinds.append(truth_kind)
            return f"event: {kind}\ndata: {_dumps({'type': kind, **fields})}\n\n"

        async def gen() -> AsyncIterator[str]:
            finish = None
            started = block = False
            try:
                while finish is None:
                    d = await _next_merged(st)
                    if not started:
                        # With the first output, as vLLM's chat stream sends its role chunk.
                        started = True
                        yield event("message_start", "role", message={
                            "id": rid, "type": "message", "role": "assistant", "content": [], "model": model_name,
                            "stop_reason": None, "stop_sequence": None, "usage": usage(0)})
                    finish = d.finish_reason
                    if d.text:
                        if not block:
                            block = True
                            yield event("content_block_start", "other", content_block={"type": "text", "text": ""},
                                        index=0)
                        yield event("content_block_delta", "content", delta={"type": "text_delta", "text": d.text},
                                    index=0)
                if block:
                    yield event("content_block_stop", "other", index=0)
                reason, sequence = stop(finish, d.stop_reason)
                yield event("message_delta", "usage", delta={"stop_reason": reason, "stop_sequence": sequence},
                            usage=usage(st.num_output_tokens))
                _finish_truth(rec, [st], finish)
                yield event("message_stop", "done")
            finally:
                if finish is None:
                    _abort_later([st])

        return StreamingResponse(gen(), media_type="text/event-stream")

    return TruthMiddleware(app, truth) if truth.enabled else app
