"""Draft vocabularies: a draft's LM head may cover only Vd of the target's V ids (EAGLE-3's
`draft_vocab_size`, or a standalone draft's frequency-ranked hot vocabulary). Checkpoints carry
the public EAGLE-3 maps, which every reader here goes through:

    d2t (Vd,) long: target id of draft row i = i + d2t[i] (the ids sorted, so d2t is non-decreasing)
    t2d (V,)  bool: True where a target id is in the draft vocabulary
"""

from __future__ import annotations

import torch


def vocab_ids(d2t: torch.Tensor) -> torch.Tensor:
    """(Vd,) target id of each draft row, i + d2t[i]: the sorted ids `vocab_maps` was built from."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def vocab_maps(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t and t2d for sorted target ids (Vd,) of a vocabulary of `vocab_size`."""
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft-row ids (any shape) -> target ids."""
    return draft_ids + d2t[draft_ids]
