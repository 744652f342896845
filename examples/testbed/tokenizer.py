"""Deterministic built-in byte-level tokenizer (no downloads).

* ids 0..255   = the UTF-8 bytes of the text (one token per byte);
* ids 256..259 = special tokens ``<|bos|>``, ``<|eos|>``, ``<|im_start|>``, ``<|im_end|>``;
* ids 260..VOCAB_SIZE-1 exist in the model's vocabulary but are never produced.

Chat template (ChatML-like), built directly as ids so user text can never forge a special token::

    <|bos|> (<|im_start|> role "\\n" content <|im_end|> "\\n")*  <|im_start|> "assistant\\n"

Because tokens are bytes, re-sending a previous answer re-tokenises to exactly the ids the model
generated, so the prefix cache hits across the hops of a chain as it does with a real tokenizer.

The random-weight model samples only from ``SAMPLEABLE_IDS`` (printable ASCII and newline) so
responses are valid, JSON-friendly text; EOS is added only when the engine allows it.
"""

from __future__ import annotations

import codecs
from typing import Any, Iterable

BOS_ID = 256
EOS_ID = 257
IM_START_ID = 258
IM_END_ID = 259
SPECIAL_TOKENS = {"<|bos|>": BOS_ID, "<|eos|>": EOS_ID, "<|im_start|>": IM_START_ID, "<|im_end|>": IM_END_ID}
VOCAB_SIZE = 320
SAMPLEABLE_IDS = [10] + list(range(32, 127))


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


class ByteTokenizer:
    vocab_size = VOCAB_SIZE
    eos_token_id = EOS_ID
    bos_token_id = BOS_ID

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID] + ids if add_bos else ids

    def apply_chat_template(self, messages: Iterable[dict], add_generation_prompt: bool = True) -> list[int]:
        ids = [BOS_ID]
        for m in messages:
            role = str(m.get("role", "user"))
            ids.append(IM_START_ID)
            ids.extend((role + "\n" + _content_text(m.get("content"))).encode("utf-8"))
            ids.append(IM_END_ID)
            ids.append(10)
        if add_generation_prompt:
            ids.append(IM_START_ID)
            ids.extend(b"assistant\n")
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        d = IncrementalDetokenizer(skip_special_tokens)
        return d.feed(ids) + d.flush()


class IncrementalDetokenizer:
    """Streams text out of token ids; holds back incomplete UTF-8 sequences (like vLLM's
    incremental detokenizer holds back partial characters)."""

    def __init__(self, skip_special_tokens: bool = True):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip = skip_special_tokens

    def feed(self, ids: Iterable[int]) -> str:
        out = []
        for t in ids:
            if 0 <= t < 256:
                out.append(self._dec.decode(bytes((t,))))
            elif not self._skip:
                out.append(self._dec.decode(b"", final=True))
                for name, sid in SPECIAL_TOKENS.items():
                    if sid == t:
                        out.append(name)
        return "".join(out)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
