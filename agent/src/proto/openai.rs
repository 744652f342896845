//! OpenAI-compatible JSON, read for metadata only: chunk kind, ids, sizes,
//! finish reasons and token counts. Generated text and prompts are measured
//! (byte lengths) and dropped, never copied into a record.

use super::json_ends::{self, Kind};
use crate::model::{SseKind, Usage};
use serde::Deserialize;
use serde_json::{Map, Value};

/// Longest id / model / finish_reason string kept.
const MAX_STR: usize = 256;

/// What one SSE `data:` payload was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkInfo {
    pub kind: SseKind,
    pub id: Option<String>,
    pub content_bytes: u32,
    pub finish_reason: Option<String>,
    pub usage: Option<Usage>,
    /// The chunk's `model` (OpenAI-compatible servers name it in every chunk).
    pub model: Option<String>,
}

impl ChunkInfo {
    pub fn other(id: Option<String>) -> Self {
        ChunkInfo {
            kind: SseKind::Other,
            id,
            content_bytes: 0,
            finish_reason: None,
            usage: None,
            model: None,
        }
    }
}

fn short(s: &str) -> String {
    super::http::truncate(s, MAX_STR)
}

fn str_of(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(short)
}

/// Chat and completions' `usage`, the Responses API's (`input_tokens`,
/// `output_tokens`, `input_tokens_details.cached_tokens`), or the Anthropic
/// Messages API's: its `input_tokens` leave out the prompt tokens read from
/// the cache (`cache_read_input_tokens`) and those written to it
/// (`cache_creation_input_tokens`), so the prompt is their sum.
fn usage_of(v: Option<&Value>) -> Option<Usage> {
    let u = v?.as_object()?;
    let n = |chat: &str, responses: &str| u.get(chat).or_else(|| u.get(responses)).and_then(Value::as_u64);
    let read = u.get("cache_read_input_tokens").and_then(Value::as_u64);
    let created = u.get("cache_creation_input_tokens").and_then(Value::as_u64);
    let mut prompt_tokens = n("prompt_tokens", "input_tokens");
    if !u.contains_key("prompt_tokens") && (read.is_some() || created.is_some()) {
        prompt_tokens = prompt_tokens.map(|p| p.saturating_add(read.unwrap_or(0)).saturating_add(created.unwrap_or(0)));
    }
    Some(Usage {
        prompt_tokens,
        completion_tokens: n("completion_tokens", "output_tokens"),
        cached_tokens: u
            .get("prompt_tokens_details")
            .or_else(|| u.get("input_tokens_details"))
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .or(read),
    })
}

/// The Anthropic Messages API's `stop_reason` in chat's words (`end_turn`
/// and `stop_sequence`: `stop`; `max_tokens`: `length`; `tool_use`:
/// `tool_calls`), any other as it is.
fn finish_of_stop_reason(reason: &str) -> String {
    match reason {
        "end_turn" | "stop_sequence" => "stop".to_owned(),
        "max_tokens" => "length".to_owned(),
        "tool_use" => "tool_calls".to_owned(),
        r => short(r),
    }
}

/// Event types of the Anthropic Messages API's stream (`/v1/messages`, which
/// vLLM serves for Claude Code and Anthropic SDK agents).
const MESSAGES_EVENTS: [&str; 7] =
    ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop", "ping"];

fn is_messages_event(kind: &str) -> bool {
    MESSAGES_EVENTS.contains(&kind)
}

/// One Anthropic Messages API streaming event, told by its `type`:
/// `message_start` opens the stream (the message's id, which vLLM takes from
/// its chat completion, and model), a `content_block_delta` with text,
/// thinking or a tool call's JSON is content, as is the start of a
/// `tool_use` block (its name: a tool call's first token), `message_delta`
/// carries the usage and the stop reason, `message_stop` ends it (chat's
/// `[DONE]`); block starts and stops of text and `ping` are other.
fn classify_messages_event(kind: &str, obj: &Map<String, Value>) -> ChunkInfo {
    let message = obj.get("message").and_then(Value::as_object);
    let mut info = ChunkInfo::other(message.and_then(|m| str_of(m.get("id"))));
    info.model = message.and_then(|m| str_of(m.get("model")));
    let content = |bytes: u64, info: &mut ChunkInfo| {
        info.kind = SseKind::Content;
        info.content_bytes = u32::try_from(bytes).unwrap_or(u32::MAX);
    };
    match kind {
        "message_start" => {
            info.kind = SseKind::Role;
            // The prompt's count; its output (0 here) comes with message_delta.
            info.usage = message.and_then(|m| usage_of(m.get("usage"))).map(|u| Usage { completion_tokens: None, ..u });
        }
        "content_block_delta" => {
            let delta = obj.get("delta").and_then(Value::as_object);
            let bytes = delta.map_or(0, |d| ["text", "thinking", "partial_json"].iter().map(|k| str_len(d, k)).sum::<u64>());
            if bytes > 0 {
                content(bytes, &mut info);
            }
        }
        "content_block_start" => {
            let block = obj.get("content_block").and_then(Value::as_object);
            if block.and_then(|b| b.get("type")).and_then(Value::as_str) == Some("tool_use") {
                let name = block.map_or(0, |b| str_len(b, "name"));
                content(name, &mut info);
            }
        }
        "message_delta" => {
            info.kind = SseKind::Usage;
            info.usage = usage_of(obj.get("usage"));
            info.finish_reason = obj
                .get("delta")
                .and_then(|d| d.get("stop_reason"))
                .and_then(Value::as_str)
                .map(finish_of_stop_reason);
        }
        "message_stop" => info.kind = SseKind::Done,
        _ => {}
    }
    info
}

