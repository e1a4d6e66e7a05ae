"""The OpenAI HTTP server: request translation (fast, no Ray), then one real Serve app on a
tiny EAGLE-3 pair driven by the official `openai` client and raw httpx requests."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from graphs.metrics import ServeMetrics, merge, render
from models.registry import DEFAULT_MODEL
from serving import tiny_server, wait_idle
from serve.app import build_app
from serve.cli import main as serve_main
from serve.protocol import APIError, chat_logprobs, completion_logprobs, parse_request
from serve.settings import DEFAULT_EAGLE3_DRAFT, ENGINE_DEPLOYMENT, FALLBACK_SPECULATION, split_args

REPO = Path(__file__).resolve().parent.parent
API_KEY = "test-key"
SERVED = "tiny"


# ---- unit: request validation and translation ------------------------------------------------


def test_completion_request_translation():
    req = parse_request({"model": SERVED, "prompt": ["w1 w2"], "max_tokens": 5, "stop": "w3", "seed": 7,
                         "temperature": 0, "logprobs": None, "user": "u", "unknown_field": 1}, False, [SERVED, "/p"])
    assert (req.prompt, req.max_tokens, req.model, req.stream) == ("w1 w2", 5, SERVED, False)
    assert req.sampling == {"temperature": 0, "top_p": 1.0, "top_k": 0, "seed": 7, "stop": ["w3"], "ignore_eos": False,
                            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                            "logit_bias": {}, "min_tokens": 0, "stop_token_ids": [], "min_p": 0.0, "logprobs": None}
    assert parse_request({"prompt": [[1, 2]]}, False, [SERVED]).prompt == [1, 2]
    assert parse_request({"prompt": "x"}, False, [SERVED]).max_tokens == 16  # OpenAI's default
    assert parse_request({"model": "/p", "prompt": "x"}, False, [SERVED, "/p"]).model == SERVED


def test_chat_request_translation():
    req = parse_request({"messages": [{"role": "system", "content": "w1"},
                                      {"role": "user", "content": [{"type": "text", "text": "w2"}]}],
                         "max_completion_tokens": 3, "max_tokens": 9, "stream": True,
                         "stream_options": {"include_usage": True}}, True, [SERVED])
    assert req.messages == [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}]
    assert (req.max_tokens, req.stream, req.include_usage) == (3, True, True)
    assert parse_request({"messages": [{"role": "user", "content": "x"}]}, True, [SERVED]).max_tokens is None


@pytest.mark.parametrize("body,chat,status,param", [
    ({"prompt": "x", "max_tokens": -1}, False, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, False, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, False, 400, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, False, 400, "top_p"),
    ({"prompt": "x", "top_p": 0}, False, 400, "top_p"),
    ({"prompt": "x", "n": 0}, False, 400, "n"),
    ({"prompt": "x", "n": 17}, False, 400, "n"),
    ({"prompt": "x", "n": 2, "best_of": 3}, False, 400, "best_of"),
    ({"prompt": "x", "logprobs": 6}, False, 400, "logprobs"),
    ({"prompt": "x", "echo": True}, False, 400, "echo"),
    ({"prompt": "x", "suffix": "y"}, False, 400, "suffix"),
    ({"prompt": "x", "presence_penalty": 2.5}, False, 400, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, False, 400, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, False, 400, "repetition_penalty"),
    ({"prompt": "x", "min_p": 2}, False, 400, "min_p"),
    ({"prompt": "x", "min_tokens": 20}, False, 400, "min_tokens"),  # more than max_tokens 16
    ({"prompt": "x", "stop_token_ids": [-4]}, False, 400, "stop_token_ids"),
    ({"prompt": "x", "logit_bias": {"w1": 3}}, False, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"3": 300}}, False, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True}, True, 400,
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, True, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, True, 400, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, True, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, True, 400,
     "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, True, 400, "functions"),
    ({"messages": [{"role": "user", "content": "x"}], "function_call": "auto"}, True, 400, "function_call"),
    ({"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": True}, True, 400,
     "parallel_tool_calls"),
    ({"prompt": ["a", "b"]}, False, 400, "prompt"),
    ({"prompt": []}, False, 400, "prompt"),
    ({"prompt": 5}, False, 400, "prompt"),
    ({"prompt": "x", "max_tokens": "5"}, False, 400, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, False, 400, "stream"),
    ({"prompt": "x", "stop": [""]}, False, 400, "stop"),
    ({"prompt": "x", "stop": ["s"] * 17}, False, 400, "stop"),
    ({"prompt": "x", "stop": ["s" * 257]}, False, 400, "stop"),
    ({"prompt": "x", "top_k": 2**63}, False, 400, "top_k"),
    ({"prompt": "x", "top_k": -2}, False, 400, "top_k"),
    ({"prompt": "x", "max_tokens": 2**40}, False, 400, "max_tokens"),
    ({"prompt": "x", "seed": 2**64}, False, 400, "seed"),
    ({"prompt": "x", "temperature": float("nan")}, False, 400, "temperature"),
    ({"prompt": "x", "temperature": float("inf")}, False, 400, "temperature"),
    ({"max_tokens": 3}, False, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, False, 404, "model"),
    ({"messages": []}, True, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, True, 400, "messages"),
    ({"messages": "hello"}, True, 400, "messages"),
    ({"prompt": "x"}, True, 400, "messages"),
    ([1, 2], False, 400, None),
])
def test_bad_requests_are_400_or_404(body, chat, status, param):
    with pytest.raises(APIError) as info:
        parse_request(body, chat, [SERVED])
    err = info.value
    assert (err.status, err.param) == (status, param)
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_api_key_settings(monkeypatch):
    from serve.cli import app_args_from_cli, parse_args
    from serve.settings import ServeSettings

    monkeypatch.setenv("MY_KEY", "s3cret")
    assert ServeSettings(api_key_env="MY_KEY").resolved_api_key() == "s3cret"
    assert ServeSettings(api_key="k", api_key_env="MY_KEY").resolved_api_key() == "k"
    monkeypatch.delenv("MY_KEY")
    assert ServeSettings(api_key_env="MY_KEY").resolved_api_key() is None
    for host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        ServeSettings().check_exposure(host)
    for host in ("0.0.0.0", "10.0.0.5", "::"):
        with pytest.raises(ValueError, match="api_key"):
            ServeSettings(api_key_env="MY_KEY").check_exposure(host)
    ServeSettings(api_key="k").check_exposure("0.0.0.0")
    # The CLI hands the replicas the variable's name, not the key.
    monkeypatch.setenv("SPECGRAPH_API_KEY", "from-env")
    args = app_args_from_cli(parse_args([]))
    assert args["api_key_env"] == "SPECGRAPH_API_KEY" and "api_key" not in args
    monkeypatch.delenv("SPECGRAPH_API_KEY")
    assert serve_main(["--host", "0.0.0.0"]) == 2  # refused before Ray starts


def test_sampling_fields_translation():
    req = parse_request({"prompt": "x", "n": 3, "best_of": 3, "seed": 5, "presence_penalty": 0.5,
                         "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"3": -100, "7": 2.5},
                         "min_tokens": 2, "stop_token_ids": [4], "min_p": 0.1, "logprobs": 2}, False, [SERVED])
    assert req.n == 3
    assert {k: req.sampling[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                                          "min_tokens", "stop_token_ids", "min_p", "logprobs")} == {
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {3: -100, 7: 2.5},
        "min_tokens": 2, "stop_token_ids": [4], "min_p": 0.1, "logprobs": 2}
    assert [req.to_engine(i)["sampling"]["seed"] for i in range(3)] == [5, 6, 7]  # each choice its own seed
    chat = [{"role": "user", "content": "x"}]
    assert parse_request({"messages": chat, "logprobs": True}, True, [SERVED]).sampling["logprobs"] == 0
    assert parse_request({"messages": chat, "logprobs": True, "top_logprobs": 4}, True, [SERVED]).sampling["logprobs"] == 4
    assert parse_request({"messages": chat, "logprobs": False}, True, [SERVED]).sampling["logprobs"] is None
    # The "not used" values of unsupported fields pass.
    assert parse_request({"messages": chat, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
                         True, [SERVED]).n == 1


def test_logprob_response_shapes():
    entries = [{"token": "w1", "logprob": -0.5, "bytes": [119, 49], "top": [("w1", -0.5, [119, 49]), ("w2", -1.5, [119, 50])]},
               {"token": " w3", "logprob": -2.0, "bytes": [32, 119, 51], "top": [("w4", -0.1, [119, 52])]}]
    chat = chat_logprobs(entries)
    assert chat["content"][1] == {"token": " w3", "logprob": -2.0, "bytes": [32, 119, 51],
                                  "top_logprobs": [{"token": "w4", "logprob": -0.1, "bytes": [119, 52]}]}
    legacy = completion_logprobs(entries, offset=4)
    assert legacy == {"tokens": ["w1", " w3"], "token_logprobs": [-0.5, -2.0],
                      "top_logprobs": [{"w1": -0.5, "w2": -1.5}, {" w3": -2.0, "w4": -0.1}], "text_offset": [4, 6]}
    assert chat_logprobs(None) is None and completion_logprobs(None) is None


def test_app_args_and_deployment_options(tiny_target):
    engine, settings = split_args({"model": str(tiny_target), "num_steps": "2", "max_replicas": "3",
                                   "max_running_requests": 8, "api_key": "k"})
    assert engine["num_steps"] == 2 and settings.max_replicas == 3 and settings.api_key == "k"
    assert engine["speculative_algorithm"] == FALLBACK_SPECULATION["speculative_algorithm"]
    default = split_args({})[0]
    assert default["model"] == DEFAULT_MODEL
    assert (default["speculative_algorithm"], default["draft_model"]) == ("EAGLE3", DEFAULT_EAGLE3_DRAFT)
    assert (default["num_steps"], default["eagle_topk"], default["num_draft_tokens"], default["ngram_branch"]) \
        == (3, 4, 8, 5)
    assert "verify_budget" not in default and "disable_by_batch_size" not in default  # adaptive instead
    assert default["min_path_prob"] == 0.1 and split_args({"min_path_prob": "0"})[0]["min_path_prob"] == 0.0
    assert split_args({"verify_budget": "64"})[0]["verify_budget"] == 64
    assert split_args({"disable_by_batch_size": "4"})[0]["disable_by_batch_size"] == 4
    assert split_args({"eagle_topk": 2})[0]["eagle_topk"] == 2  # what the user gave wins
    # A chain or a smaller tree the user asks for does not get the default tree's branch.
    assert "ngram_branch" not in split_args({"eagle_topk": 1})[0]
    assert "min_path_prob" not in split_args({"eagle_topk": 1})[0]
    assert "ngram_branch" not in split_args({"num_draft_tokens": 4})[0]
    assert split_args({"num_draft_tokens": 12, "ngram_branch": 2})[0]["ngram_branch"] == 2
    assert split_args({"model": str(tiny_target), "speculative_algorithm": "NONE"})[0]["speculative_algorithm"] == "NONE"
    assert split_args({"model": str(tiny_target), "max_model_len": "null"})[0]["max_model_len"] is None
    with pytest.raises(ValueError, match="unknown argument"):
        split_args({"modle": "x"})
    with pytest.raises(ValueError, match="num_steps"):
        split_args({"model": str(tiny_target), "num_steps": 0})
    app = build_app({"model": str(tiny_target), "speculative_algorithm": "NONE", "max_replicas": 3,
                     "max_running_requests": 8})
    engine_dep = app._bound_deployment.init_args[0]._bound_deployment
    auto = engine_dep._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 6.0)
    bundles = engine_dep._replica_config.placement_group_bundles
    # Replica, then the target with the drafter's CPU beside its own (the model-free drafter runs inside it):
    # a rank computes on 2 CPUs whatever it drafts with.
    assert bundles == [{"CPU": 0.1}, {"CPU": 2.0}]
    assert engine_dep._replica_config.placement_group_strategy == "PACK"
    assert engine_dep.max_ongoing_requests >= 8 + 256


def test_metrics_merge_and_render():
    from prometheus_client.parser import text_string_to_metric_families

    from actors.request import RequestOutput

    a, b = ServeMetrics(), ServeMetrics()
    a.set_draft_depth(3)
    a.record_request("/v1/completions", 200)
    b.record_request("/v1/completions", 200)
    a.record_finished(RequestOutput(0, [1] * 6, "", "length", 4, 6, 3, [2, 3], [3, 3]), 0.0, 1.0)
    a.set_replies_reused(2)
    b.set_replies_reused(1)
    # Adaptive speculation: a plain step (depth 0) and a two-level tree draft fewer positions.
    b.record_finished(RequestOutput(1, [1] * 5, "", "length", 4, 5, 3, [0, 2, 0], [0, 2, 3]), 0.0, 1.0)
    b.set_engine_stats({"running": 1, "waiting": 2, "free_slots": 75, "kv_slots": 100, "preemptions": 3,
                        "prefix_hit_tokens": 30, "prefix_query_tokens": 120, "queue_wait_ms": 1500, "admitted": 3,
                        "step_tokens": 40, "step_token_budget": 512, "steps_by_tree_size": {1: 5, 4: 2}})
    families = {f.name: f for f in text_string_to_metric_families(render(merge([a.snapshot(), b.snapshot()])))}
    assert families["specgraph_requests"].samples[0].value == 2
    # accepted over drafted per position: (2 + 1) / (2 + 2), (2 + 1) / (2 + 2), 1 / (2 + 1)
    assert [s.value for s in families["specgraph_spec_acceptance_rate"].samples] == [0.75, 0.75, 1 / 3]
    assert [s.value for s in families["specgraph_spec_drafted_tokens"].samples if s.name.endswith("_total")] \
        == [4, 4, 3]
    sizes = {s.labels["size"]: s.value for s in families["specgraph_spec_tree_size_steps"].samples
             if s.name.endswith("_total")}
    assert sizes == {"1": 5, "4": 2}
    assert families["specgraph_kv_cache_usage"].samples[0].value == 0.25
    assert families["specgraph_num_requests_waiting"].samples[0].value == 2
    assert families["specgraph_prefix_cache_hit_rate"].samples[0].value == 0.25
    assert families["specgraph_num_preemptions"].samples[0].value == 3
    assert families["specgraph_chat_replies_reused"].samples[0].value == 3
    assert families["specgraph_step_token_budget"].samples[0].value == 512
    wait = {s.name: s.value for s in families["specgraph_queue_wait_seconds"].samples}
    assert wait["specgraph_queue_wait_seconds_sum"] == 1.5 and wait["specgraph_queue_wait_seconds_count"] == 3
    hist = {s.name: s.value for s in families["specgraph_acceptance_length"].samples}
    assert hist["specgraph_acceptance_length_count"] == 2
    assert hist["specgraph_acceptance_length_sum"] == pytest.approx(6 / 3 + 5 / 3)


def test_cli_help():
    out = subprocess.run([sys.executable, "serve_app.py", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--port", "--api-key", "--speculative-algorithm", "--draft-model", "--max-model-len"):
        assert flag in out.stdout


# ---- integration: one Serve app for the module -------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_target, tiny_eagle3_shared):
    with tiny_server({
        "model": str(tiny_target), "speculative_algorithm": "EAGLE3", "draft_model": str(tiny_eagle3_shared),
        "num_steps": 3, "kv_slots": 4096, "max_running_requests": 16, "max_model_len": 256,
        "api_key": API_KEY, "served_model_name": SERVED, "max_queue": 64,
    }) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine_handle(server):
    from ray import serve

    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name="default")


def _headers() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def _metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=_headers(), timeout=30).text
    return {s.name + json.dumps(s.labels, sort_keys=True) if s.labels else s.name: s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


GREEDY = dict(temperature=0, max_tokens=12)
PROMPTS = ["w1 w2 w3 w4", "w10 w11 w12", "w5 w6 w5 w6 w5 w6", "w40 w41"]


@pytest.mark.integration
def test_health_and_models(server, client):
    assert httpx.get(f"{server}/health", timeout=30).json() == {"status": "ok"}  # no key needed
    models = httpx.get(f"{server}/v1/models", headers=_headers(), timeout=30).json()
    assert [m["id"] for m in models["data"]] == [SERVED]
    assert "/" not in json.dumps(models)  # no filesystem path (the model is a folder here)


@pytest.mark.integration
def test_completion_and_chat(client):
    out = client.completions.create(model=SERVED, prompt="w1 w2 w3", extra_body={"ignore_eos": True}, **GREEDY)
    assert out.object == "text_completion" and out.model == SERVED and out.id.startswith("cmpl-")
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 12, 15)
    assert len(choice.text.split()) == 12  # word-level tokenizer: one word per token
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "w1 w2 w3"}],
                                          extra_body={"ignore_eos": True}, **GREEDY)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == 3 and chat.usage.completion_tokens == 12
    assert chat.choices[0].message.content == choice.text  # the template adds nothing the tokenizer keeps
    ids = client.completions.create(model=SERVED, prompt=[1, 2, 3], extra_body={"ignore_eos": True}, **GREEDY)
    assert ids.choices[0].text == choice.text  # "w1 w2 w3" is ids [1, 2, 3]


@pytest.mark.integration
def test_streaming_concatenates_to_the_non_streamed_text(client):
    for prompt in PROMPTS[:2]:
        full = client.completions.create(model=SERVED, prompt=prompt, **GREEDY)
        chunks = list(client.completions.create(model=SERVED, prompt=prompt, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(model=SERVED, messages=messages, **GREEDY)
        chunks = list(client.chat.completions.create(model=SERVED, messages=messages, stream=True, **GREEDY))
        assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
        assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    # One token: the first event from the engine is already the finished one.
    one = list(client.completions.create(model=SERVED, prompt="w1", max_tokens=1, temperature=0, stream=True))
    assert [c.choices[0].finish_reason for c in one][-1] == "length" and "".join(c.choices[0].text for c in one)


@pytest.mark.integration
def test_stop_sequences(client):
    base = client.completions.create(model=SERVED, prompt="w1 w2 w3", extra_body={"ignore_eos": True},
                                     **GREEDY).choices[0].text
    words = base.split()
    stop = words[3]
    expected = base[: base.index(stop)]
    for stops in (stop, [stop, "zzz"]):
        out = client.completions.create(model=SERVED, prompt="w1 w2 w3", stop=stops, **GREEDY)
        assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
        streamed = client.completions.create(model=SERVED, prompt="w1 w2 w3", stop=stops, stream=True, **GREEDY)
        assert "".join(c.choices[0].text for c in streamed) == expected


@pytest.mark.integration
def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model=SERVED, prompt="w1 w2 w3", temperature=1.0, seed=seed,
                                         max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(1), sample(2), sample(3)}) > 1


@pytest.mark.integration
def test_logprobs_chat_and_completions(client):
    """Logprobs come back in OpenAI's shapes, streamed or not, and agree with each other."""
    messages = [{"role": "user", "content": "w1 w2 w3"}]
    chat = client.chat.completions.create(model=SERVED, messages=messages, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True}, **GREEDY)
    content = chat.choices[0].logprobs.content
    # Word-level tokenizer: each token decodes to its word.
    assert [c.token for c in content] == chat.choices[0].message.content.split()
    for c in content:  # greedy: the emitted token is the most likely one
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob) and c.logprob <= 0
        assert bytes(c.bytes).decode() == c.token
    streamed = list(client.chat.completions.create(model=SERVED, messages=messages, logprobs=True, top_logprobs=3,
                                                   stream=True, extra_body={"ignore_eos": True}, **GREEDY))
    stream_content = [c for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
                      for c in chunk.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in stream_content] == [(c.token, round(c.logprob, 4)) for c in content]
    plain = client.chat.completions.create(model=SERVED, messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None
    comp = client.completions.create(model=SERVED, prompt="w1 w2 w3", logprobs=2, extra_body={"ignore_eos": True},
                                     **GREEDY)
    lp = comp.choices[0].logprobs
    assert lp.tokens == [c.token for c in content]
    assert lp.token_logprobs == pytest.approx([c.logprob for c in content], abs=1e-4)
    assert all(len(top) == 2 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


@pytest.mark.integration
def test_n_choices_and_penalties(client):
    """n choices are independent samples (seeded: choice i reproducible); penalties and logit_bias
    change what greedy decoding says; each choice streams under its own index."""
    kw = dict(model=SERVED, prompt="w1 w2 w3", temperature=1.0, max_tokens=10, extra_body={"ignore_eos": True})
    out = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2] and len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 30 and out.usage.prompt_tokens == 3
    again = client.completions.create(n=3, seed=11, **kw)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert client.completions.create(n=1, seed=12, **kw).choices[0].text == out.choices[1].text  # seed + index
    chunks = list(client.completions.create(n=2, seed=11, stream=True, **kw))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(2)]
    assert texts == [c.text for c in out.choices[:2]]
    base = client.completions.create(model=SERVED, prompt="w1 w2 w3", extra_body={"ignore_eos": True}, **GREEDY)
    words = base.choices[0].text.split()
    first = int(words[0][1:])  # word-level tokenizer: "wN" is token id N
    banned = client.completions.create(model=SERVED, prompt="w1 w2 w3", logit_bias={str(first): -100},
                                       extra_body={"ignore_eos": True}, **GREEDY)
    assert banned.choices[0].text.split()[0] != words[0]
    penalised = client.completions.create(model=SERVED, prompt="w1 w2 w3", frequency_penalty=2.0,
                                          presence_penalty=2.0, extra_body={"ignore_eos": True,
                                                                           "repetition_penalty": 2.0}, **GREEDY)
    assert len(set(penalised.choices[0].text.split())) >= len(set(words))
    assert penalised.choices[0].text != base.choices[0].text
    stop_id = int(words[2][1:])
    stopped = client.completions.create(model=SERVED, prompt="w1 w2 w3", extra_body={"stop_token_ids": [stop_id]},
                                        **GREEDY)
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text.split() == words[:2]


