"""`ray job submit` batch generation against a Ray head started by this test: every id
answered once, a killed run resumed without duplicates, bad lines in the errors file."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.batch_generate import GenerateBatch, completed_ids, lock_output, main, parse_line, plan
from netutil import free_port

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def test_parse_line_reasons():
    assert parse_line('{"id": 1, "prompt": "w1"}', 8)["params"]["max_tokens"] == 8
    cases = {
        "not json": "not valid JSON",
        '{"prompt": "w1"}': "id",
        '{"id": 1}': "prompt",
        '{"id": 1, "prompt": "w1", "top_p": 2}': "top_p",
        '{"id": 1, "messages": []}': "messages",
        '{"id": 1, "prompt": "w1", "text": "mine"}': "text",
    }
    for line, reason in cases.items():
        with pytest.raises(ValueError, match=reason):
            parse_line(line, 8)


def test_lines_take_the_sampling_processors_and_logprobs(tiny_target):
    """Penalties, logit_bias (JSON string keys), min_tokens, stop_token_ids, min_p and logprobs reach
    the engine through the record the job ships to its actors; asked-for logprobs come back."""
    from jobs.batch_generate import GenerateBatch

    line = json.dumps({"id": "a", "prompt": "w1 w2", "max_tokens": 6, "presence_penalty": 0.5,
                       "frequency_penalty": 0.5, "repetition_penalty": 1.5, "logit_bias": {"7": 5.0},
                       "min_tokens": 6, "stop_token_ids": [3], "min_p": 0.05, "logprobs": 2, "ignore_eos": True})
    record = parse_line(line, 8)
    shipped = json.loads(json.dumps(record))  # what crosses to the Ray Data actors
    assert shipped["params"]["logit_bias"] == {"7": 5.0} and shipped["params"]["min_tokens"] == 6
    with pytest.raises(ValueError, match="min_tokens"):
        parse_line(json.dumps({"id": 1, "prompt": "w1", "max_tokens": 2, "min_tokens": 3}), 8)
    out = json.loads(GenerateBatch({"model": str(tiny_target), "backend": "local"})(
        {"request": [json.dumps(shipped)]})["line"][0])
    assert out["num_output_tokens"] == 6 and len(out["logprobs"]) == 6
    assert all(len(top) == 2 and lp <= 0 for lp, top in out["logprobs"])


def test_bad_engine_option_is_a_usage_error(tmp_path, capsys):
    """A bad engine flag stops the job before anything starts, with the field named (no traceback)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "w1"}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["--input", str(inp), "--output", str(tmp_path / "out.jsonl"), "--speculative-algorithm", "NGRAM",
              "--disable-by-batch-size", "0"])
    assert exit_info.value.code == 2
    assert "disable_by_batch_size must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_resume_cuts_a_torn_line_and_skips_done_ids(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "text": "a"}\n{"id": "x", "text": "b"}\n{"id": 3, "te')
    assert completed_ids(out) == {"1", '"x"'}
    assert out.read_text().endswith('"b"}\n')
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "w1"}\n{"id": 3, "prompt": "w2"}\n{"id": 3, "prompt": "w3"}\n')
    pending, errors, done = plan(inp, out, 8)
    assert [r["id"] for r in pending] == [3] and done == 2
    assert errors[0]["line"] == 3 and "duplicate" in errors[0]["reason"]


def test_other_fields_pass_through_and_refused_requests_fail_alone(tiny_target):
    """A real dataset's extra columns reach the output line unchanged; a request the engine
    refuses (longer than the context) is an error row of its own, the batch goes on."""
    lines = [json.dumps({"id": 1, "prompt": "w1 w2", "category": "qa", "source": {"set": "x", "n": [1, 2]}}),
             json.dumps({"id": 2, "prompt": " ".join(["w1"] * 600)}),
             json.dumps({"id": 3, "messages": [{"role": "user", "content": "w3"}], "tags": None})]
    records = [parse_line(line, 4) for line in lines]
    generate = GenerateBatch({"model": str(tiny_target)})
    rows = [json.loads(line) for line in generate({"request": [json.dumps(r) for r in records]})["line"]]
    assert rows[0]["category"] == "qa" and rows[0]["source"] == {"set": "x", "n": [1, 2]}
    assert "tags" in rows[2] and rows[2]["tags"] is None
    assert [r["finish_reason"] for r in rows] == ["length", "error", "length"]
    assert "prompt" in rows[1]["error"] and "error" not in rows[0]
    assert list(rows[0])[:3] == ["id", "category", "source"]


