"""bench.serve_load's multi-turn conversation, against an in-process fake of the OpenAI streaming
endpoint: the first answer runs to its own limit (MT-bench answers in full), the second turn carries
it back as history and is what the job reports."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.serve_load import build_parser, level_items, main, one_client_job, server_configs
from serve.settings import SERVE_DTYPE


def _fake_server(bodies: list[dict]) -> httpx.MockTransport:
    """Streams one content chunk per requested token ("w0 w1 ..."), then usage."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        n = body["max_tokens"]
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        chunks = [{"choices": [{"delta": {"content": f"w{i} "}}]} for i in range(n)]
        chunks.append({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def _conversation(first_answer_tokens: int | None) -> tuple[dict, list[dict]]:
    bodies: list[dict] = []

    async def run():
        async with httpx.AsyncClient(transport=_fake_server(bodies)) as http:
            return await one_client_job(http, "http://fake", None, "multi_turn", ("first question", "second one"),
                                        4, first_answer_tokens)

    return asyncio.run(run()), bodies


def test_multi_turn_answers_the_first_turn_in_full_and_times_the_second():
    result, bodies = _conversation(first_answer_tokens=10)
    first, second = bodies
    assert first["max_tokens"] == 10 and second["max_tokens"] == 4
    answer = "".join(f"w{i} " for i in range(10))
    assert second["messages"] == [{"role": "user", "content": "first question"},
                                  {"role": "assistant", "content": answer},
                                  {"role": "user", "content": "second one"}]
    assert result["tokens"] == 14  # both answers' tokens count toward the level's throughput
    assert result["prompt_tokens"] == 2 + 10 + 2  # the second turn's prompt holds the whole history
    assert "first_turn_ttft" in result and result["ttft"] >= 0


def test_multi_turn_first_answer_defaults_to_max_tokens():
    _, bodies = _conversation(first_answer_tokens=None)
    assert [b["max_tokens"] for b in bodies] == [4, 4]


@pytest.mark.parametrize("flag", ["--max-tokens", "--first-answer-tokens"])
def test_token_limits_below_one_are_refused_by_name(flag, capsys):
    with pytest.raises(SystemExit):
        main(["--url", "http://127.0.0.1:9", flag, "0"])
    assert flag in capsys.readouterr().err


def test_levels_take_distinct_items_until_the_set_runs_out():
    items = list(range(10))
    assert level_items(items, 0, 4) + level_items(items, 4, 4) == list(range(8))  # no level repeats another
    assert level_items(items, 8, 4) == [8, 9, 0, 1]  # wraps only past the end


def test_servers_run_the_dtype_the_server_runs_by_default():
    args = build_parser().parse_args([])
    args.concurrency = [1, 4]
    configs = server_configs(args, ["spec", "none-nocache", "spec-retokenize"])
    assert {c["dtype"] for c in configs.values()} == {SERVE_DTYPE}  # what `make serve` runs, not fp32
    assert configs["none-nocache"]["prefix_cache"] is False and "prefix_cache" not in configs["spec"]
    assert configs["spec-retokenize"]["reply_ids_tokens"] == 0 and "reply_ids_tokens" not in configs["spec"]
