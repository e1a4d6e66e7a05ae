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
"""

from __future__ import annotations

import argparse
import json
import random
import time
import zlib
from pathlib import Path

from graphs.config import EngineConfig
from train.decontam import filter_prompts
from train.magpie import magpie_jobs, magpie_prompts
from train.prompts import (DOC_SEVERAL, DOC_SINGLE, TRANSLATE_TO, back_translation_tasks, document_prompts, follow_up,
                           generate_prompts, passage_tasks)

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
    parser.add_argument("--max-running-requests", type=int, default=32)
    parser.add_argument("--max-prefill-tokens", type=int, default=EngineConfig.max_prefill_tokens,
                        help="prompt tokens admitted per step (raise on a GPU for long document prompts)")
    parser.add_argument("--dtype", default="float32", help="engine dtype (labels are recomputed by the trainers, see --feature-dtype)")
    parser.add_argument("--kv-slots", type=int, default=16384, help="KV pool token slots (admission reserves max_tokens each)")
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
    parser.add_argument("--max-minutes", type=float, default=0.0,
                        help="stop generating after this long (what finished is kept; rerun to resume)")
    args = parser.parse_args(argv)

    import torch

    from graphs import build_graph
    from spec.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    responses_path = out / "responses.jsonl"
    answered = {r["key"]: r for r in read_jsonl(responses_path)}
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
                                      kv_slots=args.kv_slots, max_prefill_tokens=args.max_prefill_tokens,
                                      dtype=args.dtype, num_threads=args.threads, **spec))
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rng = random.Random(args.seed)

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

    # Stage 2: greedy answers for every prompt, sampled answers for a share of them.
    jobs = []
    for p in all_prompts:
        if f"{p['id']}:g" not in answered:
            jobs.append((f"{p['id']}:g", p, greedy))
        if rng.random() < args.sample_frac and f"{p['id']}:s" not in answered:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=rng.randrange(2**31))
            jobs.append((f"{p['id']}:s", p, params))
    # Shuffled (outputs do not depend on order) so a run stopped early has covered every kind of
    # prompt in proportion; every prompt but the template ones goes first: document tasks (on
    # passages, the document stream and translations), the scarcest kind and the only one that
    # trains drafting over long contexts, and target-written ones, the nearest to real requests.
    random.Random(args.seed + 1).shuffle(jobs)
    plain = {p["id"] for p in prompts}
    jobs.sort(key=lambda job: job[1]["id"] in plain)
    first = run_engine(engine, jobs, responses_path, "answers", deadline=deadline)

    # Stage 3: second turns on a share of the greedy answers.
    previous = {r["key"]: r for r in read_jsonl(responses_path)}
    jobs = []
    for p in all_prompts:
        record = previous.get(f"{p['id']}:g")
        if record is None or record["finish"] != "stop" or rng.random() >= args.follow_up_frac:
            continue
        key = f"{p['id']}:f"
        if key in previous:
            continue
        convo = {"id": p["id"], "kind": p["kind"] + "+followup",
                 "messages": follow_up(p["messages"], record["text"], zlib.crc32(key.encode()) % 1000)}
        jobs.append((key, convo, greedy))
    run_engine(engine, jobs, responses_path, "follow-ups", deadline=deadline)
    engine.shutdown()
    records = read_jsonl(responses_path)
    tokens = sum(len(r["output_ids"]) for r in records)
    print(json.dumps({"records": len(records), "output_tokens": tokens,
                      "prompt_tokens": sum(len(r["prompt_ids"]) for r in records),
                      "new_this_run": len(first), "seconds": round(time.time() - start, 1)}))


if __name__ == "__main__":
    main()
