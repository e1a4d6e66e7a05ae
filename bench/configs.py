"""The engine configs every benchmark names the same way (`none`, `ngram`, `eagle3`, `eagle3-tree`,
`eagle3-tree-ngram`, `standalone`, and `serve`: what `make serve` runs, eagle3-tree-ngram with
min_path_prob 0.1), their command-line options and the KV pool they need. Every config chooses
its tree size per step (adaptive speculation) unless named with `+fixed`.

    NAME@P          (bench.spec_bench) a draft-model config with min_path_prob P
    NAME+fixed/B@N  (bench.concurrency) the full tree every step (adaptive_speculation=False), with
                    verify_budget=B and disable_by_batch_size=N (each part optional); `serve+fixed/16`
                    is what `make serve` ran before adaptive speculation
"""

from __future__ import annotations

import dataclasses
import re

from graphs import EngineConfig
from models.registry import DEFAULT_MODEL

ENGINE_CONFIGS = ("none", "ngram", "eagle3", "eagle3-tree", "eagle3-tree-ngram", "standalone", "serve")
SERVE_MIN_PATH_PROB = 0.1  # serve.settings.DEFAULT_SPECULATION's (bench may not import serve/)
REFERENCE = "none"


def add_engine_args(p, *, draft_eagle3: str | None = None, draft_standalone: str | None = None,
                    standalone_steps: int = 4, dtype: str = "float32") -> None:
    """The options `engine_config` reads; the benchmarks differ only in these defaults."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: registry name, HF folder or .gguf")
    p.add_argument("--draft-eagle3", default=draft_eagle3, help="EAGLE-3 head for eagle3 / eagle3-tree")
    p.add_argument("--draft-standalone", default=draft_standalone, help="small LM for standalone (and hf-assisted)")
    p.add_argument("--ngram-steps", type=int, default=4, help="NGRAM draft length (also HF prompt_lookup_num_tokens)")
    p.add_argument("--standalone-steps", type=int, default=standalone_steps, help="standalone draft length")
    p.add_argument("--tree-steps", type=int, default=3,
                   help="draft depth of eagle3-tree(-ngram); deeper lets its 8 tokens follow a confident path "
                        "further, at one more draft forward per level (docs: 5 measured no faster)")
    p.add_argument("--dtype", default=dtype)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--kv-slots", type=int, default=None, help="KV pool size (default: sized from the prompts)")


def engine_config(name: str, args) -> EngineConfig | None:
    """EngineConfig for a named config, or None when it needs a draft that was not given.
    NAME@P: a draft-model config with min_path_prob P (only drafts at least that likely are verified)."""
    base, at, prob = name.partition("@")
    if at:
        min_path_prob = _probability(name, prob)  # refused even where the draft is missing
        cfg = engine_config(base, args)
        return cfg if cfg is None else dataclasses.replace(cfg, min_path_prob=min_path_prob)
    common = dict(model=args.model, dtype=args.dtype, num_threads=args.threads, kv_slots=args.kv_slots)
    if name == "none":
        return EngineConfig(**common)
    if name == "ngram":
        return EngineConfig(speculative_algorithm="ngram", num_steps=args.ngram_steps, **common)
    if name == "eagle3":
        return EngineConfig(speculative_algorithm="eagle3", draft_model=args.draft_eagle3, num_steps=3,
                            **common) if args.draft_eagle3 else None
    if name in ("eagle3-tree", "eagle3-tree-ngram"):  # -ngram: with a prompt-lookup branch of up to 5 tokens
        branch = 5 if name == "eagle3-tree-ngram" else 0
        return EngineConfig(speculative_algorithm="eagle3", draft_model=args.draft_eagle3, num_steps=args.tree_steps,
                            eagle_topk=4, num_draft_tokens=8, ngram_branch=branch, **common) if args.draft_eagle3 else None
    if name == "serve":
        cfg = engine_config("eagle3-tree-ngram", args)
        return cfg if cfg is None else dataclasses.replace(cfg, min_path_prob=SERVE_MIN_PATH_PROB)
    if name == "standalone":
        return EngineConfig(speculative_algorithm="standalone", draft_model=args.draft_standalone,
                            num_steps=args.standalone_steps, **common) if args.draft_standalone else None
    raise ValueError(f"--configs: unknown config {name!r} (known: {', '.join(ENGINE_CONFIGS)})")


def _probability(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--configs: {name!r}: the part after '@' must be a number (min_path_prob)") from None


def kv_slots_for(prompts: list[list[int]], batch_size: int, max_tokens: int) -> int:
    """A KV pool that holds `batch_size` of the longest prompt at once: the scheduler reserves
    prompt + max_tokens + 2 steps of verify/scratch slots per request (plus a margin)."""
    longest = max(len(p) for p in prompts)
    return batch_size * (longest + max_tokens + 2 * 64) + 64


CONFIG_NAME = re.compile(r"^(?P<base>[a-z0-9-]+)(?P<fixed>\+fixed)?(?:/(?P<budget>[1-9][0-9]*))?"
                         r"(?:@(?P<cutoff>[1-9][0-9]*))?$")


def parse_config(name: str, args) -> tuple[str, object]:
    """'eagle3-tree-ngram+fixed/32@8' -> the spec_bench config with full trees every step,
    verify_budget=32 and disable_by_batch_size=8 (each part may be left out)."""
    match = CONFIG_NAME.match(name)
    if match is None:
        raise SystemExit(f"--configs: {name!r} is not NAME[+fixed][/BUDGET][@CUTOFF] with positive integers")
    cfg = engine_config(match["base"], args)
    if cfg is None:
        raise SystemExit(f"--configs: {match['base']} needs --draft-eagle3 / --draft-standalone")
    limits = {"verify_budget": match["budget"], "disable_by_batch_size": match["cutoff"]}
    cfg = dataclasses.replace(cfg, **{k: int(v) for k, v in limits.items() if v is not None})
    return name, dataclasses.replace(cfg, adaptive_speculation=False) if match["fixed"] else cfg
