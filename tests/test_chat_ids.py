"""Chat prompts keep the ids the model generated for its earlier replies (graphs.chat_ids)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from graphs.chat_ids import ReplyIds, encode_chat, reply_ids_of

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    """Byte-level BPE with one merge, "ab": "ab" has a canonical id and a second split, a + b."""
    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab["ab"] = 256
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHATML
    return tok


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _split(tok, text):
    """`text`'s ids with every "ab" split in two: what a model may generate, never the tokenizer."""
    return [i for t in _ids(tok, text) for i in (_ids(tok, "a") + _ids(tok, "b") if t == 256 else [t])]


USER = [{"role": "user", "content": "hi"}]


def _second_turn(reply: str) -> list[dict]:
    return USER + [{"role": "assistant", "content": reply}, {"role": "user", "content": "more ab"}]


def test_a_reply_sent_back_keeps_its_generated_ids(tok):
    replies = ReplyIds(1000)
    prompt = encode_chat(tok, USER, replies)
    generated = _split(tok, "ab cab")
    assert tok.decode(generated) == "ab cab" and generated != _ids(tok, "ab cab")
    replies.remember(prompt, generated, "ab cab")

    second = encode_chat(tok, _second_turn("ab cab"), replies)
    tail = _ids(tok, "<|im_end|>\n<|im_start|>user\nmore ab<|im_end|>\n<|im_start|>assistant\n")
    assert second == prompt + generated + tail  # the cached KV's ids, through the whole answer
    assert tok.decode(second) == tok.decode(encode_chat(tok, _second_turn("ab cab"), None))
    assert replies.reused == 1
    # Without the store, the template's text re-tokenized: the answer's ids differ from the model's.
    plain = encode_chat(tok, _second_turn("ab cab"), None)
    assert plain == _ids(tok, tok.apply_chat_template(_second_turn("ab cab"), tokenize=False,
                                                      add_generation_prompt=True))
    assert plain[: len(prompt) + len(generated)] != prompt + generated


def test_only_the_same_reply_after_the_same_prompt_is_put_back(tok):
    replies = ReplyIds(1000)
    prompt = encode_chat(tok, USER, replies)
    replies.remember(prompt, _split(tok, "ab"), "ab")
    edited = encode_chat(tok, _second_turn("ab!"), replies)
    other_prompt = [{"role": "system", "content": "s"}] + _second_turn("ab")
    assert edited == encode_chat(tok, _second_turn("ab!"), None)
    assert encode_chat(tok, other_prompt, replies) == encode_chat(tok, other_prompt, None)
    assert replies.reused == 0


def test_every_known_reply_of_a_long_chat_is_put_back(tok):
    replies = ReplyIds(1000)
    first = encode_chat(tok, USER, replies)
    replies.remember(first, _split(tok, "ab1"), "ab1")
    second_msgs = _second_turn("ab1")
    second = encode_chat(tok, second_msgs, replies)
    replies.remember(second, _split(tok, "ab2"), "ab2")
    third_msgs = second_msgs + [{"role": "assistant", "content": "ab2"}, {"role": "user", "content": "end"}]
    third = encode_chat(tok, third_msgs, replies)
    assert third[: len(second)] == second
    assert third[len(second): len(second) + 3] == _split(tok, "ab2")
    assert tok.decode(third) == tok.apply_chat_template(third_msgs, tokenize=False, add_generation_prompt=True)


def test_the_store_drops_the_least_recently_used_beyond_its_tokens(tok):
    replies = ReplyIds(6)
    replies.remember([1], [10, 11, 12], "x")
    replies.remember([2], [20, 21, 22], "y")
    assert replies.get([1], "x") == [10, 11, 12]  # x is now the most recent
    replies.remember([3], [30], "z")
    assert replies.get([2], "y") is None and not replies.has_text("y")
    assert replies.get([1], "x") == [10, 11, 12] and replies.get([3], "z") == [30]
    assert replies.num_tokens == 4 and len(replies) == 2
    replies.remember([4], list(range(7)), "too long")  # longer than the whole store: not kept
    assert not replies.has_text("too long") and len(replies) == 2


def test_a_replys_ids_are_its_output_without_the_stop_id(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    out = _split(tok, "ab c")
    assert reply_ids_of(tok, out + [eos], "ab c") == out
    assert reply_ids_of(tok, out, "ab c") == out  # cut at max_tokens: nothing to drop
    assert reply_ids_of(tok, out, "ab") is None  # a stop string cut inside the output: kept out
