"""Spec-Bench through the offline API: tokens/s, acceptance length and speedup per category.

    python -m bench.spec_bench [--questions ../shared/eval/spec_bench_question.jsonl]
        [--per-category 2] [--max-tokens 128] [--configs none,ngram,eagle3,eagle3-tree,eagle3-tree-ngram,standalone]
        [--draft-eagle3 PATH] [--draft-standalone PATH] [--batch-size 1]
        [--out bench/results/spec_bench.json] [--plot] [--no-hf]

Each question's first turn goes through the chat template as one user message; decoding is
greedy. The first N questions of each category are taken in file order. Every config is
loaded first (model load excluded from the timings) and warmed up with one short generation;
then the configs take turns on each question (`--batch-size` requests at a time), so load
from other processes on a shared machine hits all of them alike (`--sequential`: one config
at a time instead, less memory).

tokens_per_s = new tokens / wall time of generation, per category; acceptance_length = output
tokens / verify steps (the prefill step counts as one, so no speculation gives 1.0); speedup =
tokens_per_s / tokens_per_s of `none` in the same run. Greedy speculative decoding is lossless,
so each config's token ids are compared with `none`'s for the same question and differences
counted as `mismatches` (expected 0; the transformers rows use other kernels, so a rare
near-tie can flip a token there).

Unless --no-hf, transformers `generate` runs on the same prompt ids and weights (fp32):
`hf` (plain greedy), `hf-prompt-lookup` (prompt_lookup_num_tokens) and, with a standalone
draft, `hf-assisted` (assistant_model). Their acceptance length counts target forward calls.

Prints the JSON to stdout (progress goes to stderr) and writes it to --out; --plot writes a
PNG next to it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import shlex
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

from bench.configs import ENGINE_CONFIGS, REFERENCE, add_engine_args, engine_config, kv_slots_for
from graphs import EngineConfig, SamplingParams, build_graph
from graphs.assembly import eos_token_ids
from graphs.chat_ids import encode_chat
from models.build import ModelSource, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_QUESTIONS = REPO_ROOT.parent / "shared" / "eval" / "spec_bench_question.jsonl"
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "spec_bench.json"


# ---- questions ----------------------------------------------------------------------------


def load_questions(paths: str | Path, per_category: int) -> "OrderedDict[str, list[dict]]":
    """The first `per_category` questions of each category, categories in order of first appearance.

    `paths`: one file or several, comma-separated. Spec-Bench lines carry "category" and "turns";
    the held-out lines `train.data` writes (`eval_*.jsonl`: "messages" holding one user message)
    count under their file's name, so draft settings can be timed on our own held-out prompts."""
    by_cat: OrderedDict[str, list[dict]] = OrderedDict()
    for path in str(paths).split(","):
        with open(Path(path).expanduser(), encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                item = json.loads(line)
                prompt = _first_user_turn(item, f"{path}:{line_no}")
                bucket = by_cat.setdefault(str(item.get("category", Path(path).stem if "messages" in item
                                                        else "uncategorized")), [])
                if len(bucket) < per_category:
                    bucket.append({"question_id": item.get("question_id", item.get("id", line_no)), "prompt": prompt})
    return by_cat


def _first_user_turn(item: dict, where: str) -> str:
    if "messages" in item:
        messages = item["messages"]
        if not (isinstance(messages, list) and len(messages) == 1 and messages[0].get("role") == "user"
                and isinstance(messages[0].get("content"), str)):
            raise ValueError(f"{where}: 'messages' must hold one user message")
        return messages[0]["content"]
    turns = item.get("turns") or []
    if not turns or not isinstance(turns[0], str):
        raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
    return turns[0]


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


# A runner takes a list of prompt-id lists (and optionally fewer max tokens, for the warmup)
# and returns [(token_ids, verify_steps)] in order.
Runner = Callable[..., list[tuple[list[int], int]]]
WARMUP_TOKENS = 8


def engine_runner(engine, max_tokens: int) -> Runner:
    def run(prompts: list[list[int]], limit: int | None = None) -> list[tuple[list[int], int]]:
        outs = engine.generate(prompts, SamplingParams(max_tokens=limit or max_tokens, temperature=0.0))
        for out in outs:
            if out.error:
                raise RuntimeError(f"request failed: {out.error}")
        return [(list(o.token_ids), o.num_verify_steps) for o in outs]

    return run


def hf_runner(model, max_tokens: int, eos_ids: list[int], **generate_kwargs) -> Runner:
    """transformers generate, one prompt at a time; verify steps = target forward calls."""

    @torch.inference_mode()
    def run(prompts: list[list[int]], limit: int | None = None) -> list[tuple[list[int], int]]:
        results = []
        for ids in prompts:
            input_ids = torch.tensor([ids], dtype=torch.long)
            calls = [0]
            hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
            try:
                out = model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=limit or max_tokens,
                    do_sample=False, temperature=None, top_p=None, top_k=None,
                    eos_token_id=eos_ids, pad_token_id=eos_ids[0], **generate_kwargs,
                )
            finally:
                hook.remove()
            results.append((out[0, len(ids):].tolist(), calls[0]))
        return results

    return run


