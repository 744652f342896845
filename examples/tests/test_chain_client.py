"""The chain client's reading of the Anthropic Messages API (`--api messages`), on vLLM 0.32.0's
own bytes (its CPU build serving a tiny model): no server needed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from helpers import EXAMPLES

_spec = importlib.util.spec_from_file_location("chain_client", EXAMPLES / "chain_client.py")
cc = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
_spec.loader.exec_module(cc)

# vLLM 0.32.0's /v1/messages stream for one 8-token answer cut at max_tokens (`data:` lines).
STREAM = [
    '{"type":"message_start","message":{"id":"chatcmpl-a13fa5d1dff138bd","type":"message","role":"assistant","content":[],"model":"tiny","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":22,"output_tokens":0}}}',
    '{"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}',
    '{"type":"content_block_delta","delta":{"type":"text_delta","text":"am"},"index":0}',
    '{"type":"content_block_delta","delta":{"type":"text_delta","text":""},"index":0}',
    '{"type":"content_block_delta","delta":{"type":"text_delta","text":" case"},"index":0}',
    '{"type":"content_block_stop","index":0}',
    '{"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{"input_tokens":22,"output_tokens":8}}',
    '{"type":"message_stop"}',
]


def _rec() -> dict:
    return {"id": None, "first_content_ns": None, "chunk_ns": [], "content_chunks": 0, "usage": None,
            "finish_reason": None, "done_ns": None}


def test_a_messages_stream_gives_the_id_content_chunks_usage_and_end_in_chats_terms():
    rec, text = _rec(), []
    for t, data in enumerate(STREAM, start=100):
        cc.messages_event(rec, json.loads(data), t, text)
    assert rec["id"] == "chatcmpl-a13fa5d1dff138bd"
    assert (rec["content_chunks"], rec["chunk_ns"], rec["first_content_ns"], "".join(text)) == (2, [102, 104], 102, "am case")
    assert rec["usage"] == {"prompt_tokens": 22, "completion_tokens": 8, "prompt_tokens_details": None}
    assert (rec["finish_reason"], rec["done_ns"]) == ("length", 107)


def test_a_whole_messages_answer_adds_the_cached_prompt_tokens_back():
    body = {"id": "chatcmpl-1", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "hi"}],
            "model": "tiny", "stop_reason": "end_turn",
            "usage": {"input_tokens": 5, "output_tokens": 3, "cache_read_input_tokens": 96, "cache_creation_input_tokens": 2}}
    rec, text = _rec(), []
    rec["done_ns"] = 7
    cc.answer(rec, body, "messages", text)
    assert (rec["id"], "".join(text), rec["finish_reason"]) == ("chatcmpl-1", "hi", "stop")
    assert rec["usage"] == {"prompt_tokens": 103, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 96}}


@pytest.mark.parametrize("argv", [["--api", "messages", "--json-schema-hops", "1"], ["--previous-response"]])
def test_options_of_another_api_are_refused(argv):
    with pytest.raises(SystemExit):
        cc.main(argv)
