"""The offline API: prompts and chat, streaming, seeds, stop rules, context length,
incremental detokenization, and configuration errors caught before weights load."""

from __future__ import annotations

import pytest
import torch

import actors.target_runner
from actors.request import IncrementalDetokenizer, Request
from graphs import EngineConfig, SamplingParams, build_graph
from spec import ShapeContractError
from bench.random_models import byte_tokenizer, make_eagle3


@pytest.fixture(scope="module")
def plain(tiny_target):
    return build_graph(EngineConfig(model=str(tiny_target)))


@pytest.fixture(scope="module")
def eagle3(tiny_target, tiny_eagle3_own):
    return build_graph(EngineConfig(model=str(tiny_target), speculative_algorithm="eagle3",
                                    draft_model=str(tiny_eagle3_own), eagle_topk=2, num_draft_tokens=6))


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_text_and_token_prompts_agree(plain):
    by_text, by_ids = plain.generate(["w1 w2 w3", [1, 2, 3]], GREEDY)
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.num_prompt_tokens == 3
    assert by_text.text == plain.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    assert by_text.finish_reason == "length" and by_text.num_output_tokens == 12


def test_chat_applies_the_template(plain):
    chat = plain.chat([[{"role": "user", "content": "w5 w6"}]], GREEDY)[0]
    text = plain.generate(["w5 w6"], GREEDY)[0]  # the tiny template is "content "
    assert chat.token_ids == text.token_ids


def test_a_chat_reply_sent_back_is_read_as_its_generated_ids(plain, tiny_target):
    """The offline chat API remembers its replies (graphs.chat_ids); a later turn carrying one reads
    the first turn's prompt and reply ids unchanged, and an engine with the store off re-tokenizes."""
    conv = [{"role": "user", "content": "w5 w6"}]
    first = plain.chat([conv], GREEDY)[0]
    second = conv + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "w7"}]
    before = plain.replies.reused
    ids = plain.encode_chat(second)
    assert plain.replies.reused == before + 1
    assert ids == plain.encode_chat(conv) + first.token_ids + [7]
    off = build_graph(EngineConfig(model=str(tiny_target), reply_ids_tokens=0))
    assert off.replies is None and off.encode_chat(second) == ids  # the word tokenizer splits one way only
    with pytest.raises(ValueError, match="reply_ids_tokens"):
        EngineConfig(model=str(tiny_target), reply_ids_tokens=-1)


def test_stream_concatenation_equals_generate(plain, eagle3):
    for engine in (plain, eagle3):
        streamed = list(engine.stream("w9 w8 w7", GREEDY))
        assert len(streamed) > 1
        assert "".join(streamed) == engine.generate(["w9 w8 w7"], GREEDY)[0].text


def test_same_seed_same_text_across_algorithms(plain, eagle3):
    """Randomness is a function of (seed, position), so speculation does not change samples."""
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    a = plain.generate(["w1 w2"], params)[0]
    b = plain.generate(["w1 w2"], params)[0]
    c = eagle3.generate(["w1 w2"], params)[0]
    assert a.token_ids == b.token_ids == c.token_ids
    other = plain.generate(["w1 w2"], SamplingParams(max_tokens=16, temperature=0.9, seed=99, ignore_eos=True))[0]
    assert other.token_ids != a.token_ids


def test_stop_string_is_not_returned(plain):
    full = plain.generate(["w1 w2"], GREEDY)[0]
    words = full.text.split()
    stop = words[4]
    out = plain.generate(["w1 w2"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text
    streamed = "".join(plain.stream("w1 w2", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])))
    assert streamed == out.text


def test_context_length_stops_generation(tiny_target):
    engine = build_graph(EngineConfig(model=str(tiny_target), speculative_algorithm="ngram", max_model_len=12))
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 7
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([list(range(12))], GREEDY)


def test_eos_stops_unless_ignored():
    tok = byte_tokenizer()
    eos = tok.eos_token_id

    def request(ignore_eos):
        params = SamplingParams(max_tokens=10, ignore_eos=ignore_eos)
        return Request(0, [1], params, 0, IncrementalDetokenizer(tok), {eos}, 100)

    stopped = request(False)
    stopped.append_tokens([104, 105, eos, 106])
    assert stopped.finish_reason == "stop" and stopped.output_ids == [104, 105, eos] and stopped.text == "hi"
    ignored = request(True)
    ignored.append_tokens([104, 105, eos, 106])
    assert ignored.finish_reason is None and ignored.output_ids == [104, 105, eos, 106]


def test_detokenizer_never_emits_half_a_character():
    tok = byte_tokenizer()
    text = "héllo 🚀 wörld ✓"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_detokenizer_stream_releases_what_the_python_rule_does():
    tok = byte_tokenizer()
    ids = tok.encode("héllo 🚀 wörld ✓ ") + [tok.eos_token_id] + tok.encode("日本")
    fast, python = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
    python._stream = None
    assert fast._stream is not None  # a fast tokenizer decodes in Rust
    assert [fast.add(t) for t in ids] == [python.add(t) for t in ids]
    # A request cut inside a character releases its partial bytes at the end, as the Python rule does.
    cut = tok.encode("ok 🚀")[:-1]
    fast, python = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
    python._stream = None
    assert [fast.add(t, final=i == len(cut) - 1) for i, t in enumerate(cut)] == [
        python.add(t, final=i == len(cut) - 1) for i, t in enumerate(cut)]
    assert fast.tokens == cut and "\ufffd" in python.tokenizer.decode(cut)


