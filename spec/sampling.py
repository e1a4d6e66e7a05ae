"""Sampling rules and speculative acceptance, as pure functions (one module for both).

Randomness is a pure function of (request seed, position): the token at absolute position
p of a request is F_p^-1(u(seed, p)), where F_p is the CDF of the target's processed
distribution there and u a hash-derived uniform. Consequences we rely on:
  * same seed, same text, whatever the batch or the restarts (runners keep no RNG state);
  * verification is lossless: each tree node draws its target token from the target's
    distribution at its position; following the child that matches it is rejection
    sampling with the point-mass drafts that top-k drafting produces (accept a child c
    with probability p(c), else continue on the residual p without c), and each position's
    uniform is used once along the realised path, so outputs follow the target exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Constants below 2**63 so they fit int64; multiplication wraps (two's complement).
_MUL_SEED, _MUL_POS, _MIX = 0x5851F42D4C957F2D, 0x14057B7EF767814F, 0x2545F4914F6CDD1D
_MAX_SEED = 2**63 - 1
# Bounds on what one request may ask for: every value must fit the int64 tensors a step is
# built from, and stop strings are matched after every token (cost: count x length).
MAX_TOP_K = 2**31 - 1
MAX_TOKENS = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def _not_number(value) -> bool:
    return not isinstance(value, (int, float)) or isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request generation settings (OpenAI / vLLM semantics). Validated on construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {self.max_tokens!r}")
        if _not_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if _not_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer up to {MAX_TOP_K}, "
                             f"got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= _MAX_SEED
        ):
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(R,) float64 uniforms in [0, 1), a deterministic hash of (seed, position) per row."""
    x = seeds.to(torch.long) * _MUL_SEED + positions.to(torch.long) * _MUL_POS
    for _ in range(3):
        x = x ^ ((x >> 29) & ((1 << 35) - 1))
        x = x * _MIX
    return ((x >> 11) & ((1 << 52) - 1)).to(torch.float64) / float(1 << 52)


def processed_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """(R, V) logits -> (R, V) float32 probabilities after temperature, top-k and top-p.

    Rows with temperature 0 are not meaningful here (the caller takes the argmax).
    """
    logits = logits.float() / temperature.clamp_min(1e-5).unsqueeze(1)  # (R, V)
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    needs_sort = (k < vocab) | (top_p < 1.0)
    if bool(needs_sort.any()):
        rows = needs_sort.nonzero().flatten()
        sorted_logits, order = logits[rows].sort(dim=1, descending=True)  # (r, V)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = ranks >= k[rows].unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
        drop |= mass_before >= top_p[rows].unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits[rows] = torch.full_like(sorted_logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits.softmax(dim=1)


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """The target's token for each row: argmax where temperature is 0, else a seeded sample.

    logits (R, V); the other arguments (R,), one entry per row; `positions` is the absolute
    position of the token being chosen. Returns (R,) long.
    """
    tokens = logits.argmax(dim=1)
    sampled = (temperature > 0).nonzero().flatten()
    if sampled.numel():
        probs = processed_probs(logits[sampled], temperature[sampled], top_p[sampled], top_k[sampled])
        cdf = probs.double().cumsum(dim=1)  # (r, V)
        u = uniforms(seeds[sampled], positions[sampled]).to(cdf.device) * cdf[:, -1]
        picked = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1)
        tokens[sampled] = picked.clamp(max=logits.shape[1] - 1)
    return tokens


def accept_tree(
    draft_tokens: list[int], parents: list[int], target_tokens: list[int]
) -> tuple[list[int], int]:
    """Walk one request's draft tree from the root, following the child whose token equals
    the target's token at the current node.

    Returns (accepted node indices, root first; bonus token = target's token at the last one).
    """
    children: dict[int, dict[int, int]] = {}
    for node, parent in enumerate(parents):
        if parent >= 0:
            children.setdefault(parent, {}).setdefault(draft_tokens[node], node)
    path = [0]
    while True:
        nxt = children.get(path[-1], {}).get(target_tokens[path[-1]])
        if nxt is None:
            return path, target_tokens[path[-1]]
        path.append(nxt)
