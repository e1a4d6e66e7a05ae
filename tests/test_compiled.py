"""The target's small passes through torch.compile (models.compiled, EngineConfig.torch_compile):
the same outputs as the eager forward, the passes it does not take left eager, and an engine that
compiles still decoding exactly as plain decoding does."""

from __future__ import annotations

import pytest
import torch

from graphs import EngineConfig, SamplingParams, build_graph
from models.attention import AttentionMetadata
from models.compiled import MAX_ROWS, CompiledDecoder, compiles


@pytest.fixture(scope="module")
def compiled_runner(tiny_target, tiny_eagle3_own):
    """An EAGLE-3 target (so its aux hidden states come out of the compiled graph too), fp32."""
    from actors.target_runner import TargetRunner

    runner = TargetRunner(str(tiny_target), "eagle3", str(tiny_eagle3_own), num_slots=MAX_ROWS * 16 + 32, dtype="float32",
                          device="cpu", torch_compile=True)
    assert isinstance(runner.compiled, CompiledDecoder)
    return runner


def _pass(new_lens: list[int], prefix: int = 9, trees: bool = False, seed: int = 0):
    """tokens (T,) and metadata of requests with `prefix` committed slots and new_lens[b] new tokens each,
    distinct slots per request; `trees`: a random tree mask for every request (same size)."""
    g = torch.Generator().manual_seed(seed)
    starts = [16 * b for b in range(len(new_lens))]
    prefixes = [torch.arange(s, s + prefix) for s in starts]
    news = [torch.arange(s + prefix, s + prefix + n) for s, n in zip(starts, new_lens)]
    positions = torch.cat([torch.arange(prefix, prefix + n) for n in new_lens])
    masks = [None] * len(new_lens)
    if trees:  # each node sees itself and some earlier nodes (a tree's ancestors)
        masks = [torch.ones(n, n, dtype=torch.bool).tril() & (torch.rand(n, n, generator=g) < 0.6) | torch.eye(n, dtype=torch.bool)
                 for n in new_lens]
    tokens = torch.randint(0, 64, (sum(new_lens),), generator=g)
    return tokens, AttentionMetadata.build(prefixes, news, positions, masks)


@pytest.mark.parametrize("new_lens,trees", [
    ([1], False),                 # one request's decode: a single row
    ([5], True),                  # one request's verify tree
    ([1, 1, 1, 1], False),        # decode of a few requests
    ([2, 3, 3], False),           # ragged verify chains: padded queries
    ([1] * MAX_ROWS, False),      # the most rows a compiled pass takes
])
def test_compiled_pass_matches_eager(compiled_runner, new_lens, trees):
    runner = compiled_runner
    with torch.inference_mode():
        # The prefix slots' K/V: any values, the same for both passes.
        for k, v in zip(runner.kv.k, runner.kv.v):
            k.normal_(generator=torch.Generator().manual_seed(1)), v.normal_(generator=torch.Generator().manual_seed(2))
        tokens, meta = _pass(new_lens, trees=trees)
        assert runner.compiled.takes(tokens, meta)
        hidden, aux = runner.model(tokens, meta, runner.kv, runner.aux_layer_ids)
        k_eager = [k.clone() for k in runner.kv.k]
        for k in runner.kv.k:
            k[:, meta.out_slots] = 0  # the compiled pass must write the new tokens' K/V itself
        c_hidden, c_aux = runner.compiled(tokens, meta, runner.kv)
    torch.testing.assert_close(c_hidden, hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(c_aux, aux, atol=1e-4, rtol=1e-4)
    for k, ref in zip(runner.kv.k, k_eager):
        torch.testing.assert_close(k, ref, atol=1e-5, rtol=1e-5)


def test_compiled_decoder_leaves_long_and_fresh_passes_eager(compiled_runner):
    takes = compiled_runner.compiled.takes
    assert not takes(*_pass([1] * (MAX_ROWS + 1))), "more rows than the compiled linears run unpadded"
    assert not takes(*_pass([12], prefix=0)), "a prefill from scratch attends per request, unpadded"
    assert not takes(*_pass([1, 5])), "decode rows and a chunk attend in parts"


def test_torch_compile_applies_where_linears_pack_in_their_own_dtype():
    assert compiles(torch.float32, "cpu")
    assert not compiles(torch.float32, "cuda")
    with pytest.raises(ValueError, match="torch_compile"):
        EngineConfig(torch_compile="yes")
    config = EngineConfig(torch_compile=True)
    assert config.target_kwargs(1)["torch_compile"] is True
    assert config.runner_kwargs(1)["torch_compile"] is True  # the drafter attends through the CPU kernel


def test_serve_cli_compiles_by_default():
    from serve.cli import app_args_from_cli, parse_args

    assert app_args_from_cli(parse_args([]))["torch_compile"] is True
    assert app_args_from_cli(parse_args(["--no-torch-compile"]))["torch_compile"] is False


def test_engine_with_compiled_target_decodes_like_plain(tiny_target, tiny_eagle3_own):
    """EAGLE-3 speculation over the compiled target gives plain decoding's greedy tokens (fp32)."""
    prompts = [[3, 17, 5, 40, 22, 9], [8, 8, 31, 2], [50, 1, 14, 33, 7, 19, 26, 4, 12]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name, kw in (("plain", {}),
                     ("compiled", dict(speculative_algorithm="eagle3", draft_model=str(tiny_eagle3_own), num_steps=3,
                                       torch_compile=True))):
        engine = build_graph(EngineConfig(model=str(tiny_target), dtype="float32", **kw))
        try:
            outputs[name] = [list(o.token_ids) for o in engine.generate(prompts, params)]
            if name == "compiled":
                assert engine.scheduler.executor.target.compiled is not None
        finally:
            engine.shutdown()
    assert outputs["compiled"] == outputs["plain"]


@pytest.mark.parametrize("path", ["sdpa", "grouped", "widened"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_lens", [[1], [4], [2, 3]])
def test_attention_operator_returns_what_its_fake_promises(path, dtype, new_lens, monkeypatch):
    """The compiled graph reads the attention operator's output with the shape and strides of its fake
    (a mismatch fails the step): whichever path this CPU's rules pick, forced here in turn."""
    from models import attention

    monkeypatch.setattr(attention, "widened_pays", lambda *_: path == "widened")
    monkeypatch.setattr(attention, "grouped_pays", lambda *_: path == "grouped")
    g = torch.Generator().manual_seed(len(new_lens))
    _, meta = _pass(new_lens)
    rows, heads, kv_heads, dim = meta.num_tokens, 4, 2, 16
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    k_cache, v_cache = (torch.randn(kv_heads, 64, dim, generator=g).to(dtype) for _ in range(2))
    torch.library.opcheck(torch.ops.specgraph.paged_attention.default,
                          (q, k, v, k_cache, v_cache, meta.out_slots, meta.kv_index, meta.mask, meta.q_index,
                           meta.out_rows, 0.25), test_utils=("test_schema", "test_faketensor"))


def test_a_target_that_fails_to_compile_serves_eagerly(tiny_target, monkeypatch, caplog):
    from actors.target_runner import TargetRunner
    from models import compiled

    def fail(self, *args, **kwargs):
        raise RuntimeError("inductor cannot lower this model")

    monkeypatch.setattr(compiled.CompiledDecoder, "warm_up", fail)
    runner = TargetRunner(str(tiny_target), num_slots=32, dtype="float32", device="cpu", torch_compile=True)
    assert runner.compiled is None
    assert "running it eagerly" in caplog.text and "cannot lower" in caplog.text