@pytest.mark.integration
def test_unsupported_fields_are_400(client):
    import openai

    messages = [{"role": "user", "content": "w1"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for kwargs, param in ((dict(tools=[tool]), "tools"), (dict(response_format={"type": "json_object"}), "response_format")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=SERVED, messages=messages, **kwargs)
        assert info.value.body["param"] == param and param in info.value.body["message"]


def _assert_error(response: httpx.Response, status: int, param: str | None = "unset") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "unset":
        assert error["param"] == param
    return error


@pytest.mark.integration
def test_error_cases(server, client):
    import openai

    url = f"{server}/v1/completions"
    chat_url = f"{server}/v1/chat/completions"
    bad_values = [
        (dict(prompt="w1", max_tokens=-3), "max_tokens"),
        (dict(prompt="w1", max_tokens=10**9), "max_tokens"),  # beyond the context
        (dict(prompt="w1", temperature=-1), "temperature"),
        (dict(prompt="w1", top_p=0), "top_p"),
        (dict(prompt="w1", top_p=1.2), "top_p"),
        (dict(prompt="w1", n=17), "n"),
        (dict(prompt="w1", logit_bias={"70": 1}), "logit_bias"),  # outside the vocabulary of 64
        (dict(prompt=" ".join(["w1"] * 300)), "prompt"),  # longer than max_model_len 256
        (dict(prompt=[1, 2, 999]), "prompt"),  # token id outside the vocabulary
    ]
    for kwargs, param in bad_values:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=SERVED, **kwargs)
        assert info.value.status_code == 400 and info.value.body["param"] == param, kwargs
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=SERVED, messages=[])
    with pytest.raises(openai.BadRequestError):  # a stream fails before it starts, with a status
        client.completions.create(model=SERVED, prompt=" ".join(["w1"] * 300), stream=True)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="w1")
    assert info.value.body["code"] == "model_not_found"

    with httpx.Client(timeout=60, headers=_headers()) as http:
        _assert_error(http.post(url, content=b"{not json", headers={"Content-Type": "application/json"}), 400)
        _assert_error(http.post(url, json={"max_tokens": 3}), 400, "prompt")  # missing prompt
        _assert_error(http.post(chat_url, json={"prompt": "w1"}), 400, "messages")  # missing messages
        _assert_error(http.post(url, json={"prompt": {"text": "w1"}}), 400, "prompt")  # wrong type
        _assert_error(http.post(url, json={"prompt": "w1", "temperature": "hot"}), 400, "temperature")
        _assert_error(http.post(url, json=["w1"]), 400)
        _assert_error(http.post(url, json={"prompt": ["w1", "w2"]}), 400, "prompt")  # batches: one only
        big = json.dumps({"prompt": "w1 " * 400_000}).encode()
        _assert_error(http.post(url, content=big, headers={"Content-Type": "application/json"}), 413)

        def chunks():  # no Content-Length: the size is counted as the body arrives
            for _ in range(20):
                yield b" " * 100_000
            yield b"{}"

        _assert_error(http.post(url, content=chunks(), headers={"Content-Type": "application/json"}), 413)
        _assert_error(http.get(f"{server}/v1/nope"), 404)
    # Auth: /v1 and /metrics need the key; /health stays open.
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Bearer {API_KEY}x"}):
        error = _assert_error(httpx.post(url, json={"prompt": "w1"}, headers=headers, timeout=30), 401)
        assert error["code"] == "invalid_api_key"
        _assert_error(httpx.get(f"{server}/metrics", headers=headers, timeout=30), 401)
    _assert_error(httpx.get(f"{server}/v1/models", timeout=30), 401)
    assert httpx.get(f"{server}/metrics", headers=_headers(), timeout=30).status_code == 200
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
    # Bodies that break parsers are 400s that name nothing internal.
    with httpx.Client(timeout=60, headers=_headers()) as http:
        deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        _assert_error(http.post(url, content=deep, headers={"Content-Type": "application/json"}), 400)
        _assert_error(http.post(url, content=b'{"prompt": "w1", "seed": ' + b"9" * 5000 + b"}",
                                headers={"Content-Type": "application/json"}), 400)
        for field, value in (("top_k", 2**63), ("stop", ["w1"] * 100), ("max_tokens", 2**63)):
            _assert_error(http.post(url, json={"prompt": "w1", field: value}), 400, field)


