"""Draft-tree structure helpers shared by drafts and target (chain = tree with parent i - 1)."""

from __future__ import annotations

import torch


def chain_parents(batch: int, num_nodes: int) -> torch.Tensor:
    """(B, N) parents of a chain: node i hangs off node i - 1, the root has -1."""
    return (torch.arange(num_nodes) - 1).unsqueeze(0).expand(batch, num_nodes).clone()


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """(B, N) parents -> (B, N, N) bool: [b, i, j] is True when j is i or an ancestor of i.

    Parents always precede their children (parent index < child index), so one pass in
    node order is enough.
    """
    batch, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool).unsqueeze(0).repeat(batch, 1, 1)
    for i in range(1, n):
        p = parents[:, i].clamp_min(0)  # (B,)
        has_parent = (parents[:, i] >= 0).unsqueeze(1)
        mask[:, i] |= mask[torch.arange(batch), p] & has_parent
    return mask


def depths(parents: torch.Tensor) -> torch.Tensor:
    """(B, N) depth of each node (root 0) given parents that precede children."""
    batch, n = parents.shape
    depth = torch.zeros(batch, n, dtype=torch.long)
    for i in range(1, n):
        p = parents[:, i]
        depth[:, i] = torch.where(p >= 0, depth[torch.arange(batch), p.clamp_min(0)] + 1, 0)
    return depth
