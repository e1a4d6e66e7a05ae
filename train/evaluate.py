"""Acceptance length of a trained draft, measured with our engine on held-out self-generated
prompts (`eval_prompts.jsonl` written by `train.data`; never Spec-Bench).

    python -m train.evaluate --draft drafts/smollm2-135m-instruct-eagle3 --algorithm EAGLE3 \
        --prompts ~/.cache/specgraph/train/smollm2/eval_prompts.jsonl [--n 40] [--max-tokens 128]

acceptance_length = output tokens / verify steps (the engine's `RequestOutput.acceptance_length`
summed over requests, prefill step included); decode_acceptance = mean accepted drafts + 1 over
decode steps only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def load_prompts(path: str | Path, n: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in Path(path).expanduser().read_text().splitlines() if line.strip()]
    return [r["messages"] for r in rows[:n]]


def measure_acceptance(target: str, draft: str | None, algorithm: str, prompts_path, n: int = 40,
                       max_tokens: int = 128, num_steps: int = 3, topk: int = 1, num_draft_tokens: int = 4,
                       max_running_requests: int = 32, threads: int | None = 1, dtype: str = "float32",
                       check_against: list[list[int]] | None = None, ngram_branch: int = 0,
                       min_path_prob: float = 0.0) -> dict:
    """Acceptance of the draft itself: the whole tree is verified every step (adaptive speculation,
    which shrinks it from step costs timed as it runs, would make the figure depend on the
    machine's load)."""
    import torch

    from graphs.config import EngineConfig
    from graphs import build_graph
    from spec.sampling import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    conversations = load_prompts(prompts_path, n)
    engine = build_graph(EngineConfig(model=target, speculative_algorithm=algorithm, draft_model=draft,
                                      num_steps=num_steps, eagle_topk=topk, num_draft_tokens=num_draft_tokens,
                                      ngram_branch=ngram_branch, min_path_prob=min_path_prob,
                                      max_running_requests=max_running_requests, num_threads=threads,
                                      dtype=dtype, adaptive_speculation=False))
    start = time.time()
    try:
        outs = engine.chat(conversations, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    finally:
        engine.shutdown()
    seconds = time.time() - start
    tokens = sum(o.num_output_tokens for o in outs)
    steps = sum(o.num_verify_steps for o in outs)
    accepts = [a for o in outs for a in o.accept_lens]
    result = {
        "algorithm": algorithm, "num_steps": num_steps, "topk": topk, "prompts": len(outs),
        "max_tokens": max_tokens, "dtype": dtype, "output_tokens": tokens, "verify_steps": steps,
        "acceptance_length": round(tokens / max(1, steps), 3),
        "decode_acceptance": round(1 + sum(accepts) / max(1, len(accepts)), 3),
        "seconds": round(seconds, 1),
        **({"ngram_branch": ngram_branch} if ngram_branch else {}),
        **({"min_path_prob": min_path_prob} if min_path_prob else {}),
    }
    if check_against is not None:
        result["matches_reference"] = [o.token_ids for o in outs] == check_against
    return result


def add_measure_options(p: argparse.ArgumentParser) -> None:
    """The options of one acceptance measurement, shared with train.curve."""
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--algorithm", default="EAGLE3")
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ngram-branch", type=int, default=0, help="prompt-lookup tokens forced into each tree (--topk > 1)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_measure_options(p)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--min-path-prob", type=float, default=0.0, help="verify only draft tokens at least this likely")
    args = p.parse_args(argv)
    print(json.dumps(measure_acceptance(args.target, args.draft, args.algorithm, args.prompts, args.n, args.max_tokens,
                                        args.num_steps, args.topk, args.num_draft_tokens, threads=args.threads,
                                        dtype=args.dtype, ngram_branch=args.ngram_branch,
                                        min_path_prob=args.min_path_prob)))


if __name__ == "__main__":
    main()
