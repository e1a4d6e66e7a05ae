"""bench.peers without running any engine: config names, the peer's speculation settings and the
ours/vLLM ratios the report is read by."""

from __future__ import annotations

import pytest

from bench.peers.compare import parse_configs, ratios
from bench.peers.jobs import CONFIGS, EAGLE3_STEPS, NGRAM_TOKENS
from bench.peers.vllm_worker import speculative_config


def test_config_names_are_checked_naming_the_bad_one():
    assert parse_configs("ours:none, vllm:eagle3") == [("ours", "none"), ("vllm", "eagle3")]
    with pytest.raises(ValueError, match=r"--configs: unknown config 'vllm:serve'"):
        parse_configs("ours:none,vllm:serve")


def test_peer_speculates_like_ours():
    assert speculative_config({"config": "none"}) is None
    assert speculative_config({"config": "ngram"})["num_speculative_tokens"] == NGRAM_TOKENS
    eagle = speculative_config({"config": "eagle3", "draft": "/heads/eagle3"})
    assert eagle == {"method": "eagle3", "model": "/heads/eagle3", "num_speculative_tokens": EAGLE3_STEPS}
    assert set(CONFIGS["vllm"]) <= set(CONFIGS["ours"])


def test_ratios_pair_plain_with_plain_and_serve_with_the_peers_eagle3():
    level = lambda tps: {"levels": {"1": {"tokens_per_s": tps}}}  # noqa: E731
    results = {"bfloat16": {"ours:none": level(30.0), "vllm:none": level(40.0), "ours:serve": level(60.0),
                            "vllm:eagle3": level(30.0)}}
    assert ratios(results) == {"bfloat16": {"plain": {"1": 0.75}, "serve_vs_eagle3": {"1": 2.0}}}


def test_ours_serve_is_the_engine_make_serve_builds():
    from bench.peers.ours_worker import engine_config
    from serve.settings import SERVE_TORCH_COMPILE, split_args

    job = {"model": "/models/target", "draft": "/heads/eagle3", "dtype": "bfloat16", "kv_slots": 4096,
           "levels": [1, 4]}
    served, _ = split_args({})  # what `make serve` (serve_app.py) runs, with its defaults applied
    ours = engine_config(dict(job, config="serve"))
    assert ours.backend == "ray"
    for key, value in served.items():
        if key not in ("model", "draft_model"):  # the bench passes the resolved folders
            assert getattr(ours, key) == value, key
    assert ours.draft_model == "/heads/eagle3"
    assert ours.torch_compile is SERVE_TORCH_COMPILE  # the CLI's default, as `make serve` passes it
    assert engine_config(dict(job, config="none")).torch_compile is SERVE_TORCH_COMPILE
    assert engine_config(dict(job, config="none-eager")).torch_compile is False
    assert engine_config(dict(job, config="none", torch_compile=False)).torch_compile is False


def test_each_level_runs_waves_over_several_prompts():
    from bench.peers.compare import prompts_needed
    from bench.peers.jobs import WARMUP_TOKENS, run_levels

    prompts = [[i] for i in range(8)]
    calls = []

    def generate(batch, max_tokens):
        calls.append(([p[0] for p in batch], max_tokens))
        return [[7] * max_tokens for _ in batch]

    job = {"prompts": prompts, "max_tokens": 5, "levels": [1, 4], "prompts_per_level": 3, "engine": "ours",
           "config": "none", "dtype": "float32"}
    levels = run_levels(job, generate)
    measured = [batch for batch, n in calls if n == 5]
    # batch 1 runs three prompts one after another; 4 at once runs one whole wave of 4
    assert measured == [[0], [1], [2], [0, 1, 2, 3]]
    assert [n for _, n in calls[:2]] == [WARMUP_TOKENS, WARMUP_TOKENS]
    assert levels["1"]["tokens"] == 15 and levels["1"]["waves"] == 3
    assert levels["4"]["tokens"] == 20 and levels["4"]["waves"] == 1
    assert prompts_needed([1, 4], 3) == 4 and prompts_needed([1, 4, 16], 8) == 16 and prompts_needed([3], 4) == 6
