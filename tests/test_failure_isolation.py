"""One bad request never hurts another: a request that raises while its step is planned,
run or committed ends with an error alone, its KV slots go back to the pool, and the other
requests finish exactly as they would have without it (local backend, tiny models)."""

from __future__ import annotations

import pytest

import actors.target_runner
from actors.request import Request
from graphs import EngineConfig, SamplingParams, build_graph

POISON_SEED = 4242


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_eagle3_own):
    # A small prefill budget, so requests join over several steps while others decode.
    return build_graph(EngineConfig(model=str(tiny_target), speculative_algorithm="eagle3",
                                    draft_model=str(tiny_eagle3_own), eagle_topk=2, num_draft_tokens=6,
                                    kv_slots=4096, max_num_batched_tokens=24))


def _good() -> list[tuple[list[int], SamplingParams]]:
    """16 requests, greedy and seeded sampling, different prompts and lengths."""
    out = []
    for i in range(16):
        prompt = [1 + (i * 7 + j * 3) % 60 for j in range(3 + i % 5)]
        temperature = 0.0 if i % 2 else 0.8
        out.append((prompt, SamplingParams(max_tokens=5 + i % 4, temperature=temperature, seed=100 + i,
                                           top_k=8 if i % 3 == 0 else 0, ignore_eos=True)))
    return out


@pytest.fixture(scope="module")
def reference(engine):
    return [o.token_ids for o in engine.generate_each(_good())]


def _poison_params() -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.0, seed=POISON_SEED, ignore_eos=True)


def _poisoned(monkeypatch, where: str) -> tuple[list[int], SamplingParams]:
    """A request that raises at `where`, although its fields passed (or skipped) validation."""
    prompt, params = [5, 6, 7, 8], _poison_params()
    if where == "plan":
        params.top_k = 2**63  # set after validation, as a caller of the engine API could: int64 overflow
    elif where == "prefill":
        prompt = [5, 6, 10**6]  # a token id outside the vocabulary: the target's embedding raises
    elif where == "decode":
        forward = actors.target_runner.TargetRunner.forward_step

        def forward_step(self, meta, verify):
            rows = (meta.seeds == POISON_SEED).nonzero().flatten().tolist()
            if rows and int(meta.seq_lens[rows[0]]) > len(prompt) + 2:
                raise RuntimeError("poisoned decode")
            return forward(self, meta, verify)

        monkeypatch.setattr(actors.target_runner.TargetRunner, "forward_step", forward_step)
    elif where == "commit":
        append = Request.append_tokens

        def append_tokens(self, tokens, logprobs=None):
            if self.params.seed == POISON_SEED and len(self.output_ids) >= 3:
                raise RuntimeError("poisoned commit")
            return append(self, tokens, logprobs)

        monkeypatch.setattr(Request, "append_tokens", append_tokens)
    return prompt, params


@pytest.mark.parametrize("where", ["plan", "prefill", "decode", "commit"])
def test_a_poison_request_fails_alone(engine, reference, monkeypatch, where):
    scheduler = engine.scheduler
    free_before = scheduler.num_free_slots
    good = _good()
    poison = _poisoned(monkeypatch, where)
    outs = engine.generate_each(good[:8] + [poison] + good[8:])
    bad = outs.pop(8)
    assert bad.finish_reason == "error" and bad.error
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert scheduler.num_free_slots == free_before == scheduler.config.kv_slots
    assert not scheduler.prefilling and not scheduler.waiting and not scheduler.running
    monkeypatch.undo()
    assert [o.token_ids for o in engine.generate_each(good)] == reference  # the engine serves on


def test_a_step_that_fails_for_everyone_fails_each_alone(engine, monkeypatch):
    """When every request breaks the step, each ends with an error; nothing leaks or hangs."""
    def broken(self, meta, verify):
        raise RuntimeError("broken runner")

    monkeypatch.setattr(actors.target_runner.TargetRunner, "forward_step", broken)
    outs = engine.generate_each(_good()[:4])
    assert [o.finish_reason for o in outs] == ["error"] * 4
    assert all("broken runner" in o.error for o in outs)
    assert engine.scheduler.num_free_slots == engine.scheduler.config.kv_slots


def test_restart_budget_is_paid_back_by_healthy_time():
    from graphs.runtime import RestartBudget

    budget = RestartBudget(limit=2, window_s=600.0)
    assert budget.spend(0.0) and budget.spend(10.0)
    assert not budget.spend(20.0)  # a third restart within 10 minutes: broken
    budget = RestartBudget(limit=2, window_s=600.0)
    assert budget.spend(0.0) and budget.spend(10.0)
    assert budget.spend(700.0)  # the first two are forgotten after a healthy while


def test_sampling_params_bounds_name_the_field():
    for kwargs, field in [(dict(top_k=2**63), "top_k"), (dict(max_tokens=2**63), "max_tokens"),
                          (dict(stop=["x"] * 17), "stop"), (dict(stop=["x" * 257]), "stop"),
                          (dict(ignore_eos="yes"), "ignore_eos")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_resource_shortfall_names_what_is_missing():
    from graphs.ray_graph import resource_shortfall

    dp2 = [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]  # dp_size=2, target + draft per rank
    assert resource_shortfall(dp2, "PACK", [{"CPU": 2.0}]) == ["CPU: needs 4, the cluster has 2"]
    assert resource_shortfall(dp2, "PACK", [{"CPU": 2.0}, {"CPU": 2.0}]) == []
    assert resource_shortfall([{"CPU": 1.0, "GPU": 1.0}], "PACK", [{"CPU": 8.0}]) == ["GPU: needs 1, the cluster has 0"]
    assert resource_shortfall([{"CPU": 3.0}], "PACK", [{"CPU": 2.0}, {"CPU": 2.0}]) == [
        "bundle 0 {'CPU': 3.0} fits on no single node"]
    assert resource_shortfall(dp2, "STRICT_PACK", [{"CPU": 2.0}, {"CPU": 2.0}])[0].startswith("STRICT_PACK")
