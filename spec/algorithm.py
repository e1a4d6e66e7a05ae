"""The speculative algorithms the engine knows, and what each one implies."""

from __future__ import annotations

import enum


class SpecAlgorithm(enum.Enum):
    NONE = "NONE"
    EAGLE = "EAGLE"
    EAGLE3 = "EAGLE3"
    STANDALONE = "STANDALONE"
    NGRAM = "NGRAM"

    @classmethod
    def from_name(cls, name: "str | SpecAlgorithm | None") -> "SpecAlgorithm":
        """Parse a user-given name case-insensitively; None means no speculation."""
        if name is None:
            return cls.NONE
        if isinstance(name, SpecAlgorithm):
            return name
        if not isinstance(name, str):
            raise ValueError(f"speculative_algorithm must be a string, got {type(name).__name__}")
        try:
            return cls[name.strip().upper()]
        except KeyError:
            valid = ", ".join(a.name for a in cls)
            raise ValueError(f"unknown speculative_algorithm {name!r}; valid names: {valid}") from None

    @property
    def is_eagle(self) -> bool:
        """EAGLE-family drafts consume target hidden states and carry their own between steps."""
        return self in (SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3)

    @property
    def needs_draft_model(self) -> bool:
        return self in (SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3, SpecAlgorithm.STANDALONE)

    @property
    def has_draft_kv(self) -> bool:
        """Whether the draft keeps its own KV cache (indexed by the shared slot ids)."""
        return self.needs_draft_model
