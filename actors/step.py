"""One speculative step over a target runner and a drafter held in the same process: the
local engine and the Ray actor that hosts its drafter next to the target both run it."""

from __future__ import annotations

from spec.batch import BatchMeta, DraftExtendInput, DraftInput


def run_step(target, drafter, meta: BatchMeta, draft_input: DraftInput) -> tuple[DraftExtendInput, DraftInput]:
    """propose -> verify (or prefill) -> extend. The runners check the spec/ hidden-state
    contracts themselves, so they hold here as at an actor boundary."""
    verify = drafter.propose(meta, draft_input)
    ext = target.forward_step(meta, verify)
    return ext, drafter.extend(meta, ext)