@pytest.mark.integration
def test_full_queue_is_503_with_retry_after(server, client, engine_handle):
    import openai

    old = engine_handle.set_max_queue.remote(0).result()  # 0: refuse every new request (drain)
    try:
        response = httpx.post(f"{server}/v1/completions", json={"prompt": "w1"}, headers=_headers(), timeout=30)
        error = _assert_error(response, 503)
        assert error["code"] == "queue_full" and int(response.headers["Retry-After"]) >= 1
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "w1"}], stream=True)
    finally:
        engine_handle.set_max_queue.remote(old).result()
    # Served again once the limit is back (greedy and ignore_eos: a sampled EOS or a token that decodes
    # to no text would make a text check flaky).
    served = client.completions.create(model=SERVED, prompt="w1", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert served.choices[0].finish_reason == "length" and served.usage.completion_tokens == 2


@pytest.mark.integration
def test_32_concurrent_streams(server, client):
    import openai

    expected = {p: client.completions.create(model=SERVED, prompt=p, **GREEDY).choices[0].text for p in PROMPTS}

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=SERVED, prompt=prompt, stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*[one(ac, PROMPTS[i % len(PROMPTS)]) for i in range(32)])

    texts = asyncio.run(main())
    assert texts == [expected[PROMPTS[i % len(PROMPTS)]] for i in range(32)]