/// A Responses API `response.status` as a finish reason: `completed` is a
/// stop, `incomplete` names its reason (`max_output_tokens`: `length`, as
/// chat's), the rest (`failed`, `cancelled`) as they are.
fn responses_finish(response: &Map<String, Value>) -> Option<String> {
    let reason = response.get("incomplete_details").and_then(|d| d.get("reason")).and_then(Value::as_str);
    finish_of_status(response.get("status")?.as_str()?, reason)
}

/// Only a Responses API status: another JSON body's `status` (`{"status":
/// "ok"}` of a health check) says nothing of a generation.
fn finish_of_status(status: &str, incomplete_reason: Option<&str>) -> Option<String> {
    Some(match (status, incomplete_reason) {
        ("completed", _) => "stop".to_owned(),
        ("incomplete", Some("max_output_tokens") | None) => "length".to_owned(),
        ("incomplete", Some(r)) => short(r),
        ("failed" | "cancelled", _) => status.to_owned(),
        _ => return None,
    })
}

/// One Responses API (`/v1/responses`) streaming event, told by its `type`:
/// `response.created` opens the stream (the response's id and model), any
/// `response.….delta` with text is content (output text, reasoning, a
/// function call's arguments, a refusal), `response.completed` /
/// `response.incomplete` carry the usage and end it, `response.failed` and
/// `error` are errors; the rest (items and parts added or done, `.done`
/// events repeating a whole text) are other.
fn classify_responses_event(kind: &str, obj: &Map<String, Value>) -> ChunkInfo {
    let response = obj.get("response").and_then(Value::as_object);
    let mut info = ChunkInfo::other(response.and_then(|r| str_of(r.get("id"))));
    info.model = response.and_then(|r| str_of(r.get("model")));
    let delta = obj.get("delta").and_then(Value::as_str).map(str::len);
    responses_kind(&mut info, kind, delta);
    if info.kind == SseKind::Usage {
        info.usage = response.and_then(|r| usage_of(r.get("usage")));
        info.finish_reason = response.and_then(responses_finish);
    }
    info
}

/// Sets `info`'s kind for a Responses API event of type `kind` (a delta's
/// text `delta_bytes` long, when known).
fn responses_kind(info: &mut ChunkInfo, kind: &str, delta_bytes: Option<usize>) {
    match kind {
        "response.created" => info.kind = SseKind::Role,
        "response.completed" | "response.incomplete" => info.kind = SseKind::Usage,
        "response.failed" | "error" => info.kind = SseKind::Error,
        k if k.ends_with(".delta") => match delta_bytes {
            Some(0) => {}
            // Cut by the capture: its text is longer than it, unknown.
            None => info.kind = SseKind::Content,
            Some(n) => {
                info.kind = SseKind::Content;
                info.content_bytes = u32::try_from(n).unwrap_or(u32::MAX);
            }
        },
        _ => {}
    }
}

/// A Responses API event the capture cut (its `response` echoes the
/// request's instructions and tools, and `response.completed` the whole
/// output: often longer than a syscall's capture), or an Anthropic Messages
/// API one (a long text delta), read from its data's last bytes (`tail`,
/// the TCP capture's tail) and what its first bytes held (`head`,
/// [`partial_head`]): its root `type` (last as vLLM's Python frontend writes
/// Responses API events, first as its Rust frontend and the Messages API
/// do) and, in the root's `response`, `usage` and `status` (they come last).
/// None when neither end names an event type of theirs (a chat chunk, or
/// too little of it).
pub(crate) fn classify_tail(tail: &[u8], head: PartialHead) -> Option<ChunkInfo> {
    let (mut kind, mut usage, mut status) = (None::<String>, None, None::<String>);
    json_ends::tail_members(tail.trim_ascii_end(), |path, k, v| match (path, k) {
        ([Kind::Object], b"type") => kind = serde_json::from_slice(v).ok(),
        ([Kind::Object, Kind::Object], b"usage") if usage.is_none() => {
            usage = serde_json::from_slice::<Value>(v).ok().and_then(|u| usage_of(Some(&u)));
        }
        ([Kind::Object, Kind::Object], b"status") if status.is_none() => status = serde_json::from_slice(v).ok(),
        _ => {}
    });
    let kind = kind.or(head.kind).filter(|t| t.starts_with("response.") || t == "error" || is_messages_event(t))?;
    let mut info = ChunkInfo::other(head.id);
    if is_messages_event(&kind) {
        // Only a delta is long enough to be cut: content of unknown length.
        info.kind = match kind.as_str() {
            "message_start" => SseKind::Role,
            "content_block_delta" => SseKind::Content,
            "message_delta" => SseKind::Usage,
            "message_stop" => SseKind::Done,
            _ => SseKind::Other,
        };
        return Some(info);
    }
    responses_kind(&mut info, &kind, None);
    if info.kind == SseKind::Usage {
        info.usage = usage;
        info.finish_reason = status.and_then(|s| finish_of_status(&s, None));
    }
    Some(info)
}

fn str_len(m: &Map<String, Value>, key: &str) -> u64 {
    m.get(key)
        .and_then(Value::as_str)
        .map_or(0, |s| s.len() as u64)
}

