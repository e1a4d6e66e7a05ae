"""Chat prompts as token ids, keeping the ids the model generated for its own earlier replies.

A chat client sends the model's answer back as text in the next turn, and the chat template
re-tokenizes it. Where the model generated a split the tokenizer would not make ("Americ" + "a"
for "America"), the re-tokenized history differs from the ids whose KV the prefix cache holds from
that split on, and the rest of the answer is prefilled again (docs/benchmarks.md, session 21:
matches ending at 97-366 of ~600 tokens). `ReplyIds` remembers recent chat replies' generated ids,
keyed by the prompt ids they followed and their text; `encode_chat` puts them back in place of an
assistant message with exactly that text after exactly that prompt, so the model reads its own
tokens, as in one unbroken session, and the cache matches through the answer. Anything else (an
edited or unknown reply, a template that renders past replies differently) is re-tokenized.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from typing import Any

Messages = list[dict[str, Any]]


def _digest(ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


class ReplyIds:
    """Generated ids of recent chat replies, least recently used dropped beyond `max_tokens`."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.reused = 0  # assistant messages put back as their generated ids
        self._entries: OrderedDict[tuple[bytes, str], array] = OrderedDict()
        self._texts: Counter[str] = Counter()  # texts held, so most messages need no digest

    def __len__(self) -> int:
        return len(self._entries)

    def has_text(self, text: str) -> bool:
        return text in self._texts

    def remember(self, prompt_ids: list[int], reply_ids: list[int], text: str) -> None:
        if not reply_ids or len(reply_ids) > self.max_tokens:
            return
        key = (_digest(prompt_ids), text)
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_tokens -= len(old)
            self._texts[text] -= 1
        self._entries[key] = array("q", reply_ids)
        self.num_tokens += len(reply_ids)
        self._texts[text] += 1
        while self.num_tokens > self.max_tokens:
            (_, dropped), ids = self._entries.popitem(last=False)
            self.num_tokens -= len(ids)
            self._texts[dropped] -= 1
            if not self._texts[dropped]:
                del self._texts[dropped]

    def get(self, prompt_ids: list[int], text: str) -> list[int] | None:
        key = (_digest(prompt_ids), text)
        ids = self._entries.get(key)
        if ids is None:
            return None
        self._entries.move_to_end(key)
        return ids.tolist()


def reply_ids_of(tokenizer, token_ids: list[int], text: str) -> list[int] | None:
    """The ids of a finished reply whose text the client gets back: its output ids, without the stop
    id that ended it (its text is left out, and the template writes its own end of turn). None where
    no prefix of them decodes to exactly `text` (a stop string cut inside a token)."""
    for ids in (token_ids, token_ids[:-1]):
        if ids and tokenizer.decode(ids) == text:
            return list(ids)
    return None


def render_chat(tokenizer, messages: Messages) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_chat(tokenizer, messages: Messages, replies: ReplyIds | None) -> list[int]:
    """The prompt ids of a chat: the template's text tokenized, except that each assistant message
    `replies` knows (same text, after the same prompt ids) keeps its generated ids. The text before
    such a message is the prompt the model answered, rendered and tokenized as that turn's prompt
    was, so the ids it is keyed by come out the same."""
    text = render_chat(tokenizer, messages)
    if replies is None:
        return tokenizer.encode(text, add_special_tokens=False)
    known = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and isinstance(m.get("content"), str)
             and replies.has_text(m["content"])]
    ids: list[int] = []
    done = 0  # `ids` are the tokens of text[:done]
    for i in known:
        content = messages[i]["content"]
        before = render_chat(tokenizer, messages[:i])
        head = len(before)
        if head < done or not (text.startswith(before) and text.startswith(content, head)):
            continue
        prompt = ids + tokenizer.encode(text[done:head], add_special_tokens=False)
        reply = replies.get(prompt, content)
        if reply is not None:
            ids, done = prompt + reply, head + len(content)
            replies.reused += 1
    return ids + tokenizer.encode(text[done:], add_special_tokens=False)
