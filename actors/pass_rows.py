"""PassRows: the inputs of one model forward as flat tensors, built once per step.

The runners describe a pass (a verify step's trees, prompt chunks, a draft level's beams) by
tensors of the whole batch, never per-request lists: `AttentionMetadata.batched` turns them into
the pass's index tensors with a fixed number of ops, and `actors.cuda_graphs` pads them to a
captured batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.attention import AttentionMetadata


@dataclass
class PassRows:
    """tokens (T,), positions (T,) of the new tokens, request after request;
    prefix (B, L): each request's committed KV slots, valid up to prefix_lens (B,);
    slots (T,): the new tokens' KV slots, new_lens (B,) of them per request;
    trees (Bt, N, N) bool: tree masks of the first Bt requests (N new tokens each), or None: causal."""

    tokens: torch.Tensor
    positions: torch.Tensor
    prefix: torch.Tensor
    prefix_lens: torch.Tensor
    slots: torch.Tensor
    new_lens: torch.Tensor
    trees: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return int(self.new_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def metadata(self, device, kv_width: int = 0) -> AttentionMetadata:
        return AttentionMetadata.batched(self.prefix, self.prefix_lens, self.slots, self.new_lens, self.positions,
                                         self.trees, device, kv_width)

    def then(self, other: "PassRows") -> "PassRows":
        """These requests' rows, then `other`'s (which carries no trees: trees lead)."""
        if other.trees is not None:
            raise ValueError("PassRows.then: only the leading requests may carry tree masks")
        width = max(self.prefix.shape[1], other.prefix.shape[1])
        widen = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731
        return PassRows(
            tokens=torch.cat([self.tokens, other.tokens]), positions=torch.cat([self.positions, other.positions]),
            prefix=torch.cat([widen(self.prefix), widen(other.prefix)]),
            prefix_lens=torch.cat([self.prefix_lens, other.prefix_lens]),
            slots=torch.cat([self.slots, other.slots]), new_lens=torch.cat([self.new_lens, other.new_lens]),
            trees=self.trees,
        )


def ragged_rows(padded: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The first lens[b] entries of each row of padded (B, P), row after row -> (sum(lens),)."""
    return padded[torch.arange(padded.shape[1]) < lens.unsqueeze(1)]
