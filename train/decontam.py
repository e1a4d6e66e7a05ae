"""Keep training prompts disjoint from the evaluation set (Spec-Bench): no prompt equal to or
contained in an eval turn (or containing one), and no shared 8-word shingle. The eval file is
read only to reject overlapping training prompts, never to pick or tune them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from models.registry import REPO_ROOT

SPEC_BENCH = REPO_ROOT.parent / "shared" / "eval" / "spec_bench_question.jsonl"
SHINGLE = 8


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def shingles(text: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    words = _norm(text).split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def load_eval_turns(path: Path | str = SPEC_BENCH) -> list[str]:
    path = Path(path)
    if not path.is_file():
        return []
    return [turn for line in path.read_text().splitlines() if line.strip() for turn in json.loads(line)["turns"]]


class EvalIndex:
    def __init__(self, turns: list[str], n: int = SHINGLE):
        self.n = n
        self.turns = [_norm(t) for t in turns]
        self.shingles: set[tuple[str, ...]] = set()
        for t in turns:
            self.shingles |= shingles(t, n)

    def overlaps(self, text: str) -> str | None:
        """Why `text` overlaps the eval set, or None."""
        norm = _norm(text)
        if not norm:
            return None
        for turn in self.turns:
            if norm == turn or norm in turn or (len(turn) > 20 and turn in norm):
                return "contained"
        if shingles(text, self.n) & self.shingles:
            return f"shares a {self.n}-word shingle"
        return None


def user_text(messages: list[dict]) -> str:
    return "\n".join(m["content"] for m in messages if m["role"] == "user")


def filter_prompts(prompts: list[dict], path: Path | str = SPEC_BENCH) -> tuple[list[dict], int]:
    """Drop prompts overlapping the eval set; returns (kept, number dropped)."""
    index = EvalIndex(load_eval_turns(path))
    kept = [p for p in prompts if index.overlaps(user_text(p["messages"])) is None]
    return kept, len(prompts) - len(kept)
