"""bench.spec_bench end to end on the tiny model: JSON shape, speedup reference, losslessness, plot."""

from __future__ import annotations

import json

import pytest

from bench import configs, spec_bench

CATEGORIES = {"writing": ["w1 w2", "w3 w4 w5"], "rag": ["w6 w7 w6 w7", "w8 w9"]}


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "questions.jsonl"
    lines, qid = [], 0
    for category, prompts in CATEGORIES.items():
        for prompt in prompts + ["w10 w11"]:  # a third question per category, beyond --per-category 2
            qid += 1
            lines.append(json.dumps({"question_id": qid, "category": category, "turns": [prompt, "w12"]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _check(result, configs):
    assert list(result["results"]) == configs
    for config in configs:
        per_cat = result["results"][config]
        assert set(per_cat) == set(CATEGORIES) | {"overall"}
        for category in CATEGORIES:
            entry = per_cat[category]
            assert entry["num_questions"] == 2
            assert entry["num_tokens"] > 0 and entry["tokens_per_s"] > 0
            assert entry["acceptance_length"] >= 1.0
            assert entry["mismatches"] == 0
        assert per_cat["overall"]["num_questions"] == 4
        assert per_cat["overall"]["mismatches"] == 0
    for key in list(CATEGORIES) + ["overall"]:
        assert result["results"]["none"][key]["speedup"] == 1.0
        assert result["results"]["none"][key]["acceptance_length"] == 1.0


def test_spec_bench_none_ngram_hf_plot(tiny_target, questions, tmp_path, capsys):
    out = tmp_path / "res" / "spec_bench.json"
    result = spec_bench.main([
        "--model", str(tiny_target), "--questions", str(questions), "--per-category", "2",
        "--max-tokens", "8", "--configs", "ngram,none", "--out", str(out), "--plot", "--threads", "1",
    ])
    _check(result, ["none", "ngram", "hf", "hf-prompt-lookup"])
    assert json.loads(out.read_text()) == result
    assert json.loads(capsys.readouterr().out) == result
    png = out.with_suffix(".png")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = result["meta"]
    assert meta["max_tokens"] == 8 and meta["per_category"] == 2 and meta["categories"] == list(CATEGORIES)
    assert meta["threads"] == 1 and meta["torch"] and meta["date"] and "--plot" in meta["command"]
    assert meta["skipped"] == {}


def test_spec_bench_draft_configs(tiny_target, tiny_standalone_hot, tiny_eagle3_own, questions, tmp_path):
    """Every draft config and peer; the standalone draft has a hot vocabulary, which transformers'
    assisted generation (a peer) ignores, proposing from the whole vocabulary."""
    out = tmp_path / "drafts.json"
    result = spec_bench.main([
        "--model", str(tiny_target), "--questions", str(questions), "--per-category", "2",
        "--max-tokens", "8", "--configs", "none,eagle3-tree,standalone,eagle3,eagle3-tree@0.05",
        "--draft-eagle3", str(tiny_eagle3_own), "--draft-standalone", str(tiny_standalone_hot),
        "--out", str(out), "--threads", "1",
    ])
    _check(result, ["none", "eagle3-tree", "standalone", "eagle3", "eagle3-tree@0.05", "hf", "hf-prompt-lookup",
                    "hf-assisted"])
    assert not out.with_suffix(".png").exists()


def test_config_at_probability_sets_min_path_prob(tiny_target, tiny_eagle3_own):
    args = spec_bench.parse_args(["--model", str(tiny_target), "--draft-eagle3", str(tiny_eagle3_own),
                                  "--kv-slots", "256"])
    tree = configs.engine_config("eagle3-tree@0.05", args)
    assert tree.min_path_prob == 0.05 and tree.eagle_topk == 4
    assert configs.engine_config("eagle3-tree", args).min_path_prob == 0
    with pytest.raises(ValueError, match="after '@' must be a number"):
        configs.engine_config("eagle3@high", args)
    with pytest.raises(ValueError, match="min_path_prob"):
        configs.engine_config("ngram@0.1", args)


@pytest.mark.parametrize("configs, message", [("none,nope", "unknown config 'nope'"),
                                              ("ngram,eagle3@high", "after '@' must be a number")])
def test_bad_config_is_refused_before_any_engine_runs(tiny_target, questions, tmp_path, configs, message):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit, match=message):
        spec_bench.main(["--model", str(tiny_target), "--questions", str(questions), "--configs", configs,
                         "--no-hf", "--out", str(out)])
    assert not out.exists()


def test_sequential_and_draft_configs_skipped_without_drafts(tiny_target, questions, tmp_path):
    result = spec_bench.main([
        "--model", str(tiny_target), "--questions", str(questions), "--per-category", "1",
        "--max-tokens", "6", "--configs", "eagle3,ngram,standalone", "--no-hf", "--sequential",
        "--batch-size", "2", "--out", str(tmp_path / "r.json"),
    ])
    assert list(result["results"]) == ["none", "ngram"]
    assert set(result["meta"]["skipped"]) == {"eagle3", "standalone"}
    assert result["meta"]["interleaved"] is False
    assert result["results"]["ngram"]["overall"]["mismatches"] == 0


def test_load_questions_first_n_per_category_in_file_order(questions):
    loaded = spec_bench.load_questions(questions, 2)
    assert list(loaded) == list(CATEGORIES)
    assert [q["prompt"] for q in loaded["rag"]] == CATEGORIES["rag"]


def test_load_questions_reads_held_out_files_under_their_names(questions, tmp_path):
    """train.data's held-out prompts time draft settings without Spec-Bench: one user message a
    line, filed under the file's name, after any Spec-Bench file listed before it."""
    held = tmp_path / "eval_magpie.jsonl"
    held.write_text("".join(json.dumps({"id": f"m{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                            for i in range(3)))
    loaded = spec_bench.load_questions(f"{questions},{held}", 2)
    assert list(loaded) == [*CATEGORIES, "eval_magpie"]
    assert loaded["eval_magpie"] == [{"question_id": "m0", "prompt": "q0"}, {"question_id": "m1", "prompt": "q1"}]
    bad = tmp_path / "eval_bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}))
    with pytest.raises(ValueError, match=r"eval_bad.jsonl:1: 'messages' must hold one user message"):
        spec_bench.load_questions(bad, 2)
