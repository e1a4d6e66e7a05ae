"""Held-out acceptance against the response tokens a draft was trained on: the curve that sizes
the next data round. Measures a reference draft (the one fine-tuned from: 0 new tokens) and every
draft `train.eagle3 --keep-every N` kept, on each held-out prompt set (`train.evaluate`, greedy;
never Spec-Bench), into one JSON file and a PNG.

    python -m train.curve --reference drafts/smollm2-135m-instruct-eagle3 \
        --checkpoints WORK_DIR/checkpoints --prompts A/eval_sharegpt.jsonl,A/eval_prompts.jsonl \
        --out bench/results/eagle3_sharegpt_curve.json [--n 40] [--max-tokens 128] [--plot]

Each measurement is written as it finishes and a rerun with the same settings skips the ones
already in --out, so a stopped run resumes; the tree options (--topk, --num-draft-tokens,
--ngram-branch) make a separate file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from train.evaluate import add_measure_options, measure_acceptance

# Options whose change makes the earlier measurements in --out incomparable.
SETTINGS = ("target", "algorithm", "n", "max_tokens", "num_steps", "topk", "num_draft_tokens", "ngram_branch", "dtype")


def kept_drafts(folder: Path) -> list[tuple[str, Path, int]]:
    """(label, folder, response tokens trained on) of each draft `--keep-every` kept, by step."""
    found = []
    for sub in sorted(folder.glob("step-*")):
        info = json.loads((sub / "checkpoint.json").read_text())
        found.append((sub.name, sub, info["response_tokens"]))
    if not found:
        raise ValueError(f"--checkpoints: no step-* folders with checkpoint.json in {folder} "
                         "(written by train.eagle3 --keep-every)")
    return found


def set_name(path: str) -> str:
    """A prompt set's name in the JSON: its data folder and file stem, e.g. sharegpt/eval_sharegpt."""
    p = Path(path)
    return f"{p.parent.name}/{p.stem}"


def measure_curve(args) -> dict:
    """Every (draft, prompt set) pair not yet in --out measured and saved; returns the result."""
    out = Path(args.out)
    settings = {k: getattr(args, k) for k in SETTINGS}
    result = json.loads(out.read_text()) if out.is_file() else {}
    if result.get("settings") != settings:
        result = {"settings": settings, "points": []}
    drafts = [("reference", Path(args.reference).expanduser(), 0)]
    if args.checkpoints:
        drafts += kept_drafts(Path(args.checkpoints).expanduser())
    prompt_sets = [p.strip() for p in args.prompts.split(",") if p.strip()]
    for label, folder, tokens in drafts:
        point = next((p for p in result["points"] if p["draft"] == str(folder)), None)
        if point is None:
            point = {"label": label, "draft": str(folder), "response_tokens": tokens, "acceptance": {}}
            result["points"].append(point)
        for prompts in prompt_sets:
            name = set_name(prompts)
            if name in point["acceptance"]:
                continue
            measured = measure_acceptance(args.target, str(folder), args.algorithm, Path(prompts).expanduser(),
                                          args.n, args.max_tokens, args.num_steps, args.topk, args.num_draft_tokens,
                                          threads=args.threads, dtype=args.dtype, ngram_branch=args.ngram_branch)
            point["acceptance"][name] = measured["acceptance_length"]
            print(json.dumps({"label": label, "set": name, **measured}), flush=True)
            done = [point["acceptance"].get(set_name(p)) for p in prompt_sets]
            if None not in done:
                point["mean"] = round(sum(done) / len(done), 3)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))
    return result


def plot_curve(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(result["points"], key=lambda p: p["response_tokens"])
    names = sorted({n for p in points for n in p["acceptance"]})
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names + (["mean"] if any("mean" in p for p in points) else []):
        have = [p for p in points if (p.get("mean") if name == "mean" else p["acceptance"].get(name)) is not None]
        ax.plot([p["response_tokens"] for p in have],
                [p["mean"] if name == "mean" else p["acceptance"][name] for p in have],
                "o-" if name != "mean" else "s--", label=name)
    s = result["settings"]
    shape = f"tree topk {s['topk']}, {s['num_draft_tokens']} tokens" if s["topk"] > 1 else f"chain {s['num_steps']} steps"
    ax.set_xlabel("response tokens trained on (0: the reference draft)")
    ax.set_ylabel("acceptance length (tokens/step)")
    ax.set_title(f"held-out acceptance, {shape}, {s['n']} prompts x {s['max_tokens']} tokens, {s['dtype']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_measure_options(p)
    p.add_argument("--reference", required=True, help="the draft the checkpoints were fine-tuned from (0 tokens)")
    p.add_argument("--checkpoints", default="",
                   help="folder of step-* drafts kept by --keep-every (none: the reference alone, e.g. while training)")
    p.add_argument("--prompts", required=True, help="held-out prompt sets (jsonl), comma-separated")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", action="store_true", help="write a PNG next to the JSON")
    args = p.parse_args(argv)
    try:
        result = measure_curve(args)
    except ValueError as e:
        p.error(str(e))
    if args.plot:
        plot_curve(result, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