# ---- measuring ----------------------------------------------------------------------------


# A factory loads one config (model load, untimed) and returns (runner, batch size, close).
Factory = Callable[[], tuple[Runner, int, Callable[[], None]]]


def _log(name: str, category: str, r: dict[str, Any]) -> None:
    n = sum(map(len, r["tokens"]))
    print(f"[spec_bench] {name:18s} {category:16s} {n:5d} tok {r['wall_s']:7.2f} s "
          f"{n / max(r['wall_s'], 1e-9):7.2f} tok/s  accept {n / max(1, sum(r['steps'])):.2f}", file=sys.stderr)


def measure(factories: "OrderedDict[str, Factory]", prompts: "OrderedDict[str, list[list[int]]]",
            warmup: list[int], max_tokens: int, interleave: bool = True) -> dict[str, dict[str, dict[str, Any]]]:
    """Time every config on every category: {config: {category: {wall_s, tokens, steps}}}.

    Interleaved (the default), every config is loaded first and the configs take turns on each
    batch of questions, so load from other processes on a shared machine hits them alike;
    otherwise one config is loaded, measured and freed at a time (less memory).
    """
    raw: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in factories}

    def load(name: str):
        t0 = time.perf_counter()
        runner, batch_size, close = factories[name]()
        runner([warmup], min(WARMUP_TOKENS, max_tokens))
        print(f"[spec_bench] {name}: loaded and warmed up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return runner, batch_size, close

    def run(name: str, runner: Runner, category: str, chunk: list[list[int]]) -> None:
        entry = raw[name].setdefault(category, {"wall_s": 0.0, "tokens": [], "steps": []})
        t0 = time.perf_counter()
        outs = runner(chunk)
        entry["wall_s"] += time.perf_counter() - t0
        entry["tokens"] += [t for t, _ in outs]
        entry["steps"] += [s for _, s in outs]

    def chunks(ids: list[list[int]], size: int):
        return [ids[i:i + size] for i in range(0, len(ids), size)]

    if interleave:
        loaded = OrderedDict((name, load(name)) for name in factories)
        try:
            for category, ids in prompts.items():
                for i in range(len(ids)):
                    for name, (runner, batch_size, _) in loaded.items():
                        if i % batch_size == 0:  # a config's batch starts at this question
                            run(name, runner, category, ids[i:i + batch_size])
                for name in loaded:
                    _log(name, category, raw[name][category])
        finally:
            for _, _, close in loaded.values():
                close()
    else:
        for name in factories:
            runner, batch_size, close = load(name)
            try:
                for category, ids in prompts.items():
                    for chunk in chunks(ids, batch_size):
                        run(name, runner, category, chunk)
                    _log(name, category, raw[name][category])
            finally:
                close()
                del runner
                gc.collect()
    return raw


def summarize(raw: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]] | None) -> dict[str, dict]:
    """Per-category and overall numbers; speedup and mismatches against `reference` (the `none` run)."""
    out: dict[str, dict] = {}
    totals = {"wall_s": 0.0, "tokens": 0, "steps": 0, "questions": 0, "mismatches": 0}
    ref_tps_total = {"wall_s": 0.0, "tokens": 0}
    for category, r in raw.items():
        n_tok, n_steps, wall = sum(map(len, r["tokens"])), sum(r["steps"]), r["wall_s"]
        tps = n_tok / wall if wall > 0 else 0.0
        entry = {"tokens_per_s": round(tps, 3), "acceptance_length": round(n_tok / max(1, n_steps), 3),
                 "speedup": None, "num_questions": len(r["tokens"]), "num_tokens": n_tok,
                 "wall_s": round(wall, 3), "mismatches": None}
        if reference is not None and category in reference:
            ref = reference[category]
            ref_tok = sum(map(len, ref["tokens"]))
            ref_tps = ref_tok / ref["wall_s"] if ref["wall_s"] > 0 else 0.0
            entry["speedup"] = round(tps / ref_tps, 3) if ref_tps > 0 else None
            entry["mismatches"] = sum(a != b for a, b in zip(r["tokens"], ref["tokens"]))
            totals["mismatches"] += entry["mismatches"]
            ref_tps_total["wall_s"] += ref["wall_s"]
            ref_tps_total["tokens"] += ref_tok
        out[category] = entry
        totals["wall_s"] += wall
        totals["tokens"] += n_tok
        totals["steps"] += n_steps
        totals["questions"] += len(r["tokens"])
    tps = totals["tokens"] / totals["wall_s"] if totals["wall_s"] > 0 else 0.0
    ref_tps = ref_tps_total["tokens"] / ref_tps_total["wall_s"] if ref_tps_total["wall_s"] > 0 else 0.0
    out["overall"] = {
        "tokens_per_s": round(tps, 3), "acceptance_length": round(totals["tokens"] / max(1, totals["steps"]), 3),
        "speedup": round(tps / ref_tps, 3) if reference is not None and ref_tps > 0 else None,
        "num_questions": totals["questions"], "num_tokens": totals["tokens"], "wall_s": round(totals["wall_s"], 3),
        "mismatches": totals["mismatches"] if reference is not None else None,
    }
    return out


