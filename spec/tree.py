"""Draft-tree structure helpers shared by drafts and target (chain = tree with parent i - 1)."""

from __future__ import annotations

import torch


def chain_parents(batch: int, num_nodes: int) -> torch.Tensor:
    """(B, N) parents of a chain: node i hangs off node i - 1, the root has -1."""
    return (torch.arange(num_nodes) - 1).unsqueeze(0).expand(batch, num_nodes).clone()


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """(B, N) parents (-1 at the root) -> (B, N, N) bool: [b, i, j] is True when j is i or an
    ancestor of i.

    Vectorised (it runs every decode step): start from "j is i or i's parent" and square that
    relation until it spans the deepest possible path (N - 1 edges), a handful of batched
    matmuls instead of a Python loop over nodes.
    """
    batch, n = parents.shape
    nodes = torch.arange(n, device=parents.device)
    step = (nodes.view(1, n, 1) == nodes.view(1, 1, n)) | (parents.unsqueeze(2) == nodes.view(1, 1, n))
    reach = step.float()  # (B, N, N)
    for _ in range(max(n - 1, 1).bit_length()):  # after k squarings: paths of up to 2**k edges
        reach = (torch.bmm(reach, reach) > 0).float()
    return reach.bool()


def depths(mask: torch.Tensor) -> torch.Tensor:
    """(B, N, N) `ancestor_mask` -> (B, N) depth of each node (root 0): how many ancestors it has.
    Takes the mask, not the parents, so a caller that needs both builds the mask once."""
    return mask.sum(dim=-1) - 1