def test_text_is_made_when_read_as_the_eager_rule_makes_it():
    tok = byte_tokenizer()
    eos = tok.eos_token_id
    ids = tok.encode("héllo 🚀 wörld ✓")

    def run(stop, tokens, **params):
        request = Request(0, [1], SamplingParams(stop=stop, **{"max_tokens": 100, **params}), 0,
                          IncrementalDetokenizer(tok), {eos}, 1000)
        for k in range(0, len(tokens), 3):  # a few tokens a step, as verify steps commit them
            if request.finish_reason is None:
                request.append_tokens(tokens[k:k + 3])
        return request

    # Without stop strings nothing is decoded until the text is read; with them (here never
    # matching) every token is decoded as it comes. Both give the text the per-token rule gives.
    whole, cut = "héllo 🚀 wörld ✓", "héllo \ufffd"  # cut: after the rocket's first byte
    for tokens, params, text, end in [
            (ids + [eos, 104], {}, whole, "stop"),
            (ids, {"max_tokens": 9}, cut, "length"),  # the partial character released at the limit
            (ids[:9] + [eos], {}, cut, "stop"),  # and at a stop id
            (ids[:9] + [eos] + ids[9:] + [eos], {"min_tokens": 11}, whole, "stop")]:  # no stop before min_tokens
        lazy, eager = run([], tokens, **params), run(["never"], tokens, **params)
        assert lazy._detokenized == 0 and eager._detokenized == len(eager.output_ids)
        assert lazy.output_ids == eager.output_ids and lazy.finish_reason == eager.finish_reason == end
        assert lazy.text == eager.text == text and lazy.take_delta() == eager.take_delta() == text


def test_detokenizer_falls_back_where_the_stream_fails():
    class Failing:
        def step(self, tokenizer, token):
            raise Exception("Invalid prefix encountered")

    tok = byte_tokenizer()
    ids = tok.encode("héllo 🚀 wörld")
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in ids[:3]]
    detok._stream = Failing()
    deltas += [detok.add(t) for t in ids[3:]]
    assert detok._stream is None and "".join(deltas) == "héllo 🚀 wörld"