# ---- plot ---------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(result["results"])
    categories = [c for c in next(iter(result["results"].values()))] if configs else []
    fig, axes = plt.subplots(2, 1, figsize=(min(20, max(8, 0.35 * len(categories) * max(1, len(configs)))), 8),
                             sharex=True)
    width = 0.8 / max(1, len(configs))
    for ax, key, label in ((axes[0], "acceptance_length", "acceptance length (tokens / verify step)"),
                           (axes[1], "speedup", f"speedup over '{REFERENCE}' (tokens/s)")):
        for i, config in enumerate(configs):
            values = [result["results"][config].get(c, {}).get(key) or 0.0 for c in categories]
            xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(categories))]
            ax.bar(xs, values, width, label=config)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_ylabel(label)
        ax.legend(fontsize=8, ncol=min(4, len(configs)))
    axes[1].set_xticks(range(len(categories)))
    axes[1].set_xticklabels(categories, rotation=30, ha="right")
    meta = result["meta"]
    fig.suptitle(f"Spec-Bench: {meta['model']}, greedy, max_tokens={meta['max_tokens']}, "
                 f"{meta['per_category']}/category, batch {meta['batch_size']}, {meta['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- main ---------------------------------------------------------------------------------


def _engine_factory(cfg: EngineConfig, args) -> Factory:
    def make():
        engine = build_graph(cfg)
        return engine_runner(engine, args.max_tokens), args.batch_size, engine.shutdown

    return make


def _hf_factory(name: str, args, eos_ids: list[int], shared: dict[str, Any]) -> Factory:
    """transformers configs share one target model (and one assistant), loaded on first use."""

    def load(key: str, model: str):
        if key not in shared:
            from transformers import AutoModelForCausalLM

            from actors.device import parse_dtype
            from models.loader import resolve_model

            shared[key] = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=parse_dtype(args.dtype)).eval()
        return shared[key]

    def make():
        kwargs: dict[str, Any] = {}
        if name == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = args.ngram_steps
        elif name == "hf-assisted":
            kwargs["assistant_model"] = load("assistant", args.draft_standalone)
        return hf_runner(load("target", args.model), args.max_tokens, eos_ids, **kwargs), 1, shared.clear

    return make


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.spec_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS),
                   help="Spec-Bench question.jsonl, or train.data's held-out eval_*.jsonl files (comma-separated)")
    p.add_argument("--per-category", type=int, default=2, help="first N questions of each category")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--configs", default=",".join(ENGINE_CONFIGS),
                   help=f"comma-separated engine configs among {','.join(ENGINE_CONFIGS)}, a draft-model one "
                        "as NAME@P for min_path_prob P (draft configs are skipped without their draft; "
                        "'none' is always run, as the reference)")
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=1, help="requests submitted together (within a category)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--plot", action="store_true", help="write a PNG next to the JSON")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers generate baselines")
    p.add_argument("--sequential", action="store_true",
                   help="load and measure one config at a time (less memory) instead of interleaving them")
    args = p.parse_args(argv)
    for name in ("per_category", "max_tokens", "batch_size", "ngram_steps", "standalone_steps", "tree_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if REFERENCE in names:
        names.remove(REFERENCE)
    names = [REFERENCE] + list(dict.fromkeys(names))

    questions = load_questions(args.questions, args.per_category)
    if not questions:
        raise SystemExit(f"{args.questions}: no questions")
    n_q = sum(map(len, questions.values()))
    print(f"[spec_bench] {n_q} questions in {len(questions)} categories from {args.questions}", file=sys.stderr)

    # Tokenize once, exactly as the engine does (first turns: no replies to put back).
    target = ModelSource.resolve(args.model)
    tokenizer = load_tokenizer(target.folder)
    prompts = OrderedDict((c, [encode_chat(tokenizer, messages(q["prompt"]), None) for q in qs])
                          for c, qs in questions.items())
    eos_ids = sorted(eos_token_ids(target, tokenizer))
    warmup = next(iter(prompts.values()))[0]
    if args.kv_slots is None:
        args.kv_slots = kv_slots_for([p for ps in prompts.values() for p in ps], args.batch_size, args.max_tokens)

    factories: OrderedDict[str, Factory] = OrderedDict()
    skipped: dict[str, str] = {}
    # Every config is built (and a bad name refused) before any model loads.
    for name in names:
        try:
            cfg = engine_config(name, args)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if cfg is None:
            skipped[name] = "needs " + ("--draft-eagle3" if name.startswith("eagle3") else "--draft-standalone")
            print(f"[spec_bench] skip {name}: {skipped[name]}", file=sys.stderr)
            continue
        factories[name] = _engine_factory(cfg, args)
    hf_configs: list[str] = []
    if not args.no_hf:
        hf_configs = ["hf", "hf-prompt-lookup"] + (["hf-assisted"] if args.draft_standalone else [])
        if args.batch_size != 1:
            print("[spec_bench] transformers baselines run one prompt at a time", file=sys.stderr)
        shared: dict[str, Any] = {}
        for name in hf_configs:
            factories[name] = _hf_factory(name, args, eos_ids, shared)

    raw = measure(factories, prompts, warmup, args.max_tokens, interleave=not args.sequential)
    reference = raw[REFERENCE]
    results = {name: summarize(raw[name], reference) for name in factories}

    out_path = Path(args.out)
    result = {
        "meta": {
            "model": args.model,
            "max_tokens": args.max_tokens,
            "per_category": args.per_category,
            "batch_size": args.batch_size,
            "interleaved": not args.sequential,
            "kv_slots": args.kv_slots,
            "num_questions": n_q,
            "categories": list(questions),
            "questions": str(args.questions),
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": "python -m bench.spec_bench " + shlex.join(sys.argv[1:] if argv is None else argv),
            "draft_eagle3": args.draft_eagle3,
            "draft_standalone": args.draft_standalone,
            "ngram_steps": args.ngram_steps,
            "tree_steps": args.tree_steps,
            "standalone_steps": args.standalone_steps,
            "reference": REFERENCE,
            "hf_configs": hf_configs,
            "skipped": skipped,
            "plot": None,
        },
        "results": results,
    }
    if args.plot:
        result["meta"]["plot"] = str(out_path.with_suffix(".png"))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2)
    out_path.write_text(text + "\n")
    if args.plot:
        plot(result, out_path.with_suffix(".png"))
    print(text)
    bad = {c: r["overall"]["mismatches"] for c, r in results.items() if r["overall"]["mismatches"]}
    if bad:
        print(f"[spec_bench] WARNING: outputs differ from '{REFERENCE}' (questions): {bad}", file=sys.stderr)
    return result


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None


if __name__ == "__main__":
    main()
