"""Training sequences: `train.data`'s records as token lists, the held-out split by prompt, and the
token-frequency counts a draft vocabulary is chosen from."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Sequence:
    tokens: list[int]  # prompt + response
    num_prompt: int  # loss on positions >= num_prompt (the target's own tokens)
    group: str = ""  # prompt id: every answer to one prompt lands on the same side of the split


def load_sequences(data_dir: Path, max_len: int = 512, modes: tuple[str, ...] | None = None) -> list[Sequence]:
    """Records of `responses.jsonl` as sequences, truncated to max_len, deterministic order."""
    out = []
    path = Path(data_dir) / "responses.jsonl"
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if modes and not any(r["mode"].startswith(m) for m in modes):
            continue
        tokens = (r["prompt_ids"] + r["output_ids"])[:max_len]
        if len(tokens) - len(r["prompt_ids"]) < 2:
            continue
        out.append(Sequence(tokens, len(r["prompt_ids"]), str(r["id"])))
    return out


def _unit_hash(text: str) -> float:
    return zlib.crc32(text.encode()) / 2**32


def split_holdout(seqs: list[Sequence], frac: float, seed: int = 0) -> tuple[list[Sequence], list[Sequence]]:
    """(train, held-out) by a hash of each sequence's prompt id, not by position: a prompt's greedy,
    sampled and follow-up answers stay together, and a sequence keeps its side when the data grows
    (more `train.data` output never moves a trained-on sequence into the held-out set)."""
    hashes = {s.group: _unit_hash(f"{seed}/{s.group}") for s in seqs}
    held = {g for g, h in hashes.items() if h < frac}
    if frac > 0 and not held and len(hashes) > 1:
        held = {min(hashes, key=hashes.get)}  # tiny data sets still get a held-out group
    return [s for s in seqs if s.group not in held], [s for s in seqs if s.group in held]


def token_counts(seqs: list[Sequence], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(response counts, prompt counts) per target id, each (V,)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    prompt_counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s.tokens[s.num_prompt:]), minlength=vocab_size)
        prompt_counts += torch.bincount(torch.tensor(s.tokens[: s.num_prompt]), minlength=vocab_size)
    return counts, prompt_counts


def vocab_coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of response tokens (counts (V,) from `token_counts`) whose id is in `ids`: what a
    draft vocabulary can predict."""
    return float(counts[ids].sum()) / max(1, int(counts.sum()))


def draft_vocab(counts: torch.Tensor, prompt_counts: torch.Tensor, draft_vocab_size: int,
                keep: torch.Tensor | None = None) -> torch.Tensor:
    """The draft_vocab_size target ids most frequent as predicted (response) tokens, topped up
    with prompt tokens and then the lowest ids (BPE merge order); sorted. Counts from `token_counts`.
    `keep` (ids) are in it whatever their counts: a grown vocabulary keeps the one its head has."""
    vocab_size = counts.numel()
    # Lexicographic score: response count, then prompt count, then small id first.
    score = counts.double() * 1e9 + prompt_counts.double().clamp_max(1e8) + (1 - torch.arange(vocab_size) / vocab_size)
    if keep is not None:
        score[keep] = float("inf")
    return score.topk(min(draft_vocab_size, vocab_size)).indices.sort().values