def test_config_errors_fail_before_weights_load(monkeypatch, tiny_target, tiny_dir):
    def boom(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(actors.target_runner, "build_target", boom)
    with pytest.raises(ValueError, match="EAGLE, EAGLE3, STANDALONE, NGRAM"):
        build_graph(EngineConfig(model=str(tiny_target), speculative_algorithm="medusa"))
    with pytest.raises(ValueError, match="draft_model"):
        build_graph(EngineConfig(model=str(tiny_target), speculative_algorithm="EAGLE3"))
    bad = make_eagle3(tiny_dir / "eagle3_bad_width", tiny_target, hidden=32)
    config = (bad / "config.json").read_text().replace('"target_hidden_size": 64', '"target_hidden_size": 96')
    (bad / "config.json").write_text(config)
    with pytest.raises(ShapeContractError, match="target_hidden_size"):
        build_graph(EngineConfig(model=str(tiny_target), speculative_algorithm="EAGLE3", draft_model=str(bad)))
    with pytest.raises(ValueError, match="architectures"):
        build_graph(EngineConfig(model=str(tiny_target), speculative_algorithm="EAGLE",
                                 draft_model=str(tiny_dir / "eagle3_bad_width")))


@pytest.mark.parametrize("field,value", [("num_steps", 0), ("eagle_topk", -1), ("num_draft_tokens", 99),
                                         ("backend", "spark"), ("max_model_len", 1), ("kv_slots", 0),
                                         ("dtype", "float8"), ("ngram_branch", -1), ("ngram_branch", 6),
                                         ("disable_by_batch_size", 0), ("disable_by_batch_size", "4"),
                                         ("verify_budget", 0), ("min_path_prob", 1.0), ("min_path_prob", -0.1),
                                         ("min_path_prob", "0.5"), ("adaptive_speculation", "yes"),
                                         ("draft_placement", "nearby"), ("draft_placement", "colocated"),
                                         ("omp_wait_policy", "lazy"), ("graph_channel", "tcp")])
def test_engine_config_validation_names_the_field(tiny_target, field, value):
    kwargs = {"model": str(tiny_target), "speculative_algorithm": "EAGLE3", "draft_model": "x", "eagle_topk": 2,
              "num_draft_tokens": 6, "draft_resources": {"draft_node": 1} if field == "draft_placement" else None,
              field: value}
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_ngram_branch_needs_a_draft_model_tree(tiny_target):
    with pytest.raises(ValueError, match="ngram_branch"):
        EngineConfig(model=str(tiny_target), speculative_algorithm="EAGLE3", draft_model="x", ngram_branch=2)
    with pytest.raises(ValueError, match="ngram_branch"):
        EngineConfig(model=str(tiny_target), speculative_algorithm="NGRAM", ngram_branch=2)


def test_min_path_prob_needs_draft_probabilities(tiny_target):
    with pytest.raises(ValueError, match="min_path_prob"):
        EngineConfig(model=str(tiny_target), speculative_algorithm="NGRAM", min_path_prob=0.3)


def test_confident_nodes_keep_the_likeliest_candidates_of_the_surest_request():
    from actors.draft_runner import confident_nodes, select_tree

    # Request 0 is sure of 10 (0.9) and 10 -> 12 (0.5); request 1 of nothing.
    scores = torch.tensor([[0.9, 0.05, 0.5, 0.02], [0.3, 0.2, 0.1, 0.1]])
    tokens = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    parents = torch.tensor([[-1, -1, 0, 0], [-1, -1, 0, 1]])
    assert confident_nodes(scores, 0.4) == 3  # root + request 0's two sure candidates
    assert confident_nodes(scores, 0.95) == 1  # the root alone: a plain decode step
    nodes = confident_nodes(scores, 0.4)
    tree = select_tree(torch.tensor([5, 6]), torch.tensor([7, 7]), scores, tokens, parents, nodes)
    assert tree.draft_tokens.tolist() == [[5, 10, 12], [6, 20, 21]]  # request 1 fills the width with its best


def test_disable_by_batch_size_needs_speculation(tiny_target):
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        EngineConfig(model=str(tiny_target), disable_by_batch_size=4)


def test_auto_dtype_is_resolved_once_for_every_runner(tiny_target):
    """dtype="auto" picks bf16 only where the hardware runs it natively, and the engine's target,
    draft and hidden-state contract all get that one resolved dtype."""
    from actors.device import auto_dtype

    config = EngineConfig(model=str(tiny_target), speculative_algorithm="NGRAM", dtype="auto", device="cpu")
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert config.torch_dtype == auto_dtype(torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert config.runner_kwargs(1)["dtype"] == config.torch_dtype
    engine = build_graph(config)
    try:
        assert engine.scheduler.executor.target.dtype == config.torch_dtype
        assert engine.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))[0].num_output_tokens == 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("native", [False, True])
def test_explicit_bf16_on_a_cpu_without_it_warns_once(monkeypatch, caplog, native):
    """An explicit bf16 on a CPU that only emulates it (AVX2) still runs, with one warning per
    process that float32 is faster there; a CPU with native bf16 gets none."""
    from actors import device

    monkeypatch.setattr(device, "native_bf16_cpu", lambda: native)
    device._warn_emulated_bf16.cache_clear()
    with caplog.at_level("WARNING", logger="actors.device"):
        assert [device.parse_dtype("bfloat16", "cpu") for _ in range(3)] == [torch.bfloat16] * 3
        assert device.parse_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    warned = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warned) == (0 if native else 1) and all("float32" in m for m in warned)
    device._warn_emulated_bf16.cache_clear()


def test_ngram_branch_is_kept_first_and_reuses_the_draft_tree():
    from actors.draft_runner import select_tree, with_branches

    # One pool per request: root children 10 (p 0.6) and 11 (0.3); under 10, 12 (0.5) and 13 (0.1).
    scores = torch.tensor([[0.6, 0.3, 0.5, 0.1]] * 2)
    tokens = torch.tensor([[10, 11, 12, 13]] * 2)
    parents = torch.tensor([[-1, -1, 0, 0]] * 2)
    pool = with_branches(scores, tokens, parents, [[10, 13, 14], []])
    tree = select_tree(torch.tensor([5, 5]), torch.tensor([7, 7]), *pool, tree_size=4)
    # Request 0's branch 10 -> 13 -> 14 takes the tree: 10 and 13 are the pool's own nodes, 14 is new.
    assert tree.draft_tokens[0].tolist() == [5, 10, 13, 14] and tree.parents[0].tolist() == [-1, 0, 1, 2]
    # Request 1 matched nothing: the model's three best candidates, as without a branch, best first.
    assert tree.draft_tokens[1].tolist() == [5, 10, 12, 11] and tree.parents[1].tolist() == [-1, 0, 1, 0]
    assert tree.positions[0].tolist() == [7, 8, 9, 10]


def test_ngram_lookup_proposes_only_what_matched():
    from actors.draft_runner import prompt_lookup

    assert prompt_lookup([1, 2, 3, 4], 4) == []  # no match: the step is a plain decode
    assert prompt_lookup([5, 6, 7, 8, 9, 5, 6], 4) == [7, 8, 9, 5]  # the longest suffix match wins
    assert prompt_lookup([1, 9, 2, 9], 4) == [2, 9]
    assert prompt_lookup([1, 9, 2, 9], 4, min_ngram=2) == []  # only a one-token match there
