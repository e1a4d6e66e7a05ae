"""Target-written prompts (the Magpie method, Xu et al. 2024): an instruction-tuned model given
its chat template up to an open user turn writes a plausible user message itself. The template
prompts of `train.prompts` are narrow (a few hundred sentence frames); these read like what
people ask a chat model, and they come from the target alone, so no benchmark or outside data
enters the training set (`train.decontam` still filters them).

A share of the user turns is steered by a system prompt naming a kind of task (the target writes
more math questions after a math-tutor system prompt). Only the user turn is kept: the answers
are generated afterwards under the target's ordinary template (its default system prompt), as a
served request would be.

    magpie_jobs(tokenizer, n, seed) -> [(key, {"id", "kind", "prefix"}, SamplingParams)]
    magpie_prompts(records) -> [{"id", "kind", "messages": [{"role": "user", "content"}]}]
"""

from __future__ import annotations

import random
import re

# None: the template's own default system prompt (five draws in fourteen). The steering prompts
# name broad kinds of chat tasks, written here, not taken from any benchmark.
STEERS: list[tuple[str, str | None]] = [
    ("open", None), ("open", None), ("open", None), ("open", None), ("open", None),
    ("math", "You are an AI assistant that solves math problems step by step."),
    ("code", "You are an AI assistant that helps users write, explain and debug code."),
    ("writing", "You are an AI assistant that helps users with creative writing: stories, poems, posts and letters."),
    ("editing", "You are an AI assistant that rewrites, summarizes and proofreads texts that users paste in."),
    ("roleplay", "You are an AI assistant that plays characters and takes part in role-play scenes."),
    ("reasoning", "You are an AI assistant that answers logic puzzles and questions needing careful reasoning."),
    ("knowledge", "You are an AI assistant that answers questions about science, history and culture."),
    ("advice", "You are an AI assistant that gives practical advice and plans."),
    ("data", "You are an AI assistant that extracts information from texts and organizes it in lists and tables."),
]
MIN_WORDS, MAX_WORDS = 4, 120
SENTINEL = "\x00USER_TURN\x00"


def user_turn_prefix(tokenizer, system: str | None) -> str:
    """The chat template rendered up to where a user's message begins (its special tokens
    included), for the target to continue as the user."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    prefix = text[: text.index(SENTINEL)]
    if not prefix:
        raise ValueError("chat template: renders nothing before a user's message, so there is no open "
                         "user turn for the target to continue")
    return prefix


def magpie_jobs(tokenizer, n: int, seed: int, max_tokens: int = 100, temperature: float = 1.0,
                top_p: float = 0.95) -> list[tuple[str, dict, object]]:
    """n sampled user turns, keyed `m<seed>-k` (prefix-stable in n: a larger n adds draws);
    each has its own sampling seed, so a rerun draws the same turns."""
    from spec.sampling import SamplingParams

    prefixes = {kind: user_turn_prefix(tokenizer, system) for kind, system in STEERS}
    jobs = []
    for k in range(n):
        rng = random.Random(f"magpie-{seed}-{k}")
        kind, _ = rng.choice(STEERS)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                seed=rng.randrange(2**31))
        key = f"m{seed}-{k}"
        jobs.append((key, {"id": key, "kind": f"magpie-{kind}", "prefix": prefixes[kind]}, params))
    return jobs


def clean_turn(text: str) -> str | None:
    """The user turn as a prompt, or None for one to drop: too short or long, or one that runs
    into another turn or is mostly not words."""
    text = text.strip()
    words = text.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or "<|" in text or "|>" in text:
        return None
    if len(re.findall(r"[A-Za-z]", text)) < 0.6 * len(text.replace(" ", "")):
        return None
    return text


def magpie_prompts(records: list[dict]) -> list[dict]:
    """Prompts from finished user-turn records (`run_engine` output), in key order, each text
    once."""
    seen, prompts = set(), []
    for r in sorted(records, key=lambda r: _order(r["key"])):
        text = clean_turn(r["text"]) if r["finish"] == "stop" else None
        if text is None or text.lower() in seen:
            continue
        seen.add(text.lower())
        prompts.append({"id": r["id"], "kind": r["kind"], "messages": [{"role": "user", "content": text}]})
    return prompts


def _order(key: str) -> tuple[str, int]:
    stem, _, k = key.rpartition("-")
    return stem, int(k)
