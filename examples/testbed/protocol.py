"""Engine IPC messages, mirroring vLLM **0.33.0** (vllm/v1/engine/__init__.py), or 0.34.0.

The testbed speaks vLLM 0.33.0's layout (see ../../shared/vllm-wire.md §8 and the genuine bytes in
shared/fixtures/vllm-0.33.0/), or with ``--vllm-wire 0.34.0`` vLLM 0.34.0's (genuine bytes in
agent/tests/fixtures/vllm-0.34.0/): one more trailing field in EngineCoreRequest (``block_hashes``)
and EngineCoreOutput (``watermarking``), and the ADD's prompt ids packed into an int32 ndarray that
vLLM's MsgpackEncoder writes as ``[dtype, shape, data]``, ``data`` inline as ext 3 under 256 bytes,
else the index of an extra ZeroMQ frame (``AddEncoder``). The structs below use the same msgspec options as
vLLM (``array_like=True, omit_defaults=True, gc=False``; omit_defaults has no effect on array_like
structs, so every field is always on the wire) and the same field ORDER, so that
``msgspec.msgpack.encode`` produces the same positional arrays:

* EngineCoreRequest   22 fields (request_id … kv_hints)
* EngineCoreOutputs    9 fields (engine_index … weight_version)
* EngineCoreOutput    19 fields (request_id … error)
* EngineCoreEvent      map {"type", "timestamp"}   (plain msgspec.Struct)
* PrefillStats         map with all 6 keys         (a dataclass in vLLM: every field by name)
* SchedulerStats       map with all 18 keys        (a dataclass in vLLM; PrefixCacheStats inside too)
* SamplingParams       map of non-default keys     (msgspec.Struct, omit_defaults=True)
* StructuredOutputsParams  map with all 11 keys    (a dataclass in vLLM: every field by name)

Fields the testbed never fills are typed ``Any`` and left ``None``.

Framing (ZeroMQ, as vLLM):
* input:  API server ROUTER binds, engine DEALER connects with identity = engine index u16 LE.
  A request is ``[type byte, msgpack payload]`` (the ROUTER side prepends the identity frame).
* output: API server PULL binds, engine PUSH connects; one frame = msgpack EngineCoreOutputs.
* The engine's first message on the input socket is a msgpack map modelled on vLLM's
  ``EngineCoreReadyResponse`` (``max_model_len``, ``num_gpu_blocks``, ``dp_stats_address``,
  ``dtype``); vLLM needs it so the ROUTER learns the DEALER's identity. The separate vLLM
  handshake socket is not emulated.
"""

from __future__ import annotations

import dataclasses
import enum
import time
import uuid
from typing import Any, Optional, Union

import msgspec
import numpy as np


class EngineCoreRequestType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:  # as vLLM: "stop", "length", ...
        return self.name.lower()


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams (vllm/sampling_params.py): exactly one constraint set.

    A dataclass there, so msgspec writes every field by name, ``_backend`` (the frontend's choice,
    set after construction) and ``_backend_was_auto`` included — the same bytes as vLLM 0.32.0's
    encoder makes.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None
    _backend: Optional[str] = dataclasses.field(default=None, init=False)
    _backend_was_auto: bool = dataclasses.field(default=False, init=False)

    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag"):
            if getattr(self, k) is not None:
                return k
        return "other"


class SamplingParams(msgspec.Struct, omit_defaults=True):  # type: ignore[call-arg]
    """Subset of vLLM's SamplingParams, same defaults, in its order (0.33.0 and 0.34.0); encoded as a
    map of non-default keys.

    As in vLLM, ``stop``/``stop_token_ids``/``bad_words`` become ``[]`` and
    ``skip_reading_prefix_cache`` becomes ``False`` after construction, so they are always sent.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None
    bad_words: Optional[list[str]] = None
    skip_reading_prefix_cache: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = False


class EngineCoreEvent(msgspec.Struct):
    """Timestamped engine event; ``timestamp`` is time.monotonic() in the engine process."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: Optional[float] = None):
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class PrefillStats(msgspec.Struct):
    """vLLM 0.33.0 PrefillStats (a dataclass there; all fields by name on the wire)."""

    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0


