"""Prefix cache: a tree over token pairs mapping cached positions to KV slots.

A node at depth p + 1 stands for position p of every sequence whose tokens 0..p + 1 spell its
path, and owns the KV slot written for that position. It is keyed by the token at p + 1 as well
as the one at p, because the slot holds more than the target's K/V of token p: an EAGLE-family
draft's KV entry at position p pairs token p with token p + 1 (the draft's input at a position
is the next token with the target hidden state of that position). Keying by the pair keeps what
the draft needs at every cached position, so speculation costs no cache hits (SGLang's radix
hit rate fell from 97% to 40-53% with EAGLE, sgl-project/sglang#32459; vLLM drops the last cached
block, vllm#17137); the one position a match cannot cover is the last known token, which is
recomputed anyway for its logits.

Nodes are reference-counted while a request uses them (a reference holds the whole path to the
root) and evicted least-recently-used, leaves first, when the pool needs room. Plain Python,
one node per position: a match or insert costs one dict lookup per token.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("key", "slot", "parent", "children", "refs", "last_used")

    def __init__(self, key: tuple[int, int] | None, slot: int, parent: "_Node | None"):
        self.key, self.slot, self.parent = key, slot, parent
        self.children: dict[tuple[int, int], _Node] = {}
        self.refs = 0
        self.last_used = 0


class PrefixCache:
    """Cached KV positions by token path. `free_slots(slots)` gives evicted slots back to the pool."""

    def __init__(self, free_slots):
        self._free_slots = free_slots
        self.root = _Node(None, -1, None)
        self._clock = itertools.count(1)
        self.num_cached = 0  # nodes (= slots) in the tree
        self.num_locked = 0  # of which a running request references
        self.hit_tokens = 0  # prompt tokens served from the cache (metrics)
        self.query_tokens = 0  # prompt tokens looked up

    @property
    def num_evictable(self) -> int:
        return self.num_cached - self.num_locked

    def match(self, tokens: list[int], most: int) -> tuple[_Node, list[int]]:
        """The deepest node along `tokens` covering at most `most` positions, and the slots of
        positions 0.. of that path. Position p matches when tokens p and p + 1 both do."""
        node, slots, now = self.root, [], next(self._clock)
        for p in range(min(most, len(tokens) - 1)):
            child = node.children.get((tokens[p], tokens[p + 1]))
            if child is None:
                break
            node = child
            node.last_used = now
            slots.append(node.slot)
        return node, slots

    def lock(self, node: _Node) -> None:
        while node is not self.root:
            if node.refs == 0:
                self.num_locked += 1
            node.refs += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        while node is not self.root:
            node.refs -= 1
            if node.refs == 0:
                self.num_locked -= 1
            node = node.parent

    def insert(self, tokens: list[int], slots: list[int]) -> list[int]:
        """Cache positions 0..len(slots)-1 of `tokens` (which must extend one token past them).
        The tree takes the slots of positions it did not hold; returns the others (duplicates
        of cached positions, now the caller's to free)."""
        if len(tokens) <= len(slots):
            raise ValueError(f"insert: {len(slots)} positions need {len(slots) + 1} tokens, got {len(tokens)}")
        node, duplicates, now = self.root, [], next(self._clock)
        for p, slot in enumerate(slots):
            key = (tokens[p], tokens[p + 1])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, slot, node)
                self.num_cached += 1
            elif child.slot != slot:
                duplicates.append(slot)
            child.last_used = now
            node = child
        return duplicates

    def evict(self, n: int) -> int:
        """Free up to `n` slots of unreferenced positions, least recently used leaves first;
        returns how many were freed."""
        heap = [(leaf.last_used, id(leaf), leaf) for leaf in self._leaves() if leaf.refs == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key]
            freed.append(leaf.slot)
            self.num_cached -= 1
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        if freed:
            self._free_slots(freed)
        return len(freed)

    def clear(self) -> None:
        """Drop every unreferenced position (the runners' KV was lost: a restarted actor)."""
        self.evict(self.num_evictable)

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                yield node