/// Classifies one SSE event's data (the `data:` lines joined with `\n`).
/// Returns the info and whether the payload was invalid JSON.
pub(crate) fn classify_sse(data: &[u8]) -> (ChunkInfo, bool) {
    let data = data.trim_ascii();
    if data == b"[DONE]" {
        return (
            ChunkInfo {
                kind: SseKind::Done,
                ..ChunkInfo::other(None)
            },
            false,
        );
    }
    let v: Value = match serde_json::from_slice(data) {
        Ok(v) => v,
        Err(_) => return (ChunkInfo::other(None), true),
    };
    let Some(obj) = v.as_object() else {
        return (ChunkInfo::other(None), false);
    };
    if let Some(kind) = obj.get("type").and_then(Value::as_str) {
        if kind.starts_with("response.") || kind == "error" {
            return (classify_responses_event(kind, obj), false);
        }
        if is_messages_event(kind) {
            return (classify_messages_event(kind, obj), false);
        }
    }
    let id = str_of(obj.get("id"));
    let model = str_of(obj.get("model"));
    let usage = usage_of(obj.get("usage"));
    let mut finish_reason = None;
    let mut content = false;
    let mut role = false;
    let mut bytes: u64 = 0;
    let choices = obj.get("choices").and_then(Value::as_array);
    for choice in choices.into_iter().flatten().filter_map(Value::as_object) {
        if finish_reason.is_none() {
            finish_reason = str_of(choice.get("finish_reason"));
        }
        // Completions: `text`.
        let text = str_len(choice, "text");
        bytes = bytes.saturating_add(text);
        content |= text > 0;
        // Chat: `delta`.
        if let Some(delta) = choice.get("delta").and_then(Value::as_object) {
            let c = str_len(delta, "content");
            // vLLM sends reasoning as `reasoning_content` (older) and/or `reasoning`:
            // count the longer one so a server sending both is not counted twice.
            let r = str_len(delta, "reasoning_content").max(str_len(delta, "reasoning"));
            bytes = bytes.saturating_add(c).saturating_add(r);
            content |= c > 0 || r > 0;
            if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
                content |= !calls.is_empty();
                for f in calls
                    .iter()
                    .filter_map(|c| c.get("function"))
                    .filter_map(Value::as_object)
                {
                    bytes = bytes
                        .saturating_add(str_len(f, "name"))
                        .saturating_add(str_len(f, "arguments"));
                }
            }
            role |= delta.get("role").is_some_and(|r| !r.is_null());
        }
    }
    let has_error = obj.get("error").is_some_and(|e| !e.is_null());
    let no_choices = choices.is_none_or(|c| c.is_empty());
    let kind = if has_error {
        SseKind::Error
    } else if no_choices && usage.is_some() {
        SseKind::Usage
    } else if content {
        SseKind::Content
    } else if role {
        SseKind::Role
    } else if finish_reason.is_some() {
        SseKind::Finish
    } else {
        SseKind::Other
    };
    let content_bytes = if kind == SseKind::Content {
        u32::try_from(bytes).unwrap_or(u32::MAX)
    } else {
        0
    };
    (
        ChunkInfo {
            kind,
            id,
            content_bytes,
            finish_reason,
            usage,
            model,
        },
        false,
    )
}

/// What the first bytes of a cut event's data tell ([`partial_head`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PartialHead {
    pub id: Option<String>,
    /// The root's `type`, when it comes first (the Anthropic Messages API's
    /// events, vLLM's Rust frontend's Responses API events).
    pub kind: Option<String>,
}

/// A string value with no escapes, at most [`MAX_STR`] bytes, at the start of
/// `s` (after its opening quote is stripped): the string and what follows.
fn plain_str(s: &[u8]) -> Option<(&str, &[u8])> {
    let s = s.strip_prefix(b"\"")?;
    let end = s.iter().take(MAX_STR).position(|&b| b == b'"')?;
    let v = &s[..end];
    if v.iter().any(|&b| b == b'\\' || b < 0x20) {
        return None;
    }
    Some((std::str::from_utf8(v).ok()?, &s[end + 1..]))
}

/// The `id` and the root's `type` at the start of a cut event: the leading
/// members of the root, then of its `response` (Responses API) or `message`
/// (Anthropic's `message_start`) object, read until the id, skipping plain
/// scalars (`"type":"response.created","sequence_number":0`, as vLLM's Rust
/// frontend writes them first). Conservative: no escapes, bounded.
pub(crate) fn partial_head(src: &[u8]) -> PartialHead {
    let mut head = PartialHead::default();
    let Some(mut s) = src.trim_ascii_start().strip_prefix(b"{") else { return head };
    let mut nested = false;
    for _ in 0..16 {
        let Some((key, rest)) = plain_str(s.trim_ascii_start()) else { break };
        let Some(rest) = rest.trim_ascii_start().strip_prefix(b":") else { break };
        let rest = rest.trim_ascii_start();
        s = match (key, rest.first()) {
            ("id", _) => {
                head.id = plain_str(rest).map(|(v, _)| v.to_owned()).filter(|v| !v.is_empty());
                break;
            }
            ("response" | "message", Some(b'{')) if !nested => {
                // Its first member next: no comma before it.
                nested = true;
                s = &rest[1..];
                continue;
            }
            (_, Some(b'"')) => {
                let Some((v, after)) = plain_str(rest) else { break };
                if key == "type" && !nested {
                    head.kind = Some(v.to_owned());
                }
                after
            }
            // A number, true, false or null: up to the next comma.
            (_, Some(b'-' | b'0'..=b'9' | b't' | b'f' | b'n')) => match rest.iter().position(|&b| b == b',' || b == b'}') {
                Some(i) => &rest[i..],
                None => break,
            },
            _ => break,
        };
        let Some(next) = s.trim_ascii_start().strip_prefix(b",") else { break };
        s = next;
    }
    head
}