class PrefixCacheStats(msgspec.Struct):
    """vLLM 0.33.0/0.34.0 PrefixCacheStats (a dataclass there; all fields by name on the wire).
    Counts since the previous SchedulerStats: lookups, tokens looked up, tokens hit."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict = {}


class SchedulerStats(msgspec.Struct):
    """vLLM 0.33.0/0.34.0 SchedulerStats (a dataclass there; all 18 fields by name on the wire, in
    its order), sent in EngineCoreOutputs.scheduler_stats on every step while stats logging is on
    (the default). vLLM 0.34.0's Rust frontend refuses a map without any of them."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    num_kv_fetch_reqs_by_stage: dict = {}
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    iteration_details: Any = None
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    connector_prefix_cache_stats: Optional[PrefixCacheStats] = None
    kv_cache_eviction_events: list = []
    spec_decoding_stats: Any = None
    kv_connector_stats: Optional[dict] = None
    ec_connector_stats: Optional[dict] = None
    waiting_lora_adapters: dict = {}
    running_lora_adapters: dict = {}
    cudagraph_stats: Any = None
    perf_stats: Any = None


class EngineCoreRequest(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False
):  # type: ignore[call-arg]
    request_id: str  # 0
    prompt_token_ids: Optional[list[int]]  # 1
    mm_features: Any  # 2
    sampling_params: Optional[SamplingParams]  # 3
    pooling_params: Any  # 4
    arrival_time: float  # 5  time.time() in the API server
    lora_request: Any  # 6
    cache_salt: Optional[str]  # 7
    data_parallel_rank: Optional[int]  # 8
    prompt_embeds: Any = None  # 9
    prompt_is_token_ids: Optional[bool] = None  # 10
    client_index: int = 0  # 11
    current_wave: int = 0  # 12
    priority: int = 0  # 13
    trace_headers: Optional[dict[str, str]] = None  # 14
    resumable: bool = False  # 15
    external_req_id: Optional[str] = None  # 16
    reasoning_ended: Optional[bool] = None  # 17
    reasoning_parser_kwargs: Optional[dict] = None  # 18
    abort_immediately: bool = False  # 19
    session_id: Optional[str] = None  # 20
    kv_hints: Any = None  # 21


class EngineCoreOutput(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False
):  # type: ignore[call-arg]
    request_id: str  # 0
    new_token_ids: list[int]  # 1
    new_logprobs: Any = None  # 2
    new_prompt_logprobs_tensors: Any = None  # 3
    pooling_output: Any = None  # 4
    finish_reason: Optional[FinishReason] = None  # 5
    stop_reason: Union[int, str, None] = None  # 6
    events: Optional[list[EngineCoreEvent]] = None  # 7
    kv_transfer_params: Optional[dict[str, Any]] = None  # 8
    ec_transfer_params: Optional[dict[str, Any]] = None  # 9
    trace_headers: Optional[dict[str, str]] = None  # 10
    prefill_stats: Optional[PrefillStats] = None  # 11
    routed_experts: Any = None  # 12
    num_nans_in_logits: int = 0  # 13
    mm_cache_miss_hashes: Any = None  # 14
    new_sampling_mask: Any = None  # 15
    spec_decode_metrics: Any = None  # 16
    prompt_token_id_logprobs: Any = None  # 17
    error: Any = None  # 18

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False
):  # type: ignore[call-arg]
    engine_index: int = 0  # 0
    outputs: list[EngineCoreOutput] = []  # 1
    scheduler_stats: Any = None  # 2  SchedulerStats when stats logging is on
    timestamp: float = 0.0  # 3  time.monotonic() when the step's output is built
    utility_output: Any = None  # 4
    finished_requests: Optional[set[str]] = None  # 5
    wave_complete: Optional[int] = None  # 6
    start_wave: Optional[int] = None  # 7
    weight_version: Any = None  # 8

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()


class EngineCoreRequest034(EngineCoreRequest):  # type: ignore[call-arg]
    """vLLM 0.34.0's EngineCoreRequest: 0.33.0's fields, then ``block_hashes``."""

    # 1: a list, or the [dtype, shape, data] of vLLM 0.34.0's packed ids (AddEncoder)
    prompt_token_ids: Any
    block_hashes: Optional[list[bytes]] = None  # 22