@pytest.mark.integration
def test_client_disconnect_aborts_and_frees_kv(server, engine_handle):
    before = wait_idle(engine_handle)
    aborted_before = _metrics(server).get("specgraph_requests_aborted_total", 0)
    body = {"model": SERVED, "prompt": "w1 w2", "max_tokens": 250, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60, headers=_headers()) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            got = [line for line in (next(lines) for _ in range(4)) if line.startswith("data: ")]
            assert got
    stats = wait_idle(engine_handle)
    assert stats["running"] == 0 and stats["free_slots"] == stats["kv_slots"] == 4096
    # The scheduler itself ended the request early (it counts only aborts of unfinished requests).
    assert stats["aborted"] == before["aborted"] + 1
    deadline = time.time() + 30
    while time.time() < deadline:
        metrics = _metrics(server)
        if metrics["specgraph_requests_aborted_total"] > aborted_before:
            break
        time.sleep(0.2)
    assert metrics["specgraph_requests_aborted_total"] == aborted_before + 1
    assert metrics["specgraph_kv_cache_usage"] == 0.0 and metrics["specgraph_num_requests_running"] == 0


@pytest.mark.integration
def test_metrics(server, client):
    before = _metrics(server)
    client.completions.create(model=SERVED, prompt="w5 w6 w5 w6 w5 w6", max_tokens=20, temperature=0,
                              extra_body={"ignore_eos": True})
    after = _metrics(server)
    key = 'specgraph_requests_total{"endpoint": "/v1/completions", "status": "200"}'
    assert after[key] == before.get(key, 0) + 1
    assert after['specgraph_requests_total{"endpoint": "/v1/completions", "status": "400"}'] >= 1
    assert after["specgraph_acceptance_length_count"] == before["specgraph_acceptance_length_count"] + 1
    assert after["specgraph_acceptance_length_sum"] >= before["specgraph_acceptance_length_sum"] + 1.0
    assert after["specgraph_spec_verify_steps_total"] > before["specgraph_spec_verify_steps_total"]
    assert after["specgraph_generation_tokens_total"] == before["specgraph_generation_tokens_total"] + 20
    assert after["specgraph_prompt_tokens_total"] == before["specgraph_prompt_tokens_total"] + 6
    assert after["specgraph_time_to_first_token_seconds_count"] > before["specgraph_time_to_first_token_seconds_count"]
    assert after["specgraph_time_per_output_token_seconds_count"] > before["specgraph_time_per_output_token_seconds_count"]
    rates = [after[f'specgraph_spec_acceptance_rate{{"position": "{k}"}}'] for k in range(3)]
    assert all(0.0 <= r <= 1.0 for r in rates)
    assert sum(v for k, v in after.items() if k.startswith("specgraph_spec_tree_size_steps_total")) > 0
    assert 0.0 <= after["specgraph_kv_cache_usage"] <= 1.0 and after["specgraph_num_requests_waiting"] >= 0
    # A chat's second turn sending the first answer back reads it as the ids the server generated.
    conv = [{"role": "user", "content": "w3 w9"}]
    first = client.chat.completions.create(model=SERVED, messages=conv, extra_body={"ignore_eos": True}, **GREEDY)
    reply = {"role": "assistant", "content": first.choices[0].message.content}
    client.chat.completions.create(model=SERVED, messages=conv + [reply, {"role": "user", "content": "w4"}], **GREEDY)
    assert _metrics(server)["specgraph_chat_replies_reused_total"] == after.get("specgraph_chat_replies_reused_total",
                                                                               0) + 1


@pytest.mark.integration
def test_still_serving_after_all_of_it(server, client, engine_handle):
    out = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "w7 w8"}], max_tokens=4)
    assert out.choices[0].message.content is not None and out.usage.completion_tokens <= 4
    stats = wait_idle(engine_handle)
    assert stats["free_slots"] == stats["kv_slots"]
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