/// The `id` at the start of a truncated chunk (`{"id":"chatcmpl-…",…`), as
/// OpenAI-compatible servers write it first, or of a Responses API event's
/// response (`{"response":{"id":"resp_…",…`) or an Anthropic message's
/// ([`partial_head`]).
pub(crate) fn partial_id(src: &[u8]) -> Option<String> {
    partial_head(src).id
}

/// Only the request fields we keep; every other member (messages, prompt…)
/// is skipped by serde without being copied.
#[derive(Deserialize)]
struct RequestFields {
    #[serde(default)]
    stream: Option<Value>,
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    previous_response_id: Option<Value>,
}

/// What hopscope keeps of a request body: no prompt text, ever.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RequestMeta {
    pub stream: Option<bool>,
    pub model: Option<String>,
    /// The Responses API's link to the response this one continues (an
    /// agent's next turn, sent with `previous_response_id` instead of the
    /// whole conversation): a chain key that needs no header.
    pub previous_response_id: Option<String>,
}

/// [`RequestMeta`] of a complete JSON request body; `None` if it is not a
/// JSON object.
pub(crate) fn request_meta(body: &[u8]) -> Option<RequestMeta> {
    let m: RequestFields = serde_json::from_slice(body).ok()?;
    Some(RequestMeta {
        stream: m.stream.as_ref().and_then(Value::as_bool),
        model: str_of(m.model.as_ref()),
        previous_response_id: str_of(m.previous_response_id.as_ref()).filter(|p| !p.is_empty()),
    })
}

/// [`RequestMeta`] of a JSON request body captured in part: its first
/// bytes and its last ones (`proto::json_ends`). openai-python 1.x writes
/// `messages` first, so behind a long prompt they are in the tail.
pub(crate) fn request_meta_parts(head: &[u8], tail: &[u8]) -> RequestMeta {
    let mut m = RequestMeta::default();
    for (k, v) in json_ends::head_members(head, &["stream", "model", "previous_response_id"]) {
        match k.as_str() {
            "stream" => m.stream = m.stream.or(v.as_bool()),
            "model" => m.model = m.model.or_else(|| str_of(Some(&v))),
            _ => m.previous_response_id = m.previous_response_id.or_else(|| str_of(Some(&v))),
        }
    }
    json_ends::tail_members(tail, |path, k, v| {
        if path != [Kind::Object] {
            return;
        }
        match k {
            b"stream" if m.stream.is_none() => m.stream = serde_json::from_slice::<bool>(v).ok(),
            b"model" if m.model.is_none() => m.model = serde_json::from_slice::<String>(v).ok().map(|s| short(&s)),
            b"previous_response_id" if m.previous_response_id.is_none() => {
                m.previous_response_id = serde_json::from_slice::<String>(v).ok().map(|s| short(&s));
            }
            _ => {}
        }
    });
    m.previous_response_id = m.previous_response_id.filter(|p| !p.is_empty());
    m
}

/// [`response_meta`] of a JSON response body captured in part: the id from
/// its first bytes, `usage` and the first choice in the tail's
/// `finish_reason` from its last ones.
pub(crate) fn response_meta_parts(head: &[u8], tail: &[u8]) -> BodyMeta {
    let mut id = None;
    let mut usage = None;
    let mut model = None;
    // The Responses API's (`status` and `incomplete_details`, no `choices`).
    let (mut status, mut incomplete) = (None::<String>, None::<String>);
    // The Anthropic Messages API's.
    let mut stop_reason = None::<String>;
    for (k, v) in json_ends::head_members(head, &["id", "usage", "model", "status", "incomplete_details", "stop_reason"]) {
        match k.as_str() {
            "id" => id = id.or_else(|| str_of(Some(&v))),
            "model" => model = model.or_else(|| str_of(Some(&v))),
            "status" => status = status.or_else(|| str_of(Some(&v))),
            "incomplete_details" => incomplete = incomplete.or_else(|| str_of(v.get("reason"))),
            "stop_reason" => stop_reason = stop_reason.or_else(|| str_of(Some(&v))),
            _ => usage = usage.or_else(|| usage_of(Some(&v))),
        }
    }
    let id = id.or_else(|| partial_id(head));
    let mut finish_reason = None;
    json_ends::tail_members(tail, |path, k, v| match (path, k) {
        ([Kind::Object], b"usage") if usage.is_none() => {
            usage = serde_json::from_slice::<Value>(v).ok().and_then(|u| usage_of(Some(&u)));
        }
        ([Kind::Object], b"status") if status.is_none() => status = serde_json::from_slice::<String>(v).ok(),
        ([Kind::Object], b"stop_reason") if stop_reason.is_none() => stop_reason = serde_json::from_slice::<String>(v).ok(),
        ([Kind::Object], b"model") if model.is_none() => {
            model = serde_json::from_slice::<String>(v).ok().map(|m| short(&m));
        }
        // choices[i].finish_reason: reported nearest the end first, so the
        // last one seen is the first choice the tail holds.
        ([Kind::Object, Kind::Array, Kind::Object], b"finish_reason") => {
            if let Ok(Some(r)) = serde_json::from_slice::<Option<String>>(v) {
                finish_reason = Some(short(&r));
            }
        }
        _ => {}
    });
    let finish_reason = finish_reason
        .or_else(|| stop_reason.map(|r| finish_of_stop_reason(&r)))
        .or_else(|| status.and_then(|s| finish_of_status(&s, incomplete.as_deref())));
    BodyMeta { id, usage, finish_reason, model }
}

#[derive(Deserialize)]
struct ChoiceMeta {
    #[serde(default)]
    finish_reason: Option<Value>,
}