class EngineCoreOutput034(EngineCoreOutput):  # type: ignore[call-arg]
    """vLLM 0.34.0's EngineCoreOutput: 0.33.0's fields, then ``watermarking``."""

    watermarking: Optional[bool] = None  # 19


#: The vLLM wire layouts the testbed speaks (``--vllm-wire``).
WIRE_VERSIONS = ("0.33.0", "0.34.0")
RAW_VIEW = 3  # vLLM serial_utils.CUSTOM_TYPE_RAW_VIEW
ZERO_COPY_THRESHOLD = 256  # VLLM_MSGPACK_ZERO_COPY_THRESHOLD's default


def request_class(wire: str) -> type:
    return EngineCoreRequest034 if wire == "0.34.0" else EngineCoreRequest


def output_class(wire: str) -> type:
    return EngineCoreOutput034 if wire == "0.34.0" else EngineCoreOutput


class AddEncoder:
    """An ADD's frames after its type byte, as the frontend of vLLM ``wire`` sends them: 0.33.0 one
    msgpack frame; 0.34.0 the prompt ids packed into an int32 ndarray (``_with_packed_prompt``)
    and written by vLLM's MsgpackEncoder rules: ``[dtype, shape, data]``, ``data`` an ext 3 of the
    array's bytes under 256 bytes, else the index of the extra frame that carries them."""

    def __init__(self, wire: str):
        self.packed = wire == "0.34.0"
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self._aux: Optional[list] = None

    def encode(self, ecr: EngineCoreRequest) -> list:
        if self.packed and isinstance(ecr.prompt_token_ids, list):
            ecr = msgspec.structs.replace(ecr, prompt_token_ids=np.asarray(ecr.prompt_token_ids, dtype=np.int32))
        self._aux = bufs = [b""]
        try:
            bufs[0] = self._enc.encode(ecr)
            return bufs
        finally:
            self._aux = None

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray) and self._aux is not None:
            if not obj.shape or obj.nbytes < ZERO_COPY_THRESHOLD:
                data: Any = msgspec.msgpack.Ext(RAW_VIEW, obj.tobytes())
            else:
                data = len(self._aux)
                self._aux.append(obj.data)
            return obj.dtype.str, obj.shape, data
        raise NotImplementedError(f"cannot encode {type(obj)}")


class AddDecoder:
    """The engine's side of ``AddEncoder``, for either wire: a list of ids as it is; packed ids
    (inline, or in the frame their index names) back to a list."""

    def __init__(self) -> None:
        self._dec = msgspec.msgpack.Decoder(EngineCoreRequest034, ext_hook=self._ext)

    @staticmethod
    def _ext(code: int, data: memoryview) -> bytes:
        if code != RAW_VIEW:
            raise ValueError(f"unexpected msgpack extension {code}")
        return bytes(data)

    def decode(self, frames: list) -> EngineCoreRequest:
        """``frames``: the ADD's frames after its type byte."""
        ecr = self._dec.decode(frames[0])
        ids = ecr.prompt_token_ids
        if ids and isinstance(ids[0], str):  # [dtype, shape, data], not ids
            dtype, shape, data = ids
            buf = frames[data] if isinstance(data, int) else data
            ecr.prompt_token_ids = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape).tolist()
        return ecr


# Field names by position, for tests and for readers of the JSONL capture.
REQUEST_FIELDS = tuple(EngineCoreRequest.__struct_fields__)
OUTPUT_FIELDS = tuple(EngineCoreOutput.__struct_fields__)
OUTPUTS_FIELDS = tuple(EngineCoreOutputs.__struct_fields__)
assert len(REQUEST_FIELDS) == 22 and len(OUTPUT_FIELDS) == 19 and len(OUTPUTS_FIELDS) == 9

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


def random_uuid() -> str:
    """vLLM's random_uuid(): 16 hex digits since vllm#29375."""
    return uuid.uuid4().hex[:16]


def engine_identity(engine_index: int) -> bytes:
    return engine_index.to_bytes(2, "little")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def make_request_decoder() -> msgspec.msgpack.Decoder:
    """0.33.0's EngineCoreRequest alone (the engine reads either wire with ``AddDecoder``)."""
    return msgspec.msgpack.Decoder(EngineCoreRequest)


def make_outputs_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreOutputs)


def make_abort_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(list[str])