def test_error_rows_are_retried_on_rerun(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "finish_reason": "length"}\n{"id": 2, "finish_reason": "error", "error": "x"}\n'
                   '{"id": 3, "finish_reason": "stop"}\n{"id": 4, "fin')
    assert completed_ids(out) == {"1", "3"}
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1, 3]


def test_output_must_not_be_the_input(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "w1"}\n')
    for output in (inp, tmp_path / "." / "in.jsonl"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--input", str(inp), "--output", str(output)])
        assert exit_info.value.code == 2 and "must not be the input" in capsys.readouterr().err
    assert inp.read_text() == '{"id": 1, "prompt": "w1"}\n'


def test_a_second_run_on_the_same_output_is_refused(tmp_path, capsys):
    """The lock is held by another process (a concurrent run); it goes when that process dies."""
    out, inp = tmp_path / "out.jsonl", tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "w1"}\n')
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from jobs.batch_generate import lock_output; lock_output(Path(sys.argv[1])); "
                               "print('locked', flush=True); time.sleep(60)", str(out)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SystemExit) as exit_info:
            main(["--input", str(inp), "--output", str(out)])
        assert exit_info.value.code == 2 and "another run is writing it" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    os.close(lock_output(out))  # the dead holder left no stale lock


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head --block` on free ports (GCS in 63xx, the rest in 8xxx, away from the
    defaults another Ray on this machine may hold), stopped at the end."""
    gcs = free_port(6380, 6400)
    ports: tuple[int, ...] = ()
    for _ in range(4):
        ports += (free_port(8265, 8999, ports),)
    dash, agent_http, agent_grpc, runtime_env = ports
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    log = open(tmp_path_factory.mktemp("head") / "head.log", "w")
    head = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", f"--dashboard-agent-listen-port={agent_http}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
         "--num-cpus=4", "--include-dashboard=true", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while time.time() < deadline:
        probe = subprocess.run([str(VENV_BIN / "ray"), "job", "list", "--address", address], env=env,
                               capture_output=True, text=True)
        if probe.returncode == 0:
            break
        time.sleep(1)
    else:
        head.terminate()
        pytest.fail("ray head did not come up")
    yield address, env
    os.killpg(head.pid, signal.SIGTERM)
    head.wait(timeout=60)
    log.close()


def _submit(address, env, args, wait=True):
    cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO)]
    if not wait:
        cmd.append("--no-wait")
    cmd += ["--", "python", "-m", "jobs.batch_generate", *args]
    for _ in range(120):  # the head's job agent comes up a little after the dashboard
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if "No available agent" not in result.stdout + result.stderr:
            return result
        time.sleep(1)
    return result


@pytest.mark.integration
def test_ray_job_submit_is_complete_and_resumable(ray_head, tiny_target, tmp_path):
    address, env = ray_head
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    total = 60
    lines = [json.dumps({"id": i, "prompt": f"w{i % 50} w{(i * 7) % 50}", "ignore_eos": True}) for i in range(total)]
    lines[5] = "{not json"
    lines[9] = json.dumps({"id": 3, "prompt": "w1"})  # duplicate id
    lines[12] = json.dumps({"id": 12, "prompt": "w1", "temperature": -2})
    inp.write_text("\n".join(lines) + "\n")
    args = ["--input", str(inp), "--output", str(out), "--model", str(tiny_target), "--max-tokens", "64",
            "--batch-size", "2"]

    first = _submit(address, env, args, wait=False)
    assert first.returncode == 0, first.stderr
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", first.stdout).group(0)
    deadline = time.time() + 300
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 2):
        time.sleep(0.5)
    stop = subprocess.run([str(VENV_BIN / "ray"), "job", "stop", "--address", address, job_id],
                          env=env, capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stderr
    partial = {json.loads(line)["id"] for line in out.read_text().splitlines() if line.endswith("}")}
    assert 2 <= len(partial) < total - 3, "the first run must be interrupted midway"

    second = _submit(address, env, args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert '"summary"' in second.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(set(range(total)) - {5, 9, 12}) and len(ids) == len(set(ids)) == total - 3
    assert all(r["num_output_tokens"] == 64 and r["finish_reason"] == "length" for r in rows)
    errors = [json.loads(line) for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert [e["line"] for e in errors] == [6, 10, 13]