#[derive(Deserialize)]
struct ResponseMeta {
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    choices: Option<Vec<ChoiceMeta>>,
    #[serde(default)]
    usage: Option<Value>,
    #[serde(default)]
    model: Option<Value>,
    /// The Responses API's: it has `output`, not `choices`.
    #[serde(default)]
    status: Option<Value>,
    #[serde(default)]
    incomplete_details: Option<Value>,
    /// The Anthropic Messages API's: `content` and `stop_reason`.
    #[serde(default)]
    stop_reason: Option<Value>,
}

/// Metadata of a non-streaming response body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BodyMeta {
    pub id: Option<String>,
    pub usage: Option<Usage>,
    pub finish_reason: Option<String>,
    pub model: Option<String>,
}

/// Reads id, usage, model and the first choice's finish_reason from a complete JSON
/// body; `None` if it is not valid JSON.
pub(crate) fn response_meta(body: &[u8]) -> Option<BodyMeta> {
    if let Ok(m) = serde_json::from_slice::<ResponseMeta>(body) {
        return Some(BodyMeta {
            id: str_of(m.id.as_ref()),
            usage: usage_of(m.usage.as_ref()),
            model: str_of(m.model.as_ref()),
            finish_reason: match m.choices {
                Some(c) => c.into_iter().next().and_then(|c| str_of(c.finish_reason.as_ref())),
                None if m.stop_reason.as_ref().is_some_and(Value::is_string) => {
                    m.stop_reason.as_ref().and_then(Value::as_str).map(finish_of_stop_reason)
                }
                None => m.status.as_ref().and_then(Value::as_str).and_then(|s| {
                    let reason = m.incomplete_details.as_ref().and_then(|d| d.get("reason")).and_then(Value::as_str);
                    finish_of_status(s, reason)
                }),
            },
        });
    }
    // Valid JSON of another shape (array, odd `choices`): keep what fits.
    let v: Value = serde_json::from_slice(body).ok()?;
    let finish_reason = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .and_then(|c| str_of(c.get("finish_reason")));
    Some(BodyMeta {
        id: str_of(v.get("id")),
        usage: usage_of(v.get("usage")),
        finish_reason,
        model: str_of(v.get("model")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(s: &str) -> ChunkInfo {
        let (info, invalid) = classify_sse(s.as_bytes());
        assert!(!invalid, "{s}");
        info
    }

    /// A vLLM `/v1/responses` stream's events (their JSON as vLLM's
    /// pydantic models write it: members in declaration order, `type` last).
    #[test]
    fn classifies_responses_api_events() {
        let response = |status: &str, usage: &str| format!(r#"{{"id":"resp_9f","created_at":1767225600,"incomplete_details":null,"instructions":"SECRET system","metadata":null,"model":"org/m-8b","object":"response","output":[],"parallel_tool_calls":true,"temperature":1.0,"tool_choice":"auto","tools":[],"top_p":1.0,"status":"{status}","usage":{usage},"user":null}}"#);
        let ev = |json: String| classify_sse(json.as_bytes());
        let (created, bad) = ev(format!(r#"{{"response":{},"sequence_number":0,"type":"response.created"}}"#, response("in_progress", "null")));
        assert!(!bad);
        assert_eq!((created.kind, created.id.as_deref(), created.model.as_deref()), (SseKind::Role, Some("resp_9f"), Some("org/m-8b")));
        for (json, kind, bytes) in [
            (r#"{"response":{"id":"resp_9f","status":"in_progress"},"sequence_number":1,"type":"response.in_progress"}"#, SseKind::Other, 0),
            (r#"{"item":{"id":"msg_1","content":[],"role":"assistant","status":"in_progress","type":"message"},"output_index":0,"sequence_number":2,"type":"response.output_item.added"}"#, SseKind::Other, 0),
            (r#"{"content_index":0,"delta":"Hel","item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":4,"type":"response.output_text.delta"}"#, SseKind::Content, 3),
            (r#"{"content_index":0,"delta":"","item_id":"msg_1","output_index":0,"sequence_number":5,"type":"response.output_text.delta"}"#, SseKind::Other, 0),
            (r#"{"content_index":0,"delta":"think","item_id":"rs_1","output_index":0,"sequence_number":6,"type":"response.reasoning_text.delta"}"#, SseKind::Content, 5),
            (r#"{"delta":"{\"a\":1}","item_id":"fc_1","output_index":1,"sequence_number":7,"type":"response.function_call_arguments.delta"}"#, SseKind::Content, 7),
            (r#"{"content_index":0,"item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":8,"text":"Hello SECRET","type":"response.output_text.done"}"#, SseKind::Other, 0),
            (r#"{"code":"x","message":"boom","param":null,"sequence_number":9,"type":"error"}"#, SseKind::Error, 0),
        ] {
            let (c, bad) = classify_sse(json.as_bytes());
            assert!(!bad);
            assert_eq!((c.kind, c.content_bytes), (kind, bytes), "{json}");
        }
        let usage = r#"{"input_tokens":120,"input_tokens_details":{"cached_tokens":64},"output_tokens":9,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":129}"#;
        let (done, _) = ev(format!(r#"{{"response":{},"sequence_number":10,"type":"response.completed"}}"#, response("completed", usage)));
        let want = Usage { prompt_tokens: Some(120), completion_tokens: Some(9), cached_tokens: Some(64) };
        assert_eq!((done.kind, done.usage, done.finish_reason.as_deref()), (SseKind::Usage, Some(want), Some("stop")));
        let (cut, _) = ev(format!(r#"{{"response":{},"sequence_number":10,"type":"response.incomplete"}}"#, response("incomplete", usage).replace(r#""incomplete_details":null"#, r#""incomplete_details":{"reason":"max_output_tokens"}"#)));
        assert_eq!(cut.finish_reason.as_deref(), Some("length"));
        // Cut by the capture: read from the last bytes, the id from the first.
        let whole = format!(r#"{{"response":{},"sequence_number":10,"type":"response.completed"}}"#, response("completed", usage));
        let head = partial_head(&whole.as_bytes()[..30]);
        assert_eq!(head, PartialHead { id: Some("resp_9f".into()), kind: None });
        let tail = classify_tail(&whole.as_bytes()[whole.len() - 300..], head).expect("a Responses event");
        assert_eq!((tail.kind, tail.id.as_deref(), tail.usage, tail.finish_reason.as_deref()), (SseKind::Usage, Some("resp_9f"), Some(want), Some("stop")));
        let delta = br#"xxxxxxxx","item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":4,"type":"response.output_text.delta"}"#;
        assert_eq!(classify_tail(delta, PartialHead::default()).map(|c| (c.kind, c.content_bytes)), Some((SseKind::Content, 0)), "a delta of unknown length");
        // A chat chunk's tail names no event type.
        assert_eq!(classify_tail(br#"ent":"x"},"finish_reason":null}]}"#, PartialHead::default()), None);
        assert!(!format!("{done:?}{tail:?}").contains("SECRET"));
    }

    #[test]
    fn classifies_anthropic_messages_api_events() {
        let got: Vec<_> = crate::proto::tests::MESSAGES_STREAM
            .iter()
            .map(|json| {
                let (c, bad) = classify_sse(json.as_bytes());
                assert!(!bad, "{json}");
                c
            })
            .collect();
        let kinds: Vec<_> = got.iter().map(|c| (c.kind, c.content_bytes)).collect();
        assert_eq!(
            kinds,
            [(SseKind::Role, 0), (SseKind::Other, 0), (SseKind::Content, 2), (SseKind::Content, 4), (SseKind::Content, 5), (SseKind::Content, 5), (SseKind::Content, 5), (SseKind::Content, 1), (SseKind::Other, 0), (SseKind::Content, 1), (SseKind::Other, 0), (SseKind::Other, 0), (SseKind::Usage, 0), (SseKind::Done, 0)]
        );
        // The message's id is vLLM's chat completion's: what the engine request id extends.
        assert_eq!((got[0].id.as_deref(), got[0].model.as_deref()), (Some("chatcmpl-a13fa5d1dff138bd"), Some("tiny")));
        assert_eq!(got[0].usage, Some(Usage { prompt_tokens: Some(22), completion_tokens: None, cached_tokens: None }));
        assert_eq!((got[12].usage, got[12].finish_reason.as_deref()), (Some(Usage { prompt_tokens: Some(22), completion_tokens: Some(8), cached_tokens: None }), Some("length")));
        // Thinking and a tool call's JSON are content; so is a tool_use block's start (its name).
        for (json, kind, bytes) in [
            (r#"{"type":"content_block_delta","delta":{"type":"thinking_delta","thinking":"hmm"},"index":0}"#, SseKind::Content, 3),
            (r#"{"type":"content_block_start","content_block":{"type":"tool_use","id":"call_1","name":"search","input":{}},"index":1}"#, SseKind::Content, 6),
            (r#"{"type":"content_block_delta","delta":{"type":"input_json_delta","partial_json":"{\"q\":"},"index":1}"#, SseKind::Content, 5),
            (r#"{"type":"content_block_delta","delta":{"type":"signature_delta","signature":"abc"},"index":0}"#, SseKind::Other, 0),
            (r#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#, SseKind::Error, 0),
        ] {
            let (c, _) = classify_sse(json.as_bytes());
            assert_eq!((c.kind, c.content_bytes), (kind, bytes), "{json}");
        }
        // Stop reasons in chat's words; the prompt counts the cached tokens Anthropic's
        // input_tokens leave out (vLLM with --enable-prompt-tokens-details).
        for (reason, finish) in [("end_turn", "stop"), ("stop_sequence", "stop"), ("tool_use", "tool_calls"), ("max_tokens", "length"), ("refusal", "refusal")] {
            let json = format!(r#"{{"type":"message_delta","delta":{{"stop_reason":"{reason}","stop_sequence":null}},"usage":{{"input_tokens":5,"output_tokens":3,"cache_read_input_tokens":96,"cache_creation_input_tokens":2}}}}"#);
            let (c, _) = classify_sse(json.as_bytes());
            assert_eq!((c.kind, c.finish_reason.as_deref()), (SseKind::Usage, Some(finish)));
            assert_eq!(c.usage, Some(Usage { prompt_tokens: Some(103), completion_tokens: Some(3), cached_tokens: Some(96) }));
        }
    }

    /// A non-streaming `/v1/messages` answer (vLLM 0.32.0's): its id, usage
    /// and stop reason, whole or from its ends.
    #[test]
    fn an_anthropic_messages_body_gives_its_id_usage_and_stop_reason() {
        let body = r#"{"id":"chatcmpl-98580c3782e1e428","type":"message","role":"assistant","content":[{"type":"text","text":"workerse batch SECRET block"}],"model":"tiny","stop_reason":"max_tokens","usage":{"input_tokens":14,"output_tokens":8}}"#;
        let want = BodyMeta {
            id: Some("chatcmpl-98580c3782e1e428".into()),
            usage: Some(Usage { prompt_tokens: Some(14), completion_tokens: Some(8), cached_tokens: None }),
            finish_reason: Some("length".into()),
            model: Some("tiny".into()),
        };
        assert_eq!(response_meta(body.as_bytes()), Some(want.clone()));
        let long = body.replace("SECRET", &"x".repeat(50_000));
        assert_eq!(response_meta_parts(&long.as_bytes()[..4096], &long.as_bytes()[long.len() - 4096..]), want);
        let tool = body.replace(r#""stop_reason":"max_tokens""#, r#""stop_reason":"tool_use""#);
        assert_eq!(response_meta(tool.as_bytes()).and_then(|m| m.finish_reason).as_deref(), Some("tool_calls"));
    }

    /// A non-streaming `/v1/responses` answer: `status` (and the reason of an
    /// incomplete one) is its finish, `usage` its own names; a health
    /// check's `status` is not a finish.
    #[test]
    fn a_responses_api_body_gives_its_usage_and_status() {
        let body = br#"{"id":"resp_1","created_at":1,"incomplete_details":{"reason":"max_output_tokens"},"model":"m","object":"response","output":[{"type":"message","content":[{"type":"output_text","text":"SECRET"}]}],"status":"incomplete","usage":{"input_tokens":5,"output_tokens":16,"input_tokens_details":{"cached_tokens":0}}}"#;
        let m = response_meta(body).unwrap();
        assert_eq!((m.id.as_deref(), m.model.as_deref(), m.finish_reason.as_deref()), (Some("resp_1"), Some("m"), Some("length")));
        assert_eq!(m.usage, Some(Usage { prompt_tokens: Some(5), completion_tokens: Some(16), cached_tokens: Some(0) }));
        let parts = response_meta_parts(&body[..40], &body[60..]);
        assert_eq!((parts.id.as_deref(), parts.usage.and_then(|u| u.completion_tokens), parts.finish_reason.as_deref()), (Some("resp_1"), Some(16), Some("length")));
        assert_eq!(response_meta(br#"{"status":"ok"}"#).unwrap().finish_reason, None);
    }

    #[test]
    fn classifies_vllm_chat_chunks() {
        let role = kind(
            r#"{"id":"chatcmpl-1","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
        );
        assert_eq!(
            (role.kind, role.id.as_deref(), role.content_bytes),
            (SseKind::Role, Some("chatcmpl-1"), 0)
        );
        let c = kind(
            r#"{"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"héllo"},"finish_reason":null}]}"#,
        );
        assert_eq!((c.kind, c.content_bytes), (SseKind::Content, 6));
        let f = kind(
            r#"{"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}"#,
        );
        assert_eq!(
            (f.kind, f.finish_reason.as_deref()),
            (SseKind::Finish, Some("stop"))
        );
        let cf = kind(
            r#"{"id":"x","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"length"}]}"#,
        );
        assert_eq!(
            (cf.kind, cf.finish_reason.as_deref()),
            (SseKind::Content, Some("length"))
        );
        let u = kind(
            r#"{"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}}"#,
        );
        assert_eq!(u.kind, SseKind::Usage);
        assert_eq!(
            u.usage,
            Some(Usage {
                prompt_tokens: Some(7),
                completion_tokens: Some(3),
                cached_tokens: Some(4)
            })
        );
        assert_eq!(kind("[DONE]").kind, SseKind::Done);
        assert_eq!(
            kind(r#"{"error":{"message":"boom","code":500}}"#).kind,
            SseKind::Error
        );
        assert_eq!(
            kind(r#"{"id":"x","choices":[{"index":0,"delta":{}}]}"#).kind,
            SseKind::Other
        );
        assert_eq!(kind("[1,2]").kind, SseKind::Other);
    }

    #[test]
    fn continuous_usage_rides_on_content_chunks() {
        let c = kind(
            r#"{"id":"x","choices":[{"index":0,"delta":{"content":"ab"}}],"usage":{"prompt_tokens":5,"completion_tokens":1}}"#,
        );
        assert_eq!(c.kind, SseKind::Content);
        assert_eq!(c.usage.and_then(|u| u.completion_tokens), Some(1));
    }

    #[test]
    fn reasoning_tool_calls_and_completions_text_count_as_content() {
        let r = kind(r#"{"choices":[{"delta":{"reasoning_content":"abc","reasoning":"abc"}}]}"#);
        assert_eq!((r.kind, r.content_bytes), (SseKind::Content, 3));
        let t = kind(
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"{\"a\""}}]}}]}"#,
        );
        assert_eq!((t.kind, t.content_bytes), (SseKind::Content, 5));
        let c =
            kind(r#"{"id":"cmpl-9","choices":[{"index":0,"text":" world","finish_reason":null}]}"#);
        assert_eq!(
            (c.kind, c.id.as_deref(), c.content_bytes),
            (SseKind::Content, Some("cmpl-9"), 6)
        );
        let two = kind(r#"{"choices":[{"index":0,"text":"ab"},{"index":1,"text":"cde"}]}"#);
        assert_eq!(two.content_bytes, 5);
    }

    #[test]
    fn invalid_json_is_reported() {
        let (info, invalid) = classify_sse(b"{\"id\":\"x\",");
        assert!(invalid);
        assert_eq!(info.kind, SseKind::Other);
    }

    #[test]
    fn partial_id_reads_only_a_leading_id() {
        assert_eq!(
            partial_id(br#"{"id":"chatcmpl-abc","object":"chat.comp"#).as_deref(),
            Some("chatcmpl-abc")
        );
        assert_eq!(partial_id(br#"{"id":"chatcmpl-ab"#), None);
        assert_eq!(partial_id(br#"{"object":{"x":1},"id":"a"}"#), None);
        assert_eq!(partial_id(br#"{"object":"x\"y","id":"a"}"#), None);
        assert_eq!(partial_id(br#"{"id":"","object":"x"}"#), None);
        // Behind plain scalars: vLLM's Rust frontend writes an event's type and sequence number
        // first, vLLM's Anthropic Messages API the type.
        let rust = br#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_f95387a6","object":"response","instructions":"SECRET"#;
        assert_eq!(partial_head(rust), PartialHead { id: Some("resp_f95387a6".into()), kind: Some("response.created".into()) });
        let start = br#"{"type":"message_start","message":{"id":"chatcmpl-a13f","type":"message","role":"assistant","content":[{"type":"text","text":"SECRET"#;
        assert_eq!(partial_head(start), PartialHead { id: Some("chatcmpl-a13f".into()), kind: Some("message_start".into()) });
        let delta = br#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"SECRET"#;
        assert_eq!(partial_head(delta), PartialHead { id: None, kind: Some("content_block_delta".into()) });
        assert_eq!(partial_head(br#"{"created":17,"done":true,"x":null,"id":"a"}"#).id.as_deref(), Some("a"));
    }

    /// Cut Anthropic and Rust-frontend events are told by the type their first bytes name.
    #[test]
    fn cut_events_whose_type_comes_first_are_told_by_their_head() {
        let delta = br#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"SECRET"#;
        let c = classify_tail(br#"SECRET more"},"index":0}"#, partial_head(delta)).expect("a Messages API event");
        assert_eq!((c.kind, c.content_bytes), (SseKind::Content, 0));
        let created = br#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","instructions":"SECRET"#;
        let c = classify_tail(br#"x","user":null}}"#, partial_head(created)).expect("a Responses API event");
        assert_eq!((c.kind, c.id.as_deref()), (SseKind::Role, Some("resp_1")));
        let done = br#"{"type":"response.completed","sequence_number":12,"response":{"id":"resp_1","instructions":"SECRET"#;
        let tail = br#"ECRET","status":"completed","usage":{"input_tokens":2815,"input_tokens_details":{"cached_tokens":2800},"output_tokens":8},"user":null}}"#;
        let c = classify_tail(tail, partial_head(done)).expect("a Responses API event");
        assert_eq!((c.kind, c.finish_reason.as_deref(), c.usage.and_then(|u| u.cached_tokens)), (SseKind::Usage, Some("stop"), Some(2800)));
        // A chat chunk names no type at either end.
        assert_eq!(classify_tail(br#"x"}}]}"#, partial_head(br#"{"id":"chatcmpl-1","choices":[{"delta":{"content":"SECRET"#)), None);
    }

    #[test]
    fn request_and_response_meta() {
        let body =
            br#"{"messages":[{"role":"user","content":"SECRET"}],"model":"m1","stream":true}"#;
        assert_eq!(
            request_meta(body),
            Some(RequestMeta { stream: Some(true), model: Some("m1".to_string()), previous_response_id: None })
        );
        assert_eq!(request_meta(b"{\"prompt\":\"x\"}"), Some(RequestMeta::default()));
        assert_eq!(request_meta(b"not json"), None);
        // The Responses API's link to the turn before; null or empty is none.
        let next = br#"{"input":[{"role":"user","content":"SECRET"}],"model":"m","previous_response_id":"resp_7","stream":true}"#;
        assert_eq!(request_meta(next).and_then(|m| m.previous_response_id).as_deref(), Some("resp_7"));
        assert_eq!(request_meta(br#"{"previous_response_id":null}"#).unwrap().previous_response_id, None);
        assert_eq!(request_meta(br#"{"previous_response_id":""}"#).unwrap().previous_response_id, None);
        // Behind a long input, from either end.
        let (head, tail) = (&next[..40], &next[40..]);
        assert_eq!(request_meta_parts(head, tail).previous_response_id.as_deref(), Some("resp_7"));
        let first = br#"{"previous_response_id":"resp_8","input":"SECRET SECRET","model":"m"}"#;
        assert_eq!(request_meta_parts(&first[..45], &first[60..]).previous_response_id.as_deref(), Some("resp_8"));
        let r = response_meta(
            br#"{"id":"chatcmpl-2","choices":[{"index":0,"message":{"content":"SECRET"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#,
        )
        .unwrap();
        assert_eq!(r.id.as_deref(), Some("chatcmpl-2"));
        assert_eq!(r.finish_reason.as_deref(), Some("stop"));
        assert_eq!(r.usage.and_then(|u| u.prompt_tokens), Some(3));
        assert_eq!(r.model, None);
        assert!(!format!("{r:?}").contains("SECRET"));
        // The model a response names: whole, from the head of a partial
        // body, or from the tail when the head lost it.
        let named = br#"{"id":"cmpl-3","model":"org/m-7b","choices":[{"text":"SECRET","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#;
        assert_eq!(response_meta(named).unwrap().model.as_deref(), Some("org/m-7b"));
        assert_eq!(response_meta_parts(&named[..40], b"").model.as_deref(), Some("org/m-7b"));
        let last = br#"{"id":"cmpl-4","choices":[],"model":"tail-m"}"#;
        assert_eq!(response_meta_parts(&last[..10], &last[20..]).model.as_deref(), Some("tail-m"));
        let (chunk, bad) = classify_sse(br#"{"id":"c","model":"m-9","choices":[{"index":0,"delta":{"role":"assistant"}}]}"#);
        assert!(!bad);
        assert_eq!((chunk.kind, chunk.model.as_deref()), (SseKind::Role, Some("m-9")));
    }
}
