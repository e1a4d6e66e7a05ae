"""KV slot allocation: one token-level index space shared by target and draft."""

from __future__ import annotations

import torch


class SlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"kv_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() hands out low ids first
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor:
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} slots, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._in_use.update(out)
        return torch.tensor(out, dtype=torch.long)

    def free(self, slots: torch.Tensor | list[int]) -> None:
        ids = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        for s in ids:
            if s not in self._in_use:
                raise RuntimeError(f"slot {s} freed twice or never allocated")
            self._in_use.remove(s)
            self._free.append(s)
